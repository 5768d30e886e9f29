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
