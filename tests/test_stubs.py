"""python/l2prefetch/_C.pyi agrees with the extension it describes.

The stub's Literal types are what a type checker holds ``kernel=`` and
``graph_fork=`` to, so they must list exactly what the C code accepts; and every
public name of ``_C`` (and of its types) must be in the stub.
"""

import ast
import builtins
import os
import typing

import pytest

import l2prefetch
from l2prefetch import _C
from l2prefetch.mechanisms import GRAPH_FORKS

STUB = os.path.join(os.path.dirname(os.path.abspath(l2prefetch.__file__)), "_C.pyi")


@pytest.fixture(scope="module")
def stub():
    with open(STUB, encoding="utf-8") as f:
        return ast.parse(f.read())


def literal(stub, name):
    """The strings of the stub's ``name = Literal[...]``."""
    for node in stub.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == [name]:
            value = node.value
            assert isinstance(value, ast.Subscript) and value.value.id == "Literal", name
            items = value.slice.elts if isinstance(value.slice, ast.Tuple) else [value.slice]
            return [item.value for item in items]
    raise AssertionError(f"{name} is not in {STUB}")


def names(body):
    out = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            out.add(node.target.id)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets)
    return out


def test_kernel_literal_is_the_variant_table(stub):
    kernels = literal(stub, "_Kernel")
    assert len(kernels) == len(set(kernels))
    assert set(kernels) == set(_C.kernel_variants()), "update _Kernel in _C.pyi"


def test_graph_fork_literal_is_the_registry(stub):
    """The registry (l2prefetch.mechanisms) is what the controller takes:
    tests/test_mechanisms.py."""
    assert tuple(literal(stub, "_GraphFork")) == GRAPH_FORKS, "update _GraphFork in _C.pyi"


def test_every_public_name_has_a_stub(stub):
    stubbed = names(stub.body)
    public = {n for n in dir(_C) if not n.startswith("_")}
    assert public <= stubbed, f"not in _C.pyi: {sorted(public - stubbed)}"
    classes = {node.name: names(node.body) for node in stub.body if isinstance(node, ast.ClassDef)}
    for cls in (_C.PreparedWeightRanges, _C.PrefetchController, _C.GraphExec):
        members = {n for n in vars(cls) if not n.startswith("_")}
        assert members <= classes[cls.__name__], \
            f"{cls.__name__} members not in _C.pyi: {sorted(members - classes[cls.__name__])}"


def test_every_name_the_stub_uses_is_defined(stub):
    used = {node.id for node in ast.walk(stub)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    defined = names(stub.body) | set(dir(typing)) | set(dir(builtins))
    assert used <= defined, f"undefined in _C.pyi: {sorted(used - defined)}"


def _stub_parameters(node):
    """(name, kind) of a stub function's parameters, ``self`` left out."""
    a = node.args
    out = [(p.arg, "POSITIONAL_ONLY") for p in a.posonlyargs]
    out += [(p.arg, "POSITIONAL_OR_KEYWORD") for p in a.args]
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL"))
    out += [(p.arg, "KEYWORD_ONLY") for p in a.kwonlyargs]
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD"))
    return [p for p in out if p[0] != "self"]


def _runtime_parameters(function):
    import inspect

    try:
        signature = inspect.signature(function)
    except ValueError:   # no __text_signature__: nothing to hold against the stub
        return None
    return [(p.name, p.kind.name) for p in signature.parameters.values()
            if p.name not in ("self", "$self")]


def test_the_extensions_text_signatures_are_the_stubs(stub):
    """inspect.signature (help(), IDEs) reads a C function's __text_signature__: it names
    the parameters the stub does, of the same kinds (a helper found _graph_set_loaders'
    missing its fourth and none of the private ones positional-only)."""
    stubbed = [(name, node, getattr(_C, name, None)) for name, node in
               ((n.name, n) for n in stub.body if isinstance(n, ast.FunctionDef))]
    for cls in stub.body:
        if isinstance(cls, ast.ClassDef) and isinstance(getattr(_C, cls.name, None), type):
            stubbed += [(f"{cls.name}.{node.name}", node, vars(getattr(_C, cls.name)).get(
                node.name)) for node in cls.body if isinstance(node, ast.FunctionDef)
                and not node.decorator_list and not node.name.startswith("__")]
    checked, differ = 0, []
    for name, node, function in stubbed:
        found = None if function is None else _runtime_parameters(function)
        if found is None:
            continue
        checked += 1
        if found != _stub_parameters(node):
            differ.append(f"{name}: {found} at run time, {_stub_parameters(node)} in the stub")
    assert checked >= 20 and differ == [], "\n".join(differ)
