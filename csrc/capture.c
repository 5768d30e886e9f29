/*
 * capture.c: how a fork goes into a CUDA graph being captured.
 *
 * NOTE [inline graph fork]: a side branch in a replayed graph can cost far
 * more than its own nodes.  In graphs of cuBLAS kernels (with their
 * programmatic edges), a real model's decode step among them, one fork to a
 * side stream and its join slow the whole replay by tens of us, even when the
 * branch launches nothing (a bare cross-stream edge costs the same) and
 * however many forks it holds; in graphs of plain elementwise kernels the same
 * fork costs under a microsecond (benchmarks/RESULTS.md, section "Run 5").
 *
 * So, while the stream is capturing, the controller does not fork to its side
 * stream: it puts the prefetch kernel K on the captured stream itself, after
 * X as any captured kernel would be, and gives the node after it a
 * programmatic "launch order" edge from K, which lets a node start once all
 * blocks of its upstream kernel have *begun*, not finished:
 *
 *      before:  X ---------------------> Y          (X: the last captured node)
 *      after:   X --programmatic--> K               (see below)
 *               X ---------------------> Y          (X's own edge, unchanged)
 *               K --launch order-------> Y
 *
 * K loads when X is done, as the eager fork's event makes it ("a prefetch
 * starts only after the work it overlaps"); Y still waits for X exactly as
 * before and for nothing of K but its launch, so K overlaps Y and what
 * follows.  The graph stays one chain; the replay does not pay for a branch.
 * Nothing waits for K inside the graph; the graph as a whole completes after
 * it, which is the join of the eager path.  Another stream that joins after
 * the fork (an event recorded here and waited on there, as torch does for
 * NCCL) inherits the same two edges: its kernel waits for X and for K's
 * launch only (tests/test_capture_edges_gpu.py checks it).
 *
 * K's edges from X's kernel nodes are programmatic, from X's launch-order port,
 * and the loader's first instruction is griddepcontrol.wait: K launches once
 * all of X's blocks have begun and its loads start when X is done, so K's
 * launch is off the main path and Y starts when X is done, as without a fork.
 * An empty inline fork cost 0.6-1.0 us with an ordinary edge from X and
 * 0.17-0.43 us with a programmatic one, after a cuBLAS GEMV (which triggers
 * its dependents early) in HF Llama- and Qwen3-shaped graphs (benchmarks/
 * RESULTS.md, run 15).  After a kernel that does not trigger (torch's
 * elementwise add, a spin) the trigger port fires only at X's end, and K's
 * launch was on the main path: the launch-order port took such a fork from
 * 1.1-1.4 to 0.7-0.9 us, and left it unchanged after a GEMV (run 21).  Without the wait K's
 * loads would compete with X for HBM, which made a GEMV X slower (run 7).  X's
 * other nodes (a memcpy, an event wait) keep their ordinary edges, and so does
 * every edge on a device before compute capability 9.0 (no programmatic launch;
 * the loader there has no griddepcontrol.wait).  Two inline forks back to back:
 * K2 gets K1's launch-order edge, and its wait also waits for K1, so their loads
 * run one after the other.  If the launch fails the stream gets X's own edges
 * back; if that too fails, the error says the capture is unusable (X's
 * programmatic edge would let the next kernel start before X is done).  Driver
 * 12.3 or newer (edge data); older drivers and
 * PrefetchController(graph_fork="branch") use the side stream.
 *
 * NOTE [leaf graph fork]: an inline K overlaps Y only.  The graph executor
 * puts K and Y on one hardware stream (the launch-order edge is a programmatic
 * dependency, which lives within a stream), and work on a stream completes in
 * order: Y's completion is held until K's, so the node after Y waits for all
 * of K (a CUPTI timeline of an HF Llama graph shows Y "running" until K ends,
 * the window after it starting only then: benchmarks/RESULTS.md, run 12).  So
 * graph_fork="leaf": K depends on X by X's own edge and nothing depends on it;
 * the stream's dependencies are set back to X's.  The executor then runs K on
 * another stream beside the whole window, and the graph completes after it.
 * Each leaf also depends on the previous leaf of the same capture, so that the
 * loaders form one side chain (one extra stream, not one per fork: seven
 * streams cost about 4 us more per step than two at batch 8, run 12).
 */
#include "l2p.h"

int l2p_capture_inline_available(const l2p_driver *d)
{
    return d->fn.cuStreamGetCaptureInfo && d->fn.cuStreamUpdateCaptureDependencies;
}

#define SMALL 8

/* The capture dependencies of s, copied (the driver's arrays live only until
 * the next call on s).  *nodes and *edges point at the small arrays or at
 * PyMem memory the caller frees with free_deps. */
typedef struct {
    size_t n;
    CUgraphNode *nodes;
    CUgraphEdgeData *edges;
    CUgraphNode small_nodes[SMALL];
    CUgraphEdgeData small_edges[SMALL];
} deps;

static void free_deps(deps *x)
{
    if (x->nodes != x->small_nodes)
        PyMem_Free(x->nodes);
    if (x->edges != x->small_edges)
        PyMem_Free(x->edges);
    x->nodes = x->small_nodes;
    x->edges = x->small_edges;
    x->n = 0;
}

/* Room for n (+ extra) entries. */
static CUresult reserve(deps *x, size_t n)
{
    x->nodes = x->small_nodes;
    x->edges = x->small_edges;
    if (n <= SMALL)
        return CUDA_SUCCESS;
    x->nodes = PyMem_Calloc(n, sizeof(CUgraphNode));
    x->edges = PyMem_Calloc(n, sizeof(CUgraphEdgeData));
    if (!x->nodes || !x->edges) {
        PyMem_Free(x->nodes);
        PyMem_Free(x->edges);
        x->nodes = x->small_nodes;
        x->edges = x->small_edges;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

static CUresult get_deps(l2p_driver *d, CUstream s, deps *x, size_t extra)
{
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    const CUgraphNode *nodes = NULL;
    const CUgraphEdgeData *edges = NULL;
    size_t n = 0;
    CUresult r = d->fn.cuStreamGetCaptureInfo(s, &status, NULL, NULL, &nodes, &edges, &n);
    if (r != CUDA_SUCCESS)
        return r;
    if (status != CU_STREAM_CAPTURE_STATUS_ACTIVE)
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    r = reserve(x, n + extra);
    if (r != CUDA_SUCCESS)
        return r;
    x->n = n;
    for (size_t i = 0; i < n; i++) {
        x->nodes[i] = nodes[i];
        if (edges)
            x->edges[i] = edges[i];
        else
            memset(&x->edges[i], 0, sizeof(CUgraphEdgeData));
    }
    return CUDA_SUCCESS;
}

/* Once all of X's blocks have begun; a downstream kernel's griddepcontrol.wait
 * still waits for X's completion (a programmatic dependency of either port). */
static CUgraphEdgeData launch_order(void)
{
    CUgraphEdgeData e;
    memset(&e, 0, sizeof e);
    e.from_port = CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER;
    e.to_port = 0;
    e.type = CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC;
    return e;
}

/* Programmatic edges join kernel nodes only. */
static int is_kernel(const l2p_driver *d, CUgraphNode node)
{
    int type = -1;
    return d->fn.cuGraphNodeGetType && d->fn.cuGraphNodeGetType(node, &type) == CUDA_SUCCESS &&
           type == CU_GRAPH_NODE_TYPE_KERNEL;
}

CUresult l2p_capture_inline_launch(l2p_driver *d, CUstream s, PyObject *prepared,
                                   const l2p_range *extra, int order_edge, int early, CUgraphNode chain,
                                   CUgraphNode *node, const char **failed)
{
    deps before = {0}, after = {0}, next = {0};
    before.nodes = after.nodes = next.nodes = NULL;
    int reedged = 0;
    CUresult r;

    /* X's edges, to give back to the stream after K. */
    *failed = "cuStreamGetCaptureInfo";
    if ((r = get_deps(d, s, &before, 0)) != CUDA_SUCCESS)
        goto out;
    /* K after X (and after chain, the previous leaf, when given). */
    if (chain) {
        CUgraphEdgeData e;
        memset(&e, 0, sizeof e);
        *failed = "cuStreamUpdateCaptureDependencies";
        if ((r = d->fn.cuStreamUpdateCaptureDependencies(s, &chain, &e, 1,
                                                         CU_STREAM_ADD_CAPTURE_DEPENDENCIES))
            != CUDA_SUCCESS)
            goto out;
    }
    /* 'inline' (never chained): K's edges from X's kernel nodes programmatic, from the
     * launch-order port (NOTE [inline graph fork]): K launches once X's blocks have
     * begun and waits for X's end in griddepcontrol.wait. */
    if (early && order_edge && !chain && before.n) {
        if ((r = reserve(&next, before.n)) != CUDA_SUCCESS)
            goto out;
        next.n = before.n;
        for (size_t i = 0; i < before.n; i++) {
            next.nodes[i] = before.nodes[i];
            next.edges[i] = before.edges[i];
            if (before.edges[i].type == CU_GRAPH_DEPENDENCY_TYPE_DEFAULT &&
                before.edges[i].from_port == CU_GRAPH_KERNEL_NODE_PORT_DEFAULT &&
                is_kernel(d, before.nodes[i])) {
                next.edges[i] = launch_order();
                reedged = 1;
            }
        }
        *failed = "cuStreamUpdateCaptureDependencies";
        if (reedged &&
            (r = d->fn.cuStreamUpdateCaptureDependencies(s, next.nodes, next.edges, next.n,
                                                         CU_STREAM_SET_CAPTURE_DEPENDENCIES))
            != CUDA_SUCCESS)
            goto out;
        free_deps(&next);
        next.nodes = NULL;
    }
    /* A captured launch (on failure nothing was captured, and the stream gets X's
     * own edges back: a programmatic edge left there would let the next captured
     * kernel start before X is done, and a chained leaf's edge would make it wait for
     * the previous loader). */
    *failed = "cuLaunchKernelEx";
    if ((r = l2p_prepared_launch_raw(prepared, s, extra)) != CUDA_SUCCESS) {
        if ((reedged || chain) &&
            d->fn.cuStreamUpdateCaptureDependencies(s, before.nodes, before.edges, before.n,
                                                    CU_STREAM_SET_CAPTURE_DEPENDENCIES)
            != CUDA_SUCCESS)
            *failed = "cuLaunchKernelEx (and restoring the captured stream's dependencies "
                      "failed: this capture is unusable, end it and discard the graph)";
        goto out;
    }
    /* The stream now depends on K alone; make it X's edges plus K's launch
     * ('inline'), or X's edges alone ('leaf': K is a sink of the graph). */
    *failed = "cuStreamGetCaptureInfo";
    if ((r = get_deps(d, s, &after, 0)) != CUDA_SUCCESS)
        goto out;
    if (node)
        *node = after.n == 1 ? after.nodes[0] : NULL;
    if (!order_edge)
        after.n = 0;
    if ((r = reserve(&next, before.n + after.n)) != CUDA_SUCCESS)
        goto out;
    next.n = before.n + after.n;
    for (size_t i = 0; i < before.n; i++) {
        next.nodes[i] = before.nodes[i];
        next.edges[i] = before.edges[i];
    }
    for (size_t i = 0; i < after.n; i++) {
        next.nodes[before.n + i] = after.nodes[i];
        next.edges[before.n + i] = launch_order();
    }
    *failed = "cuStreamUpdateCaptureDependencies";
    r = d->fn.cuStreamUpdateCaptureDependencies(s, next.n ? next.nodes : NULL,
                                                next.n ? next.edges : NULL, next.n,
                                                CU_STREAM_SET_CAPTURE_DEPENDENCIES);
    /* On failure (here or at the get_deps above) the stream depends on K alone, by
     * an ordinary edge; K's edge from X may be programmatic, and then the next node
     * is after X because every thread of K waits for X (griddepcontrol.wait, sm_90+:
     * early is set only there) before K can end.  Correct, serial. */
out:
    if (before.nodes)
        free_deps(&before);
    if (after.nodes)
        free_deps(&after);
    if (next.nodes)
        free_deps(&next);
    if (r == CUDA_SUCCESS)
        *failed = NULL;
    return r;
}
