"""The search's time at one batch: what each group would cost, what is left, the ETA.

Costs are estimated from the step's measured capture and replay times
(:class:`~l2prefetch.tuning.arms.Prepared`), 20% over, plus 50 ms a group.  How the
search spends them (what it reserves for later steps) is in
:mod:`l2prefetch.tuning.search`'s docstring.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, Optional

from ..mechanisms import GRAPH_FORK_MODES
from .arms import Arm, Backend, Prepared
from .discovery import Role

__all__ = ["Budget", "LEAD_INSTANCES_FACTOR", "Params", "Progress", "lead_max_instances"]

#: How many times ``max_instances`` a group's lead may get while only the resolution is
#: unmet (sequential sampling is on): on deepseek-v3-6l B1 one lead's paired a - b varied by
#: SD 3.25 us per instance and needed about 40 for 0.05% of the step (RESULTS run 17).
LEAD_INSTANCES_FACTOR = 2


def lead_max_instances(instances: int, max_instances: int) -> int:
    """The most instances a group's lead gets while its paired intervals are wider than
    the resolution: ``LEAD_INSTANCES_FACTOR`` times ``max_instances``, or
    ``max_instances`` where that equals ``instances`` (sequential sampling off)."""
    if max_instances <= instances:
        return max_instances
    return LEAD_INSTANCES_FACTOR * max_instances


@dataclasses.dataclass
class Params:
    """The search's settings (:func:`l2prefetch.tuning.search.search`'s arguments, caps
    in bytes)."""

    instances: int
    max_instances: int
    caps: tuple[int, ...]
    grids: tuple[int, ...]
    kernels: tuple[Optional[str], ...]
    graph_forks: tuple[str, ...]
    min_gain_us: float
    resolution: float

    @property
    def lead_max_instances(self) -> int:
        return lead_max_instances(self.instances, self.max_instances)


class Progress:
    """One line per measured group on a stream (stderr), with elapsed time and an ETA."""

    def __init__(self, stream: Any, budget_s: float, clock: Callable[[], float]) -> None:
        self.stream, self.budget_s, self.clock = stream, budget_s, clock
        self.start = clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def line(self, text: str, eta_s: Optional[float] = None) -> None:
        if self.stream is None:
            return
        elapsed = self.elapsed()
        eta = "" if eta_s is None else f", ETA {max(0.0, eta_s):.0f} s"
        print(f"[l2prefetch tune {elapsed:5.0f}/{self.budget_s:.0f} s{eta}] {text}",
              file=self.stream, flush=True)


class Budget:
    """Cost estimates of one batch's groups against its deadline.

    Until :attr:`prepared` is set (the backend's prepare), a group is priced at 1.2 s
    per arm and instance.
    """

    def __init__(self, backend: Backend, params: Params, deadline: float,
                 clock: Callable[[], float]) -> None:
        self.backend, self.p, self.deadline, self.clock = backend, params, deadline, clock
        self.prepared: Optional[Prepared] = None
        #: The sweeps so far: their first rounds' estimated seconds, and the seconds they
        #: took with their sequential rounds (the ETA scales by the ratio).
        self.swept_estimate = self.swept_actual = 0.0
        self._final_reserve: Optional[float] = None

    def cost(self, arms: int, captures: Optional[int] = None,
             instances: Optional[int] = None) -> float:
        """Estimated seconds of one group of ``arms`` arms, of which
        ``captures`` (default: all) are captured (the others switched in place),
        on ``instances`` instances each (default: the first round's).  A backend that
        derives each capture's step without forks (Backend.derives_no_forks) replays
        one more graph per capture but the first, (a)'s own; one that compares within one
        compilation (Backend.within_compilation) captures one more graph per instance."""
        p = self.prepared
        captures = arms if captures is None else captures
        instances = self.p.instances if instances is None else instances
        if not p:
            return arms * instances * 1.2 + 0.05
        replayed = arms + (max(0, captures - 1) if self.backend.derives_no_forks else 0)
        replay = self.rounds * p.step_us * 1e-6
        captured = captures + (1 if self.backend.within_compilation else 0)
        return instances * (captured * p.capture_s + replayed * replay) * 1.2 + 0.05

    def check_prepared(self, prepared: object) -> Prepared:
        """What the backend's prepare() returned, checked: the budget's estimates start
        from its times, and a NaN or negative one would make every estimate fit."""
        name = type(self.backend).__name__
        if not isinstance(prepared, Prepared):
            raise TypeError(f"{name}.prepare() must return a tuning.arms.Prepared, got "
                            f"{type(prepared).__name__}")
        for field, low in (("step_us", 0.0), ("capture_s", 0.0), ("compile_s", 0.0)):
            value = getattr(prepared, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                    or not math.isfinite(value) or value < low \
                    or (field == "step_us" and value == 0):
                raise ValueError(f"{name}.prepare(): Prepared.{field} must be a finite number "
                                 f"{'> 0' if field == 'step_us' else '>= 0'}, got {value!r}")
        return prepared

    @property
    def rounds(self) -> int:
        """Replays per graph instance in this batch's groups."""
        rounds = self.prepared.rounds if self.prepared else None
        rounds = self.backend.rounds if rounds is None else rounds
        if isinstance(rounds, bool) or not isinstance(rounds, numbers.Integral) or rounds < 1:
            raise TypeError(f"{type(self.backend).__name__}: replays per instance must be an "
                            f"int >= 1, in Prepared.rounds (from prepare()) or else the "
                            f"backend's rounds; got {rounds!r}")
        return rounds

    def switched(self, mode: str) -> bool:
        """Whether the backend measures a fork mode's arms as switched states of one
        graph per instance (it switches, and the mode's loader nodes are switchable)."""
        return self.backend.switches and GRAPH_FORK_MODES[mode].switchable

    def group_cost(self, arms: Mapping[str, Arm],
                   instances: Optional[int] = None) -> float:
        """cost() of these arms: a switching backend captures one graph per structure
        (of switchable fork modes; the others, one per arm)."""
        if not self.backend.switches:
            return self.cost(len(arms), None, instances)
        per_structure = collections.Counter(arm.structure() for arm in arms.values())
        captures = sum(1 if all(self.switched(mode) for _, mode, _ in structure) else n
                       for structure, n in per_structure.items())
        return self.cost(len(arms), captures, instances)

    def sweep_cost(self, caps: int) -> float:
        """Estimated seconds of a role's sweep: (a), and per mode (d) and the caps; a
        pairing backend captures each (switchable) mode once per instance."""
        modes = self.p.graph_forks
        captures = 1 + sum(1 if self.switched(mode) else caps + 1 for mode in modes)
        return self.cost(1 + len(modes) * (caps + 1), captures)

    def verify_cost(self) -> float:
        """Estimated seconds of one verify sampled to the end, at most: three arms, each
        captured, rounds of ``instances`` until ``max_instances``."""
        rounds = -(-self.p.max_instances // self.p.instances)
        return rounds * self.cost(3)

    def confirm_cost(self) -> float:
        """Estimated seconds of one confirmation: (a), the plan and the plan's forks with
        empty tables, the last two one capture where every fork mode the search tries
        is switched in place."""
        both = self.backend.switches and all(self.switched(m) for m in self.p.graph_forks)
        return self.cost(3, 2 if both else 3)

    def final_estimate(self) -> float:
        """The combine step (priced as a group of two arms) and two confirmations."""
        return self.cost(2) + 2 * self.confirm_cost()

    def final_reserve(self) -> float:
        """What the combine and confirm steps keep back (:meth:`final_estimate`), priced
        once, at the first call after prepare (the later steps keep back what the sweep
        did, though a backend that stops deriving its steps without forks prices groups
        lower from then on)."""
        if self._final_reserve is None or not self.prepared:
            self._final_reserve = self.final_estimate()
        return self._final_reserve

    def left(self) -> float:
        return self.deadline - self.clock()

    def fits(self, arms: int, reserve: float = 0.0) -> bool:
        return self.cost(arms) + reserve <= self.left()

    def eta(self, roles_left: int) -> float:
        """Seconds until the sweeps are done: each one's first round, times what the sweeps
        so far took for their first round's estimate (their sequential rounds), at most
        what is left."""
        more = self.swept_actual / self.swept_estimate if self.swept_estimate > 0 else 1.0
        return min(self.left(),
                   roles_left * self.sweep_cost(len(self.p.caps)) * more + self.final_estimate())

    def caps_for(self, role: Role) -> list[int]:
        """The caps a role's sweep tries: the search's, at most its bytes, and its default."""
        fallback = role.default("byte_cap", 0)
        caps = sorted({min(c, role.max_bytes) for c in self.p.caps})
        if fallback and fallback not in caps:
            caps.append(fallback)
        return sorted(set(caps))

    @staticmethod
    def coarser(caps: list[int]) -> list[int]:
        """Fewer caps: keep every other one, always the largest; then none."""
        if len(caps) <= 1:
            return []
        return sorted(set(caps[1::2]) | {caps[-1]})
