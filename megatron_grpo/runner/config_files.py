"""Reading YAML config files: `read_yaml` (one file, strictly) and `read_yaml_with_defaults` (a file on top of the
`defaults:` files it names). The one loader of this project's configs (`load_config`) and of NeMo-RL's (`plan
--nemo-rl-config`).

Inheritance is NeMo-RL's (its `load_config`, OmegaConf's merge for plain data): `defaults:` is a path or a list of
paths, relative to the file that names them; they are loaded recursively and merged in order, then the file itself
on top. Mappings merge key by key, anything else (lists included) is replaced, and a mapping holding
`_override_: true` replaces its parent's mapping whole: at any depth in this project's configs, and only in a
top-level section for NeMo-RL's (`nested_override=False`: its `merge_with_override` reads the flag on the
override's top-level keys only, and a nested `_override_` stays a key of its own, the section merged as usual).
A parent that cannot be read, or a `defaults:` chain that comes back to a file it passed, is a ConfigError naming
the files. Never imports torch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterator, Mapping

import yaml

from megatron_grpo.strict_config import ConfigError, join_key


class ConfigLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """PyYAML's safe loader (its libyaml parser where PyYAML has one: a NeMo-RL recipe's chain of six files parses in
    0.1 s instead of 1.2 s), reading numbers as OmegaConf (NeMo-RL's and Hydra's loader) and YAML 1.2 do: `1e-3`,
    `5e-7` and `1E+3` are floats. PyYAML follows YAML 1.1, whose floats need a dot and a signed exponent
    (`1.0e-3`), and reads `1e-3` as a string. Everything else, `.inf` and `.nan` included, resolves as before."""


ConfigLoader.add_implicit_resolver(  # copies the inherited resolvers first: PyYAML's loaders are left as they are
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def read_yaml(path: str | os.PathLike) -> Any:
    """The parsed YAML file (`ConfigLoader`); an unreadable file, invalid YAML or a key given twice is a
    ConfigError naming it.

    PyYAML silently keeps the last of two equal keys, so a duplicated key would hide the value the user reads
    first; the node tree is checked for duplicates before anything is built from it. Non-finite numbers load
    (`.inf`), and every numeric key of a config rejects them.
    """
    name = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as stream:
            text = stream.read()
    except OSError as err:
        raise ConfigError(f"{name}: cannot read the config file: {err.strerror or err}") from err
    try:
        duplicates = list(_duplicate_keys(yaml.compose(text, Loader=ConfigLoader), ""))
        if duplicates:
            raise ConfigError([f"{name}: {problem}" for problem in duplicates])
        return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as err:
        raise ConfigError(f"{name}: not valid YAML: {err}") from err


def _duplicate_keys(node: yaml.Node | None, path: str) -> Iterator[str]:
    """Yields one line per key that a mapping of the YAML node tree gives more than once."""
    if isinstance(node, yaml.MappingNode):
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            line = key_node.start_mark.line + 1
            if key in first_line:
                yield f"{join_key(path, key)}: key given twice (lines {first_line[key]} and {line})"
            else:
                first_line[key] = line
            yield from _duplicate_keys(value_node, join_key(path, key))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            yield from _duplicate_keys(item, f"{path}[{index}]")


def read_yaml_with_defaults(path: str | os.PathLike, *, nested_override: bool = True
                            ) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The merged mapping of a YAML file and its `defaults:` parents (without the `defaults` key), and the files
    merged into it, parents first. `nested_override=False`: `_override_` only in top-level sections (NeMo-RL's)."""
    files: list[str] = []
    merged = _load_with_defaults(Path(path), files, chain=(), nested_override=nested_override)
    return merged, tuple(files)


def merge(base: Mapping[str, Any], override: Mapping[str, Any], *, nested_override: bool = True,
          _top: bool = True) -> dict[str, Any]:
    """OmegaConf.merge's rules for plain data: mappings merge key by key, everything else is replaced, and a
    mapping that holds `_override_: true` replaces the base's mapping whole (below the top level only with
    `nested_override`)."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and value.get("_override_") is True and (_top or nested_override):
            merged[key] = {k: v for k, v in value.items() if k != "_override_"}
        elif isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge(merged[key], value, nested_override=nested_override, _top=False)
        else:
            merged[key] = value
    return merged


def _load_with_defaults(path: Path, files: list[str], chain: tuple[Path, ...], nested_override: bool
                        ) -> dict[str, Any]:
    resolved = path.resolve()
    if resolved in chain:
        raise ConfigError(f"{path}: `defaults:` loop through {' -> '.join(map(str, (*chain, resolved)))}")
    data = read_yaml(path)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    data = dict(data)
    parents = data.pop("defaults", None)
    if isinstance(parents, str):
        parents = [parents]
    if parents is not None and not (isinstance(parents, list) and all(isinstance(p, str) for p in parents)):
        raise ConfigError(f"{path}: defaults: expected a path or a list of paths, got {parents!r}")
    merged: dict[str, Any] = {}
    for parent in parents or []:
        parent_path = Path(parent) if os.path.isabs(parent) else path.parent / parent
        if not parent_path.is_file():
            raise ConfigError(f"{path}: defaults: {parent}: no such file ({parent_path})")
        merged = merge(merged, _load_with_defaults(parent_path, files, (*chain, resolved), nested_override),
                       nested_override=nested_override)
    files.append(str(path))
    return merge(merged, data, nested_override=nested_override)
