"""``l2prefetch::fork`` and ``l2prefetch::join``: the controller as PyTorch custom ops.

Code that :func:`torch.compile` traces cannot call a controller's C methods
(each call would break the graph), so these two operators stand in for them::

    l2prefetch::fork(int handle, str point, int layer, SymInt batch, Tensor? after=None) -> ()
    l2prefetch::join(int handle, Tensor? after=None) -> ()

They name their controller by the int handle :func:`register` returns (a weak
reference: a handle whose controller was collected, unregistered or never
registered raises :class:`LookupError`).  Anything with ``fork(point, layer,
batch)`` and ``join()`` that supports weak references serves as a controller;
the ops call them with torch's current stream and drop fork's answer.
:func:`l2prefetch.hooks.attach` switches to the ops by itself while the model
is being compiled.  Hand-written layer code::

    handle = l2prefetch.ops.register(controller)       # once
    ...
    h = self.o_proj(x)
    l2prefetch.ops.fork(handle, "oproj_down", layer_idx, batch, after=h)
    ...
    l2prefetch.ops.join(handle, after=logits)           # once, at the end of the step

:func:`fork` and :func:`join` put the ops in the graph while torch.compile
traces and call the controller themselves when run eagerly (vLLM's
``enforce_eager``), as the hooks do, so a profile's controller can tell how the
step runs (:func:`l2prefetch.profile.check_step`).  ``torch.ops.l2prefetch.fork``
/ ``join`` called directly are the ops alone, which cannot tell compiled code
from an eager call: they count every fork as compiled.  Pass as
``after`` the output of the work the fork follows, and to ``join`` the step's
final output: it keeps Inductor from moving the op before that work.  How the
ops stay in place under Dynamo, AOTAutograd and Inductor, and why ``after``
rather than a mutated argument: python/l2prefetch/DESIGN.md, "How the custom
ops stay in place".

Importing this module imports torch and registers the ops; ``import
l2prefetch`` does not import it (``hooks.attach`` does, lazily).
"""

from __future__ import annotations

import itertools
import operator
import sys
import threading
import weakref
from typing import Any, Optional

from ._torch import require
from .controller import fork_activation, warms
from .plan import shown
from .profile import check_step

torch = require("l2prefetch.ops")

__all__ = ["check_after", "fork", "join", "lookup", "mark_ordered", "register", "traced",
           "unregister"]

# handle -> weak reference to its controller.  A dead reference stays until
# unregister() so that the op can say the controller was collected; handles
# are never reused, also across importlib.reload of this module (which runs it again
# in the same namespace: each of these four is kept from the first run).
_registry: dict[int, weakref.ReferenceType] = globals().get("_registry", {})
_handles = globals().get("_handles", itertools.count(1))
_lock = globals().get("_lock", threading.Lock())
#: Registered handle -> the compilations (Dynamo's compile ids; None: not known) that
#: traced its fork or join op: the fake implementations run while Dynamo traces, whether
#: or not the compiled call then succeeds (hooks.Attachment.detach reads it).  Emptied
#: when torch._dynamo.reset() has run since (:func:`_forget_before_reset`): it numbers
#: compilations from 0 again, and an old id would name a new compilation.
_traced: dict[int, set] = globals().get("_traced", {})


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


def _check_handle(handle: object) -> None:
    """A handle from a caller: an int itself (a bool or float that equals one is not)."""
    if type(handle) is not int:
        raise TypeError(f"handle must be the int l2prefetch.ops.register returned, got "
                        f"{type(handle).__name__} {shown(handle)}")


def check_after(after: object) -> None:
    """``after`` from a caller: a tensor or None, as the ops' schema takes it (eagerly too,
    so that an eager run refuses what compiled code would)."""
    if after is not None and not isinstance(after, torch.Tensor):
        raise TypeError(f"after must be a torch.Tensor or None (the output of the work the "
                        f"op follows), got {type(after).__name__}: pass one tensor of it, "
                        f"e.g. l2prefetch.hooks.first_tensor(output)")


def unregister(handle: int) -> None:
    """Take ``handle`` out of the registry; an unknown handle is ignored (one that is not
    an int is a TypeError)."""
    _check_handle(handle)
    with _lock:
        _registry.pop(handle, None)
        _traced.pop(handle, None)


def traced(handle: int) -> frozenset:
    """The compilations that traced a fork or join op of ``handle`` since it was
    registered (until :func:`unregister`), as Dynamo's compile ids (None where this
    torch names none); empty where none did."""
    _check_handle(handle)
    with _lock:
        _forget_before_reset()
        return frozenset(_traced.get(handle, ()))


def lookup(handle: int) -> Any:
    """The controller registered under ``handle``; :class:`LookupError` if unknown or gone,
    :class:`TypeError` where ``handle`` is not an int."""
    if type(handle) is not int:   # inline: the ops run this on every fork and join
        _check_handle(handle)
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


def _fork_with(handle: int, point: str, layer: int, batch: int, compiled: bool,
               after: Optional[torch.Tensor] = None) -> None:
    """Fork on the controller under ``handle``; a profile's controller first checks that
    the step runs as it was tuned (``compiled``: the op, in compiled code).  Eager, a
    controller whose fork takes it gets ``activation=after`` as the hooks pass it
    (:func:`l2prefetch.controller.fork_activation`), for a ``warm_activation`` table."""
    controller = lookup(handle)
    step = getattr(controller, "tuned_step", None)
    if step is not None:   # a profile's controller: tuned the way this step runs?
        check_step(step, compiled=compiled, controller=controller)
    if not compiled and after is not None and warms(controller):
        controller.fork(point, layer, batch,
                        activation=fork_activation(controller.device, after))
    else:
        controller.fork(point, layer, batch)


def _fork(handle: int, point: str, layer: int, batch: int,
          after: Optional[torch.Tensor] = None) -> None:
    _fork_with(handle, point, layer, batch, compiled=True)


def _join(handle: int, after: Optional[torch.Tensor] = None) -> None:
    lookup(handle).join()


_fork_op = torch.library.custom_op(
    "l2prefetch::fork", _fork, mutates_args=(),
    schema="(int handle, str point, int layer, SymInt batch, Tensor? after=None) -> ()")
_join_op = torch.library.custom_op(
    "l2prefetch::join", _join, mutates_args=(),
    schema="(int handle, Tensor? after=None) -> ()")


def fork(handle: int, point: str, layer: int, batch: int,
         after: Optional[torch.Tensor] = None) -> None:
    """Fork the prefetch of ``(point, layer, batch)`` on the controller registered
    under ``handle`` (the controller's ``fork``, on torch's current stream).

    While torch.compile traces, this puts the ``l2prefetch::fork`` op in the graph;
    called eagerly, it calls the controller itself, as the hooks do (a profile's
    controller refuses either where it was tuned the other way).  ``after``: a
    tensor the fork must follow in compiled code (see the module docstring); run
    eagerly, also the activation a ``warm_activation`` table reads last, as the hooks
    pass their module's output (compiled code does not read it)."""
    check_after(after)
    if torch.compiler.is_compiling():
        _check_handle(handle)   # eager, lookup checks it
        for name, value in (("layer", layer), ("batch", batch)):
            if isinstance(value, bool):   # the op's schema would take it as 0 or 1
                raise TypeError(f"{name} must be an int, got bool {value!r}")
        _fork_op(handle, point, layer, batch, after)
    else:
        _fork_with(handle, point, layer, batch, compiled=False, after=after)


def join(handle: int, after: Optional[torch.Tensor] = None) -> None:
    """Make torch's current stream wait for the prefetches forked on the controller
    registered under ``handle`` (the controller's ``join``): the ``l2prefetch::join``
    op while torch.compile traces, the controller's own call eagerly.  ``after``: a
    tensor the join must follow in compiled code, such as the step's output."""
    check_after(after)
    if torch.compiler.is_compiling():
        _check_handle(handle)   # eager, lookup checks it
        _join_op(handle, after)
    else:
        lookup(handle).join()


@_fork_op.register_fake
def _fork_fake(handle: int, point: str, layer: int, batch: int,
               after: Optional[torch.Tensor] = None) -> None:
    _note_traced(handle)
    _lower_off_the_data_path()
    return None


@_join_op.register_fake
def _join_fake(handle: int, after: Optional[torch.Tensor] = None) -> None:
    _note_traced(handle)
    _lower_off_the_data_path()
    return None


def _note_traced(handle: Any) -> None:
    """Note which compilation traced an op of ``handle`` (:func:`traced`)."""
    context = getattr(getattr(torch, "_guards", None), "CompileContext", None)
    compile_id = context.current_compile_id() if context is not None else None
    with _lock:
        _forget_before_reset()
        if type(handle) is int and handle in _registry:
            _traced.setdefault(handle, set()).add(compile_id)


def _reset_sentinel(args: Any) -> None:
    """A compile-start callback that does nothing: torch._dynamo.reset() clears every
    such callback, so its absence says a reset ran since it was put there."""


def _forget_before_reset() -> None:
    """Empty :data:`_traced` where torch._dynamo.reset() has run since the last look (the
    sentinel callback gone), then put the sentinel back; hold ``_lock``.  Where Dynamo
    was never imported nothing was compiled; where this torch has no callback handler,
    nothing is forgotten (and an id noted before a reset may name a later compilation)."""
    handler = getattr(sys.modules.get("torch._dynamo.callback"), "callback_handler", None)
    callbacks = getattr(handler, "start_callbacks", None)
    if not isinstance(callbacks, list) or any(cb is _reset_sentinel for cb in callbacks):
        return
    for compile_ids in _traced.values():
        compile_ids.clear()
    handler.register_start_callback(_reset_sentinel)


_lowered = False


def _lower_off_the_data_path() -> None:
    """Register the ops' Inductor lowering, once, when Inductor is in this process.

    Inductor lowers an op's tensor argument by realizing it: where ``after`` is
    a pointwise result that Inductor would otherwise inline into its consumer
    (a residual add into the RMSNorm after it, the input of a before-site),
    the consumer then reads the add back rounded to bf16 instead of computing
    on its float32 value, and the logits change (python/l2prefetch/DESIGN.md,
    "How the custom ops stay in place").  The lowering hands the op, in place
    of an ``after`` that no extern kernel made, the latest extern buffer that
    ``after`` reads: the op still follows the work that ``after`` waits for, and
    Inductor fuses as it would without the op.  Except where the next node
    realizes ``after`` anyway (``realized_next``: the op then takes it as it is)
    and where ``after`` reads no extern buffer (the op then gets an empty tensor
    on ``after``'s device).  Called from the fake implementations, which run
    while Dynamo and AOTAutograd trace, before Inductor lowers; importing
    Inductor here only when something already did keeps ``import
    l2prefetch.ops`` and eager use free of it.
    """
    global _lowered
    if _lowered or "torch._inductor" not in sys.modules:
        return
    with _lock:
        if _lowered:
            return
        from torch._inductor import ir
        from torch._inductor import lowering
        from torch._inductor.virtualized import V

        fork_op, join_op = _fork_op._opoverload, _join_op._opoverload
        user_lowerings = getattr(lowering, "user_lowerings", {})   # torch 2.13 has them
        # the node AOTAutograd wraps each effectful op in (None where this torch has none)
        with_effects = getattr(torch.ops.higher_order, "with_effects", None)

        def realized_next() -> bool:
            """Whether the node after the op being lowered, past getitems and other
            fork and join ops, is an effectful custom op with no lowering that reads
            ``after`` and mutates nothing (a planted spin): Inductor lowers it to a
            fallback kernel that realizes ``after`` in place.  Realizing it for the op
            instead, one node earlier, leaves every kernel as it was, and the op then
            follows ``after`` itself rather than the buffers it reads, which lets a
            before-site fork start after the fused kernel that makes its module's
            input (RESULTS, run 34).  Not any other reader: a fallback that is not
            effectful (an all-reduce) gets a copy of an unrealized ``after`` to meet
            its layout constraint, a mutating one a buffer Inductor then reinplaces,
            and one with a user lowering may fuse it."""
            node = V.graph.current_node
            if node is None or node.op != "call_function":
                return False
            args = node.args[2:] if node.target is with_effects else node.args
            mine = [a for a in (*args, *node.kwargs.values())
                    if isinstance(a, torch.fx.Node)
                    and isinstance(a.meta.get("val"), torch.Tensor)]
            if len(mine) != 1:
                return False
            reader = node.next
            while reader.op == "call_function":
                effectful = reader.target is with_effects
                target, args = (reader.args[1], reader.args[2:]) if effectful else (
                    reader.target, reader.args)
                if target is not operator.getitem and target not in (fork_op, join_op):
                    return (effectful and isinstance(target, torch._ops.OpOverload)
                            and mine[0] in args and not target._schema.is_mutable
                            and target not in user_lowerings
                            and (target not in lowering.lowerings
                                 or target in lowering.fallbacks))
                reader = reader.next
            return False

        def settled(after: Any) -> Any:
            """``after`` where a kernel Inductor never fuses made it (an extern kernel:
            cuBLAS's GEMM, attention, a fallback op) or where the next node realizes it
            anyway (:func:`realized_next`), else the latest such buffer that its
            computation reads, through the buffers Inductor may fuse (a pointwise or
            reduction kernel, a GEMM template with its epilogue); where it reads none,
            an empty tensor on its device.  That gives the op a device but no read: a
            deviceless op went before the CPU backend's pending fused kernel, after
            the frees of that kernel's inputs, and a graph input handed over instead
            would order the op before the kernel that mutates that input."""
            if not isinstance(after, ir.TensorBox) or realized_next():
                return after
            node = after.data
            while isinstance(node, ir.BaseView):
                node = node.data
            if isinstance(node, ir.StorageBox):
                node = node.data
            if isinstance(node, ir.ExternKernel):
                return after
            made = {buf.get_name(): i for i, buf in enumerate(V.graph.buffers)}
            latest, todo, seen = None, [node], set()
            while todo:
                for name in todo.pop().get_read_names():
                    if name in seen or name not in made:   # seen, or a graph input
                        continue
                    seen.add(name)
                    buf = V.graph.get_buffer(name)
                    if not isinstance(buf, ir.ExternKernel):
                        todo.append(buf)
                    elif latest is None or made[name] > made[latest]:
                        latest = name
            if latest is None:
                return lowering.empty_strided([0], [1], dtype=after.get_dtype(),
                                              device=after.get_device())
            return ir.TensorBox.create(V.graph.get_buffer(latest))

        @lowering.register_lowering(fork_op, type_promotion_kind=None)
        def _fork_lowering(handle: int, point: str, layer: int, batch: Any,
                           after: Any = None) -> Any:
            return ir.FallbackKernel.create(fork_op, handle, point, layer, batch,
                                            settled(after))

        @lowering.register_lowering(join_op, type_promotion_kind=None)
        def _join_lowering(handle: int, after: Any = None) -> Any:
            return ir.FallbackKernel.create(join_op, handle, settled(after))

        _lowered = True


def mark_ordered(op: Any) -> None:
    """Register custom op ``op`` (a ``torch.library.custom_op``) as ORDERED-effectful with
    whichever API this torch has, as fork and join are: Dynamo records it in program
    order, AOTAutograd threads an effect token through it, Inductor keeps it."""
    try:
        from torch._library.effects import EffectType as effect_type
    except ImportError:  # older torch
        from torch._higher_order_ops.effects import _EffectType as effect_type
    ordered, overload = effect_type.ORDERED, op._opoverload
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
        side_effectful.add(overload)


def _mark_effectful() -> None:
    """Register both ops as ORDERED-effectful."""
    for op in (_fork_op, _join_op):
        mark_ordered(op)


_mark_effectful()
