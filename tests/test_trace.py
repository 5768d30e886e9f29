"""``l2prefetch trace``: kernel timelines of synthetic chrome traces, the Markdown, the CLI's
bad inputs (CPU), and one real trace of a tiny HF Llama (GPU)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import types

import pytest

import _tuning_fakes as fakes
from l2prefetch import cli
from l2prefetch.tuning import trace as tr
from l2prefetch.tuning import trace_analysis, trace_capture, trace_cli, trace_dot

T0 = 1.7e12      # CUPTI's clock: absolute microseconds
KEY = ("after self_attn.o_proj: mlp.gate_proj", 0, 1)
CONSUMER = "model.layers.0.mlp.gate_proj"


def kernel(name, stream, ts, dur, **extra):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream,
            "ts": T0 + ts, "dur": dur, "args": {"stream": stream, "device": 0}, **extra}


def step(loader, *, held=0.0, gate=12.0, t=0.0):
    """One replay of a GEMV, the fork, an add, a norm, a 40 us spin and the consumer GEMV.

    ``loader`` is (stream, start, dur) or None; ``held`` stretches the add (an inline
    loader holding its next node); ``t`` shifts the whole replay."""
    events = [kernel("gemv_o_proj", 7, t, 10), kernel("add", 7, t + 11, 2 + held),
              kernel("norm", 7, t + 14 + held, 2), kernel("spin", 7, t + 17 + held, 40),
              kernel("gemv_gate_proj", 7, t + 58 + held, gate)]
    if loader is not None:
        stream, start, dur = loader
        events.append(kernel("l2p_prefetch_32", stream, t + start, dur))
    return events


def layout():
    """The layout graph: markers after the fork's GEMV and around the consumer's."""
    events = [kernel("gemv_o_proj", 7, 0, 10), kernel("l2p_prefetch_8", 7, 10.2, 0.3),
              kernel("add", 7, 11, 2), kernel("norm", 7, 14, 2), kernel("spin", 7, 17, 40),
              kernel("l2p_prefetch_8", 7, 57.2, 0.3), kernel("gemv_gate_proj", 7, 58, 12),
              kernel("l2p_prefetch_8", 7, 70.2, 0.3)]
    marks = [("fork", KEY), ("begin", CONSUMER), ("end", CONSUMER)]
    return tr.layout_of(tr.timeline({"traceEvents": events}, 1), marks)


def traced(loads, control=None, with_layout=True):
    timeline = tr.timeline({"traceEvents": loads}, 1)
    base = tr.timeline({"traceEvents": control}, 1) if control is not None else None
    return tr.analyze(timeline, base, layout() if with_layout else None, {KEY: CONSUMER},
                      {KEY: "leaf"}), timeline


# -- the timeline ---------------------------------------------------------------------------

def test_a_leaf_loader_overlaps_its_window():
    forks, _ = traced(step((20, 11.5, 28.5), gate=12), step((20, 11.5, 1.0), gate=18))
    (fork,) = forks
    assert fork.key == KEY and fork.mode == "leaf" and fork.found_by == "module"
    assert (fork.loader.start, fork.loader.end, fork.loader.stream) == (11.5, 40.0, 20)
    assert fork.before.name == "gemv_o_proj" and fork.fork_us == 10.0
    assert fork.start_after_fork_us == pytest.approx(1.5)
    assert [k.name for k in fork.window] == ["add", "norm", "spin"]
    # covered: the add from 11.5 to 13, the norm 14-16, the spin 17-40 of the loader's 28.5 us
    assert fork.overlap == pytest.approx((1.5 + 2 + 23) / 28.5)
    assert [k.name for k in fork.consumer] == ["gemv_gate_proj"]
    assert fork.consumer_us == 12 and fork.consumer_control_us == 18
    assert fork.loader_control.dur == 1.0
    roles = {row.kernel.name: row.role for row in fork.rows}
    assert roles == {"gemv_o_proj": "", "add": "window", "norm": "window", "spin": "window",
                     "l2p_prefetch_32": "**loader**", "gemv_gate_proj": "consumer"}
    assert [row.kernel.name for row in fork.rows][:3] == ["gemv_o_proj", "add",
                                                            "l2p_prefetch_32"]


def test_an_inline_loader_on_the_same_stream_holds_the_next_kernel():
    # The loader runs on the step's stream; the add after it ends only when it does.
    forks, _ = traced(step((7, 10.5, 19.5), held=17.7), step((7, 10.5, 1.0)))
    (fork,) = forks
    assert fork.window == [] and fork.overlap == 0.0
    assert "window (kernels on other streams meanwhile): none" in fork.summary()
    add = next(row for row in fork.rows if row.kernel.name == "add")
    assert add.kernel.dur == pytest.approx(19.7, abs=1e-3) and add.control.dur == 2
    assert add.role == "meanwhile, its stream, held"
    text = tr.TraceResult("t", 1, forks).markdown()
    assert "Meanwhile on the loader's stream: `add` ran 11.0-30.7 us (19.7 us; 2.0 us with " \
        "empty tables): the loader held it." in text
    assert fork.consumer_us == fork.consumer_control_us == 12


def test_an_inline_loader_beside_the_spin_overlaps_it():
    # Forked before the window (a before-site): the spin after the loader runs beside it
    # as long as with empty tables, so the loads overlap it (H200 trace: RESULTS run 20).
    forks, _ = traced(step((7, 17.2, 12.8)), step((7, 17.2, 1.0)), with_layout=False)
    (fork,) = forks
    assert fork.window == [] and fork.overlap == pytest.approx(1.0)
    spin = next(row for row in fork.rows if row.kernel.name == "spin")
    assert spin.role == "meanwhile, its stream"
    text = tr.TraceResult("t", 1, forks).markdown()
    assert "Meanwhile on the loader's stream: `spin` ran 17.0-57.0 us (40.0 us; 40.0 us " \
        "with empty tables): it ran beside the loads." in text
    # without the control there is no telling: held is assumed, nothing overlaps
    (alone,) = traced(step((7, 17.2, 12.8)), with_layout=False)[0]
    assert alone.overlap == 0.0


@pytest.mark.parametrize("with_layout", [True, False])
def test_an_inline_loader_launched_early_is_shown_from_its_fork(with_layout):
    # Launched once o_proj's blocks began (5 us into its 10), it waits for o_proj's end
    # (griddepcontrol.wait): its loads start at 10, and o_proj is not beside them.
    forks, _ = traced(step((7, 5.0, 20.0)), step((7, 5.0, 6.0)), with_layout=with_layout)
    (fork,) = forks
    assert (fork.loader.start, fork.loader.end) == (10.0, 25.0)
    assert fork.before.name == "gemv_o_proj" and fork.start_after_fork_us == 0.0
    assert fork.loader_control.start == 10.0        # the same with empty tables
    beside = [row.kernel.name for row in fork.rows if "its stream" in row.role]
    assert beside == ["add", "norm", "spin"]
    assert fork.overlap == pytest.approx((2 + 2 + 8) / 15)
    # its own row is the loader as shown, and no other loader's
    assert [(r.kernel.start, r.role) for r in fork.rows if r.index is None] == \
        [(10.0, "**loader**")]


def test_an_empty_forks_delay_against_no_forks(caplog):
    # With empty tables the kernel after the fork (the add) starts 0.8 us late and the
    # step ends 0.8 us late; the graph without forks is the same step with no loader.
    def shifted(lag):
        return [kernel("gemv_o_proj", 7, 0, 10), kernel("add", 7, 11 + lag, 2),
                kernel("norm", 7, 14 + lag, 2), kernel("spin", 7, 17 + lag, 40),
                kernel("gemv_gate_proj", 7, 58 + lag, 12)]
    control = shifted(0.8) + [kernel("l2p_prefetch_32", 7, 10.2, 0.5)]
    timelines = [tr.timeline({"traceEvents": e}, 1)
                 for e in (step((7, 10.2, 19.0)), control, shifted(0), shifted(0.1))]
    (fork,) = tr.analyze(timelines[0], timelines[1], layout(), {KEY: CONSUMER},
                         {KEY: "inline"}, none=timelines[2], floor=timelines[3])
    assert fork.after == 1
    assert fork.delay_us == pytest.approx(0.8, abs=1e-3)
    assert fork.delay_to_next_us == pytest.approx(0.8, abs=1e-3)
    assert fork.delay_floor_us == pytest.approx(0.1, abs=1e-3)
    # each kernel from the add to the consumer, 0.8 us late (0.1 between the captures)
    assert fork.lags_us == pytest.approx((0.8,) * 4, abs=1e-3)
    assert fork.lags_floor_us == pytest.approx((0.1,) * 4, abs=1e-3)
    text = tr.TraceResult("t", 1, [fork], step_us=70, control_step_us=70.8,
                          none_step_us=70).markdown()
    assert "70.8 us with empty tables, 70.0 us without forks." in text
    assert "With empty tables against no forks: the kernel after the fork started +0.80 us " \
        "later, relative to the end of the one before it (two captures without forks: " \
        "+0.10 us); the step reached the next fork (or its end) +0.80 us later." in text
    # other kernels without forks: no delays, and a warning
    (fork,) = tr.analyze(timelines[0], timelines[1], layout(), {KEY: CONSUMER},
                         none=tr.timeline({"traceEvents": shifted(0)[:-1]}, 1))
    assert fork.delay_us is None and fork.delay_to_next_us is None
    assert "the graph without forks ran other kernels" in caplog.text


def test_delays_per_place():
    # Five kernels; each fork place adds 1 us to the kernel after it.
    bare = [tr.Kernel(f"k{j}", 7, 10.0 * j, 10.0 * j + 5) for j in range(5)]
    def base(*places):
        lag = [sum(1.0 for p in places if p <= j) for j in range(5)]
        return [tr.Kernel(k.name, 7, k.start + lag[j], k.end + lag[j])
                for j, k in enumerate(bare)]
    # in order: each its own 1 us, to the next fork and to the end; per kernel up to the
    # next fork (kernels 1-2, then 3-4)
    assert trace_analysis._delays(base(1, 3), bare, [1, 3]) == [(1.0, 1.0, (1.0, 1.0)),
                                                    (1.0, 1.0, (1.0, 1.0))]
    # placed out of order (forks on several streams): still to the nearest later place
    assert trace_analysis._delays(base(1, 3), bare, [3, 1]) == [(1.0, 1.0, (1.0, 1.0)),
                                                    (1.0, 1.0, (1.0, 1.0))]
    # back to back at one place: the first carries the place's delay
    assert trace_analysis._delays(base(2, 2), bare, [2, 2]) == [(2.0, 2.0, (2.0, 2.0, 2.0)),
                                                    (None, None, ())]
    # at the step's start or end: nothing to tell
    assert trace_analysis._delays(base(), bare, [0, 5]) == [(None, None, ()), (None, None, ())]
    # a delay that a later kernel absorbs: the lags show where
    absorbed = base(1)
    absorbed[3] = tr.Kernel("k3", 7, bare[3].start, bare[3].end)
    absorbed[4] = tr.Kernel("k4", 7, bare[4].start, bare[4].end)
    assert trace_analysis._delays(absorbed, bare, [1]) == [(1.0, 0.0, (1.0, 1.0, 0.0, 0.0))]


def test_a_loader_on_another_stream_is_not_moved():
    # A leaf loader (stream 20, an ordinary edge from o_proj) starting while an
    # all-reduce queued before the fork runs on stream 9: it is shown as it ran.
    loads = [kernel("gemv_o_proj", 7, 0, 10), kernel("allreduce", 9, 10.1, 20),
             kernel("add", 7, 31, 2), kernel("gemv_gate_proj", 7, 34, 12),
             kernel("l2p_prefetch_32", 20, 11.5, 28.5)]
    marks = [kernel("gemv_o_proj", 7, 0, 10), kernel("allreduce", 9, 10.1, 20),
             kernel("l2p_prefetch_8", 7, 10.2, 0.3), kernel("add", 7, 31, 2),
             kernel("l2p_prefetch_8", 7, 33.5, 0.2), kernel("gemv_gate_proj", 7, 34, 12),
             kernel("l2p_prefetch_8", 7, 46.2, 0.3)]
    layout_ = tr.layout_of(tr.timeline({"traceEvents": marks}, 1),
                           [("fork", KEY), ("begin", CONSUMER), ("end", CONSUMER)])
    (fork,) = tr.analyze(tr.timeline({"traceEvents": loads}, 1), None, layout_,
                         {KEY: CONSUMER}, {KEY: "leaf"})
    assert fork.before.name == "allreduce" and fork.loader.start == 11.5


def test_the_window_reaches_past_the_consumer_when_the_loader_does():
    forks, _ = traced(step((20, 11.0, 62.0)))
    (fork,) = forks
    assert [k.name for k in fork.window] == ["add", "norm", "spin", "gemv_gate_proj"]
    assert next(r for r in fork.rows if r.kernel.name == "gemv_gate_proj").role == \
        "window, consumer"
    assert fork.consumer_control_us is None and "(no control)" in fork.summary()


def test_no_loader_kernels_no_forks():
    forks, timeline = traced(step(None))
    assert forks == [] and len(timeline) == 5
    text = tr.TraceResult("tiny", 1, forks).markdown()
    assert "No loader kernel ran" in text and "## Fork" not in text


def test_without_a_layout_forks_go_by_time_and_the_consumer_by_name():
    forks, _ = traced(step((20, 11.5, 5.0)), with_layout=False)
    (fork,) = forks
    assert fork.key is None and fork.label == "fork 1" and fork.found_by == "name"
    assert fork.before.name == "gemv_o_proj"
    assert [k.name for k in fork.consumer] == ["gemv_gate_proj"]


def test_a_layout_of_other_kernels_is_not_used(caplog):
    loads = step((20, 11.5, 5.0)) + [kernel("extra", 7, 80, 1)]
    forks = tr.analyze(tr.timeline(loads, 1), None, layout(), {KEY: CONSUMER})
    assert forks[0].found_by == "name" and forks[0].key is None
    assert "forks placed by time" in caplog.text


def test_a_control_of_other_kernels_gives_no_durations(caplog):
    forks, _ = traced(step((20, 11.5, 5.0)), step(None)[:-1] + [kernel("x", 7, 60, 1)])
    assert all(row.control is None for row in forks[0].rows)
    assert "control graph ran other kernels" in caplog.text


def test_several_replays_give_medians_relative_to_each_replays_first_kernel():
    shifts, jitter = (0.0, 500.0, 1100.0), (0.0, 0.9, 0.3)
    events = []
    for shift, j in zip(shifts, jitter):
        events += step((20, 11.5 + j, 28.5 - j), gate=12 + 2 * j, t=shift)
    timeline = tr.timeline({"traceEvents": events[::-1]}, 3)   # any order in the file
    by_name = {k.name: k for k in timeline}
    # (CUPTI's absolute clock leaves about 1e-4 us of float resolution)
    assert by_name["l2p_prefetch_32"].start == pytest.approx(
        statistics.median(11.5 + j for j in jitter), abs=1e-3)
    assert by_name["l2p_prefetch_32"].end == 40.0
    assert by_name["gemv_gate_proj"].dur == pytest.approx(
        statistics.median(12 + 2 * j for j in jitter), abs=1e-3)
    assert by_name["gemv_o_proj"].start == 0.0
    assert [k.name for k in timeline] == ["gemv_o_proj", "add", "l2p_prefetch_32", "norm",
                                          "spin", "gemv_gate_proj"]


def test_same_named_kernels_keep_their_order():
    events = [kernel("k", 7, 0, 1), kernel("k", 7, 5, 3), kernel("k", 7, 100, 2),
              kernel("k", 7, 104, 4)]
    timeline = tr.timeline(events, 2)
    assert [(k.start, k.dur) for k in timeline] == [(0, 1.5), (4.5, 3.5)]


@pytest.mark.parametrize("data, message", [
    ("text", "a chrome trace is a JSON object"),
    ({"traceEvents": {}}, "a chrome trace is a JSON object"),
    ({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "dur": 1}]},
     r"traceEvents\[0\] is a kernel event without"),
    ({"traceEvents": [kernel("k", 7, 0, -1)]}, "'dur' >= 0"),
    ({"traceEvents": [kernel("k", 7, 0, float("nan"))]}, "finite 'dur'"),
    ({"traceEvents": [{**kernel("k", 7, 0, 1), "name": 3}]}, "without a name"),
    ({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}]},
     "no kernel events"),
    ({"traceEvents": step(None)}, "5 kernels do not split into 2 replays"),
    ({"traceEvents": step(None) + step(None, t=100)[:-1] + [kernel("x", 7, 190, 1)]},
     "replay 1 ran other kernels"),
])
def test_malformed_traces_raise_a_clear_error(data, message):
    with pytest.raises(tr.TraceError, match=message):
        tr.timeline(data, 2 if "replay" in message else 1)


@pytest.mark.parametrize("change, message", [
    ({"ts": 10**400}, "a finite 'ts'"),                            # OverflowError before
    ({"ts": -10**400}, "a finite 'ts'"),
    ({"ts": 1.7e308, "dur": 1.7e308}, "their sum within 1e\\+18 us"),   # end=inf before
    ({"ts": 1e18, "dur": 1e18}, "their sum within"),
    ({"dur": 10**400}, "'dur' >= 0"),
    ({"ts": True}, "a finite 'ts'"),
    ({"args": {"stream": [1, 2]}}, "whose stream .* is not an int of 64 bits"),  # TypeError
    ({"args": {"stream": {"a": 1}}}, "whose stream"),
    ({"args": {"stream": 10**400}}, r"whose stream .*<a 1329-bit int>"),
    ({"args": {}, "tid": "s" * 1000}, "whose stream"),
    ({"name": 10**5000}, r"without a name.*'name': <a 16610-bit int>"),
])
def test_hostile_kernel_events_raise_a_trace_error(change, message):
    """Issue 38.5: every malformed kernel event is the documented TraceError (a message
    that can always be printed), never OverflowError, TypeError or an infinite end."""
    events = step((20, 11.5, 28.5))
    events[2] = {**events[2], **change}
    with pytest.raises(tr.TraceError, match=message) as caught:
        tr.timeline({"traceEvents": events}, 1)
    assert len(str(caught.value)) < 1000


def test_the_largest_times_still_give_finite_spans():
    events = [kernel("a", 7, 0, 1), kernel("b", 7, 2, 1)]
    events[0]["ts"], events[1]["ts"] = -1e18 + 1, 1e18 - 2
    (a, b) = tr.timeline(events, 1)
    assert a.start == 0 and b.start == pytest.approx(2e18)   # relative to the replay's first
    assert all(abs(t) < float("inf") for k in (a, b) for t in (k.start, k.end, k.dur))


HOSTILE_DOTS = {
    "blank lines": "\n" * 100_000 + "x",                   # 0.77 s at 8000 before
    "a long name": "a" * 100_000,
    "a long name in a node": '"n' + "1" * 100_000 + '" [label="l2p_prefetch_8"];\n',
    "unclosed labels": 'a [label="l2p_prefetch_8\n' * 4000,
    "an unclosed record": '"n" [label="{ID | 1 | l2p_prefetch_8' + "|" * 100_000,
    "IDs in one label": '"n" [label="l2p_prefetch_8 ' + "{ID " * 25_000 + '"];\n',
    "a mangled length of 5000 digits":
        '"n" [label="{ID | 1 | _Z' + "9" * 5000 + 'a l2p_prefetch_8"];\n',
}


@pytest.mark.parametrize("shape", HOSTILE_DOTS)
def test_dot_neighbours_is_linear_and_never_raises(shape):
    """Issue 38.5: dot_neighbours takes any text in time linear in its size (these took
    seconds to minutes, or raised ValueError: Exceeds the limit (4300 digits))."""
    import time

    text = HOSTILE_DOTS[shape]
    t0 = time.perf_counter()
    lines = tr.dot_neighbours(text)
    assert time.perf_counter() - t0 < 2.0
    assert all(isinstance(line, str) and len(line) < 1000 for line in lines)


def test_demangling_reads_a_length_only_where_it_fits():
    assert trace_dot._demangle("_ZN2at6native6kernelIiEEvv") == "at::native::kernel"
    assert trace_dot._demangle("_Z" + "9" * 5000 + "abc") == "_Z" + "9" * 5000 + "abc"
    assert trace_dot._demangle("_Z3ab") == "_Z3ab"                  # a length past the end
    assert trace_dot._demangle("l2p_prefetch_8") == "l2p_prefetch_8"


def test_a_layout_with_the_wrong_marks_raises():
    events = tr.timeline(step((7, 10.5, 0.3)), 1)
    with pytest.raises(tr.TraceError, match="1 marker kernels for 2 marks"):
        tr.layout_of(events, [("fork", KEY), ("begin", CONSUMER)])
    with pytest.raises(tr.TraceError, match="a layout mark must be"):
        tr.layout_of(events, [("end", CONSUMER)])
    with pytest.raises(ValueError, match="replays must be an int >= 1"):
        tr.split_replays(events, 0)


# -- the Markdown and the plot ---------------------------------------------------------------

def test_the_markdown_timeline():
    forks, timeline = traced(step((20, 11.5, 28.5), gate=12), step((20, 11.5, 1.0), gate=18))
    result = tr.TraceResult("LlamaForCausalLM, batch 1", 5, forks, step_us=70, control_step_us=76,
                            notes=["a note"], graph=["node graph_0_node_3 depends on ..."],
                            kernels=timeline)
    text = result.markdown()
    assert text.startswith("# l2prefetch trace: LlamaForCausalLM, batch 1\n")
    assert "Medians over 5 replays" in text and "- a note" in text
    assert "70.0 us with loads, 76.0 us with empty tables" in text
    assert f"## Fork 1: `{KEY[0]}`, layer 0, batch 1 (leaf)" in text
    assert ("loads ran 11.5-40.0 us (28.5 us, starting +1.5 us after the fork); window "
            "(kernels on other streams meanwhile) 11.0-57.0 us; overlap 93%; consumer 12.0 us "
            "with loads vs 18.0 us with empty tables.") in text
    assert f"consumer: the kernels of `{CONSUMER}`, placed by the layout graph" in text
    assert "The fork follows `gemv_o_proj` (stream 7, ends 10.0 us); the loader ran on stream 20" \
        in text
    assert "Graph: node graph_0_node_3 depends on ..." in text
    assert "| - | `l2p_prefetch_32` | 20 | 11.5 | 40.0 | 28.5 | 1.0 | **loader** |" in text
    assert "| 3 | `spin` | 7 | 17.0 | 57.0 | 40.0 | 40.0 | window |" in text
    assert "| 4 | `gemv_gate_proj` | 7 | 58.0 | 70.0 | 12.0 | 18.0 | consumer |" in text


def test_long_tables_and_odd_names_stay_markdown():
    events = [kernel("gemv|x`y" + "z" * 100, 7, 0, 1)]
    events += [kernel(f"k{i}", 7, 2 + 2 * i, 1) for i in range(60)]
    events += [kernel("l2p_prefetch_8", 20, 1.5, 200), kernel("gemv_late", 7, 130, 1)]
    result = tr.TraceResult("t", 1, tr.analyze(tr.timeline(events, 1)))
    text = result.markdown()
    assert "`gemv\\|x'y" in text and "z" * 80 not in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + tr.MAX_ROWS + 1           # the header, the kept rows, the ellipsis
    assert f"| ... | {len(result.forks[0].rows) - tr.MAX_ROWS} rows left out" in text


@pytest.mark.parametrize("loader", [(20, 11.5, 28.5), (7, 5.0, 20.0)])   # leaf; early inline
def test_the_plot(tmp_path, loader):
    pytest.importorskip("matplotlib")
    forks, timeline = traced(step(loader))
    path = tmp_path / "trace.png"
    tr.TraceResult("t", 1, forks, kernels=timeline).plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_without_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="--plot needs matplotlib"):
        tr.TraceResult("t", 1, []).plot("x.png")


def dot_node(n, name):
    """A kernel node as cuGraphDebugDotPrint writes it (verbose, CUDA 13)."""
    return (f'"graph_1_node_{n}"[style="bold" shape="record" label="{{KERNEL\n'
            f'| {{ID | {n} (topoId: {9 - n}) | {name}\\<\\<\\<32,32,131072\\>\\>\\>}}\n'
            '| {{node handle | func handle} | {0x000000003AB630E8 | 0x000000003B0780B0}}\n'
            '| {cooperative | 0}\n| {priority | 0}\n}"];\n\n')


def dot(*edges):
    names = ["nvjet_sm90_tst_8x64_64x16_2x1_v_bz_TNN", "l2p_prefetch_8",
             "_ZN2at6native29vectorized_elementwise_kernelILi8ENS0_15CUDAFunctor_addIN3c108"
             "BFloat16EEESt5arrayIPcLm3EEEEviT0_T1_"]
    return ('digraph dot {\nsubgraph cluster_1 {\nlabel="graph_1" graph[style="dashed"];\n'
            + "".join(dot_node(n, name) for n, name in enumerate(names))
            + "".join(f'"graph_1_node_{a}" -> "graph_1_node_{b}" [headlabel={h}];\n'
                      for a, b, h in edges) + "}\n}\n")


def test_the_loader_nodes_neighbours_in_the_graph():
    leaf = tr.dot_neighbours(dot((0, 1, 0), (0, 2, 0)))
    assert leaf == ["node graph_1_node_1 (l2p_prefetch_8) depends on graph_1_node_0 "
                    "(nvjet_sm90_tst_8x64_64x16_2x1_v_bz_TNN); nothing (a sink of the graph) "
                    "depends on it."]
    inline = tr.dot_neighbours(dot((0, 1, 0), (0, 2, 0), (1, 2, 1)))
    assert inline[0].endswith("; graph_1_node_2 (at::native::vectorized_elementwise_kernel) "
                              "depends on it.")
    assert tr.dot_neighbours("digraph dot {\n}\n") == []


# -- the command line (CPU) ------------------------------------------------------------------

TINY = ["--set", "hidden_size=256", "--set", "intermediate_size=1024",
        "--set", "num_hidden_layers=2", "--set", "num_attention_heads=4",
        "--set", "num_key_value_heads=2", "--set", "vocab_size=512"]
ROLE = "after self_attn.o_proj: mlp.gate_proj"


def one_line_error(capsys, argv, message, code=2):
    assert cli.main(argv) == code
    captured = capsys.readouterr()
    assert len(captured.err.splitlines()) == 1, captured.err
    assert message in captured.err, captured.err
    return captured.err


def test_help_works_without_torch_and_the_runtime_never_imports_trace():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from l2prefetch import cli\n"
            "try:\n    cli.main(['trace', '--help'])\n"
            "except SystemExit as exc:\n    assert not exc.code, exc.code\n"
            "import l2prefetch, l2prefetch.controller, l2prefetch.hooks, l2prefetch.plan\n"
            "print(sorted(m for m in sys.modules if m.startswith('l2prefetch.tuning.trace')))\n")
    # the l2prefetch this suite imports (installed, or the tree's with its built _C)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: python -m l2prefetch trace" in proc.stdout and "--mode" in proc.stdout
    # the CLI registers trace_cli; the trace logic itself stays unimported
    assert proc.stdout.splitlines()[-1] == "['l2prefetch.tuning.trace_cli']"
    code = ("import sys, l2prefetch, l2prefetch.controller, l2prefetch.hooks, l2prefetch.ops\n"
            "print([m for m in sys.modules if m.startswith('l2prefetch.tuning')])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr


def test_the_trace_api_is_one_module_over_five_jobs():
    """Issue 39.2: l2prefetch.tuning.trace keeps every name it had, each the object of the
    one module of its job (events, analysis, rendering, dot, captures)."""
    from l2prefetch.tuning import trace_events, trace_render

    before = {"Forks", "ForkTrace", "Kernel", "Layout", "TraceError", "TraceResult", "analyze",
              "forks_of_profile", "forks_of_role", "kernel_events", "layout_of",
              "median_timeline", "split_replays", "timeline", "trace", "dot_neighbours",
              "GEMM_NAME", "MAX_ROWS", "LOADER_PREFIX", "HELD_US", "BEFORE", "WARM_REPLAYS"}
    assert before <= set(tr.__all__)
    jobs = (trace_events, trace_analysis, trace_render, trace_dot, trace_capture)
    for name in tr.__all__:
        owners = [job for job in jobs if name in job.__all__]
        assert len(owners) == 1 and getattr(owners[0], name) is getattr(tr, name), name
    assert set(tr.__all__) == {name for job in jobs for name in job.__all__}


def test_trace_is_a_command(capsys):
    assert cli.main(["--help"]) == 0
    assert "trace" in capsys.readouterr().out
    assert cli.main(["trace", "--help"]) == 0
    assert "usage: python -m l2prefetch trace" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["trace", "llama", "--role", ROLE, "--bogus"], "unrecognized arguments: --bogus"),
    (["trace", "llama"], "one of the arguments --profile/--plan --role is required"),
    (["trace", "llama", "--role", ROLE, "--profile", "p.json"], "not allowed with argument"),
    (["trace", "llama", "--role", ROLE, "--mode", "sideways"], "argument --mode: invalid choice"),
    (["trace", "llama", "--role", ROLE, "--grid", "0"], "--grid must be in 1..65535"),
    (["trace", "llama", "--role", ROLE, "--cap-mib", "x"], "--cap-mib must be a number"),
    (["trace", "llama", "--role", ROLE, "--replays", "0"], "--replays must be in 1..1000"),
    (["trace", "llama", "--role", ROLE, "--device", "cpu"], "--device must be a CUDA device"),
    (["trace", "llama", "--profile", "/no/such.json"], "--profile /no/such.json: no such file"),
    (["trace", "llama", "--profile", __file__, "--mode", "leaf"],
     "--mode set with --profile: a profile's entries carry their own settings"),
    (["trace", "llama", "--role", ROLE, "--kernel", "nope"], "--kernel 'nope' is not a loader"),
    (["trace", "llama", "--role", ROLE, "--out", "/no/such/dir/t.md"],
     "--out /no/such/dir/t.md cannot be written: /no/such/dir is not a directory"),
])
def test_bad_options_exit_2_with_one_line(capsys, argv, message):
    one_line_error(capsys, argv, message)


def test_no_gpu_no_matplotlib_and_disabled_exit_2(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    one_line_error(capsys, ["trace", "llama", "--role", ROLE], "trace needs a CUDA GPU, and "
                   f"torch {torch.__version__} sees none")
    monkeypatch.setenv("L2PREFETCH_DISABLE", "1")
    one_line_error(capsys, ["trace", "llama", "--role", ROLE], "L2PREFETCH_DISABLE is set")
    monkeypatch.delenv("L2PREFETCH_DISABLE")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    one_line_error(capsys, ["trace", "llama", "--role", ROLE, "--plot", "t.png"],
                   "--plot needs matplotlib, which is not installed")


def test_a_missing_model_exits_2(capsys, monkeypatch):
    pytest.importorskip("transformers")
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # get past the GPU checks
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    one_line_error(capsys, ["trace", "no-such-model-type", "--role", ROLE],
                   "cannot build 'no-such-model-type': 'no-such-model-type' is neither a "
                   "checkpoint directory")
    one_line_error(capsys, ["trace", "llama", "--set", "oops", "--role", ROLE], "KEY=VALUE")


def test_options_a_profile_trace_would_ignore_are_refused(tmp_path, capsys):
    """--min-bytes-mib chooses roles to discover, which a profile's trace does not do;
    a negative --seed is refused as tune refuses it."""
    good = fake_profile(tmp_path)
    one_line_error(capsys, ["trace", "llama", "--profile", good, "--min-bytes-mib", "5"],
                   "--min-bytes-mib set with --profile: a profile's entries carry their own "
                   "settings")
    one_line_error(capsys, ["trace", "llama", "--role", ROLE, "--seed", "-7"],
                   "--seed must be in 0..4294967295, got -7")


def test_the_model_options_are_checked_before_the_gpu(monkeypatch, capsys):
    """Without a GPU, a bad --dtype, --set or --prompt-len is named, not 'needs a GPU'."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    one_line_error(capsys, ["trace", "llama", "--role", ROLE, "--dtype", "float99"],
                   "--dtype: ")
    one_line_error(capsys, ["trace", "llama", "--role", ROLE, "--set", "oops"], "--set: ")
    one_line_error(capsys, ["trace", "llama", "--role", ROLE, "--prompt-len", "64"],
                   "--max-cache-len (64) must exceed --prompt-len (64)")


def test_a_profile_is_traced_by_default_at_the_first_batch_it_forks_at(tmp_path):
    """A plan empty at batch 1 and kept at batch 8 (a common result): --batch left out
    traces batch 8, not the first batch tuned (which failed, blaming a --batch not given)."""
    import argparse

    data = json.loads(open(fake_profile(tmp_path)).read())
    data["plan"] = [{**e, "batches": [8]} for e in data["plan"] if 8 in e["batches"]]
    path = tmp_path / "b8.json"
    path.write_text(json.dumps(data))
    args = argparse.Namespace(profile=str(path), batch=None, cap_mib=None, mode=None,
                              grid=None, kernel=None, min_bytes_mib=None)
    trace_cli._check_profile(args)
    assert data["batches"][0] == 1 and args.batch == 8


def fake_profile(tmp_path):
    """A profile as tune writes it, of the tuner's stand-in llama (tests/_tuning_fakes.py):
    its o_proj role forks at batches 1 and 8."""
    import torch
    from l2prefetch import tuning

    model = fakes.llama(n_layers=2, h=256, i=512, kv=64)
    xs = {}

    def step(batch):
        return model(xs.setdefault(batch, torch.zeros(batch, 1, 256, dtype=torch.bfloat16)))
    backend = fakes.DeviceBackend({"after self_attn.v_proj: self_attn.o_proj": lambda s: 9.0},
                                  seed=1)
    result = tuning.tune(model, step, [1, 8], backend=backend, progress=None,
                         min_bytes=16 * 1024)
    path = tmp_path / "profile.json"
    result.save(path, model)
    return str(path)


def tiny_model():
    from l2prefetch.tuning import hf

    model = hf.load_model("llama", overrides=hf.parse_overrides(TINY[1::2]), device="cpu",
                          dtype="float32")
    return model, hf.DecodeStep(model, max_cache_len=16)


def namespace(**kw):
    defaults = dict(profile=None, role=None, batch=None, cap_mib=None, mode=None, grid=None,
                    kernel=None, min_bytes_mib=0.25)
    return types.SimpleNamespace(**{**defaults, **kw})


def test_roles_and_profiles_are_checked_against_the_model(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    model, step = tiny_model()
    with pytest.raises(trace_cli._Bad, match=r"--role 'nope' is not a role of this model; its "
                       r"roles: .*'after self_attn.o_proj: mlp.gate_proj'"):
        trace_cli._forks(namespace(role="nope"), model, step, tr)
    # a profile of another model (the tuner's stand-in llama) is refused once it is built
    from l2prefetch import profile as profile_module

    monkeypatch.setattr(profile_module, "device_fingerprint",
                        lambda device=None: dict(fakes.FAKE_DEVICE))
    with pytest.raises(trace_cli._Bad, match="--profile: profile .* was tuned on another model"):
        trace_cli._forks(namespace(profile=fake_profile(tmp_path)), model, step, tr)


@pytest.mark.parametrize("change", ["compiled", "batches"])
def test_a_profile_replaced_after_its_check_is_checked_again(tmp_path, monkeypatch, change):
    """trace reads the profile twice (checked before the GPU, then bound to the model):
    a file replaced in between (another tune writing it) is checked again, not traced."""
    from l2prefetch import profile as profile_module

    monkeypatch.setattr(profile_module, "device_fingerprint",
                        lambda device=None: dict(fakes.FAKE_DEVICE))
    path = fake_profile(tmp_path)
    args = namespace(profile=path, min_bytes_mib=None)
    trace_cli._check_profile(args)
    assert args.batch == 1
    data = json.loads(open(path).read())
    if change == "compiled":
        data["step"] = {"compiled": True, "mode": "default", "torch": "2.13.0"}
        words = "changed since trace first read it: .* was tuned on the compiled"
    else:
        data["plan"] = [{**e, "batches": [8]} for e in data["plan"] if 8 in e["batches"]]
        words = (r"changed since trace first read it: the batch it forked at first 1: the profile "
                 r"forks at batches \[8\] only")
    open(path, "w").write(json.dumps(data))
    with pytest.raises(trace_cli._Bad, match=words):
        trace_cli._forks(args, fakes.llama(n_layers=2, h=256, i=512, kv=64), None, tr)


def test_a_profile_is_checked_before_the_gpu(tmp_path, capsys, monkeypatch):
    """Issue 41.5: the profile is read (through _files) and checked (parse_profile), and
    its batch, before torch is asked for a GPU: here torch sees none, and each bad
    profile is still named for what it is."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"plan": []}))
    one_line_error(capsys, ["trace", "llama", "--profile", str(bad)],
                   f"--profile: profile {bad}: is not an l2prefetch profile")
    good = fake_profile(tmp_path)
    data = json.loads(open(good).read())
    truncated = tmp_path / "truncated.json"
    truncated.write_text(open(good).read()[:200])
    one_line_error(capsys, ["trace", "llama", "--profile", str(truncated)],
                   "is not valid JSON")
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({**data, "plan": [], "results": []}))
    one_line_error(capsys, ["trace", "llama", "--profile", str(empty)],
                   "its plan is empty, so nothing forks")
    one_line_error(capsys, ["trace", "llama", "--profile", good, "--batch", "2"],
                   "--batch 2: the profile forks at batches [1, 8] only")
    compiled = tmp_path / "compiled.json"
    compiled.write_text(json.dumps({**data, "step": {"compiled": True, "mode": "default",
                                                     "torch": "2.13.0"}}))
    one_line_error(capsys, ["trace", "llama", "--profile", str(compiled)],
                   f"--profile {compiled} was tuned on the compiled (torch.compile, mode "
                   "default, torch 2.13.0) step; trace captures the step eagerly")
    # a good profile gets as far as the GPU
    one_line_error(capsys, ["trace", "llama", "--profile", good], "trace needs a CUDA GPU")


def test_a_profile_that_is_not_a_regular_file_is_named_so(tmp_path, capsys):
    """Issue 38.6: --profile DIR and --profile FIFO exist: they are not 'no such file'."""
    one_line_error(capsys, ["trace", "llama", "--profile", str(tmp_path)],
                   f"--profile: profile {tmp_path} is a directory, not a regular file")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    one_line_error(capsys, ["trace", "llama", "--profile", str(fifo)],
                   f"--profile: profile {fifo} is a FIFO, not a regular file")


def test_a_role_becomes_forks_with_its_consumers():
    pytest.importorskip("transformers")
    model, step = tiny_model()
    forks, batch, what = trace_cli._forks(namespace(role=ROLE, mode="leaf", cap_mib=0),
                                          model, step, tr)
    assert batch == 1 and what == f"role '{ROLE}', 0 MiB, grid 32, leaf, warm activation"
    assert forks.consumers == {(ROLE, 0): "model.layers.0.mlp.gate_proj",
                               (ROLE, 1): "model.layers.1.mlp.gate_proj"}
    (sites,) = forks.points.values()
    assert [layer for _, layer in sites] == [0, 1]
    assert sites[1][0] is model.model.layers[1].self_attn.o_proj
    # the eager step's forks as tune() measures them
    asked = {}
    stub = types.SimpleNamespace(forks_of_role=lambda *a, **kw: asked.update(kw) or forks)
    trace_cli._forks(namespace(role=ROLE, mode="leaf", cap_mib=0), model, step, stub)
    assert asked["warm_activation"] is True


# -- on the GPU ------------------------------------------------------------------------------

GPU_TINY = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, vocab_size=1024)


@pytest.mark.gpu
def test_a_leaf_loader_starts_at_its_fork_and_overlaps_the_next_kernels(tmp_path, capsys):
    pytest.importorskip("transformers")
    from l2prefetch.tuning import candidates, discover, hf

    model = hf.load_model("llama", overrides=GPU_TINY, device="cuda", dtype="bfloat16")
    step = hf.DecodeStep(model)
    roles = {r.name: r for r in candidates(model, discover(model, lambda: step(1)))}
    forks = tr.forks_of_role(model, roles[ROLE], 1, byte_cap=0, mode="leaf")
    result = tr.trace(model, step, 1, forks, replays=5, dot=str(tmp_path / "g.dot"))
    print(result.markdown())
    assert [f.key[1] for f in result.forks] == [0, 1]
    for fork in result.forks:
        assert fork.mode == "leaf" and fork.found_by == "module"
        assert fork.before is not None and tr.GEMM_NAME.search(fork.before.name), fork.before
        assert fork.consumer_path == f"model.layers.{fork.key[1]}.mlp.gate_proj"
        assert 0 <= fork.start_after_fork_us < 5, fork.summary()
        before = next(r.index for r in fork.rows if r.kernel is fork.before)
        after = next(r.kernel for r in fork.rows if r.index == before + 1)
        assert after in fork.window, fork.summary()     # the kernel right after the fork
        # the executor keeps the loader on the fork's stream and moves what follows
        # to another one (RESULTS.md, run 12): the window runs beside the loader
        assert all(k.stream != fork.loader.stream for k in fork.window), fork.summary()
        assert fork.overlap > 0.5, fork.summary()
        assert fork.delay_to_next_us is not None        # the graph without forks ran
    # the leaves of one capture form one side chain: the second depends on the first
    # loader, and nothing depends on the last (H200 run: RESULTS.md, run 12)
    assert len(result.graph) == 2 and "a sink of the graph" in result.graph[-1]
    assert result.graph[-1].split(";")[0].count("(l2p_prefetch_") == 2
    # the command line writes the same kind of timeline
    out = tmp_path / "trace.md"
    argv = ["trace", "llama", *[x for k, v in GPU_TINY.items() for x in ("--set", f"{k}={v}")],
            "--role", ROLE, "--mode", "leaf", "--cap-mib", "0", "--out", str(out)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    text = out.read_text()
    assert f"## Fork 2: `{ROLE}`, layer 1, batch 1 (leaf)" in text and "**loader**" in text


@pytest.mark.gpu
@pytest.mark.parametrize("window, role", [
    ("norm", "before post_attention_layernorm: mlp.gate_proj"),
    ("o_proj", ROLE)])
def test_an_inline_fork_just_before_the_window_loads_beside_it(window, role):
    """An inline fork whose next kernel is a planted 20 us spin starts its loads as the
    spin starts and ends them inside it; the consumer starts after both (issue 24).
    norm: the spin in a pre-hook of post_attention_layernorm, the fork hooked ahead of
    it (a before-site); o_proj: the spin in a forward hook of o_proj (where a tensor-
    parallel all-reduce runs), the fork after o_proj, hooked ahead of it (run 21)."""
    pytest.importorskip("transformers")
    import torch

    from l2prefetch.tuning import candidates, discover, hf
    from l2prefetch.tuning.rig import spin_cycles_per_us

    model = hf.load_model("llama", overrides=GPU_TINY, device="cuda", dtype="bfloat16")
    step = hf.DecodeStep(model)
    cycles = int(20 * spin_cycles_per_us())
    if window == "norm":
        planted = [layer.post_attention_layernorm.register_forward_pre_hook(
            lambda m, a: torch.cuda._sleep(cycles)) for layer in model.model.layers]
    else:
        planted = [layer.self_attn.o_proj.register_forward_hook(
            lambda m, a, o: torch.cuda._sleep(cycles)) for layer in model.model.layers]
    try:
        roles = {r.name: r for r in candidates(model, discover(model, lambda: step(1)))}
        forks = tr.forks_of_role(model, roles[role], 1, byte_cap=0, mode="inline")
        result = tr.trace(model, step, 1, forks, replays=5)
    finally:
        for handle in planted:
            handle.remove()
    print(result.markdown())
    assert [f.key[1] for f in result.forks] == [0, 1]
    for fork in result.forks:
        assert fork.mode == "inline" and fork.found_by == "module", fork.summary()
        assert fork.consumer_path == f"model.layers.{fork.key[1]}.mlp.gate_proj"
        spin = next(r.kernel for r in fork.rows if "spin" in r.kernel.name)
        loader = fork.loader
        assert 0 <= fork.start_after_fork_us < 5, fork.summary()
        # the loads run beside the spin, and are done before the spin is
        assert spin.start < loader.end <= spin.end, fork.summary()
        assert fork.overlap > 0.5, fork.summary()
        assert loader.end <= fork.consumer[0].start, fork.summary()


# -- the outputs (issue 38.2-4): checked by _files before any work, written atomically -----

def no_gpu_asked(monkeypatch):
    import torch

    def asked():
        pytest.fail("trace asked torch for a GPU before refusing its outputs")
    monkeypatch.setattr(torch.cuda, "is_available", asked)


@pytest.mark.parametrize("options, message", [
    (["--out", "{dir}"], "--out {dir} is a directory: name a file to write"),
    (["--plot", "{dir}"], "--plot {dir} is a directory: name a file to write"),
    (["--dot", "{dir}"], "--dot {dir} is a directory: name a file to write"),
    (["--out", "{p}"], "--out {p} is the file --profile reads"),
    (["--plot", "{p}"], "--plot {p} is the file --profile reads"),
    (["--dot", "{link}"], "--dot {link} is the file --profile reads"),   # a link to it
    (["--out", "{t}", "--plot", "{t}"], "--plot {t} is the file --out names too"),
    (["--out", "{t}", "--dot", "{dir}/../t.md"], "is the file --out names too"),
    (["--dot", "{dir}/none/t.dot"], "--dot {dir}/none/t.dot cannot be written: "
     "{dir}/none is not a directory"),
])
def test_every_output_is_checked_before_the_gpu(tmp_path, capsys, monkeypatch, options,
                                                 message):
    profile = fake_profile(tmp_path)
    sub = tmp_path / "sub"
    sub.mkdir()
    os.symlink(profile, tmp_path / "link")
    names = dict(dir=str(sub), p=profile, link=str(tmp_path / "link"), t=str(tmp_path / "t.md"))
    no_gpu_asked(monkeypatch)
    one_line_error(capsys, ["trace", "llama", "--profile", profile,
                            *(o.format(**names) for o in options)], message.format(**names))
    assert json.loads(open(profile).read())["plan"]            # the profile is untouched


def stub_trace(monkeypatch, result):
    """trace_cli.run as far as its outputs, without a GPU: the model, the forks and the
    trace itself stand-ins; ``result`` is the TraceResult the trace returns."""
    import torch

    from l2prefetch.tuning import hf

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(name="a stand-in GPU"))
    monkeypatch.setattr(hf, "load_model", lambda *a, **kw: torch.nn.Linear(2, 2))
    monkeypatch.setattr(hf, "DecodeStep", lambda *a, **kw: None)
    monkeypatch.setattr(trace_cli, "_forks", lambda args, model, step, trace: (None, 1, "x"))
    monkeypatch.setattr(tr, "trace", lambda *a, **kw: result)


@pytest.mark.parametrize("option, name", [("--out", "config.json"),
                                          ("--dot", "model.safetensors")])
def test_an_output_that_is_a_file_of_the_model_is_refused(tmp_path, capsys, monkeypatch,
                                                           option, name):
    """As tune: an output of trace's naming one of the checkpoint's files is refused
    before anything runs (it replaced the config with the timeline)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in ("config.json", "model.safetensors"):
        (ckpt / f).write_text("{}")
    forks, timeline = traced(step((20, 11.5, 28.5)))
    stub_trace(monkeypatch, tr.TraceResult("t", 1, forks, kernels=timeline))
    target = ckpt / name
    one_line_error(capsys, ["trace", str(ckpt), "--role", ROLE, option, str(target)],
                   f"{option} {target} is the file the model reads")
    assert target.read_text() == "{}"


def test_a_set_value_nested_too_deep_is_one_line(tmp_path, capsys, monkeypatch):
    forks, timeline = traced(step((20, 11.5, 28.5)))
    stub_trace(monkeypatch, tr.TraceResult("t", 1, forks, kernels=timeline))
    one_line_error(capsys, ["trace", "LlamaConfig", "--role", ROLE,
                            "--set", "rope_parameters=" + "[" * 900 + "]" * 900],
                   "more than 32 deep (rope_parameters)")


def test_outputs_replace_a_planted_link_never_write_through_it(tmp_path, capsys, monkeypatch):
    """Issue 38.2: --out and --plot at a planted link replace the link (atomically, by
    _files.write_atomic); the file it pointed at is untouched."""
    pytest.importorskip("matplotlib")
    forks, timeline = traced(step((20, 11.5, 28.5)))
    stub_trace(monkeypatch, tr.TraceResult("t", 1, forks, kernels=timeline))
    victims = {}
    for name in ("out.md", "plot.png"):
        victims[name] = tmp_path / f"victim-{name}"
        victims[name].write_text("precious")
        os.symlink(victims[name], tmp_path / name)
    argv = ["trace", "llama", "--role", ROLE, "--out", str(tmp_path / "out.md"),
            "--plot", str(tmp_path / "plot.png")]
    assert cli.main(argv) == 0, capsys.readouterr().err
    for name, victim in victims.items():
        assert victim.read_text() == "precious"
        assert not os.path.islink(tmp_path / name)
    assert (tmp_path / "out.md").read_text().startswith("# l2prefetch trace: t\n")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == sorted(["out.md", "plot.png", *(
        v.name for v in victims.values())])                    # no temporary left behind


def test_an_output_that_became_unwritable_after_the_checks_is_exit_1(tmp_path, capsys,
                                                                     monkeypatch):
    forks, timeline = traced(step((20, 11.5, 28.5)))
    stub_trace(monkeypatch, tr.TraceResult("t", 1, forks, kernels=timeline))
    out = tmp_path / "sub" / "out.md"
    out.parent.mkdir()
    real = tr.trace

    def trace_then_remove(*a, **kw):
        out.parent.rmdir()          # gone while the GPU traced
        return real(*a, **kw)
    monkeypatch.setattr(tr, "trace", trace_then_remove)
    one_line_error(capsys, ["trace", "llama", "--role", ROLE, "--out", str(out)],
                   "traced, but the outputs could not be written", code=1)


class DumpingGraph:
    """A captured graph's stand-in: debug_dump writes a dot text where it is told, as
    cuGraphDebugDotPrint does (a plain open, following links)."""

    def __init__(self, text):
        self.text, self.dumped_to = text, None

    def instantiate(self):
        pass

    def debug_dump(self, path):
        self.dumped_to = path
        with open(path, "w") as f:
            f.write(self.text)


def test_the_dot_goes_through_a_private_file_to_an_atomic_write(tmp_path):
    """Issue 38.2-4: the driver dumps into a private directory; the dot is read back
    through _files and written atomically over --dot (a planted link replaced)."""
    text = dot((0, 1, 0), (0, 2, 0))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "graph.dot"
    os.symlink(victim, target)
    graph = DumpingGraph(text)
    neighbours = trace_capture._dump(graph, str(target))
    assert neighbours == tr.dot_neighbours(text) and len(neighbours) == 1
    assert victim.read_text() == "precious" and not os.path.islink(target)
    assert target.read_text() == text
    assert not os.path.dirname(graph.dumped_to).startswith(str(tmp_path))
    assert not os.path.exists(graph.dumped_to)                 # the private copy is gone
    assert sorted(os.listdir(tmp_path)) == ["graph.dot", "victim"]


def test_trace_refuses_a_dot_it_cannot_write_before_capturing(tmp_path):
    """The library's trace() checks dot= before anything runs (no model is touched)."""
    pytest.importorskip("torch")

    class Untouchable:
        def parameters(self):
            pytest.fail("trace() looked at the model before checking dot=")
    with pytest.raises(ValueError, match=f"dot {tmp_path} is a directory"):
        tr.trace(Untouchable(), None, 1, None, dot=str(tmp_path))
