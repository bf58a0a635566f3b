"""`define_op`: a `torch.library` operator from Python functions, with as few Python frames per call as the
dispatcher allows.

`torch.library.custom_op` wraps its implementation in checks and a `torch._dynamo.disable` frame, and its autograd
registration builds an `autograd.Function` on every call, under `no_grad` too: some 30 us per call on a CPU, more
than the logprob kernels take on a small batch. `define_op` registers the same pieces (a schema, an implementation
for every backend, a fake kernel, a backward) directly with the dispatcher:

- the implementation is the op's `CompositeExplicitAutograd` kernel (one Python frame);
- the autograd kernel is C++ where the compiled extension defines the op (csrc/logprob_op.cpp: the schema and a
  C++ autograd node, as torchvision registers its ops; `define_op` then checks that the schemas agree). Otherwise it
  is Python's: it builds an `autograd.Function` only when a gradient is wanted (grad mode on and a differentiable
  input requiring it), and else calls the implementation at once where nothing but the backend lies below autograd
  (eager), or redispatches where something does (a tracing mode, whose fake kernel must then run);
- the fake kernel is `torch.library.register_fake`'s, so `torch.compile(fullgraph=True)` traces the op as one node
  and `torch.library.opcheck` checks it as any custom op.

`IMPLEMENTATIONS` maps each op's qualified name to its implementation, as `torch._library.custom_ops.OPDEFS` does for
`custom_op`'s (tests run the bodies under a `TorchFunctionMode`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch._C import DispatchKey

IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {}
_LIBRARIES: list[torch.library.Library] = []  # a Library unregisters its kernels when collected
_BACKENDS = frozenset((DispatchKey.CPU, DispatchKey.CUDA))


def define_op(qualname: str, schema: str, implementation: Callable[..., Any], fake: Callable[..., Any], *,
              differentiable: Sequence[int] = (), setup_context: Callable[..., None] | None = None,
              backward: Callable[..., tuple] | None = None,
              non_differentiable_outputs: Sequence[int] = ()) -> torch._ops.OpOverload:
    """Defines `qualname` ("namespace::name") with `schema` ("(Tensor x, ...) -> Tensor") and returns its overload.
    Where a loaded C++ library has defined it already, checks that its schema is this one and registers the rest.

    With `backward`: `setup_context(ctx, inputs, output)` runs after forward, `backward(ctx, *grads)` returns one
    gradient per input; `differentiable` are the positions of the inputs that can require a gradient (the only ones
    the autograd kernel looks at), `non_differentiable_outputs` the outputs that never carry one. A C++ library that
    defines the op registers its autograd kernel too; these are then not used.
    """
    namespace, name = qualname.split("::")
    library = torch.library.Library(namespace, "FRAGMENT")
    _LIBRARIES.append(library)
    defined = torch._C._jit_get_schemas_for_operator(qualname)
    if not defined:
        library.define(name + schema)
    elif str(defined[0]) != str(torch._C.parse_schema(qualname + schema)):
        raise RuntimeError(f"the compiled extension defines {defined[0]}, but this code expects {qualname}{schema}: "
                           "rebuild megatron_grpo._C")
    library.impl(name, implementation, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=library)
    op = getattr(getattr(torch.ops, namespace), name).default
    IMPLEMENTATIONS[qualname] = implementation
    if backward is not None and not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Autograd"):
        library.impl(name, _autograd_kernel(op, implementation, tuple(differentiable), setup_context, backward,
                                            tuple(non_differentiable_outputs)), "Autograd", with_keyset=True)
    return op


def _autograd_kernel(op: torch._ops.OpOverload, implementation: Callable[..., Any], differentiable: tuple[int, ...],
                     setup_context: Callable[..., None] | None, backward: Callable[..., tuple],
                     non_differentiable_outputs: tuple[int, ...]) -> Callable[..., Any]:
    after_autograd = torch._C._after_autograd_keyset

    def below_autograd(keyset: torch._C.DispatchKeySet, args: tuple) -> Any:
        keyset = keyset & after_autograd
        if keyset.highestPriorityTypeId() in _BACKENDS:  # eager: the implementation is what the dispatcher would run
            return implementation(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset, *args)

    def forward(ctx, keyset, *args):
        output = below_autograd(keyset, args)
        if setup_context is not None:
            setup_context(ctx, args, output)
        if non_differentiable_outputs:
            ctx.mark_non_differentiable(*(output[i] for i in non_differentiable_outputs))
        return output

    def backward_with_keyset(ctx, *grads):
        return (None, *backward(ctx, *grads))

    # Named after the op, so is its autograd node (`<op>_autogradBackward`).
    Function = type(f"{op._opname}_autograd", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward_with_keyset)})

    def kernel(keyset: torch._C.DispatchKeySet, *args: Any) -> Any:
        if torch.is_grad_enabled() and any(args[i].requires_grad for i in differentiable):
            return Function.apply(keyset, *args)
        return below_autograd(keyset, args)

    return kernel
