"""A model's tensors and decoder layers, by module path.

Plans, profiles and the tuner name what they prefetch and where they fork by
the dotted path of a module or tensor in the model (``model.layers.3.mlp``),
never by object: these are the helpers they share.  :func:`layer_of` reads the
decoder layer out of a path, :func:`layer_count` counts a model's layers that
way, :func:`named_tensors` lists every tensor a path can name and
:func:`tensor_paths` names a tensor by its identity.  :func:`compiled_module` is
the module a ``torch.compile(module)`` wrapper wraps, whose paths those are.

Importing this module imports neither torch nor the C extension: a model can
only hold tensors if torch is already imported, so torch is looked up in
``sys.modules``.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

__all__ = ["compiled_module", "layer_count", "layer_of", "named_tensors", "tensor_paths"]


def compiled_module(model: Any) -> Any:
    """The module that ``torch.compile(module)`` wrapped, where ``model`` is that wrapper
    (an ``OptimizedModule``, whose paths all begin ``_orig_mod.``), else ``model``: the
    wrapper runs the module's own hooks in its compiled code, and a profile names the
    module's paths, whichever way it was compiled."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    while wrapper is not None and isinstance(model, wrapper):
        model = model._orig_mod
    return model


def layer_of(path: str) -> tuple[Optional[int], str]:
    """(decoder layer index, path below the layer) of a module path.

    The layer is the first component of ASCII digits, at most 18 (``model.layers.3.mlp``
    -> 3, ``mlp``); a path with none has no layer and keeps its whole path.  (``str.isdigit``
    alone takes ``²``, which ``int`` refuses, and 5000 digits, which it converts slowly.)
    """
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isascii() and part.isdigit() and len(part) <= 18:
            return int(part), ".".join(parts[i + 1:])
    return None, path


def layer_count(model: Any) -> int:
    """How many decoder layers ``model`` has: the distinct indices that appear as
    the first all-digit component of its module paths."""
    return len({layer_of(name)[0] for name, _ in model.named_modules()} - {None})


def named_tensors(model: Any) -> dict[str, Any]:
    """Every tensor reachable from model by name, in a stable order.

    Parameters first, then buffers, then plain tensor attributes of submodules
    (such as an MLA's ``W_UK_T``), each under its dotted path.  Tied tensors
    appear under every name.  A ``model`` without ``named_parameters`` is a
    TypeError.
    """
    if not callable(getattr(model, "named_parameters", None)):
        raise TypeError("model must be the nn.Module whose tensors the plan names, "
                        f"got {type(model).__name__}")
    torch = sys.modules.get("torch")
    tensor = None if torch is None else torch.Tensor
    names: dict[str, Any] = {}
    for name, value in model.named_parameters(remove_duplicate=False):
        names.setdefault(name, value)
    for name, value in model.named_buffers(remove_duplicate=False):
        names.setdefault(name, value)
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attribute, value in vars(module).items():
            if tensor is not None and isinstance(value, tensor):
                names.setdefault(f"{prefix}.{attribute}" if prefix else attribute, value)
    return names


def tensor_paths(model: Any) -> dict[int, str]:
    """``id(tensor) -> path`` for every tensor of :func:`named_tensors`: a tied tensor
    by its first name.  What names a plan's weights when it is stored."""
    paths: dict[int, str] = {}
    for name, value in named_tensors(model).items():
        paths.setdefault(id(value), name)
    return paths
