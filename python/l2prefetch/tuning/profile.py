"""Profiles: a tuned plan as a file, refused where it was not measured.

A profile is JSON written by :meth:`TuneResult.save`: the device it was
tuned on (name, compute capability, SMs, L2 size, driver), the versions
(l2prefetch, torch, NVRTC), a fingerprint of the model (its class, its
decoder layer count, and the path, shape and dtype of every weight the plan
names), the batches, the plan (weights and fork sites by module path, every
per-entry setting) and every measurement behind it.

:func:`load_profile` checks the fingerprints before anything is prepared:
another GPU or another model is a :class:`ProfileMismatchError` that says
what differs, never a plan applied silently.  Version differences are logged
as warnings (the plan still applies; tune again to be sure).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from typing import Any, Optional, Union

__all__ = ["PROFILE_FORMAT", "PROFILE_VERSION", "Profile", "ProfileMismatchError",
           "device_fingerprint", "load_profile", "model_fingerprint"]

logger = logging.getLogger(__name__)

PROFILE_FORMAT = "l2prefetch-profile"
PROFILE_VERSION = 1
#: Device fields that must match for a profile to apply.
DEVICE_KEYS = ("name", "sm", "sm_count", "l2_bytes")
_ENTRY_KEYS = ("point", "layer", "batches", "weights", "site", "byte_cap", "grid", "carveout",
               "priority", "kernel", "graph_fork")


class ProfileMismatchError(ValueError):
    """A profile was tuned on another device or another model."""


def device_fingerprint(device: Any = None) -> dict:
    """What a profile records of a CUDA device: name, sm (e.g. 90), SMs, L2
    bytes and the driver version (needs torch with CUDA and the driver)."""
    import torch

    from .. import _C

    index = torch.device("cuda", torch.cuda.current_device()).index if device is None \
        else torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    info = _C.device_info(index)
    return {"name": props.name, "sm": info["sm"], "sm_count": info["sm_count"],
            "l2_bytes": info["l2_bytes"], "driver_version": info["driver_version"]}


def decoder_layers(model: Any) -> int:
    """How many decoder layers ``model`` has: the distinct indices that appear as
    the first all-digit component of its module paths."""
    from .discover import _layer_of

    return len({_layer_of(name)[0] for name, _ in model.named_modules()} - {None})


def model_fingerprint(model: Any, weights: Any = ()) -> dict:
    """The model's class, decoder layer count, and path -> [shape, dtype] of ``weights``
    (paths of tensors in the model)."""
    from ..plan import _named_tensors

    tensors = _named_tensors(model)
    described = {}
    for path in weights:
        t = tensors[path]
        described[path] = [list(t.shape), str(t.dtype).replace("torch.", "")]
    return {"class": type(model).__name__, "layers": decoder_layers(model),
            "weights": described}


def versions() -> dict:
    """l2prefetch, torch and NVRTC versions (NVRTC where it can be loaded)."""
    from .. import __version__, _C

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
    """A loaded profile: its raw data, the plan resolved in a model and the fork sites."""

    data: dict
    plan: list
    sites: dict[str, list[tuple[str, int]]]
    path: Optional[str] = None

    @property
    def batches(self) -> list[int]:
        return list(self.data["batches"])

    @property
    def device(self) -> dict:
        return dict(self.data["device"])

    @property
    def empty(self) -> bool:
        return not self.plan

    def hook_points(self, model: Any) -> dict[str, list[tuple[Any, int]]]:
        """``point -> [(module, layer)]`` for :func:`l2prefetch.hooks.attach`."""
        return {point: [(model.get_submodule(path) if path else model, layer)
                        for path, layer in sites] for point, sites in self.sites.items()}

    def controller(self, device: Any = None, *, eager: bool = False) -> Any:
        """A :class:`~l2prefetch.PrefetchController` with the profile's plan
        (``eager=False`` unless given: the tuner measured captured steps)."""
        from .rig import build_controller

        return build_controller(self.plan, device, eager=eager)


def _fail(where: str, what: str) -> ValueError:
    return ValueError(f"profile {where}: {what}; write it again with `python -m l2prefetch tune`")


def _require(data: Mapping, key: str, kind: Union[type, tuple], where: str) -> Any:
    if key not in data:
        raise _fail(where, f"missing {key!r}")
    value = data[key]
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise _fail(where, f"{key!r} must be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def parse_profile(text: str, where: str = "<text>") -> dict:
    """Check a profile's structure (not its fit to a model or device) and return its data."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise _fail(where, f"is not valid JSON ({exc}); it may be truncated") from None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise _fail(where, f"is not an l2prefetch profile (no \"format\": \"{PROFILE_FORMAT}\")")
    version = data.get("version")
    if version != PROFILE_VERSION or isinstance(version, bool):
        raise _fail(where, f"has version {version!r}; this l2prefetch reads version "
                    f"{PROFILE_VERSION}")
    device = _require(data, "device", dict, where)
    for key in DEVICE_KEYS:
        _require(device, key, str if key == "name" else int, where)
    model = _require(data, "model", dict, where)
    _require(model, "layers", int, where)
    weights = _require(model, "weights", dict, where)
    batches = _require(data, "batches", list, where)
    if not batches or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1
                              for b in batches):
        raise _fail(where, f"'batches' must be a non-empty list of ints >= 1, got {batches!r}")
    plan = _require(data, "plan", list, where)
    for i, entry in enumerate(plan):
        if not isinstance(entry, dict):
            raise _fail(where, f"plan[{i}] must be an object, got {entry!r}")
        missing = [k for k in ("point", "layer", "batches", "weights", "site") if k not in entry]
        unknown = sorted(set(entry) - set(_ENTRY_KEYS))
        if missing or unknown:
            raise _fail(where, f"plan[{i}]: missing fields {missing}, unknown fields {unknown}")
        names = entry["weights"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise _fail(where, f"plan[{i}]: 'weights' must be a list of module paths")
        absent = [n for n in names if n not in weights]
        if absent:
            raise _fail(where, f"plan[{i}]: weights {absent} are not in the model fingerprint")
        if not isinstance(entry["site"], str):
            raise _fail(where, f"plan[{i}]: 'site' must be a module path, got {entry['site']!r}")
    return data


def _check_device(data: dict, device: Any) -> None:
    here = device_fingerprint(device)
    theirs = data["device"]
    diffs = [f"{key}: profile {theirs[key]!r}, this device {here[key]!r}"
             for key in DEVICE_KEYS if theirs[key] != here[key]]
    if diffs:
        raise ProfileMismatchError(
            "this profile was tuned on another GPU (" + "; ".join(diffs) + "): what pays "
            "depends on the chip, so tune again on this one (python -m l2prefetch tune)")
    if theirs.get("driver_version") != here["driver_version"]:
        logger.warning("profile tuned with driver %s, this driver is %s: the plan applies; "
                       "tune again to be sure it still pays", theirs.get("driver_version"),
                       here["driver_version"])


def _check_model(data: dict, model: Any) -> None:
    from ..plan import _named_tensors

    fp = data["model"]
    here_layers = decoder_layers(model)
    diffs = []
    if fp["layers"] != here_layers:
        diffs.append(f"{fp['layers']} decoder layers in the profile, {here_layers} in this model")
    tensors = _named_tensors(model)
    for path, described in fp["weights"].items():
        t = tensors.get(path)
        if t is None:
            diffs.append(f"{path} is not in this model")
            continue
        shape, dtype = list(t.shape), str(t.dtype).replace("torch.", "")
        if [shape, dtype] != list(described):
            diffs.append(f"{path} is {shape} {dtype} here, {described[0]} {described[1]} in "
                         "the profile")
        if len(diffs) >= 5:
            diffs.append("...")
            break
    if diffs:
        raise ProfileMismatchError("this profile was tuned on another model (" + "; ".join(diffs)
                                   + "): tune this model (python -m l2prefetch tune)")


def load_profile(source: Union[str, os.PathLike], model: Any, *, device: Any = None,
                 check_device: bool = True) -> Profile:
    """Read a profile and resolve its plan in ``model``.

    Raises ValueError for a file that is not a well-formed profile (corrupt,
    truncated, another version), :class:`ProfileMismatchError` (a ValueError)
    when it was tuned on another device (unless ``check_device=False``, for
    inspecting a profile without its GPU) or another model, naming what
    differs; OSError from reading the file.
    """
    from ..plan import PlanEntry, _named_tensors

    where = os.fspath(source)
    with open(where, encoding="utf-8") as f:
        text = f.read()
    data = parse_profile(text, where)
    if check_device:
        _check_device(data, device)
    _check_model(data, model)
    tensors = _named_tensors(model)
    modules = dict(model.named_modules())
    plan, sites = [], {}
    for i, raw in enumerate(data["plan"]):
        if raw["site"] not in modules:
            raise ProfileMismatchError(f"profile {where}: plan[{i}] forks after "
                                       f"{raw['site']!r}, which is not a module of this model")
        fields = {k: raw[k] for k in ("byte_cap", "grid", "carveout", "priority", "kernel",
                                      "graph_fork") if k in raw and raw[k] is not None}
        try:
            entry = PlanEntry(raw["point"], raw["layer"], raw["batches"],
                              tuple(tensors[n] for n in raw["weights"]), **fields)
        except (TypeError, ValueError) as exc:
            raise _fail(where, f"plan[{i}] is not a valid plan entry: {exc}") from exc
        plan.append(entry)
        point_sites = sites.setdefault(raw["point"], [])
        if (raw["site"], raw["layer"]) not in point_sites:  # one hook per site and layer
            point_sites.append((raw["site"], raw["layer"]))
    mine = versions()
    for key, value in data.get("versions", {}).items():
        if key in mine and mine[key] != value:
            logger.warning("profile written with %s %s, this is %s %s", key, value, key,
                           mine[key])
    logger.info("profile %s: %d entries over %d points for batches %s", where, len(plan),
                len(sites), data["batches"])
    return Profile(data=data, plan=plan, sites=sites, path=where)
