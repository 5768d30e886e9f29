"""``l2prefetch tune``'s options and errors (CPU: no measuring; --list-roles discovers)."""

from __future__ import annotations

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


def test_list_roles_on_the_cpu(capsys):
    pytest.importorskip("transformers")
    code, out, err = run(["llama", *TINY, "--device", "cpu", "--dtype", "float32",
                          "--list-roles", "--min-bytes-mib", "0.25"], capsys)
    assert code == 0, err
    assert "| after self_attn.v_proj: self_attn.o_proj | 2 |" in out
    assert "| after mlp: next self_attn.q_proj | 1 |" in out


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
    assert lines[0] == (f"[l2prefetch tune] LlamaForCausalLM, 2 layers, {count / 1e6:.1f} M "
                        f"parameters ({count * 4 / 2**30:.2f} GiB of float32): building it "
                        "with random weights on cpu"), err
    assert lines[1].startswith("[l2prefetch tune] model ready in ")
    assert "discovering the roles" in lines[2] and len(lines) == 3
    assert run([*argv, "--quiet"], capsys) == (0, out, "")


@pytest.mark.parametrize("argv, message", [
    (["llama", "--batches", "1,x"], "--batches must be comma-separated integers"),
    (["llama", "--budget", "0"], "--budget must be in"),
    (["llama", "--budget", "1e308"], "--budget must be in"),
    (["llama", "--instances", "3"], "--instances must be in"),
    (["llama", "--caps-mib", "0"], "--caps-mib must be numbers > 0"),
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
    assert code == 2 and "KEY=VALUE" in err


def test_an_unknown_model_exits_2(capsys):
    pytest.importorskip("transformers")
    code, _, err = run(["no-such-model-type", "--device", "cpu", "--list-roles"], capsys)
    assert code == 2 and "neither a checkpoint directory" in err


def test_without_transformers_exit_2(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    code, _, err = run(["llama", "--device", "cpu", "--list-roles"], capsys)
    assert code == 2 and "needs transformers" in err and len(err.strip().splitlines()) == 1


def test_a_directory_without_config(tmp_path, capsys):
    pytest.importorskip("transformers")
    code, _, err = run([str(tmp_path), "--device", "cpu", "--list-roles"], capsys)
    assert code == 2 and "without config.json" in err
