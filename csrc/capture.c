/*
 * capture.c: how a fork goes into a CUDA graph being captured.
 *
 * NOTE [inline graph fork]: a side branch in a replayed graph can cost far
 * more than its own nodes.  Measured on the H200 (benchmarks/RESULTS.md,
 * "Run 5"): in a graph of cuBLAS GEMVs, or in Hugging Face DeepSeek-V3's
 * decode step (727 kernels, 30 of their edges programmatic), one fork to a
 * side stream and its join slow the whole replay by 35-60 us, even when the
 * side branch launches nothing (a bare cross-stream edge costs the same) and
 * whether it has one fork or ten.  In graphs of plain elementwise kernels the
 * same fork costs ~0.5 us.
 *
 * So, while the stream is capturing, the controller does not fork to its side
 * stream: it puts the prefetch kernel K on the captured stream itself and
 * gives it programmatic "launch order" edges, which let a node start once
 * all blocks of its upstream kernel have *begun*, not finished:
 *
 *      before:  X ---------------------> Y          (X: the last captured node)
 *      after:   X --launch order--> K
 *               X ---------------------> Y          (X's own edge, unchanged)
 *               K --launch order-------> Y
 *
 * K starts as soon as X is running (it only reads weights, so it needs
 * nothing X writes); Y still waits for X exactly as before and for nothing of
 * K but its launch, so K overlaps Y and what follows.  The graph stays one
 * chain of launch-ordered kernels; the replay no longer pays the branch.  An
 * upstream that is not a kernel node (a memcpy, say) keeps an ordinary edge
 * to K (only kernel nodes have a launch-order port).  Nothing waits for K
 * inside the graph; the graph as a whole completes after it, which is the
 * join of the eager path.  Driver 12.3 or newer (edge data); older drivers
 * and PrefetchController(graph_fork="branch") use the side stream.
 */
#include "l2p.h"

int l2p_capture_inline_available(const l2p_driver *d)
{
    return d->fn.cuStreamGetCaptureInfo && d->fn.cuStreamUpdateCaptureDependencies &&
           d->fn.cuGraphNodeGetType;
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

static CUgraphEdgeData launch_order(void)
{
    CUgraphEdgeData e;
    memset(&e, 0, sizeof e);
    e.from_port = CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER;
    e.to_port = 0;
    e.type = CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC;
    return e;
}

CUresult l2p_capture_inline_launch(l2p_driver *d, CUstream s, PyObject *prepared,
                                   const char **failed)
{
    deps before = {0}, upstream = {0}, after = {0};
    before.nodes = upstream.nodes = after.nodes = NULL;
    CUresult r;

    *failed = "cuStreamGetCaptureInfo";
    if ((r = get_deps(d, s, &before, 0)) != CUDA_SUCCESS)
        goto out;
    /* K's own dependencies: X's launch for kernels, X's edge otherwise. */
    if ((r = reserve(&upstream, before.n)) != CUDA_SUCCESS)
        goto out;
    upstream.n = before.n;
    for (size_t i = 0; i < before.n; i++) {
        int type = -1;
        upstream.nodes[i] = before.nodes[i];
        upstream.edges[i] = before.edges[i];
        *failed = "cuGraphNodeGetType";
        if ((r = d->fn.cuGraphNodeGetType(before.nodes[i], &type)) != CUDA_SUCCESS)
            goto out;
        if (type == CU_GRAPH_NODE_TYPE_KERNEL && before.edges[i].type == 0 &&
            before.edges[i].from_port == 0)
            upstream.edges[i] = launch_order();
    }
    *failed = "cuStreamUpdateCaptureDependencies";
    if ((r = d->fn.cuStreamUpdateCaptureDependencies(s, upstream.nodes, upstream.edges,
                                                     upstream.n,
                                                     CU_STREAM_SET_CAPTURE_DEPENDENCIES)) !=
        CUDA_SUCCESS)
        goto out;
    *failed = "cuLaunchKernelEx";
    r = l2p_prepared_launch_raw(prepared, s);
    if (r != CUDA_SUCCESS) {
        /* Nothing was captured: put the stream's dependencies back as they were. */
        (void)d->fn.cuStreamUpdateCaptureDependencies(s, before.nodes, before.edges, before.n,
                                                      CU_STREAM_SET_CAPTURE_DEPENDENCIES);
        goto out;
    }
    /* The stream now depends on K alone; make it X's edges plus K's launch. */
    *failed = "cuStreamGetCaptureInfo";
    if ((r = get_deps(d, s, &after, 0)) != CUDA_SUCCESS)
        goto out;
    deps next = {0};
    next.nodes = NULL;
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
    r = d->fn.cuStreamUpdateCaptureDependencies(s, next.nodes, next.edges, next.n,
                                                CU_STREAM_SET_CAPTURE_DEPENDENCIES);
    free_deps(&next);
    /* On failure the stream depends on K with an ordinary edge: correct, serial. */
out:
    if (before.nodes)
        free_deps(&before);
    if (upstream.nodes)
        free_deps(&upstream);
    if (after.nodes)
        free_deps(&after);
    if (r == CUDA_SUCCESS)
        *failed = NULL;
    return r;
}
