"""Profiles: a tuned plan as a file, refused where it was not measured.

This module owns the format and alone knows its field names: it puts a profile
together (:func:`profile_document`, from the plan, sites and records the tuner
hands it), writes it (:func:`save_profile`; both called by
:meth:`l2prefetch.tuning.TuneResult.save`), reads, checks and fingerprints it,
and belongs to the runtime: a server that loads a profile imports no tuner code.
The tuner's settings and measurements (``"tuning"``, ``"results"``) are its own
records, stored as given; of them the runtime reads only each result's batch and
``spread.recommended_k`` (:attr:`Profile.capture_k`).
A profile is JSON written by :meth:`TuneResult.save`: the device it was
tuned on (name, compute capability, SMs, L2 size, driver), the versions
(l2prefetch, torch, NVRTC), a fingerprint of the model (its class, its
decoder layer count, the path, shape and dtype of every weight the plan
names, and the other names of those it ties: ``"tied"``, absent in profiles
written before), how the tuned step ran (``"step"``: eager, or compiled by
``torch.compile`` with its Inductor mode, and the torch version), the batches,
the plan (weights and fork sites by module path, every per-entry setting) and
every measurement behind it.  A profile without ``"step"`` was written before
the tuner measured compiled steps, so it was tuned eagerly.

:func:`load_profile` checks the fingerprints before anything is prepared:
another GPU or another model is a :class:`ProfileMismatchError` that says
what differs, never a plan applied silently.  Version differences are logged
as warnings (the plan still applies; tune again to be sure).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import sys
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

from . import _C, _torch
from ._files import check_output, loads_json, read_text, write_atomic
from ._version import __version__
from .disable import disabled
from .mechanisms import DEFAULT_SITE_HOOK, SITE_HOOKS, site_entry, site_hook_choices
from .model_paths import compiled_module, layer_count, layer_of, named_tensors, tensor_paths
from .plan import MAX_BATCH, MAX_LAYER, PlanEntry, check_settings, shown

__all__ = ["EAGER_STEP", "PROFILE_FORMAT", "PROFILE_VERSION", "Profile",
           "ProfileMismatchError", "STEP_KEYS", "StepMismatchError", "check_step",
           "describe_step", "device_fingerprint", "load_profile", "model_fingerprint",
           "parse_profile", "profile_batches", "profile_document", "profile_step",
           "save_profile", "step_compiled", "step_mode", "step_record"]

logger = logging.getLogger(__name__)

PROFILE_FORMAT = "l2prefetch-profile"
PROFILE_VERSION = 1
#: Device fields that must match for a profile to apply.
DEVICE_KEYS = ("name", "sm", "sm_count", "l2_bytes")
#: A profile's fields, in the order written (``created``, ``versions``, ``step``,
#: ``tuning`` and ``results`` may be absent).
DOCUMENT_KEYS = ("format", "version", "created", "device", "versions", "step", "model",
                 "batches", "plan", "tuning", "results")
#: The fields of a plan entry (``hook`` absent: after the module; the settings absent or
#: null: PlanEntry's defaults).
#: An entry's settings: PlanEntry's fields after its weights (plan.check_settings).
SETTING_KEYS = ("byte_cap", "grid", "carveout", "priority", "kernel", "graph_fork",
                "warm_activation")
ENTRY_KEYS = ("point", "layer", "batches", "weights", "site", "hook", *SETTING_KEYS)
#: The fields of ``model`` (the fingerprint) and of ``device`` (DEVICE_KEYS, and the
#: driver, which only warns where it differs).
MODEL_KEYS = ("class", "layers", "weights", "tied")
DEVICE_FIELDS = (*DEVICE_KEYS, "driver_version")


class ProfileMismatchError(ValueError):
    """A profile was tuned on another device or another model."""


class StepMismatchError(ProfileMismatchError):
    """A profile tuned on an eager step forks in compiled code, or the reverse.

    Raised where the library can tell how the step runs: by where a fork runs.  A
    fork that ``torch.compile`` traced runs as the ``l2prefetch::fork`` op in the
    compiled code (:mod:`l2prefetch.ops`); a fork from a hook that ran eagerly is
    an eager step's (a graph break that leaves a hooked module outside the
    compiled code makes its forks eager ones).  Only a fork that would launch is
    refused (:func:`check_step`): a disabled controller's, or an ``eager=False`` one's
    outside a capture, does nothing and passes.  The Inductor mode is recorded and
    shown, and a profile must name one the tuner measures; a fork does not check it:
    nothing at a fork tells one mode from another.
    """


#: The fields of ``step``: how the tuned step ran (:func:`step_record`).
STEP_KEYS = ("compiled", "mode", "torch")
#: How a step ran that a profile without a ``"step"`` field was tuned on.
EAGER_STEP = {"compiled": False, "mode": None, "torch": None}
#: The Inductor modes a compiled step is tuned in (``tune(compiled=MODE)``, ``--compile
#: MODE``), the ``"step"``'s ``"mode"``: those that leave CUDA graphs to the caller (the
#: tuner captures the step itself, as a server does).
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


def step_record(compiled: bool, mode: Optional[str] = None) -> dict:
    """The profile's ``"step"`` field: eager or compiled, the Inductor mode (None:
    eager, or not known), this torch's version."""
    try:
        import torch

        version: Optional[str] = torch.__version__
    except ImportError:  # pragma: no cover - the tuner needs torch
        version = None
    return {"compiled": bool(compiled), "mode": mode if compiled else None,
            "torch": version}


def step_compiled(step: Optional[Mapping]) -> bool:
    """Whether a ``"step"`` record says the step ran in compiled code (None: eager)."""
    return bool(step and step.get("compiled"))


def step_mode(step: Optional[Mapping]) -> Optional[str]:
    """The Inductor mode a ``"step"`` record names (None: eager, or not recorded)."""
    return step.get("mode") if step_compiled(step) else None


def describe_step(step: Mapping) -> str:
    """``"eager"`` or ``"compiled (torch.compile, mode default, torch 2.11.0)"``."""
    if not step_compiled(step):
        return "eager"
    mode = step_mode(step)
    return ("compiled (torch.compile, mode " + (mode if mode else "not recorded")
            + (f", torch {step['torch']}" if step.get("torch") else "") + ")")


def check_step(step: Optional[Mapping], compiled: bool, controller: Any = None) -> None:
    """Raise :class:`StepMismatchError` unless a fork that runs ``compiled`` (in code
    torch.compile made, or eagerly) matches the profile's ``step`` (None: a controller
    not made from a profile, which is not checked).

    Given the ``controller`` the fork goes to, only a fork that would launch is
    refused: none of a disabled controller (L2PREFETCH_DISABLE), none of an
    ``eager=False`` one outside a CUDA graph capture, where its fork does nothing.  So
    a server that runs its prefill another way than its captured decode step (SGLang
    and ``generate`` compile only the decode) works, and the captured step is still
    checked."""
    if step is None or step_compiled(step) == compiled:
        return
    if controller is not None and not _launches(controller):
        return
    if compiled:
        raise StepMismatchError(
            "l2prefetch: this controller's profile was tuned on an eager step, but this fork "
            "runs in code torch.compile made; Inductor fuses away the kernels the eager "
            "forks were placed between, so the plan can make the compiled step slower: tune "
            "the compiled step (python -m l2prefetch tune MODEL --compile), or run the step "
            "eagerly")
    raise StepMismatchError(
        f"l2prefetch: this controller's profile was tuned on a {describe_step(step)} step, "
        "but this fork runs eagerly (its hook was not traced by torch.compile: an eager "
        "step, or a graph break before the hooked module); tune the eager step (python -m "
        "l2prefetch tune MODEL, without --compile), or compile the step as it was tuned")


def _launches(controller: Any) -> bool:
    """Whether ``controller.fork`` would launch now: enabled, and eager or on a stream
    being captured (torch's current stream on the controller's device, the one the fork
    takes).  An object without ``enabled`` or ``eager`` (any object serves the ops)
    counts as launching.  A closed controller's fork launches nothing: it raises, saying
    it is closed."""
    if not getattr(controller, "enabled", True) or getattr(controller, "closed", False) is True:
        return False
    if getattr(controller, "eager", True):
        return True
    torch = sys.modules.get("torch")   # the hooks and ops imported it; else none captures
    if torch is None or not torch.cuda.is_available():
        return False
    device = getattr(controller, "device", None)   # an index, 'cuda:1', a torch.device
    if device is not None and type(device) is not int:
        try:
            found = torch.device(device)
        except (TypeError, RuntimeError):
            found = None
        device = found.index if found is not None and found.type == "cuda" else None
    if device is not None and not 0 <= device < torch.cuda.device_count():
        return True   # no such GPU here: its fork cannot be a no-op, so it counts
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        return bool(torch.cuda.is_current_stream_capturing())


def device_fingerprint(device: Any = None) -> dict:
    """What a profile records of a CUDA device: name, sm (e.g. 90), SMs, L2
    bytes and the driver version (needs torch with CUDA and the driver).

    ``device`` is what the controller takes (None: torch's current device, an
    index, 'cuda:N', a torch.device): another value is a TypeError/ValueError
    naming it; no driver, or a torch that sees no GPU (the device's name comes
    from torch), a :class:`l2prefetch.CudaUnavailableError`; without torch, a
    ModuleNotFoundError naming the extra to install.
    """
    torch = _torch.require("l2prefetch.profile.device_fingerprint")

    # The driver's view first: it checks the argument as the controller does.
    info = _C.device_info(device)
    index = info["device"]
    if not torch.cuda.is_available():
        raise _C.CudaUnavailableError(
            f"torch {torch.__version__} sees no CUDA device (a CPU-only build?), so the name "
            f"of cuda:{index}, which a profile is checked against, cannot be read: use a CUDA "
            "build of torch, or load_profile(..., check_device=False) to read the profile "
            "without its GPU")
    props = torch.cuda.get_device_properties(index)
    return {"name": props.name, "sm": info["sm"], "sm_count": info["sm_count"],
            "l2_bytes": info["l2_bytes"], "driver_version": info["driver_version"]}


def model_fingerprint(model: Any, weights: Any = ()) -> dict:
    """The model's class, decoder layer count, path -> [shape, dtype] of ``weights``
    (paths of tensors in the model), and where the model ties some of ``weights``,
    ``tied``: path -> the other names of that tensor (a plan names a tied tensor by its
    first name, which an untied model of the same shapes also has)."""
    tensors = named_tensors(model)
    names: dict[int, list[str]] = {}
    for name, t in tensors.items():
        names.setdefault(id(t), []).append(name)
    described, tied = {}, {}
    for path in weights:
        t = tensors.get(path) if isinstance(path, str) else None
        if t is None:
            raise ValueError(f"weights holds {_show(path)}, which is not a tensor path of the "
                             "model (a name from named_parameters() or named_buffers())")
        described[path] = [list(t.shape), str(t.dtype).replace("torch.", "")]
        others = sorted(n for n in names[id(t)] if n != path)
        if others:
            tied[path] = others
    found = {"class": type(model).__name__, "layers": layer_count(model),
             "weights": described}
    if tied:   # only where some weight is tied: a release before it reads the rest
        found["tied"] = tied
    return found


def versions() -> dict:
    """l2prefetch, torch and NVRTC versions (NVRTC where it can be loaded)."""
    out = {"l2prefetch": __version__}
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:  # pragma: no cover - the tuner needs torch
        out["torch"] = None
    try:
        info = _C.nvrtc_info()
        out["nvrtc"] = ".".join(str(x) for x in info.get("version", ())) or None
    except Exception:  # noqa: BLE001 - a profile can be written without NVRTC details
        out["nvrtc"] = None
    return out


@dataclasses.dataclass
class Profile:
    """A loaded profile: its raw data, the plan resolved in a model and the fork sites.

    The plan holds the tensors of the model it was resolved in, so the profile
    is bound to that model: :meth:`hook_points` and
    :meth:`~l2prefetch.PrefetchController.from_profile` refuse another one
    (even of the same shapes; load the profile for each model).  ``model`` is
    a weak reference to it (None for a profile made by hand: then the plan's
    weights must be the model's tensors).
    """

    data: dict
    plan: list
    sites: dict[str, list[tuple]]
    path: Optional[str] = None
    model: Optional[weakref.ref] = dataclasses.field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        """One line: the file, the GPU, the step, the plan's size; not the data (a run's
        trials make it 100 KB, too much for a log line)."""
        try:
            step = self.step
            how = ("eager" if not step.get("compiled") else
                   f"compiled ({step['mode']})" if step.get("mode") else "compiled")
            device = self.data.get("device")
            name = device.get("name") if isinstance(device, Mapping) else None
            return (f"Profile(path={self.path!r}, device={name!r}, step={how}, "
                    f"entries={len(self.plan)}, points={sorted(self.sites, key=str)!r})")
        except Exception:   # a hand-made profile missing fields: a repr never raises
            return object.__repr__(self)

    def check_model(self, model: Any) -> None:
        """Raise :class:`ProfileMismatchError` unless ``model`` is the model this profile's
        plan was resolved in."""
        model = compiled_module(model)
        where = f"profile {self.path}" if self.path else "this profile"
        fix = ("its plan holds that model's weights and its sites are that model's "
               "modules: load the profile for this model (tuning.load_profile(path, model))")
        if self.model is not None:
            bound = self.model()
            if bound is not model:
                what = ("a model that no longer exists" if bound is None
                        else f"another {type(bound).__name__} object")
                raise ProfileMismatchError(f"{where} was loaded for {what}, not this "
                                           f"{type(model).__name__}: {fix}")
            # The same object, but changed since (model.half(), weights assigned anew):
            # its fingerprint again, and below, whether the plan still holds its tensors.
            _check_model(self.data, model, self.path if self.path else "(loaded)")
        mine = {id(t) for t in named_tensors(model).values()}
        for i, entry in enumerate(self.plan):
            if any(id(w) not in mine for w in entry.weights):
                raise ProfileMismatchError(f"{where}: plan[{i}] ({_show(entry.point)}, layer "
                                           f"{entry.layer}) holds weights that are not this "
                                           f"{type(model).__name__}'s: {fix}")

    def check_device(self, device: Any = None) -> None:
        """Raise :class:`ProfileMismatchError` unless this profile was tuned on a GPU like
        ``device`` (what :func:`load_profile` checks; one loaded with
        ``check_device=False`` is checked here before it is applied)."""
        _check_device(self.data, device, self.path if self.path else "(loaded)")

    @property
    def batches(self) -> list[int]:
        return list(self.data["batches"])

    @property
    def weight_paths(self) -> list[list[str]]:
        """Each plan entry's weights by their paths in the model, in plan order."""
        return [list(raw["weights"]) for raw in self.data["plan"]]

    @property
    def step(self) -> dict:
        """How the tuned step ran: ``{"compiled": bool, "mode": str or None, "torch":
        str or None}`` (:data:`EAGER_STEP` for a profile written before this field)."""
        return profile_step(self.data)

    @property
    def device(self) -> dict:
        return dict(self.data["device"])

    @property
    def empty(self) -> bool:
        return not self.plan

    @property
    def capture_k(self) -> dict[int, int]:
        """Per batch the tuner measured the spread at, how many captures of the step to
        keep the fastest of (:func:`l2prefetch.graphs.capture_fastest`; 1: not worth it).
        Batches without a measured spread (profiles written before it) are absent."""
        out = {}
        for result in self.data.get("results", ()):
            spread = result.get("spread")
            if spread is not None:
                out[result["batch"]] = spread["recommended_k"]
        return out

    def hook_points(self, model: Any) -> dict[str, list[tuple]]:
        """``point -> [(module, layer)]`` (``(module, layer, "before")`` for a site
        hooked before its module) for :func:`l2prefetch.hooks.attach` (``model``
        must be the profile's own: :meth:`check_model`)."""
        model = compiled_module(model)
        self.check_model(model)
        return {point: [(model.get_submodule(path) if path else model, *rest)
                        for path, *rest in sites] for point, sites in self.sites.items()}


_show = shown   # a value for a message: its repr, shortened (a field may hold megabytes)


def _cut(value: Any, limit: int = 200) -> str:
    """``str(value)`` for a message, cut to about ``limit`` characters as :func:`_show`
    cuts a repr (a profile's path, shape or dtype may hold megabytes)."""
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-(limit // 2):]}"


def _fail(where: str, what: str) -> ValueError:
    return ValueError(f"profile {where}: {what}; write it again with `python -m l2prefetch tune`")


def _kind(kind: Union[type, tuple]) -> str:
    names = {int: "an int", str: "a str", dict: "an object", list: "a list", type(None): "null"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _check_known(data: Mapping, known: Sequence[str], place: str, where: str) -> None:
    """Refuse a field this version does not write (a misspelt ``step`` would read as an
    eager profile); ``place``: the fields' parent in the file (``model.``)."""
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise _fail(where, f"unknown fields {_show([place + k for k in unknown])} (this "
                    f"version reads {_show([place + k for k in known])})")


def _require(data: Mapping, key: str, kind: Union[type, tuple], where: str,
             place: str = "") -> Any:
    """``data[key]``, which must be of ``kind`` (bool is no int); ``place`` is the field's
    parent in the file (``model.``) for the message."""
    if key not in data:
        raise _fail(where, f"missing {place + key!r}")
    value = data[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kind):
        raise _fail(where, f"{place + key!r} must be {_kind(kind)}, got {_show(value)}")
    return value


def _int_in(value: Any, low: int, high: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and low <= value <= high


def _check_fingerprint(weights: dict, where: str) -> None:
    """model.weights: path -> [shape (ints >= 0), dtype name]."""
    for path, described in weights.items():
        if not (isinstance(described, list) and len(described) == 2
                and isinstance(described[0], list)
                and all(_int_in(n, 0, 2**63 - 1) for n in described[0])
                and isinstance(described[1], str) and described[1]):
            raise _fail(where, f"'model.weights'[{_show(path)}] must be [shape, dtype] (a list "
                        f"of ints >= 0 and a dtype name such as \"bfloat16\"), got "
                        f"{_show(described)}")


def _check_tied(tied: dict, weights: dict, where: str) -> None:
    """model.tied: a path of model.weights -> the other names of that tensor."""
    for path, others in tied.items():
        if path not in weights:
            raise _fail(where, f"'model.tied' names {_show(path)}, which is not in "
                        "'model.weights'")
        if not (isinstance(others, list) and others
                and all(isinstance(n, str) and n and n != path for n in others)):
            raise _fail(where, f"'model.tied'[{_show(path)}] must be a non-empty list of the "
                        f"tensor's other names, got {_show(others)}")


def _settings(entry: dict) -> dict:
    """An entry's settings as PlanEntry's keyword arguments (null: the default)."""
    return {k: entry[k] for k in SETTING_KEYS if entry.get(k) is not None}


def _check_entry(i: int, entry: Any, data: dict, tuned: set, owner: dict, where: str) -> None:
    """plan[i]: its fields, and that it agrees with the rest of the file.  ``owner`` maps
    each (point, layer, batch) already planned to the entry that plans it, and each
    (point, layer) to its first entry (one hook per point and layer, whatever the batch)."""
    if not isinstance(entry, dict):
        raise _fail(where, f"plan[{i}] must be an object, got {_show(entry)}")
    missing = [k for k in ("point", "layer", "batches", "weights", "site") if k not in entry]
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if missing or unknown:
        raise _fail(where, f"plan[{i}]: missing fields {missing}, unknown fields {unknown}")
    point, layer, batches = entry["point"], entry["layer"], entry["batches"]
    if not isinstance(point, str) or not point or not point.isprintable():
        raise _fail(where, f"plan[{i}].point must be a non-empty str of printable characters, "
                    f"got {_show(point)}")
    if not _int_in(layer, 0, MAX_LAYER):
        raise _fail(where, f"plan[{i}].layer must be an int in 0..{MAX_LAYER}, got "
                    f"{_show(layer)}")
    names = entry["weights"]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise _fail(where, f"plan[{i}].weights must be a non-empty list of weight paths, "
                    f"got {_show(names)}")
    repeated = sorted(n for n, count in collections.Counter(names).items() if count > 1)
    if repeated:
        raise _fail(where, f"plan[{i}].weights lists {_show(repeated)} more than once (a prefetch "
                    "loads each weight once)")
    absent = [n for n in names if n not in data["model"]["weights"]]
    if absent:
        raise _fail(where, f"plan[{i}].weights {_show(absent)} are not in the model fingerprint "
                    "('model.weights')")
    site = entry["site"]
    if not isinstance(site, str):
        raise _fail(where, f"plan[{i}].site must be a module path, got {_show(site)}")
    hook = entry.get("hook", DEFAULT_SITE_HOOK)
    if not isinstance(hook, str) or hook not in SITE_HOOKS:
        raise _fail(where, f"plan[{i}].hook must be {site_hook_choices()} (absent: "
                    f"{DEFAULT_SITE_HOOK!r}), got {_show(hook)}")
    try:
        check_settings(**_settings(entry))
    except (TypeError, ValueError) as exc:
        raise _fail(where, f"plan[{i}] is not a valid plan entry: {exc}") from None
    site_layer = layer_of(site)[0]
    if site_layer is not None and site_layer != layer:
        raise _fail(where, f"plan[{i}].site {_show(site)} is in layer {site_layer}, but the "
                    f"entry is for layer {layer}")
    first = owner.setdefault((point, layer), i)
    if first != i:
        theirs = data["plan"][first]
        if (theirs["site"], theirs.get("hook", DEFAULT_SITE_HOOK)) != (site, hook):
            raise _fail(where, f"plan[{first}] and plan[{i}] fork at point {_show(point)}, "
                        f"layer {layer} from different sites ({_show(theirs['site'])} "
                        f"{theirs.get('hook', DEFAULT_SITE_HOOK)}, {_show(site)} {hook}): the "
                        "hooks of a point and layer serve all its batches")
    if not isinstance(batches, list) or not batches:
        raise _fail(where, f"plan[{i}].batches must be a non-empty list of the profile's "
                    f"batches, got {_show(batches)}")
    for batch in batches:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch not in tuned:
            raise _fail(where, f"plan[{i}].batches holds {_show(batch)}, which is not one of "
                        f"the profile's batches {_show(data['batches'])}")
        key = (point, layer, batch)
        if key in owner:
            raise _fail(where, f"plan[{owner[key]}] and plan[{i}] both prefetch at point "
                        f"{_show(point)}, layer {layer}, batch {batch} (one entry per point, "
                        "layer and batch)")
        owner[key] = i


def parse_profile(text: str, where: str = "<text>") -> dict:
    """Check a profile's structure and that it agrees with itself (not its fit to a model
    or device) and return its data.  Every error is a ValueError naming the file
    (``where``) and the field."""
    try:
        data = loads_json(text, f"profile {where}")
    except (json.JSONDecodeError, RecursionError) as exc:
        raise _fail(where, f"is not valid JSON ({exc}); it may be truncated") from None
    except ValueError as exc:  # a key twice, a number too long: named by loads_json
        raise ValueError(f"{exc}; write it again with `python -m l2prefetch tune`") from None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise _fail(where, f"is not an l2prefetch profile (no \"format\": "
                    f"\"{PROFILE_FORMAT}\")")
    version = data.get("version")
    if version != PROFILE_VERSION or type(version) is not int:   # not True, not 1.0
        raise _fail(where, f"has version {_show(version)}; this l2prefetch reads version "
                    f"{PROFILE_VERSION}")
    _check_known(data, DOCUMENT_KEYS, "", where)
    device = _require(data, "device", dict, where)
    _check_known(device, DEVICE_FIELDS, "device.", where)
    for key in DEVICE_KEYS:
        value = _require(device, key, str if key == "name" else int, where, "device.")
        if key != "name" and not _int_in(value, 0, 2**63 - 1):
            raise _fail(where, f"'device.{key}' must be an int >= 0, got {_show(value)}")
    if "driver_version" in device:
        _require(device, "driver_version", (int, type(None)), where, "device.")
    model = _require(data, "model", dict, where)
    _check_known(model, MODEL_KEYS, "model.", where)
    if "class" in model:
        _require(model, "class", str, where, "model.")
    layers = _require(model, "layers", int, where, "model.")
    if not _int_in(layers, 0, 2**63 - 1):
        raise _fail(where, f"'model.layers' must be an int >= 0, got {_show(layers)}")
    _check_fingerprint(_require(model, "weights", dict, where, "model."), where)
    if "tied" in model:   # absent: a profile written before it was recorded
        _check_tied(_require(model, "tied", dict, where, "model."), model["weights"], where)
    if "versions" in data:
        found = _require(data, "versions", dict, where)
        for key, value in found.items():
            if value is not None and not isinstance(value, str):
                raise _fail(where, f"'versions'[{key!r}] must be a version string or null, "
                            f"got {_show(value)}")
    if "step" in data:
        _check_step(_require(data, "step", dict, where), where)
    batches = _require(data, "batches", list, where)
    if not batches or not all(_int_in(b, 1, MAX_BATCH) for b in batches):
        raise _fail(where, f"'batches' must be a non-empty list of ints in 1..{MAX_BATCH}, got "
                    f"{_show(batches)}")
    if len(set(batches)) != len(batches):
        raise _fail(where, f"'batches' names a batch more than once: {_show(batches)}")
    owner: dict = {}
    tuned = set(batches)
    for i, entry in enumerate(_require(data, "plan", list, where)):
        _check_entry(i, entry, data, tuned, owner, where)
    _check_capture_k(data, where)
    return data


def profile_batches(data: Mapping) -> tuple[list[int], list[int]]:
    """(the batches tuned at, the batches the plan forks at, sorted) of a profile's data
    (:func:`parse_profile`)."""
    forked = sorted({batch for entry in data["plan"] for batch in entry["batches"]})
    return list(data["batches"]), forked


def profile_step(data: Mapping) -> dict:
    """How the step a profile's data (:func:`parse_profile`) was tuned on ran
    (:attr:`Profile.step`; :data:`EAGER_STEP` for a profile written before the field)."""
    return dict(data.get("step", EAGER_STEP))


def _check_step(step: dict, where: str) -> None:
    compiled = _require(step, "compiled", bool, where, "step.")
    for key in ("mode", "torch"):
        _require(step, key, (str, type(None)), where, "step.")
    if not compiled and step["mode"] is not None:
        raise _fail(where, f"'step.mode' is {_show(step['mode'])} but 'step.compiled' is "
                    "false: an eager step has no compile mode")
    if step["mode"] is not None and step["mode"] not in COMPILE_MODES:
        raise _fail(where, f"'step.mode' is {_show(step['mode'])}: the tuner measures steps "
                    f"compiled in {' or '.join(map(repr, COMPILE_MODES))} (or null, "
                    "not named)")
    unknown = sorted(set(step) - {"compiled", "mode", "torch"})
    if unknown:
        raise _fail(where, f"'step' has unknown fields {_show(unknown)}")


#: The most captures a profile may advise keeping the fastest of.
MAX_CAPTURE_K = 64


def _check_capture_k(data: dict, where: str) -> None:
    """The part of the measurements the runtime reads: each result's batch and, where
    its spread was measured, ``spread.recommended_k`` (an int in 1..MAX_CAPTURE_K)."""
    if "results" not in data:
        return
    batches: dict = {}
    tuned = set(data["batches"])
    for i, result in enumerate(_require(data, "results", list, where)):
        if not isinstance(result, dict):
            raise _fail(where, f"'results'[{i}] must be an object, got {_show(result)}")
        batch = result.get("batch")
        if _int_in(batch, 1, 2**31 - 1):
            if batch in batches:
                raise _fail(where, f"'results'[{i}] is batch {batch} again (also "
                            f"'results'[{batches[batch]}]): one result per batch")
            batches[batch] = i
        spread = result.get("spread")
        if spread is None:
            continue
        name = f"'results'[{i}].spread"
        if not isinstance(spread, dict):
            raise _fail(where, f"{name} must be an object or null, got {_show(spread)}")
        if not _int_in(result.get("batch"), 1, 2**31 - 1) or \
                result["batch"] not in tuned:
            raise _fail(where, f"'results'[{i}].batch must be one of 'batches' "
                        f"{_show(data['batches'])}, got {_show(result.get('batch'))}")
        k = spread.get("recommended_k")
        if not _int_in(k, 1, MAX_CAPTURE_K):
            raise _fail(where, f"{name}.recommended_k must be an int in 1..{MAX_CAPTURE_K}, "
                        f"got {_show(k)}")


def _check_device(data: dict, device: Any, where: str) -> None:
    here = device_fingerprint(device)
    theirs = data["device"]
    diffs = [f"{key}: profile {_show(theirs[key])}, this device {_show(here[key])}"
             for key in DEVICE_KEYS if theirs[key] != here[key]]
    if diffs:
        raise ProfileMismatchError(
            f"profile {where} was tuned on another GPU (" + "; ".join(diffs) + "): what pays "
            "depends on the chip, so tune again on this one (python -m l2prefetch tune)")
    if theirs.get("driver_version") != here["driver_version"]:
        logger.warning("profile tuned with driver %s, this driver is %s: the plan applies; "
                       "tune again to be sure it still pays", theirs.get("driver_version"),
                       here["driver_version"])


def _check_step_torch(data: dict, where: str) -> None:
    """Warn where a compiled step's profile was tuned under another torch: Inductor's
    kernels, and with them what the forks between them save, can change with it."""
    step = data.get("step")
    theirs = step.get("torch") if step_compiled(step) else None
    if theirs is None:
        return
    try:
        import torch

        here: Optional[str] = torch.__version__
    except ImportError:   # nothing compiled runs here without torch
        return
    if theirs != here:
        logger.warning("profile %s was tuned on a step compiled by torch %s, this torch is "
                       "%s: Inductor's kernels, and what the plan's forks save between them, "
                       "may differ; the plan applies; tune again (python -m l2prefetch tune "
                       "--compile) to be sure it still pays", where, theirs, here)


def _check_model(data: dict, model: Any, where: str) -> None:
    fp = data["model"]
    here_layers = layer_count(model)
    diffs = []
    if "class" in fp and fp["class"] != type(model).__name__:
        diffs.append(f"class {_show(fp['class'])} in the profile, {type(model).__name__} here")
    if fp["layers"] != here_layers:
        diffs.append(f"{_show(fp['layers'])} decoder layers in the profile, {here_layers} in "
                     "this model")
    tensors = named_tensors(model)
    for path, described in fp["weights"].items():
        t = tensors.get(path)
        if t is None:
            diffs.append(f"{_cut(path)} is not in this model")
            continue
        shape, dtype = list(t.shape), str(t.dtype).replace("torch.", "")
        if [shape, dtype] != list(described):
            diffs.append(f"{_cut(path)} is {shape} {dtype} here, {_cut(described[0])} "
                         f"{_cut(described[1])} in the profile")
        untied = [n for n in fp.get("tied", {}).get(path, ()) if tensors.get(n) is not t]
        if untied:   # the plan's loads would land on this name's tensor, not theirs
            diffs.append(f"{_cut(path)} is also {_show(untied)} in the profile (tied), "
                         "not here")
        if len(diffs) >= 5:
            diffs.append("...")
            break
    if diffs:
        raise ProfileMismatchError(f"profile {where} was tuned on another model ("
                                   + "; ".join(diffs)
                                   + "): tune this model (python -m l2prefetch tune)")


def load_profile(source: Union[str, os.PathLike], model: Any, *, device: Any = None,
                 check_device: bool = True) -> Profile:
    """Read a profile and resolve its plan in ``model``.

    Raises ValueError for a file that is not a well-formed profile (corrupt,
    truncated, another version, a field that contradicts another) or not a
    regular file, naming the file and the field; :class:`ProfileMismatchError`
    (a ValueError) when it was tuned on another device (unless
    ``check_device=False``, for inspecting a profile without its GPU) or
    another model, naming what differs; a bad ``device`` as the controller
    does, and :class:`l2prefetch.CudaUnavailableError` without a GPU to check
    (see :func:`device_fingerprint`); OSError from reading the file.  Logs a
    warning, and loads, where the driver differs from the one it was tuned with, or
    a compiled step's profile names another torch version.  The
    profile is bound to ``model`` (:meth:`Profile.check_model`).  With
    L2PREFETCH_DISABLE set the device is not checked here (nothing will be prepared;
    :meth:`~l2prefetch.PrefetchController.from_profile` checks it on an enabled
    controller), the file and the model are.
    """
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"source must be the profile's path (str or os.PathLike), got "
                        f"{type(source).__name__}")
    where = os.fspath(source)
    model = compiled_module(model)   # torch.compile(model): the paths are its module's
    if not callable(getattr(model, "named_modules", None)):
        raise TypeError(f"model must be the torch.nn.Module the profile was tuned for, got "
                        f"{type(model).__name__}")
    data = parse_profile(read_text(where, "profile"), where)
    if check_device and disabled():   # a value it does not know: warned here too
        # prefetching is off: nothing is prepared, and a server started without a driver
        # (a CPU test run) must not fail here; from_profile checks the device again when
        # the controller it builds is enabled
        logger.info("L2PREFETCH_DISABLE is set: profile %s's device is not checked", where)
    elif check_device:
        _check_device(data, device, where)
    _check_model(data, model, where)
    _check_step_torch(data, where)
    tensors = named_tensors(model)
    modules = dict(model.named_modules())
    plan, sites, seen = [], {}, set()
    for i, raw in enumerate(data["plan"]):
        if raw["site"] not in modules:
            raise ProfileMismatchError(f"profile {where}: plan[{i}] forks at "
                                       f"{_show(raw['site'])}, which is not a module of this "
                                       "model")
        fields = _settings(raw)
        try:
            entry = PlanEntry(raw["point"], raw["layer"], raw["batches"],
                              tuple(tensors[n] for n in raw["weights"]), **fields)
        except (TypeError, ValueError) as exc:
            raise _fail(where, f"plan[{i}] is not a valid plan entry: {exc}") from exc
        plan.append(entry)
        site = site_entry(raw["site"], raw["layer"], raw.get("hook", DEFAULT_SITE_HOOK))
        if (raw["point"], site) not in seen:  # one hook per site and layer
            seen.add((raw["point"], site))
            sites.setdefault(raw["point"], []).append(site)
    mine = versions()
    for key, value in data.get("versions", {}).items():  # checked: str -> str or null
        if key in mine and mine[key] != value:
            logger.warning("profile written with %s %s, this is %s %s", key, value, key,
                           mine[key])
    logger.info("profile %s: %d entries over %d points for batches %s, tuned on the %s step",
                where, len(plan), len(sites), data["batches"],
                describe_step(data.get("step", EAGER_STEP)))
    return Profile(data=data, plan=plan, sites=sites, path=where, model=weakref.ref(model))


# ---------------------------------------------------------------------- writing

def _entry(entry: PlanEntry, weights: list[str], site: tuple) -> dict:
    """A plan entry's fields: its weights by path, its fork site ``(path,)`` or
    ``(path, hook)`` (no ``hook`` written for a site hooked after its module)."""
    path, *hook = site
    return {"point": entry.point, "layer": entry.layer, "batches": list(entry.batches),
            "weights": weights, "site": path, **({"hook": hook[0]} if hook else {}),
            "byte_cap": entry.byte_cap, "grid": entry.grid, "carveout": entry.carveout,
            "priority": entry.priority, "kernel": entry.kernel,
            "graph_fork": entry.graph_fork,
            **({"warm_activation": True} if entry.warm_activation else {})}


def profile_document(model: Any, plan: Sequence[PlanEntry], sites: Mapping[str, Sequence],
                     *, batches: Sequence[int], device: Optional[Mapping],
                     versions: Optional[Mapping], step: Mapping, tuning: Mapping,
                     results: Sequence) -> dict:
    """A profile's JSON object, for :func:`save_profile`.

    ``plan`` is the tuned plan (its weights must be ``model``'s tensors: they are
    stored by path), ``sites`` each point's fork sites (``(path, layer)`` or ``(path,
    layer, hook)``, as :attr:`Profile.sites`), ``batches`` the batches tuned at,
    ``device`` the :func:`device_fingerprint`, ``versions`` :func:`versions`, ``step``
    the :func:`step_record`; ``tuning`` (the tuner's settings) and ``results`` (its
    measurements, one record per batch) are stored as given.  A weight that is not
    ``model``'s, an entry without a site, or a site that is not a module path of
    ``model`` is a ValueError.
    """
    model = compiled_module(model)
    paths = tensor_paths(model)
    site_of = _sites_of(model, sites)
    entries, weight_paths = [], []
    for entry in plan:
        weights = []
        for weight in entry.weights:
            path = paths.get(id(weight))
            if path is None:
                raise ValueError(f"plan entry {entry.point!r} layer {entry.layer} holds a "
                                 "tensor that is not the model's: pass the tuned model")
            weights.append(path)
        weight_paths += weights
        site = site_of.get((entry.point, entry.layer))
        if site is None:
            raise ValueError(f"plan entry {entry.point!r} layer {entry.layer} has no site in "
                             f"sites[{entry.point!r}]: give each entry's (point, layer) the "
                             "module path it forks at")
        entries.append(_entry(entry, weights, site))
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "device": device, "versions": versions, "step": dict(step),
            "model": model_fingerprint(model, dict.fromkeys(weight_paths)),
            "batches": list(batches), "plan": entries, "tuning": dict(tuning),
            "results": list(results)}


def _sites_of(model: Any, sites: Mapping[str, Sequence]) -> dict:
    """``(point, layer) -> (path, *hook)`` from ``sites``, each path a module of
    ``model`` (as a profile is read: its forks hook modules)."""
    if not isinstance(sites, Mapping):
        raise TypeError(f"sites must map each point to its (path, layer[, hook]) sites, got "
                        f"{type(sites).__name__}")
    modules = dict.fromkeys(name for name, _ in model.named_modules())
    site_of = {}
    for point, point_sites in sites.items():
        for site in point_sites:
            if not isinstance(site, (tuple, list)) or len(site) not in (2, 3):
                raise ValueError(f"sites[{point!r}] holds {_show(site)}: each site is "
                                 "(path, layer) or (path, layer, hook)")
            path, layer, *hook = site
            if not isinstance(path, str) or path not in modules:
                raise ValueError(f"sites[{point!r}] holds {_show(path)}, which is not a "
                                 "module path of the model (a name from named_modules(): the "
                                 "profile's forks hook modules)")
            site_of[(point, layer)] = (path, *hook)
    return site_of


def _compact_json(value: Any, indent: str = "") -> str:
    """JSON with a member per line, but a list or object of scalars on one line: the
    profile's thousands of numbers take a line per interval or setting, not per number
    (run 11's profiles: 3.6x fewer lines).  Any JSON reader reads it, as the profile's
    reader reads the ``json.dumps(indent=1)`` files written before.  A NaN or infinity
    raises ValueError: JSON has none, and Python's reader accepts what others refuse."""
    members = value.values() if isinstance(value, dict) else value
    if not isinstance(value, (dict, list)) or not any(isinstance(m, (dict, list))
                                                        for m in members):
        return json.dumps(value, allow_nan=False)
    inner = indent + " "
    if isinstance(value, dict):
        # a key as json.dumps writes it: a string, other scalars as their JSON text
        items = [f"{inner}{json.dumps(k if isinstance(k, str) else json.dumps(k))}: "
                 f"{_compact_json(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    return "[\n" + ",\n".join(inner + _compact_json(v, inner) for v in value) + f"\n{indent}]"


def _non_finite(value: Any, where: str = "") -> Optional[str]:
    """Where the first NaN or infinity in ``value`` is (``results[1].step_us``), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where or 'the document'} = {value!r}"
    items = (value.items() if isinstance(value, Mapping) else
             enumerate(value) if isinstance(value, (list, tuple)) else ())
    for key, member in items:
        found = _non_finite(member, f"{where}[{key}]" if isinstance(key, int) else
                            f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


def save_profile(path: Union[str, os.PathLike], document: Mapping) -> None:
    """Write a profile's JSON object (:func:`profile_document`) to ``path``: checked
    against the format it will be read with, compact (:func:`_compact_json`), as a new
    file renamed into place (no planted link followed).  A NaN or infinity in it is a
    ValueError naming where (JSON has none); a value of no JSON type a TypeError."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike naming the profile file, got "
                        f"{type(path).__name__}")
    try:
        text = _compact_json(document)
    except ValueError as exc:
        raise ValueError(f"profile {os.fspath(path)}: {_non_finite(document) or 'a value'} "
                         f"is not a finite number, which JSON cannot hold (a bug: report "
                         f"it); nothing was written") from exc
    except TypeError as exc:   # a set, a module, a tensor in tuning= or results=, say
        raise TypeError(f"profile {os.fspath(path)}: {exc}; a profile holds only JSON's "
                        "types (dict, list, str, int, float, bool, None): nothing was "
                        "written") from None
    parse_profile(text, os.fspath(path))   # what is written is what load_profile accepts
    check_output(path, "profile")   # not a directory, a FIFO or a device
    write_atomic(path, text + "\n", "profile")
