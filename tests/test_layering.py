"""The folders show the architecture, and the imports keep to it.

The plugin is `ops <- loss <- scheduler <- megatron`, with the project's bottom modules (`strict_config`, `timing`,
the lazy exports, the compiled extension). On top of it sit the GRPO runner and its command line
(`megatron_grpo.runner`) and the benchmarks (`megatron_grpo.bench`). Importing each plugin package, every module
of it, in a fresh interpreter loads no module of the runner or the benchmarks; `ops`, `loss` and the scheduler never
load Megatron-Core; the plugin's top level holds only plugin code; the package face exports only plugin names.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "megatron_grpo"
PLUGIN = ("megatron_grpo.ops", "megatron_grpo.loss", "megatron_grpo.scheduler", "megatron_grpo.megatron")
BOTTOM = ("megatron_grpo", "megatron_grpo._lazy", "megatron_grpo._C", "megatron_grpo.strict_config",
          "megatron_grpo.timing")
ON_TOP = ("megatron_grpo.runner", "megatron_grpo.bench")
WITHOUT_MEGATRON = ("megatron_grpo.ops", "megatron_grpo.loss", "megatron_grpo.scheduler")
# The layers below each plugin package: what it may import of the project besides the bottom modules.
BELOW = {
    "megatron_grpo.ops": (),
    "megatron_grpo.loss": ("megatron_grpo.ops",),
    "megatron_grpo.scheduler": ("megatron_grpo.ops", "megatron_grpo.loss"),
    "megatron_grpo.megatron": ("megatron_grpo.ops", "megatron_grpo.loss", "megatron_grpo.scheduler"),
}

# Imports the package and each of its modules (a package's names load lazily), then prints what was loaded.
IMPORT_ALL = """
import importlib, pkgutil, sys
package = importlib.import_module(sys.argv[1])
for module in pkgutil.walk_packages(getattr(package, "__path__", []), prefix=package.__name__ + "."):
    importlib.import_module(module.name)
print("\\n".join(sorted(sys.modules)))
"""


def _loaded_by_importing(package: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL, package], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


@pytest.mark.parametrize("package", PLUGIN)
def test_a_plugin_package_imports_only_the_layers_below_it(package):
    loaded = _loaded_by_importing(package)
    assert package in loaded
    ours = {module for module in loaded if _within(module, ("megatron_grpo",))}
    allowed = (package, *BELOW[package])
    assert sorted(module for module in ours if module not in BOTTOM and not _within(module, allowed)) == []
    if package in WITHOUT_MEGATRON:
        assert sorted(module for module in loaded if _within(module, ("megatron",))) == []


def test_the_top_level_holds_only_plugin_code():
    """Every module and package directly under megatron_grpo/ is a plugin package, a bottom module, one of the two
    packages on top, or `__main__` (the `python -m megatron_grpo` entry, one import of `runner.cli`)."""
    names = {path.stem if path.suffix == ".py" else path.name for path in PACKAGE.iterdir()
             if (path.suffix == ".py" or (path.is_dir() and (path / "__init__.py").exists()))}
    known = {name.split(".")[-1] for name in (*PLUGIN, *BOTTOM, *ON_TOP) if name != "megatron_grpo"}
    assert sorted(names - known - {"__init__", "__main__"}) == []
    assert (PACKAGE / "__main__.py").read_text().count("import") == 2  # sys, and runner.cli's console_main


def test_the_package_face_exports_only_plugin_names():
    face = importlib.import_module("megatron_grpo")
    for name in face.__all__:
        module = getattr(face, name).__module__
        assert _within(module, PLUGIN) or module in BOTTOM, (name, module)
