"""``l2prefetch tune``'s options and errors (CPU: no measuring; --list-roles discovers)."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from l2prefetch.tuning import cli, hf

TINY = ["--set", "hidden_size=512", "--set", "intermediate_size=1024",
        "--set", "num_hidden_layers=2", "--set", "num_attention_heads=8",
        "--set", "num_key_value_heads=2", "--set", "vocab_size=1024"]


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_parse_overrides():
    assert hf.parse_overrides(["a=1", "b=1.5", "c=true", "d=[1, 2]", "e=text"]) == {
        "a": 1, "b": 1.5, "c": True, "d": [1, 2], "e": "text"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        hf.parse_overrides(["novalue"])
    with pytest.raises(ValueError, match="config field name"):
        hf.parse_overrides(["1x=2"])
    # a deeply nested value is kept as text, not a RecursionError
    assert hf.parse_overrides(["a=" + "[" * 100000])["a"].startswith("[[")


def test_model_options_name_the_option_at_fault():
    """tune's and trace's commands check --dtype and --set in one place, hf.model_options."""
    assert hf.model_options("bfloat16", ["a=1", "e=text"]) == {"a": 1, "e": "text"}
    with pytest.raises(ValueError, match=r"^--dtype: .*float16"):
        hf.model_options("int8", ["a=1"])
    with pytest.raises(ValueError, match=r"^--set: .*KEY=VALUE"):
        hf.model_options("float32", ["novalue"])


def test_list_roles_on_the_cpu(capsys):
    pytest.importorskip("transformers")
    code, out, err = run(["llama", *TINY, "--device", "cpu", "--dtype", "float32",
                          "--list-roles", "--min-bytes-mib", "0.25"], capsys)
    assert code == 0, err
    assert "| after self_attn.v_proj: self_attn.o_proj | 2 |" in out
    assert "| after mlp: next self_attn.q_proj | 1 |" in out
    # the column says what it counts (issue 41.7: after gate_proj it showed 24.3 MiB where
    # up_proj is 1.5 MiB): the consumer's weights and those read after it
    assert out.splitlines()[-1] == (
        "largest load: the most one fork of the role can load: its consumer's weights and "
        "those of the reads after it, at most the largest cap, 48 MiB (--caps-mib)")
    # the column obeys it: a chain ends with a whole read, a fork at the largest cap
    code, out, err = run(["llama", *TINY, "--device", "cpu", "--dtype", "float32",
                          "--list-roles", "--min-bytes-mib", "0.25", "--caps-mib", "0.5,1"],
                         capsys)
    assert code == 0, err
    loads = [line.rsplit("|", 2)[-2].strip() for line in out.splitlines()
             if line.startswith("| after") or line.startswith("| before")]
    assert loads and set(loads) <= {"1.0 MiB", "512 KiB"}, loads
    assert out.splitlines()[-1].endswith("at most the largest cap, 1 MiB (--caps-mib)")


def test_list_roles_of_the_compiled_step_on_the_cpu(capsys):
    """--compile --list-roles --device cpu: the compiled step runs (Inductor's CPU
    backend), and the roles are the eager step's (issue 40)."""
    pytest.importorskip("transformers")
    import shutil

    import torch

    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("Inductor's CPU backend needs a C++ compiler")
    argv = ["llama", *TINY, "--device", "cpu", "--list-roles", "--min-bytes-mib", "0.25"]
    code, eager, _ = run(argv, capsys)
    assert code == 0
    try:
        code, compiled, err = run([*argv, "--compile"], capsys)
    finally:
        torch._dynamo.reset()
    assert code == 0, err
    assert compiled == eager
    assert "compiled with torch.compile (Inductor, mode default)" in err
    assert re.search(r"the compiled step ran at batch 1 in [\d.]+ s", err)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune", "nope"])
def test_compile_modes_that_capture_their_own_graphs_are_refused(mode, capsys):
    code, _, err = status(["llama", *TINY, "--device", "cpu", "--list-roles", "--compile",
                           mode], capsys)
    assert code == 2
    assert "--compile" in err and "max-autotune-no-cudagraphs" in err
    # it says why: these modes capture CUDA graphs of their own; an unknown one is no mode
    assert ("captures CUDA graphs of its own" in err) == (mode != "nope"), err
    assert ("is not an Inductor mode the tuner measures" in err) == (mode == "nope"), err


def test_config_json_and_class_name_sources(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024,
                                      num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=2, vocab_size=1024)
    config.save_pretrained(tmp_path)          # a directory with only config.json
    for source in (str(tmp_path), str(tmp_path / "config.json")):
        model = hf.load_model(source, device="cpu", dtype="float32")
        assert type(model).__name__ == "LlamaForCausalLM"
        assert model.config.num_hidden_layers == 2
    model = hf.load_model("LlamaConfig", overrides={"num_hidden_layers": 1, "hidden_size": 256,
                                                    "intermediate_size": 512,
                                                    "num_attention_heads": 4,
                                                    "num_key_value_heads": 2,
                                                    "vocab_size": 512},
                          device="cpu", dtype="float32")
    assert model.config.num_hidden_layers == 1
    # a checkpoint directory: from_pretrained, local files only
    model.save_pretrained(tmp_path / "ckpt")
    loaded = hf.load_model(str(tmp_path / "ckpt"), device="cpu", dtype="float32")
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert (a == b).all(), name


def test_decode_step_replays_the_same_step():
    pytest.importorskip("transformers")
    import torch

    model = hf.load_model("llama", overrides=hf.parse_overrides(TINY[1::2]), device="cpu",
                          dtype="float32")
    step = hf.DecodeStep(model, max_cache_len=16)
    first, second = step(3), step(3)
    assert first.shape == (3, 1, 1024) and torch.equal(first, second)
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        step(0)
    with pytest.raises(ValueError, match="max_cache_len"):
        hf.DecodeStep(model, prompt_len=8, max_cache_len=8)


def test_the_cache_goes_in_under_the_name_forward_takes():
    import functools

    class New:      # transformers 5.24: cache=, past_key_values= deprecated
        def forward(self, input_ids=None, cache=None, use_cache=None):
            pass

    class Old:      # transformers 5.17
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            pass

    class Wrapped:  # a decorator such as transformers' deprecate_kwarg (functools.wraps)
        forward = functools.wraps(New.forward)(lambda self, *args, **kwargs: None)

    assert hf.cache_keyword(New()) == "cache"
    assert hf.cache_keyword(Old()) == "past_key_values"
    assert hf.cache_keyword(Wrapped()) == "cache"


def test_decode_step_passes_no_deprecated_argument():
    pytest.importorskip("transformers")
    import warnings

    model = hf.load_model("llama", overrides=hf.parse_overrides(TINY[1::2]), device="cpu",
                          dtype="float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf.DecodeStep(model, max_cache_len=16)(2)
    deprecations = [str(w.message) for w in caught
                    if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert deprecations == []


def test_list_roles_says_what_it_builds_and_how_big(capsys):
    pytest.importorskip("transformers")
    argv = ["llama", *TINY, "--device", "cpu", "--dtype", "float32", "--list-roles"]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    model = hf.load_model("llama", overrides=hf.parse_overrides(TINY[1::2]), device="cpu",
                          dtype="float32")
    count = sum(p.numel() for p in model.parameters())
    lines = err.splitlines()
    assert lines[0] == (f"[l2prefetch tune] LlamaForCausalLM, 2 layers, {count / 1e6:.1f} "
                        f"million parameters ({count * 4 / 2**30:.2f} GiB of float32) from "
                        "the model type llama (LlamaConfig): building it with random weights "
                        "on cpu"), err
    assert lines[1].startswith("[l2prefetch tune] model ready in ")
    assert "discovering the roles" in lines[2] and len(lines) == 3
    assert run([*argv, "--quiet"], capsys) == (0, out, "")


@pytest.mark.parametrize("argv, message", [
    (["llama", "--batches", "1,x"], "--batches must be comma-separated integers"),
    (["llama", "--budget", "0"], "--budget must be in"),
    (["llama", "--budget", "1e308"], "--budget must be in"),
    (["llama", "--instances", "3"], "--instances must be in"),
    (["llama", "--caps-mib", "0"], "--caps-mib must be numbers > 0"),
    (["llama", "--max-instances", "4"], "--max-instances must be in 5..1000"),
    (["llama", "--resolution", "0"], "--resolution must be in (0, 0.5]"),
    (["llama", "--resolution", "x"], "--resolution must be a number"),
    (["llama", "--max-instances", "5.0"], "--max-instances must be a whole number, got '5.0'"),
    (["llama", "--rounds", "0"], "--rounds must be in 1..100000, got 0"),
    (["llama", "--rounds", "ten"], "--rounds must be a whole number, got 'ten'"),
])
def test_bad_options_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err


def test_tune_sweeps_every_graph_fork_mode_by_default():
    """As tune() does (and the README says): every mode of l2prefetch.mechanisms."""
    import argparse

    from l2prefetch.mechanisms import GRAPH_FORKS

    parser = argparse.ArgumentParser()
    cli.configure(parser)
    assert parser.parse_args(["llama"]).graph_forks.split(",") == list(GRAPH_FORKS)


def test_errors_before_measuring_exit_2(capsys, monkeypatch):
    import torch

    code, _, err = run(["llama", "--device", "cpu"], capsys)
    assert code == 2 and "--device must be a CUDA device" in err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run(["llama"], capsys)
    assert code == 2 and "tuning needs a CUDA GPU" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(["llama", "--set", "nonsense", "--device", "cpu", "--list-roles"], capsys)
    assert code == 2 and "--set: a config override must be KEY=VALUE, got 'nonsense'" in err


def test_an_unknown_model_exits_2(capsys):
    pytest.importorskip("transformers")
    code, _, err = run(["no-such-model-type", "--device", "cpu", "--list-roles"], capsys)
    assert code == 2 and "neither a checkpoint directory" in err
    # a path that is not there says so first
    for path in ("/nonexistent/ckpt", "./ckpt", "config.json", "meta-llama/Llama-3.1-8B"):
        code, _, err = run([path, "--device", "cpu", "--list-roles"], capsys)
        assert code == 2 and f"{path!r}: no such file or directory (pass a checkpoint" in err
        # what looks like a Hub id is told that nothing is downloaded
        assert ("Hub id is not downloaded" in err) == (path == "meta-llama/Llama-3.1-8B"), err


def test_without_transformers_exit_2(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    code, _, err = run(["llama", "--device", "cpu", "--list-roles"], capsys)
    assert code == 2 and "needs transformers" in err and len(err.strip().splitlines()) == 1


def test_a_directory_without_config(tmp_path, capsys):
    pytest.importorskip("transformers")
    code, _, err = run([str(tmp_path), "--device", "cpu", "--list-roles"], capsys)
    assert code == 2 and "without config.json" in err


# -- issue 21: bad input is one line and exit status 2, before anything is built ---------------

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128)
SMALL = [arg for key, value in LLAMA.items() for arg in ("--set", f"{key}={value}")]


def small(**changed):
    """--set options of a tiny Llama, with ``changed`` fields (None: left out)."""
    fields = {**LLAMA, **changed}
    return [a for k, v in fields.items() if v is not None for a in ("--set", f"{k}={v}")]


@pytest.fixture
def checkpoint(tmp_path):
    """A tiny Llama checkpoint directory (config.json, generation_config.json, safetensors)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**LLAMA)
    path = tmp_path / "ckpt"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def status(argv, capsys):
    """(exit status, stdout, stderr) of ``l2prefetch tune ARGV``, argparse's exits included."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_trust_remote_code_is_refused_before_any_code_of_the_checkpoint_runs(checkpoint, capsys):
    # The checkpoint names its own configuration code; --set was forwarded to
    # AutoConfig.from_pretrained, so trust_remote_code=true imported and ran it.
    marker = checkpoint / "ran"
    (checkpoint / "configuration_planted.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import LlamaConfig\n\n\nclass PlantedConfig(LlamaConfig):\n    pass\n")
    config = json.loads((checkpoint / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_planted.PlantedConfig",
                          "AutoModelForCausalLM": "configuration_planted.PlantedConfig"}
    (checkpoint / "config.json").write_text(json.dumps(config))
    code, _, err = status([str(checkpoint), "--set", "trust_remote_code=true", "--list-roles",
                        "--device", "cpu"], capsys)
    assert code == 2 and not marker.exists()
    assert re.search(r"--set trust_remote_code=true: LlamaConfig has no field "
                     r"'trust_remote_code'", one_line(err))
    # auto_map alone runs nothing either: transformers' own Llama is built
    code, out, err = status([str(checkpoint), "--list-roles", "--device", "cpu", "--dtype",
                          "float32", "--min-bytes-mib", "0.001"], capsys)
    assert code == 0 and "| after" in out and not marker.exists(), err


def test_a_model_type_transformers_lacks_is_refused_without_running_its_code(tmp_path, capsys):
    pytest.importorskip("transformers")
    marker = tmp_path / "ran"
    (tmp_path / "configuration_x.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "planted_model", "auto_map": {"AutoConfig": "configuration_x.XConfig"}}))
    code, _, err = status([str(tmp_path), "--list-roles", "--device", "cpu"], capsys)
    assert code == 2 and not marker.exists()
    assert "model_type 'planted_model' is not one transformers" in one_line(err)


@pytest.mark.parametrize("argv, words", [
    # a misspelt field: transformers keeps it as an attribute nothing reads, and built the
    # whole default model (32 layers for qwen3: the OOM killer ended the process)
    (["llama", *small(num_hidden_layers=None), "--set", "num_hiden_layers=2"],
     r"--set num_hiden_layers=2: LlamaConfig has no field 'num_hiden_layers' \(closest: "
     r"num_hidden_layers"),
    (["llama", *SMALL, "--list-role"], r"unrecognized arguments: --list-role$"),
    (["llama", *SMALL, "--dtype", "bf16"], r"--dtype: dtype must name a floating-point torch "
                                           r"dtype \(bfloat16, float16, float32 or "
                                           r"float64\), got 'bf16'"),
    (["llama", *SMALL, "--dtype", "int8"], r"--dtype: .*got 'int8'"),
    (["llama", *SMALL, "--device", "gpu"], r"--device: device must be 'cpu', 'cuda' or "
                                           r"'cuda:N', got 'gpu'"),
    (["llama", *SMALL, "--device", "nonsense"], r"--device: .*got 'nonsense'"),
    (["llama", *SMALL, "--device", "cuda:3"], r"--device: device 'cuda:3': torch .* sees no "
                                              r"CUDA GPU here"),
    (["llama", *small(num_hidden_layers="two")],
     r"--set num_hidden_layers=two: LlamaConfig.num_hidden_layers takes an int"),
    (["llama", *small(num_hidden_layers="1e400")],
     r"--set num_hidden_layers=Infinity: must be a finite number"),
    (["llama", *small(hidden_size="NaN")], r"--set hidden_size=NaN: must be a finite number"),
    (["llama", *small(num_attention_heads=3)],
     r"no valid LlamaConfig from the overrides: ValueError: The hidden size \(64\) is not a "
     r"multiple of the number of attention heads \(3\)"),
    (["llama", *small(vocab_size=0)], r"vocab_size must be an int >= 1, got 0"),
    (["llama", *small(num_hidden_layers=-1)], r"num_hidden_layers must be an int >= 1, got -1"),
    (["llama", *small(num_hidden_layers=70000)], r"num_hidden_layers must be at most 65536"),
    (["llama", *small(rope_parameters='{"rope_type": "default", "rope_type": "linear"}')],
     r"gives the key 'rope_type' more than once"),
    (["llama", *SMALL, "--caps-mib", "1e-9"], r"--caps-mib must be numbers >= 1.53e-05"),
    # a batch the controller cannot key (it allocated a 33 GiB prompt first), a seed torch
    # cannot take (it said "Overflow when unpacking long long"), a grid no launch takes
    (["llama", *SMALL, "--batches", "1,70000"], r"--batches must be integers <= 65535"),
    (["llama", *SMALL, "--seed", str(2**70)], r"--seed must be in 0..4294967295"),
    (["llama", *SMALL, "--grids", "70000"], r"--grids must be integers <= 65535"),
    # issue 41.4: an empty item, a misspelt mode or kernel, a role that is no role name, an
    # output that cannot be written: refused in every mode (here --list-roles), before any
    # work, where they were dropped or ignored
    (["llama", *SMALL, "--batches", "1,,2"], r"--batches must be comma-separated integers "
                                             r"with none empty, got '1,,2'"),
    (["llama", *SMALL, "--batches", "1,"], r"--batches must be .* with none empty"),
    (["llama", *SMALL, "--caps-mib", "4,,8"], r"--caps-mib must be comma-separated numbers "
                                              r"with none empty"),
    (["llama", *SMALL, "--graph-forks", "inlin"], r"--graph-forks: unknown 'inlin'; the choices "
                                                  r"are inline, branch, leaf$"),
    (["llama", *SMALL, "--graph-forks", "inline,"], r"--graph-forks must be comma-separated "
                                                    r"names of inline, branch, leaf, none empty"),
    (["llama", *SMALL, "--kernels", "nope"], r"--kernels: unknown 'nope'; the choices are "
                                             r"default, .*\bload\b.*ring"),
    (["llama", *SMALL, "--kernels", "ring,,load"], r"--kernels must be .* none empty"),
    (["llama", *SMALL, "--roles", "o_proj"], r"--roles 'o_proj' is not a role name: a role is "
                                             r"'after SITE: CONSUMER' or 'before SITE: "
                                             r"CONSUMER', as --list-roles prints them"),
    (["llama", *SMALL, "--roles", "after mlp: x", "--roles", "after mlp: x"],
     r"--roles names 'after mlp: x' more than once"),
    (["llama", *SMALL, "--batches", "8,1,8"], r"--batches names 8 more than once: give each "
                                              r"batch once"),
    # a hostile review's: a repeated value measured the same arm twice, a negative gain
    # slipped past --list-roles (and tune refused it only once the model was built), and a
    # float8 dtype failed the build blaming the config
    (["llama", *SMALL, "--grids", "16,32,16"], r"--grids names 16 more than once: give each "
                                               r"grid once"),
    (["llama", *SMALL, "--caps-mib", "4,4.0"], r"--caps-mib names 4.0 more than once"),
    (["llama", *SMALL, "--kernels", "default,default"], r"--kernels names 'default' more "
                                                        r"than once: give each kernel once"),
    (["llama", *SMALL, "--graph-forks", "leaf,inline,leaf"], r"--graph-forks names 'leaf' "
                                                             r"more than once"),
    (["llama", *SMALL, "--min-gain-us", "-0.5"], r"--min-gain-us must be in \[0, 1e\+06\], "
                                                 r"got -0.5"),
    (["llama", *SMALL, "--dtype", "float8_e4m3fn"], r"--dtype: dtype must name a "
                                                    r"floating-point torch dtype \(bfloat16, "
                                                    r"float16, float32 or float64\), got "
                                                    r"'float8_e4m3fn'"),
    (["llama", *SMALL, "--prompt-len", "100"], r"--max-cache-len \(64\) must exceed "
                                               r"--prompt-len \(100\)"),
    (["llama", *SMALL, "--out", "/nonexistent/dir/p.json"],
     r"--out /nonexistent/dir/p.json cannot be written: /nonexistent/dir is not a directory"),
    (["llama", *SMALL, "--plot", "/nonexistent/dir/p.png"], r"--plot /nonexistent/dir/p.png "
                                                            r"cannot be written"),
    (["llama", *SMALL, "--report", "/nonexistent/dir/p.md"], r"--report /nonexistent/dir/p.md "
                                                             r"cannot be written"),
    # a role name this model lacks: refused once discovery knows its roles
    (["llama", *SMALL, "--min-bytes-mib", "0.001", "--roles", "after nothing: x", "--roles",
      "after self_attn.v_proj: self_attn.o_prj", "--quiet"],
     r"--roles: this model has no role 'after nothing: x', 'after self_attn.v_proj: "
     r"self_attn.o_prj' \(closest: 'after self_attn.v_proj: self_attn.o_proj'"),
])
def test_bad_tune_input_is_one_line_and_exit_2(argv, words, capsys):
    pytest.importorskip("transformers")
    code, out, err = status([*argv, "--list-roles", "--device", "cpu"] if "--device" not in argv
                         else [*argv, "--list-roles"], capsys)
    assert code == 2 and out == "", err
    assert re.search(words, one_line(err)), err


def test_an_output_may_not_replace_a_file_of_the_model(tmp_path, capsys):
    """--out naming the config.json (or a checkpoint's file) that MODEL reads: refused."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(**LLAMA).save_pretrained(tmp_path)
    config = tmp_path / "config.json"
    before = config.read_bytes()
    for model in (config, tmp_path):
        code, out, err = status([str(model), "--out", str(config), "--list-roles", "--device",
                                 "cpu"], capsys)
        assert code == 2 and re.search(r"--out .*config.json is the file the model reads",
                                       one_line(err)), err
    assert config.read_bytes() == before


def test_what_refuses_a_tune_is_said_before_the_model_is_built(monkeypatch, capsys):
    """L2PREFETCH_DISABLE, and --plot without matplotlib: one line, nothing built."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # get past the GPU checks
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(hf, "load_model", lambda *a, **k: pytest.fail("built the model"))
    monkeypatch.setenv("L2PREFETCH_DISABLE", "1")
    code, _, err = status(["llama", *SMALL], capsys)
    assert code == 2 and "L2PREFETCH_DISABLE is set, so nothing forks" in one_line(err)
    monkeypatch.delenv("L2PREFETCH_DISABLE")
    find_spec = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    code, _, err = status(["llama", *SMALL, "--plot", "p.png"], capsys)
    assert code == 2 and "--plot needs matplotlib, which is not installed" in one_line(err)


def test_cuda_devices_are_checked_against_the_gpus_torch_sees(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert hf.device_of("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"device 'cuda:3': there is no cuda:3, torch sees 2 "
                                         r"GPUs \(cuda:0\.\.1\)"):
        hf.device_of("cuda:3")


def test_a_model_too_large_for_the_device_is_refused_before_it_is_built(monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.setattr(hf, "available_bytes", lambda device: 100 << 10)
    code, _, err = status(["llama", *SMALL, "--dtype", "float32", "--list-roles", "--device",
                           "cpu"], capsys)
    assert code == 2
    assert re.search(r"LlamaForCausalLM with 2 layers in float32 is \d+\.\d\d thousand "
                     r"parameters, \d+\.\d\d KiB; building it and running its steps take about "
                     r"1\.00 GiB, more than the 100\.00 KiB free on cpu: make it smaller \(e\.g\. "
                     r"--set num_hidden_layers=1 and smaller sizes", one_line(err)), err
    # the size is the model's own: parameters times the dtype's bytes, from the config
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.LlamaConfig(**LLAMA)
    count, nbytes = hf.model_bytes(transformers.LlamaForCausalLM, config, torch.bfloat16)
    built = transformers.LlamaForCausalLM(config)
    assert count == sum(p.numel() for p in built.parameters()) + sum(
        b.numel() for b in built.buffers())
    assert nbytes == 2 * sum(p.numel() for p in built.parameters()) + sum(
        b.numel() * b.element_size() for b in built.buffers())


def test_the_memory_available_is_read_here():
    import torch

    free = hf.available_bytes(torch.device("cpu"))
    assert free is not None and 0 < free <= os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")


@pytest.mark.parametrize("damage, words", [
    ("corrupt", r"model.safetensors is not a safetensors file \(its header is not JSON"),
    ("truncated", r"model.safetensors is corrupt or truncated: its tensors need \d+ bytes of "
                  r"data and the file holds \d+"),
    ("header", r"model.safetensors is not a safetensors file \(its header length does not "
               r"fit the file\)"),
    ("offsets", r"model.safetensors is corrupt: the header's entry for tensor "),
    ("huge shape", r"model.safetensors is corrupt: the header's entry for tensor "),
    ("pickle", r"holds its weights only as pickles \(pytorch_model.bin\), which l2prefetch "
               r"never loads"),
    ("fifo", r"generation_config.json is a FIFO, not a regular file"),
    ("config fifo", r"config.json is a FIFO, not a regular file"),
    ("index fifo", r"model.safetensors.index.json maps 'lm_head.weight' to 'shard', which is not "
                   r"a safetensors file of its directory \(model.safetensors\)"),
    ("index outside", r"maps 'lm_head.weight' to '../x.safetensors', which is not a "
                      r"safetensors file of its directory"),
    ("index absolute", r"maps 'lm_head.weight' to '/.*', which is not a safetensors file"),
])
def test_bad_checkpoints_are_one_line_and_exit_2(checkpoint, damage, words, capsys):
    weights = checkpoint / "model.safetensors"
    data = weights.read_bytes()
    size = int.from_bytes(data[:8], "little")
    if damage == "corrupt":
        weights.write_bytes(data[:8] + b"#" * 16 + data[24:])
    elif damage == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "header":
        weights.write_bytes((len(data) * 2).to_bytes(8, "little") + data[8:])
    elif damage in ("offsets", "huge shape"):
        header = json.loads(data[8:8 + size])
        name = next(k for k in header if k != "__metadata__")
        if damage == "offsets":
            header[name]["data_offsets"][1] += 2
        else:   # sizes of 4300 digits: multiplied out, a few thousand take hours
            header[name]["shape"] = [int("9" * 4300)] * 300
        text = json.dumps(header).encode()
        weights.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + size:])
    elif damage == "pickle":
        import torch

        torch.save({"x": torch.zeros(2)}, checkpoint / "pytorch_model.bin")
        weights.unlink()
    elif damage.startswith("index"):   # transformers opens every shard its index names
        shard = {"index fifo": "shard", "index outside": "../x.safetensors",
                 "index absolute": str(checkpoint.parent / "fifo.safetensors")}[damage]
        os.mkfifo(checkpoint / "shard")
        os.mkfifo(checkpoint.parent / "fifo.safetensors")
        (checkpoint.parent / "x.safetensors").write_bytes(data)
        (checkpoint / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {"lm_head.weight": shard}}))
    elif damage == "fifo":
        (checkpoint / "generation_config.json").unlink()
        os.mkfifo(checkpoint / "generation_config.json")
    else:
        text = (checkpoint / "config.json").read_text()
        (checkpoint / "config.json").unlink()
        os.mkfifo(checkpoint / "config.json")
        del text
    code, out, err = status([str(checkpoint), "--list-roles", "--device", "cpu"], capsys)
    assert code == 2 and out == "", err
    assert re.search(words, one_line(err)), err


def test_a_header_shape_is_multiplied_only_up_to_the_data_size():
    """hf._elements stops once the product passes the limit: the sizes after that point
    are never multiplied (here one that raises if it were)."""
    class Unmultiplied(int):
        def __rmul__(self, other):
            raise AssertionError("multiplied past the limit")

    assert hf._elements([2, 3, 4], 100) == 24
    assert hf._elements([10 ** 4000, Unmultiplied(7)], 100) == 101
    assert hf._elements([7, 10 ** 4000, 0], 100) == 0   # a zero anywhere: no elements
    assert hf._elements([], 100) == 1                   # a scalar


def test_a_sharded_checkpoint_loads_through_its_checked_index(tmp_path, capsys):
    """The index's weight_map names only files beside it, each checked: accepted."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "sharded"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(
        path, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    (path / "pytorch_model.bin.index.json").write_text(json.dumps(   # a pickles' index, left
        {"weight_map": {"lm_head.weight": "pytorch_model.bin"}}))   # over: never loaded
    code, out, err = status([str(path), "--list-roles", "--device", "cpu", "--quiet",
                             "--min-bytes-mib", "0.001"], capsys)
    assert code == 0 and "mlp" in out, err


def test_a_config_json_fifo_does_not_hang(tmp_path, capsys):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    os.mkfifo(path)
    code, _, err = status([str(path), "--list-roles", "--device", "cpu"], capsys)
    assert code == 2 and "is a FIFO, not a regular file" in one_line(err)


@pytest.mark.parametrize("option, make, words", [
    ("--out", lambda p: p.mkdir(), r"--out .*/x is a directory: name a file to write"),
    ("--out", None, r"--out .*/missing/x cannot be written: .*/missing is not a directory"),
    ("--report", lambda p: os.mkfifo(p), r"--report .*/x is a FIFO: name a file to write"),
    ("--plot", lambda p: p.mkdir(), r"--plot .*/x is a directory"),
])
def test_outputs_are_checked_before_the_model_is_built(tmp_path, monkeypatch, capsys, option,
                                                       make, words):
    import torch

    target = tmp_path / "x" if make is not None else tmp_path / "missing" / "x"
    if make is not None:
        make(target)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hf, "device_of", lambda device: torch.device("cuda", 0))

    def built(*args, **kwargs):
        raise AssertionError("the model was built before the outputs were checked")
    monkeypatch.setattr(hf, "load_model", built)
    argv = ["llama", option, str(target)]
    if option != "--out":
        argv += ["--out", str(tmp_path / "p.json")]
    code, _, err = status(argv, capsys)
    assert code == 2 and re.search(words, one_line(err)), err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["x"] if make else [])


def test_outputs_that_name_one_file_are_refused(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hf, "device_of", lambda device: torch.device("cuda", 0))
    code, _, err = status(["llama", "--out", str(tmp_path / "p.md")], capsys)
    assert code == 2 and "is the file --out names too" in one_line(err)


def test_sampling_options_reach_tune(tmp_path, monkeypatch, capsys):
    """--max-instances and --resolution are tune()'s, and its refusal is one line, exit 2."""
    import torch

    from l2prefetch.tuning import tuner

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hf, "device_of", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(hf, "load_model", lambda *args, **kwargs: torch.nn.Linear(2, 2))
    monkeypatch.setattr(hf, "DecodeStep", lambda *args, **kwargs: (lambda batch: None))
    seen = []

    def refuse(model, step, batches, **kwargs):
        seen.append(kwargs)
        raise ValueError("the stub refuses")           # tune()'s ValueError: one line, exit 2
    monkeypatch.setattr(tuner, "tune", refuse)
    out = ["--out", str(tmp_path / "p.json")]
    code, _, err = status(["llama", *out, "--instances", "8", "--max-instances", "6"], capsys)
    assert code == 2 and "--max-instances must be >= --instances (8), got 6" in one_line(err)
    assert seen == []                                       # refused before anything is built
    code, _, err = status(["llama", *out, "--instances", "8", "--max-instances", "9",
                           "--resolution", "0.001"], capsys)
    assert code == 2 and one_line(err).endswith("the stub refuses"), err
    assert seen[-1]["instances"] == 8 and seen[-1]["max_instances"] == 9
    assert seen[-1]["resolution"] == 0.001
    status(["llama", *out], capsys)
    assert seen[-1]["max_instances"] is None and seen[-1]["resolution"] == 0.0005
    assert seen[-1]["rounds"] is None         # the CLI's default is tune()'s: by the step
    status(["llama", *out, "--rounds", "12"], capsys)
    assert seen[-1]["rounds"] == 12


def test_every_parser_refuses_abbreviations(capsys):
    from l2prefetch.__main__ import main as top
    from l2prefetch.cli import plan_main

    for call, argv, words in ((top, ["--verb"], "unrecognized arguments: --verb"),
                              (top, ["info", "--verb"], "unrecognized arguments: --verb"),
                              (plan_main, ["--all-p"], "unrecognized arguments: --all-p"),
                              (cli.main, ["llama", "--list-role"],
                               "unrecognized arguments: --list-role"),
                              (top, ["trace", "llama", "--role", "r", "--prof", "p.json"],
                               "unrecognized arguments: --prof")):
        try:
            code = call(argv)
        except SystemExit as exc:
            code = exc.code
        assert code == 2, argv
        assert words in one_line(capsys.readouterr().err)
    # and every command of the top-level parser, present or future
    from l2prefetch import cli as top_cli

    commands = top_cli._parser().commands
    assert {"info", "plan", "tune", "trace", "demo"} <= set(commands)
    assert all(p.allow_abbrev is False for p in commands.values()), \
        [name for name, p in commands.items() if p.allow_abbrev]


@pytest.mark.parametrize("entry", ["l2prefetch", "l2prefetch.tuning.cli"])
def test_ctrl_c_while_tuning_is_one_line_exit_130_and_writes_nothing(tmp_path, monkeypatch,
                                                                      capsys, entry):
    """Issue 38.7: Ctrl-C in the middle of measuring (here a stand-in backend's third
    group) ends `tune` with one line and exit status 130, through either entry point, and
    no profile, report or temporary file is written."""
    import torch

    import _tuning_fakes as fakes
    from l2prefetch import cli as main_cli
    from l2prefetch.tuning import tuner

    model = fakes.llama(n_layers=3, h=1024, i=2048, kv=256)
    inputs = {}

    def step(batch):
        return model(inputs.setdefault(batch, torch.zeros(batch, 1, 1024, dtype=torch.bfloat16)))

    class Interrupting(fakes.DeviceBackend):
        measured = 0

        def measure(self, batch, arms, instances):
            self.measured += 1
            if self.measured == 3:
                raise KeyboardInterrupt
            return super().measure(batch, arms, instances)

    real_tune = tuner.tune
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hf, "device_of", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(hf, "load_model", lambda *args, **kwargs: model)
    monkeypatch.setattr(hf, "DecodeStep", lambda *args, **kwargs: step)
    monkeypatch.setattr(tuner, "tune", lambda model, step, batches, **kw: real_tune(
        model, step, batches, **{**kw, "kernels": None, "min_bytes": 256 * 1024,
                                 "backend": Interrupting({}, seed=1)}))
    argv = ["llama", "--out", str(tmp_path / "p.json"), "--quiet"]
    if entry == "l2prefetch":
        code = main_cli.main(["tune", *argv])
    else:
        code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 130 and one_line(err) == "l2prefetch tune: interrupted", err
    assert list(tmp_path.iterdir()) == []


# -- issue 41.2: the fit check leaves room for building and running, and says the fix --------

GIB = 1 << 30


def machine(monkeypatch, total_gib, free_gib):
    """The CPU's memory as a machine of total_gib with free_gib available."""
    monkeypatch.setattr(hf, "_cpu_memory", lambda: (int(total_gib * GIB), int(free_gib * GIB)))


def test_the_default_llama_is_refused_on_a_24_gib_machine_before_it_is_built(monkeypatch,
                                                                              capsys):
    """The default LlamaConfig (6.74 B parameters, 12.55 GiB of bf16) passed the check
    against the 22 GiB free of a 24 GiB machine and was OOM-killed 260 s into its build
    (exit 137, no message).  Now: exit 2 at once, one line, with the fix."""
    pytest.importorskip("transformers")
    machine(monkeypatch, 24, 22)
    code, out, err = status(["llama", "--list-roles", "--device", "cpu"], capsys)
    assert code == 2 and out == ""
    line = one_line(err)                              # no "building it" line: nothing built
    assert re.search(r"LlamaForCausalLM with 32 layers in bfloat16 is 6\.74 billion parameters, "
                     r"12\.55 GiB; building it and running its steps take about 14\.8\d GiB, "
                     r"more than the 12\.00 GiB a model may take on cpu \(half of the machine's "
                     r"24\.00 GiB", line), line
    assert "make it smaller (e.g. --set num_hidden_layers=4;" in line
    # that fix fits there: 4 layers, 2.0 GiB, pass the same check
    import torch
    import transformers

    small_config = transformers.LlamaConfig(num_hidden_layers=4)
    count, nbytes = hf.model_bytes(transformers.LlamaForCausalLM, small_config, torch.bfloat16)
    hf.check_fits("4 layers", count, nbytes, torch.device("cpu"), 4)
    # on a 32 GiB machine with 30 GiB free the default Llama has room (16 GiB is half)
    config = transformers.LlamaConfig()
    count, nbytes = hf.model_bytes(transformers.LlamaForCausalLM, config, torch.bfloat16)
    machine(monkeypatch, 32, 30)
    hf.check_fits("default", count, nbytes, torch.device("cpu"), 32)
    # but not with only 14 GiB of them free: the weights plus 10% plus 1 GiB
    machine(monkeypatch, 32, 14)
    with pytest.raises(ValueError, match=r"more than the 14\.00 GiB free on cpu"):
        hf.check_fits("default", count, nbytes, torch.device("cpu"), 32)


def test_the_fit_check_names_a_layer_count_that_fits(monkeypatch):
    pytest.importorskip("transformers")
    import torch

    # 12.55 GiB in 32 layers, ~0.39 GiB a layer: with 2.1 GiB a model may take, 2 fit
    # (1 GiB and 10% for building and the step), not 4
    machine(monkeypatch, 4.2, 4)
    with pytest.raises(ValueError, match=r"\(e\.g\. --set num_hidden_layers=2; the tuner needs "
                                         r"a few layers"):
        hf.check_fits("default", 6_738_415_616, 13_476_831_232, torch.device("cpu"), 32)


def test_a_gpu_gives_all_its_free_memory_and_a_checkpoint_staged_on_the_cpu_too(monkeypatch):
    import torch

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(hf, "available_bytes", lambda device: 20 * GIB)
    monkeypatch.setattr(hf, "total_bytes", lambda device: 24 * GIB)
    hf.check_fits("m", 1, 12 * GIB, cuda, 32)            # 14.2 GiB of 20: no half rule
    hf.check_fits("m", 1, 12 * GIB, torch.device("cpu"), 32, staging=True)
    with pytest.raises(ValueError, match=r"more than the 12\.00 GiB a model may take on cpu"):
        hf.check_fits("m", 1, 12 * GIB, torch.device("cpu"), 32)
    with pytest.raises(ValueError, match=r"more than the 20\.00 GiB free on cuda:0"):
        hf.check_fits("m", 1, 18 * GIB, cuda, 32)


def test_the_memory_table_reads_total_and_available():
    total, free = hf._cpu_memory()
    assert total is not None and free is not None and 0 < free <= total
    assert total <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_parameter_counts_read_as_counts_not_bytes():
    """"84003.28 B parameters" read as bytes (issue 41.7)."""
    assert hf._count(84_003.28e9) == "84.00 trillion"
    assert hf._count(6_738_415_616) == "6.74 billion"
    assert hf._count(90_450) == "90.45 thousand" and hf._count(912) == "912"


# -- issue 41.3: the first progress line names the source used, and what it shadows ----------

def test_a_local_directory_that_shadows_a_model_type_is_named(tmp_path, monkeypatch, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**dict(LLAMA, num_hidden_layers=1))
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    capsys.readouterr()                               # transformers' progress bars
    monkeypatch.chdir(tmp_path)
    argv = ["--list-roles", "--device", "cpu", "--min-bytes-mib", "0.001"]
    code, out, err = status(["llama", *argv], capsys)
    assert code == 0 and "| after" in out, err
    first = err.splitlines()[0]
    assert first.startswith("[l2prefetch tune] LlamaForCausalLM, 1 layers, "), first
    assert first.endswith(" from the checkpoint directory llama (it shadows the model type "
                          "llama: name it LlamaConfig to build that instead): loading it on "
                          "cpu"), first
    # the other one, as that line says: the model type's random weights, here 2 layers
    code, out, err = status(["LlamaConfig", *SMALL, *argv], capsys)
    assert code == 0, err
    assert err.splitlines()[0].startswith("[l2prefetch tune] LlamaForCausalLM, 2 layers, ")
    assert " from the config class LlamaConfig: building it with random weights" in err
    # a path with a directory part names only the path: nothing is shadowed
    code, out, err = status(["./llama", *argv], capsys)
    assert code == 0 and " from the checkpoint directory ./llama: loading it on cpu" in err, err
    # a config class name shadowed by a directory points to the model type
    (tmp_path / "llama").rename(tmp_path / "LlamaConfig")
    code, out, err = status(["LlamaConfig", *argv], capsys)
    assert code == 0, err
    assert ("from the checkpoint directory LlamaConfig (it shadows the config class "
            "LlamaConfig: name it llama to build that instead)") in err, err


# -- issue 41.7: the README's step(batch) for a model not from Hugging Face -------------------

def test_the_readmes_hand_written_model_discovers_its_merged_projections():
    """The README's vLLM-style module (merged qkv_proj and gate_up_proj) and its step, run
    as the README says up to tune() (which needs a GPU), with device = "cpu"."""
    readme = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "README.md")
    if not os.path.exists(readme):
        pytest.skip("no README.md beside tests/ (an installed copy of the tests)")
    with open(readme) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    (block,) = [b for b in blocks if "gate_up_proj" in b and "def step(batch)" in b]
    assert 'device = "cuda"\n' in block and "result = tuning.tune(model, step, [1, 8])" in block
    code = block.replace('device = "cuda"\n', 'device = "cpu"\n').split("result = tuning.tune")[0]
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)        # noqa: S102 - our own README
    names = [role.name for role in scope["roles"]]
    assert names == ["after self_attn.qkv_proj: self_attn.o_proj",
                     "after self_attn.o_proj: mlp.gate_up_proj",
                     "after self_attn: mlp.gate_up_proj",
                     "after mlp.gate_up_proj: mlp.down_proj",
                     "after mlp.down_proj: next self_attn.qkv_proj",
                     "after mlp: next self_attn.qkv_proj"]
    assert [len(role.sites) for role in scope["roles"]] == [4, 4, 4, 4, 3, 3]


# -- files are untrusted: a checkpoint's links, its config's numbers, a --set's nesting -------

def test_a_checkpoint_file_linked_out_of_its_directory_is_refused_unread(checkpoint, tmp_path,
                                                                          capsys):
    """model.safetensors -> ../secret: refused by its link, before anything reads it (the
    header check printed the target's first 8 bytes as a length)."""
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"SECRET=hunter2\n")
    (checkpoint / "model.safetensors").unlink()
    os.symlink("../secret.txt", checkpoint / "model.safetensors")
    code, _, err = status([str(checkpoint), "--list-roles", "--device", "cpu"], capsys)
    line = one_line(err)
    assert code == 2 and "is a link to" in line and "outside the checkpoint" in line, line
    shown = line.replace(str(tmp_path), "TMP")   # pytest's folder names hold numbers
    assert str(int.from_bytes(b"SECRET=h", "little")) not in shown and "15" not in shown


def test_a_hugging_face_cache_snapshot_links_into_its_blobs(checkpoint, tmp_path, capsys):
    """A Hugging Face cache's snapshot is links into <repo>/blobs: those are followed."""
    repo = tmp_path / "models--x--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(checkpoint.iterdir())):
        os.replace(f, blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / f.name)
    code, out, err = status([str(snapshot), "--list-roles", "--device", "cpu",
                             "--min-bytes-mib", "0.001"], capsys)
    assert code == 0 and "mlp.gate_proj" in out, err


def test_a_non_finite_number_in_a_config_file_is_refused_as_in_set(tmp_path, capsys):
    """NaN and Infinity, which JSON lacks and Python's reader takes, are refused in a
    config.json as `--set` refuses them, naming the field."""
    for literal in ("NaN", "-Infinity"):
        path = tmp_path / "config.json"
        path.write_text(json.dumps({"model_type": "llama", **LLAMA})[:-1]
                        + f', "rms_norm_eps": {literal}}}')
        code, _, err = status([str(path), "--list-roles", "--device", "cpu"], capsys)
        line = one_line(err)
        assert code == 2 and f"rms_norm_eps is {literal}, which JSON does not have" in line, line


def test_a_set_value_nested_too_deep_is_one_line(capsys):
    """A --set value of 900 nested lists parses (json nests deeper than the checks could
    recurse): refused by its depth, exit status 2, not a RecursionError's traceback."""
    deep = "[" * 900 + "]" * 900
    code, _, err = status(["LlamaConfig", "--list-roles", "--device", "cpu",
                           "--set", f"rope_parameters={deep}"], capsys)
    line = one_line(err)
    assert code == 2 and "--set: " in line and "more than 32 deep (rope_parameters)" in line
    code, _, err = status(["LlamaConfig", "--list-roles", "--device", "cpu",
                           "--set", "rope_parameters=" + "[" * 3 + "]" * 3], capsys)
    assert "deep" not in err   # a shallow list is checked as before (its type here)
