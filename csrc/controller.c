/*
 * controller.c: PrefetchController, prefetch launches per (point, layer,
 * batch) on one side stream of one device.
 *
 * fork(point, layer, batch) records the (point, layer) event on the current
 * stream, makes the side stream wait on it (so the prefetch starts only after
 * the work it overlaps was issued), launches the prepared table on the side
 * stream, and marks the controller pending.  join() makes the current stream
 * wait for the side stream, so a captured CUDA graph always rejoins it.
 * While the current stream is being captured into a CUDA graph, fork instead
 * puts the prefetch on that stream with launch-order edges (capture.c, NOTE
 * [inline graph fork]): a side branch slows some graphs by tens of us.  Such
 * a fork leaves nothing pending; graph_fork="branch" keeps the side stream.
 * With eager=False, a fork outside a capture does nothing and returns False:
 * in a host-bound eager decode step a fork costs host time (~15 us measured in
 * a real model's step) and cannot gain, as the GPU waits for the host anyway.
 *
 * The hot path allocates no Python object and hashes nothing: point names are
 * interned to small integers at add() and compared by identity first; the
 * table is a flat array indexed [point][layer][batch]; the current stream comes
 * from torch's C shim (stream.c); the only driver calls are the three of the
 * fork (record, wait, launch) and the two of the join (record, wait), plus one
 * cuCtxGetCurrent read that catches a fork while another device is current and
 * one cuStreamGetCaptureInfo read of the capture state.
 * All of it runs under the GIL, so forks from several Python threads are
 * serialised, never interleaved.
 */
#include "l2p.h"

/* Set by l2p_device_ready() (driver.c): the call that failed. */

#include "structmember.h"

/* While capturing: the prefetch node on the captured stream itself with
 * launch-order edges (capture.c, NOTE [inline graph fork]), or the side stream. */
enum { GRAPH_FORK_INLINE = 0, GRAPH_FORK_BRANCH = 1 };
static const char *const graph_fork_names[] = {"inline", "branch"};

#define MAX_LAYER 65535
#define MAX_BATCH 65535

typedef struct {
    PyObject_HEAD
    l2p_driver *drv;          /* NULL when disabled */
    l2p_device *dev;
    int device;
    int enabled;
    int closed;
    int graph_fork;           /* GRAPH_FORK_*: how a fork goes into a captured graph */
    int eager;                /* fork outside graph captures too (the default) */
    CUstream side;
    CUevent join_event;
    PyObject *points;         /* list of interned str; index = point id */
    PyObject *entries;        /* {(point, layer, batch): PreparedWeightRanges} (owns them) */
    int npoints, nlayers, nbatches;
    PyObject **table;         /* [point][layer][batch] -> borrowed from entries */
    CUevent *events;          /* [point][layer] */
    unsigned long long *forks, *bytes;   /* per point */
    int pending;
    unsigned long long capture_id;       /* capture of the pending fork, 0 if eager */
    PyObject *stream_obj;     /* torch.cuda.ExternalStream, made on first use */
    PyObject *weakreflist;
} controller;

static l2p_state *state_of(controller *self)
{
    return l2p_state_of_type(Py_TYPE(self));
}


static PyObject *controller_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"device", "graph_fork", "eager", NULL};
    PyObject *device_obj = Py_None, *graph_fork_obj = NULL;
    int eager = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O$Op:PrefetchController", kwlist, &device_obj,
                                     &graph_fork_obj, &eager))
        return NULL;
    l2p_state *st = l2p_state_of_type(type);
    int device, graph_fork = GRAPH_FORK_INLINE;
    if (l2p_device_arg(device_obj, &device) < 0)
        return NULL;
    if (graph_fork_obj) {
        graph_fork = -1;
        for (int i = 0; PyUnicode_Check(graph_fork_obj) && i < 2; i++)
            if (PyUnicode_CompareWithASCIIString(graph_fork_obj, graph_fork_names[i]) == 0)
                graph_fork = i;
        if (graph_fork < 0) {
            PyErr_Format(PyExc_ValueError,
                         "graph_fork must be 'inline' (the default) or 'branch', not %R",
                         graph_fork_obj);
            return NULL;
        }
    }
    controller *self = (controller *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->device = device;
    self->graph_fork = graph_fork;
    self->eager = eager;
    self->points = PyList_New(0);
    self->entries = PyDict_New();
    if (!self->points || !self->entries)
        goto error;
    self->enabled = !l2p_env_flag("L2PREFETCH_DISABLE");
    if (!self->enabled)
        return (PyObject *)self;

    l2p_driver *d = l2p_use_driver(st);
    if (!d)
        goto error;
    CUresult r = l2p_device_ready(d, device, &self->dev);
    if (r == CUDA_ERROR_INVALID_DEVICE || r == CUDA_ERROR_NO_DEVICE) {
        PyErr_Format(PyExc_ValueError, "cuda:%d does not exist (the driver sees %d device%s)",
                     device, d->device_count, d->device_count == 1 ? "" : "s");
        goto error;
    }
    if (r != CUDA_SUCCESS) {
        char op[96];
        PyOS_snprintf(op, sizeof op, "%s (preparing cuda:%d)", l2p_device_ready_failed_call, device);
        l2p_raise_cuda(st, d, op, r);
        goto error;
    }
    self->drv = d;
    l2p_driver_incref(d);
    if (!eager && !d->fn.cuStreamGetCaptureInfo) {
        PyErr_Format(PyExc_ValueError,
                     "eager=False needs the capture state of a stream (cuStreamGetCaptureInfo, "
                     "CUDA driver 12.3 or newer); this driver is %d.%d: leave eager=True",
                     d->version / 1000, d->version % 1000 / 10);
        goto error;
    }
    CUcontext popped;
    const char *op = "cuCtxPushCurrent";
    r = d->fn.cuCtxPushCurrent(self->dev->ctx);
    if (r == CUDA_SUCCESS) {
        op = "cuStreamCreateWithPriority";
        r = d->fn.cuStreamCreateWithPriority(&self->side, CU_STREAM_NON_BLOCKING, 0);
        if (r == CUDA_SUCCESS) {
            op = "cuEventCreate";
            r = d->fn.cuEventCreate(&self->join_event, CU_EVENT_DISABLE_TIMING);
        }
        CUresult p = d->fn.cuCtxPopCurrent(&popped);
        if (r == CUDA_SUCCESS && p != CUDA_SUCCESS) {
            r = p;
            op = "cuCtxPopCurrent";
        }
    }
    if (r != CUDA_SUCCESS) {
        l2p_raise_cuda(st, d, op, r);
        goto error;   /* dealloc destroys what was created */
    }
    return (PyObject *)self;
error:
    Py_DECREF(self);
    return NULL;
}

/* Destroys the stream and events exactly once; returns the first failure. */
static CUresult release(controller *self, const char **failed)
{
    CUresult first = CUDA_SUCCESS;
    *failed = NULL;
    if (!self->drv)
        return first;
    l2p_driver *d = self->drv;
    int nev = self->npoints * self->nlayers;
    for (int i = 0; self->events && i < nev; i++) {
        if (!self->events[i])
            continue;
        CUresult r = d->fn.cuEventDestroy(self->events[i]);
        self->events[i] = NULL;
        if (r != CUDA_SUCCESS && first == CUDA_SUCCESS) {
            first = r;
            *failed = "cuEventDestroy";
        }
    }
    if (self->join_event) {
        CUresult r = d->fn.cuEventDestroy(self->join_event);
        self->join_event = NULL;
        if (r != CUDA_SUCCESS && first == CUDA_SUCCESS) {
            first = r;
            *failed = "cuEventDestroy";
        }
    }
    if (self->side) {
        CUresult r = d->fn.cuStreamDestroy(self->side);
        self->side = NULL;
        if (r != CUDA_SUCCESS && first == CUDA_SUCCESS) {
            first = r;
            *failed = "cuStreamDestroy";
        }
    }
    return first;
}

static int controller_traverse(controller *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->entries);
    Py_VISIT(self->stream_obj);
    return 0;
}

static void drop_tables(controller *self)
{
    /* The flat table borrows from entries: forget it before entries go.  The
     * events (indexed by npoints x nlayers) stay for release(). */
    PyMem_Free(self->table);
    self->table = NULL;
    self->nbatches = 0;
}

static int controller_clear(controller *self)
{
    drop_tables(self);
    Py_CLEAR(self->entries);
    Py_CLEAR(self->stream_obj);
    return 0;
}

static void controller_dealloc(controller *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist)
        PyObject_ClearWeakRefs((PyObject *)self);
    const char *failed;
    CUresult r = release(self, &failed);
    if (r != CUDA_SUCCESS)
        l2p_report_in_dealloc(self->drv, failed, r, (PyObject *)self);
    PyMem_Free(self->events);
    PyMem_Free(self->forks);
    PyMem_Free(self->bytes);
    controller_clear(self);
    Py_CLEAR(self->points);
    if (self->drv)
        l2p_driver_decref(self->drv);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* ---- argument helpers ---- */

static int as_index(PyObject *o, const char *what, long *out)
{
    if (!PyLong_Check(o) || PyBool_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    *out = PyLong_AsLong(o);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        *out = LONG_MAX;   /* out of any table: "not registered" */
    }
    return 0;
}

/* Point id of name, or -1.  Identity first: callers pass the same literals. */
static inline int find_point(controller *self, PyObject *name)
{
    PyObject **items = ((PyListObject *)self->points)->ob_item;
    for (int i = 0; i < self->npoints; i++)
        if (items[i] == name)
            return i;
    for (int i = 0; i < (int)PyList_GET_SIZE(self->points); i++)
        if (PyUnicode_Compare(items[i], name) == 0)
            return i;
    if (PyErr_Occurred())
        PyErr_Clear();
    return -1;
}

static int check_open(controller *self)
{
    if (self->closed) {
        PyErr_SetString(state_of(self)->error,
                        "this PrefetchController is closed: make a new one");
        return -1;
    }
    return 0;
}

static int ensure_context(controller *self)
{
    CUresult r = l2p_ensure_current(self->drv, self->dev);
    if (r == CUDA_SUCCESS)
        return 0;
    if (r == CUDA_ERROR_INVALID_CONTEXT) {
        PyErr_Format(PyExc_RuntimeError,
                     "another CUDA device is current on this thread, but this controller is for "
                     "cuda:%d: fork/join under torch.cuda.device(%d), or use one controller per device",
                     self->device, self->device);
        return -1;
    }
    /* l2p_ensure_current() does not say which of its two calls failed. */
    return l2p_raise_cuda_int(state_of(self), self->drv, "cuCtxGetCurrent/cuCtxSetCurrent", r);
}

/* Grows the flat tables to hold (point, layer, batch). */
static int grow(controller *self, int p, int l, int b)
{
    int np = p + 1 > self->npoints ? p + 1 : self->npoints;
    int nl = l + 1 > self->nlayers ? l + 1 : self->nlayers;
    int nb = b + 1 > self->nbatches ? b + 1 : self->nbatches;
    if (np == self->npoints && nl == self->nlayers && nb == self->nbatches)
        return 0;
    PyObject **table = PyMem_Calloc((size_t)np * nl * nb, sizeof *table);
    CUevent *events = PyMem_Calloc((size_t)np * nl, sizeof *events);
    unsigned long long *forks = PyMem_Calloc((size_t)np, sizeof *forks);
    unsigned long long *bytes = PyMem_Calloc((size_t)np, sizeof *bytes);
    if (!table || !events || !forks || !bytes) {
        PyMem_Free(table);
        PyMem_Free(events);
        PyMem_Free(forks);
        PyMem_Free(bytes);
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < self->npoints; i++) {
        forks[i] = self->forks[i];
        bytes[i] = self->bytes[i];
        for (int j = 0; j < self->nlayers; j++) {
            events[i * nl + j] = self->events[i * self->nlayers + j];
            for (int k = 0; k < self->nbatches; k++)
                table[((size_t)i * nl + j) * nb + k] =
                    self->table[((size_t)i * self->nlayers + j) * self->nbatches + k];
        }
    }
    PyMem_Free(self->table);
    PyMem_Free(self->events);
    PyMem_Free(self->forks);
    PyMem_Free(self->bytes);
    self->table = table;
    self->events = events;
    self->forks = forks;
    self->bytes = bytes;
    self->npoints = np;
    self->nlayers = nl;
    self->nbatches = nb;
    return 0;
}

/* ---- add ---- */

PyDoc_STRVAR(add_doc,
"add($self, point, layer, batches, ranges, /)\n--\n\n"
"Register ranges (a PreparedWeightRanges of this device) for (point, layer, b)\n"
"for each b in batches (an int or an iterable of ints).  The (point, layer)\n"
"event is created and recorded once here, before any capture can begin.");

static PyObject *controller_add(controller *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4)
        return PyErr_Format(PyExc_TypeError, "add() takes 4 arguments (point, layer, batches, ranges), %zd given", nargs);
    if (check_open(self) < 0)
        return NULL;
    l2p_state *st = state_of(self);
    PyObject *point = args[0], *batches = args[2], *ranges = args[3];
    long layer;
    if (!PyUnicode_Check(point) || PyUnicode_GET_LENGTH(point) == 0)
        return PyErr_Format(PyExc_TypeError, "point must be a non-empty str, not %R", point);
    if (as_index(args[1], "layer", &layer) < 0)
        return NULL;
    if (layer < 0 || layer > MAX_LAYER)
        return PyErr_Format(PyExc_ValueError, "layer must be in 0..%d, got %R", MAX_LAYER, args[1]);
    if (!l2p_prepared_check(st, ranges))
        return PyErr_Format(PyExc_TypeError, "ranges must be a PreparedWeightRanges, not %s", Py_TYPE(ranges)->tp_name);
    if (self->enabled && l2p_prepared_device(ranges) != self->device)
        return PyErr_Format(PyExc_ValueError,
                            "ranges are prepared for cuda:%d but this controller is for cuda:%d",
                            l2p_prepared_device(ranges), self->device);
    if (self->enabled && l2p_prepared_driver(ranges) != self->drv)
        return PyErr_Format(PyExc_ValueError, "ranges were prepared with another CUDA driver instance");

    /* Collect and check the batches before changing anything. */
    PyObject *list = PyLong_Check(batches) ? PyTuple_Pack(1, batches) : PySequence_Tuple(batches);
    if (!list) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "batches must be an int or an iterable of ints, not %s", Py_TYPE(batches)->tp_name);
        }
        return NULL;
    }
    long maxb = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(list); i++) {
        long b;
        if (as_index(PyTuple_GET_ITEM(list, i), "each batch", &b) < 0)
            goto error;
        if (b < 1 || b > MAX_BATCH) {
            PyErr_Format(PyExc_ValueError, "batch must be in 1..%d, got %R", MAX_BATCH, PyTuple_GET_ITEM(list, i));
            goto error;
        }
        if (b > maxb)
            maxb = b;
    }
    if (PyTuple_GET_SIZE(list) == 0) {
        PyErr_SetString(PyExc_ValueError, "batches is empty: name at least one batch size");
        goto error;
    }

    Py_INCREF(point);
    PyUnicode_InternInPlace(&point);
    int p = find_point(self, point);
    if (p < 0) {
        p = (int)PyList_GET_SIZE(self->points);
        if (PyList_Append(self->points, point) < 0) {
            Py_DECREF(point);
            goto error;
        }
    }
    Py_DECREF(point);
    point = PyList_GET_ITEM(self->points, p);
    if (grow(self, p, (int)layer, (int)maxb) < 0)
        goto error;

    CUevent *ev = &self->events[p * self->nlayers + layer];
    if (self->enabled && !*ev) {
        CUstream cur = NULL;
        if (l2p_current_stream(self->device, &cur) < 0)
            PyErr_Clear();   /* no torch: record on the legacy default stream */
        CUcontext popped;
        const char *op = "cuCtxPushCurrent";
        CUresult r = self->drv->fn.cuCtxPushCurrent(self->dev->ctx);
        if (r == CUDA_SUCCESS) {
            op = "cuEventCreate";
            r = self->drv->fn.cuEventCreate(ev, CU_EVENT_DISABLE_TIMING);
            if (r == CUDA_SUCCESS) {
                op = "cuEventRecord";
                r = self->drv->fn.cuEventRecord(*ev, cur);
                if (r != CUDA_SUCCESS) {
                    (void)self->drv->fn.cuEventDestroy(*ev);
                    *ev = NULL;
                }
            }
            CUresult pop = self->drv->fn.cuCtxPopCurrent(&popped);
            if (r == CUDA_SUCCESS && pop != CUDA_SUCCESS) {
                op = "cuCtxPopCurrent";
                r = pop;
            }
        }
        if (r != CUDA_SUCCESS) {
            l2p_raise_cuda(st, self->drv, op, r);
            goto error;
        }
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(list); i++) {
        long b = PyLong_AsLong(PyTuple_GET_ITEM(list, i));
        PyObject *key = Py_BuildValue("(Oll)", point, layer, b);
        if (!key || PyDict_SetItem(self->entries, key, ranges) < 0) {
            Py_XDECREF(key);
            goto error;
        }
        Py_DECREF(key);
        self->table[((size_t)p * self->nlayers + layer) * self->nbatches + b] = ranges;
    }
    Py_DECREF(list);
    Py_RETURN_NONE;
error:
    Py_DECREF(list);
    return NULL;
}

/* ---- fork / join ---- */

static int parse_key(controller *self, PyObject *const *args, PyObject **entry, int *p, long *layer)
{
    PyObject *point = args[0];
    long batch;
    *entry = NULL;
    if (!PyUnicode_Check(point)) {
        PyErr_Format(PyExc_TypeError, "point must be a str, not %s", Py_TYPE(point)->tp_name);
        return -1;
    }
    if (as_index(args[1], "layer", layer) < 0 || as_index(args[2], "batch", &batch) < 0)
        return -1;
    *p = find_point(self, point);
    /* p >= npoints: a point whose add() failed to grow the tables (MemoryError) */
    if (*p < 0 || *p >= self->npoints || *layer < 0 || *layer >= self->nlayers || batch < 0 ||
        batch >= self->nbatches)
        return 0;
    *entry = self->table[((size_t)*p * self->nlayers + *layer) * self->nbatches + batch];
    return 0;
}

static int stream_arg(controller *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                      Py_ssize_t npos, const char *fname, PyObject **stream)
{
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    *stream = Py_None;
    if (nargs == npos + 1 && nkw == 0) {
        *stream = args[npos];
        return 0;
    }
    if (nargs == npos && nkw == 1 &&
        PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "stream") == 0) {
        *stream = args[npos];
        return 0;
    }
    if (nargs == npos && nkw == 0)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd positional arguments and an optional stream=",
                 fname, npos);
    return -1;
}

/* Capture id of stream, 0 when not capturing or unknown. */
static unsigned long long capture_of(controller *self, CUstream s)
{
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    unsigned long long id = 0;
    if (!self->drv->fn.cuStreamGetCaptureInfo ||
        self->drv->fn.cuStreamGetCaptureInfo(s, &status, &id, NULL, NULL, NULL, NULL) != CUDA_SUCCESS)
        return 0;
    return status == CU_STREAM_CAPTURE_STATUS_ACTIVE ? id : 0;
}

PyDoc_STRVAR(fork_doc,
"fork($self, point, layer, batch, /, stream=None)\n--\n\n"
"Launch the table registered for (point, layer, batch) on the side stream,\n"
"after the work already queued on stream (default: torch's current stream).\n"
"While stream is being captured (graph_fork='inline'), the launch goes on\n"
"stream itself with launch-order edges, overlapping what follows.\n"
"Returns False, doing nothing, when nothing is registered there, and with\n"
"eager=False when stream is not being captured.");

static PyObject *controller_fork(controller *self, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames)
{
    PyObject *entry, *stream;
    int p;
    long layer;
    if (nargs < 3)
        return PyErr_Format(PyExc_TypeError, "fork() takes point, layer, batch (%zd given)", nargs);
    if (stream_arg(self, args, nargs, kwnames, 3, "fork", &stream) < 0 ||
        parse_key(self, args, &entry, &p, &layer) < 0 || check_open(self) < 0)
        return NULL;
    if (!entry || !self->enabled)
        Py_RETURN_FALSE;
    l2p_state *st = state_of(self);
    l2p_driver *d = self->drv;
    CUstream cur;
    if (l2p_parse_stream(stream, self->device, &cur) < 0 || ensure_context(self) < 0)
        return NULL;
    int inline_ok = self->graph_fork == GRAPH_FORK_INLINE && l2p_capture_inline_available(d);
    unsigned long long cap = 0;
    if (inline_ok || !self->pending || self->capture_id != 0 || !self->eager)
        cap = capture_of(self, cur);
    if (self->pending && self->capture_id != 0 && cap != self->capture_id) {
        self->pending = 0;
        self->capture_id = 0;
        return PyErr_Format(st->error,
                            "this controller forked during a CUDA graph capture that ended "
                            "without join(): call join() at the end of every captured step "
                            "(the earlier capture is invalid)");
    }
    if (!cap && !self->eager)
        Py_RETURN_FALSE;
    if (cap && inline_ok) {
        const char *failed;
        CUresult r = l2p_capture_inline_launch(d, cur, entry, &failed);
        if (r != CUDA_SUCCESS)
            return l2p_raise_cuda(st, d, failed, r);
        self->forks[p]++;
        self->bytes[p] += l2p_prepared_nbytes(entry);
        Py_RETURN_TRUE;
    }
    if (!self->pending)
        self->capture_id = cap;
    CUevent ev = self->events[p * self->nlayers + layer];
    CUresult r = d->fn.cuEventRecord(ev, cur);
    if (r != CUDA_SUCCESS)
        return l2p_raise_cuda(st, d, "cuEventRecord", r);
    r = d->fn.cuStreamWaitEvent(self->side, ev, 0);
    if (r != CUDA_SUCCESS)
        return l2p_raise_cuda(st, d, "cuStreamWaitEvent", r);
    self->pending = 1;
    r = l2p_prepared_launch_raw(entry, self->side);
    if (r != CUDA_SUCCESS)
        return l2p_raise_cuda(st, d, "cuLaunchKernelEx", r);
    self->forks[p]++;
    self->bytes[p] += l2p_prepared_nbytes(entry);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(join_doc,
"join($self, /, stream=None)\n--\n\n"
"If a fork is pending, make stream (default: torch's current stream) wait for\n"
"the side stream.  Call it at the end of every step, inside a captured graph too.");

static PyObject *controller_join(controller *self, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames)
{
    PyObject *stream;
    if (stream_arg(self, args, nargs, kwnames, 0, "join", &stream) < 0 || check_open(self) < 0)
        return NULL;
    if (!self->pending)
        Py_RETURN_NONE;
    l2p_state *st = state_of(self);
    CUstream cur;
    if (l2p_parse_stream(stream, self->device, &cur) < 0 || ensure_context(self) < 0)
        return NULL;
    CUresult r = self->drv->fn.cuEventRecord(self->join_event, self->side);
    if (r != CUDA_SUCCESS)
        return l2p_raise_cuda(st, self->drv, "cuEventRecord", r);
    r = self->drv->fn.cuStreamWaitEvent(cur, self->join_event, 0);
    if (r != CUDA_SUCCESS)
        return l2p_raise_cuda(st, self->drv, "cuStreamWaitEvent", r);
    self->pending = 0;
    self->capture_id = 0;
    Py_RETURN_NONE;
}

/* ---- lookups, stats, lifetime ---- */

static PyObject *controller_get(controller *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *entry;
    int p;
    long layer;
    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError, "get() takes point, layer, batch (%zd given)", nargs);
    if (parse_key(self, args, &entry, &p, &layer) < 0)
        return NULL;
    return Py_NewRef(entry ? entry : Py_None);
}

static PyObject *controller_keys(controller *self, PyObject *unused)
{
    return PyDict_Keys(self->entries);
}

static Py_ssize_t controller_len(controller *self)
{
    return PyDict_GET_SIZE(self->entries);
}

static PyObject *controller_stats(controller *self, PyObject *unused)
{
    PyObject *d = PyDict_New();
    for (Py_ssize_t i = 0; d && i < PyList_GET_SIZE(self->points); i++) {
        unsigned long long f = i < self->npoints ? self->forks[i] : 0;
        unsigned long long b = i < self->npoints ? self->bytes[i] : 0;
        PyObject *e = Py_BuildValue("{s:K,s:K}", "forks", f, "bytes", b);
        if (!e || PyDict_SetItem(d, PyList_GET_ITEM(self->points, i), e) < 0) {
            Py_XDECREF(e);
            Py_CLEAR(d);
        } else {
            Py_DECREF(e);
        }
    }
    return d;
}

static PyObject *controller_reset_stats(controller *self, PyObject *unused)
{
    for (int i = 0; i < self->npoints; i++)
        self->forks[i] = self->bytes[i] = 0;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(close_doc,
"close($self, /)\n--\n\n"
"Destroy the side stream and the events and drop the prepared tables (and so\n"
"the weights) now.  Idempotent; the controller refuses use afterwards.");

static PyObject *controller_close(controller *self, PyObject *unused)
{
    if (self->closed)
        Py_RETURN_NONE;
    self->closed = 1;
    self->pending = 0;
    const char *failed;
    CUresult r = release(self, &failed);
    drop_tables(self);    /* forks now find nothing */
    PyDict_Clear(self->entries);
    Py_CLEAR(self->stream_obj);
    if (r != CUDA_SUCCESS)
        return l2p_raise_cuda(state_of(self), self->drv, failed, r);
    Py_RETURN_NONE;
}

static PyObject *controller_enter(controller *self, PyObject *unused)
{
    return Py_NewRef(self);
}

static PyObject *controller_exit(controller *self, PyObject *const *args, Py_ssize_t nargs)
{
    return controller_close(self, NULL);
}

static PyObject *get_stream_handle(controller *self, void *c)
{
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)self->side);
}

static PyObject *get_stream(controller *self, void *c)
{
    if (check_open(self) < 0)
        return NULL;
    if (!self->enabled)
        Py_RETURN_NONE;
    if (!self->stream_obj) {
        PyObject *cuda = PyImport_ImportModule("torch.cuda");
        if (!cuda)
            return NULL;
        self->stream_obj = PyObject_CallMethod(cuda, "ExternalStream", "Ki",
                                               (unsigned long long)(uintptr_t)self->side, self->device);
        Py_DECREF(cuda);
        if (!self->stream_obj)
            return NULL;
    }
    return Py_NewRef(self->stream_obj);
}

static PyObject *get_device(controller *self, void *c) { return PyLong_FromLong(self->device); }
static PyObject *get_enabled(controller *self, void *c) { return PyBool_FromLong(self->enabled); }
static PyObject *get_pending(controller *self, void *c) { return PyBool_FromLong(self->pending); }
static PyObject *get_closed(controller *self, void *c) { return PyBool_FromLong(self->closed); }
static PyObject *get_graph_fork(controller *self, void *c)
{
    return PyUnicode_FromString(graph_fork_names[self->graph_fork]);
}
static PyObject *get_points(controller *self, void *c) { return PyList_AsTuple(self->points); }
static PyObject *get_eager(controller *self, void *c) { return PyBool_FromLong(self->eager); }

static PyGetSetDef controller_getset[] = {
    {"stream", (getter)get_stream, NULL, "The side stream as a torch.cuda.ExternalStream (None when disabled).", NULL},
    {"stream_handle", (getter)get_stream_handle, NULL, "The side stream's CUstream handle as an int (0 when disabled).", NULL},
    {"device", (getter)get_device, NULL, "CUDA device index.", NULL},
    {"enabled", (getter)get_enabled, NULL, "False when L2PREFETCH_DISABLE was set at construction: forks do nothing.", NULL},
    {"pending", (getter)get_pending, NULL, "Whether a fork awaits join().", NULL},
    {"closed", (getter)get_closed, NULL, "Whether close() was called.", NULL},
    {"graph_fork", (getter)get_graph_fork, NULL,
     "How a fork goes into a CUDA graph being captured: 'inline' (the prefetch node on the\n"
     "captured stream with launch-order edges; the default) or 'branch' (the side stream).",
     NULL},
    {"points", (getter)get_points, NULL, "Point names in registration order.", NULL},
    {"eager", (getter)get_eager, NULL,
     "Whether fork() launches outside CUDA graph captures (False: only while capturing).", NULL},
    {NULL},
};

static PyMethodDef controller_methods[] = {
    {"add", (PyCFunction)(void (*)(void))controller_add, METH_FASTCALL, add_doc},
    {"fork", (PyCFunction)(void (*)(void))controller_fork, METH_FASTCALL | METH_KEYWORDS, fork_doc},
    {"join", (PyCFunction)(void (*)(void))controller_join, METH_FASTCALL | METH_KEYWORDS, join_doc},
    {"get", (PyCFunction)(void (*)(void))controller_get, METH_FASTCALL,
     "get($self, point, layer, batch, /)\n--\n\nThe PreparedWeightRanges registered there, or None."},
    {"keys", (PyCFunction)controller_keys, METH_NOARGS,
     "keys($self, /)\n--\n\nRegistered (point, layer, batch) keys."},
    {"stats", (PyCFunction)controller_stats, METH_NOARGS,
     "stats($self, /)\n--\n\n{point: {'forks': n, 'bytes': b}} since creation or reset_stats()."},
    {"reset_stats", (PyCFunction)controller_reset_stats, METH_NOARGS,
     "reset_stats($self, /)\n--\n\nZero the fork and byte counters."},
    {"close", (PyCFunction)controller_close, METH_NOARGS, close_doc},
    {"__enter__", (PyCFunction)controller_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))controller_exit, METH_FASTCALL, NULL},
    {NULL},
};

static PyMemberDef controller_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(controller, weakreflist), READONLY},
    {NULL},
};

static PyObject *controller_repr(controller *self)
{
    return PyUnicode_FromFormat("<PrefetchController cuda:%d %zd entries%s%s>", self->device,
                                PyDict_GET_SIZE(self->entries), self->enabled ? "" : " disabled",
                                self->closed ? " closed" : "");
}

PyDoc_STRVAR(controller_doc,
"PrefetchController(device=None, *, graph_fork='inline', eager=True)\n--\n\n"
"Prefetch launches per (point, layer, batch) on one side stream of one CUDA\n"
"device (default: torch's current device).  graph_fork says how a fork goes\n"
"into a CUDA graph being captured: 'inline' puts the prefetch node on the\n"
"captured stream with launch-order edges (no side branch; driver 12.3+,\n"
"older drivers fall back), 'branch' forks to the side stream as in eager mode.\n"
"eager=False makes fork() outside a capture return False without launching:\n"
"a host-bound eager decode step pays a fork's host time and cannot gain.\n"
"With L2PREFETCH_DISABLE=1 in the environment at construction, nothing\n"
"touches the GPU and fork() returns False.");

static PyType_Slot controller_slots[] = {
    {Py_tp_new, controller_new},
    {Py_tp_dealloc, controller_dealloc},
    {Py_tp_traverse, controller_traverse},
    {Py_tp_clear, controller_clear},
    {Py_tp_getset, controller_getset},
    {Py_tp_methods, controller_methods},
    {Py_tp_members, controller_members},
    {Py_tp_repr, controller_repr},
    {Py_mp_length, controller_len},
    {Py_tp_doc, (void *)controller_doc},
    {0, NULL},
};

PyType_Spec l2p_controller_spec = {
    .name = "l2prefetch._C.PrefetchController",
    .basicsize = sizeof(controller),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .slots = controller_slots,
};
