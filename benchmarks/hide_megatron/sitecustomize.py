"""Hides megatron-core from every Python process started with this folder on PYTHONPATH, as on a bare GPU image.

`import megatron` (or any `megatron.*`) then fails with ModuleNotFoundError, even where megatron-core is
installed. The benchmark test and the dry run of gpu_check.sh use it to check that `bench logprob` finishes
and reports the Megatron peer as missing. Child processes inherit PYTHONPATH, so they are covered too. (It
shadows any other sitecustomize module for those processes.)
"""

import importlib.abc
import sys


class _HideMegatron(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "megatron" or fullname.startswith("megatron."):
            raise ModuleNotFoundError(f"No module named {fullname!r} (hidden by {__file__})", name=fullname)
        return None


sys.meta_path.insert(0, _HideMegatron())
