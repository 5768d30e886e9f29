"""Hugging Face causal LMs for the tuner: load one, and a capturable decode step for it.

:func:`load_model` builds a model from a local checkpoint directory
(``from_pretrained`` with ``local_files_only``: nothing is downloaded), from
a ``config.json`` path or a directory holding only a config, or from a config
class name (``LlamaConfig``) or model type (``llama``) plus overrides; the
last three get random weights (seeded), which is enough to measure: timing
does not depend on the values.  Fused expert modules are switched to
``grouped_mm`` where transformers offers it, since the default expert loop
synchronises the host and cannot be captured.

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

import inspect
import json
import os
import time
from collections.abc import Mapping
from typing import Any, Optional

__all__ = ["DecodeStep", "load_model", "parse_overrides"]

PROMPT_LEN = 8
MAX_CACHE_LEN = 64
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")


def _transformers() -> Any:
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


def parse_overrides(items: Any) -> dict:
    """``["num_hidden_layers=8", "rope_theta=1e6", "name=x"]`` -> a dict; each value is
    read as JSON where it parses (numbers, booleans, lists), else kept as a string."""
    out = {}
    for item in items or ():
        if not isinstance(item, str) or "=" not in item:
            raise ValueError(f"a config override must be KEY=VALUE, got {item!r}")
        key, _, text = item.partition("=")
        key = key.strip()
        if not key.isidentifier():
            raise ValueError(f"a config override's key must be a config field name, got {key!r}")
        try:
            out[key] = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            out[key] = text
    return out


def _config(source: str, overrides: Mapping[str, Any]) -> tuple[Any, Optional[str]]:
    """(config, checkpoint directory or None)."""
    tf = _transformers()
    if os.path.isdir(source):
        config_path = os.path.join(source, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"{source} is a directory without config.json: pass a checkpoint "
                             "directory, a config.json path, or a config class name")
        has_weights = any(name.endswith(WEIGHT_FILES) for name in os.listdir(source))
        if has_weights:
            config = tf.AutoConfig.from_pretrained(source, local_files_only=True, **overrides)
            return config, source
        source = config_path
    if os.path.isfile(source):
        try:
            with open(source, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{source} is not a readable config.json: {exc}") from exc
        if not isinstance(data, dict) or "model_type" not in data:
            raise ValueError(f"{source} has no \"model_type\": it is not a transformers config")
        model_type = data.pop("model_type")
        data.update(overrides)
        return tf.AutoConfig.for_model(model_type, **data), None
    cls = getattr(tf, source, None)
    if isinstance(cls, type) and issubclass(cls, tf.PretrainedConfig):
        return cls(**overrides), None
    try:
        return tf.AutoConfig.for_model(source, **overrides), None
    except ValueError:
        raise ValueError(f"{source!r} is neither a checkpoint directory, a config.json path, a "
                         "transformers config class (e.g. LlamaConfig) nor a model type (e.g. "
                         "llama)") from None


def _size(tf: Any, config: Any, dtype: Any) -> str:
    """'LlamaForCausalLM, 2 layers, 666.9 M parameters (1.24 GiB of bfloat16)', from the
    model built on the meta device (shapes only, no memory: 0.3 s on 2 cores for the
    671 B-parameter DeepSeek-V3 config).  Only words for a progress line, so a model that
    cannot be built on meta is just named."""
    import torch

    layers = f"{getattr(config, 'num_hidden_layers', '?')} layers"
    try:
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception:  # noqa: BLE001 (only the size is lost; the real build reports)
        return f"{type(config).__name__}, {layers}"
    count = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    number = f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.1f} M"
    return (f"{type(model).__name__}, {layers}, {number} parameters "
            f"({nbytes / 2**30:.2f} GiB of {str(dtype).removeprefix('torch.')})")


def load_model(source: str, *, overrides: Optional[Mapping[str, Any]] = None,
               device: Any = "cuda", dtype: Any = "bfloat16", seed: int = 0,
               progress: Any = None) -> Any:
    """A causal LM in eval mode on ``device`` (see the module's docstring).

    ``progress``: a text stream (stderr) for a line before the build, naming the model
    and its size, and one after it with the time it took; None: quiet."""
    import torch

    tf = _transformers()
    if not isinstance(source, str) or not source:
        raise TypeError(f"source must be a path or a config name, got {source!r}")
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch dtype name such as bfloat16, got {dtype!r}")
    config, checkpoint = _config(source, dict(overrides or {}))
    t0 = time.monotonic()
    if progress is not None:
        how = (f"loading {checkpoint}" if checkpoint is not None
               else "building it with random weights")
        print(f"[l2prefetch tune] {_size(tf, config, torch_dtype)}: {how} on {device}",
              file=progress, flush=True)
    if checkpoint is not None:
        model = tf.AutoModelForCausalLM.from_pretrained(
            checkpoint, config=config, dtype=torch_dtype, attn_implementation="sdpa",
            local_files_only=True).to(device)
    else:
        torch.manual_seed(seed)
        with torch.device(device):
            model = tf.AutoModelForCausalLM.from_config(config, dtype=torch_dtype,
                                                        attn_implementation="sdpa")
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

        tf = _transformers()
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
