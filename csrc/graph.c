/*
 * graph.c: the loader nodes of a captured CUDA graph, found and switched in place.
 *
 * Identical captures of one step replay up to a few percent apart, stably
 * (benchmarks/RESULTS.md, run 12), so the tuner compares a prefetch with its
 * controls inside one graph instance: it captures the step once with its loads
 * and, between blocks of replays, switches every loader node of the executable
 * graph to one of three states and back:
 *
 *   on     the captured parameters (the loads), node enabled;
 *   empty  the same kernel with a table of no ranges (count 0): the empty-fork
 *          control, cuGraphExecKernelNodeSetParams;
 *   off    the node disabled (cuGraphNodeSetEnabled): an empty node, its edges kept.
 *
 * And it replays the step without any fork at the same addresses: a clone of
 * the template graph with the loader nodes destroyed, instantiated on its own
 * (_graph_instantiate_without).  Two captures of one step, even into one memory
 * pool, place its buffers apart and replay a few us apart, stably (run 18), so
 * (a), the step without forks, is this graph rather than a capture of its own.
 * Whether destroying the nodes keeps every other ordering of the graph is the
 * caller's check (l2prefetch.tuning.rig.NoForks, from _graph_edges).  The clone is
 * instantiated with no flags: torch's own graphs also use AutoFreeOnLaunch (no
 * allocation nodes here) and UseNodePriority (nodes captured at the replay stream's
 * priority); run 18 measured it replaying like a capture without forks.  The exec
 * comes back as a GraphExec (graphexec.c), which holds this driver instance and is
 * launched and destroyed through it, whatever driver the module uses by then.
 *
 * The entry points are private calls for the tuner's rig and the tests; their
 * arguments are exact ints (raw handles), exact tuples of them, a str or a tuple of
 * our tables: nothing they read runs Python code.  Each holds the driver for the
 * call (graph_driver): its result's and its exceptions' allocations can run the GC.
 *
 * A loader node is a kernel node of the template graph whose function is one of
 * the prefetch kernels this driver instance loaded (l2p_device.functions),
 * matched by handle, never by name.  The template graph must outlive the
 * executable graph's switching (torch: CUDAGraph(keep_graph=True)); both come
 * in as raw handles from the Python layer (l2prefetch.tuning.rig), which holds them.
 */
#include "l2p.h"

/* The function of node if it launches one of our kernels: its device and capacity. */
static int match(l2p_driver *d, CUfunction f, int *device, int *cap)
{
    for (int i = 0; i < d->device_count; i++) {
        l2p_device *dev = &d->devices[i];
        if (!dev->ready)
            continue;
        for (int v = 0; v < L2P_MAX_VARIANTS; v++)
            for (int c = 0; c < L2P_NUM_CAPACITIES; c++)
                if (dev->functions[v][c] && dev->functions[v][c] == f) {
                    *device = i;
                    *cap = c;
                    return 1;
                }
    }
    return 0;
}

/* What each kind of call needs of the driver, and the version that has it all. */
enum { SWITCH_API, DERIVE_API };
static const struct {
    const char *what, *version, *calls;
} apis[] = {
    [SWITCH_API] = {"switching loader nodes in place", "12.0",
                    "cuGraphNodeSetEnabled, cuGraphExecKernelNodeSetParams"},
    [DERIVE_API] = {"a graph without its loader nodes", "12.3",
                    "cuGraphGetEdges with edge data, cuGraphClone"},
};

static int has_api(const l2p_driver *d, int api)
{
    if (api == SWITCH_API)
        return d->fn.cuGraphGetNodes && d->fn.cuGraphKernelNodeGetParams &&
               d->fn.cuGraphNodeSetEnabled && d->fn.cuGraphExecKernelNodeSetParams &&
               d->fn.cuGraphNodeGetType;
    /* GraphExec (graphexec.c) calls cuGraphLaunch and cuGraphExecDestroy unchecked */
    return d->fn.cuGraphGetEdges && d->fn.cuGraphClone && d->fn.cuGraphNodeFindInClone &&
           d->fn.cuGraphDestroyNode && d->fn.cuGraphDestroy && d->fn.cuGraphInstantiateWithFlags &&
           d->fn.cuGraphLaunch && d->fn.cuGraphExecDestroy;
}

/* The module's driver if it has what api needs, held: the caller drops it
 * (l2p_driver_decref) when done.  Held because the allocations of a result or of
 * an exception can run the GC, whose finalizers could swap the module's driver. */
static l2p_driver *graph_driver(l2p_state *st, int api)
{
    l2p_driver *d = l2p_use_driver(st);
    if (!d)
        return NULL;
    if (!has_api(d, api)) {
        PyErr_Format(st->error, "%s needs driver %s or newer (%s); this one is %d.%d",
                     apis[api].what, apis[api].version, apis[api].calls, d->version / 1000,
                     d->version % 1000 / 10);
        return NULL;
    }
    l2p_driver_incref(d);
    return d;
}

/* An exact int, not 0: a raw handle (no Python code runs on an exact int). */
static int handle_arg(PyObject *o, const char *what, uintptr_t *out)
{
    if (!PyLong_CheckExact(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int handle, not %s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (PyErr_Occurred() || v == 0) {
        PyErr_Clear();
        return l2p_raise_shown(PyExc_ValueError, o, "%s must be a non-null handle, got ", what), -1;
    }
    *out = (uintptr_t)v;
    return 0;
}

/* nodes, an exact tuple of node handles (`expected` says which), as a new array of
 * *n handles (PyMem_Free it), or NULL with TypeError/ValueError/MemoryError. */
static CUgraphNode *node_args(PyObject *nodes, const char *expected, Py_ssize_t *n)
{
    if (!PyTuple_CheckExact(nodes)) {
        PyErr_Format(PyExc_TypeError, "nodes must be %s, not %s", expected, Py_TYPE(nodes)->tp_name);
        return NULL;
    }
    *n = PyTuple_GET_SIZE(nodes);
    CUgraphNode *out = PyMem_Calloc(*n ? (size_t)*n : 1, sizeof *out);
    if (!out) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        uintptr_t h;
        if (handle_arg(PyTuple_GET_ITEM(nodes, i), "each node", &h) < 0) {
            PyMem_Free(out);
            return NULL;
        }
        out[i] = (CUgraphNode)h;
    }
    return out;
}

/* ((a, b), ...) of the n pairs a, b laid out one after the other in flat. */
static PyObject *pairs(const uint64_t *flat, size_t n)
{
    PyObject *out = PyTuple_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        const uint64_t *p = flat + 2 * i;
        PyObject *pair = Py_BuildValue("(KK)", (unsigned long long)p[0], (unsigned long long)p[1]);
        if (!pair) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, (Py_ssize_t)i, pair);
    }
    return out;
}

/* ((ptr, nbytes), ...) of the table in a loader node's parameters. */
static PyObject *node_ranges(const CUDA_KERNEL_NODE_PARAMS *p, int cap)
{
    const uint64_t *block = p->kernelParams ? (const uint64_t *)p->kernelParams[0] : NULL;
    uint64_t count = block ? block[0] : 0;
    if (count > l2p_capacities[cap])
        count = l2p_capacities[cap];
    return pairs(block ? block + 2 : NULL, (size_t)count);   /* L2pRange: ptr, nbytes */
}

/* The signatures of the entry points (positional only). */
static const char *const graph_params[] = {"graph", NULL};
static const l2p_signature loader_nodes_sig = {
    .name = "_graph_loader_nodes", .params = graph_params, .posonly = 1, .maxpos = 1,
    .required = 1};
static const l2p_signature set_loaders_sig = {
    .name = "_graph_set_loaders",
    .params = (const char *const[]){"exec", "nodes", "state", "extras", NULL},
    .posonly = 4, .maxpos = 4, .required = 3};
static const l2p_signature edges_sig = {
    .name = "_graph_edges", .params = graph_params, .posonly = 1, .maxpos = 1, .required = 1};
static const l2p_signature instantiate_without_sig = {
    .name = "_graph_instantiate_without", .params = (const char *const[]){"graph", "nodes", NULL},
    .posonly = 2, .maxpos = 2, .required = 2};

/* The arguments of a call by sig into vals: the first, a handle named by sig's first
 * parameter, into *h; with nodes_are, the second, a tuple of node handles (nodes_are
 * says which), into *nodes (n of them; PyMem_Free it).  -1 with the exception. */
static int call_args(const l2p_signature *sig, PyObject *const *args, Py_ssize_t nargs,
                     PyObject **vals, uintptr_t *h, const char *nodes_are, CUgraphNode **nodes,
                     Py_ssize_t *n)
{
    if (l2p_parse_args(sig, args, nargs, NULL, vals) < 0 || handle_arg(vals[0], sig->params[0], h) < 0)
        return -1;
    return nodes_are && !(*nodes = node_args(vals[1], nodes_are, n)) ? -1 : 0;
}

/* A call whose one argument is the template graph: query(st, d, graph) with the
 * module's driver if it has what api needs, held for the query (graph_driver). */
static PyObject *graph_query(PyObject *module, const l2p_signature *sig, PyObject *const *args,
                             Py_ssize_t nargs, int api,
                             PyObject *(*query)(l2p_state *, l2p_driver *, CUgraph))
{
    l2p_state *st = l2p_get_state(module);
    PyObject *graph = NULL;
    uintptr_t g;
    if (call_args(sig, args, nargs, &graph, &g, NULL, NULL, NULL) < 0)
        return NULL;
    l2p_driver *d = graph_driver(st, api);
    PyObject *out = d ? query(st, d, (CUgraph)g) : NULL;
    l2p_driver_decref(d);
    return out;
}

/* ((node, ranges), ...): our kernel nodes in template graph g, in the graph's order,
 * each with the ranges it was captured with. */
static PyObject *loader_nodes(l2p_state *st, l2p_driver *d, CUgraph g)
{
    size_t n = 0;
    PyObject *out = NULL, *list = NULL;
    CUgraphNode *nodes = NULL;
    CUresult r = d->fn.cuGraphGetNodes(g, NULL, &n);
    if (r != CUDA_SUCCESS) {
        l2p_raise_cuda(st, d, "cuGraphGetNodes", r);
        goto done;
    }
    if (!(nodes = PyMem_Calloc(n ? n : 1, sizeof(CUgraphNode)))) {
        PyErr_NoMemory();
        goto done;
    }
    if ((r = d->fn.cuGraphGetNodes(g, nodes, &n)) != CUDA_SUCCESS) {
        l2p_raise_cuda(st, d, "cuGraphGetNodes", r);
        goto done;
    }
    if (!(list = PyList_New(0)))
        goto done;
    for (size_t i = 0; i < n; i++) {
        int type = -1, device, cap;
        if ((r = d->fn.cuGraphNodeGetType(nodes[i], &type)) != CUDA_SUCCESS) {
            l2p_raise_cuda(st, d, "cuGraphNodeGetType", r);
            goto done;
        }
        if (type != CU_GRAPH_NODE_TYPE_KERNEL)
            continue;
        CUDA_KERNEL_NODE_PARAMS p;
        memset(&p, 0, sizeof p);
        if ((r = d->fn.cuGraphKernelNodeGetParams(nodes[i], &p)) != CUDA_SUCCESS) {
            l2p_raise_cuda(st, d, "cuGraphKernelNodeGetParams", r);
            goto done;
        }
        if (!match(d, p.func, &device, &cap))
            continue;
        PyObject *ranges = node_ranges(&p, cap);
        PyObject *h = ranges ? Py_BuildValue("(KN)", (unsigned long long)(uintptr_t)nodes[i],
                                             ranges) : NULL;
        if (!h || PyList_Append(list, h) < 0) {
            Py_XDECREF(h);
            goto done;
        }
        Py_DECREF(h);
    }
    out = PyList_AsTuple(list);
done:
    Py_XDECREF(list);
    PyMem_Free(nodes);
    return out;
}

/* _C._graph_loader_nodes(graph) -> ((node, ranges), ...) */
PyObject *l2p_py_graph_loader_nodes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return graph_query(module, &loader_nodes_sig, args, nargs, SWITCH_API, loader_nodes);
}

/* The kernel's parameter block with no ranges, one per capacity (only count and
 * granules are read by a kernel whose count is 0; the rest stays zero). */
static uint64_t empty_block[2 + 2 * 128];

enum { STATE_OFF, STATE_ON, STATE_EMPTY, STATE_TABLES };

/* The state argument of _graph_set_loaders: STATE_* (*tables set for
 * STATE_TABLES), or -1 with TypeError/ValueError. */
static int state_arg(l2p_state *st, PyObject *state, Py_ssize_t nodes, PyObject **tables)
{
    static const char *const names[] = {[STATE_OFF] = "off", [STATE_ON] = "on",
                                        [STATE_EMPTY] = "empty"};
    if (PyUnicode_Check(state)) {   /* compared as text: no Python code */
        for (int i = 0; i < 3; i++)
            if (PyUnicode_CompareWithASCIIString(state, names[i]) == 0)
                return i;
    } else if (PyTuple_CheckExact(state)) {
        if (PyTuple_GET_SIZE(state) != nodes) {
            PyErr_Format(PyExc_ValueError, "state: %zd tables for %zd nodes (one per node)",
                         PyTuple_GET_SIZE(state), nodes);
            return -1;
        }
        for (Py_ssize_t i = 0; i < nodes; i++)
            if (!l2p_prepared_check(st, PyTuple_GET_ITEM(state, i))) {
                PyErr_Format(PyExc_TypeError, "state[%zd] must be a PreparedWeightRanges, not %s",
                             i, Py_TYPE(PyTuple_GET_ITEM(state, i))->tp_name);
                return -1;
            }
        *tables = state;
        return STATE_TABLES;
    }
    PyErr_Format(PyExc_ValueError, "state must be 'on', 'empty', 'off' or a tuple of "
                 "PreparedWeightRanges, not %R", state);
    return -1;
}

/* The extras argument of _graph_set_loaders: None, or an exact tuple of one item per
 * node, each None or an exact tuple of two exact ints (ptr 16-byte aligned, nbytes at
 * least 16), into out (n entries) and has (0/1 each); -1 with TypeError/ValueError. */
static int extras_arg(PyObject *extras, Py_ssize_t n, l2p_range *out, char *has)
{
    memset(has, 0, (size_t)n);
    if (extras == Py_None)
        return 0;
    if (!PyTuple_CheckExact(extras) || PyTuple_GET_SIZE(extras) != n) {
        PyErr_Format(PyExc_TypeError, "extras must be None or a tuple of %zd items (one per "
                     "node), not %R", n, extras);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyTuple_GET_ITEM(extras, i);
        if (e == Py_None)
            continue;
        unsigned long long ptr = 0, nbytes = 0;
        if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 2 ||
            !PyLong_CheckExact(PyTuple_GET_ITEM(e, 0)) || !PyLong_CheckExact(PyTuple_GET_ITEM(e, 1)) ||
            ((ptr = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(e, 0))) == (unsigned long long)-1 &&
             PyErr_Occurred()) ||
            ((nbytes = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(e, 1))) == (unsigned long long)-1 &&
             PyErr_Occurred()) ||
            ptr % 16 || nbytes < 16) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "extras[%zd] must be None or (ptr, nbytes), ptr "
                         "16-byte aligned and nbytes at least 16 (a range a node was captured "
                         "with), not %R", i, e);
            return -1;
        }
        out[i].ptr = ptr;
        out[i].nbytes = nbytes;
        has[i] = 1;
    }
    return 0;
}

/* Switches node i of exec (a loader node of d) to state; tables[i] for STATE_TABLES,
 * with extra (or NULL) appended where that table warms. */
static int set_loader(l2p_state *st, l2p_driver *d, CUgraphExec exec, CUgraphNode node,
                      Py_ssize_t i, int state, PyObject *tables, const l2p_range *extra)
{
    CUresult r;
    if (state == STATE_OFF) {
        if ((r = d->fn.cuGraphNodeSetEnabled(exec, node, 0)) != CUDA_SUCCESS)
            return l2p_raise_cuda_int(st, d, "cuGraphNodeSetEnabled", r);
        return 0;
    }
    CUDA_KERNEL_NODE_PARAMS p;
    int device, cap;
    memset(&p, 0, sizeof p);
    if ((r = d->fn.cuGraphKernelNodeGetParams(node, &p)) != CUDA_SUCCESS)
        return l2p_raise_cuda_int(st, d, "cuGraphKernelNodeGetParams", r);
    if (!match(d, p.func, &device, &cap)) {
        PyErr_Format(PyExc_ValueError, "node %zd is not a loader node of this driver "
                     "(pass what _graph_loader_nodes() returned)", i);
        return -1;
    }
    void *empty_params[1] = {empty_block}, *slot[1];
    uint64_t buf[L2P_TABLE_WORDS];
    if (state == STATE_EMPTY) {
        p.kernelParams = empty_params;
        p.extra = NULL;
    } else if (state == STATE_TABLES) {
        PyObject *t = PyTuple_GET_ITEM(tables, i);
        if (!l2p_prepared_alive(t)) {   /* as fork: a cleared table's weights may be gone */
            PyErr_Format(st->error, "state[%zd] was cleared by the garbage collector (its "
                         "weights dropped): prepare a new table", i);
            return -1;
        }
        if (l2p_prepared_device(t) != device || l2p_prepared_driver(t) != d) {
            PyErr_Format(PyExc_ValueError, "state[%zd] is a table of cuda:%d; node %zd runs on "
                         "cuda:%d", i, l2p_prepared_device(t), i, device);
            return -1;
        }
        l2p_prepared_node_params(t, &p, extra, buf, slot);
    }
    if ((r = d->fn.cuGraphExecKernelNodeSetParams(exec, node, &p)) != CUDA_SUCCESS)
        return l2p_raise_cuda_int(st, d, "cuGraphExecKernelNodeSetParams", r);
    if ((r = d->fn.cuGraphNodeSetEnabled(exec, node, 1)) != CUDA_SUCCESS)
        return l2p_raise_cuda_int(st, d, "cuGraphNodeSetEnabled", r);
    return 0;
}

/* _C._graph_set_loaders(exec, nodes, state, extras=None): state 'on', 'empty' or 'off'
 * (above), or a tuple of PreparedWeightRanges, one per node: each node launches that
 * table (its kernel, grid and ranges; the node's priority and carveout stay as
 * captured), and where the table warms, extras[i]: the activation range node i was
 * captured with (tuning.rig.LoaderSwitch reads it from the node).  exec is a raw handle
 * of an executable graph its owner keeps (torch's CUDAGraph). */
PyObject *l2p_py_graph_set_loaders(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    l2p_state *st = l2p_get_state(module);
    PyObject *vals[4] = {NULL, NULL, NULL, Py_None}, *tables = NULL;
    uintptr_t exec;
    CUgraphNode *nodes;
    Py_ssize_t n;
    /* exact ints, an exact tuple, a str or a tuple of our tables: nothing read runs
     * Python code before the driver calls */
    if (call_args(&set_loaders_sig, args, nargs, vals, &exec,
                  "the tuple _graph_loader_nodes() returned", &nodes, &n) < 0)
        return NULL;
    int state = state_arg(st, vals[2], n, &tables);
    l2p_range *extras = PyMem_Calloc((size_t)n + 1, sizeof *extras);
    char *has = PyMem_Calloc((size_t)n + 1, 1);
    if (!extras || !has) {
        PyErr_NoMemory();
        state = -1;
    } else if (state >= 0 && extras_arg(vals[3], n, extras, has) < 0) {
        state = -1;
    }
    l2p_driver *d = state < 0 ? NULL : graph_driver(st, SWITCH_API);
    int rc = d ? 0 : -1;
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++)
        rc = set_loader(st, d, (CUgraphExec)exec, nodes[i], i, state, tables,
                        has[i] ? &extras[i] : NULL);
    PyMem_Free(extras);
    PyMem_Free(has);
    PyMem_Free(nodes);
    l2p_driver_decref(d);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ((from, to), ...): every edge of template graph g, as node handles (what
 * loader_nodes() gives for its loader nodes). */
static PyObject *edges(l2p_state *st, l2p_driver *d, CUgraph g)
{
    size_t n = 0;
    PyObject *out = NULL;
    CUgraphNode *from = NULL, *to = NULL;
    CUgraphEdgeData *data = NULL;   /* asked for: without it a programmatic edge is a lossy query */
    uint64_t *flat = NULL;
    CUresult r = d->fn.cuGraphGetEdges(g, NULL, NULL, NULL, &n);
    if (r != CUDA_SUCCESS) {
        l2p_raise_cuda(st, d, "cuGraphGetEdges", r);
        goto done;
    }
    from = PyMem_Calloc(n ? n : 1, sizeof(CUgraphNode));
    to = PyMem_Calloc(n ? n : 1, sizeof(CUgraphNode));
    data = PyMem_Calloc(n ? n : 1, sizeof(CUgraphEdgeData));
    flat = PyMem_Calloc(n ? 2 * n : 1, sizeof(uint64_t));
    if (!from || !to || !data || !flat) {
        PyErr_NoMemory();
        goto done;
    }
    size_t got = n;
    if ((r = d->fn.cuGraphGetEdges(g, from, to, data, &got)) != CUDA_SUCCESS) {
        l2p_raise_cuda(st, d, "cuGraphGetEdges", r);
        goto done;
    }
    if (got > n)   /* the graph grew between the calls: only n were written */
        got = n;
    for (size_t i = 0; i < got; i++) {
        flat[2 * i] = (uint64_t)(uintptr_t)from[i];
        flat[2 * i + 1] = (uint64_t)(uintptr_t)to[i];
    }
    out = pairs(flat, got);
done:
    PyMem_Free(from);
    PyMem_Free(to);
    PyMem_Free(data);
    PyMem_Free(flat);
    return out;
}

/* _C._graph_edges(graph) -> ((from, to), ...) */
PyObject *l2p_py_graph_edges(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return graph_query(module, &edges_sig, args, nargs, DERIVE_API, edges);
}

/* 0 when no node is named twice (it would be destroyed twice in the clone), else
 * -1 with ValueError. */
static int distinct(const CUgraphNode *nodes, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        for (Py_ssize_t j = 0; j < i; j++)
            if (nodes[j] == nodes[i]) {
                PyErr_Format(PyExc_ValueError, "nodes[%zd] repeats nodes[%zd]; name each node "
                             "once", i, j);
                return -1;
            }
    return 0;
}

/* The clone of g without nodes, instantiated; the clone destroyed.  CUDA_SUCCESS
 * with *exec, else the failed call in *failed and nothing left behind. */
static CUresult instantiate_without(l2p_driver *d, CUgraph g, const CUgraphNode *nodes,
                                    Py_ssize_t n, CUgraphExec *exec, const char **failed)
{
    CUgraph clone = NULL;
    *exec = NULL;
    *failed = "cuGraphClone";
    CUresult r = d->fn.cuGraphClone(&clone, g);
    if (r != CUDA_SUCCESS)
        return r;
    for (Py_ssize_t i = 0; i < n && r == CUDA_SUCCESS; i++) {
        CUgraphNode mine = NULL;
        if ((r = d->fn.cuGraphNodeFindInClone(&mine, nodes[i], clone)) != CUDA_SUCCESS)
            *failed = "cuGraphNodeFindInClone";
        else if ((r = d->fn.cuGraphDestroyNode(mine)) != CUDA_SUCCESS)
            *failed = "cuGraphDestroyNode";
    }
    if (r == CUDA_SUCCESS && (r = d->fn.cuGraphInstantiateWithFlags(exec, clone, 0)) != CUDA_SUCCESS)
        *failed = "cuGraphInstantiateWithFlags";
    CUresult destroyed = d->fn.cuGraphDestroy(clone);
    if (r == CUDA_SUCCESS && destroyed != CUDA_SUCCESS) {
        (void)d->fn.cuGraphExecDestroy(*exec);
        *exec = NULL;
        *failed = "cuGraphDestroy";
        r = destroyed;
    }
    return r;
}

/* _C._graph_instantiate_without(graph, nodes) -> GraphExec: the template graph cloned,
 * those of its nodes destroyed in the clone (with their edges), the clone instantiated
 * and destroyed.  The GraphExec (graphexec.c) holds this driver; the caller keeps what
 * its nodes point at (the template's memory pool) alive as long. */
PyObject *l2p_py_graph_instantiate_without(PyObject *module, PyObject *const *args,
                                           Py_ssize_t nargs)
{
    l2p_state *st = l2p_get_state(module);
    PyObject *vals[2] = {NULL, NULL};
    uintptr_t g;
    CUgraphNode *nodes;
    Py_ssize_t n;
    if (call_args(&instantiate_without_sig, args, nargs, vals, &g, "a tuple of node handles",
                  &nodes, &n) < 0)
        return NULL;
    PyObject *out = NULL;
    l2p_driver *d = distinct(nodes, n) < 0 ? NULL : graph_driver(st, DERIVE_API);
    if (d) {
        CUgraphExec exec;
        const char *failed;
        CUresult r = instantiate_without(d, (CUgraph)g, nodes, n, &exec, &failed);
        out = r == CUDA_SUCCESS ? l2p_graph_exec_new(st, d, exec) : l2p_raise_cuda(st, d, failed, r);
        l2p_driver_decref(d);
    }
    PyMem_Free(nodes);
    return out;
}
