"""``python -m l2prefetch demo`` (l2prefetch/tuning/demo.py) and ``./dev.sh run``'s default.

On the CPU: the path without a GPU end to end (and without torch), bad options and
outputs refused in one line with exit status 2 before anything is built, and dev.sh's
``run`` with no arguments running ``demo``.  On a GPU (marked ``gpu``): the demo with a
small budget writes each case's files, and its profiles load.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import l2prefetch
from l2prefetch import cli
from l2prefetch.tuning import demo

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(l2prefetch.__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_DRIVER = "/nonexistent/libcuda.so.1"
#: A model that builds and decodes on the CPU in a fraction of a second, with weights of
#: 1 MiB and more in its MLPs, so that it has roles.
TINY = ["--set", "num_hidden_layers=2", "--set", "hidden_size=1024", "--set",
        "intermediate_size=3072", "--set", "num_attention_heads=8", "--set",
        "num_key_value_heads=2", "--set", "vocab_size=1024"]


def l2p(*args, tmp_path, no_torch=False, env=None):
    """`python -m l2prefetch ARGS` in a fresh interpreter, in tmp_path; no torch if asked."""
    env = {**os.environ, **(env or {}), "L2PREFETCH_CACHE_DIR": str(tmp_path / "kcache")}
    env["PYTHONPATH"] = os.pathsep.join([PYTHON_DIR, env.get("PYTHONPATH", "")])
    code = "import sys, runpy; "
    if no_torch:
        code += "sys.modules['torch'] = None; "
    code += "runpy.run_module('l2prefetch', run_name='__main__')"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)


@pytest.fixture
def nothing_built(monkeypatch):
    """The demo may check, but must build no model; where it looks for a GPU, it finds
    none (the calls are counted: only the fit check, which needs the device, comes
    after)."""
    looked = []

    def refuse(*args, **kwargs):
        raise AssertionError("built before the options were checked")

    monkeypatch.setattr(demo, "build_model", refuse)
    monkeypatch.setattr(demo, "gpu_reason", lambda torch: looked.append(1) or "no GPU (test)")
    return looked


def _refused(capsys, args, words):
    assert cli.main(["demo", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert re.search(words, err), err
    return err


# -- without a GPU ---------------------------------------------------------------------------

def test_without_a_gpu_it_lists_the_roles_shows_a_plan_and_compiles(tmp_path):
    pytest.importorskip("transformers")
    proc = l2p("demo", *TINY, tmp_path=tmp_path, env={"L2PREFETCH_LIBCUDA": NO_DRIVER})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith(f"l2prefetch {l2prefetch.__version__} demo: nothing is measured "
                          "here"), out
    assert "no GPU to measure on: " in out and NO_DRIVER in out, out
    assert "On a GPU this command would, in about 2 minutes:" in out, out
    assert "| role | layers | largest load |" in out, out
    assert re.search(r"^\| before post_attention_layernorm: mlp\.gate_proj \| 2 \| ", out,
                     re.M), out
    assert "The demo measures 3 of them" in out, out
    assert "L2 prefetch plan: 2 entries" in out, out
    assert re.search(r"^\| before post_attention_layernorm: mlp\.gate_proj \| 1 \| 1 \| "
                     r".* inline \|$", out, re.M), out
    assert ("The loader kernel: NVRTC " in out and "for sm_90" in out) or \
        "The loader kernel: not compiled, NVRTC is not available (pip install " \
        "'nvidia-cuda-nvrtc>=13,<14')" in out, out
    # progress on stderr, nothing else; nothing written
    assert all(line.startswith("[l2prefetch demo] ") for line in proc.stderr.splitlines()), \
        proc.stderr
    assert "[l2prefetch demo] building a Llama of 2 layers" in proc.stderr
    assert not (tmp_path / demo.DEFAULT_OUT).exists()


def test_with_prefetching_switched_off_it_refuses_without_a_gpu_too(tmp_path):
    """README, Configuration: under L2PREFETCH_DISABLE the demo refuses to run."""
    proc = l2p("demo", "--quiet", tmp_path=tmp_path,
               env={"L2PREFETCH_LIBCUDA": NO_DRIVER, "L2PREFETCH_DISABLE": "1"})
    assert proc.returncode == 2, proc.stdout
    assert proc.stdout == ""
    assert proc.stderr == ("l2prefetch demo: L2PREFETCH_DISABLE is set, so nothing forks: "
                           "unset it to run the demo\n")


def test_without_torch_it_names_the_extras_and_compiles(tmp_path):
    proc = l2p("demo", "--quiet", tmp_path=tmp_path, no_torch=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    out = proc.stdout
    assert "torch is not installed: install torch 2.11-2.13 (README, Install)" in out, out
    assert "The model's roles and a plan: skipped (building the model needs torch and " \
           "transformers: l2prefetch's 'tune' extra)" in out, out
    assert "- build a Llama of 4 layers, hidden 2048" in out, out
    assert "The loader kernel: " in out, out


def test_a_set_the_forward_refuses_is_one_line(tmp_path, monkeypatch, capsys):
    """--set num_key_value_heads=3: the config takes it, the attention does not (32 heads):
    one line naming --set, exit 2, not the forward's traceback."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(demo, "gpu_reason", lambda torch: "no GPU (test)")
    monkeypatch.setattr(demo, "_print_kernel", lambda: None)
    assert cli.main(["demo", "--quiet", "--out", str(tmp_path / "o"), "--set",
                     "num_key_value_heads=3", "--set", "num_hidden_layers=1"]) == 2
    err = capsys.readouterr().err   # stdout has said what it would do on a GPU
    assert len(err.splitlines()) == 1 and re.search(
        r"^l2prefetch demo: --set: the model it builds fails its decode step: step\(1\) "
        r"failed while discovering the weights it reads: RuntimeError", err), err


def test_what_it_would_do_follows_the_options(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.setattr(demo, "gpu_reason", lambda torch: "no GPU (test)")
    monkeypatch.setattr(demo, "_roles_and_plan", lambda args, config: None)
    monkeypatch.setattr(demo, "_print_kernel", lambda: None)
    out = tmp_path / "o"
    assert cli.main(["demo", "--quiet", "--compile", "--budget", "300", "--all-roles",
                     "--spin-us", "12.5", "--out", str(out), "--set",
                     "num_hidden_layers=3"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "no GPU to measure on: no GPU (test)" in text
    assert "in about 10 minutes" in text and "a Llama of 3 layers" in text
    assert "its step compiled by torch.compile (default) at batch 1 for 300 s, measuring " \
           "every role" in text
    assert "a 12.5 us spin before each layer's post_attention_layernorm" in text
    assert f"to {out}/" in text and "trace" not in text      # compiled: no trace
    assert not out.exists()


# -- bad options and outputs: one line, exit 2, before anything is built ---------------------

@pytest.mark.parametrize("args, words", [
    (["--budget", "0"], r"^python -m l2prefetch demo: error: argument --budget: --budget "
                        r"must be in \(0, 86400\], got 0$"),
    (["--budget", "soon"], r"argument --budget: --budget must be a number, got 'soon'$"),
    (["--spin-us", "-1"], r"argument --spin-us: --spin-us must be in \(0, 1000\]"),
    (["--compile", "reduce-overhead"], r"argument --compile: 'reduce-overhead' captures CUDA "
                                       r"graphs of its own"),
    (["--bogus"], r"demo: error: unrecognized arguments: --bogus$"),
    (["--out"], r"argument --out: expected one argument$"),
    (["--set", "hidden_size"], r"^l2prefetch demo: --set: a config override must be "
                               r"KEY=VALUE, got 'hidden_size'$"),
    (["--set", "hidden_sise=64"], r"^l2prefetch demo: --set hidden_sise=64: LlamaConfig has "
                                  r"no field 'hidden_sise' \(closest: hidden_size"),
    (["--set", "num_hidden_layers=0"], r"^l2prefetch demo: --set: num_hidden_layers must be "
                                       r"an int >= 1, got 0"),
    (["--set", "num_hidden_layers=two"], r"^l2prefetch demo: --set num_hidden_layers=two: "
                                         r"LlamaConfig.num_hidden_layers takes an int"),
    (["--set", "hidden_size=100000"], r"^l2prefetch demo: --set: the demo's model .* make it "
                                      r"smaller"),
])
def test_bad_options_are_one_line_and_exit_2(capsys, nothing_built, tmp_path, args, words):
    if any(a.startswith(("hidden_", "num_")) for a in args):
        pytest.importorskip("transformers")
    _refused(capsys, ["--out", str(tmp_path / "o"), *args], words)
    assert not (tmp_path / "o").exists()
    assert not nothing_built or "hidden_size=100000" in args     # no GPU looked for


def test_an_empty_out_is_refused(tmp_path, capsys, nothing_built, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _refused(capsys, ["--out", ""], r"^l2prefetch demo: --out is empty: name a directory "
                                    r"\(created if missing\), e\.g\. --out l2prefetch-demo$")
    assert list(tmp_path.iterdir()) == [] and not nothing_built   # no GPU looked for


def test_a_file_in_the_way_of_out_is_refused(tmp_path, capsys, nothing_built):
    (tmp_path / "f").write_text("keep")
    _refused(capsys, ["--out", str(tmp_path / "f")],
             r"^l2prefetch demo: --out .*f is a file, not a directory: name a directory")
    _refused(capsys, ["--out", str(tmp_path / "f" / "sub")],
             r"^l2prefetch demo: --out .*sub cannot be created: .*f is not a directory$")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    _refused(capsys, ["--out", str(tmp_path / "dangling")], r"is a link to nothing")
    assert (tmp_path / "f").read_text() == "keep"


@pytest.mark.parametrize("compiled", [[], ["--compile"]])
def test_an_output_in_the_way_is_refused_in_either_mode(tmp_path, capsys, nothing_built,
                                                         compiled):
    """A link planted at an output's temporary name, or a directory where an output goes:
    refused before anything is built, the link's target untouched."""
    out = tmp_path / "o"
    out.mkdir()
    tag = "compiled" if compiled else "eager"
    victim = tmp_path / "victim"
    victim.write_text("keep")
    planted = out / f".planted-{tag}.json.{os.getpid()}.tmp"
    os.symlink(victim, planted)
    _refused(capsys, ["--out", str(out), *compiled],
             rf"^l2prefetch demo: the planted profile .*planted-{tag}\.json cannot be "
             r"written: .* is in the way")
    assert victim.read_text() == "keep" and planted.is_symlink()
    planted.unlink()
    (out / f"plain-{tag}.md").mkdir()
    _refused(capsys, ["--out", str(out), *compiled],
             rf"^l2prefetch demo: the plain report .*plain-{tag}\.md is a directory")


def test_the_outputs_per_case():
    files = demo.outputs("d", None)
    assert [path for _, path in files["plain"]] == [
        "d/plain-eager.json", "d/plain-eager.md", "d/plain-eager.png",
        "d/plain-eager-trace.md", "d/plain-eager-trace.png"]
    assert [path for _, path in demo.outputs("d", "default")["planted"]] == [
        "d/planted-compiled.json", "d/planted-compiled.md", "d/planted-compiled.png"]


# -- the command line and dev.sh -------------------------------------------------------------

def test_demo_is_registered_and_its_help_needs_no_torch(tmp_path):
    parser = cli._parser()
    assert parser.commands["demo"].get_default("func") is demo.run
    proc = l2p("demo", "--help", tmp_path=tmp_path, no_torch=True)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for words in ("usage: python -m l2prefetch demo", "about two minutes on a GPU",
                  "Without a GPU (or torch, transformers, NVRTC)", "--compile [MODE]",
                  "default ./l2prefetch-demo/", "Exit status: 0 done"):
        assert words in text, proc.stdout
    proc = l2p("--help", tmp_path=tmp_path, no_torch=True)
    assert re.search(r"^\s+demo\s+the whole flow on a small built-in model", proc.stdout,
                     re.M), proc.stdout


def _dev_sh_run(*args):
    """dev.sh's dispatch with its set-up stubbed: what `./dev.sh run ARGS` would exec."""
    text = open(os.path.join(ROOT, "dev.sh"), encoding="utf-8").read()
    dispatch = text[text.index('case "${1:-}" in'):]
    script = "set -euo pipefail\npick_python() { PY=echo; }\ninstall() { :; }\n" + dispatch
    return subprocess.run(["bash", "-c", script, "dev.sh", "run", *args],
                          capture_output=True, text=True, timeout=60)


def test_dev_sh_run_defaults_to_the_demo():
    proc = _dev_sh_run()
    assert proc.returncode == 0 and proc.stdout == "-m l2prefetch demo\n", proc
    proc = _dev_sh_run("info", "-v")
    assert proc.returncode == 0 and proc.stdout == "-m l2prefetch info -v\n", proc
    header = open(os.path.join(ROOT, "dev.sh"), encoding="utf-8").read().split("set -e")[0]
    assert "(no ARGS: demo" in header


# -- on a GPU --------------------------------------------------------------------------------

@pytest.mark.gpu
def test_the_demo_on_a_gpu_writes_each_case_and_its_profiles_load(tmp_path, capsys,
                                                                   monkeypatch):
    """The whole demo at a small budget: each case's profile, report and plot, a trace
    where a plan was kept, and a summary; each profile loads against the demo's model."""
    import torch

    from l2prefetch.profile import load_profile

    monkeypatch.delenv("L2PREFETCH_DISABLE", raising=False)
    out = tmp_path / "demo"
    assert cli.main(["demo", "--out", str(out), "--budget", "20"]) == 0
    text, err = capsys.readouterr()
    print(text)
    assert "[l2prefetch demo] case 2 of 2, planted" in err
    model = demo.build_model(demo.make_config(), "meta")
    for case in demo.CASES:
        paths = dict(zip(("profile", "report", "plot", "trace", "trace plot"),
                         (path for _, path in demo.outputs(str(out), None)[case])))
        assert re.search(rf"^{case}, .*: the step takes \d+\.\d us$", text, re.M), text
        for kind in ("profile", "report"):
            assert os.path.isfile(paths[kind]) and f"file: {paths[kind]}" in text
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            pass
        else:
            assert os.path.getsize(paths["plot"]) > 0
        profile = load_profile(paths["profile"], model, check_device=False)
        load_profile(paths["profile"], model, device=torch.cuda.current_device())
        assert os.path.isfile(paths["trace"]) == bool(profile.plan)
        if profile.plan:
            assert "confirmed: " in text.split(f"\n{case}, ")[1].split("\n\n")[0]
    assert not any(name.endswith(".tmp") for name in os.listdir(out))


def test_the_summary_of_a_batch_not_prepared_says_so_and_how_to_fix_it():
    """A case whose batch the search did not prepare (the budget ran out first) has no
    step time: its summary says the step was not measured (no 'nan') and, since the
    reason names the budget, where to give more."""
    import argparse

    from l2prefetch.tuning.results import BatchReport
    from l2prefetch.tuning.search import NOT_PREPARED

    rep = BatchReport(batch=1, reason=NOT_PREPARED)
    text = demo._summary("planted", argparse.Namespace(spin_us=40.0), rep, ["out/p.json"])
    assert "nan" not in text
    assert text.splitlines()[0].endswith(": the step was not measured")
    assert "plan: empty (not prepared: its share of the budget" in text
    assert "budget_s, --budget)" in text and text.endswith("file: out/p.json")
