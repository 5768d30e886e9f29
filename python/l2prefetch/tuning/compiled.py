"""Tuning a compiled step: a fork at every candidate site, compiled once, switched per arm.

A step that ``torch.compile`` made runs its modules' hooks only while Dynamo
traces; a hook attached to a model already compiled is not run at all (Dynamo
does not guard on hooks added later), and attaching each measurement arm's
hooks and compiling again would cost a compilation per arm.  So the tuner
hooks a :class:`Switchboard` once, at every site any candidate role forks at,
and makes Dynamo compile the step anew (:func:`recompile`):

* the board is the controller of those hooks; the compiled code's forks name
  it by one ops handle and each site by a point of its own, and at run time
  (while a graph is captured) it forwards each fork to the controller of the
  arm being captured (:meth:`Switchboard.select`), at that arm's point names,
  or to nothing;
* with the board off, its hooks fork nowhere at trace time (their batch is 0),
  so Dynamo compiles the step as it was, with no fork ops: the no-fork arm (a)
  is the user's compiled step, not one with idle forks.  Dynamo guards on the
  flag, so the two compiled versions of the step live side by side (two
  compilations per batch shape, made in :meth:`GraphBackend.prepare`).

Where a fork lands in compiled code and why it leaves Inductor's fusions as they
were: python/l2prefetch/DESIGN.md, "How the custom ops stay in place".
Discovery and the window probe read the eager module tree
(:func:`eager_stance`: the same weights, the same modules).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Optional

from .. import hooks
from ..mechanisms import DEFAULT_SITE_HOOK

__all__ = ["Switchboard", "eager_stance", "recompile", "step_is_compiled"]

logger = logging.getLogger(__name__)


def recompile() -> None:
    """Drop every compiled frame (``torch._dynamo.reset()``), so that the next call of a
    compiled step traces its modules' hooks as they are now."""
    import torch

    torch._dynamo.reset()


@contextlib.contextmanager
def eager_stance() -> Iterator[None]:
    """Run compiled functions eagerly inside (``torch.compiler.set_stance("force_eager")``):
    the modules' hooks run on every call, as discovery and the probe need."""
    import torch

    with torch.compiler.set_stance("force_eager"):
        yield


def step_is_compiled(model: Any, step: Callable[[int], Any], batch: int) -> bool:
    """Whether ``step(batch)`` runs ``model``'s modules in code torch.compile made.

    Runs the step once with a forward pre-hook on every module that holds
    parameters: a hook Dynamo traces sees ``torch.compiler.is_compiling()``, and
    a compiled frame traced before the hooks existed does not run them at all;
    an eager step runs them, not compiling.  Call :func:`recompile` afterwards
    (the hooks are gone, a frame compiled now still holds them).
    """
    import torch

    seen: list[bool] = []

    def pre(module: Any, args: Any) -> None:
        seen.append(torch.compiler.is_compiling())

    handles = [module.register_forward_pre_hook(pre) for module in model.modules()
               if any(True for _ in module.parameters(recurse=False))]
    try:
        with torch.no_grad():
            step(batch)
    finally:
        for handle in handles:
            handle.remove()
    return not seen or any(seen)


def _site_point(path: str, hook: str) -> str:
    return f"{hook}:{path}"


class Switchboard:
    """The controller hooked at every candidate site of a compiled step (see the module).

    ``sites``: ``(module, layer, hook)`` of every site an arm may fork at.  While
    :attr:`on` is False its hooks add no fork ops to code being compiled; once on
    (and compiled so), each fork goes to the selected controller at the arm's
    point names, or nowhere.  :meth:`close` detaches it.
    """

    def __init__(self, model: Any, sites: Iterable[tuple[Any, int, str]]) -> None:
        self.model = model
        #: Whether code compiled from now on holds the forks (Dynamo guards on it).
        self.on = False
        self._paths = {id(module): path for path, module in model.named_modules()}
        points: dict[str, list[tuple[Any, int, str]]] = {}
        for module, layer, hook in sites:
            point = _site_point(self._path(module), hook)
            if (module, layer, hook) not in points.setdefault(point, []):
                points[point].append((module, layer, hook))
        self.sites = {point: [layer for _, layer, _ in where] for point, where in points.items()}
        self._routes: dict[tuple[str, int], list[tuple[str, int]]] = {}
        self._current: Any = None
        self.attachment = hooks.attach(model, self, points, batch_fn=self._batch, join=False)
        try:
            self._join_handle = model.register_forward_hook(self._join_hook)
        except BaseException:
            self.attachment.detach()
            raise

    def _path(self, module: Any) -> str:
        path = self._paths.get(id(module))
        if path is None:
            raise ValueError(f"a site's module ({type(module).__name__}) is not a module of "
                             f"the tuned {type(self.model).__name__}")
        return path

    def _join_hook(self, module: Any, args: tuple, output: Any) -> None:
        # the join, as attach's own join hook, but off the compiled code while off
        import torch

        if self.on or not torch.compiler.is_compiling():
            self.attachment.join(hooks.first_tensor(output))

    def _batch(self, module: Any, args: tuple, kwargs: dict) -> int:
        return hooks.default_batch(module, args, kwargs) if self.on else 0

    # ------------------------------------------------------------------ arms
    def select(self, controller: Any,
               points: Mapping[str, Sequence[tuple]]) -> None:
        """Forward forks to ``controller`` at ``points`` (``point -> [(module, layer)]``
        or ``(module, layer, hook)``, as :func:`hooks.attach` takes them), in the order
        given where two points share a site; ValueError for a site not hooked."""
        routes: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for point, sites in points.items():
            for site in sites:
                module, layer = site[:2]
                hook = site[2] if len(site) > 2 else DEFAULT_SITE_HOOK
                key = (_site_point(self._path(module), hook), layer)
                if layer not in self.sites.get(key[0], ()):
                    raise ValueError(f"arm point {point!r} forks at {key[0]!r} layer {layer}, "
                                     "which the switchboard was not hooked at")
                routes.setdefault(key, []).append((point, layer))
        self._routes, self._current = routes, controller

    def clear(self) -> None:
        """Fork nowhere (the board's hooks stay compiled in while :attr:`on`)."""
        self._routes, self._current = {}, None

    @contextlib.contextmanager
    def selected(self, controller: Any,
                 points: Optional[Mapping[str, Sequence[tuple]]]) -> Iterator[None]:
        """``on`` and :meth:`select` inside; points None: off (the step without forks)."""
        before = self.on
        if points is None:
            self.on = False
            self.clear()
        else:
            self.on = True
            self.select(controller, points)
        try:
            yield
        finally:
            self.clear()
            self.on = before

    # ------------------------------------------------- the hooks' controller
    def fork(self, point: str, layer: int, batch: int) -> bool:
        forked = False
        for arm_point, arm_layer in self._routes.get((point, layer), ()):
            forked = bool(self._current.fork(arm_point, arm_layer, batch)) or forked
        return forked

    def join(self) -> None:
        if self._current is not None:
            self._current.join()

    def close(self) -> None:
        """Detach the hooks and drop the compiled frames that hold them."""
        self._join_handle.remove()
        self.attachment.detach()
        self.clear()
        recompile()
