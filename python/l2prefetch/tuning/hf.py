"""Hugging Face causal LMs for the tuner: load one, and a capturable decode step for it.

:func:`load_model` builds a model from a local checkpoint directory
(``from_pretrained`` with ``local_files_only``: nothing is downloaded), from
a ``config.json`` path or a directory holding only a config, or from a config
class name (``LlamaConfig``) or model type (``llama``) plus overrides; the
last three get random weights (seeded), which is enough to measure: timing
does not depend on the values.  Fused expert modules are switched to
``grouped_mm`` where transformers offers it, since the default expert loop
synchronises the host and cannot be captured.

A checkpoint is untrusted input.  Its ``config.json`` is read here (a regular
file, no key twice) and made into transformers' own config class of its
``model_type``; ``auto_map`` is dropped, so no code of the checkpoint is ever
imported.  Overrides must be fields of that class (or attributes its model
reads off the config) with values of their types: they are never loader
keyword arguments (``trust_remote_code`` is no field).  Weights are loaded only
from safetensors files whose headers were checked against the file; a
checkpoint with only pickled weights is refused.  Before anything is built
the model is made on the meta device to count its bytes, and refused where
they, with the headroom that building and running it take (:func:`needed_bytes`),
exceed the memory free on the device (:func:`available_bytes`) or, on the CPU, half
of the machine's memory (:data:`CPU_SHARE`).  The first progress line names the
source used: a checkpoint directory or config file, a config class or a model type
(and what a local path of the same name shadows, with the name that builds that).

:class:`DecodeStep` is ``step(batch)`` for :func:`l2prefetch.tuning.tune`:
per batch a ``StaticCache`` filled by a prompt of ``prompt_len`` random
tokens, static ``input_ids`` and ``position_ids``; each call resets the
cache's length counters and the position to the prompt length, then decodes
one token, so every replay of a captured step does the same work.  The cache
goes in as ``cache=`` where the model's ``forward`` takes it (transformers 5.24:
``past_key_values`` is deprecated there, to be removed in 5.40), else as
``past_key_values=`` (5.17).

Needs ``transformers`` (tested with 5.17 and 5.24: the ``tune`` extra's bounds).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import itertools
import json
import math
import os
import re
import reprlib
import sys
import time
from collections.abc import Mapping
from typing import Any, Optional

from .._files import check_regular, loads_json, open_regular, read_text
from .._torch import parse_device  # also hf's: the CLI's --device

__all__ = ["DecodeStep", "OverrideError", "available_bytes", "config_fields", "device_of",
           "dtype_of", "error_line", "load_model", "model_bytes", "model_options",
           "needed_bytes", "parse_device", "parse_overrides", "total_bytes"]

PROMPT_LEN = 8
MAX_CACHE_LEN = 64
#: Weight files that are pickles: never loaded (unpickling runs code the file chooses).
PICKLE_FILES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
#: Config fields that size the model, each an int >= 1 where the config has it (a
#: negative or zero one builds an empty or broken model instead of failing).
SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")
#: What building a model and its decode steps take beyond its weights (needed_bytes):
#: on the CPU the peak resident memory of ``tune --list-roles`` grew by the weights and
#: under 0.4 GiB more (Llama layers of 0.38 GiB: 1.22, 1.60 and 2.35 GiB at 1, 2 and 4
#: layers, transformers 5.24, torch 2.13), so a share for the allocator and the caches
#: and one GiB for the step.
HEADROOM_SHARE = 0.10
HEADROOM_BYTES = 1 << 30
#: The most of the machine's memory a model built on the CPU may take: a random-weight
#: build takes minutes there (4.5 s per 0.38 GiB Llama layer on 2 cores), during which
#: the rest of the machine needs memory too (issue 41: the default LlamaConfig, 12.55
#: GiB, passed a check against MemAvailable on a 24 GiB machine and was OOM-killed
#: 260 s later, exit 137 and no message).
CPU_SHARE = 0.5
#: At most this many decoder layers: a controller's layers are 0..65535.
MAX_LAYERS = 65536
#: The largest seed: DecodeStep seeds each batch's prompt with seed * 1000 + batch,
#: which torch's generator takes up to 2**64 - 1.
MAX_SEED = 2**32 - 1
#: safetensors' own limit on its JSON header, and the bytes of each of its dtypes.
SAFETENSORS_HEADER_MAX = 100_000_000
SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
                      "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
                      "I64": 8, "U64": 8, "F64": 8}


#: What a command that builds a Hugging Face model says without torch: both of what it
#: needs, so that installing one does not meet the other's message next.
NO_TORCH = ("needs torch, which is not installed: install torch 2.11-2.13, then "
            "l2prefetch's 'tune' extra (transformers; README, Install)")


def import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError("tuning a Hugging Face model needs transformers: install "
                          "l2prefetch's 'tune' extra (README, Install)") from None
    return transformers


def cache_keyword(model: Any) -> str:
    """The name under which ``model.forward`` takes its KV cache: ``cache`` where it
    has that parameter (newer transformers), else ``past_key_values``."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):   # a forward without a signature: the old name
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def error_line(exc: BaseException) -> str:
    """An exception as one line.  transformers' validation errors span several, the
    last of which is the cause ("ValueError: The hidden size (64) is not a multiple ...")."""
    lines = [part.strip() for part in str(exc).splitlines() if part.strip()]
    if type(exc).__name__.startswith("StrictDataclass") and lines:
        return lines[-1]
    return f"{type(exc).__name__}: {' '.join(lines)}" if lines else type(exc).__name__


def parse_overrides(items: Any) -> dict:
    """``["num_hidden_layers=8", "rope_theta=1e6", "name=x"]`` -> a dict; each value is
    read as JSON where it parses (numbers, booleans, lists), else kept as a string; the
    last of a key given twice counts, as with any option.  A JSON object value that gives
    a key twice is a ValueError."""
    out = {}
    for item in items or ():
        if not isinstance(item, str) or "=" not in item:
            raise ValueError(f"a config override must be KEY=VALUE, got {item!r}")
        key, _, text = item.partition("=")
        key = key.strip()
        if not key.isidentifier():
            raise ValueError(f"a config override's key must be a config field name, got {key!r}")
        try:
            out[key] = loads_json(text, f"the config override {key}", finite=False)
        except (json.JSONDecodeError, RecursionError):
            out[key] = text
        if _nested_deeper(out[key], MAX_OVERRIDE_DEPTH):   # checks and messages recurse
            raise ValueError(f"a config override's value nests lists or objects more than "
                             f"{MAX_OVERRIDE_DEPTH} deep ({key}); no config field does")
    return out


#: How deep a --set value may nest lists and objects (a config's deepest fields, such as
#: rope scaling's, nest two or three).
MAX_OVERRIDE_DEPTH = 32


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists or dicts more than ``limit`` deep (without recursing)."""
    level = [value]
    for _ in range(limit + 1):   # a level of containers found each time: more than limit
        containers = [x for x in level if isinstance(x, (list, dict))]
        if not containers:
            return False
        level = [v for x in containers for v in (x.values() if isinstance(x, dict) else x)]
    return True


def dtype_of(dtype: Any) -> Any:
    """The torch dtype ``dtype`` names: torch.bfloat16, float16, float32 or float64, or the
    name of one ('bfloat16', 'half', ...); anything else is a ValueError naming them."""
    import torch

    if isinstance(dtype, torch.dtype):
        found = dtype
    elif isinstance(dtype, str) and dtype.isidentifier() and not dtype.startswith("_"):
        found = getattr(torch, dtype, None)
    else:
        found = None
    # those transformers builds random weights in (float8 is floating-point too, but the
    # build failed there, blaming the config)
    if found not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ValueError(f"dtype must name a floating-point torch dtype (bfloat16, float16, "
                         f"float32 or float64), got {dtype!r}")
    return found


def model_options(dtype: Any, overrides: Any) -> dict:
    """The command line's ``--dtype`` (:func:`dtype_of`) and ``--set`` (the overrides,
    returned as :func:`parse_overrides` reads them), checked before a model is built; a
    ValueError that starts with the option's name."""
    try:
        dtype_of(dtype)
    except ValueError as exc:
        raise ValueError(f"--dtype: {exc}") from None
    try:
        return parse_overrides(overrides)
    except ValueError as exc:
        raise ValueError(f"--set: {exc}") from None


def device_of(device: Any) -> Any:
    """The ``torch.device`` to build on: 'cpu', or a CUDA device torch sees ('cuda',
    'cuda:N', an index, or what :func:`parse_device` returned); anything else is a
    ValueError saying what there is."""
    import torch

    found = parse_device(device)
    if isinstance(device, torch.device):   # parsed already: named as it was given
        device = str(device)
    if found.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {device!r}: torch {torch.__version__} sees no CUDA GPU "
                             "here (use 'cpu')")
        if found.index is not None and found.index >= count:
            raise ValueError(f"device {device!r}: there is no cuda:{found.index}, torch sees "
                             f"{count} GPU{'' if count == 1 else 's'} (cuda:0..{count - 1})")
    return found


def _cpu_memory() -> tuple[Optional[int], Optional[int]]:
    """(total, available) bytes of the CPU's memory: MemTotal and MemAvailable, each
    lowered to the cgroup's limit (and what the limit leaves) where that is lower; None
    where it cannot be read."""
    table = {}
    try:
        for line in read_text("/proc/meminfo", "memory table").splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable") and rest.split():
                table[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    totals = [table["MemTotal"]] if "MemTotal" in table else []
    free = [table["MemAvailable"]] if "MemAvailable" in table else []
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            most = read_text(limit, "cgroup limit").strip()
            used = read_text(usage, "cgroup usage").strip()
        except (OSError, ValueError):
            continue
        if most.isdigit() and used.isdigit():
            totals.append(int(most))
            free.append(max(0, int(most) - int(used)))
    return (min(totals) if totals else None), (min(free) if free else None)


def available_bytes(device: Any) -> Optional[int]:
    """The bytes a model can take on ``device`` (a torch.device): a CUDA device's free
    memory, the CPU's available memory (MemAvailable, and the cgroup's limit where it is
    lower); None where this cannot be read."""
    import torch

    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(torch.cuda.mem_get_info(index)[0])
    return _cpu_memory()[1]


def total_bytes(device: Any) -> Optional[int]:
    """All the memory of ``device``: a CUDA device's, or the CPU's (MemTotal, or the
    cgroup's limit where it is lower); None where this cannot be read."""
    import torch

    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(torch.cuda.mem_get_info(index)[1])
    return _cpu_memory()[0]


def _config_class(tf: Any, model_type: Any, where: str) -> type:
    """transformers' own config class of ``model_type``; never a checkpoint's code."""
    if not isinstance(model_type, str) or model_type not in tf.CONFIG_MAPPING:
        raise ValueError(f"{where}: model_type {model_type!r} is not one transformers "
                         f"{tf.__version__} has; l2prefetch builds only transformers' own "
                         "models and never runs a checkpoint's code (auto_map, "
                         "trust_remote_code)")
    return tf.CONFIG_MAPPING[model_type]


def _config_class_named(tf: Any, name: str) -> Optional[type]:
    """The config class called ``name`` (LlamaConfig), found by transformers' table of
    names rather than by an attribute lookup of whatever was typed."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    for model_type, class_name in CONFIG_MAPPING_NAMES.items():
        if class_name == name:
            return tf.CONFIG_MAPPING[model_type]
    return None


def config_fields(cls: type, model_cls: Optional[type] = None) -> set[str]:
    """The fields a config class takes: its dataclass fields (transformers 5), the named
    parameters of its ``__init__``, its ``attribute_map`` aliases and, with
    ``model_cls``, the attributes that model's module reads off its config
    (``config.head_dim`` or ``getattr(config, "head_dim", ...)``: Qwen3-MoE reads
    ``head_dim`` though its config class has no such field)."""
    names = set()
    if model_cls is not None:
        try:
            source = inspect.getsource(sys.modules[model_cls.__module__])
        except (KeyError, OSError, TypeError):
            source = ""
        names.update(re.findall(r"\bconfig\.([A-Za-z_]\w*)", source))
        names.update(re.findall(r"getattr\(\s*(?:self\.)?config\s*,\s*[\"'](\w+)[\"']", source))
    if dataclasses.is_dataclass(cls):
        names.update(f.name for f in dataclasses.fields(cls))
    try:
        parameters = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        parameters = ()
    names.update(p.name for p in parameters
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self")
    names.update(getattr(cls, "attribute_map", None) or {})
    return {n for n in names if not n.startswith("_")}


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


class OverrideError(ValueError):
    """A config override that is not a field of the config or not of its type.
    ``option`` says it as the command line's ``--set KEY=VALUE: ...``."""

    def __init__(self, shown: str, problem: str) -> None:
        super().__init__(f"override {shown}: {problem}")
        self.option = f"--set {shown}: {problem}"


# The value types an override may have, by the type of the field's default (a float
# field takes an int too), with the words for a message; other defaults (None, lists,
# objects) are left to transformers' own validation.
_ACCEPTED: dict = {bool: ((bool,), "a bool"), int: ((int,), "an int"),
                   float: ((int, float), "a number"), str: ((str,), "a str")}


def _check_overrides(tf: Any, cls: type, overrides: Mapping[str, Any]) -> None:
    """Each override names a field of ``cls`` (or an attribute its model reads) and has
    the type of its default; numbers are finite.  (transformers accepts any key, keeping
    a misspelt one as a new attribute that nothing reads.)"""
    if not overrides:
        return
    try:
        model_cls = tf.MODEL_FOR_CAUSAL_LM_MAPPING[cls]
    except KeyError:
        model_cls = None   # refused later, naming the class
    known = config_fields(cls, model_cls)
    try:
        defaults = cls()
    except Exception:  # noqa: BLE001 - a config without defaults: no types to compare
        defaults = None
    for key, value in overrides.items():
        shown = f"{key}={json.dumps(value) if not isinstance(value, str) else value}"
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f" (closest: {', '.join(close)})" if close else ""
            raise OverrideError(shown, f"{cls.__name__} has no field {key!r}{hint}; an "
                                "override sets a config field, nothing else")
        if not _finite(value):
            raise OverrideError(shown, "must be a finite number")
        default = getattr(defaults, key, None)
        types, words = _ACCEPTED.get(type(default), (None, ""))
        if types is not None and type(value) not in types:
            raise OverrideError(shown, f"{cls.__name__}.{key} takes {words} (its default is "
                                f"{default!r}), got {type(value).__name__}")


def _size_error(key: str, value: Any, where: str) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{key} must be an int >= 1, got {value!r} ({where})"
    if key == "num_hidden_layers" and value > MAX_LAYERS:
        return (f"num_hidden_layers must be at most {MAX_LAYERS} (a controller's layers are "
                f"0..{MAX_LAYERS - 1}), got {value} ({where})")
    return None


def _check_sizes(cls: type, values: Any, where: str) -> None:
    """The SIZE_FIELDS of a config (an object) or of the values that will make one (a
    mapping, before transformers sees them: it warns about some on stderr)."""
    aliases = getattr(cls, "attribute_map", None) or {}
    for key in SIZE_FIELDS:
        if isinstance(values, Mapping):
            found = [values[k] for k in (key, aliases.get(key)) if k in values]
            value = found[-1] if found else None
        else:
            value = getattr(values, key, None)
        problem = _size_error(key, value, where)
        if problem is not None:
            raise ValueError(problem)


def make_config(tf: Any, cls: type, data: Mapping[str, Any], overrides: Mapping[str, Any],
                 where: str) -> Any:
    """``cls`` from a config file's ``data`` (``where`` names the file, or is None) and the
    overrides, each checked first."""
    _check_overrides(tf, cls, overrides)
    merged = {**data, **overrides}
    if where is None:
        source = "the overrides" if overrides else f"{cls.__name__}'s defaults"
    else:
        source = f"{where} with the overrides" if overrides else where
    _check_sizes(cls, merged, source)
    try:
        config = cls(**merged)
    except Exception as exc:  # noqa: BLE001 - only transformers' config code ran: bad values
        raise ValueError(f"no valid {cls.__name__} from {source}: {error_line(exc)}") from None
    _check_sizes(cls, config, source)
    return config


def _elements(shape: list, limit: int) -> int:
    """The product of ``shape``, or ``limit + 1`` once it passes ``limit``: a crafted
    header's thousands of 4300-digit sizes would take hours to multiply out."""
    if 0 in shape:
        return 0
    count = 1
    for size in shape:
        count *= size
        if count > limit:
            return limit + 1
    return count


def _check_safetensors(path: str) -> None:
    """Read a safetensors file's header and check it describes the file: a JSON object of
    tensors whose dtypes, shapes and offsets tile the data exactly (what the loader would
    otherwise fail on, or not)."""
    fd, info = open_regular(path, "weight file")
    try:
        head = os.read(fd, 8)
        size = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= size <= min(SAFETENSORS_HEADER_MAX, info.st_size - 8):
            # neither the length read nor the file's size is said: the file may be
            # anything a planted name points at
            raise ValueError(f"{path} is not a safetensors file (its header length does not "
                             "fit the file): it is corrupt or truncated")
        chunks, got = [], 0
        while got < size:
            chunk = os.read(fd, size - got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    finally:
        os.close(fd)
    where = f"safetensors header of {path}"
    try:
        header = loads_json(b"".join(chunks), where)
    except (json.JSONDecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a safetensors file (its header is not JSON: "
                         f"{error_line(exc)}): it is corrupt or truncated") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file (its header is not an object)")
    data_bytes = info.st_size - 8 - size
    spans = []
    for name, described in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(described, dict)
        dtype = described.get("dtype") if ok else None
        shape = described.get("shape") if ok else None
        offsets = described.get("data_offsets") if ok else None
        ok = (ok and isinstance(dtype, str) and isinstance(shape, list)
              and all(type(n) is int and n >= 0 for n in shape)
              and isinstance(offsets, list) and len(offsets) == 2
              and all(type(n) is int for n in offsets) and 0 <= offsets[0] <= offsets[1])
        item = SAFETENSORS_DTYPES.get(dtype) if ok else None
        if ok and item is not None:
            ok = offsets[1] - offsets[0] == _elements(shape, data_bytes) * item
        if not ok:
            raise ValueError(f"{path} is corrupt: the header's entry for tensor "
                             f"{reprlib.repr(name)} is not a dtype, shape and data_offsets "
                             f"that agree: {reprlib.repr(described)}")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise ValueError(f"{path} is corrupt: tensor {reprlib.repr(name)} starts at byte "
                             f"{begin} of the data, where the tensors before it end at {end}")
        end = stop
    if end != data_bytes:
        raise ValueError(f"{path} is corrupt or truncated: its tensors need {end} bytes of data "
                         f"and the file holds {data_bytes}")


def _checkpoint_files(directory: str) -> list[str]:
    """The safetensors files of a checkpoint directory, after checking that every config
    and weight file in it is a regular file (transformers opens them itself, so a FIFO
    there would hang it) and refusing one with only pickled weights."""
    entries = sorted(os.listdir(directory))
    weights = []
    inside = _link_targets(directory)
    for name in entries:
        path = os.path.join(directory, name)
        if name.endswith((".json", ".safetensors")):
            if os.path.islink(path):
                target = os.path.realpath(path)
                if not any(os.path.commonpath([target, root]) == root for root in inside):
                    raise ValueError(f"{path} is a link to {target}, outside the checkpoint: "
                                     "a checkpoint's files are read only in its directory "
                                     "(or a Hugging Face cache's blobs/); copy the file in")
            check_regular(path, "checkpoint file")
        if name.endswith(".safetensors"):
            weights.append(path)
    pickles = [name for name in entries if name.endswith(PICKLE_FILES)]
    if not weights and pickles:
        raise ValueError(f"{directory} holds its weights only as pickles ({', '.join(pickles)}), "
                         "which l2prefetch never loads (unpickling runs code from the file): "
                         "convert them to safetensors, or pass its config.json to tune with "
                         "random weights (timing does not depend on the values)")
    for path in weights:
        _check_safetensors(path)
    for name in entries:
        if name.endswith(".safetensors.index.json"):   # a .bin index: its pickles never load
            _check_index(os.path.join(directory, name), {os.path.basename(w) for w in weights})
    return weights


def _link_targets(directory: str) -> list[str]:
    """Where a checkpoint's links may point: into the directory itself, and for a Hugging
    Face cache's snapshot (``<repo>/snapshots/<revision>``) into ``<repo>/blobs``, where
    its files are."""
    real = os.path.realpath(directory)
    roots = [real]
    parent, revision = os.path.split(real)
    if revision and os.path.basename(parent) == "snapshots":
        roots.append(os.path.join(os.path.dirname(parent), "blobs"))
    return roots


def _check_index(path: str, checked: set) -> None:
    """A sharded checkpoint's index (``model.safetensors.index.json``): transformers
    opens every file its ``weight_map`` names, so each must be one of the directory's
    safetensors files checked above (not a path elsewhere, not a FIFO that would hang)."""
    try:
        index = loads_json(read_text(path, "checkpoint index"), f"checkpoint index {path}")
    except (json.JSONDecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise ValueError(f"checkpoint index {path} is not valid JSON: "
                         f"{type(exc).__name__}: {exc}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"checkpoint index {path} has no 'weight_map' object of tensor "
                         "name -> shard file")
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or shard not in checked:
            raise ValueError(f"checkpoint index {path} maps {reprlib.repr(tensor)} to "
                             f"{reprlib.repr(shard)}, which is not a safetensors file of "
                             f"its directory ({_some(sorted(checked))}): a shard must be a "
                             "file beside the index")


def _some(names: list) -> str:
    """Up to three names, and how many more: a line's worth of a long list."""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return (", ".join(names[:3]) + more) if names else "none"


def _shadowed(tf: Any, source: str) -> Optional[str]:
    """Where ``source``, a path, is also a config class name or a model type (a bare
    name: ``llama`` with a directory ``./llama`` here): what that path shadows and how to
    name it instead; None where it shadows nothing."""
    if os.path.dirname(source) or source in (".", ".."):
        return None     # a path with a directory part names only the path
    cls = _config_class_named(tf, source)
    if cls is not None:
        other, what = cls.model_type, f"the config class {source}"
    elif source in tf.CONFIG_MAPPING:
        other, what = tf.CONFIG_MAPPING[source].__name__, f"the model type {source}"
    else:
        return None
    if os.path.lexists(other):
        return f"it shadows {what} (run from another directory to build that)"
    return f"it shadows {what}: name it {other} to build that instead"


def _config(source: str, overrides: Mapping[str, Any]) -> tuple[Any, Optional[str], str]:
    """(config, checkpoint directory or None, which source was used: a phrase for the
    progress line, saying what a path of that name shadows)."""
    tf = import_transformers()
    checkpoint = None
    shadow = _shadowed(tf, source) if os.path.lexists(source) else None
    if os.path.isdir(source):
        config_path = os.path.join(source, "config.json")
        if not os.path.lexists(config_path):
            raise ValueError(f"{source} is a directory without config.json: pass a checkpoint "
                             "directory, a config.json path, or a config class name")
        if _checkpoint_files(source):
            checkpoint = source
        used = (f"the checkpoint directory {source}" if checkpoint is not None
                else f"the directory {source} (its config.json)")
        source = config_path
    else:
        used = f"the config file {source}"
    if os.path.lexists(source):
        text = read_text(source, "config")
        try:
            data = loads_json(text, f"config {source}")
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"config {source} is not valid JSON: {error_line(exc)}") from None
        if not isinstance(data, dict) or "model_type" not in data:
            raise ValueError(f"{source} has no \"model_type\": it is not a transformers config")
        data.pop("auto_map", None)   # a checkpoint's own code: never imported
        cls = _config_class(tf, data.pop("model_type"), source)
        used += f" ({shadow})" if shadow else ""
        return make_config(tf, cls, data, overrides, source), checkpoint, used
    cls = _config_class_named(tf, source)
    if cls is not None:
        used = f"the config class {source}"
    elif source in tf.CONFIG_MAPPING:
        cls = tf.CONFIG_MAPPING[source]
        used = f"the model type {source} ({cls.__name__})"
    elif os.sep in source or source.startswith(".") or source.endswith(".json"):
        hub = (re.fullmatch(r"[\w.-]+/[\w.-]+", source) is not None
               and not source.startswith("."))
        raise ValueError(f"{source!r}: no such file or directory (pass a checkpoint "
                         "directory, a config.json path, a transformers config class, e.g. "
                         "LlamaConfig, or a model type, e.g. llama"
                         + ("; a Hugging Face Hub id is not downloaded: download the "
                            "checkpoint, then pass its directory" if hub else "") + ")")
    else:
        raise ValueError(f"{source!r} is neither a checkpoint directory, a config.json path, a "
                         "transformers config class (e.g. LlamaConfig) nor a model type (e.g. "
                         "llama)")
    return make_config(tf, cls, {}, overrides, None), None, used


def _causal_lm_class(tf: Any, config: Any) -> type:
    try:
        return tf.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ValueError(f"transformers has no causal LM for {type(config).__name__} "
                         f"({config.model_type}): the tuner decodes with a causal LM") from None


def model_bytes(model_cls: type, config: Any, dtype: Any) -> tuple[int, int]:
    """(parameters, bytes) of the model ``config`` makes, built on the meta device (shapes
    only: no memory, a fraction of a second even for the 671 B-parameter DeepSeek-V3).
    Raises ValueError where the config does not build (only config code ran)."""
    import torch

    try:
        with torch.device("meta"):
            model = model_cls._from_config(config, dtype=dtype, attn_implementation="sdpa")
    except Exception as exc:  # noqa: BLE001 - on meta nothing but the config can fail
        raise ValueError(f"the {type(config).__name__} does not build a model: "
                         f"{error_line(exc)}") from None
    tensors = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    count = sum(t.numel() for t in tensors.values())
    return count, sum(t.numel() * t.element_size() for t in tensors.values())


def _amount(n: float, units: tuple[str, ...], step: float) -> str:
    """``n`` in the largest of ``units`` it reaches ('12.05 B', '22.44 GiB')."""
    unit = 0
    while unit + 1 < len(units) and n >= step ** (unit + 1):
        unit += 1
    return f"{n / step ** unit:.{0 if unit == 0 else 2}f} {units[unit]}".rstrip()


def _bytes(n: float) -> str:
    return _amount(n, ("bytes", "KiB", "MiB", "GiB", "TiB"), 1024)


def _count(n: float) -> str:
    """A parameter count in words ('6.74 billion'): 'B' would read as bytes."""
    return _amount(n, ("", "thousand", "million", "billion", "trillion"), 1000)


def needed_bytes(nbytes: int) -> int:
    """What building a model of ``nbytes`` of weights and running its decode steps take:
    the weights plus HEADROOM_SHARE of them plus HEADROOM_BYTES."""
    return int(nbytes * (1 + HEADROOM_SHARE)) + HEADROOM_BYTES


def check_fits(what: str, count: int, nbytes: int, device: Any, layers: Any = None,
                staging: bool = False) -> None:
    """Refuse a model whose :func:`needed_bytes` exceed what ``device`` can give: its free
    memory and, where the model is to live on the CPU (not ``staging``: a checkpoint read
    there on its way to a GPU), at most CPU_SHARE of the machine's memory."""
    free = available_bytes(device)
    total = total_bytes(device) if device.type == "cpu" and not staging else None
    limits = [(free, f"the {_bytes(free)} free on {device}")] if free is not None else []
    if total is not None:
        limits.append((int(total * CPU_SHARE),
                       f"the {_bytes(int(total * CPU_SHARE))} a model may take on {device} "
                       f"(half of the machine's {_bytes(total)}: the rest needs memory "
                       "during the minutes such a build takes)"))
    if not limits:
        return
    limit, said = min(limits)
    need = needed_bytes(nbytes)
    if need <= limit:
        return
    hint = "--set num_hidden_layers=4"
    if isinstance(layers, int) and layers > 1:
        # the layers' share of the weights scaled down to what fits (the embeddings and
        # the head count as layers here, so it errs small)
        fit = int((limit - HEADROOM_BYTES) / (1 + HEADROOM_SHARE) / (nbytes / layers))
        if 1 <= fit < 4:
            hint = f"--set num_hidden_layers={fit}"
        elif fit < 1:
            hint = "--set num_hidden_layers=1 and smaller sizes"
    raise ValueError(
        f"{what} is {_count(count)} parameters, {_bytes(nbytes)}; building it and running "
        f"its steps take about {_bytes(need)}, more than {said}: make it smaller (e.g. "
        f"{hint}; the tuner needs a few layers, not the whole model) or use a larger device")


def _check_seed(seed: Any) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an int in 0..{MAX_SEED}, got {seed!r}")


def load_model(source: str, *, overrides: Optional[Mapping[str, Any]] = None,
               device: Any = "cuda", dtype: Any = "bfloat16", seed: int = 0,
               progress: Any = None) -> Any:
    """A causal LM in eval mode on ``device`` (see the module's docstring).

    Before anything is built: ``overrides`` must name fields of the config class (with
    values of their types), ``device`` must be the CPU or a CUDA device torch sees,
    ``dtype`` bfloat16, float16, float32 or float64 (:func:`dtype_of`), and the model
    with its headroom (:func:`needed_bytes`) must fit in the memory free on ``device``,
    on the CPU in half its memory too (and in the CPU's free memory, where a checkpoint
    is read first); each is a ValueError that names it, as is a checkpoint whose weights
    are pickles or corrupt.
    ``progress``: a text stream (stderr) for a line before the build, naming the model,
    its size and the source used, and one after it with the time it took; None: quiet.
    """
    import torch

    tf = import_transformers()
    if not isinstance(source, str) or not source:
        raise TypeError(f"source must be a path or a config name, got {source!r}")
    _check_seed(seed)
    torch_dtype = dtype_of(dtype)
    where = device_of(device)
    if overrides is not None and not isinstance(overrides, Mapping):
        raise TypeError(f"overrides must be a mapping of config fields, got "
                        f"{type(overrides).__name__}")
    config, checkpoint, used = _config(source, dict(overrides or {}))
    model_cls = _causal_lm_class(tf, config)
    count, nbytes = model_bytes(model_cls, config, torch_dtype)
    layers = getattr(config, "num_hidden_layers", None)
    what = (f"{model_cls.__name__}" + (f" with {layers} layers" if isinstance(layers, int) else "")
            + f" in {str(torch_dtype).removeprefix('torch.')}")
    check_fits(what, count, nbytes, where, layers)
    if checkpoint is not None and where.type != "cpu":
        # read into the CPU first
        check_fits(what, count, nbytes, torch.device("cpu"), layers, staging=True)
    t0 = time.monotonic()
    if progress is not None:
        how = "loading it" if checkpoint is not None else "building it with random weights"
        number = f"{count / 1e9:.2f} billion" if count >= 1e9 else f"{count / 1e6:.1f} million"
        print(f"[l2prefetch tune] {model_cls.__name__}, {layers} layers, {number} parameters "
              f"({nbytes / 2**30:.2f} GiB of {str(torch_dtype).removeprefix('torch.')}) from "
              f"{used}: {how} on {device}", file=progress, flush=True)
    if checkpoint is not None:
        try:
            model = model_cls.from_pretrained(
                checkpoint, config=config, dtype=torch_dtype, attn_implementation="sdpa",
                local_files_only=True, use_safetensors=True)
        except (torch.OutOfMemoryError, MemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 - transformers reading checked files
            raise ValueError(f"cannot load the weights of {checkpoint}: "
                             f"{error_line(exc)}") from None
        model = model.to(where)
    else:
        torch.manual_seed(seed)
        with torch.device(where):
            model = model_cls._from_config(config, dtype=torch_dtype, attn_implementation="sdpa")
    setter = getattr(model, "set_experts_implementation", None)
    if callable(setter):
        try:
            setter("grouped_mm")
        except (ValueError, NotImplementedError, AttributeError):
            pass  # a model without fused experts
    model.eval()
    if progress is not None:
        print(f"[l2prefetch tune] model ready in {time.monotonic() - t0:.1f} s", file=progress,
              flush=True)
    return model


class _State:
    """One batch's static decode buffers (see :class:`DecodeStep`)."""

    def __init__(self, model: Any, batch: int, prompt_len: int, max_cache_len: int,
                 seed: int) -> None:
        import torch

        tf = import_transformers()
        device = next(model.parameters()).device
        self.prompt_len = prompt_len
        self.cache = tf.StaticCache(config=model.config, max_cache_len=max_cache_len)
        self.inputs = {cache_keyword(model): self.cache, "use_cache": True}
        generator = torch.Generator().manual_seed(seed * 1000 + batch)
        prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len),
                               generator=generator).to(device)
        positions = torch.arange(prompt_len, device=device).expand(batch, -1)
        with torch.no_grad():
            logits = model(input_ids=prompt, position_ids=positions, **self.inputs).logits
        self.ids = logits[:, -1:].argmax(-1).contiguous()
        self.pos = torch.full((batch, 1), prompt_len, dtype=torch.long, device=device)
        self.lengths = [getattr(layer, "cumulative_length", None) for layer in self.cache.layers]
        if not all(isinstance(t, torch.Tensor) for t in self.lengths):
            raise RuntimeError("this transformers version's StaticCache keeps no device tensor "
                               "of its length (cumulative_length), so a decode step cannot be "
                               "replayed; tested with transformers 5.17 and 5.24")


class DecodeStep:
    """``step(batch)``: one decode step of a Hugging Face causal LM on static buffers.

    ``prompt_len`` tokens fill the cache first (once per batch, on first use);
    ``max_cache_len`` sizes the ``StaticCache`` (small: some models re-read the
    whole static cache each step).  Returns the step's logits.
    """

    def __init__(self, model: Any, *, prompt_len: int = PROMPT_LEN,
                 max_cache_len: int = MAX_CACHE_LEN, seed: int = 0) -> None:
        for name, value in (("prompt_len", prompt_len), ("max_cache_len", max_cache_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        _check_seed(seed)
        if max_cache_len <= prompt_len:
            raise ValueError(f"max_cache_len ({max_cache_len}) must exceed prompt_len "
                             f"({prompt_len}) to leave room for the decoded token")
        self.model, self.prompt_len, self.max_cache_len, self.seed = (
            model, prompt_len, max_cache_len, seed)
        self._states: dict[int, _State] = {}

    def state(self, batch: int) -> _State:
        state = self._states.get(batch)
        if state is None:
            if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
                raise ValueError(f"batch must be an int >= 1, got {batch!r}")
            state = self._states[batch] = _State(self.model, batch, self.prompt_len,
                                                 self.max_cache_len, self.seed)
        return state

    def __call__(self, batch: int) -> Any:
        s = self.state(batch)
        for length in s.lengths:
            length.fill_(s.prompt_len)
        s.pos.fill_(s.prompt_len)
        return self.model(input_ids=s.ids, position_ids=s.pos, **s.inputs).logits
