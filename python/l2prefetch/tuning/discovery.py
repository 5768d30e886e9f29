"""Which weights a forward reads, in order, and where a prefetch of each could fork.

:func:`discover` runs one forward with hooks on every module and records, in
execution order, each module that reads a weight of at least ``min_bytes``:
an ``nn.Linear``, and any module whose own parameters are read in its
forward (Hugging Face's fused expert modules, a hand-written GEMV).  It
needs no GPU and no per-model code.

:func:`candidates` turns those reads into :class:`Role` objects.  For a read
``R[k]``, a fork can go where the module of ``R[k-1]`` returns (site kind
``"module"``) or where the enclosing block before it returns (kind
``"block"``: the child of the two modules' common ancestor that holds
``R[k-1]``, one level inside the decoder layer when that child is the layer
itself, e.g. ``self_attn`` or ``mlp``), or where a module that runs between
the two begins (kind ``"before"``: a forward pre-hook on a child of the
decoder layer, or a module outside the layers, called after ``R[k-1]`` and
before ``R[k]``, such as ``post_attention_layernorm`` before the MLP: an inline
fork there runs its loader beside the module's first kernel, which may be a
window's long one; RESULTS run 20).  The fork loads ``R[k]``'s weights and
those of the following reads, in order, up to a byte cap.  A role is that
site and consumer relative to the decoder layer ("after self_attn.v_proj:
self_attn.o_proj"), so it is one candidate per layer and is measured once
for all of them.

Reads of routed experts (a module path with an index below the layer, such
as ``mlp.experts.3.w1``, or a stacked parameter of three or more dimensions)
read a batch-dependent subset of their weights: they are recorded, never
prefetched, and a chain of following reads stops at them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

from ..mechanisms import DEFAULT_SITE_HOOK, site_entry
from ..model_paths import compiled_module, layer_of, named_tensors  # the runtime's too
from .. import MAX_RANGES
from ..plan import PlanEntry
from .errors import StepError

__all__ = ["Read", "Reads", "Role", "RoleSite", "candidates", "describe_roles", "discover",
           "discovery_step", "eager_stance", "find_roles", "resolve_roles", "role_hints",
           "roles_from_plan"]

MIB = 1 << 20
#: The largest load a candidate is built for (the tuner's largest cap).
DEFAULT_MAX_BYTES = 48 * MIB
#: The kinds of fork site :func:`candidates` knows, in the order it lists a read's.
KINDS = ("module", "block", "before")


@dataclasses.dataclass(frozen=True, eq=False)
class Read:
    """One module's weight read in a forward.

    ``path`` is the module's path in the model, ``layer`` the decoder layer
    index parsed from it (or None), ``relative`` the path below the decoder layer
    (the whole path outside layers), ``nbytes`` the bytes of its own
    parameters, ``order`` its position among the reads, ``params`` the
    parameters' paths, ``routed`` whether it reads a batch-dependent subset
    (routed experts: recorded, never prefetched).
    """

    path: str
    layer: Optional[int]
    nbytes: int
    order: int
    params: tuple[str, ...]
    routed: bool
    module: Any = dataclasses.field(repr=False, compare=False)
    tensors: tuple[Any, ...] = dataclasses.field(repr=False, compare=False)
    relative: str = dataclasses.field(init=False)   # from path, once

    def __post_init__(self) -> None:
        object.__setattr__(self, "relative", layer_of(self.path)[1])


class Reads(list):
    """The reads of one forward (a list of :class:`Read`), plus ``calls``: the
    paths of every module whose forward ran, in the order of their first calls,
    and ``called``, the same as a set; :func:`candidates` uses them to pick fork
    sites that really run during the step, and what runs between two reads."""

    calls: tuple = ()
    called: frozenset = frozenset()
    #: paths of modules whose forward ran more than once in one forward of the model (a
    #: hook on one forks at every run, so none is a before- or block-site)
    repeated: frozenset = frozenset()


def _own_parameters(module: Any) -> list[tuple[str, Any]]:
    return [(name, p) for name, p in module.named_parameters(recurse=False) if p is not None]


def _is_routed(relative: str, params: Sequence[Any]) -> bool:
    if any(part.isdigit() for part in relative.split(".")):
        return True
    return any(p.dim() >= 3 for p in params)


def eager_stance() -> contextlib.AbstractContextManager:
    """Run compiled functions eagerly inside (``torch.compiler.set_stance("force_eager")``):
    the modules' hooks run on every call, as discovery and the window probe need.  Where
    Dynamo was never imported nothing was compiled (and importing it costs about 1 s):
    nothing to do."""
    torch = sys.modules.get("torch")
    if torch is None or "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def discover(model: Any, run: Callable[[], Any], *, min_bytes: int = 1 << 20) -> Reads:
    """Record, in execution order, every module of ``model`` that reads a weight
    of at least ``min_bytes`` while ``run()`` executes one forward.

    ``run`` takes no arguments (e.g. ``lambda: model(input_ids=ids)``); it runs
    under ``torch.no_grad()`` on whatever device the model is on, and eagerly
    (``torch.compiler.set_stance("force_eager")``): a compiled step reads the same
    weights, and a frame compiled before the hooks here would run none of them.  Embedding
    tables are not reads (a lookup touches a few rows).  A module called
    several times is recorded at its first call; a parameter shared by two
    modules (tied embeddings) counts for the module that runs first.

    Raises TypeError for a model that is not an ``nn.Module`` or a ``run`` that
    is not callable, ValueError for a bad ``min_bytes`` or when no module
    reads that much; ``run``'s own exception propagates.
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    model = compiled_module(model)   # torch.compile(model): the paths tune measures in
    if not callable(run):
        raise TypeError(f"run must be a callable that runs one forward of the model, "
                        f"got {type(run).__name__}")
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int):
        raise TypeError(f"min_bytes must be an int >= 1, got {type(min_bytes).__name__}")
    if min_bytes < 1:
        raise ValueError(f"min_bytes must be an int >= 1, got {min_bytes}")

    where = {}   # module -> (path, decoder layer, path below it)
    for name, module in model.named_modules():
        where.setdefault(module, (name, *layer_of(name)))
    param_names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        param_names.setdefault(id(p), name)

    reads = Reads()
    called: list[str] = []
    runs: dict[str, int] = {}          # per forward of the model (run() may make several)
    repeated: set[str] = set()
    seen_modules: set[int] = set()
    seen_params: set[int] = set()

    def pre_hook(module: Any, args: Any) -> None:
        found = where.get(module)
        if found is None:
            return
        path, layer, relative = found
        if module is model:            # a forward of the model: count the runs of each anew
            runs.clear()
        runs[path] = runs.get(path, 0) + 1
        if runs[path] > 1:
            repeated.add(path)
        if id(module) in seen_modules:
            return
        seen_modules.add(id(module))
        called.append(path)
        if isinstance(module, torch.nn.Embedding):
            return
        own = [(n, p) for n, p in _own_parameters(module) if id(p) not in seen_params]
        nbytes = sum(p.numel() * p.element_size() for _, p in own)
        if not own or nbytes < min_bytes:
            return
        for _, p in own:
            seen_params.add(id(p))
        tensors = tuple(p for _, p in own)
        reads.append(Read(path=path, layer=layer, nbytes=nbytes, order=len(reads),
                          params=tuple(param_names.get(id(p), f"{path}.{n}") for n, p in own),
                          routed=_is_routed(relative, tensors), module=module,
                          tensors=tensors))

    handles = [module.register_forward_pre_hook(pre_hook) for module in where]
    try:
        with torch.no_grad(), eager_stance():
            run()
    finally:
        for handle in handles:
            handle.remove()
    reads.calls = tuple(called)
    reads.called = frozenset(called)
    reads.repeated = frozenset(repeated)
    if not reads:
        largest = max((p.numel() * p.element_size() for p in model.parameters()), default=0)
        raise ValueError(f"no module read a weight of at least min_bytes={min_bytes} in that "
                         f"forward (the largest parameter has {largest} bytes); lower "
                         "min_bytes (tune's --min-bytes-mib), or check that the step calls "
                         "the model")
    return reads


# ------------------------------------------------------------------------- candidates

@dataclasses.dataclass(frozen=True)
class RoleSite:
    """One layer's instance of a role: fork when ``site`` returns (``hook``
    ``"before"``: when it begins), at ``layer`` (the layer the fork carries),
    loading ``weights`` in order; ``reads`` are the reads those weights belong to
    (consumer first)."""

    layer: int
    site: str
    reads: tuple[str, ...]
    weights: tuple[Any, ...] = dataclasses.field(repr=False)
    nbytes: tuple[int, ...] = dataclasses.field(repr=False)
    hook: str = DEFAULT_SITE_HOOK

    def hook_site(self) -> tuple:
        """The site as profiles and tune results list it: ``(path, layer)``, or
        ``(path, layer, hook)`` where the hook is not the default."""
        return site_entry(self.site, self.layer, self.hook)

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes)

    def loaded_bytes(self, cap: int) -> int:
        """About what a fork with this cap loads (whole weights, then the cap)."""
        total = self.total_bytes
        return total if not cap else min(cap, total)


@dataclasses.dataclass(frozen=True)
class Role:
    """A fork site and consumer at the same relative place in every layer.

    ``name`` is the point name its forks use.  ``consumer`` and ``site`` are
    paths relative to the decoder layer (whole paths outside layers);
    ``kind`` is ``"module"`` (after the previous read's module),
    ``"block"`` (after its enclosing block), ``"before"`` (before a module
    that runs between the two reads) or ``"policy"`` (a policy's point, see
    :func:`roles_from_plan`); ``next_layer`` is True when the
    consumer is in the layer after the site's.  ``sites`` has one entry per
    layer.  ``defaults`` are settings a policy chose (empty for discovered
    roles): ``byte_cap``, ``grid``, ``carveout``, ``priority``.
    """

    name: str
    consumer: str
    site: str
    kind: str
    next_layer: bool
    sites: tuple[RoleSite, ...]
    defaults: tuple[tuple[str, Any], ...] = ()

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(s.layer for s in self.sites)

    @property
    def max_bytes(self) -> int:
        """The most bytes one fork of this role can load (its longest chain)."""
        return max(s.total_bytes for s in self.sites)

    def default(self, key: str, fallback: Any) -> Any:
        return dict(self.defaults).get(key, fallback)

    def restrict(self, layers: Iterable[int]) -> "Role":
        """The same role forking at ``layers`` only (a subset of :attr:`layers`): the
        tuner's per-layer measurements and its plans for a group of layers."""
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
            raise TypeError(f"layers must be an iterable of layer indices of role "
                            f"{self.name!r}, got {type(layers).__name__}")
        wanted = set()
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, int):
                raise TypeError(f"layers must hold ints, got {type(layer).__name__} {layer!r}")
            wanted.add(layer)
        unknown = sorted(wanted - set(self.layers))
        if not wanted or unknown:
            raise ValueError(f"layers must name at least one of role {self.name!r}'s layers "
                             f"{list(self.layers)}, got {sorted(wanted)}"
                             + (f" ({unknown} not among them)" if unknown else ""))
        return dataclasses.replace(self, sites=tuple(s for s in self.sites if s.layer in wanted))

    def entries(self, batches: Iterable[int], *, byte_cap: int, grid: int = 32,
                kernel: Optional[str] = None, graph_fork: Optional[str] = None,
                warm_activation: bool = False) -> list:
        """One :class:`~l2prefetch.plan.PlanEntry` per layer with these settings."""
        batches = tuple(batches)
        extra = {}
        if kernel is not None:
            extra["kernel"] = kernel
        if graph_fork is not None:
            extra["graph_fork"] = graph_fork
        # a warm table keeps one of the MAX_RANGES slots free: a site with that many
        # weights loads them alone
        return [PlanEntry(self.name, s.layer, batches, s.weights, byte_cap=byte_cap, grid=grid,
                          carveout=self.default("carveout", None),
                          priority=self.default("priority", False),
                          warm_activation=warm_activation and len(s.weights) < MAX_RANGES,
                          **extra)
                for s in self.sites]

    def hook_sites(self, model: Any) -> list[tuple]:
        """``(module, layer)`` (``(module, layer, "before")`` for a site hooked before
        its module) for :func:`l2prefetch.hooks.attach`."""
        return [(model.get_submodule(path) if path else model, *rest)
                for path, *rest in (s.hook_site() for s in self.sites)]


def _role_name(kind: str, site_rel: str, consumer_rel: str, next_layer: bool) -> str:
    where = "before" if kind == "before" else "after"
    return f"{where} {site_rel}: {'next ' if next_layer else ''}{consumer_rel}"


def _before_sites(calls: Sequence[str], position: dict[str, int], repeated: frozenset,
                  previous: str, consumer: str) -> list[str]:
    """The modules a ``"before"`` site can hook for ``consumer``: called after ``previous``
    and before ``consumer``, once in the step, neither inside ``previous`` nor an ancestor
    of ``consumer``, and a child of a decoder layer or outside the layers (one of a layer's
    parts, such as its norms, not a module deep inside a block)."""
    if previous not in position or consumer not in position:
        return []
    out = []
    for path in calls[position[previous] + 1:position[consumer]]:
        if (path.startswith(previous + ".") or consumer.startswith(path + ".") or not path
                or path in repeated):
            continue
        layer, relative = layer_of(path)
        if layer is not None and (not relative or "." in relative):
            continue
        out.append(path)
    return out


def _ancestors(path: str) -> list[str]:
    """'a.b.c' -> ['', 'a', 'a.b', 'a.b.c']."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts) + 1)]


def _block_site(previous: str, consumer: str) -> Optional[str]:
    """The block that holds ``previous`` and returns before ``consumer`` runs."""
    mine, theirs = _ancestors(previous), set(_ancestors(consumer))
    common = [a for a in mine if a in theirs][-1]
    below = mine[len(_ancestors(common))] if len(mine) > len(_ancestors(common)) else None
    if below is None:
        return None
    if below.split(".")[-1].isdigit():  # the decoder layer itself: one level inside it
        deeper = mine.index(below) + 1
        below = mine[deeper] if deeper < len(mine) else None
    return below


def _chain(reads: Sequence[Read], k: int, max_bytes: int) -> list[Read]:
    chain: list[Read] = []
    total = 0
    for read in reads[k:]:
        if read.routed or total >= max_bytes:
            break
        chain.append(read)
        total += read.nbytes
    return chain


def candidates(model: Any, reads: Sequence[Read], *, max_bytes: int = DEFAULT_MAX_BYTES,
               kinds: Sequence[str] = KINDS) -> list[Role]:
    """The candidate roles of ``reads`` (from :func:`discover`), in the order of
    their first fork.

    Each role forks at one site per layer and loads the consumer's weights
    and those of the following reads, up to ``max_bytes`` per fork (the cap
    is chosen later, per setting).  Routed reads are never consumers.
    ``kinds`` selects the sites: ``"module"`` (after the previous read),
    ``"block"`` (after its enclosing block) and ``"before"`` (before a module
    between the two, which needs the call order that :func:`discover` records).
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    called = reads.called if isinstance(reads, Reads) and reads.called else None
    calls = reads.calls if isinstance(reads, Reads) else ()
    repeated = reads.repeated if isinstance(reads, Reads) else frozenset()
    position = {path: i for i, path in enumerate(calls)}
    reads = list(reads)
    for i, read in enumerate(reads):
        if not isinstance(read, Read):
            raise TypeError(f"reads[{i}] must be a Read from discover(), got "
                            f"{type(read).__name__}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be an int >= 1, got {max_bytes!r}")
    if isinstance(kinds, str) or not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"kinds must be a non-empty sequence of {', '.join(map(repr, KINDS))}, "
                         f"got {kinds!r}")

    grouped: dict[tuple, list[RoleSite]] = {}
    order: list[tuple] = []
    for k in range(1, len(reads)):
        consumer, previous = reads[k], reads[k - 1]
        if consumer.routed:
            continue
        chain = _chain(reads, k, max_bytes)
        weights = tuple(t for read in chain for t in read.tensors)
        nbytes = tuple(t.numel() * t.element_size() for t in weights)
        sites = []
        if "module" in kinds:
            sites.append(("module", previous.path))
        if "block" in kinds:
            block = _block_site(previous.path, consumer.path)
            if block is not None and block != previous.path and block not in repeated and (
                    called is None or block in called):
                sites.append(("block", block))
        if "before" in kinds:
            sites += [("before", path) for path in
                      _before_sites(calls, position, repeated, previous.path, consumer.path)]
        for kind, site in sites:
            site_layer, site_rel = layer_of(site)
            next_layer = (site_layer is not None and consumer.layer is not None
                          and consumer.layer != site_layer)
            key = (kind, site_rel, consumer.relative, next_layer)
            layer = site_layer if site_layer is not None else (consumer.layer or 0)
            if key not in grouped:
                grouped[key] = []
                order.append(key)
            grouped[key].append(RoleSite(layer=layer, site=site,
                                         reads=tuple(r.path for r in chain), weights=weights,
                                         nbytes=nbytes,
                                         hook="before" if kind == "before" else "after"))
    roles = []
    for key in order:
        kind, site_rel, consumer_rel, next_layer = key
        sites = grouped[key]
        # A role forks once per layer: two reads at one relative place in a layer
        # (impossible for one module path) would collide on the controller's key.
        layers = [s.layer for s in sites]
        if len(set(layers)) != len(layers):
            continue
        roles.append(Role(name=_role_name(kind, site_rel, consumer_rel, next_layer),
                          consumer=consumer_rel, site=site_rel, kind=kind,
                          next_layer=next_layer, sites=tuple(sites)))
    return roles


def find_roles(model: Any, run: Callable[[], Any], *, min_bytes: int) -> list[Role]:
    """The candidate roles of one forward (:func:`candidates` of what :func:`discover`
    records while ``run()`` runs, eagerly also where the step is compiled).  What
    ``tune`` and ``tune --list-roles`` both do."""
    reads = discover(model, run, min_bytes=min_bytes)
    return candidates(model, reads)


def discovery_step(step: Callable[[int], Any], batch: int) -> Callable[[], Any]:
    """``step(batch)`` as discovery runs it: a failure is a :class:`StepError` naming
    the batch, its cause on the same line (the CLI prints it as one) and chained."""
    def run() -> Any:
        try:
            return step(batch)
        except Exception as exc:
            cause = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            raise StepError(f"step({batch}) failed while discovering the weights it "
                            f"reads: {type(exc).__name__}" + (f": {cause}" if cause else "")
                            ) from exc
    return run


def check_candidates(model: Any, candidates: object) -> None:
    """tune()'s ``candidates`` as far as they can be checked before the step runs: None,
    role names (each once), or :class:`Role` objects (each once, forking at modules of
    ``model`` and loading its tensors or views of them)."""
    if isinstance(candidates, (str, bytes)):
        raise TypeError("candidates must be None (discover them), a list of role names, or a "
                        f"list of Role objects, got the string {candidates!r}: wrap it in a list")
    if candidates is None:
        return
    if not isinstance(candidates, Sequence):
        raise TypeError("candidates must be None (discover them), a list of role names, or a "
                        f"list of Role objects, got {type(candidates).__name__}")
    if not candidates:
        raise ValueError("candidates is empty, so there is nothing to measure: pass None to "
                         "discover the roles, or name at least one")
    if all(isinstance(c, str) for c in candidates):
        _check_once(list(candidates))
        return
    for i, role in enumerate(candidates):
        if not isinstance(role, Role):
            raise TypeError(f"candidates[{i}] must be a Role (from tuning.candidates() or "
                            f"tuning.roles_from_plan()) or a role name, got "
                            f"{type(role).__name__}")
    _check_once([role.name for role in candidates])
    _check_weights_of(model, candidates)


def resolve_roles(model: Any, step: Callable[[int], Any], batch: int,
                  candidates: object, min_bytes: int) -> list[Role]:
    """tune()'s ``candidates``, already checked (:func:`check_candidates`, before the
    step first ran): None, the roles :func:`find_roles` discovers from ``step(batch)``
    (:func:`discovery_step`); role names, those of them; :class:`Role` objects, as
    given."""
    if candidates is None or all(isinstance(c, str) for c in candidates):
        # a compiled step: the same modules and weights, read from the eager module tree
        roles = find_roles(model, discovery_step(step, batch), min_bytes=min_bytes)
        if candidates is None:
            return roles
        known = {role.name: role for role in roles}
        unknown = [c for c in candidates if c not in known]
        if unknown:
            raise ValueError(f"unknown role(s) {role_hints(unknown, list(known))}; this "
                             "model's roles are: " + "; ".join(map(repr, known)))
        return [known[c] for c in candidates]
    return list(candidates)


def _check_once(names: Sequence[str]) -> None:
    twice = sorted(n for n in set(names) if names.count(n) > 1)
    if twice:
        raise ValueError(f"candidates name a role twice: {twice}: give each once")


def _check_weights_of(model: Any, roles: Sequence[Role]) -> None:
    """Given Role objects fork at ``model``'s modules and load its memory (its tensors,
    or views of them, by storage): a role found in another model would measure that
    model's weights under this one's hooks."""
    module = compiled_module(model)
    modules = dict(module.named_modules())
    own = {_storage(t) for t in named_tensors(module).values()}
    for i, role in enumerate(roles):
        for s in role.sites:
            if s.site not in modules:
                raise ValueError(f"candidates[{i}] ({role.name!r}) forks at {s.site!r}, which "
                                 "is not a module of this model: pass roles found in the "
                                 "model tuned (tuning.candidates(model, ...))")
            if any(_storage(w) not in own for w in s.weights):
                raise ValueError(f"candidates[{i}] ({role.name!r}) loads a tensor whose memory "
                                 f"is not this model's (layer {s.layer}): pass roles found in "
                                 "the model tuned, whose weights are its tensors or views of "
                                 "them")


def _storage(t: Any) -> Any:
    """Where a tensor's memory lives: (device, its storage's address), or the object
    itself where it has none (a storageless wrapper: only itself matches)."""
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (AttributeError, RuntimeError, NotImplementedError):
        return id(t)


def role_hints(unknown: Iterable[str], names: Sequence[str]) -> str:
    """Role names a model lacks, each with the closest of ``names`` it has, for a
    message: "'x' (closest: 'y')"."""
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, list(names), n=2)
        hints.append(f"{name!r}" + (f" (closest: {', '.join(map(repr, close))})" if close
                                    else ""))
    return ", ".join(hints)


def describe_roles(roles: Sequence[Role], cap: Optional[int] = None) -> str:
    """The candidate roles as a Markdown table (name, layers, largest load: what one fork
    can load, at most ``cap`` bytes, the largest cap the tuner tries; a chain ends with
    the whole read that reaches :data:`DEFAULT_MAX_BYTES`, so it may hold more)."""
    lines = ["| role | layers | largest load |", "|---|---:|---:|"]
    for role in roles:
        most = role.max_bytes if cap is None else min(role.max_bytes, cap)
        lines.append(f"| {role.name} | {len(role.sites)} | {describe_bytes(most)} |")
    return "\n".join(lines) + "\n"


def roles_from_plan(model: Any, plan: Iterable[Any], hook_points: Any) -> list[Role]:
    """Roles from a policy's plan and its hook points (``kimi_k3.plan(...,
    points=kimi_k3.POINTS)`` with ``kimi_k3.hook_points``, or the same for
    ``deepseek_v3``): one role per point, with the plan's weights and settings
    as defaults (per layer, the entry of the smallest batch).

    ``hook_points`` is what :func:`l2prefetch.hooks.attach` takes: a mapping of
    point to ``[(module, layer)]`` or a callable ``model -> mapping``.
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    model = compiled_module(model)   # torch.compile(model): the paths tune measures in
    points = hook_points(model) if callable(hook_points) else hook_points
    if not hasattr(points, "items"):
        raise TypeError("hook_points must map point names to [(module, layer)] or be a "
                        f"callable returning that, got {type(points).__name__}")
    names = {module: name for name, module in model.named_modules()}
    sites_of: dict[tuple[str, int], tuple[str, str]] = {}
    for point, sites in points.items():
        sites = sites(model) if callable(sites) else sites
        for module, layer, *hook in sites:       # (module, layer) or (module, layer, hook)
            if module not in names:
                raise ValueError(f"hook_points[{point!r}]: a {type(module).__name__} at layer "
                                 f"{layer} is not a submodule of the model")
            sites_of[(point, layer)] = (names[module], hook[0] if hook else DEFAULT_SITE_HOOK)
    param_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    by_point: dict[str, dict[int, PlanEntry]] = {}
    for i, entry in enumerate(plan):
        if not isinstance(entry, PlanEntry):
            raise TypeError(f"plan[{i}] must be a PlanEntry, not {type(entry).__name__}")
        layers = by_point.setdefault(entry.point, {})
        kept = layers.get(entry.layer)
        if kept is None or min(entry.batches) < min(kept.batches):
            layers[entry.layer] = entry
    roles = []
    for point, layers in by_point.items():
        sites = []
        for layer, entry in sorted(layers.items()):
            found = sites_of.get((point, layer))
            if found is None:
                raise ValueError(f"plan point {point!r} at layer {layer} has no hook site in "
                                 "hook_points: pass the policy's hook_points with the same "
                                 "points= as its plan")
            site, hook = found
            nbytes = tuple(t.numel() * t.element_size() for t in entry.weights)
            reads = tuple(param_names.get(id(t), "?") for t in entry.weights)
            sites.append(RoleSite(layer=layer, site=site, reads=reads, weights=entry.weights,
                                  nbytes=nbytes, hook=hook))
        first = next(iter(layers.values()))
        defaults = (("byte_cap", first.byte_cap), ("grid", first.grid),
                    ("carveout", first.carveout), ("priority", first.priority))
        site_rel = layer_of(sites[0].site)[1]
        roles.append(Role(name=point, consumer=point, site=site_rel, kind="policy",
                          next_layer=False, sites=tuple(sites), defaults=defaults))
    return roles


def describe_bytes(n: float) -> str:
    """Bytes for people: '16.0 MiB', '512 KiB'."""
    if n >= MIB:
        return f"{n / MIB:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.0f} KiB"
    return f"{int(n)} B"

