"""A decode step captured in one CUDA graph as a server captures it (the GPU tests of
compiled steps): run once on a side stream (compiling, warming up), captured, replayed."""


def captured(step, batch):
    """The output of one replay of ``step(batch)`` captured in a CUDA graph (a copy
    later replays cannot overwrite), and the graph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        step(batch)                                       # compiles, warms up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = step(batch)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    return out.clone(), graph


def fresh_frames(monkeypatch):
    """Forks enabled, and no compiled frame left from an earlier test, before and after:
    a frame compiled with another test's hooks would run them (an autouse fixture of the
    modules that import it: ``fresh = pytest.fixture(autouse=True)(fresh_frames)``)."""
    from l2prefetch.tuning.compiled import recompile

    monkeypatch.delenv("L2PREFETCH_DISABLE", raising=False)
    recompile()
    yield
    recompile()
