"""l2prefetch.graphs.capture_fastest: arguments on the CPU, the choice on a GPU."""

import pytest

torch = pytest.importorskip("torch")

from l2prefetch import graphs  # noqa: E402


@pytest.mark.parametrize("kw, message", [
    ({"k": 0}, "k must be an int >= 1, got 0"),
    ({"k": True}, "k must be an int >= 1, got True"),
    ({"replays": 0}, "replays must be an int >= 1"),
    ({"warmup": -1}, "warmup must be an int >= 0"),
])
def test_bad_arguments_are_refused_before_any_capture(kw, message):
    with pytest.raises(ValueError, match=message):
        graphs.capture_fastest(lambda: None, **kw)


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="fn must be callable, got int"):
        graphs.capture_fastest(3)


def test_report_arithmetic():
    r = graphs.CaptureReport(k=3, chosen=2, first_us=110.0, chosen_us=100.0,
                             instance_us=(110.0, 105.0, 100.0))
    assert r.gain_us == 10.0 and r.spread_pct == pytest.approx(10.0)
    assert "kept capture 2 of 3" in str(r) and "+10.0 us" in str(r)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_without_a_gpu_it_says_so():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        graphs.capture_fastest(lambda: None)


@pytest.mark.gpu
def test_keeps_a_capture_never_slower_than_the_first_and_its_output_is_right():
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    ref = x @ w.t()
    graph, out, report = graphs.capture_fastest(lambda: x @ w.t(), k=4, replays=10)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    assert 0 <= report.chosen < 4 and len(report.instance_us) == 4
    assert report.chosen_us <= report.first_us
