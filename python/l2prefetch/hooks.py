"""Fork and join from forward hooks, for models that are plain ``nn.Module`` trees.

:func:`attach` puts a forward hook on each module where a point forks, ahead of
the module's other forward hooks; the hook reads the decode batch from the
module's input and calls ``controller.fork(point, layer, batch)`` once the
module's own kernels are queued (the controller records its event there, so the
prefetch starts after them) and before whatever its other hooks queue (a
tensor-parallel all-reduce done in a hook, say: the window an inline fork then
runs beside).  A site ``(module, layer, "before")`` forks from a forward
pre-hook instead, ahead of the module's other pre-hooks, so the prefetch starts
before the module's kernels (:data:`l2prefetch.mechanisms.SITE_HOOKS`): the
place for a window that a module's forward begins with.  "Ahead" holds for the
hooks registered on the module before :func:`attach`; torch runs global module
hooks first, and one registered later ahead of the others (a second
:func:`attach`'s, or torch's ``prepend=True``) goes ahead.
A forward hook on the root calls ``controller.join()`` at the end of the step.
Any object with ``fork(point, layer, batch) -> bool`` and ``join()`` serves as
the controller.

Under :func:`torch.compile` the hooks call the custom ops
``l2prefetch::fork`` / ``l2prefetch::join`` (:mod:`l2prefetch.ops`) instead,
so the forks and the join become graph nodes (no graph break, also with
``fullgraph=True``); each passes its module's output as ``after`` so that
compiled code keeps it behind the work it follows.  The switch is
``torch.compiler.is_compiling()``, which Dynamo folds to True while tracing
and which adds about 70 ns per hook in eager mode.  :func:`attach` registers
the controller with :func:`l2prefetch.ops.register` (a weak reference) and
:meth:`Attachment.detach` unregisters it.

Hooks cost host time on every call, so each is a closure over its point,
layer and the bound ``fork``: it looks nothing up and allocates nothing
beyond what torch's hook dispatch does.

``L2PREFETCH_DISABLE=1`` (or ``true``, ``yes``, ``on``) makes :func:`attach`
attach nothing, which turns prefetching off without a code change.
"""

from __future__ import annotations

import logging
import operator
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional, Protocol, Union

from . import _C, _torch
from .mechanisms import DEFAULT_SITE_HOOK, SITE_HOOKS, site_hook_choices
from .model_paths import compiled_module
from .controller import fork_activation, warms
# The package's one disabled(), also public here: attach() is what it turns off.
from .disable import disabled
from .plan import MAX_LAYER, shown
from .profile import check_step, step_compiled

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Attachment", "BatchFn", "Controller", "Points", "Site", "attach", "attached",
           "default_batch", "disabled", "first_tensor", "register_site_hook"]

logger = logging.getLogger(__name__)


class Controller(Protocol):
    """What :func:`attach` needs of a controller (a PrefetchController has both)."""

    def fork(self, point: str, layer: int, batch: int, /) -> object: ...

    def join(self) -> object: ...


#: A fork site: a module and the decoder layer index its forks carry (0..65535, a
#: controller's layers), and optionally where the hook runs
#: (:data:`l2prefetch.mechanisms.SITE_HOOKS`; default ``"after"``).
Site = Union[tuple["torch.nn.Module", int], tuple["torch.nn.Module", int, str]]
#: ``batch_fn(module, args, kwargs) -> batch``: overrides how a hook reads the batch;
#: a batch of 0 (or None) skips the fork.  It must return an int >= 0 (or an index such
#: as a numpy int); anything else is a TypeError or ValueError naming it and the site.
BatchFn = Callable[["torch.nn.Module", tuple, dict], Optional[int]]

_disabled_logged = False


class Attachment:
    """The hooks one :func:`attach` added; :meth:`detach` removes them all.

    Also a context manager that detaches on exit.  :meth:`join` calls the
    controller's ``join()`` (for servers that end a step without a forward of
    the hooked root); it keeps working after detach, since prefetches forked
    before it may still be pending.  In code being compiled it is the
    ``l2prefetch::join`` op (until detach, which unregisters the controller).
    """

    __slots__ = ("_controller", "_handles", "_op_handle", "_frames", "sites")

    def __init__(self, controller: Any = None, handles: Sequence[Any] = (),
                 sites: Sequence[tuple[str, int, Any]] = (),
                 op_handle: Optional[int] = None, frames: Any = None) -> None:
        self._controller = controller
        # (the forwards whose frames can run the hooks, the compiled frames of them at
        # attach): see _forwards
        self._frames = frames
        self._handles = list(handles)
        #: The controller's handle in :mod:`l2prefetch.ops`' registry, or None.
        self._op_handle = op_handle
        #: ``(point, layer, module)`` for each fork hook, in attach order; empty once
        #: detached (it would keep the modules, and their weights, alive).
        self.sites: tuple[tuple[str, int, Any], ...] = tuple(sites)

    @property
    def attached(self) -> bool:
        """True while hooks are in place."""
        return bool(self._handles)

    @property
    def op_handle(self) -> Optional[int]:
        """The controller's handle for :mod:`l2prefetch.ops` while attached, else None."""
        return self._op_handle

    def join(self, after: Any = None) -> None:
        """Make the main stream wait for the prefetches forked so far.

        In compiled code this is ``l2prefetch::join``; ``after`` (a tensor,
        such as the step's output) keeps it behind that tensor's producer.
        """
        if self._controller is None:
            return
        if after is not None:   # a tensor, as the op takes it: refused eagerly too
            _ops().check_after(after)
        if self._op_handle is not None:
            import torch

            if torch.compiler.is_compiling():
                torch.ops.l2prefetch.join(self._op_handle, after)
                return
        self._controller.join()

    def detach(self) -> None:
        """Remove every hook this attachment added and unregister the controller.

        A second call does nothing.
        """
        handles = list(self._handles)
        for handle in handles:   # interrupted mid-way: a second detach removes the rest
            handle.remove()      # (removing a removed hook again does nothing)
        self._handles = []
        self.sites = ()
        frames, self._frames = self._frames, None
        op_handle, self._op_handle = self._op_handle, None
        traced = _ops().traced(op_handle) if op_handle is not None else frozenset()
        if frames is not None and handles and traced:
            # frames compiled while the hooks were on by a compilation that traced one of
            # their ops (its compile id): they guard on the hooks, and a later attach's
            # make Dynamo trace anew.  Where this torch names no compilation (an op's or a
            # frame's id None), every frame compiled meanwhile counts, another instance's
            # without hooks too.  Where a graph break puts every hooked module in the
            # forward's resume frames, its own frame traced no op and is not counted: a
            # later attach warns although its hooks run there (a warning too many, never
            # one too few; tests/test_compile_ops.py).
            forwards, before = frames
            _hooked_frames.update(
                code for code, made_by, _ in _entries_of(forwards)
                if code not in before
                and (made_by is None or made_by in traced or None in traced))
        if op_handle is not None:
            _ops().unregister(op_handle)

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.detach()

    def __repr__(self) -> str:
        state = "attached" if self.attached else "detached"
        return f"<Attachment {state}, {len(self.sites)} fork sites>"


def first_tensor(value: Any) -> Any:
    """The first tensor in a module's output or input (a tensor, or tuples, lists and
    mappings of them, four levels deep), or None: what the hooks pass as ``after``."""
    import torch

    return _first_tensor(value, torch.Tensor)


def _first_tensor(value: Any, tensor: type, depth: int = 0) -> Any:
    """The first tensor in a module output (a tensor, tuple, list or mapping), or None."""
    if isinstance(value, tensor):
        return value
    if depth < 4:
        items: Iterable[Any]
        if isinstance(value, (tuple, list)):
            items = value
        elif isinstance(value, Mapping):
            items = value.values()
        else:
            return None
        for item in items:
            found = _first_tensor(item, tensor, depth + 1)
            if found is not None:
                return found
    return None


def _unregistered(name: str) -> Callable[..., None]:
    """Stands in for the ops where the controller could not be registered."""
    def refuse(*args: Any) -> None:
        raise TypeError(f"l2prefetch: a {name} cannot be weakly referenced, so attach() could "
                        f"not register it for the l2prefetch::fork/join ops that compiled "
                        f"code calls; add '__weakref__' to its __slots__")
    return refuse


def _input_tensor(args: tuple, kwargs: dict, tensor: type) -> Any:
    """The tensor argument of a module's input that the hooks read: the first
    floating-point one of two or more dimensions (the hidden states: [B, 1, H] or
    [B, H] in decode), else the first of two or more dimensions (token ids, [B, S]),
    else the first; None without one.  A vLLM-style ``forward(positions,
    hidden_states)`` passes its positions first: [T], or [3, T] for M-RoPE."""
    first = ids = None
    for candidate in (*args, *kwargs.values()):
        if isinstance(candidate, tensor):
            if candidate.dim() >= 2:
                if candidate.is_floating_point():
                    return candidate
                if ids is None:
                    ids = candidate
            elif first is None:
                first = candidate
    return ids if ids is not None else first


def _batch_of(args: tuple, kwargs: dict, tensor: type) -> int:
    """The decode batch of a module's input (:func:`_input_tensor`'s tensor): the product
    of all but its last dimension; its length where it is a 1-D tensor of integers (a
    vLLM model's token ids or positions, [T]); 1 for a scalar; 0 without a tensor."""
    value = _input_tensor(args, kwargs, tensor)
    if value is None:
        return 0
    if value.dim() == 0:
        return 1
    if value.dim() == 1 and not value.is_floating_point():
        return value.shape[0]
    last = value.shape[-1]
    if last:
        return value.numel() // last
    batch = 1
    for n in value.shape[:-1]:
        batch *= n
    return batch


def default_batch(module: Any, args: tuple, kwargs: dict) -> int:
    """The :data:`BatchFn` that :func:`attach` uses by default: the product of all but
    the last dimension of the module's hidden states, the first floating-point tensor
    argument of two or more dimensions (else of the first tensor argument; a 1-D one of
    integers, token ids or positions: its length; 0 without one)."""
    import torch

    return _batch_of(args, kwargs, torch.Tensor)


def register_site_hook(module: Any, where: str, hook: Callable[..., Any], *,
                       with_kwargs: bool = False) -> Any:
    """Register ``hook`` where a site of kind ``where`` forks (``"after"``: a forward
    hook, ``"before"``: a forward pre-hook), ahead of the module's other hooks of that
    kind, as :func:`attach` does; returns torch's removable handle."""
    _check_module("module", module)
    if not isinstance(where, str) or where not in SITE_HOOKS:
        raise ValueError(f"where must be {site_hook_choices()}, got {where!r}")
    if where == "before":
        handle = module.register_forward_pre_hook(hook, with_kwargs=with_kwargs)
        registered = module._forward_pre_hooks
    else:
        handle = module.register_forward_hook(hook, with_kwargs=with_kwargs)
        registered = module._forward_hooks
    try:
        _move_ahead(registered, handle.id)
    except BaseException:   # an interrupt mid-way: not left registered out of order
        handle.remove()
        raise
    return handle


def _move_ahead(registered: Any, key: int) -> None:
    """Put hook ``key`` first in the module's hook dict.  Where Dynamo pairs each hook
    it runs with the guard of the hook at that ``dict.keys`` position (torch before
    2.13: a crash at guard creation beside another pre-hook, pytorch#160083; RESULTS,
    run 23), the others are re-inserted after it one by one, in running order, so that
    the dict's own order is the running order too; each is missing for an instant,
    which a forward on another thread can see.  From 2.13 on, one ``move_to_end``
    (what ``prepend=True`` does) relinks it first and drops nothing.  Like any hook
    registration (torch inserts a hook before it records ``with_kwargs``), not safe
    against another thread running the module's forward meanwhile."""
    if _torch_at_least(2, 13):
        registered.move_to_end(key, last=False)
        return
    others = [(k, hook) for k, hook in registered.items() if k != key]
    try:
        for k, hook in others:
            del registered[k]
            registered[k] = hook
    except BaseException:   # interrupted mid-way: every one back after ours, in order
        for k, _ in others:
            registered.pop(k, None)
        for k, hook in others:
            registered[k] = hook
        raise


def _torch_at_least(major: int, minor: int) -> bool:
    """Whether the torch imported is at least ``major.minor`` (False before it is)."""
    torch = sys.modules.get("torch")
    try:
        found = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    except (AttributeError, ValueError):   # not imported, or a version of other words
        return False
    return found >= (major, minor)


def _fork_hook(controller: Any, point: str, layer: int,
               batch_fn: Optional[BatchFn], tensor: type[torch.Tensor],
               is_compiling: Callable[[], bool],
               fork_op: Callable[..., None], handle: Optional[int],
               before: bool) -> Callable[..., None]:
    """The forward hook (``before``: pre-hook) with kwargs of one site; it returns None.

    Eager: ``controller.fork(point, layer, batch)``; a PrefetchController's whose fork
    takes it also gets ``activation=``, the first tensor of the module's output
    (``before``: its input's hidden states, the tensor the batch is read from) where
    that tensor is on the controller's device (else None), which a ``warm_activation``
    table reads last.  Being compiled:
    ``fork_op(handle, point, layer, batch, after=<that tensor>)`` (so compiled code keeps
    the fork behind that tensor's producer).  A profile's controller tuned on a compiled
    step refuses an eager fork that would launch (:func:`~l2prefetch.profile.check_step`).
    """
    fork = controller.fork
    # only a fork that takes activation= gets it (a subclass may override fork with
    # hooks.Controller's signature), and only a tensor on the controller's device
    warm = warms(controller)
    device = controller.device if warm else None
    tuned_step = getattr(controller, "tuned_step", None)
    refuse_eager = step_compiled(tuned_step)
    if batch_fn is None:
        def batch_of(module: Any, args: tuple, kwargs: dict) -> Any:
            return _batch_of(args, kwargs, tensor)
    else:
        symbolic = sys.modules["torch"].SymInt   # torch.compile's batch: checked as traced

        def batch_of(module: Any, args: tuple, kwargs: dict) -> Any:
            batch = batch_fn(module, args, kwargs)
            if type(batch) is int and batch >= 0:
                return batch
            return _checked_batch(batch, point, layer, tensor, symbolic)

    def follows(args: tuple, kwargs: dict, output: Any) -> Any:
        # after: the output's first tensor; before: the input's hidden states, as the
        # batch is read (positions passed first would let compiled code hoist the fork
        # to the start of the graph), else its first tensor at any depth
        if not before:
            return _first_tensor(output, tensor)
        found = _input_tensor(args, kwargs, tensor)
        return found if found is not None else _first_tensor((args, kwargs), tensor)

    def at(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        batch = batch_of(module, args, kwargs)
        if batch:
            if is_compiling():
                fork_op(handle, point, layer, batch, follows(args, kwargs, output))
            else:
                if refuse_eager:
                    check_step(tuned_step, compiled=False, controller=controller)
                try:
                    if warm:   # e.g. a pre-hook's input not yet moved to this GPU: None
                        seen = follows(args, kwargs, output)
                        fork(point, layer, batch, activation=None if seen is None
                             else fork_activation(device, seen))
                    else:
                        fork(point, layer, batch)
                except _C.Error:
                    _raise_if_closed(controller)
                    raise

    if before:
        def pre_hook(module: Any, args: tuple, kwargs: dict) -> None:
            at(module, args, kwargs, None)
        return pre_hook

    def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        at(module, args, kwargs, output)
    return hook


def _checked_batch(batch: Any, point: str, layer: int, tensor: type, symbolic: type) -> Any:
    """What ``batch_fn`` returned that is not an int >= 0: None (no fork), a SymInt (under
    torch.compile) or an index (a numpy int) as an int; else a TypeError or ValueError
    naming batch_fn and the site."""
    if batch is None or isinstance(batch, symbolic):
        return batch
    where = f"at point {point!r}, layer {layer}"
    must = "it must return an int >= 0 (0 or None: no fork), e.g. hidden_states.shape[0]"
    if isinstance(batch, (bool, tensor)):
        index = None
    else:
        try:
            index = operator.index(batch)
        except TypeError:
            index = None
    if index is None:
        got = (f"a Tensor of shape {tuple(batch.shape)}" if isinstance(batch, tensor)
               else f"{type(batch).__name__} {shown(batch)}")
        raise TypeError(f"batch_fn returned {got} {where}: {must}")
    if index < 0:
        raise ValueError(f"batch_fn returned {shown(index)} {where}: {must}")
    return index


def _raise_if_closed(controller: Any) -> None:
    """After a hook's fork or join failed: where the controller is closed, an Error that
    names the hooks left on (the controller's own says only that it is closed)."""
    if getattr(controller, "closed", False) is True:
        raise _C.Error(f"the {type(controller).__name__} that hooks.attach hooked into this "
                       "model is closed, and its hooks are still on: detach them "
                       "(Attachment.detach()) before closing the controller, or attach a "
                       "new one") from None


def _sites(model: Any, point: object, spec: Any,
           module_type: type) -> list[tuple[Any, int, str]]:
    """The sites of ``point`` as ``(module, layer, hook)``, checked."""
    if not isinstance(point, str) or not point:
        raise TypeError(f"point names must be non-empty str, got {point!r}")
    sites = spec(model) if callable(spec) else spec
    try:
        sites = list(sites)
    except TypeError:
        raise TypeError(f"points[{point!r}] must be a list of (module, layer) or a callable "
                        f"returning one, got {type(sites).__name__}") from None
    resolved = []
    for site in sites:
        if not (isinstance(site, tuple) and len(site) in (2, 3)):
            raise TypeError(f"points[{point!r}] must hold (module, layer) or (module, layer, "
                            f"hook) tuples, got {site!r}")
        module, layer = site[:2]
        hook = site[2] if len(site) == 3 else DEFAULT_SITE_HOOK
        if not isinstance(module, module_type):
            raise TypeError(f"points[{point!r}]: {type(module).__name__} is not an nn.Module")
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"points[{point!r}]: layer must be an int in 0..{MAX_LAYER}, got "
                            f"{shown(layer)}")
        if not isinstance(hook, str) or hook not in SITE_HOOKS:
            raise ValueError(f"points[{point!r}]: a site's hook must be {site_hook_choices()}, "
                             f"got {hook!r}")
        resolved.append((module, layer, hook))
    return resolved


#: Fork sites per point name: a list of sites, or a callable ``model -> list``.
Points = Mapping[str, Union[Sequence[Site], Callable[["torch.nn.Module"], Sequence[Site]]]]


def attach(model: torch.nn.Module, controller: Controller,
           points: Union[Points, Callable[[torch.nn.Module], Points]], *,
           batch_fn: Optional[BatchFn] = None, join: bool = True) -> Attachment:
    """Hook ``controller``'s forks and join into ``model``; returns what to detach.

    ``points`` maps each point name to its fork sites: a list of ``(module,
    layer)`` (or ``(module, layer, hook)``) or a callable ``model -> list``;
    ``points`` may also be a callable ``model -> mapping``, such as
    ``deepseek_v3.hook_points``.  Each site gets a forward hook, registered
    ahead of the module's other forward hooks, that calls
    ``controller.fork(point, layer, batch)`` after the module's forward (with
    ``hook`` ``"before"``: a forward pre-hook, registered ahead of the module's
    other pre-hooks, that forks before its forward), with ``batch`` read from the
    module's input by :func:`default_batch` (its hidden states: all but their last
    dimension; ``batch_fn`` overrides that; a batch of 0 skips the fork).  With
    ``join`` the root ``model`` gets a forward hook that calls ``controller.join()``
    at the end of each forward.
    Everything is checked before any hook is added.  Under
    ``L2PREFETCH_DISABLE`` nothing is attached.

    Hooks run when the model's Python runs: in eager mode on every step, and
    only while capturing under CUDA graphs (the captured forks replay).  A
    controller made with ``eager=False`` turns the eager steps' forks into a
    capture-state read that returns False (an eager decode step pays a fork's
    host time and cannot gain from it).  Under
    ``torch.compile`` they run while Dynamo traces and put the
    ``l2prefetch::fork`` / ``join`` ops into the graph; for that the
    controller is registered with :func:`l2prefetch.ops.register` (so it must
    support weak references) until :meth:`Attachment.detach`.

    One controller attaches to one model once: while its hooks are on a module of
    ``model`` (an earlier attachment not detached, kept or not, or one to a submodule),
    attaching it again is a ValueError, since every site would fork twice a step and
    the step join twice.  Detach the first attachment, or attach once with all the
    points in one mapping.  Other controllers, and this one on another model, attach
    as before.
    """
    global _disabled_logged
    if disabled():
        if not _disabled_logged:
            logger.info("L2PREFETCH_DISABLE is set: l2prefetch attaches no hooks")
            _disabled_logged = True
        return Attachment()

    torch = _torch.require("l2prefetch.hooks.attach")
    # torch.compile(model): its module's hooks run in the compiled code, the join's too
    model = compiled_module(model)
    resolved = _check_attach(model, controller, points, batch_fn, torch)
    op_handle, fork_op, join_op = _register_ops(controller, torch)
    try:
        handles, sites = _add_hooks(model, controller, resolved, batch_fn, join, torch,
                                    op_handle, fork_op, join_op)
    except BaseException:
        if op_handle is not None:
            _ops().unregister(op_handle)
        raise
    _log_attach(model, sites, join, op_handle)
    forwards = _forwards(model, [module for _, _, module in sites])
    entries = _entries_of(forwards)
    late = [name for code, _, name in entries if code not in _hooked_frames]
    if late:
        name = late[0]
        logger.warning(
            "attach: torch.compile already traced %s.forward (for this model or another "
            "%s: every instance shares its frames), and Dynamo does not guard on a "
            "module's empty hook dicts, so those frames run none of the hooks added now "
            "and nothing forks there: attach before the first compiled call of any %s, "
            "or call torch._dynamo.reset() after attaching", name, name, name)
    frames = [code for code, _, _ in entries]
    return Attachment(controller, handles, sites, op_handle,
                      (forwards, weakref.WeakSet(frames)) if handles else None)


#: Code Dynamo compiled for a forward while an attachment's hooks were on the module: it
#: guards on those hooks, so a later attachment's are traced anew (no warning for it).
_hooked_frames: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _forwards(model: Any, modules: Iterable[Any] = ()) -> list:
    """``(class name, forward)`` whose compiled frames can run the hooks of ``modules``
    (the sites): ``model``'s class's, then that of each module above a site (a decoder
    layer compiled on its own, ``layer.compile()``), each class once."""
    wanted = {id(module) for module in modules}
    named = list(model.named_modules(remove_duplicate=False))
    above = {""}
    for path, module in named:
        if id(module) in wanted and path:
            parts = path.split(".")
            above.update(".".join(parts[:i]) for i in range(1, len(parts)))
    found, classes = [], set()
    for path, module in named:
        cls = type(module)
        if path in above and cls not in classes:
            classes.add(cls)
            found.append((cls.__name__, getattr(cls, "forward", None)))
    return found


def _entries_of(forwards: Sequence[tuple[str, Any]]) -> list:
    """``(code, compile id, class name)`` of each frame torch.compile holds for the
    ``(class name, forward)`` of :func:`_forwards` (compiled with ``model.compile()``,
    ``torch.compile(model)`` or of its forward, and called; the id: Dynamo's
    ``CompileId`` of the compilation that made it, None where this torch has none).  Not
    seen: a compiled function that calls the model, whose frame holds the forward
    inlined, and every way under ``torch._dynamo.config.wrap_top_frame``, which compiles
    one frame shared by every compiled callable instead."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")   # not loaded: nothing compiled
    entries = getattr(eval_frame, "_debug_get_cache_entry_list", None)
    if entries is None:
        return []
    try:
        return [(entry.code, getattr(entry, "compile_id", None), name)
                for i, (name, forward) in enumerate(forwards)
                for code in _forward_codes(forward, inline=i == 0)
                for entry in entries(code)]
    except Exception:   # a torch whose private helpers changed: no warning, not a failed attach
        return []


def _forward_codes(forward: Any, inline: bool = True) -> list:
    """The code whose compiled frames run ``forward``: its own, that of each function it
    wraps (``__wrapped__``: ``model.compile()`` of a forward decorated with
    ``torch.no_grad()`` compiles the function inside), and, with ``inline`` (the model's
    own forward) where Dynamo does not trace ``forward`` itself (that decorator is
    torch's), the frame ``torch.compile`` puts around it (``external_utils.wrap_inline``'s,
    shared by every callable compiled so: a warning too many, never one too few)."""
    codes: list = []
    fn = forward
    while fn is not None and len(codes) < 16:
        code = getattr(fn, "__code__", None)
        if code is not None and code not in codes:
            codes.append(code)
        fn = getattr(fn, "__wrapped__", None)
    trace_rules = sys.modules.get("torch._dynamo.trace_rules")
    external = sys.modules.get("torch._dynamo.external_utils")
    if inline and codes and trace_rules is not None and external is not None \
            and trace_rules.check(forward):
        codes.append(external.wrap_inline(forward).__code__)
    return codes


#: The attribute that marks a hook function as one of :func:`attach`'s, naming its controller.
_TAG = "_l2prefetch_controller"
_SITE = "_l2prefetch_module"   # a weak reference to the module a hook was registered on


def _ops() -> Any:
    """:mod:`l2prefetch.ops`, imported on first use: it imports torch, which importing
    this module must not."""
    from . import ops

    return ops


def _check_attach(model: Any, controller: Any, points: Any, batch_fn: Any,
                  torch: Any) -> list[tuple[str, list[tuple[Any, int, str]]]]:
    """attach()'s arguments, checked before any hook is added: per point its sites
    ``(module, layer, hook)``, each a module of ``model`` and given once."""
    for method in ("fork", "join"):
        if not callable(getattr(controller, method, None)):
            raise TypeError(f"controller must have fork(point, layer, batch) and join(); "
                            f"{type(controller).__name__} has no {method}()")
    _check_module("model", model)
    if batch_fn is not None and not callable(batch_fn):
        raise TypeError(f"batch_fn must be None (the default batch) or a callable "
                        f"batch_fn(module, args, kwargs) -> batch, got {type(batch_fn).__name__}")
    if callable(points) and not isinstance(points, Mapping):
        points = points(model)
    if not isinstance(points, Mapping):
        raise TypeError(f"points must map point names to fork sites, got {type(points).__name__}")
    resolved = [(point, _sites(model, point, spec, torch.nn.Module))
                for point, spec in points.items()]
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    for point, sites in resolved:
        seen = set()
        for module, layer, where in sites:
            if id(module) not in names:
                raise ValueError(f"points[{point!r}]: the {type(module).__name__} at layer "
                                 f"{layer} is not a module of this {type(model).__name__}: "
                                 "give sites inside the model attached to")
            if not 0 <= layer <= MAX_LAYER:
                raise ValueError(f"points[{point!r}]: the site {names[id(module)] or 'the root'!r}"
                                 f" ({where}) has layer {shown(layer)}, outside 0..{MAX_LAYER} (a "
                                 "controller's layers): give its decoder layer's index")
            if (id(module), where) in seen:
                raise ValueError(f"points[{point!r}] gives {names[id(module)] or 'the root'!r} "
                                 f"({where}) twice, which would fork twice a step: give each "
                                 "site once")
            seen.add((id(module), where))
    for module, owner, hook in _tagged(model):   # attached already: it would fork twice
        site = hook.__dict__.get(_SITE)
        if site is not None and site() is not module:
            name = names.get(id(module))
            on = f"its {type(module).__name__} {name!r}" if name else "its root"
            raise ValueError(
                f"this {type(model).__name__} carries hooks copied from another model, on "
                f"{on} (a copy of an attached model carries them): they fork for that "
                "model's controller; copy the model before attaching, or detach before "
                "copying")
        if owner is controller:
            raise ValueError(
                f"this {type(controller).__name__} is already attached to this "
                f"{type(model).__name__} (its hooks are on a "
                f"{type(module).__name__} of it) and would fork twice a step: "
                "detach the first attachment (Attachment.detach(), or leave its "
                "with-block) or attach once with all the points in one mapping")
    return resolved


def _tagged(model: Any) -> Iterator[tuple[Any, Any, Any]]:
    """``(module, controller, hook)`` for each hook :func:`attach` put on a module of
    ``model`` (tagged by _add_hooks) and no detach removed.  Read from the modules' own
    dicts, so that no user code (a hook object's or module's ``__getattr__``) runs."""
    for module in model.modules():
        state = vars(module)
        for kind in ("_forward_hooks", "_forward_pre_hooks"):
            for hook in list((state.get(kind) or {}).values()):
                if type(hook) is types.FunctionType and _TAG in hook.__dict__:
                    yield module, hook.__dict__[_TAG], hook


def _check_module(name: str, value: Any) -> None:
    """A TypeError naming ``name`` where ``value`` is not an nn.Module (without torch
    imported, nothing is one; this module does not import it)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(value).__name__}")


def attached(model: Any) -> list:
    """The controllers whose hooks :func:`attach` put on ``model`` and are still on (the
    ``torch.compile(model)`` wrapper: its module's), each once."""
    model = compiled_module(model)
    _check_module("model", model)
    found: list = []
    for _, controller, _ in _tagged(model):
        if not any(controller is seen for seen in found):
            found.append(controller)
    return found


def _register_ops(controller: Any, torch: Any) -> tuple[Optional[int], Callable[..., Any],
                                                        Callable[..., Any]]:
    """(the controller's ops handle, the fork op, the join op): what compiled code calls.
    A controller without weak references gets no handle, and ops that refuse."""
    ops = _ops()   # registers the ops with torch
    fork_op: Callable[..., Any] = torch.ops.l2prefetch.fork.default
    join_op: Callable[..., Any] = torch.ops.l2prefetch.join.default
    try:
        return ops.register(controller), fork_op, join_op
    except TypeError:  # no weak references: eager use still works, compiled code cannot
        logger.warning("l2prefetch: a %s cannot be weakly referenced; its forks work in eager "
                       "mode only (under torch.compile they break the graph)",
                       type(controller).__name__)
        refuse = _unregistered(type(controller).__name__)
        return None, refuse, refuse


def _add_hooks(model: Any, controller: Any,
               resolved: list[tuple[str, list[tuple[Any, int, str]]]],
               batch_fn: Optional[BatchFn], join: bool, torch: Any, op_handle: Optional[int],
               fork_op: Callable[..., Any],
               join_op: Callable[..., Any]) -> tuple[list[Any], list[tuple[str, int, Any]]]:
    """Each site's fork hook and, with ``join``, the root's join hook: (their handles, the
    ``(point, layer, module)`` of each fork hook).  All or none: a failure removes those
    added."""
    is_compiling = torch.compiler.is_compiling
    handles, sites, hooked = [], [], []
    try:
        for point, point_sites in resolved:
            for module, layer, where in point_sites:
                hook = _fork_hook(controller, point, layer, batch_fn, torch.Tensor,
                                  is_compiling, fork_op, op_handle, where == "before")
                setattr(hook, _TAG, controller)   # what _check_attach finds
                setattr(hook, _SITE, weakref.ref(module))   # a deepcopy's module is another
                hooked.append((module, where, hook))
                sites.append((point, layer, module))
        # each prepended ahead of the last: in reverse, so that one module's sites fork in
        # the order given
        for module, where, hook in reversed(hooked):
            handles.append(register_site_hook(module, where, hook, with_kwargs=True))
        if join:
            end, tensor = controller.join, torch.Tensor

            def join_hook(module: Any, args: tuple, output: Any) -> None:
                if is_compiling():
                    join_op(op_handle, _first_tensor(output, tensor))
                else:
                    try:
                        end()
                    except _C.Error:
                        _raise_if_closed(controller)
                        raise
            setattr(join_hook, _TAG, controller)
            setattr(join_hook, _SITE, weakref.ref(model))
            handles.append(model.register_forward_hook(join_hook))
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    return handles, sites


def _log_attach(model: Any, sites: list[tuple[str, int, Any]], join: bool,
                op_handle: Optional[int]) -> None:
    """At INFO: the fork hooks per point, the join hook and the ops handle."""
    if not logger.isEnabledFor(logging.INFO):
        return
    per_point: dict[str, int] = {}
    for point, _, _ in sites:
        per_point[point] = per_point.get(point, 0) + 1
    logger.info("attach: %d fork hook%s on %s (%s); %s; ops handle %s", len(sites),
                "" if len(sites) == 1 else "s", type(model).__name__,
                ", ".join(f"{point}: {n} site{'s' if n != 1 else ''}"
                          for point, n in per_point.items()) or "no sites",
                f"a join hook on the root {type(model).__name__}" if join else "no join hook",
                op_handle)
