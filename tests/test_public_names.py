"""A public name means one thing in the package (issue 22: ``Site`` was a tuple in hooks
and a dataclass in tuning.discover, ``disabled()`` was written twice).

A name that two modules export (``__all__``) must be the same object, except the
interface that each module of one kind defines for itself: the policies' (kimi_k3,
deepseek_v3) and the command lines' (cli, tuning.cli, tuning.trace_cli)."""

import importlib
import pkgutil

import pytest

pytest.importorskip("torch")

import l2prefetch  # noqa: E402

#: Names each module of a kind defines for itself.
PER_MODULE = {
    "POINTS", "DEFAULT_POINTS", "attention_weights", "hook_points", "plan",  # the policies
    "main", "add_parser", "run",                                             # the command lines
}


def public_names():
    names = ["l2prefetch"] + [m.name for m in pkgutil.walk_packages(l2prefetch.__path__,
                                                                     "l2prefetch.")]
    out = {}
    for name in names:
        module = importlib.import_module(name)
        for public in getattr(module, "__all__", ()):
            out.setdefault(public, []).append((name, getattr(module, public)))
    return out


def test_a_public_name_is_one_object():
    names = public_names()
    assert "Site" in names and "RoleSite" in names and "Arm" in names
    twice = {public: [module for module, _ in owners] for public, owners in names.items()
             if public not in PER_MODULE and len({id(obj) for _, obj in owners}) > 1}
    assert twice == {}, f"names that mean different things in different modules: {twice}"
