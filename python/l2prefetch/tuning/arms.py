"""What the tuner measures, and what it needs of whatever measures it.

A :class:`Setting` is how one role's forks load; an :class:`Arm` is one way to run
the step in a measured group (the roles that fork, their settings, empty tables or
not, the layers that load), keyed by :func:`arm_key`; a :class:`Backend` measures
groups of arms (:class:`l2prefetch.tuning.measure.GraphBackend` on the GPU, the tests'
planted fake on the CPU), and says what a step costs to capture and replay
(:class:`Prepared`) and where its windows are (:class:`Probe`).  The search that
chooses the arms is :mod:`l2prefetch.tuning.search`.
"""

from __future__ import annotations

import abc
import dataclasses
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Optional

from ..mechanisms import DEFAULT_GRAPH_FORK
from .discovery import Role, describe_bytes

__all__ = ["ARM_KINDS", "Arm", "Backend", "DEFAULT_GRID", "EMPTY", "EMPTY_PLAN", "LOADS",
           "NO_FORKS", "PLAN", "Prepared", "Probe", "SAME_CODE", "Setting",
           "arm_key", "no_forks_of", "parse_arm_key"]

#: The loader's CTAs in a role's default setting.
DEFAULT_GRID = 32


@dataclasses.dataclass(frozen=True)
class Setting:
    """How a role's forks load: byte cap, loader CTAs, kernel variant (None: the
    device's default), how a fork goes into a captured graph, and the role's layers
    it forks at (None: every layer; else a sorted tuple, a group of layers).  In a
    trial of the layers step's stage ``"layer"``, ``layers`` names the one layer
    whose forks loaded; the forks ran at every layer (:attr:`Arm.loads_at`)."""

    byte_cap: int
    grid: int = DEFAULT_GRID
    kernel: Optional[str] = None
    graph_fork: str = DEFAULT_GRAPH_FORK
    layers: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.layers is None:
            return
        if isinstance(self.layers, (str, bytes)) or not isinstance(self.layers, Iterable):
            raise TypeError(f"layers must be None (every layer of the role) or a sequence of "
                            f"layer indices, got {type(self.layers).__name__}")
        values = tuple(self.layers)
        if not values or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
            raise ValueError(f"layers must be None (every layer of the role) or name at least "
                             f"one layer by its int index, got {values!r}")
        object.__setattr__(self, "layers", tuple(sorted(set(values))))

    def label(self) -> str:
        kernel = self.kernel or "default kernel"
        layers = "" if self.layers is None else \
            f", layer{'s' if len(self.layers) > 1 else ''} {', '.join(map(str, self.layers))}"
        return (f"{describe_bytes(self.byte_cap)}, grid {self.grid}, {kernel}, "
                f"{self.graph_fork}{layers}")

    def launch_key(self) -> tuple:
        """What the empty-fork control must share with this setting."""
        return (self.grid, self.kernel, self.graph_fork, self.layers)

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["layers"] = None if self.layers is None else list(self.layers)
        return out


# The measurement arms.  A measured group maps a key per arm to an :class:`Arm`; the
# key's kind says what the arm is, its tags tell arms of one kind apart.  The letters are
# the report's, and the profile's field names (Trial.as_dict, Confirmation.as_dict: changing
# one changes the profile's format); (c), the benchmarks' computed limit, is not measured here.
#: (a) the step as it is, no forks: every group holds it, the reference of the bitwise check.
NO_FORKS = "a"
#: (b) a role's forks with their loads.
LOADS = "b"
#: (d) the same forks with empty tables: what the forks cost, the control of (b).
EMPTY = "d"
#: Several kept roles' loads together (combine: ``plan:1``, ``plan:2``...; confirm: ``plan``).
PLAN = "plan"
#: Confirm's control: the confirmed plan's forks with empty tables.
EMPTY_PLAN = f"{EMPTY}:{PLAN}"
#: Within one compilation (:attr:`Backend.within_compilation`): the compiled step with
#: its fork ops, forking nowhere, captured once per instance beside (a); the reference
#: of the bitwise checks there (never timed as an arm).
SAME_CODE = f"{NO_FORKS}:same-code"
ARM_KINDS = (NO_FORKS, LOADS, EMPTY, PLAN)


def arm_key(kind: str, *tags: object) -> str:
    """The key of an arm in a group: its kind, then the tags that tell arms of one kind
    apart, joined by ':' (``arm_key(LOADS, "leaf", 4194304)`` is ``'b:leaf:4194304'``,
    ``arm_key(NO_FORKS)`` is ``'a'``)."""
    if kind not in ARM_KINDS:
        raise ValueError(f"arm kind must be one of {ARM_KINDS}, got {kind!r}")
    parts = [str(tag) for tag in tags]
    if any(not part or ":" in part for part in parts):
        raise ValueError(f"arm tags must be non-empty and hold no ':', got {tags!r}")
    return ":".join((kind, *parts))


def no_forks_of(key: str) -> str:
    """The key of arm ``key``'s own step without forks, where a backend measures one
    (:attr:`Backend.references`): ``no_forks_of('b:leaf:4194304')`` is
    ``'a:of:b:leaf:4194304'`` (any key, also one not made by :func:`arm_key`)."""
    return f"{NO_FORKS}:of:{key}"


def parse_arm_key(key: str) -> tuple[str, tuple[str, ...]]:
    """``(kind, tags)`` of a key made by :func:`arm_key`; ValueError for any other."""
    kind, *tags = key.split(":") if isinstance(key, str) else [None]
    if kind not in ARM_KINDS or not all(tags):
        raise ValueError(f"not an arm key (kind {'/'.join(ARM_KINDS)}, then ':'-separated "
                         f"tags): {key!r}")
    return kind, tuple(tags)


@dataclasses.dataclass(frozen=True)
class Arm:
    """A measurement arm, one way to run the step: the roles that fork and their
    settings; ``empty``: the same forks with empty tables (the control).  No roles:
    the step as it is.  ``loads_at``: None, or the only layers whose forks load (a
    sorted tuple; the forks at the arm's other layers launch empty tables), so that
    each layer's loads alone are one structure with the empty forks and can be
    switched in one graph (the search's layers step)."""

    roles: tuple[tuple[str, Setting], ...] = ()
    empty: bool = False
    loads_at: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.loads_at is not None:
            values = tuple(self.loads_at) if isinstance(self.loads_at, Iterable) and \
                not isinstance(self.loads_at, (str, bytes)) else ()
            if not values or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
                raise ValueError(f"Arm.loads_at must be None or name at least one layer by its "
                                 f"int index, got {self.loads_at!r}")
            if self.empty:
                raise ValueError("an empty arm loads nowhere: give loads_at=None with empty=True")
            if not self.roles:
                raise ValueError("loads_at names layers of the arm's roles, and it has none")
            object.__setattr__(self, "loads_at", tuple(sorted(set(values))))

    def loads(self, layer: int) -> bool:
        """Whether the arm's fork at ``layer`` loads (not empty, and in loads_at if given)."""
        return not self.empty and (self.loads_at is None or layer in self.loads_at)

    def structure(self) -> tuple:
        """Its forks' structure (roles, fork modes, layers): arms with the same one
        differ in their tables only, so a backend can switch one graph between them."""
        return tuple(sorted((name, s.graph_fork, s.layers or ()) for name, s in self.roles))


@dataclasses.dataclass(frozen=True)
class Probe:
    """What a probe of the step found for one role at one batch: the window from
    the fork to the consumer (us, mean over layers), the consumer's cold-to-hot
    gap (us, summed over layers) and that of every read its largest load
    covers (``chain_gap_us``: the most its loads could gain)."""

    window_us: Optional[float]
    gap_us: Optional[float]
    chain_gap_us: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The step at one batch: replay time, the host cost of one capture, and the replays
    per graph instance the backend's groups will take at this batch (None: its
    :attr:`Backend.rounds`)."""

    step_us: float
    capture_s: float
    rounds: Optional[int] = None
    #: Seconds spent compiling the step at this batch (a compiled step: without forks,
    #: and with a fork at every candidate site); 0 for an eager one.
    compile_s: float = 0.0


class Backend(abc.ABC):
    """What the search (and :func:`~l2prefetch.tuning.tune`) needs of a measurement
    backend.  :class:`l2prefetch.tuning.measure.GraphBackend` captures the real step;
    tests plant effects in a fake (tests/_tuning_fakes.py).  A backend derives from
    this class: :meth:`prepare`, :meth:`probe`, :meth:`measure` and :attr:`rounds` are
    its own; :attr:`pairs`, :attr:`switches`, :attr:`shared_placement`,
    :meth:`use_roles`, :meth:`offer` and :meth:`device_fingerprint` have the defaults
    below (no pairing, no switching, independent instances, roles not needed, every role
    offered, no device).
    Every member is read directly: nothing is probed with ``hasattr``."""

    #: Replays per graph instance in a group (the budget's estimate counts them); None
    #: where they depend on the batch, and then prepare() says (:attr:`Prepared.rounds`).
    rounds: Optional[int]
    #: After each measure(): the sets of arm keys whose instance i of each were measured
    #: alike (switched states of one graph, or graphs placed alike), so that their
    #: differences are paired; none by default.
    pairs: Sequence[set] = ()
    #: Whether the arms' graphs of one instance index share placement (GraphBackend's
    #: placement="shared"): then (a) is paired with the other arms by instance; the
    #: instance indices are still independent placements, so (a)'s spread across them
    #: is the capture spread; False by default.
    shared_placement: bool = False
    #: Whether measure() captures each fork structure once per instance and switches
    #: its tables in place (what the budget estimate assumes); False by default.
    switches: bool = False
    #: After each measure(): per arm key, the key of that arm's own step without forks
    #: in the times measure() returned (GraphBackend: the arm's captured graph with its
    #: loader nodes removed, replayed at the same addresses), which the search takes as
    #: the arm's (a) instead of :data:`NO_FORKS`'s captures, paired by instance; none
    #: by default.
    references: Mapping[str, str] = types.MappingProxyType({})
    #: Whether measure() returns such a reference for every captured graph with forks
    #: (the budget estimate replays one more graph per capture); False by default.
    derives_no_forks: bool = False
    #: Whether the step it measures runs the model in code torch.compile made
    #: (GraphBackend: found out or given); what tune records where ``compiled`` is None.
    #: False by default.
    compiled: bool = False
    #: Whether measure() compares outputs within one compilation of a compiled step
    #: (GraphBackend: a mode whose compilations differ); it then captures one more graph
    #: per instance (the budget counts it).  False by default.
    within_compilation: bool = False
    #: Whether the arms' loads end by reading their site's activation (``warm_activation``:
    #: GraphBackend on an eager step); tune's plan marks its entries so only then.  False
    #: by default.
    warm_activation: bool = False

    def use_roles(self, roles: Sequence[Role], caps_bytes: Sequence[int]) -> None:
        """The roles the arms will name and the caps (bytes) the search tries (called by
        :meth:`offer`'s default).  Default: nothing."""

    def offer(self, roles: Sequence[Role], caps_bytes: Sequence[int],
              batch: int) -> tuple[list[Role], Mapping[str, str]]:
        """Called by :func:`~l2prefetch.tuning.tune` once, before the search: the roles
        it will measure (the arms name no others), and those it will not, each with the
        reason (GraphBackend on a compiled step: a role forking where a fork changes the
        compiled code, screened at ``batch``).  Default: :meth:`use_roles`, every role
        offered."""
        self.use_roles(roles, caps_bytes)
        return list(roles), {}

    def close(self) -> None:
        """Called by :func:`~l2prefetch.tuning.tune` once, after the search (also when
        it fails): release what :meth:`offer` set up.  Default: nothing."""

    def device_fingerprint(self) -> Optional[dict]:
        """The device measured on (:func:`l2prefetch.profile.device_fingerprint`),
        stored in the result; None (the default) for a backend that measures no GPU:
        such a result cannot be saved as a profile."""
        return None

    @abc.abstractmethod
    def prepare(self, batch: int) -> Prepared:
        """Run and capture the step once at ``batch``, time it
        (:class:`~l2prefetch.tuning.StepError` if it fails or cannot be captured)."""

    @abc.abstractmethod
    def probe(self, batch: int, roles: Sequence[Role]) -> Optional[dict[str, Probe]]:
        """Each role's window and cold-to-hot gaps at ``batch``, by role name; None
        where the backend cannot probe (then every role is measured)."""

    @abc.abstractmethod
    def measure(self, batch: int, arms: Mapping[str, Arm],
                instances: int) -> tuple[dict[str, list[float]], dict[str, bool]]:
        """Per arm key, one time (us) per instance, and whether its outputs are
        bitwise those of the arm keyed :data:`NO_FORKS` (every group holds it).
        An arm's :attr:`Arm.loads_at` must be honoured: forks at every layer of its
        settings, loads only at those layers (the others' tables empty)."""
