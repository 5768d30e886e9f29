"""The tuner's measurement backend on a GPU: the real step, captured as deployed.

Each measurement arm (:class:`~l2prefetch.tuning.arms.Arm`) becomes a
controller (:func:`~l2prefetch.tuning.rig.build_controller`: the plan's loads,
or empty tables for the control) made with ``eager=False`` and attached with
:func:`l2prefetch.hooks.attach`, the way a server deploys it; the step is captured
with its hooks in place, several instances per arm, and replayed interleaved
(:class:`~l2prefetch.tuning.rig.Rig`); every arm's outputs are compared bitwise with
the step's (:mod:`~l2prefetch.tuning.outputs`).

A compiled step (``compiled=True``: the model runs in code ``torch.compile``
made) is measured the same way, in the compiled code: one
:class:`~l2prefetch.tuning.compiled.Switchboard` hooked at every candidate
site instead of hooks per arm, the step compiled with and without its forks
once per batch shape in :meth:`GraphBackend.prepare`, each arm's forks
switched to at capture (tuning/compiled.py says why).  Where two compilations of
the step differ (max-autotune, :attr:`GraphBackend.within_compilation`), outputs are
compared within the code with the fork ops instead: each arm with its own graph
without forks, the rest with that code forking nowhere
(:data:`~l2prefetch.tuning.arms.SAME_CODE`).

The windows and gaps that order the roles come from :mod:`~l2prefetch.tuning.probe`.
"""

from __future__ import annotations

import logging
import numbers
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from .. import CudaError, Error, hooks
from .._torch import parse_device
from ..mechanisms import GRAPH_FORK_MODES
from .arms import NO_FORKS, SAME_CODE, Arm, Backend, Prepared, Probe, no_forks_of
from .compiled import board_for_roles, screened_board
from .discovery import Role
from .errors import StepError
from .outputs import clone, compare_outputs, compare_within, copy_into
from .probe import WindowProbe
from .rig import LoaderSwitch, NoForks, Rig, build_controller

__all__ = ["MAX_ROUNDS", "MIN_ROUNDS", "PLACEMENTS", "ROUNDS_TARGET_US", "GraphBackend",
           "check_rounds", "rounds_for", "switch_states"]

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
#: Where the graphs of one measured group get their memory (GraphBackend's placement).
PLACEMENTS = ("private", "shared")

logger = logging.getLogger(__name__)


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


def _incapable(exc: BaseException) -> bool:
    """Whether ``exc`` says the driver cannot remove graph nodes at all (l2prefetch.Error,
    not a CudaError: an entry point it lacks), rather than failing for one graph."""
    return isinstance(exc, Error) and not isinstance(exc, CudaError)


def _tables(controller: Any) -> list[Any]:
    return [controller.get(*key) for key in controller.keys()]


def switch_states(names: list[str], head: str,
                  controllers: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """Per arm of one structure, what LoaderSwitch.set takes when ``head`` is the
    captured arm: a mapping from each of head's tables' ranges to that arm's table
    for the same key; None when the keys differ, when two keys whose captured ranges
    are the same want different tables (e.g. head's empty forks at layers another
    arm loads: then the group is captured unpaired), or when an arm's warm table
    would replace one of head's that does not warm (its node holds no activation to
    give it: LoaderSwitch)."""
    keys = set(controllers[head].keys())
    if any(set(controllers[name].keys()) != keys for name in names):
        return None
    states: dict[str, Any] = {}
    for name in names:
        mapping: dict[Any, Any] = {}
        for key in keys:
            head_table = controllers[head].get(*key)
            captured = head_table.ranges
            table = controllers[name].get(*key)
            if mapping.get(captured, table) is not table:
                return None
            if table.warm_activation and table.ranges and not head_table.warm_activation:
                return None
            mapping[captured] = table
        states[name] = mapping
    return states


class _Switched:
    """One state of a LoaderSwitch's graph, replayed as if it were its own graph."""

    def __init__(self, switch: Any, state: Any) -> None:
        self.switch, self.state = switch, state

    def replay(self) -> None:
        self.switch.set(self.state)
        self.switch.graph.replay()


def cuda_device(model: Any, device: Any = None) -> Any:
    """The CUDA device tuning measures on: ``device``, else the model's first parameter's;
    a ValueError where that is not a CUDA device, a TypeError for a ``device`` of
    another type (checked before the step runs; not against the GPUs torch sees)."""
    import torch

    if device is None:
        params = list(model.parameters())
        found = params[0].device if params else torch.device("cuda")
        if found.type != "cuda":
            raise ValueError(f"tuning measures CUDA graphs: the model is on {found}; move it "
                             "to a CUDA device (discover() works on the CPU)")
        return found
    if isinstance(device, (str, torch.device)) or (
            isinstance(device, numbers.Integral) and not isinstance(device, bool)):
        try:
            # an index names a CUDA device (torch's CPU build refuses a bare int); a
            # string is checked before torch sees it (_torch.parse_device)
            found = parse_device(f"cuda:{int(device)}" if isinstance(device, numbers.Integral)
                                 else device)
        except ValueError:
            found = None
        if found is not None and found.type == "cuda":
            return found
        kind: type = ValueError
    else:
        kind = TypeError
    raise kind(f"device must be None (the model's), a CUDA device index, 'cuda', 'cuda:N' "
               f"or a torch.device of CUDA: tuning measures CUDA graphs; got "
               f"{type(device).__name__} {device!r}")


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
                 compiled: bool = False, within_compilation: bool = False) -> None:
        import torch

        check_rounds(rounds)
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        device = cuda_device(model, device)
        self.torch, self.model, self.step, self.rounds = torch, model, step, rounds
        #: Whether the step runs in compiled code (then arms fork through self._board).
        self.compiled = bool(compiled)
        #: An eager step's loads end by reading their site's activation (_controller).
        self.warm_activation = not self.compiled
        #: Outputs compared within the compiled code with the fork ops (SAME_CODE), for
        #: modes whose two compilations of one step differ (run 23).
        self.within_compilation = bool(within_compilation)
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
            self.close()
            self._board = board_for_roles(self.model, roles)

    def offer(self, roles: Sequence[Role], caps_bytes: Sequence[int],
              batch: int) -> tuple[list[Role], dict[str, str]]:
        """Every role of an eager step (:meth:`use_roles`); a compiled step's roles
        screened at ``batch`` and the board hooked at the sites of those offered
        (:func:`~l2prefetch.tuning.compiled.screened_board`: a role with a site where a
        fork changes Inductor's kernels is not offered, with the reason)."""
        not_offered: dict[str, str] = {}
        if self.compiled:
            self.close()                            # the screen compiles boards of its own
            with self.torch.cuda.device(self.device):
                self._board, not_offered = screened_board(self.model, self.step, batch, roles)
        offered = [role for role in roles if role.name not in not_offered]
        self._roles = {role.name: role for role in offered}
        self.caps_bytes = tuple(caps_bytes)
        return offered, not_offered

    def close(self) -> None:
        """Detach the compiled step's switchboard (and drop the frames holding it)."""
        board, self._board = self._board, None
        if board is not None:
            board.close()

    def prepare(self, batch: int) -> Prepared:
        torch = self.torch
        fn = self._fn(batch)   # what the rig captures below (reads the outputs when it runs)
        compile_s = 0.0
        try:
            with torch.cuda.device(self.device), torch.no_grad():
                t0 = time.perf_counter()
                self._outputs[batch] = clone(self.step(batch))
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
            graph, _ = self.rig.capture(fn, warmup=0)
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
        """The step at ``batch`` as the rig captures it: while capturing, its output
        copied into the batch's buffers outside the pool (where their shapes fit)."""
        torch, step = self.torch, self.step

        def fn() -> Any:
            with torch.no_grad():
                out = step(batch)
            static = self._outputs.get(batch)
            if static is not None and torch.cuda.is_current_stream_capturing() \
                    and copy_into(static, out):
                return static
            return out
        return fn

    def probe(self, batch: int, roles: Sequence[Role]) -> Optional[dict[str, Probe]]:
        """Windows and cold-to-hot gaps of the discovered roles
        (:class:`~l2prefetch.tuning.probe.WindowProbe`)."""
        return WindowProbe(self.model, self.rig, self._fn, self.compiled).probe(
            batch, roles, self.caps_bytes)

    def device_fingerprint(self) -> dict:
        from ..profile import device_fingerprint

        return device_fingerprint(self.device)

    # ------------------------------------------------------------------ arms
    def _controller(self, arm: Arm, batch: int) -> Any:
        """A controller for ``arm`` at ``batch`` (:func:`~l2prefetch.tuning.rig.build_controller`:
        ``eager=False``, as deployed; empty tables for the control).  An eager step's loads
        end by reading their site's activation (``warm_activation``; the empty tables do
        not)."""
        entries = []
        for name, setting in arm.roles:
            entries += self._role(name, setting).entries(
                (batch,), byte_cap=setting.byte_cap, grid=setting.grid, kernel=setting.kernel,
                graph_fork=setting.graph_fork, warm_activation=self.warm_activation)
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
        bitwise the no-fork step's (the arm keyed :data:`~l2prefetch.tuning.arms.NO_FORKS`;
        within one compilation, see :meth:`_check_outputs`).

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
        for name, arm in arms.items():
            if arm.roles:
                controllers[name] = self._controller(arm, batch)
        paired = _switch_groups(arms, controllers, self.switches)
        out_of: dict[tuple[str, int], Any] = {}
        # kept until the graphs are replayed: it holds the primers and spacers that keep
        # each instance's placement
        captured = _Instances(self, batch, arms, controllers, paired, graphs, out_of)
        references = captured.capture(instances)
        # SAME_CODE only checks outputs: not timed
        us = self.rig.replays({k: g for k, g in graphs.items() if k[0] != SAME_CODE},
                              self.rounds or self._rounds_at.get(batch, MAX_ROUNDS))
        measured = list(arms) + sorted(set(references.values()))
        medians = {name: [statistics.median(us[(name, i)]) for i in range(instances)]
                   for name in measured}
        identical = self._check_outputs(batch, graphs, out_of, references)
        # a graph without forks whose output is not the step's is no (a): not used
        bad = {key for key in set(references.values()) if not identical.get(key, True)}
        self.references = {n: k for n, k in references.items() if k not in bad}
        in_pairs = {n for _, names, _ in paired for n in names}
        alone = {n: k for n, k in self.references.items() if n not in in_pairs}
        self.pairs = [set(measured) - bad] if self.shared_placement else \
            [set(names) | {self.references[names[0]]} if names[0] in self.references
             else set(names) for _, names, _ in paired] + \
            [{n, k} for n, k in alone.items()]
        return medians, identical

    def _check_outputs(self, batch: int, graphs: Mapping[tuple[str, int], Any],
                       out_of: Mapping[tuple[str, int], Any],
                       references: Optional[Mapping[str, str]] = None) -> dict[str, bool]:
        """:func:`~l2prefetch.tuning.outputs.compare_outputs` here.  Within one compilation
        (where :data:`SAME_CODE` was captured): each arm with a reference against it, the
        rest against SAME_CODE, and (a), compiled apart, against itself."""
        sync = lambda: self.torch.cuda.synchronize(self.device)  # noqa: E731
        if self.within_compilation and (SAME_CODE, 0) in graphs:
            return compare_within(batch, graphs, out_of, sync, references or {})
        return compare_outputs(batch, graphs, out_of, sync)

    def _capture(self, name: str, arm: Arm, controllers: Mapping[str, Any],
                 fn: Callable[[], Any], *, warmup: bool, keep_graph: bool = False,
                 pool: Any = None) -> tuple:
        def capture() -> tuple:
            return self.rig.capture(fn, warmup=1 if warmup else 0, pool=pool,
                                    keep_graph=keep_graph)

        if self._board is not None:
            # the compiled step: its switchboard forks as this arm says (no roles: the
            # board off, the step compiled without fork ops)
            points = self._points(arm) if arm.roles else {} if name == SAME_CODE else None
            with self._board.selected(controllers.get(name), points):
                return capture()
        if not arm.roles:
            return capture()
        with hooks.attach(self.model, controllers[name], self._points(arm)):
            return capture()


def _switch_groups(arms: Mapping[str, Arm], controllers: Mapping[str, Any], switches: bool
                   ) -> list[tuple[str, list[str], dict[str, Any]]]:
    """The arms measured as switched states of one graph: per fork structure whose
    modes are all switchable, (the head captured, its arms, each arm's state)."""
    groups: dict[tuple, list[str]] = {}
    for name, arm in arms.items():
        if arm.roles:
            groups.setdefault(arm.structure(), []).append(name)
    paired = []
    for structure, names in groups.items() if switches else ():
        if not all(GRAPH_FORK_MODES[mode].switchable for _, mode, _ in structure):
            continue
        loads = [n for n in names if not arms[n].empty]
        if len(names) < 2 or not loads:
            continue
        head = max(loads, key=lambda n: sum(t.nbytes for t in _tables(controllers[n])))
        states = switch_states(names, head, controllers)
        if states is not None:
            paired.append((head, names, states))
    return paired


class _Instances:
    """The graph instances of one measured group (GraphBackend.measure): per instance a
    fresh pool (shared placement) primed with spacers, the units captured in an order
    rotated by one per instance, switched groups' states, and each unit's own step
    without forks where it can be derived.  Fills ``graphs`` and ``out_of``, keyed
    ``(arm, instance)``."""

    def __init__(self, backend: GraphBackend, batch: int, arms: Mapping[str, Arm],
                 controllers: Mapping[str, Any],
                 paired: list[tuple[str, list[str], dict[str, Any]]],
                 graphs: dict[tuple[str, int], Any], out_of: dict[tuple[str, int], Any]
                 ) -> None:
        self.backend, self.batch, self.arms, self.controllers = backend, batch, arms, controllers
        self.paired, self.graphs, self.out_of = paired, graphs, out_of
        #: Units whose step without forks could not be made.
        self.failed: set[str] = set()
        #: Each shared pool's first capture and its spacers, alive while the group is
        #: replayed (see capture()).
        self.primers: list[Any] = []
        self.spacers: list[Any] = []

    def capture(self, instances: int) -> dict[str, str]:
        """Every instance's graphs; returns each arm's reference (its own step without
        forks, keyed no_forks_of(unit)) where every instance has one."""
        backend, paired, arms = self.backend, self.paired, self.arms
        fn = backend._fn(self.batch)
        in_pairs = {n for _, names, _ in paired for n in names}
        # what one instance captures: the unswitched arms (NO_FORKS among them), and each
        # switched group's head
        units = [name for name in arms if name not in in_pairs] + [p[0] for p in paired]
        if backend.within_compilation and backend._board is not None:
            units.append(SAME_CODE)
        references: dict[str, str] = {}
        for i in range(instances):
            pool = backend.torch.cuda.graph_pool_handle() if backend.shared_placement else None
            if pool is not None:
                # A new pool's first capture lays out its segments and the captures after
                # it reuse them; at batch 8 they did not pair (RESULTS run 13), likely because
                # the first differs: a primer, kept alive, never timed, takes its place.
                # It first takes spacers of random sizes from the pool, kept alive, so
                # that each instance is a placement of its own: without them the pools of
                # every group landed alike, instance i of one group where instance i of
                # the last one had (RESULTS run 18).
                self.primers.append(backend._capture(NO_FORKS, Arm(), self.controllers,
                                                     self._spaced(fn, self.spacers),
                                                     warmup=i == 0, pool=pool)[0])
            k = backend._captured % len(units)
            backend._captured += 1
            for unit in units[k:] + units[:k]:
                references.update(self._unit(unit, i, fn, pool))
        if self.failed:
            # a driver that cannot (before 12.3), a graph that would lose an ordering, a
            # clone the driver refused: no reference for those units in any instance
            for key in [k for k in self.graphs if k[0] in self.failed]:
                self.graphs.pop(key).close()
                self.out_of.pop(key)
            references = {n: k for n, k in references.items() if k not in self.failed}
        return references

    def _unit(self, unit: str, i: int, fn: Callable[[], Any], pool: Any) -> dict[str, str]:
        """One unit of instance ``i`` captured (a switched group's head: every state of
        its group); the references it gives its arms."""
        backend, graphs, out_of = self.backend, self.graphs, self.out_of
        group = next((p for p in self.paired if p[0] == unit), None)
        key = no_forks_of(unit)
        arm = self.arms.get(unit, Arm())           # SAME_CODE: no arm of the group
        derive = backend.derives_no_forks and bool(arm.roles) and key not in self.failed
        graph, out = backend._capture(unit, arm, self.controllers, fn,
                                      warmup=i == 0, keep_graph=group is not None or derive,
                                      pool=pool)
        switch = LoaderSwitch(graph) if group is not None else None
        references = {}
        if derive and self._derive(unit, graph, switch, key, i):
            out_of[(key, i)] = out
            references = {n: key for n in (group[1] if group else [unit])}
        if group is None:
            graphs[(unit, i)], out_of[(unit, i)] = graph, out
            return references
        _, names, states = group
        for name in names:
            graphs[(name, i)] = _Switched(switch, states[name])
            out_of[(name, i)] = out
        return references

    def _derive(self, unit: str, graph: Any, switch: Any, key: str, i: int) -> bool:
        """The unit's captured graph without its loader nodes, as ``graphs[(key, i)]``;
        False (the unit in ``failed``) where it cannot be made."""
        backend = self.backend
        try:
            with backend.torch.cuda.device(backend.device):
                self.graphs[(key, i)] = NoForks(graph, switch.nodes if switch else None,
                                                device=backend.device)
        except RuntimeError as exc:    # (a)'s captures stand in for this unit
            self.failed.add(key)
            if _incapable(exc):        # and for every unit from now on
                backend.derives_no_forks = False
            logger.warning("batch %d, arm %s: no graph without its forks (%s: %s); "
                           "it is compared with (a)'s own captures", self.batch, unit,
                           type(exc).__name__, exc)
            return False
        return True

    def _spaced(self, fn: Callable[[], Any], spacers: list) -> Callable[[], Any]:
        """``fn`` after two allocations of random sizes, kept in ``spacers``: one under
        1 MiB (the allocator's small blocks) and one of 1-10 MiB (carved from its 20 MiB
        segments), each 512-byte aligned, drawn from the backend's seeded generator."""
        torch, device = self.backend.torch, self.backend.device
        draw = self.backend._placements
        sizes = [512 * draw.randrange(2048), 512 * draw.randrange(2048, 20480)]

        def spaced() -> Any:
            if torch.cuda.is_current_stream_capturing():   # not the eager warm-up's call
                spacers.extend(torch.empty(n, dtype=torch.uint8, device=device)
                               for n in sizes if n)
            return fn()
        return spaced
