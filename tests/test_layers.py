"""The runtime never imports the tuner (python/l2prefetch/DESIGN.md): a server that loads a
profile needs none of l2prefetch.tuning's code, and nothing in the runtime reaches it."""

import subprocess
import sys
import textwrap

import pytest

RUNTIME = ("l2prefetch", "l2prefetch.controller", "l2prefetch.plan", "l2prefetch.profile",
           "l2prefetch.hooks", "l2prefetch.ops", "l2prefetch.graphs", "l2prefetch.deepseek_v3",
           "l2prefetch.kimi_k3")


def run(code):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)


def test_the_runtime_imports_without_the_tuner():
    """Every runtime module imports with l2prefetch.tuning made unimportable."""
    r = run(f"""
        import sys
        sys.modules["l2prefetch.tuning"] = None   # any import of it now raises ImportError
        import importlib
        for name in {RUNTIME!r}:
            importlib.import_module(name)
        print(sorted(m for m in sys.modules if m.startswith("l2prefetch.tuning")))
        """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['l2prefetch.tuning']"


def test_from_profile_reaches_the_file_without_the_tuner(tmp_path):
    """from_profile's whole path (read, check, build) runs without the tuner: with it
    unimportable, a missing profile is the file's error, not an ImportError."""
    pytest.importorskip("torch")
    missing = tmp_path / "none.json"
    r = run(f"""
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
