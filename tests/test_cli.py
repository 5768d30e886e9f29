"""``python -m l2prefetch``: the commands, the no-GPU reason, exit statuses, no torch.

The command line's contract (l2prefetch/cli.py): ``info`` is the default; a bad
option or input, or a missing torch, is exit status 2 with one line on stderr;
a CUDA or NVRTC failure while running is 1; ``--help`` does not import torch.
The ``plan`` command's own tests are in test_cli_plan.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types

import pytest

import l2prefetch
from l2prefetch import _C, cli

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(l2prefetch.__file__)))
NO_DRIVER = "/nonexistent/libcuda.so.1"
#: Words a help text must not use undefined (issue 17).
JARGON = re.compile(r"\bthe seed\b|\bseed's\b|--seed-points|main job|\bwindows?\b|\brun \d+\b",
                    re.IGNORECASE)


def l2p(*args, env=None, no_torch=False, tmp_path=None):
    """Run `python -m l2prefetch ARGS` in a fresh interpreter; without torch if asked."""
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join([PYTHON_DIR, env.get("PYTHONPATH", "")])
    if tmp_path is not None:
        env["L2PREFETCH_CACHE_DIR"] = str(tmp_path / "kcache")
    code = "import sys, runpy; "
    if no_torch:
        code += "sys.modules['torch'] = None; "  # import torch raises ModuleNotFoundError
    code += "runpy.run_module('l2prefetch', run_name='__main__')"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)


def nvrtc_available():
    try:
        _C.nvrtc_info()
    except (l2prefetch.CudaUnavailableError, l2prefetch.Error):
        return False
    return True


def subparsers():
    parser = cli._parser()
    return parser, parser.commands


def test_help_lists_the_commands_and_imports_no_torch(tmp_path):
    code = ("import sys; from l2prefetch.cli import main; status = main(['--help']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(status)")
    env = {**os.environ, "PYTHONPATH": PYTHON_DIR}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^\s+info\s+\S", proc.stdout, re.M), proc.stdout
    assert re.search(r"^\s+plan\s+\S", proc.stdout, re.M), proc.stdout
    assert "With no command, runs 'info'" in " ".join(proc.stdout.split())


def test_plan_says_it_is_kimi_k3_only_and_points_to_tune():
    parser, commands = subparsers()
    top = " ".join(parser.format_help().split())
    assert "plan Kimi K3 only:" in top and "(for your model: tune)" in top
    assert " ".join(commands["plan"].format_help().split()).count("Kimi K3 only") == 1


def test_help_texts_have_no_jargon():
    parser, commands = subparsers()
    for name, text in [("", parser.format_help())] + [
            (name, sub.format_help()) for name, sub in commands.items()]:
        found = JARGON.findall(text)
        assert not found, f"{name or 'top'} --help uses {found}:\n{text}"


def test_every_command_has_the_same_shape():
    _, commands = subparsers()
    assert {"info", "plan"} <= set(commands)
    for name, sub in commands.items():
        func = sub.get_default("func")
        assert callable(func), f"{name} sets no func"


def test_no_gpu_prints_the_whole_reason(tmp_path):
    proc = l2p(env={"L2PREFETCH_LIBCUDA": NO_DRIVER}, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "no GPU to measure on here" in out
    # and what to do next without one
    assert out.rstrip().endswith("(a model's candidate fork points); on a GPU, 'python -m "
                                 "l2prefetch tune MODEL' measures them."), out
    assert "python -m l2prefetch demo" in out
    # Where it looked and why, to the last line of CudaUnavailableError's text.
    assert "looked in:" in out or "could not be loaded" in out, out
    assert NO_DRIVER in out, out
    reason = no_driver_reason()
    assert len(reason.splitlines()) >= 2, reason
    for line in reason.splitlines():
        assert line.strip() in out, f"{line!r} missing from:\n{out}"
    assert "PTX instructions" not in out and "NVRTC options" not in out  # only with --verbose
    assert "Byte ranges (compute_ranges) of a Kimi-sized attention shard" in out
    assert re.search(r"^\s+total\s+38\.00\s+24\.00$", out, re.M), out


def no_driver_reason():
    """The text of the CudaUnavailableError that L2PREFETCH_LIBCUDA=NO_DRIVER gives."""
    code = ("import l2prefetch\n"
            "try:\n    l2prefetch._C.driver_info()\n"
            "except l2prefetch.CudaUnavailableError as exc:\n    print(exc, end='')\n")
    env = {**os.environ, "PYTHONPATH": PYTHON_DIR, "L2PREFETCH_LIBCUDA": NO_DRIVER}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120).stdout


@pytest.mark.parametrize("args", [["-v"], ["info", "-v"], ["-v", "info"], ["info", "--verbose"]])
def test_verbose_adds_the_instruction_mix(tmp_path, args):
    if not nvrtc_available():
        pytest.skip("no NVRTC here: nothing is compiled")
    proc = l2p(*args, env={"L2PREFETCH_LIBCUDA": NO_DRIVER}, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "NVRTC options: --gpu-architecture=sm_90" in proc.stdout
    mix = proc.stdout.split("PTX instructions")[1]
    assert re.search(r"^\s+\S+\s+\d+$", mix, re.M), proc.stdout


def test_info_is_the_default(fake, capsys):
    fake.configure(device_count=0)
    _C._use_driver(fake.path)
    # The two calls compared come after a first one: on the H200, in a pytest-xdist
    # worker, the first info of the process printed ptxas's resource report and the
    # second did not (what NVRTC's log holds is not ours to fix).
    assert cli.main(["info"]) == 0
    capsys.readouterr()
    assert cli.main([]) == 0
    default = capsys.readouterr().out
    assert cli.main(["info"]) == 0
    assert capsys.readouterr().out == default
    assert "the CUDA driver found no GPU" in default
    assert "L2PREFETCH_DISABLE" not in default


def test_info_says_when_prefetching_is_switched_off(fake, capsys, monkeypatch):
    fake.configure(device_count=0)
    _C._use_driver(fake.path)
    monkeypatch.setenv("L2PREFETCH_DISABLE", "yes")
    assert cli.main(["info"]) == 0
    assert capsys.readouterr().out.startswith("L2PREFETCH_DISABLE is set: prefetching is off")
    # a value it does not know (a typo) leaves prefetching on, and info says so on stdout,
    # not only to a logger nobody configured
    for typo in ("ture", "2"):
        monkeypatch.setenv("L2PREFETCH_DISABLE", typo)
        assert cli.main(["info"]) == 0
        assert capsys.readouterr().out.startswith(
            f"L2PREFETCH_DISABLE={typo!r} is not a word l2prefetch knows, so prefetching "
            "stays on: 1 (true, yes, on) turns it off")
    monkeypatch.setenv("L2PREFETCH_DISABLE", "off")
    assert cli.main(["info"]) == 0
    assert "L2PREFETCH_DISABLE" not in capsys.readouterr().out


def test_torch_without_cuda_is_a_reason(fake, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here")
    _C._use_driver(fake.path)
    assert cli.main(["info"]) == 0
    assert f"torch {torch.__version__} sees no CUDA device" in capsys.readouterr().out


def test_cuda_failure_is_exit_status_1(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise l2prefetch.Error("cuSomething failed: CUDA_ERROR_UNKNOWN: unknown error")

    monkeypatch.setattr(cli, "_why_no_gpu", lambda: "no GPU (test)")
    monkeypatch.setattr(cli, "_print_ranges", broken)
    assert cli.main(["info"]) == 1
    err = capsys.readouterr().err
    assert err == "l2prefetch info: cuSomething failed: CUDA_ERROR_UNKNOWN: unknown error\n"


def test_ctrl_c_is_exit_status_130(monkeypatch, capsys):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_why_no_gpu", interrupted)
    assert cli.main([]) == 130
    assert capsys.readouterr().err == "l2prefetch info: interrupted\n"


@pytest.mark.parametrize("args, words", [
    (["--bogus"], r"^python -m l2prefetch: error: unrecognized arguments: --bogus$"),
    (["info", "--bogus"], r"^python -m l2prefetch info: error: unrecognized arguments: --bogus$"),
    (["plan", "--bogus"], r"^python -m l2prefetch plan: error: unrecognized arguments: --bogus$"),
    (["tune-nothing"], r"^python -m l2prefetch: error: argument COMMAND: invalid choice"),
])
def test_usage_errors_are_one_line_and_exit_2(capsys, args, words):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and re.search(words, err), err


def test_version_and_script_name(monkeypatch, capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"l2prefetch {l2prefetch.__version__}\n"
    monkeypatch.setattr(sys, "argv", ["/usr/bin/l2prefetch"])
    assert cli.main(["--bogus"]) == 2
    assert capsys.readouterr().err.startswith("l2prefetch: error: unrecognized arguments")


def test_without_torch(tmp_path):
    proc = l2p("plan", no_torch=True, tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("l2prefetch plan: needs torch, which is not installed: "
                           "install torch 2.11-2.13 (README, Install)\n")
    for command in ("tune", "trace"):   # both of what they need, torch and the 'tune' extra
        proc = l2p(command, "llama", "--list-roles" if command == "tune" else "--role=after x: y",
                   no_torch=True, tmp_path=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr == (f"l2prefetch {command}: needs torch, which is not installed: "
                               "install torch 2.11-2.13, then l2prefetch's 'tune' extra "
                               "(transformers; README, Install)\n")
    proc = l2p("--help", no_torch=True, tmp_path=tmp_path)
    assert proc.returncode == 0 and "plan" in proc.stdout, proc.stderr
    proc = l2p(env={"L2PREFETCH_LIBCUDA": NO_DRIVER}, no_torch=True, tmp_path=tmp_path)
    assert proc.returncode == 0 and "Byte ranges" in proc.stdout, proc.stderr  # no torch needed
    code = ("import sys; sys.modules['torch'] = None\n"
            "import l2prefetch, l2prefetch.plan, l2prefetch.hooks, l2prefetch.kimi_k3\n"
            "import l2prefetch.deepseek_v3, l2prefetch.controller, l2prefetch.cli\n"
            "for call in (lambda: l2prefetch.hooks.attach(object(), object(), {}),\n"
            "             lambda: l2prefetch.kimi_k3.attention_weights(object())):\n"
            "    try:\n        call()\n"
            "    except ModuleNotFoundError as exc:\n        print(exc.name, exc)\n"
            "try:\n    import l2prefetch.ops\n"
            "except ModuleNotFoundError as exc:\n    print(exc.name, exc)\n")
    env = {**os.environ, "PYTHONPATH": PYTHON_DIR}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.stdout == "".join(
        f"torch {what} needs torch, which is not installed: install torch 2.11-2.13 (README, "
        "Install)\n"
        for what in ("l2prefetch.hooks.attach", "kimi_k3.attention_weights", "l2prefetch.ops")
    ), proc.stderr


def test_gpu_found_but_no_torch_is_a_reason(fake, monkeypatch, capsys):
    _C._use_driver(fake.path)
    monkeypatch.setitem(sys.modules, "torch", None)
    assert cli.main(["info"]) == 0
    assert "measuring on the GPU needs torch, which is not installed: install torch " \
           "2.11-2.13 (README, Install)" in capsys.readouterr().out


# -- tune: registered from l2prefetch.tuning.cli where that module exists -------------------

def fake_tuning(monkeypatch, calls):
    """A stand-in l2prefetch.tuning.cli with the shape the real one has."""
    def add_parser(subparsers):
        parser = subparsers.add_parser("tune", help="tune the plan on this GPU")
        parser.add_argument("--budget", type=int, default=1)
        parser.set_defaults(func=run)

    def run(args):
        calls.append(args.budget)
        return 0

    module = types.ModuleType("l2prefetch.tuning.cli")
    module.add_parser, module.run = add_parser, run
    package = types.ModuleType("l2prefetch.tuning")
    package.__path__ = []
    package.cli = module
    monkeypatch.setitem(sys.modules, "l2prefetch.tuning", package)
    monkeypatch.setitem(sys.modules, "l2prefetch.tuning.cli", module)


def test_the_real_tune_is_registered(capsys):
    try:
        from l2prefetch.tuning import cli as tuning_cli
    except ImportError:
        pytest.skip("no l2prefetch.tuning.cli here")
    assert subparsers()[1]["tune"].get_default("func") is tuning_cli.run
    assert cli.main(["tune", "--help"]) == 0
    assert "usage: python -m l2prefetch tune" in capsys.readouterr().out
    assert cli.main(["tune"]) == 2                      # its usage errors: one line, exit 2
    assert len(capsys.readouterr().err.splitlines()) == 1


def test_tune_is_registered_where_it_exists(monkeypatch, capsys):
    if "tune" in subparsers()[1]:
        pytest.skip("the real l2prefetch.tuning.cli is here")
    assert cli.main(["tune"]) == 2                       # not there: an unknown command
    assert "invalid choice: 'tune'" in capsys.readouterr().err
    calls = []
    fake_tuning(monkeypatch, calls)
    assert cli.main(["tune", "--budget", "3"]) == 0 and calls == [3]
    assert re.search(r"^\s+tune\s+tune the plan", capsys.readouterr().out, re.M) is None
    assert cli.main(["--help"]) == 0
    assert re.search(r"^\s+tune\s+tune the plan on this GPU", capsys.readouterr().out, re.M)
    assert cli.main(["tune", "--budget", "x"]) == 2
    assert "python -m l2prefetch tune: error: argument --budget" in capsys.readouterr().err


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`l2prefetch plan --all-points | head -1`: the pipe closes under the writer; the
    command exits quietly (141, as a shell reports SIGPIPE), not with a BrokenPipeError."""
    proc = subprocess.Popen([sys.executable, "-m", "l2prefetch", "plan", "--all-points"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()   # before it writes: its first write (or flush) finds no reader
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err, err
