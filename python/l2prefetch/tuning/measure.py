"""The tuner's measurement backend on a GPU: the real step, captured as deployed.

Each measurement arm (:class:`~l2prefetch.tuning.arms.Arm`) becomes a
controller (:func:`~l2prefetch.tuning.rig.build_controller`: the plan's loads,
or empty tables for the control) made with ``eager=False`` and attached with
:func:`l2prefetch.hooks.attach`, the way a server deploys it; the step is captured with its hooks in place, several
instances per arm, and replayed interleaved (:class:`~l2prefetch.tuning.rig.Rig`).

A compiled step (``compiled=True``: the model runs in code ``torch.compile``
made) is measured the same way, in the compiled code: one
:class:`~l2prefetch.tuning.compiled.Switchboard` hooked at every candidate
site instead of hooks per arm, the step compiled with and without its forks
once per batch shape in :meth:`GraphBackend.prepare`, each arm's forks
switched to at capture (tuning/compiled.py says why).  The probe reads the
eager module tree.

The probe captures two extra graphs with timing events recorded inside
them (``torch.cuda.Event(external=True)``): in the first, events at each
fork site and around each consumer give the window from a fork to its
consumer and the consumer's cold time; in the second, each consumer's
weights are loaded on the main stream right before it, which gives its hot
time.  The difference is the most a prefetch of it can save.
"""

from __future__ import annotations

import logging
import numbers
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from ..mechanisms import DEFAULT_SITE_HOOK, GRAPH_FORK_MODES
from .discovery import KINDS, Role
from .rig import NoForks, Rig
from .arms import NO_FORKS, Arm, Backend, Prepared, Probe, StepError, no_forks_of

__all__ = ["MAX_ROUNDS", "MIN_ROUNDS", "ROUNDS_TARGET_US", "GraphBackend", "check_rounds",
           "rounds_for"]

#: Replays per graph instance in a measuring group, by default as many as take about
#: ROUNDS_TARGET_US of the step (rounds_for), at least MIN_ROUNDS and at most MAX_ROUNDS.
#: Paired comparisons are limited by how arms differ between instances (about 2 us per
#: instance on a 2.4 ms step), not by the replays within one, so replays beyond that buy
#: less than instances do: on deepseek-v3-6l 20 replays resolved 12 of 15 roles to 0.05%
#: in the 300 s budget at batch 1 (60 replays: 4 of 16), and at batch 8 (a 3.8 ms step)
#: 10 replays resolved 16 of 16 where 20 resolved 12 (benchmarks/RESULTS.md, runs 16, 17).
MAX_ROUNDS = 20
MIN_ROUNDS = 10
ROUNDS_TARGET_US = 40_000.0


def rounds_for(step_us: float) -> int:
    """Replays per instance for a step of ``step_us``: about ROUNDS_TARGET_US of replays,
    but at least MIN_ROUNDS and at most MAX_ROUNDS (20 up to a 2.05 ms step, 10 from
    3.81 ms; MAX_ROUNDS for a step not timed)."""
    if not step_us > 0:  # NaN too
        return MAX_ROUNDS
    return max(MIN_ROUNDS, min(MAX_ROUNDS, round(ROUNDS_TARGET_US / step_us)))


def check_rounds(rounds: object) -> None:
    """TypeError/ValueError unless ``rounds`` is None (by the step's time) or an int >= 1."""
    if rounds is None:
        return
    if isinstance(rounds, bool) or not isinstance(rounds, numbers.Integral):
        raise TypeError(f"rounds must be None (by the step's time) or an int >= 1, got "
                        f"{type(rounds).__name__} {rounds!r}")
    if rounds < 1:
        raise ValueError(f"rounds must be None (by the step's time) or an int >= 1, got "
                         f"{type(rounds).__name__} {rounds!r}")

logger = logging.getLogger(__name__)

#: A layer index in a module path (model.layers.3.mlp): a site kind names every layer's.
_LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")

#: Replays of each probe graph (medians of the event intervals).
PROBE_REPLAYS = 20
#: Where the graphs of one measured group get their memory (GraphBackend's placement).
PLACEMENTS = ("private", "shared")


def _bitwise_equal(x: Any, y: Any) -> bool:
    import torch

    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return (x.shape == y.shape and x.dtype == y.dtype
                and bool(torch.equal(x.view(torch.uint8) if x.is_contiguous() else x,
                                     y.view(torch.uint8) if y.is_contiguous() else y)))
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return len(x) == len(y) and all(_bitwise_equal(a, b) for a, b in zip(x, y))
    return x is None and y is None


def _clone(x: Any) -> Any:
    """A copy of an output (a tensor, or a tuple or list of them) that later replays
    cannot overwrite."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(v) for v in x)
    return x


def _copy_into(dst: Any, src: Any) -> bool:
    """Copy output ``src`` into buffers ``dst`` of the same structure, shapes and
    dtypes; False (nothing copied) where they differ."""
    import torch

    def fits(d: Any, s: Any) -> bool:
        if isinstance(d, torch.Tensor) and isinstance(s, torch.Tensor):
            return d.shape == s.shape and d.dtype == s.dtype and d.device == s.device
        if isinstance(d, (tuple, list)) and isinstance(s, (tuple, list)):
            return len(d) == len(s) and all(fits(a, b) for a, b in zip(d, s))
        return d is None and s is None

    def copy(d: Any, s: Any) -> None:
        if isinstance(d, torch.Tensor):
            d.copy_(s)
        elif isinstance(d, (tuple, list)):
            for a, b in zip(d, s):
                copy(a, b)

    if not fits(dst, src):
        return False
    copy(dst, src)
    return True


def _max_diff(x: Any, y: Any) -> Optional[float]:
    import torch

    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape:
        return (x.float() - y.float()).abs().max().item()
    return None


def _incapable(exc: BaseException) -> bool:
    """Whether ``exc`` says the driver cannot remove graph nodes at all (l2prefetch.Error,
    not a CudaError: an entry point it lacks), rather than failing for one graph."""
    from .. import CudaError, Error

    return isinstance(exc, Error) and not isinstance(exc, CudaError)


class _Switched:
    """One state of a LoaderSwitch's graph, replayed as if it were its own graph."""

    def __init__(self, switch: Any, state: Any) -> None:
        self.switch, self.state = switch, state

    def replay(self) -> None:
        self.switch.set(self.state)
        self.switch.graph.replay()


class GraphBackend(Backend):
    """Measures arms of ``step(batch)`` in CUDA graphs on one device.

    ``model`` is the module whose hooks fork; ``step(batch)`` one capturable
    decode step at that batch (static buffers, same work every replay),
    returning its output (logits) for the bitwise check.  ``rounds``:
    replays per graph instance in a group; None (the default): per batch, by the step's
    time (:func:`rounds_for`, said in :attr:`Prepared.rounds`; a batch not prepared
    gets MAX_ROUNDS).  ``placement``: ``"shared"`` (the
    default: the arms' graphs of one instance index share one memory pool,
    captured in an order rotated by the index, and each capture leaves nothing
    alive in it (its output is copied to a buffer outside, :meth:`_fn`), so their
    buffers land at the same addresses; every arm is then paired with every other
    by instance, (a) included; each pool starts with spacers of random sizes, so that
    each instance lands somewhere else) or ``"private"`` (every graph its own pool, the
    instances of all arms independent).  Where the buffers land is what makes
    captures of one step differ (benchmarks/RESULTS.md, run 13: 4.6% between
    captures, 0.12% between captures into one pool).  torch
    shares a pool safely only among graphs replayed in capture order; here the
    graphs are replayed in rotated order, one after another on one stream, each
    recomputing its whole step from the static inputs, so what one replay leaves
    in a shared buffer is never read by another: only outputs can be overwritten,
    and :meth:`measure` reads each right after its own graph's replay.
    """

    #: A compiled step's switchboard (use_roles), None for an eager step.
    _board: Any = None
    compiled = False

    def __init__(self, model: Any, step: Callable[[int], Any], *, device: Any = None,
                 rounds: Optional[int] = None, placement: str = "shared",
                 compiled: bool = False) -> None:
        import torch

        check_rounds(rounds)
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")

        if device is None:
            params = list(model.parameters())
            device = params[0].device if params else torch.device("cuda")
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"tuning measures CUDA graphs: the model is on {device}; move it to "
                             "a CUDA device (discover() works on the CPU)")
        self.torch, self.model, self.step, self.rounds = torch, model, step, rounds
        #: Whether the step runs in compiled code (then arms fork through self._board).
        self.compiled = bool(compiled)
        #: Per batch, the replays per instance prepare() chose (where rounds is None).
        self._rounds_at: dict[int, int] = {}
        self.shared_placement = placement == "shared"
        #: Instances captured so far: where the next capture order starts (rotated by
        #: one per instance across calls, so no arm is always captured first).
        self._captured = 0
        self.rig = Rig(device)
        self.device = self.rig.device
        self._roles: dict[str, Role] = {}
        #: The caps the search tries (bytes): the probe counts reads up to the largest.
        self.caps_bytes: tuple[int, ...] = ()
        #: Arms of one fork structure share graph instances (tuning.rig.LoaderSwitch);
        #: needs torch's raw graph handles (CUDAGraph.raw_cuda_graph_exec).
        self.switches = hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec")
        self.pairs: list[set[str]] = []
        #: Each captured graph with forks also replays without them, at its addresses
        #: (tuning.rig.NoForks): the arm's own (a), keyed no_forks_of(unit).
        self.derives_no_forks = self.switches
        self.references: dict[str, str] = {}
        #: Draws each instance's spacers (_spaced): a fresh placement per instance.
        self._placements = random.Random(0)
        #: Per batch, buffers outside every graph pool that each capture copies the
        #: step's output into (_fn): a capture then leaves nothing of its own alive in
        #: its pool, so the next capture into a shared pool gets the same addresses
        #: (benchmarks/RESULTS.md, run 13: kept outputs moved them).
        self._outputs: dict[int, Any] = {}

    # ------------------------------------------------------------------ setup
    def use_roles(self, roles: Sequence[Role], caps_bytes: Sequence[int] = ()) -> None:
        """The roles arms name, and the caps the search will try."""
        self._roles = {role.name: role for role in roles}
        self.caps_bytes = tuple(caps_bytes)
        if self.compiled:
            from .compiled import Switchboard, recompile

            if self._board is not None:
                self._board.close()
            sites = {(module, layer, rest[0] if rest else DEFAULT_SITE_HOOK)
                     for role in roles for module, layer, *rest in role.hook_sites(self.model)}
            self._board = Switchboard(self.model, sorted(sites, key=lambda s: (s[1], s[2],
                                                                              id(s[0]))))
            recompile()

    def screen(self, batch: int) -> dict[str, str]:
        """A compiled step: the roles with a site where a fork changes Inductor's kernels
        (:func:`~l2prefetch.tuning.compiled.screen_sites`, at ``batch``), with the reason;
        none for an eager step."""
        if self._board is None:
            return {}
        from .compiled import screen_sites

        def kind_of(site: tuple) -> str:
            module, _, hook = site
            return f"{_LAYER_INDEX.sub('#', self._board.path_of(module))}:{hook}"

        sites = self._board.all_sites()
        self.close()                                # the screen compiles boards of its own
        with self.torch.cuda.device(self.device):
            bad = screen_sites(self.model, self.step, batch, sites, kind_of)
        out = {}
        for name, role in self._roles.items():
            for module, layer, *rest in role.hook_sites(self.model):
                kind = kind_of((module, layer, rest[0] if rest else DEFAULT_SITE_HOOK))
                if kind in bad:
                    out[name] = f"not offered under torch.compile: at {kind}, {bad[kind]}"
                    break
        if bad:
            logger.info("batch %d: site kinds not offered under torch.compile: %s", batch,
                        sorted(bad))
        return out

    def close(self) -> None:
        """Detach the compiled step's switchboard (and drop the frames holding it)."""
        board, self._board = self._board, None
        if board is not None:
            board.close()

    def prepare(self, batch: int) -> Prepared:
        torch = self.torch
        compile_s = 0.0
        try:
            with torch.cuda.device(self.device), torch.no_grad():
                t0 = time.perf_counter()
                self._outputs[batch] = _clone(self.step(batch))
                torch.cuda.synchronize()
                if self._board is not None:
                    # both compiled versions of the step now, not in the middle of a
                    # capture: with the forks (the board on, forking nowhere) as well
                    with self._board.selected(None, {}):
                        self.step(batch)
                    torch.cuda.synchronize()
                    compile_s = time.perf_counter() - t0
        except Exception as exc:
            raise StepError(f"step({batch}) failed, so batch {batch} cannot be tuned: "
                            f"{type(exc).__name__}: {exc}") from exc
        t0 = time.perf_counter()
        try:
            graph, _ = self.rig.capture(self._fn(batch), warmup=0)
        except Exception as exc:
            raise StepError(
                f"step({batch}) cannot be captured into a CUDA graph: {type(exc).__name__}: "
                f"{exc}; a tuned step must be capturable (static input buffers, no host "
                "synchronisation such as .item() or .cpu(), no allocation that depends on "
                "data)") from exc
        capture_s = time.perf_counter() - t0
        us = self.rig.replays({0: graph}, 10)[0]
        del graph
        step_us = statistics.median(us)
        rounds = self._rounds_at[batch] = self.rounds or rounds_for(step_us)
        return Prepared(step_us=step_us, capture_s=capture_s, rounds=rounds,
                        compile_s=compile_s)

    def _fn(self, batch: int) -> Callable[[], Any]:
        torch, step = self.torch, self.step

        def fn() -> Any:
            with torch.no_grad():
                out = step(batch)
            static = self._outputs.get(batch)
            if static is not None and torch.cuda.is_current_stream_capturing() \
                    and _copy_into(static, out):
                return static
            return out
        return fn

    # ------------------------------------------------------------------ arms
    def _controller(self, arm: Arm, batch: int) -> Any:
        """A controller for ``arm`` at ``batch`` (:func:`~l2prefetch.tuning.rig.build_controller`:
        ``eager=False``, as deployed; empty tables for the control)."""
        from .rig import build_controller

        entries = []
        for name, setting in arm.roles:
            entries += self._role(name, setting).entries(
                (batch,), byte_cap=setting.byte_cap, grid=setting.grid, kernel=setting.kernel,
                graph_fork=setting.graph_fork)
        if arm.empty or arm.loads_at is None:
            return build_controller(entries, self.device.index, empty=arm.empty)
        layers = {entry.layer for entry in entries}
        if not set(arm.loads_at) <= layers:
            raise ValueError(f"Arm.loads_at names layers {sorted(set(arm.loads_at) - layers)} "
                             f"that its roles do not fork at (they fork at {sorted(layers)})")
        return build_controller(entries, self.device.index,
                                empty=lambda entry: not arm.loads(entry.layer))

    def _role(self, name: str, setting: Any) -> Role:
        """The role an arm names, restricted to its setting's layers where it has them."""
        role = self._roles[name]
        return role if setting.layers is None else role.restrict(setting.layers)

    def _points(self, arm: Arm) -> dict[str, list]:
        return {name: self._role(name, setting).hook_sites(self.model)
                for name, setting in arm.roles}

    def measure(self, batch: int, arms: Mapping[str, Arm],
                instances: int) -> tuple[dict[str, list[float]], dict[str, bool]]:
        """Per arm, the median us of each instance, and whether its outputs are
        bitwise the no-fork step's (the arm keyed :data:`~l2prefetch.tuning.arms.NO_FORKS`).

        Arms whose forks have one structure (:meth:`Arm.structure`: the
        same roles in the same fork modes at the same layers) share their graph
        instances where every one of those modes is switchable
        (:attr:`l2prefetch.mechanisms.GraphForkMode.switchable`): the instance is
        captured once with the loads of the arm loading most, and every arm of the
        group is its loader nodes switched in place
        (:class:`~l2prefetch.tuning.rig.LoaderSwitch`: other tables, or the empty
        ones), so that their differences are paired (:attr:`pairs`).  The other arms
        are captured each on their own, in an order rotated by one per instance (across
        calls, so that no arm is always captured first).
        With ``placement="shared"`` an instance index's graphs share one memory pool
        and every arm is paired with every other.  All graphs are replayed
        interleaved, round after round; then each once more, its output compared
        right after it.
        """
        if NO_FORKS not in arms:
            raise ValueError(f"a measured group must hold the arm {NO_FORKS!r} (no forks, the "
                             f"reference of the bitwise check), got {sorted(arms)}")
        controllers: dict[str, Any] = {}
        graphs: dict[tuple[str, int], Any] = {}
        try:
            return self._measure(batch, arms, instances, controllers, graphs)
        finally:
            # every one closed even if one raises: an error of measuring goes on, and one
            # of closing is raised only where nothing else is (the others are logged)
            errors = []
            for obj in [*(g for g in graphs.values() if isinstance(g, NoForks)),
                        *controllers.values()]:
                try:
                    obj.close()
                except Exception as exc:        # noqa: BLE001 - the rest still close
                    errors.append(exc)
            graphs.clear()
            for exc in errors[1:] if sys.exc_info()[1] is None else errors:
                logger.warning("batch %d: closing after a measured group: %s: %s", batch,
                               type(exc).__name__, exc)
            if errors and sys.exc_info()[1] is None:
                raise errors[0]

    def _measure(self, batch: int, arms: Mapping[str, Arm], instances: int,
                 controllers: dict[str, Any], graphs: dict[tuple[str, int], Any]
                 ) -> tuple[dict[str, list[float]], dict[str, bool]]:
        from .rig import LoaderSwitch

        torch = self.torch
        groups: dict[tuple, list[str]] = {}
        for name, arm in arms.items():
            if arm.roles:
                controllers[name] = self._controller(arm, batch)
                groups.setdefault(arm.structure(), []).append(name)
        paired: list[tuple[str, list[str], dict[str, Any]]] = []
        for structure, names in groups.items() if self.switches else ():
            if not all(GRAPH_FORK_MODES[mode].switchable for _, mode, _ in structure):
                continue
            loads = [n for n in names if not arms[n].empty]
            if len(names) < 2 or not loads:
                continue
            head = max(loads, key=lambda n: sum(l2p.nbytes for l2p in
                                               self._tables(controllers[n])))
            states = self._states(names, head, controllers)
            if states is not None:
                paired.append((head, names, states))
        in_pairs = {n for _, names, _ in paired for n in names}
        fn = self._fn(batch)
        out_of: dict[tuple[str, int], Any] = {}
        # what one instance captures: the unswitched arms (NO_FORKS among them), and each
        # switched group's head
        units = [name for name in arms if name not in in_pairs] + [p[0] for p in paired]
        primers, spacers = [], []
        references: dict[str, str] = {}
        failed: set[str] = set()       # units whose NoForks could not be made
        for i in range(instances):
            pool = torch.cuda.graph_pool_handle() if self.shared_placement else None
            if pool is not None:
                # A new pool's first capture lays out its segments and the captures after
                # it reuse them; at batch 8 they did not pair (RESULTS run 13), likely because
                # the first differs: a primer, kept alive, never timed, takes its place.
                # It first takes spacers of random sizes from the pool, kept alive, so
                # that each instance is a placement of its own: without them the pools of
                # every group landed alike, instance i of one group where instance i of
                # the last one had (RESULTS run 18).
                primers.append(self._capture(NO_FORKS, Arm(), controllers,
                                             self._spaced(fn, spacers),
                                             warmup=i == 0, pool=pool)[0])
            k = self._captured % len(units)
            self._captured += 1
            for unit in units[k:] + units[:k]:
                group = next((p for p in paired if p[0] == unit), None)
                key = no_forks_of(unit)
                derive = self.derives_no_forks and bool(arms[unit].roles) and key not in failed
                graph, out = self._capture(unit, arms[unit], controllers, fn,
                                           warmup=i == 0,
                                           keep_graph=group is not None or derive, pool=pool)
                switch = LoaderSwitch(graph) if group is not None else None
                if derive:
                    try:
                        with torch.cuda.device(self.device):
                            graphs[(key, i)] = NoForks(graph, switch.nodes if switch else None,
                                                       device=self.device)
                    except RuntimeError as exc:    # (a)'s captures stand in for this unit
                        failed.add(key)
                        if _incapable(exc):        # and for every unit from now on
                            self.derives_no_forks = False
                        logger.warning("batch %d, arm %s: no graph without its forks (%s: %s); "
                                       "it is compared with (a)'s own captures", batch, unit,
                                       type(exc).__name__, exc)
                    else:
                        out_of[(key, i)] = out
                        references.update({n: key for n in (group[1] if group else [unit])})
                if group is None:
                    graphs[(unit, i)], out_of[(unit, i)] = graph, out
                    continue
                _, names, states = group
                for name in names:
                    graphs[(name, i)] = _Switched(switch, states[name])
                    out_of[(name, i)] = out
        if failed:
            # a driver that cannot (before 12.3), a graph that would lose an ordering, a
            # clone the driver refused: no reference for those units in any instance
            for key in [k for k in graphs if k[0] in failed]:
                graphs.pop(key).close()
                out_of.pop(key)
            references = {n: k for n, k in references.items() if k not in failed}
        us = self.rig.replays(graphs, self.rounds or self._rounds_at.get(batch, MAX_ROUNDS))
        measured = list(arms) + sorted(set(references.values()))
        medians = {name: [statistics.median(us[(name, i)]) for i in range(instances)]
                   for name in measured}
        identical = self._check_outputs(batch, graphs, out_of)
        # a graph without forks whose output is not the step's is no (a): not used
        bad = {key for key in set(references.values()) if not identical.get(key, True)}
        self.references = {n: k for n, k in references.items() if k not in bad}
        alone = {n: k for n, k in self.references.items() if n not in in_pairs}
        self.pairs = [set(measured) - bad] if self.shared_placement else \
            [set(names) | {self.references[names[0]]} if names[0] in self.references
             else set(names) for _, names, _ in paired] + \
            [{n, k} for n, k in alone.items()]
        return medians, identical

    def _spaced(self, fn: Callable[[], Any], spacers: list) -> Callable[[], Any]:
        """``fn`` after two allocations of random sizes, kept in ``spacers``: one under
        1 MiB (the allocator's small blocks) and one of 1-10 MiB (carved from its 20 MiB
        segments), each 512-byte aligned, drawn from a seeded generator."""
        torch, device = self.torch, self.device
        sizes = [512 * self._placements.randrange(2048),
                 512 * self._placements.randrange(2048, 20480)]

        def spaced() -> Any:
            if torch.cuda.is_current_stream_capturing():   # not the eager warm-up's call
                spacers.extend(torch.empty(n, dtype=torch.uint8, device=device)
                               for n in sizes if n)
            return fn()
        return spaced

    def _check_outputs(self, batch: int, graphs: Mapping[tuple[str, int], Any],
                       out_of: Mapping[tuple[str, int], Any]) -> dict[str, bool]:
        """Per arm, whether the outputs of all its instances are bitwise those of the
        no-fork step's first instance.  Each graph is replayed once more and its output
        compared right after: graphs that share a pool (or a switched graph's states)
        share buffers, so a later replay overwrites an earlier output."""
        torch = self.torch

        def replay(key: tuple[str, int]) -> Any:
            graphs[key].replay()
            torch.cuda.synchronize(self.device)
            return out_of[key]

        reference = _clone(replay((NO_FORKS, 0))) if (NO_FORKS, 0) in graphs else None
        differ: dict[str, list[tuple[int, Optional[float]]]] = {}
        for key in graphs:
            name, i = key
            out = replay(key)
            differ.setdefault(name, [])
            if not _bitwise_equal(reference, out):
                differ[name].append((i, _max_diff(reference, out)))
        for name, bad in differ.items():
            if bad:
                logger.warning("batch %d, arm %s: outputs of instances %s differ from the "
                               "no-fork step's first instance (max abs diff %s)", batch, name,
                               [i for i, _ in bad], [d for _, d in bad])
        return {name: not bad for name, bad in differ.items()}

    def _capture(self, name: str, arm: Arm, controllers: Mapping[str, Any],
                 fn: Callable[[], Any], *, warmup: bool, keep_graph: bool = False,
                 pool: Any = None) -> tuple:
        from .. import hooks

        if self._board is not None:
            # the compiled step: its switchboard forks as this arm says (no roles: the
            # board off, the step compiled without fork ops)
            points = self._points(arm) if arm.roles else None
            with self._board.selected(controllers.get(name), points):
                return self.rig.capture(fn, warmup=1 if warmup else 0, pool=pool,
                                        keep_graph=keep_graph)
        if not arm.roles:
            return self.rig.capture(fn, warmup=1 if warmup else 0, pool=pool,
                                    keep_graph=keep_graph)
        with hooks.attach(self.model, controllers[name], self._points(arm)):
            return self.rig.capture(fn, warmup=1 if warmup else 0, pool=pool,
                                    keep_graph=keep_graph)

    @staticmethod
    def _tables(controller: Any) -> list[Any]:
        return [controller.get(*key) for key in controller.keys()]

    @staticmethod
    def _states(names: list[str], head: str,
                controllers: Mapping[str, Any]) -> Optional[dict[str, Any]]:
        """Per arm of one structure, what LoaderSwitch.set takes when ``head`` is the
        captured arm: a mapping from each of head's tables' ranges to that arm's table
        for the same key; None when the keys differ or two keys whose captured ranges
        are the same want different tables (e.g. head's empty forks at layers another
        arm loads: then the group is captured unpaired)."""
        keys = set(controllers[head].keys())
        if any(set(controllers[name].keys()) != keys for name in names):
            return None
        states: dict[str, Any] = {}
        for name in names:
            mapping: dict[Any, Any] = {}
            for key in keys:
                captured = controllers[head].get(*key).ranges
                table = controllers[name].get(*key)
                if mapping.get(captured, table) is not table:
                    return None
                mapping[captured] = table
            states[name] = mapping
        return states

    # ------------------------------------------------------------------ probe
    def probe(self, batch: int, roles: Sequence[Role]) -> Optional[dict[str, Probe]]:
        """Windows and cold-to-hot gaps of the discovered roles (see the module's
        docstring); None where events cannot be recorded in a capture."""
        torch = self.torch
        try:
            torch.cuda.Event(enable_timing=True, external=True)
        except TypeError:
            logger.info("torch %s cannot record timing events inside a graph capture: "
                        "windows and gaps are not probed", torch.__version__)
            return None
        discovered = [r for r in roles if r.kind in KINDS]
        if not discovered:
            return None
        try:
            with self._eager():
                cold = self._probe_graph(batch, discovered, hot=False)
                hot = self._probe_graph(batch, discovered, hot=True)
        except Exception as exc:  # the probe is advisory: measuring goes on without it
            logger.warning("probing windows at batch %d failed (%s: %s); measuring every role",
                           batch, type(exc).__name__, exc)
            return None
        def gap(read: str) -> float:
            if read in cold["dur"] and read in hot["dur"]:
                return cold["dur"][read] - hot["dur"][read]
            return 0.0

        out = {}
        largest = max(self.caps_bytes, default=0)
        for role in discovered:
            windows, consumer_gap, chain_gap = [], 0.0, 0.0
            for site in role.sites:
                consumer = site.reads[0]
                start = cold["start"].get(consumer)
                at = cold["site"].get((site.site, site.hook))
                if start is not None and at is not None:
                    windows.append(start - at)
                consumer_gap += gap(consumer)
                loaded = 0
                for read, nbytes in zip(site.reads, self._read_bytes(site)):
                    if largest and loaded >= largest:
                        break
                    chain_gap += gap(read)
                    loaded += nbytes
            out[role.name] = Probe(statistics.fmean(windows) if windows else None,
                                   consumer_gap, chain_gap)
        return out

    def _eager(self) -> Any:
        """Where the probe's hooks must run: eagerly, also for a compiled step (its
        windows are then the eager step's: an estimate that orders the roles)."""
        import contextlib

        if not self.compiled:
            return contextlib.nullcontext()
        from .compiled import eager_stance

        return eager_stance()

    def _read_bytes(self, site: Any) -> list[int]:
        """Bytes of each read of a site's chain (its weights grouped by module)."""
        sizes = []
        for path in site.reads:
            module = self.model.get_submodule(path)
            sizes.append(sum(p.numel() * p.element_size() for p in module.parameters(recurse=False)))
        return sizes

    def _probe_graph(self, batch: int, roles: Sequence[Role], hot: bool) -> dict[str, dict]:
        from .. import PreparedWeightRanges
        from ..hooks import register_site_hook

        torch, model = self.torch, self.model
        reads = sorted({read for role in roles for site in role.sites for read in site.reads})
        sites = sorted({(site.site, site.hook) for role in roles for site in role.sites})
        events: dict[tuple[str, str], Any] = {}

        def event(kind: str, path: Any) -> Any:
            ev = events.get((kind, path))
            if ev is None:
                ev = events[(kind, path)] = torch.cuda.Event(enable_timing=True, external=True)
            return ev

        loaders = {}
        if hot:
            for path in reads:
                module = model.get_submodule(path)
                tensors = [p for p in module.parameters(recurse=False)]
                loaders[path] = PreparedWeightRanges(tensors, grid=self._sm_count(),
                                                     device=self.device.index)
        handles = []
        origin = torch.cuda.Event(enable_timing=True, external=True)
        try:
            for path in reads:
                module = model.get_submodule(path)

                def pre(module: Any, args: Any, path: str = path) -> None:
                    if hot:
                        loaders[path].launch()
                    event("start", path).record()

                def post(module: Any, args: Any, output: Any, path: str = path) -> None:
                    event("end", path).record()
                handles.append(module.register_forward_pre_hook(pre))
                handles.append(module.register_forward_hook(post))
            for path, hook in sites:
                module = model.get_submodule(path) if path else model

                def at(module: Any, *args: Any, path: str = path, hook: str = hook) -> None:
                    event("site", (path, hook)).record()
                handles.append(register_site_hook(module, hook, at))   # where attach forks
            inner = self._fn(batch)

            def fn() -> Any:
                origin.record()
                return inner()
            graph, _ = self.rig.capture(fn, warmup=1)
        finally:
            for handle in handles:
                handle.remove()
        samples: dict[tuple[str, str], list[float]] = {key: [] for key in events}
        with torch.cuda.device(self.device):
            for _ in range(PROBE_REPLAYS):
                graph.replay()
                torch.cuda.synchronize()
                for key, ev in events.items():
                    samples[key].append(origin.elapsed_time(ev) * 1e3)
        med = {key: statistics.median(v) for key, v in samples.items()}
        out: dict[str, dict] = {"start": {}, "site": {}, "dur": {}}
        for (kind, path), t in med.items():
            if kind == "start":
                out["start"][path] = t
                if ("end", path) in med:
                    out["dur"][path] = med[("end", path)] - t
            elif kind == "site":
                out["site"][path] = t
        del graph
        return out

    def device_fingerprint(self) -> dict:
        from ..profile import device_fingerprint

        return device_fingerprint(self.device)

    def _sm_count(self) -> int:
        return self.torch.cuda.get_device_properties(self.device).multi_processor_count

