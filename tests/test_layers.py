"""The package's layers as python/l2prefetch/DESIGN.md draws them: each module imports only
modules listed below it there, and the runtime imports without the tuner."""

import ast
import os
import re
import subprocess
import sys
import textwrap

import pytest

import l2prefetch

PACKAGE = os.path.dirname(os.path.abspath(l2prefetch.__file__))
DESIGN = os.path.join(PACKAGE, "DESIGN.md")
#: Imports against the layers that DESIGN.md names as exceptions: none.
KNOWN: set = set()


def layers():
    """The modules of DESIGN.md's drawing, top first (dotted, relative to the package):
    a line's first column names them; 'tuning/' and 'the runtime' start the layers."""
    text = open(DESIGN, encoding="utf-8").read()
    drawing = text.split("```", 2)[1]
    order, prefix = [], ""
    for line in drawing.splitlines():
        first = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        if first == "tuning/":
            prefix = "tuning."
        elif first == "the runtime":
            prefix = ""
            order.append("__init__")
        order += [prefix + name for name in re.findall(r"(\w+)\.py", first)]
    return order


def imports(module):
    """The module each relative import in module's file names, lazy ones included."""
    path = os.path.join(PACKAGE, *module.split(".")) + ".py"
    package = module.split(".")[:-1] if module != "__init__" else []
    known = set(layers())
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = package[:len(package) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
        for alias in node.names:
            name = f"{source}.{alias.name}" if source else alias.name
            if name in known or name == "_C":
                yield name
            elif source in known or source == "_C":
                yield source
            else:   # a name of a package: its __init__
                yield source + ".__init__" if source else "__init__"


def test_design_md_draws_every_module():
    drawn = set(layers())
    files = {os.path.relpath(os.path.join(root, f), PACKAGE)[:-3].replace(os.sep, ".")
             for root, _, names in os.walk(PACKAGE) for f in names if f.endswith(".py")}
    files.discard("tuning.__init__")
    assert files == drawn, f"DESIGN.md draws {sorted(drawn - files)} that do not exist and " \
                           f"not {sorted(files - drawn)}"


def test_each_module_imports_only_modules_below_it():
    order = layers()
    rank = {name: i for i, name in enumerate(order)}
    rank["_C"] = len(order)
    upward = set()
    for module in order:
        for target in imports(module):
            if target == "tuning.__init__":
                target_rank = rank["tuning.cli"]            # the tuning package: its top
            else:
                target_rank = rank[target]
            if target_rank <= rank[module] and target != "__init__" or (
                    target == "__init__" and rank[module] > rank["__init__"]):
                upward.add((module, target))
    assert upward <= KNOWN, f"imports against DESIGN.md's layers: {sorted(upward - KNOWN)}"


def test_the_runtime_imports_without_the_tuner():
    code = textwrap.dedent("""
        import sys

        class NoTuner:
            def find_spec(self, name, path=None, target=None):
                if name == "l2prefetch.tuning" or name.startswith("l2prefetch.tuning."):
                    raise ImportError(f"{name} is blocked")
                return None
        sys.meta_path.insert(0, NoTuner())
        import l2prefetch
        from l2prefetch import (controller, deepseek_v3, graphs, hooks, kimi_k3, mechanisms,
                                ops, plan, profile)
        assert not any(m.startswith("l2prefetch.tuning") for m in sys.modules)
        print("ok")
    """)
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _run(code):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))


def test_from_profile_reaches_the_file_without_the_tuner(tmp_path):
    """from_profile's whole path (read, check, build) runs without the tuner: with it
    unimportable, a missing profile is the file's error, not an ImportError."""
    pytest.importorskip("torch")
    missing = tmp_path / "none.json"
    r = _run(f"""
        import sys
        sys.modules["l2prefetch.tuning"] = None
        import torch, l2prefetch
        try:
            l2prefetch.PrefetchController.from_profile({str(missing)!r}, torch.nn.Linear(2, 2))
        except ImportError as exc:
            print("ImportError", exc)
        except Exception as exc:
            print(type(exc).__name__, exc)
        """)
    assert r.returncode == 0, r.stderr
    assert not r.stdout.startswith("ImportError"), r.stdout
    assert "none.json" in r.stdout, r.stdout


def test_the_tuner_reexports_the_runtimes_builders():
    from l2prefetch import controller
    from l2prefetch.tuning import rig

    assert rig.build_controller is controller.build_controller
    assert rig.empty_controller is controller.empty_controller
