"""benchmarks/probe_schedule.py on the CPU: where Inductor puts the library's fork ops and
the planted spin among a compiled layer's kernels (RESULTS runs 30, 34).  The fork after
o_proj lands ahead of a window in o_proj's hook, where a TP all-reduce sits, with nothing
between them.  A window in the norm's pre-hook has the residual add and the norm's
reduction before the spin: a fork after o_proj lands ahead of that kernel, the fork
before the norm after it, right before the spin (it follows the add that the spin
realizes anyway), and a fork after the norm after the spin."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from benchmarks.probe_schedule import main, schedule  # noqa: E402


def _between(order, first, last):
    return order[order.index(first) + 1:order.index(last)]


def test_the_fork_after_o_proj_lands_right_before_a_window_in_o_proj_s_hook():
    order = schedule("oproj", "oproj_after")
    assert order.count("fork") == 1 and order.count("spin") == 1
    assert order.index("fork") < order.index("spin")
    assert _between(order, "fork", "spin") == []
    assert order[order.index("fork") - 1].startswith("extern_kernels.mm")   # o_proj's GEMM


def test_a_window_in_the_norm_s_pre_hook_has_the_fork_before_the_norm_right_before_it():
    before = schedule("norm", "norm_before")
    assert _between(before, "fork", "spin") == []
    made = before[before.index("fork") - 1]
    assert "add" in made and "mean" in made    # the residual add and the norm's reduction
    oproj = schedule("norm", "oproj_after")
    kernels = _between(oproj, "fork", "spin")
    assert kernels and all("add" in k and "mean" in k for k in kernels)
    after = schedule("norm", "norm_after")
    assert after.index("spin") < after.index("fork")   # no window left for its loads


def test_the_command_line_refuses_an_unknown_fork_site(capsys):
    with pytest.raises(SystemExit):
        main(["--forks", "nowhere"])
    assert "--forks" in capsys.readouterr().err
