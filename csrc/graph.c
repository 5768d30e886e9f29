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
 * comes back as a bare handle, destroyed through the driver in use at that time: a
 * private call for the tuner, which never swaps drivers in between.
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

static int graph_api(l2p_state *st, l2p_driver *d)
{
    if (d->fn.cuGraphGetNodes && d->fn.cuGraphKernelNodeGetParams && d->fn.cuGraphNodeSetEnabled &&
        d->fn.cuGraphExecKernelNodeSetParams && d->fn.cuGraphNodeGetType)
        return 0;
    PyErr_Format(st->error, "switching loader nodes in place needs driver 12.0 or newer "
                 "(cuGraphNodeSetEnabled, cuGraphExecKernelNodeSetParams); this one is %d.%d",
                 d->version / 1000, d->version % 1000 / 10);
    return -1;
}

static int handle_arg(PyObject *o, const char *what, void **out)
{
    if (!PyLong_CheckExact(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int handle, not %s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (PyErr_Occurred() || v == 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a non-null handle, got %R", what, o);
        return -1;
    }
    *out = (void *)(uintptr_t)v;
    return 0;
}

/* ((ptr, nbytes), ...) of the table in a loader node's parameters. */
static PyObject *node_ranges(const CUDA_KERNEL_NODE_PARAMS *p, int cap)
{
    const uint64_t *block = p->kernelParams ? (const uint64_t *)p->kernelParams[0] : NULL;
    uint64_t count = block ? block[0] : 0;
    if (count > l2p_capacities[cap])
        count = l2p_capacities[cap];
    PyObject *out = PyTuple_New((Py_ssize_t)count);
    for (uint64_t i = 0; out && i < count; i++) {
        PyObject *r = Py_BuildValue("(KK)", (unsigned long long)block[2 + 2 * i],
                                    (unsigned long long)block[3 + 2 * i]);
        if (!r) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, (Py_ssize_t)i, r);
    }
    return out;
}

/* _C._graph_loader_nodes(graph) -> ((node, ranges), ...): our kernel nodes in the
 * template graph, in the graph's order, each with the ranges it was captured with. */
PyObject *l2p_py_graph_loader_nodes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    l2p_state *st = l2p_get_state(module);
    void *g;
    if (nargs != 1)
        return PyErr_Format(PyExc_TypeError, "_graph_loader_nodes() takes exactly 1 argument "
                            "(%zd given)", nargs);
    if (handle_arg(args[0], "graph", &g) < 0)
        return NULL;
    l2p_driver *d = l2p_use_driver(st);
    if (!d || graph_api(st, d) < 0)
        return NULL;
    /* The list's allocations can run the GC, whose finalizers could swap the driver. */
    l2p_driver_incref(d);
    size_t n = 0;
    CUresult r = d->fn.cuGraphGetNodes((CUgraph)g, NULL, &n);
    if (r != CUDA_SUCCESS) {
        l2p_raise_cuda(st, d, "cuGraphGetNodes", r);
        l2p_driver_decref(d);
        return NULL;
    }
    CUgraphNode *nodes = PyMem_Calloc(n ? n : 1, sizeof(CUgraphNode));
    if (!nodes) {
        l2p_driver_decref(d);
        return PyErr_NoMemory();
    }
    PyObject *out = NULL, *list = NULL;
    if ((r = d->fn.cuGraphGetNodes((CUgraph)g, nodes, &n)) != CUDA_SUCCESS) {
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
    l2p_driver_decref(d);
    return out;
}

/* The kernel's parameter block with no ranges, one per capacity (only count and
 * granules are read by a kernel whose count is 0; the rest stays zero). */
static uint64_t empty_block[2 + 2 * 128];

/* _C._graph_set_loaders(exec, nodes, state): state 'on', 'empty' or 'off' (above), or a
 * tuple of PreparedWeightRanges, one per node: each node launches that table (its
 * kernel, grid and ranges; the node's priority and carveout stay as captured). */
PyObject *l2p_py_graph_set_loaders(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    l2p_state *st = l2p_get_state(module);
    void *exec;
    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError, "_graph_set_loaders() takes exactly 3 arguments "
                            "(%zd given)", nargs);
    if (handle_arg(args[0], "exec", &exec) < 0)
        return NULL;
    if (!PyTuple_CheckExact(args[1]))
        return PyErr_Format(PyExc_TypeError, "nodes must be the tuple _graph_loader_nodes() "
                            "returned, not %s", Py_TYPE(args[1])->tp_name);
    int state = -1;
    static const char *const names[] = {"off", "on", "empty"};
    PyObject *tables = NULL;
    if (PyUnicode_Check(args[2])) {
        for (int i = 0; i < 3; i++)
            if (PyUnicode_CompareWithASCIIString(args[2], names[i]) == 0)
                state = i;
    } else if (PyTuple_CheckExact(args[2])) {
        tables = args[2];
        state = 3;
        if (PyTuple_GET_SIZE(tables) != PyTuple_GET_SIZE(args[1]))
            return PyErr_Format(PyExc_ValueError, "state: %zd tables for %zd nodes (one per node)",
                                PyTuple_GET_SIZE(tables), PyTuple_GET_SIZE(args[1]));
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tables); i++)
            if (!l2p_prepared_check(st, PyTuple_GET_ITEM(tables, i)))
                return PyErr_Format(PyExc_TypeError, "state[%zd] must be a PreparedWeightRanges, "
                                    "not %s", i, Py_TYPE(PyTuple_GET_ITEM(tables, i))->tp_name);
    }
    if (state < 0)
        return PyErr_Format(PyExc_ValueError, "state must be 'on', 'empty', 'off' or a tuple of "
                            "PreparedWeightRanges, not %R", args[2]);
    l2p_driver *d = l2p_use_driver(st);
    if (!d || graph_api(st, d) < 0)
        return NULL;
    PyObject *nodes = args[1];   /* an exact tuple of exact ints: no Python code below */
    Py_ssize_t n = PyTuple_GET_SIZE(nodes);
    for (Py_ssize_t i = 0; i < n; i++) {
        void *node;
        if (handle_arg(PyTuple_GET_ITEM(nodes, i), "each node", &node) < 0)
            return NULL;
        CUresult r;
        if (state == 0) {
            if ((r = d->fn.cuGraphNodeSetEnabled((CUgraphExec)exec, (CUgraphNode)node, 0)) != CUDA_SUCCESS)
                return l2p_raise_cuda(st, d, "cuGraphNodeSetEnabled", r);
            continue;
        }
        CUDA_KERNEL_NODE_PARAMS p;
        int device, cap;
        memset(&p, 0, sizeof p);
        if ((r = d->fn.cuGraphKernelNodeGetParams((CUgraphNode)node, &p)) != CUDA_SUCCESS)
            return l2p_raise_cuda(st, d, "cuGraphKernelNodeGetParams", r);
        if (!match(d, p.func, &device, &cap))
            return PyErr_Format(PyExc_ValueError, "node %zd is not a loader node of this driver "
                                "(pass what _graph_loader_nodes() returned)", i);
        void *empty_params[1] = {empty_block};
        if (state == 2) {
            p.kernelParams = empty_params;
            p.extra = NULL;
        } else if (state == 3) {
            PyObject *t = PyTuple_GET_ITEM(tables, i);
            if (l2p_prepared_device(t) != device || l2p_prepared_driver(t) != d)
                return PyErr_Format(PyExc_ValueError, "state[%zd] is a table of cuda:%d; node %zd "
                                    "runs on cuda:%d", i, l2p_prepared_device(t), i, device);
            l2p_prepared_node_params(t, &p);
        }
        if ((r = d->fn.cuGraphExecKernelNodeSetParams((CUgraphExec)exec, (CUgraphNode)node, &p))
            != CUDA_SUCCESS)
            return l2p_raise_cuda(st, d, "cuGraphExecKernelNodeSetParams", r);
        if ((r = d->fn.cuGraphNodeSetEnabled((CUgraphExec)exec, (CUgraphNode)node, 1)) != CUDA_SUCCESS)
            return l2p_raise_cuda(st, d, "cuGraphNodeSetEnabled", r);
    }
    Py_RETURN_NONE;
}


static int derive_api(l2p_state *st, l2p_driver *d)
{
    if (d->fn.cuGraphGetEdges && d->fn.cuGraphClone && d->fn.cuGraphNodeFindInClone &&
        d->fn.cuGraphDestroyNode && d->fn.cuGraphDestroy && d->fn.cuGraphInstantiateWithFlags &&
        d->fn.cuGraphLaunch && d->fn.cuGraphExecDestroy)
        return 0;
    PyErr_Format(st->error, "a graph without its loader nodes needs driver 12.3 or newer "
                 "(cuGraphGetEdges with edge data, cuGraphClone); this one is %d.%d",
                 d->version / 1000, d->version % 1000 / 10);
    return -1;
}

/* _C._graph_edges(graph) -> ((from, to), ...): every edge of the template graph, as
 * node handles (what _graph_loader_nodes() returns for its loader nodes). */
PyObject *l2p_py_graph_edges(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    l2p_state *st = l2p_get_state(module);
    void *g;
    if (nargs != 1)
        return PyErr_Format(PyExc_TypeError, "_graph_edges() takes exactly 1 argument "
                            "(%zd given)", nargs);
    if (handle_arg(args[0], "graph", &g) < 0)
        return NULL;
    l2p_driver *d = l2p_use_driver(st);
    if (!d || derive_api(st, d) < 0)
        return NULL;
    l2p_driver_incref(d);   /* the tuple's allocations can run the GC (see above) */
    size_t n = 0;
    PyObject *out = NULL;
    CUgraphNode *from = NULL, *to = NULL;
    CUgraphEdgeData *data = NULL;   /* asked for: without it a programmatic edge is a lossy query */
    CUresult r = d->fn.cuGraphGetEdges((CUgraph)g, NULL, NULL, NULL, &n);
    if (r != CUDA_SUCCESS) {
        l2p_raise_cuda(st, d, "cuGraphGetEdges", r);
        goto done;
    }
    from = PyMem_Calloc(n ? n : 1, sizeof(CUgraphNode));
    to = PyMem_Calloc(n ? n : 1, sizeof(CUgraphNode));
    data = PyMem_Calloc(n ? n : 1, sizeof(CUgraphEdgeData));
    if (!from || !to || !data) {
        PyErr_NoMemory();
        goto done;
    }
    size_t got = n;
    if ((r = d->fn.cuGraphGetEdges((CUgraph)g, from, to, data, &got)) != CUDA_SUCCESS) {
        l2p_raise_cuda(st, d, "cuGraphGetEdges", r);
        goto done;
    }
    if (got > n)   /* the graph grew between the calls: only n were written */
        got = n;
    if (!(out = PyTuple_New((Py_ssize_t)got)))
        goto done;
    for (size_t i = 0; i < got; i++) {
        PyObject *e = Py_BuildValue("(KK)", (unsigned long long)(uintptr_t)from[i],
                                    (unsigned long long)(uintptr_t)to[i]);
        if (!e) {
            Py_CLEAR(out);
            goto done;
        }
        PyTuple_SET_ITEM(out, (Py_ssize_t)i, e);
    }
done:
    PyMem_Free(from);
    PyMem_Free(to);
    PyMem_Free(data);
    l2p_driver_decref(d);
    return out;
}

/* _C._graph_instantiate_without(graph, nodes) -> exec: the template graph cloned, those
 * of its nodes destroyed in the clone (with their edges), the clone instantiated and
 * destroyed.  The caller owns exec (_graph_exec_destroy) and keeps what its nodes
 * point at (the template's memory pool) alive as long. */
PyObject *l2p_py_graph_instantiate_without(PyObject *module, PyObject *const *args,
                                           Py_ssize_t nargs)
{
    l2p_state *st = l2p_get_state(module);
    void *g;
    if (nargs != 2)
        return PyErr_Format(PyExc_TypeError, "_graph_instantiate_without() takes exactly 2 "
                            "arguments (%zd given)", nargs);
    if (handle_arg(args[0], "graph", &g) < 0)
        return NULL;
    if (!PyTuple_CheckExact(args[1]))
        return PyErr_Format(PyExc_TypeError, "nodes must be a tuple of node handles, not %s",
                            Py_TYPE(args[1])->tp_name);
    PyObject *nodes = args[1];   /* an exact tuple of exact ints: no Python code below */
    Py_ssize_t n = PyTuple_GET_SIZE(nodes);
    for (Py_ssize_t i = 0; i < n; i++) {
        void *node;
        if (handle_arg(PyTuple_GET_ITEM(nodes, i), "each node", &node) < 0)
            return NULL;
        /* a node named twice would be destroyed twice in the clone */
        for (Py_ssize_t j = 0; j < i; j++)
            if (PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(nodes, j)) == (uintptr_t)node)
                return PyErr_Format(PyExc_ValueError, "nodes[%zd] repeats nodes[%zd]; name "
                                    "each node once", i, j);
    }
    l2p_driver *d = l2p_use_driver(st);
    if (!d || derive_api(st, d) < 0)
        return NULL;
    CUgraph clone = NULL;
    CUgraphExec exec = NULL;
    CUresult r = d->fn.cuGraphClone(&clone, (CUgraph)g);
    if (r != CUDA_SUCCESS)
        return l2p_raise_cuda(st, d, "cuGraphClone", r);
    const char *failed = NULL;
    for (Py_ssize_t i = 0; i < n && !failed; i++) {
        CUgraphNode mine = NULL;
        void *node = (void *)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(nodes, i));
        if ((r = d->fn.cuGraphNodeFindInClone(&mine, (CUgraphNode)node, clone)) != CUDA_SUCCESS)
            failed = "cuGraphNodeFindInClone";
        else if ((r = d->fn.cuGraphDestroyNode(mine)) != CUDA_SUCCESS)
            failed = "cuGraphDestroyNode";
    }
    if (!failed && (r = d->fn.cuGraphInstantiateWithFlags(&exec, clone, 0)) != CUDA_SUCCESS)
        failed = "cuGraphInstantiateWithFlags";
    CUresult destroyed = d->fn.cuGraphDestroy(clone);
    if (failed)
        return l2p_raise_cuda(st, d, failed, r);
    if (destroyed != CUDA_SUCCESS) {
        (void)d->fn.cuGraphExecDestroy(exec);
        return l2p_raise_cuda(st, d, "cuGraphDestroy", destroyed);
    }
    PyObject *out = PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)exec);
    if (!out)
        (void)d->fn.cuGraphExecDestroy(exec);
    return out;
}

/* _C._graph_exec_launch(exec, stream): cuGraphLaunch; stream 0 is the legacy stream. */
PyObject *l2p_py_graph_exec_launch(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    l2p_state *st = l2p_get_state(module);
    void *exec;
    if (nargs != 2)
        return PyErr_Format(PyExc_TypeError, "_graph_exec_launch() takes exactly 2 arguments "
                            "(%zd given)", nargs);
    if (handle_arg(args[0], "exec", &exec) < 0)
        return NULL;
    if (!PyLong_CheckExact(args[1]))
        return PyErr_Format(PyExc_TypeError, "stream must be an int handle, not %s",
                            Py_TYPE(args[1])->tp_name);
    unsigned long long stream = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    l2p_driver *d = l2p_use_driver(st);
    if (!d || derive_api(st, d) < 0)
        return NULL;
    CUresult r = d->fn.cuGraphLaunch((CUgraphExec)exec, (CUstream)(uintptr_t)stream);
    if (r != CUDA_SUCCESS)
        return l2p_raise_cuda(st, d, "cuGraphLaunch", r);
    Py_RETURN_NONE;
}

/* _C._graph_exec_destroy(exec): cuGraphExecDestroy of what _graph_instantiate_without made. */
PyObject *l2p_py_graph_exec_destroy(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    l2p_state *st = l2p_get_state(module);
    void *exec;
    if (nargs != 1)
        return PyErr_Format(PyExc_TypeError, "_graph_exec_destroy() takes exactly 1 argument "
                            "(%zd given)", nargs);
    if (handle_arg(args[0], "exec", &exec) < 0)
        return NULL;
    l2p_driver *d = l2p_use_driver(st);
    if (!d || derive_api(st, d) < 0)
        return NULL;
    CUresult r = d->fn.cuGraphExecDestroy((CUgraphExec)exec);
    if (r != CUDA_SUCCESS)
        return l2p_raise_cuda(st, d, "cuGraphExecDestroy", r);
    Py_RETURN_NONE;
}
