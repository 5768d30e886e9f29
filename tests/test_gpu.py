"""GPU tests: real launches, ordering, CUDA graphs, numerics.  Skipped without a GPU.

Run under compute-sanitizer by .ci/gpu (memcheck, racecheck) with
PYTORCH_NO_CUDA_MEMORY_CACHING=1, so each tensor is its own allocation and a
read past a range's end would be past the allocation's end.
"""

import gc
import os

import pytest

import l2prefetch
from l2prefetch import PrefetchController, PreparedWeightRanges, _C
from conftest import storageless

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

DEV = "cuda:0"


def _rand(shape, dtype=torch.bfloat16):
    return torch.randn(shape, device=DEV, dtype=torch.float32).to(dtype)


@pytest.fixture(scope="module", autouse=True)
def _cublas_ready():
    """Create cuBLAS's handle before any capture: its creation frees memory, which a
    capture refuses, so the first matmul of a process must not be a captured one (a test
    selected alone with -k, as .ci/gpu sanitize does, would be)."""
    a = torch.ones((16, 16), device=DEV, dtype=torch.bfloat16)
    (a @ a).float().sum().item()


def _sleep_us(us):
    """Keep the current stream busy for about us microseconds (one CTA, no memory)."""
    torch.cuda._sleep(int(us * 1980))


@pytest.mark.parametrize("variant", sorted(_C.kernel_variants()))
@pytest.mark.parametrize("nbytes", [1, 15, 16, 17, 4096 + 3, 1 << 20, (16 << 20) + 5])
def test_every_variant_launches_over_odd_sizes(variant, nbytes):
    info = _C.device_info(0)
    if info["sm"] < _C.kernel_variants()[variant]["min_sm"]:
        pytest.skip(f"{variant} needs sm_{_C.kernel_variants()[variant]['min_sm']}")
    # A byte tensor of exactly nbytes: its end is the allocation's end when the
    # caching allocator is off (the sanitizer run), and a range never rounds up.
    w = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=DEV)
    before = w.clone()
    p = PreparedWeightRanges([w], kernel=variant, grid=7)
    assert p.ranges == ((w.data_ptr(), nbytes),)
    for _ in range(3):
        p.launch()
    torch.cuda.synchronize()
    assert torch.equal(w, before)     # a prefetch never writes


@pytest.mark.parametrize("variant", ["ring", "load"])
def test_launch_after_model_to_reads_memory_still_allocated(variant):
    """model.to(dtype) keeps each Parameter and swaps its storage: the table holds the old
    storage, so its loads read allocated memory until the table goes.  memcheck does not
    report that read when the storage was freed (RESULTS, run 39): the allocator's count
    tells, so with caching off (as under memcheck) the test only launches."""
    if _C.device_info(0)["sm"] < _C.kernel_variants()[variant]["min_sm"]:
        pytest.skip(f"{variant} needs sm_{_C.kernel_variants()[variant]['min_sm']}")
    lin = torch.nn.Linear(1024, 1024, bias=False, device=DEV, dtype=torch.bfloat16)
    p = PreparedWeightRanges([lin.weight], kernel=variant, grid=8)
    ((ptr, nbytes),) = p.ranges
    lin.to(torch.float32)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert p.weights[0] is lin.weight and lin.weight.data_ptr() != ptr
    held = torch.cuda.memory_allocated()
    for _ in range(3):
        p.launch()
    torch.cuda.synchronize()
    del p
    gc.collect()
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") != "1":   # no stats kept then
        assert torch.cuda.memory_allocated() == held - nbytes   # the old storage, freed now


@pytest.mark.parametrize("grid", [1, 8, 32, 132, 1000])
def test_many_ranges_and_grids(grid):
    ws = [_rand((n, 64)) for n in (1, 3, 64, 1000, 7)] + [_rand((5, 7))[:, 1:5:2]]
    ws = [w for w in ws if w.data_ptr() % 16 == 0]
    p = PreparedWeightRanges(ws, grid=grid, carveout=100, priority=True)
    assert p.launch_priority == _C.device_info(0)["greatest_priority"]
    p.launch(torch.cuda.current_stream())
    p.launch(torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()


def test_default_kernel_is_ring_on_hopper():
    p = PreparedWeightRanges([_rand((64, 64))])
    expected = "ring" if _C.device_info(0)["sm"] >= 90 else "load"
    assert p.kernel == expected


def test_prefetch_keeps_gemv_bitwise_identical():
    w, x = _rand((4096, 7168)), _rand((8, 7168))
    ref = torch.nn.functional.linear(x, w)
    ctrl = PrefetchController(0)
    ctrl.add("p", 0, [8], PreparedWeightRanges([w]))
    for _ in range(20):
        assert ctrl.fork("p", 0, 8)
        y = torch.nn.functional.linear(x, w)
        ctrl.join()
        assert torch.equal(y, ref)
    torch.cuda.synchronize()
    assert ctrl.stats()["p"] == {"forks": 20, "bytes": 20 * w.numel() * 2}


def test_fork_refuses_host_and_storageless_activations_on_the_driver():
    """On the real driver: an __cuda_array_interface__ activation in host memory is
    refused as not device memory (the driver's CUDA_ERROR_INVALID_VALUE), a CUDA wrapper
    tensor without storage (data pointer 0) as having none, a small CPU tensor as a big
    one; nothing launched, and the next fork with a real activation reads it.  (Kept out
    of .ci/gpu's memcheck selections: the refused query is an API error to it.)"""
    w, x = _rand((1024, 1024)), _rand((8, 1024))
    host = torch.zeros(4096)
    in_host = type("InHost", (), {"__cuda_array_interface__": {
        "shape": (4096,), "typestr": "<f4", "data": (host.data_ptr(), False), "version": 3}})()
    ctrl = PrefetchController(0)
    ctrl.add("p", 0, [8], PreparedWeightRanges([w], warm_activation=True))
    for bad, words in ((in_host, "not in CUDA device memory"),
                       (storageless((8, 1024), DEV), "no storage of its own"),
                       (torch.zeros(2), "not in CUDA device memory")):
        with pytest.raises(ValueError, match=words):
            ctrl.fork("p", 0, 8, activation=bad)
    assert ctrl.stats()["p"]["forks"] == 0
    assert ctrl.fork("p", 0, 8, activation=x)
    ctrl.join()
    torch.cuda.synchronize()
    assert ctrl.stats()["p"] == {"forks": 1, "bytes": w.numel() * 2 + x.numel() * 2}
    ctrl.close()


@pytest.mark.parametrize("mode", ["eager", "inline", "branch", "leaf"])
def test_warm_fork_reads_the_activation_and_keeps_numerics(mode):
    """warm_activation: each fork also reads its activation (counted in the stats), eagerly
    and in each graph mode; a view 2 bytes past an allocation's start is read from the
    next 16-byte boundary (under compute-sanitizer, no byte outside it); bitwise."""
    w, x = _rand((2048, 4096)), _rand((9, 4096))
    act = x[1:]                                  # starts 8192 bytes in: aligned
    odd = x.view(-1)[1:4097]                     # starts 2 bytes in: rounded up to 16
    ref = torch.nn.functional.linear(act, w)
    ctrl = PrefetchController(0, graph_fork="inline" if mode == "eager" else mode)
    ctrl.add("p", 0, [8], PreparedWeightRanges([w], warm_activation=True))
    wbytes = w.numel() * 2
    if mode == "eager":
        for seen in (act, odd):
            assert ctrl.fork("p", 0, 8, activation=seen)
            y = torch.nn.functional.linear(act, w)
            ctrl.join()
            assert torch.equal(y, ref)
        torch.cuda.synchronize()
        assert ctrl.stats()["p"] == {"forks": 2, "bytes": 2 * wbytes + act.numel() * 2
                                     + 4096 * 2 - 14}
        return
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            assert ctrl.fork("p", 0, 8, activation=odd)
            out = torch.nn.functional.linear(act, w)
            ctrl.join()
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    assert ctrl.stats()["p"] == {"forks": 1, "bytes": wbytes + 4096 * 2 - 14}


def test_attached_warm_plan_keeps_a_block_bitwise():
    """from_plan + hooks.attach with warm_activation entries before and after modules:
    each eager fork reads the tensor its hook sees (the stats count it), output bitwise."""
    from l2prefetch import PlanEntry, hooks

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.Linear(4096, 2048)).to(
        DEV, torch.bfloat16)
    x = _rand((4, 2048))
    with torch.no_grad():
        ref = model(x)
    plan = [PlanEntry("before1", 0, (4,), (model[1].weight,), warm_activation=True),
            PlanEntry("after0", 0, (4,), (model[1].weight,), byte_cap=1 << 20,
                      warm_activation=True)]
    ctrl = PrefetchController.from_plan(plan, 0)
    with hooks.attach(model, ctrl, {"before1": [(model[1], 0, "before")],
                                    "after0": [(model[0], 0)]}), torch.no_grad():
        for _ in range(5):
            assert torch.equal(model(x), ref)
    torch.cuda.synchronize()
    hidden = 4 * 4096 * 2   # model[0]'s output: what both hooks see
    assert ctrl.stats()["before1"]["bytes"] == 5 * (model[1].weight.numel() * 2 + hidden)
    assert ctrl.stats()["after0"]["bytes"] == 5 * ((1 << 20) + hidden)


def _ordering_step(ctrl, src, seen, dst, value):
    """Main: (slow) src <- value; fork; side: seen <- src, (slow) dst <- value; join."""
    _sleep_us(50)
    src.fill_(value)
    assert ctrl.fork("p", 0, 1)
    with torch.cuda.stream(ctrl.stream):
        seen.copy_(src)            # must see the main stream's write
        _sleep_us(50)
        dst.fill_(value)
    ctrl.join()
    return dst.clone()             # must see the side stream's write


def test_fork_orders_after_main_stream_and_join_rejoins():
    ctrl = PrefetchController(0)
    w = _rand((1024, 1024))
    ctrl.add("p", 0, [1], PreparedWeightRanges([w]))
    src, seen, dst = (torch.zeros(1 << 20, device=DEV) for _ in range(3))
    for value in range(1, 30):
        after = _ordering_step(ctrl, src, seen, dst, float(value))
        assert torch.all(after == value)
        assert torch.all(seen == value)


def test_inline_graph_fork_keeps_the_stream_order():
    """The shipped capture path (graph_fork='inline'): the work after a fork
    still waits for the work before it, on every replay, and the prefetch node
    is in the graph (counted), with nothing pending."""
    ctrl = PrefetchController(0)
    assert ctrl.graph_fork == "inline"
    w = _rand((2048, 2048))
    ctrl.add("p", 0, [1], PreparedWeightRanges([w], carveout=100, priority=True))
    src, dst = torch.zeros(1 << 20, device=DEV), torch.zeros(1 << 20, device=DEV)
    value = torch.zeros((), device=DEV)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            _sleep_us(50)
            src.copy_(value.expand_as(src))        # X: the last node before the fork
            assert ctrl.fork("p", 0, 1)
            assert not ctrl.pending
            dst.copy_(src + 1)                     # must still follow X
            ctrl.join()
    torch.cuda.current_stream().wait_stream(s)
    assert ctrl.stats()["p"]["forks"] == 1
    for v in range(200):
        value.fill_(float(v))
        g.replay()
        torch.cuda.synchronize()
        assert torch.all(dst == v + 1), v


def test_fork_join_in_cuda_graph_replays_like_eager():
    """graph_fork='branch': the side stream is part of the capture, ordered
    after the fork and joined at the end, as in eager mode."""
    ctrl = PrefetchController(0, graph_fork="branch")
    w = _rand((1024, 1024))
    ctrl.add("p", 0, [1], PreparedWeightRanges([w], carveout=100, priority=True))
    src, seen, dst = (torch.zeros(1 << 20, device=DEV) for _ in range(3))
    value = torch.zeros((), device=DEV)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            _sleep_us(50)
            src.copy_(value.expand_as(src))
            assert ctrl.fork("p", 0, 1)
            with torch.cuda.stream(ctrl.stream):
                seen.copy_(src)
                _sleep_us(50)
                dst.copy_(src + 1)
            ctrl.join()
            out = dst.clone()
    torch.cuda.current_stream().wait_stream(s)
    assert not ctrl.pending
    for v in range(200):
        value.fill_(float(v))
        g.replay()
        torch.cuda.synchronize()
        assert torch.all(seen == v) and torch.all(out == v + 1), v


@pytest.mark.parametrize("mode", ["inline", "branch"])
def test_eager_false_forks_only_while_capturing(mode):
    """eager=False: an eager fork launches nothing; the same fork captured into a
    graph is a prefetch node that replays, with the graph's result unchanged."""
    ctrl = PrefetchController(0, graph_fork=mode, eager=False)
    w = _rand((1024, 1024))
    ctrl.add("p", 0, [1], PreparedWeightRanges([w]))
    x = _rand((1, 1024))
    assert ctrl.fork("p", 0, 1) is False and not ctrl.pending
    ctrl.join()
    assert ctrl.stats()["p"]["forks"] == 0
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            assert ctrl.fork("p", 0, 1) is True
            y = x @ w.t()
            ctrl.join()
    torch.cuda.current_stream().wait_stream(s)
    assert ctrl.stats()["p"] == {"forks": 1, "bytes": w.numel() * w.element_size()}
    want = x @ w.t()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want)
    assert ctrl.fork("p", 0, 1) is False                   # eager again after the capture


def test_unjoined_capture_is_reported_by_us():
    drv = pytest.importorskip("cuda.bindings.driver")
    ctrl = PrefetchController(0, graph_fork="branch")      # inline forks leave nothing unjoined
    ctrl.add("p", 0, [1], PreparedWeightRanges([_rand((256, 256))]))
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    # A raw driver capture, so torch's own capture bookkeeping stays out of it.
    mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    assert drv.cuStreamBeginCapture(s.cuda_stream, mode)[0] == drv.CUresult.CUDA_SUCCESS
    assert ctrl.fork("p", 0, 1, stream=s.cuda_stream)      # no join: the capture cannot end
    err, graph = drv.cuStreamEndCapture(s.cuda_stream)
    assert err == drv.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNJOINED
    with pytest.raises(l2prefetch.Error, match="join"):
        ctrl.fork("p", 0, 1)
    # The controller recovers: the next step works.
    assert ctrl.fork("p", 0, 1)
    ctrl.join()
    torch.cuda.synchronize()


@pytest.mark.parametrize("where", ["in another capture", "eagerly"])
def test_join_outside_the_capture_that_forked_is_reported_by_us(where):
    """A PIECEWISE step whose fork's join falls in the next piece: our error, not the
    driver's, and the controller works again."""
    drv = pytest.importorskip("cuda.bindings.driver")
    ctrl = PrefetchController(0, graph_fork="branch")
    ctrl.add("p", 0, [1], PreparedWeightRanges([_rand((256, 256))]))
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    assert drv.cuStreamBeginCapture(s.cuda_stream, mode)[0] == drv.CUresult.CUDA_SUCCESS
    assert ctrl.fork("p", 0, 1, stream=s.cuda_stream) and ctrl.pending
    err, _ = drv.cuStreamEndCapture(s.cuda_stream)
    assert err == drv.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNJOINED
    if where == "in another capture":
        assert drv.cuStreamBeginCapture(s.cuda_stream, mode)[0] == drv.CUresult.CUDA_SUCCESS
    with pytest.raises(l2prefetch.Error, match=f"this join\\(\\) runs {where}"):
        ctrl.join(stream=s.cuda_stream)
    assert not ctrl.pending
    if where == "in another capture":
        err, graph = drv.cuStreamEndCapture(s.cuda_stream)   # nothing of ours in it
        assert err == drv.CUresult.CUDA_SUCCESS
        drv.cuGraphDestroy(graph)
    assert ctrl.fork("p", 0, 1)
    ctrl.join()
    torch.cuda.synchronize()


def test_captured_kernel_nodes_carry_priority_and_carveout():
    drv = pytest.importorskip("cuda.bindings.driver")
    ctrl = PrefetchController(0)
    urgent = PreparedWeightRanges([_rand((512, 512))], carveout=100, priority=True, grid=8)
    plain = PreparedWeightRanges([_rand((512, 512))])
    ctrl.add("urgent", 0, [1], urgent)
    ctrl.add("plain", 0, [1], plain)
    s = torch.cuda.Stream()
    handle = s.cuda_stream
    err, = drv.cuStreamBeginCapture(handle, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    assert err == drv.CUresult.CUDA_SUCCESS
    ctrl.fork("urgent", 0, 1, stream=handle)
    ctrl.fork("plain", 0, 1, stream=handle)
    ctrl.join(stream=handle)
    err, graph = drv.cuStreamEndCapture(handle)
    assert err == drv.CUresult.CUDA_SUCCESS
    err, nodes, n = drv.cuGraphGetNodes(graph, 0)
    err, nodes, n = drv.cuGraphGetNodes(graph, n)
    kernels = []
    for node in nodes:
        err, kind = drv.cuGraphNodeGetType(node)
        if kind == drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            kernels.append(node)
    assert len(kernels) == 2
    ids = drv.CUlaunchAttributeID
    seen = []
    for node in kernels:
        err, params = drv.cuGraphKernelNodeGetParams(node)
        err, prio = drv.cuGraphKernelNodeGetAttribute(node, ids.CU_LAUNCH_ATTRIBUTE_PRIORITY)
        err2, carve = drv.cuGraphKernelNodeGetAttribute(
            node, ids.CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT)
        seen.append((params.gridDimX, prio.priority, carve.sharedMemCarveout))
    greatest = _C.device_info(0)["greatest_priority"]
    assert (8, greatest, 100) in seen, seen
    drv.cuGraphDestroy(graph)


def test_controller_drop_after_capture_and_many_cycles_leak_nothing():
    w = _rand((256, 256))
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    for _ in range(200):
        with PrefetchController(0) as ctrl:
            ctrl.add("p", 0, [1], PreparedWeightRanges([w]))
            ctrl.fork("p", 0, 1)
            ctrl.join()
        del ctrl
    gc.collect()
    torch.cuda.synchronize()
    assert abs(torch.cuda.mem_get_info()[0] - free0) < (8 << 20)


def test_controller_dropped_mid_capture_after_join_leaves_a_working_graph():
    """Dropping the controller between join() and the end of a torch capture
    destroys its side stream and events while the capture is still open: the
    capture must still end, and the graph replay like eager."""
    w = _rand((1024, 1024))
    x = _rand((8, 1024))
    ref = torch.nn.functional.linear(x, w) * 2
    ctrl = PrefetchController(0)
    ctrl.add("p", 0, [8], PreparedWeightRanges([w]))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            assert ctrl.fork("p", 0, 8)
            y = torch.nn.functional.linear(x, w)
            ctrl.join()
            del ctrl
            gc.collect()
            y = y * 2                          # captured after the controller is gone
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, ref)


@pytest.mark.parametrize("mode", ["inline", "branch"])
def test_controller_dropped_mid_capture_before_join(mode):
    """Dropped after fork() and before join().  'branch': the side branch can
    never be joined, so ending the capture fails with a driver error (not a
    crash).  'inline': the prefetch node is on the captured stream, so the
    capture ends and the graph runs.  Either way the process keeps working: a
    new controller forks, captures and replays."""
    drv = pytest.importorskip("cuda.bindings.driver")
    w = _rand((512, 512))
    ctrl = PrefetchController(0, graph_fork=mode)
    ctrl.add("p", 0, [1], PreparedWeightRanges([w]))
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    mode_ = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    assert drv.cuStreamBeginCapture(s.cuda_stream, mode_)[0] == drv.CUresult.CUDA_SUCCESS
    assert ctrl.fork("p", 0, 1, stream=s.cuda_stream)
    del ctrl
    gc.collect()
    err, graph = drv.cuStreamEndCapture(s.cuda_stream)
    if mode == "branch":
        assert err != drv.CUresult.CUDA_SUCCESS, "a capture with an unjoined branch ended"
    else:
        assert err == drv.CUresult.CUDA_SUCCESS, err
        err, exe = drv.cuGraphInstantiate(graph, 0)
        assert err == drv.CUresult.CUDA_SUCCESS, err
        assert drv.cuGraphLaunch(exe, s.cuda_stream)[0] == drv.CUresult.CUDA_SUCCESS
        assert drv.cuStreamSynchronize(s.cuda_stream)[0] == drv.CUresult.CUDA_SUCCESS
        drv.cuGraphExecDestroy(exe)
        drv.cuGraphDestroy(graph)
    assert drv.cuStreamIsCapturing(s.cuda_stream)[1] == \
        drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
    torch.cuda.synchronize()
    # Nothing is left broken: a fresh controller works eager and in a capture.
    again = PrefetchController(0)
    again.add("p", 0, [1], PreparedWeightRanges([w]))
    assert again.fork("p", 0, 1)
    again.join()
    g = torch.cuda.CUDAGraph()
    s2 = torch.cuda.Stream()
    s2.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s2):
        with torch.cuda.graph(g, stream=s2):
            assert again.fork("p", 0, 1)
            again.join()
    torch.cuda.current_stream().wait_stream(s2)
    g.replay()
    torch.cuda.synchronize()
    assert again.stats()["p"]["forks"] == 2          # one eager, one captured


def test_stream_of_another_device_or_context_is_refused():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    p = PreparedWeightRanges([_rand((64, 64))])
    with pytest.raises(ValueError, match="cuda:1"):
        p.launch(torch.cuda.Stream(device=1))


def test_graph_replays_after_its_controller_is_gone():
    """The captured kernel nodes own copies of their parameter blocks and the
    module outlives the controller: dropping the controller after capture leaves
    a graph that replays (the caller keeps the weights alive)."""
    w = _rand((2048, 2048))
    x = _rand((4, 2048))
    ctrl = PrefetchController(0)
    ctrl.add("p", 0, [4], PreparedWeightRanges([w], carveout=100, priority=True))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = torch.nn.functional.linear(x, w)
        with torch.cuda.graph(g, stream=s):
            assert ctrl.fork("p", 0, 4)
            y = torch.nn.functional.linear(x, w)
            ctrl.join()
    torch.cuda.current_stream().wait_stream(s)
    ref = torch.nn.functional.linear(x, w)
    del ctrl
    gc.collect()
    for _ in range(100):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, ref)
