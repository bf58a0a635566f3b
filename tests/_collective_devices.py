"""A check, for CPU-only CI, that every collective gets tensors on the device its group's backend wants on GPUs.

On GPUs Megatron's groups (and the default group) are NCCL, which takes CUDA tensors only: a CPU tensor handed to a
collective raises "No backend type associated with device type cpu". Under gloo on the CPU every tensor is a CPU
tensor, so a run cannot see that mistake by devices. This module makes the mistake visible by provenance instead:

- `HostTensors`, a torch-function mode, marks the tensors that would live on the host in a GPU run: those made by
  a factory given no device (torch's default device, the CPU), by `.cpu()` or `.to("cpu")`, or by a factory given a
  host tensor's `.device`; a tensor computed from host tensors only is on the host too (a 0-d host tensor mixed into
  device tensors gives a device tensor, as CUDA allows). `.to(device)`, `.cuda()` and a factory given any other
  device (the layout's, a device tensor's) put a tensor on the accelerator.
- `checked_collectives` wraps `torch.distributed`'s collectives and records every host tensor handed to one on a
  group that is NCCL on GPUs (every group but Megatron's gloo groups), with the caller's file and function.

`torch.cuda.current_device()` names the accelerator on GPUs; on the CPU `megatron_grpo.megatron.cpu_support` makes it
return "cpu", a name the check takes for the accelerator's (Megatron places its gradient buffers and its checkpoint
flags there).

Object collectives (`all_gather_object`, `broadcast_object_list`) place their own tensors and are not checked.
"""

from __future__ import annotations

import traceback
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

HOST = "_collective_devices_on_host"
FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
             torch.linspace, torch.logspace, torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye,
             torch.empty_strided, torch.scalar_tensor, torch.tril_indices, torch.triu_indices}
LIKE_FACTORIES = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
                  torch.randn_like, torch.randint_like, torch.Tensor.new_zeros, torch.Tensor.new_ones,
                  torch.Tensor.new_empty, torch.Tensor.new_full, torch.Tensor.new_tensor,
                  torch.Tensor.new_empty_strided}
COLLECTIVES = ["all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
               "send", "recv", "isend", "irecv"]


class AcceleratorName(str):
    """The name `torch.cuda.current_device()` returns on the CPU under the check: "cpu", meaning the accelerator."""


def _accelerator_device() -> AcceleratorName:
    return AcceleratorName("cpu")


def on_host(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, HOST, False))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _mark(value: Any, host: bool, inputs: set[int]) -> None:
    """Marks the fresh tensors of an output (not the inputs an in-place op returns: their place is theirs)."""
    for tensor in _tensors(value):
        if id(tensor) not in inputs:
            setattr(tensor, HOST, host)


class HostTensors(TorchFunctionMode):
    """Marks host tensors as they are made (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._host_devices: dict[int, torch.device] = {}  # the `.device` objects handed out for host tensors

    def _is_host_device(self, device: Any) -> bool:
        if isinstance(device, AcceleratorName):
            return False
        return (isinstance(device, str) and device.split(":")[0] == "cpu") or id(device) in self._host_devices

    def __torch_function__(self, func: Callable, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is torch.Tensor.device:  # `tensor.device`
            device = func(*args, **kwargs)
            if on_host(args[0]):
                device = torch.device(device.type, device.index)  # a fresh object, remembered as a host device
                self._host_devices[id(device)] = device
            return device
        out = func(*args, **kwargs)
        inputs = {id(t) for t in _tensors((args, kwargs))}
        if func in FACTORIES:
            device = kwargs.get("device")
            _mark(out, device is None or self._is_host_device(device), inputs)
        elif func in LIKE_FACTORIES and "device" in kwargs:
            _mark(out, self._is_host_device(kwargs["device"]), inputs)
        elif func in (torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.to):
            host = self._placement(func, args, kwargs)
            if out is args[0] and host is not None and host != on_host(out):
                out = out.view_as(out)  # the same data, with its own place (the input keeps its own)
            if host is not None:
                setattr(out, HOST, host)
            else:
                _mark(out, on_host(args[0]), inputs)
        else:
            given = list(_tensors((args, kwargs)))
            if given:
                _mark(out, all(on_host(t) for t in given), inputs)
        return out

    def _placement(self, func: Callable, args: tuple, kwargs: dict) -> bool | None:
        """Whether `.cpu()` / `.cuda()` / `.to(...)` puts its result on the host (None: where its input is)."""
        if func is torch.Tensor.cpu:
            return True
        if func is torch.Tensor.cuda:
            return False
        for value in (*args[1:], kwargs.get("device"), kwargs.get("other")):
            if isinstance(value, torch.Tensor):
                return on_host(value)
            if isinstance(value, (str, torch.device, int)) and not isinstance(value, bool):
                return self._is_host_device(value)
        return None


@dataclass
class CollectiveLog:
    """What `checked_collectives` saw: every checked collective by caller, and the host tensors among them."""

    checked: Counter = field(default_factory=Counter)  # "file:function collective" -> calls
    host_tensors: list[str] = field(default_factory=list)  # one line per host tensor handed to a collective


def _caller() -> str:
    """The innermost caller outside torch and this module: `file:function`."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and frame.filename.rsplit("/", 1)[-1] != "_collective_devices.py":
            return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.name}"
    return "?"


def gloo_groups() -> set[int]:
    """Megatron's gloo groups (ids): the CPU tensors sent through these are where they belong."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return set()
    return {id(value) for name, value in vars(parallel_state).items()
            if "GLOO" in name.upper() and isinstance(value, dist.ProcessGroup)}


@contextmanager
def checked_collectives() -> Iterator[CollectiveLog]:
    """Inside the block, host tensors are marked and every collective's tensors are checked (see the docstring)."""
    log = CollectiveLog()
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def checking(name: str, collective: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            if id(group) not in gloo_groups():
                caller = _caller()
                log.checked[f"{caller} {name}"] += 1
                for tensor in _tensors((args, kwargs)):
                    if on_host(tensor):
                        log.host_tensors.append(f"{caller}: {name} got a host tensor {tuple(tensor.shape)} "
                                                f"{tensor.dtype}")
            return collective(*args, **kwargs)
        return wrapper

    from megatron_grpo.megatron import cpu_support

    cpu_device = cpu_support._cpu_device
    cpu_support._cpu_device = _accelerator_device  # what apply_cpu_support installs, if it runs in the block
    if torch.cuda.current_device is cpu_device:  # already installed
        torch.cuda.current_device = _accelerator_device
    for name, collective in originals.items():
        setattr(dist, name, checking(name, collective))
    try:
        with HostTensors():
            yield log
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)
        cpu_support._cpu_device = cpu_device
        if torch.cuda.current_device is _accelerator_device:  # cpu_support's stand-in, as it installs it
            torch.cuda.current_device = cpu_device
