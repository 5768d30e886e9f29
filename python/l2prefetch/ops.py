"""``l2prefetch::fork`` and ``l2prefetch::join``: the controller as PyTorch custom ops.

Code that :func:`torch.compile` traces cannot call a controller's C methods:
Dynamo does not trace into them, so each call would break the graph (or fail
under ``fullgraph=True``).  This module registers two operators that Dynamo
records in the graph instead::

    l2prefetch::fork(int handle, str point, int layer, SymInt batch, Tensor? after=None) -> ()
    l2prefetch::join(int handle, Tensor? after=None) -> ()

A graph cannot hold a Python object, so the ops name their controller by an
int *handle*: :func:`register` puts a weak reference to a controller in a
module-level registry and returns a new handle, :func:`unregister` takes it
out.  The registry never keeps a controller alive.  When the op runs, the
handle is looked up; a handle whose controller was garbage-collected,
unregistered or never registered raises :class:`LookupError` naming it.
Anything with ``fork(point, layer, batch)`` and ``join()`` that supports weak
references serves as a controller.  The op calls ``fork``/``join`` with
their default stream, torch's current one, and drops fork's answer.

:func:`l2prefetch.hooks.attach` registers its controller and switches to the
ops by itself while the model is being compiled.  Hand-written layer code::

    handle = l2prefetch.ops.register(controller)       # once
    ...
    h = self.o_proj(x)
    l2prefetch.ops.fork(handle, "oproj_down", layer_idx, batch, after=h)
    ...
    l2prefetch.ops.join(handle, after=logits)           # once, at the end of the step

(``torch.ops.l2prefetch.fork`` / ``join`` are the same ops.)

How they stay in place
----------------------
The ops are :func:`torch.library.custom_op` operators (``mutates_args=()``,
fake implementations that do nothing, so tracing needs no GPU and no live
controller) marked *effectful* with ``EffectType.ORDERED``
(``CustomOpDef.register_effect``; older spellings are tried where that is
missing).  That is how torch itself keeps ``aten::_print`` and torchbind
calls; PyTorch 2.11-2.13 have no ``Tag.side_effect``.  It gives:

* Dynamo records each call as a graph node in program order, without a
  graph break, and its dead-code elimination keeps them (``Node.is_impure``).
* AOTAutograd threads an effect token through them (``with_effects``), so
  functionalization, partitioning and DCE keep them and keep their order
  among themselves: every fork stays before the join after it.
* Inductor lowers them to ``EffectfulKernel`` calls, which it never removes
  and never reorders against one another.

A token orders the ops only among themselves, not against the compute
around them.  With no tensor argument at all, Inductor's post-grad pass
``reorder_for_locality`` sinks the compute towards its consumers and every
fork and the join end up at the top of the generated code, before the kernels
they should follow (seen on torch 2.13): the prefetch would then compete
with the work before it and the join would wait for it at once.  Hence
``after``: a tensor argument the op ignores, which makes it depend on the
tensor's producer, so it cannot run before it.  Pass the output of the work the fork follows
(the hooks pass the hooked module's output) and, to ``join``, the step's
final output.  Nothing pins the op before later work: Inductor may fuse a
later pointwise op into the kernel before a fork, which only shifts when the
prefetch starts; numerics never depend on it.  The alternatives pin harder
but cost kernels: declaring ``after`` mutated (``Tensor(a!)``) orders the op
before every later reader, but splits the fusions around it (an extra kernel
per fork in a CPU experiment on torch 2.13) and makes functionalization copy
the tensor wherever it cannot reinplace; a token tensor returned and threaded
through the model changes every call site.  ``backend="eager"`` and
``"aot_eager"`` keep program order exactly, ``after`` or not.

The ops are not tagged ``cudagraph_unsafe``: under ``mode="reduce-overhead"``
the forks are meant to be captured into the CUDA graph, as eager forks are
under ``torch.cuda.graph`` (tests/test_compile_gpu.py checks it on a GPU).
A capture must then hold a step's forks and its join: compile a step function,
or set ``torch._dynamo.config.wrap_top_frame`` so that ``torch.compile(model)``
traces the root's join hook in forward's graph.

Importing this module imports torch and registers the ops; ``import
l2prefetch`` does not import it (``hooks.attach`` does, lazily).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Optional

from ._torch import require

torch = require("l2prefetch.ops")

__all__ = ["fork", "join", "lookup", "register", "unregister"]

# handle -> weak reference to its controller.  A dead reference stays until
# unregister() so that the op can say the controller was collected; handles
# are never reused.
_registry: dict[int, weakref.ReferenceType] = {}
_handles = itertools.count(1)
_lock = threading.Lock()


def register(controller: Any) -> int:
    """Put a weak reference to ``controller`` in the registry; return its new handle.

    Every call returns a new handle, also for a controller already registered,
    so each user unregisters only its own.  Raises :class:`TypeError` for an
    object without ``fork``/``join`` or one that cannot be weakly referenced.
    """
    for method in ("fork", "join"):
        if not callable(getattr(controller, method, None)):
            raise TypeError(f"controller must have fork(point, layer, batch) and join(); "
                            f"{type(controller).__name__} has no {method}()")
    try:
        ref = weakref.ref(controller)
    except TypeError:
        raise TypeError(f"l2prefetch.ops.register: a {type(controller).__name__} cannot be "
                        f"weakly referenced (add '__weakref__' to its __slots__); the "
                        f"registry never keeps a controller alive") from None
    with _lock:
        handle = next(_handles)
        _registry[handle] = ref
    return handle


def unregister(handle: int) -> None:
    """Take ``handle`` out of the registry; an unknown handle is ignored."""
    with _lock:
        _registry.pop(handle, None)


def lookup(handle: int) -> Any:
    """The controller registered under ``handle``; :class:`LookupError` if unknown or gone."""
    ref = _registry.get(handle)
    if ref is None:
        raise LookupError(f"l2prefetch: no controller is registered under handle {handle!r} "
                          f"(never registered, or unregistered, e.g. by Attachment.detach()); "
                          f"register one with l2prefetch.ops.register(controller)")
    controller = ref()
    if controller is None:
        raise LookupError(f"l2prefetch: the controller registered under handle {handle} was "
                          f"garbage-collected; keep it alive while code that forks through "
                          f"it runs")
    return controller


def _fork(handle: int, point: str, layer: int, batch: int,
          after: Optional[torch.Tensor] = None) -> None:
    lookup(handle).fork(point, layer, batch)


def _join(handle: int, after: Optional[torch.Tensor] = None) -> None:
    lookup(handle).join()


fork = torch.library.custom_op(
    "l2prefetch::fork", _fork, mutates_args=(),
    schema="(int handle, str point, int layer, SymInt batch, Tensor? after=None) -> ()")
fork.__doc__ = """fork(handle, point, layer, batch, after=None)

Fork the prefetch of ``(point, layer, batch)`` on the controller registered
under ``handle`` (the controller's ``fork``, on torch's current stream).
``after``: a tensor the fork must follow in compiled code (see the module
docstring); it is not read."""

join = torch.library.custom_op(
    "l2prefetch::join", _join, mutates_args=(),
    schema="(int handle, Tensor? after=None) -> ()")
join.__doc__ = """join(handle, after=None)

Make torch's current stream wait for the prefetches forked on the controller
registered under ``handle`` (the controller's ``join``).  ``after``: a tensor
the join must follow in compiled code, such as the step's output."""


@fork.register_fake
def _fork_fake(handle: int, point: str, layer: int, batch: int,
               after: Optional[torch.Tensor] = None) -> None:
    return None


@join.register_fake
def _join_fake(handle: int, after: Optional[torch.Tensor] = None) -> None:
    return None


def _mark_effectful() -> None:
    """Register both ops as ORDERED-effectful with whichever API this torch has."""
    try:
        from torch._library.effects import EffectType as effect_type
    except ImportError:  # older torch
        from torch._higher_order_ops.effects import _EffectType as effect_type
    ordered = effect_type.ORDERED
    for op in (fork, join):
        overload = op._opoverload
        if hasattr(op, "register_effect"):
            op.register_effect(ordered)
        elif hasattr(torch.library, "_register_effectful_op"):
            torch.library._register_effectful_op(overload, ordered)
        else:
            from torch._higher_order_ops import effects

            if hasattr(effects, "_register_effectful_op"):
                effects._register_effectful_op(overload, ordered)
            else:
                effects.SIDE_EFFECTS[overload] = ordered  # type: ignore[attr-defined]
    # Belt and braces for FX dead-code elimination where Node.is_impure does
    # not consult the effect registry.
    side_effectful = getattr(torch.fx.node, "_side_effectful_functions", None)
    if isinstance(side_effectful, set):
        side_effectful.update(op._opoverload for op in (fork, join))


_mark_effectful()
