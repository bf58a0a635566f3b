"""The dotted config keys known to NeMo-RL's GRPO family, from a git directory of NVIDIA-NeMo/RL at one commit:
the list `plan --nemo-rl-config` checks a config against (`megatron_grpo/runner/nemo_rl_known_keys.txt`).

    python -m megatron_grpo.runner.nemo_rl_keys GIT_DIR [COMMIT] > megatron_grpo/runner/nemo_rl_known_keys.txt

It imports nothing of NeMo-RL (no torch, no pydantic): it reads NeMo-RL's sources with `ast` and its example YAMLs
with PyYAML, straight out of the git object store (`git show COMMIT:path`). Sources of known keys (each line says
which):
- schema: the fields of the pydantic models and TypedDicts reachable from NeMo-RL's two GRPO `MasterConfig`s
  (`nemo_rl/algorithms/grpo.py`, `nemo_rl/algorithms/single_controller_utils/config.py`), following the annotations
  (Optional, `|`, NotRequired, Annotated, discriminated unions, `dict[str, Model]` as `<name>.*.<field>`) and base
  classes;
- exemplar: every leaf of the GRPO example YAMLs, each `examples/**.yaml` outside `examples/configs/recipes/` with a
  top-level `grpo:` section (NeMo-RL's TypedDicts do not list every key its code reads; its example YAMLs carry the
  full set). `exemplar-unread` marks such a key whose name no `nemo_rl/**.py` mentions: known, but without effect;
- free (`prefix.*`): any sub-key is accepted: schema fields typed `dict[str, Any]` / `Any`, and `FREE_FORM` below,
  sections passed through to another library or keyed by user-chosen names, written by hand from NeMo-RL's code.
The recipes (`examples/configs/recipes/**`) are not a source: they are what gets checked.
"""

from __future__ import annotations

import ast
import subprocess
import sys

import yaml

ROOTS = (
    ("nemo_rl/algorithms/grpo.py", "MasterConfig"),
    ("nemo_rl/algorithms/single_controller_utils/config.py", "MasterConfig"),
)

# Sub-trees whose keys are not NeMo-RL's to define (passed through to vLLM / Megatron Bridge / HF / Ray / a
# logger backend / NeMo-Gym / a dataset class), written as `prefix.*`. Reason in the comment.
FREE_FORM = {
    "env.*": "per-environment configs; MasterConfig.env is dict[str, Any]",
    "data.*": "dataset-class specific keys (ResponseDatasetConfig variants, data.train may be a list)",
    "logger.*": "logger backends' own kwargs (wandb/mlflow/tensorboard/swanlab/gpu_monitoring)",
    "checkpointing.*": "CheckpointingConfig + pretrained_checkpoint/format options; no say in the plan",
    "cluster.*": "cluster layout; no say in the plan",
    "data_plane.*": "TransferQueue adapter options",
    "policy.generation.*": "vLLM/SGLang/TRT-LLM/Megatron/Dynamo generation configs (vllm_cfg, vllm_kwargs, ...)",
    "policy.hf_config_overrides.*": "Hugging Face config attributes",
    "policy.megatron_cfg.*": "Megatron Bridge provider / optimizer / scheduler / DDP attributes",
    "policy.dtensor_cfg.*": "DTensor / Automodel kwargs (automodel_kwargs, lora_cfg, ...)",
    "policy.tokenizer.*": "tokenizer + chat template kwargs",
    "policy.optimizer.*": "torch optimizer name + kwargs",
    "policy.scheduler.*": "torch schedulers (a list or a milestones dict)",
    "policy.draft.*": "Eagle draft model",
    "policy.reward_model_cfg.*": "reward model",
    "policy.pretrained_checkpoint.*": "checkpoint import",
    "policy.dynamic_batching.*": "microbatching",
    "policy.sequence_packing.*": "microbatching",
    "on_policy_distillation.teacher_model_by_agent_name.*": "alias -> model name map (dict[str, str])",
    "on_policy_distillation.non_colocated_teachers.*": "TeacherResourceConfig folds unknown keys into "
                                                       "megatron_cfg_overrides (extra='allow' by design)",
    "reward_penalties.token_ids.*": "token id lists",
}
# Maps keyed by user-chosen names (agents, env vars, environments): their entries are not keys to list.
NAME_MAPS = ("env.", "on_policy_distillation.teacher_model_by_agent_name.",
             "on_policy_distillation.non_colocated_teachers.teacher_overrides.", "policy.generation.vllm_cfg.env_vars.",
             "policy.megatron_cfg.env_vars.", "policy.dtensor_cfg.env_vars.")
# Sections whose unknown keys the plan should report (the ones it reads, and their siblings): see the report.
CHECKED = ("grpo", "loss_fn", "async_rl", "on_policy_distillation", "reward_penalties", "policy")

TYPING_WRAPPERS = {"Optional", "NotRequired", "Required", "Annotated", "Union", "ClassVar", "Final"}
FREE_TYPES = {"Any", "dict", "Dict", "Mapping", "object"}


def git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True,
                          text=True).stdout


class Index:
    """Every class and module-level alias of nemo_rl/**.py at the commit. A name is resolved in the module that
    uses it: its own definitions first, then its `from nemo_rl... import Name` imports, then the only definition
    of that name anywhere (several classes share a name: MasterConfig, AdvEstimatorConfig of grpo vs ppo)."""

    def __init__(self, git_dir: str, commit: str):
        self.classes: dict[str, list[tuple[str, ast.ClassDef]]] = {}
        self.aliases: dict[tuple[str, str], ast.expr] = {}
        self.imports: dict[str, dict[str, str]] = {}  # module path -> {local name: defining module path}
        paths = [p for p in git(git_dir, "ls-tree", "-r", "--name-only", commit, "nemo_rl").split()
                 if p.endswith(".py")]
        self.paths = set(paths)
        self.mentioned: set[str] = set()  # every string constant, attribute and keyword name in nemo_rl/**.py
        for path in paths:
            tree = ast.parse(git(git_dir, "show", f"{commit}:{path}"))
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    self.mentioned.add(node.value)
                elif isinstance(node, ast.Attribute):
                    self.mentioned.add(node.attr)
                elif isinstance(node, ast.keyword) and node.arg:
                    self.mentioned.add(node.arg)
            imports = self.imports.setdefault(path, {})
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nemo_rl"):
                    base = node.module.replace(".", "/")
                    target = f"{base}.py"
                    for alias in node.names:
                        imports[alias.asname or alias.name] = target
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, []).append((path, node))
                elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0],
                                                                                              ast.Name):
                    self.aliases[(path, node.targets[0].id)] = node.value
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
                    self.aliases[(path, node.target.id)] = node.value

    def resolve(self, name: str, module: str) -> tuple[str, str] | None:
        """(defining module, name) of a class or alias named `name` as seen from `module`."""
        for _ in range(4):  # follow re-exports through package __init__ files
            if any(p == module for p, _ in self.classes.get(name, ())) or (module, name) in self.aliases:
                return module, name
            source = self.imports.get(module, {}).get(name)
            if source is None:
                break
            candidates = [source, source[:-3] + "/__init__.py"]
            module = next((c for c in candidates if c in self.paths), source)
        found = self.classes.get(name, [])
        if len(found) == 1:
            return found[0][0], name
        aliased = [p for (p, n) in self.aliases if n == name]
        if len(aliased) == 1 and not found:
            return aliased[0], name
        return None

    def cls(self, name: str, module: str) -> tuple[str, ast.ClassDef] | None:
        where = self.resolve(name, module)
        if where is None:
            return None
        for path, node in self.classes.get(name, ()):
            if path == where[0]:
                return path, node
        return None

    def alias(self, name: str, module: str) -> tuple[str, ast.expr] | None:
        where = self.resolve(name, module)
        if where is None or where not in self.aliases:
            return None
        return where[0], self.aliases[where]

    def fields(self, module: str, node: ast.ClassDef, seen: set[str]) -> dict[str, tuple[str, ast.expr]]:
        out: dict[str, tuple[str, ast.expr]] = {}
        for base in node.bases:
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            if name and name not in ("BaseModel", "TypedDict") and name not in seen:
                base_cls = self.cls(name, module)
                if base_cls is not None:
                    out.update(self.fields(base_cls[0], base_cls[1], seen | {name}))
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if not stmt.target.id.startswith("_") or stmt.target.id == "_target_":
                    out[stmt.target.id] = (module, stmt.annotation)
        return out


def type_targets(index: Index, module: str, ann: ast.expr) -> tuple[list, bool, list]:
    """((module, class) models the annotation may hold, whether it is free-form, models held as dict values)."""
    models: list[tuple[str, str]] = []
    dict_values: list[tuple[str, str]] = []
    free = False

    def walk(node: ast.expr, mod: str) -> None:
        nonlocal free
        if isinstance(node, ast.Constant) and isinstance(node.value, str):  # forward reference
            try:
                walk(ast.parse(node.value, mode="eval").body, mod)
            except SyntaxError:
                pass
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            walk(node.left, mod)
            walk(node.right, mod)
        elif isinstance(node, (ast.Name, ast.Attribute)):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name in FREE_TYPES:
                free = True
                return
            found = index.cls(name, mod)
            if found is not None:
                models.append((found[0], name))
                return
            aliased = index.alias(name, mod)
            if aliased is not None:
                walk(aliased[1], aliased[0])
        elif isinstance(node, ast.Subscript):
            head = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
            args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if head in TYPING_WRAPPERS:
                for arg in (args[:1] if head == "Annotated" else args):
                    walk(arg, mod)
            elif head in ("dict", "Dict", "Mapping"):
                if len(args) > 1:
                    inner, _, _ = type_targets(index, mod, args[1])
                else:
                    inner = []
                if inner:
                    dict_values.extend(inner)
                else:
                    free = True
            # list[...], tuple[...], Literal[...], set[...]: a leaf

    walk(ann, module)
    return models, free, dict_values


def schema_keys(index: Index) -> tuple[set[str], set[str]]:
    keys: set[str] = set()
    free: set[str] = set()

    def visit(prefix: str, module: str, cls_name: str, stack: tuple[str, ...]) -> None:
        found = index.cls(cls_name, module)
        if found is None or (found[0], cls_name) in stack:
            return
        path, node = found
        for name, (mod, ann) in index.fields(path, node, {cls_name}).items():
            dotted = f"{prefix}.{name}" if prefix else name
            keys.add(dotted)
            models, is_free, dict_values = type_targets(index, mod, ann)
            if is_free:
                free.add(f"{dotted}.*")
            for model_mod, model in models:
                visit(dotted, model_mod, model, stack + ((path, cls_name),))
            for model_mod, model in dict_values:
                keys.add(f"{dotted}.*")
                visit(f"{dotted}.*", model_mod, model, stack + ((path, cls_name),))

    for path, name in ROOTS:
        visit("", path, name, ())
    return keys, free


def leaf_keys(data, prefix: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(data, dict):
        for key, value in data.items():
            dotted = f"{prefix}.{key}" if prefix else str(key)
            out.add(dotted)
            out |= leaf_keys(value, dotted)
    return out


def exemplar_keys(git_dir: str, commit: str) -> tuple[set[str], list[str]]:
    keys: set[str] = set()
    files = []
    for path in git(git_dir, "ls-tree", "-r", "--name-only", commit, "examples").split():
        if not path.endswith((".yaml", ".yml")) or path.startswith("examples/configs/recipes/"):
            continue
        try:
            data = yaml.safe_load(git(git_dir, "show", f"{commit}:{path}"))
        except yaml.YAMLError:
            continue
        if isinstance(data, dict) and "grpo" in data:
            files.append(path)
            data.pop("defaults", None)
            keys |= {k for k in leaf_keys(data) if not k.startswith(NAME_MAPS)}
    return keys, files


def known_keys(git_dir: str, commit: str) -> dict[str, set[str]]:
    index = Index(git_dir, commit)
    schema, schema_free = schema_keys(index)
    exemplar, files = exemplar_keys(git_dir, commit)
    unread = {k for k in exemplar - schema if k.rpartition(".")[2] not in index.mentioned}
    return {"schema": schema, "schema_free": schema_free, "exemplar": exemplar, "files": set(files), "unread": unread}


def main(argv: list[str]) -> int:
    git_dir = argv[1]
    commit = argv[2] if len(argv) > 2 and not argv[2].startswith("--") else "HEAD"
    commit = git(git_dir, "rev-parse", commit).strip()
    found = known_keys(git_dir, commit)
    free = found["schema_free"] | set(FREE_FORM)
    print("# Dotted config keys known to NeMo-RL's GRPO family (legacy grpo_train / async_grpo_train / "
          "grpo_train_sync / SingleController).")
    print(f"# Generated by megatron_grpo/runner/nemo_rl_keys.py from NVIDIA-NeMo/RL commit {commit}.")
    print("# Columns: key<TAB>source. source: schema (pydantic/TypedDict field), exemplar (a leaf of a GRPO exemplar "
          "YAML), exemplar-unread (in an exemplar YAML, but its name appears nowhere in nemo_rl/**.py: no effect), "
          "free (any sub-key accepted).")
    print("# async_rl.sampler: with name: custom, extra keys are forwarded to the custom class (not checkable).")
    print("# A config key is known when it is listed, or a `prefix.*` line covers it, or it matches a `x.*.y` line.")
    print(f"# Sections to check for unknown keys: {', '.join(CHECKED)} (the rest is free-form for the plan).")
    print("# Exemplar YAMLs read: " + ", ".join(sorted(found["files"])))
    rows = {}
    for key in found["exemplar"]:
        rows[key] = "exemplar" if key not in found["unread"] else "exemplar-unread (no nemo_rl code names it)"
    for key in found["schema"]:
        rows[key] = "schema" if key not in rows else "schema+exemplar"
    for key in free:
        rows[key] = "free" + (f" ({FREE_FORM[key]})" if key in FREE_FORM else " (schema: dict/Any)")
    for key in sorted(rows):
        print(f"{key}\t{rows[key]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
