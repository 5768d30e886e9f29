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
(:func:`~l2prefetch.tuning.discovery.eager_stance`: the same weights, the same modules).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Optional

from .. import hooks
from ..mechanisms import DEFAULT_SITE_HOOK
from ..model_paths import compiled_module
from ..profile import COMPILE_MODES   # what a profile's step may name, and the tuner measures
from .discovery import Role

__all__ = ["COMPILE_MODES", "OWN_GRAPH_MODES", "Switchboard", "board_for_roles", "calls_in",
           "compilations_differ", "compile_mode", "kernel_calls",
           "own_graphs", "recompile", "screen_roles", "screen_sites", "screened_board",
           "step_is_compiled"]

logger = logging.getLogger(__name__)


#: Inductor modes that capture CUDA graphs of their own: the tuner cannot measure them.
OWN_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_mode(text: str) -> str:
    """``--compile MODE`` (an argparse type): one of :data:`COMPILE_MODES`, else an
    error that says why and what to use instead."""
    if text in COMPILE_MODES:
        return text
    use = f"use {' or '.join(COMPILE_MODES)}"
    if text in OWN_GRAPH_MODES:
        raise argparse.ArgumentTypeError(
            f"{text!r} captures CUDA graphs of its own, and the tuner captures the compiled "
            f"step itself: {use} (the server's capture then holds the forks)")
    raise argparse.ArgumentTypeError(f"{text!r} is not an Inductor mode the tuner measures: "
                                     f"{use} (if {text!r} is the model, put --compile after "
                                     "it or write --compile=MODE)")


def own_graphs(model: Any) -> Optional[str]:
    """How ``model`` was compiled to capture CUDA graphs of Inductor's own
    (``triton.cudagraphs``: ``mode="reduce-overhead"`` or ``"max-autotune"``, or that
    option), as a phrase; None where no compilation the model holds does.  It looks at
    what the model holds: the ``torch.compile(model)`` wrapper, a compiled ``forward``
    set on the module, ``model.compile()``; not a compiled function that calls the
    model, nor Dynamo's own ``backend="cudagraphs"``."""
    module = compiled_module(model)
    held = [("torch.compile(model)", model if model is not module else None),
            ("model.forward = torch.compile(...)", vars(module).get("forward")),
            ("model.compile()", vars(module).get("_compiled_call_impl"))]
    for how, compiled in held:
        config = getattr(compiled, "get_compiler_config", None)
        options = config() if callable(config) else None
        if type(options) is dict and options.get("triton.cudagraphs") is True:
            return (f"{how} with Inductor's triton.cudagraphs (its modes "
                    f"{' and '.join(map(repr, OWN_GRAPH_MODES))} set it)")
    return None


def compilations_differ(mode: Optional[str]) -> bool:
    """Whether two compilations of one step in Inductor ``mode`` can give bitwise
    different outputs: the autotuning modes pick kernels by timing (RESULTS, run 23:
    ``max-autotune-no-cudagraphs``, caches off).  The tuner then compares each arm with
    its own graph without forks, in the same compiled code."""
    return bool(mode) and mode.startswith("max-autotune")


def recompile() -> None:
    """Drop every compiled frame (``torch._dynamo.reset()``), so that the next call of a
    compiled step traces its modules' hooks as they are now."""
    import torch

    torch._dynamo.reset()


def step_is_compiled(model: Any, step: Callable[[int], Any], batch: int) -> bool:
    """Whether ``step(batch)`` runs ``model``'s modules in code torch.compile made.

    Runs the step with a forward pre-hook on every module that holds parameters: a
    hook Dynamo traces sees ``torch.compiler.is_compiling()``, an eager step runs
    them, not compiling.  A frame compiled before the hooks existed runs none of
    them, so where some module's hook did not run and none ran compiling (a warmed
    compiled decoder beside an eager head, as vLLM runs ``lm_head``), every frame is
    dropped (:func:`recompile`) and the step runs once more.  Call :func:`recompile`
    afterwards (the hooks are gone, a frame compiled now still holds them).
    """
    import torch

    compiling: dict[int, bool] = {}   # id(module) -> whether its hook ran compiling

    def pre(module: Any, args: Any) -> None:
        compiling[id(module)] = compiling.get(id(module), False) or \
            torch.compiler.is_compiling()

    handles = [module.register_forward_pre_hook(pre) for module in model.modules()
               if any(True for _ in module.parameters(recurse=False))]
    try:
        with torch.no_grad():
            step(batch)
            if len(compiling) < len(handles) and not any(compiling.values()):
                recompile()   # frames compiled before the hooks: traced anew with them
                step(batch)
    finally:
        for handle in handles:
            handle.remove()
    return any(compiling.values())


_CALL = re.compile(r"^\s+(?:\w+ = )?((?:triton_|cpp_fused_|extern_kernels\.|aten\.|torch\.ops\.)"
                   r"[\w.]*)\((?:\d+, '([^']*)')?", re.M)
_FORK = "torch.ops.l2prefetch.fork"


def kernel_calls(step: Callable[[int], Any], batch: int) -> Optional[list[str]]:
    """Compile ``step`` anew and call it at ``batch``: the calls of Inductor's code, in
    order, kernel numbers dropped (``triton_poi_fused_add_3`` -> ``triton_poi_fused_add``),
    each fork as ``fork <point>``, joins left out; None where no Inductor code was made
    (another backend)."""
    import torch
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    functorch = getattr(torch._functorch, "config", None)
    with config.patch(fx_graph_cache=False), (      # a cache hit makes no code to read
            functorch.patch(enable_autograd_cache=False)
            if functorch is not None and hasattr(functorch, "enable_autograd_cache")
            else contextlib.nullcontext()), torch.no_grad():
        _, codes = run_and_get_code(step, batch)
    return calls_in(codes) if codes else None


def calls_in(codes: Sequence[str]) -> list[str]:
    """The calls in Inductor's output code, as :func:`kernel_calls` gives them: a
    kernel's number dropped also before the ``.run`` of a Triton launch
    (``triton_poi_fused_add_3.run(...)`` -> ``triton_poi_fused_add``), so that one
    kernel more does not renumber, and so change, every kernel after it."""
    calls = []
    for code in codes:
        for name, point in _CALL.findall(code):
            if name.startswith(_FORK):
                calls.append(f"fork {point}")
            elif "l2prefetch" not in name:
                calls.append(re.sub(r"_\d+(?:\.run)?$", "", name))
    return calls


def _kernels(calls: Sequence[str]) -> list[str]:
    return [c for c in calls if not c.startswith("fork ")]


def screen_sites(model: Any, step: Callable[[int], Any], batch: int,
                 sites: Sequence[tuple[Any, int, str]],
                 kind_of: Callable[[tuple[Any, int, str]], str],
                 progress: Optional[Callable[[str], None]] = None) -> dict[str, str]:
    """The site kinds whose forks change the kernels Inductor makes for ``step``.

    Compiles the step without forks, then with a switchboard at every site of ``sites``
    (forking nowhere).  Where the kernel calls differ, the kinds (``kind_of(site)``:
    e.g. the module path below the layer and the hook) whose forks sit next to a
    difference are suspects: each is compiled alone, and the rest together, which
    must then leave the kernels as they were (else they are bisected); last, the kinds
    offered are compiled together, as the measuring board compiles them (bisected
    again where they still differ; kinds that differ only together are all refused).
    Returns ``kind -> reason`` for each kind that changes them (a fork there would
    change what the compiled step computes or how fast), empty where none does or where
    the code cannot be read (another backend: the tuner's bitwise check is then the
    only guard).  Every trial is one compilation, each set of kinds compiled once; a
    clean step takes two.  The first one also finds the kinds whose hooks run eagerly
    (outside the compiled code): those are refused too (:data:`EAGER_SITE`), by any
    backend.
    """
    kinds: dict[str, list[tuple[Any, int, str]]] = {}
    for site in sites:
        kinds.setdefault(kind_of(site), []).append(site)
    base, eager_kinds = _eager_kinds(step, batch, kinds)   # the step compiled without forks
    out = {name: EAGER_SITE for name in sorted(eager_kinds)}
    kinds = {name: at for name, at in kinds.items() if name not in eager_kinds}
    trials = 0

    def said(bad: Iterable[str]) -> dict[str, str]:
        bad = sorted(bad)
        line = (f"{trials + 1} compilation{'s' if trials else ''}; {len(bad)} of {len(kinds)} "
                "site kinds change "
                "Inductor's kernels" + (f": {', '.join(bad)}" if bad else "")
                + (f"; {len(eager_kinds)} run their hooks outside the compiled code: "
                   f"{', '.join(sorted(eager_kinds))}" if eager_kinds else ""))
        logger.info("the site screen at batch %d: %s", batch, line)
        if progress is not None:
            progress(line)
        recompile()   # drop the frames traced with the screen's hooks
        return {**out, **{name: reason for name in bad}}

    if base is None or not kinds:
        if base is None:
            logger.info("no Inductor code to compare (another torch.compile backend): the "
                        "fork sites are not screened; the bitwise check of each arm still "
                        "holds")
        return said(())

    def compiled_with(names: Sequence[str]) -> Optional[list[str]]:
        nonlocal trials
        trials += 1
        board = Switchboard(model, [site for name in names for site in kinds[name]])
        board.on = True
        try:
            return kernel_calls(step, batch)
        finally:
            board.close()

    verdicts: dict[tuple[str, ...], bool] = {}

    def same(names: Sequence[str]) -> bool:   # each set of kinds compiled once
        key = tuple(sorted(names))
        if key and key not in verdicts:
            verdicts[key] = _kernels(compiled_with(key) or []) == base
        return verdicts.get(key, True)

    reason = ("a fork there changes the kernels Inductor makes for the compiled step (it "
              "splits or moves a fusion), so it is not offered under torch.compile")
    everything = sorted(kinds)
    calls = compiled_with(everything) or []
    verdicts[tuple(everything)] = _kernels(calls) == base
    bad: set[str] = set()
    if not verdicts[tuple(everything)]:
        kind_of_point = {_site_point(Switchboard.path_in(model, m), hook): kind_of((m, l, hook))
                         for kind in kinds.values() for m, l, hook in kind}
        suspects = sorted(_next_to_differences(calls, base, kind_of_point))
        bad = {name for name in suspects if not same([name])}

        def bisect(names: list[str]) -> None:   # names change the kernels together
            if len(names) == 1:
                bad.add(names[0])
                return
            alone = [half for half in (names[:len(names) // 2], names[len(names) // 2:])
                     if not same(half)]
            for half in alone:
                bisect(half)
            if not alone:   # only together: keep each kind that leaves them as they were
                kept: list[str] = []
                for name in names:
                    (kept.append if same(kept + [name]) else bad.add)(name)

        rest = [name for name in everything if name not in suspects]
        if not same(rest):   # a difference no fork sat beside
            bisect(rest)
        # what is offered is measured on one board: compiled together, it must leave the
        # kernels as they were (each bisect adds a kind at least, so this ends)
        offered = [name for name in everything if name not in bad]
        while offered and not same(offered):
            bisect(offered)
            offered = [name for name in everything if name not in bad]
    return said(bad)


#: Why a site kind whose hook runs eagerly inside a compiled step is not offered.
EAGER_SITE = ("its hook runs outside the compiled code (the compiled function's caller, or "
              "a graph break there), where a controller of a profile tuned on the compiled "
              "step refuses a fork (StepMismatchError), so it is not offered under "
              "torch.compile")


def _eager_kinds(step: Callable[[int], Any], batch: int,
                 kinds: Mapping[str, Sequence[tuple[Any, int, str]]]
                 ) -> tuple[Optional[list[str]], set[str]]:
    """(:func:`kernel_calls` of the step compiled without forks, the kinds whose hooks
    ran eagerly in it): a hook at every site records whether it ran in code torch.compile
    traced; hooks that call no op leave Inductor's kernels as they are."""
    import torch

    eager: set[str] = set()
    handles = []
    try:
        for name, at in kinds.items():
            for module, _, hook in at:
                def seen(*args: Any, name: str = name) -> None:
                    if not torch.compiler.is_compiling():
                        eager.add(name)
                handles.append(hooks.register_site_hook(module, hook, seen))
        recompile()   # traced with these hooks
        return kernel_calls(step, batch), eager
    except BaseException:
        recompile()   # no frame keeps the hooks that looked
        raise
    finally:
        for handle in handles:
            handle.remove()


#: A layer index in a module path (model.layers.3.mlp): a site kind names every layer's.
_LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _role_sites(model: Any, role: Role) -> list[tuple[Any, int, str]]:
    return [(module, layer, rest[0] if rest else DEFAULT_SITE_HOOK)
            for module, layer, *rest in role.hook_sites(model)]


def _in_order(sites: Iterable[tuple[Any, int, str]]) -> list[tuple[Any, int, str]]:
    """``(module, layer, hook)`` sites, each once, in layer, then hook order."""
    return sorted(set(sites), key=lambda s: (s[1], s[2], id(s[0])))


def board_for_roles(model: Any, roles: Iterable[Role]) -> "Switchboard":
    """A :class:`Switchboard` hooked at every site of ``roles`` (in layer, then hook
    order); making it drops the compiled frames."""
    return Switchboard(model, _in_order(site for role in roles
                                        for site in _role_sites(model, role)))


def screened_board(model: Any, step: Callable[[int], Any], batch: int,
                   roles: Iterable[Role]) -> tuple["Switchboard", dict[str, str]]:
    """A compiled step's roles screened at ``batch``: the :class:`Switchboard` to measure
    the roles offered with, hooked at their sites, and the roles not offered, each with
    the reason (:func:`screen_roles`).  The screen compiles boards of its own; the
    measuring board is made last, so that the step's next compilation holds its hooks."""
    sites = {role.name: _role_sites(model, role) for role in roles}
    not_offered = screen_roles(model, step, batch, sites)
    return Switchboard(model, _in_order(site for name, at in sites.items()
                                        if name not in not_offered for site in at)), not_offered


def screen_roles(model: Any, step: Callable[[int], Any], batch: int,
                 sites: Mapping[str, Sequence[tuple[Any, int, str]]]) -> dict[str, str]:
    """:func:`screen_sites` over every role's ``sites`` (role name -> its ``(module,
    layer, hook)`` sites) by site kind (the module path below the layer index, and the
    hook): each role with a site of a kind whose forks change Inductor's kernels, with
    the reason it is not offered."""
    def kind_of(site: tuple[Any, int, str]) -> str:
        module, _, hook = site
        return f"{_LAYER_INDEX.sub('#', Switchboard.path_in(model, module))}:{hook}"

    bad = screen_sites(model, step, batch,
                       _in_order(site for at in sites.values() for site in at), kind_of)
    out = {}
    for name, at in sites.items():
        for site in at:
            kind = kind_of(site)
            if kind in bad:
                out[name] = f"not offered under torch.compile: at {kind}, {bad[kind]}"
                break
    if bad:
        logger.info("batch %d: site kinds not offered under torch.compile: %s", batch,
                    sorted(bad))
    return out


#: How many kernels on each side of a difference a fork may sit and be suspected.
NEAR = 2


def _next_to_differences(calls: Sequence[str], base: Sequence[str],
                         kind_of_point: Mapping[str, str]) -> set[str]:
    """The kinds of the forks in ``calls`` that lie in, or right beside, a stretch of
    kernels that differs from ``base``."""
    import difflib

    kernels_at = [i for i, c in enumerate(calls) if not c.startswith("fork ")]
    matcher = difflib.SequenceMatcher(a=base, b=[calls[i] for i in kernels_at],
                                      autojunk=False)
    found: set[str] = set()
    for tag, _, _, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        lo = kernels_at[j1 - NEAR] if j1 >= NEAR else 0
        hi = kernels_at[j2 + NEAR - 1] if j2 + NEAR - 1 < len(kernels_at) else len(calls)
        for call in calls[lo:hi + 1]:
            if call.startswith("fork "):
                kind = kind_of_point.get(call[5:])
                if kind is not None:
                    found.add(kind)
    return found


def _site_point(path: str, hook: str) -> str:
    return f"{hook}:{path}"


class Switchboard:
    """The controller hooked at every candidate site of a compiled step (see the module).

    ``sites``: ``(module, layer, hook)`` of every site an arm may fork at.  While
    :attr:`on` is False its hooks add no fork ops to code being compiled; once on
    (and compiled so), each fork goes to the selected controller at the arm's
    point names, or nowhere.  Making one drops every compiled frame
    (:func:`recompile`); :meth:`close` detaches it and drops them again.
    """

    def __init__(self, model: Any, sites: Iterable[tuple[Any, int, str]]) -> None:
        self.model = model
        #: Whether code compiled from now on holds the forks (Dynamo guards on it).
        self.on = False
        self._paths = {id(module): path for path, module in model.named_modules()}
        points: dict[str, list[tuple[Any, int, str]]] = {}
        self._sites = list(dict.fromkeys(sites))
        for module, layer, hook in self._sites:
            point = _site_point(self._path(module), hook)
            if (module, layer, hook) not in points.setdefault(point, []):
                points[point].append((module, layer, hook))
        self.sites = {point: [layer for _, layer, _ in where] for point, where in points.items()}
        self._routes: dict[tuple[str, int], list[tuple[str, int]]] = {}
        self._current: Any = None
        recompile()   # frames compiled before the hooks would run none of them
        self.attachment = hooks.attach(model, self, points, batch_fn=self._batch, join=False)
        try:
            self._join_handle = model.register_forward_hook(self._join_hook)
        except BaseException:
            self.attachment.detach()
            raise

    def path_of(self, module: Any) -> str:
        """``module``'s path in the model (ValueError for a module not in it)."""
        return self._path(module)

    @staticmethod
    def path_in(model: Any, module: Any) -> str:
        """``module``'s path in ``model`` (ValueError for a module not in it)."""
        for path, found in model.named_modules():
            if found is module:
                return path
        raise ValueError(f"a site's module ({type(module).__name__}) is not a module of "
                         f"the tuned {type(model).__name__}")

    def all_sites(self) -> list[tuple[Any, int, str]]:
        """Every ``(module, layer, hook)`` hooked, in hook order."""
        return list(self._sites)

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
                if isinstance(layer, bool) or not isinstance(layer, int):
                    raise TypeError(f"arm point {point!r}: layer must be an int >= 0, not "
                                    f"{type(layer).__name__} {layer!r}")
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
            self.clear()
        else:
            self.select(controller, points)   # a refused site leaves the board as it was
        self.on = points is not None
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
