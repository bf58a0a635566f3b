"""The plugin stands without the runner: importing each plugin package, every module of it, in a fresh interpreter
loads no module of the runner (`grpo/`, `config.py`, the CLIs), and `ops`, `loss` and the scheduler never load
Megatron-Core.

The plugin is `ops <- loss <- scheduler <- megatron`, with the project's bottom modules (`strict_config`, `timing`,
the lazy exports, the compiled extension); everything else under `megatron_grpo` is the runner or a tool on top.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PLUGIN = ("megatron_grpo.ops", "megatron_grpo.loss", "megatron_grpo.scheduler", "megatron_grpo.megatron")
BOTTOM = ("megatron_grpo", "megatron_grpo._lazy", "megatron_grpo._C", "megatron_grpo.strict_config",
          "megatron_grpo.timing")
WITHOUT_MEGATRON = ("megatron_grpo.ops", "megatron_grpo.loss", "megatron_grpo.scheduler")

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


def _in_plugin(module: str) -> bool:
    return module in BOTTOM or any(module == package or module.startswith(package + ".") for package in PLUGIN)


@pytest.mark.parametrize("package", PLUGIN)
def test_a_plugin_package_imports_nothing_of_the_runner(package):
    loaded = _loaded_by_importing(package)
    assert package in loaded
    ours = {module for module in loaded if module == "megatron_grpo" or module.startswith("megatron_grpo.")}
    assert sorted(module for module in ours if not _in_plugin(module)) == []
    if package in WITHOUT_MEGATRON:
        assert sorted(module for module in loaded if module == "megatron" or module.startswith("megatron.")) == []
