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
 * a fork leaves nothing pending; graph_fork="branch" keeps the side stream,
 * for the whole controller or (add(..., graph_fork=)) for some keys only.
 * With eager=False, a fork outside a capture does nothing and returns False:
 * in a host-bound eager decode step a fork costs host time and cannot gain, as
 * the GPU waits for the host anyway (benchmarks/RESULTS.md, section "The eager
 * fork's host cost inside the step").
 *
 * The tables are sparse: a point holds one row pointer per layer up to its
 * highest layer, a (point, layer) row holds its event and its batches sorted
 * (a key costs one slot; add("p", 65535, [65535], t) costs 512 KiB of row
 * pointers, not the 32 GiB a dense [point][layer][batch] array would).  The
 * hot path allocates no Python object and hashes nothing: point names are
 * interned to small integers at add() and compared by identity first, the
 * layer is an index, the batch a binary search of its row (one to three
 * compares for the usual eight batches); the current stream comes from torch's
 * C shim (stream.c); the only driver calls are the three of the fork (record,
 * wait, launch) and the two of the join (record, wait), plus one
 * cuCtxGetCurrent read that catches a fork while another device is current and
 * one cuStreamGetCaptureInfo read of the capture state (the join reads it only
 * for a fork pending in a capture, which joins in that capture alone).
 *
 * NOTE [one point of effect]: some steps of a call can run Python code: a
 * stream argument's cuda_stream and device properties, torch's Python
 * current-stream fallback, iterating `batches`, parsing `device`, building
 * the result of keys() or stats() (an allocation can run the garbage collector
 * and so any finalizer), releasing a replaced table (its weights' finalizers).
 * That code may call this controller again, from this thread or, as it can
 * give up the GIL, from another.  So each method reads the tables only after
 * the last such step (or copies what it read, with strong references, before
 * one), and from then to its end (its commit) makes no call that can run
 * Python code or release the GIL: calls from several threads, and calls made
 * from that Python code, take effect one at a time at their commits, never
 * interleaved.  After such a step a method checks again that the controller
 * is open and looks its entry up again when the tables changed (`gen` counts
 * their changes).  Tables a call drops are released after its commit.
 * __init__ runs once: calling it again, or from the Python code it runs,
 * raises.
 */
#include "l2p.h"

#include "structmember.h"

/* While capturing: the prefetch node on the captured stream itself with
 * launch-order edges (capture.c, NOTE [inline graph fork]), the side stream, or a
 * sink of the graph (NOTE [leaf graph fork]).  python/l2prefetch/mechanisms.py names
 * the same modes in the same order (tests/test_mechanisms.py). */
enum { GRAPH_FORK_DEFAULT = -1, GRAPH_FORK_INLINE = 0, GRAPH_FORK_BRANCH = 1, GRAPH_FORK_LEAF = 2,
       GRAPH_FORK_COUNT = 3 };
static const char *const graph_fork_names[] = {"inline", "branch", "leaf"};

/* __init__ not run (or failed), running, done; close() or the GC ended it. */
enum { STATE_UNINIT = 0, STATE_INITIALISING, STATE_OPEN, STATE_CLOSED };

#define MAX_LAYER 65535
#define MAX_BATCH 65535

typedef struct {
    int batch;
    int mode;                 /* GRAPH_FORK_*; DEFAULT: the controller's */
    PyObject *ranges;         /* PreparedWeightRanges (strong) */
} slot;

typedef struct row {
    CUevent event;            /* the (point, layer) event; NULL when disabled */
    int n, cap;
    slot *slots;              /* sorted by batch */
    struct row *next;         /* chains detached rows until they are freed */
} row;

typedef struct {
    PyObject *name;           /* interned exact str (strong) */
    int nlayers;              /* rows[] covers layers 0..nlayers-1 */
    row **rows;               /* NULL where nothing was added */
    unsigned long long forks, bytes;
} point;

typedef struct {
    PyObject_HEAD
    l2p_driver *drv;          /* NULL when disabled or not initialised */
    l2p_device *dev;
    int device;
    int enabled;
    int state;                /* STATE_* */
    int graph_fork;           /* GRAPH_FORK_INLINE or _BRANCH: the default of every key */
    int eager;                /* fork outside graph captures too (the default) */
    CUstream side;
    CUevent join_event;
    point *points;            /* registration order; only ever grows */
    int npoints, cap_points;
    Py_ssize_t nentries;      /* registered keys */
    unsigned long long gen;   /* bumped by every change of the tables (NOTE above) */
    int pending;
    unsigned long long capture_id;       /* capture of the pending fork, 0 if eager */
    PyObject *stream_obj;     /* torch.cuda.ExternalStream, made on first use */
    CUgraphNode leaf_tail;    /* the last leaf node of capture leaf_capture (capture.c) */
    unsigned long long leaf_capture;
    PyObject *weakreflist;
} controller;

static l2p_state *state_of(controller *self)
{
    return l2p_state_of_type(Py_TYPE(self));
}

/* ---- tables ---- */

/* Index of the first slot of r with batch >= batch. */
static inline int slot_at(const row *r, long batch)
{
    int lo = 0, hi = r->n;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (r->slots[mid].batch < batch)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Point id of name, or -1.  Identity first: callers pass the same literals.
 * PyUnicode_Compare compares the characters (no __eq__ of a str subclass). */
static inline int find_point(controller *self, PyObject *name)
{
    for (int i = 0; i < self->npoints; i++)
        if (self->points[i].name == name)
            return i;
    for (int i = 0; i < self->npoints; i++)
        if (PyUnicode_Compare(self->points[i].name, name) == 0)
            return i;
    if (PyErr_Occurred())
        PyErr_Clear();
    return -1;
}

static inline row *find_row(controller *self, int p, long layer)
{
    if (p < 0 || layer < 0 || layer >= self->points[p].nlayers)
        return NULL;
    return self->points[p].rows[layer];
}

/* The slot of (name, layer, batch) and its point id, or NULL.  Runs no Python code. */
static inline slot *lookup(controller *self, PyObject *name, long layer, long batch, int *p)
{
    *p = find_point(self, name);
    row *r = find_row(self, *p, layer);
    if (!r)
        return NULL;
    int i = slot_at(r, batch);
    return i < r->n && r->slots[i].batch == batch ? &r->slots[i] : NULL;
}

/* Frees a chain of detached rows, dropping their tables: finalizers of the
 * weights may run, so the controller must be consistent before. */
static void free_rows(row *chain)
{
    while (chain) {
        row *r = chain;
        chain = r->next;
        for (int i = 0; i < r->n; i++)
            Py_DECREF(r->slots[i].ranges);
        PyMem_Free(r->slots);
        PyMem_Free(r);
    }
}

/* Ends the controller (state CLOSED, nothing pending): destroys the side
 * stream and every event exactly once (returns the first failure), detaches
 * the rows into *chain and the stream object into *stream_obj for the caller
 * to release afterwards.  Points and their counters stay.  Runs no Python code. */
static CUresult teardown(controller *self, row **chain, PyObject **stream_obj, const char **failed)
{
    CUresult first = CUDA_SUCCESS;
    l2p_driver *d = self->drv;
    *failed = NULL;
    *chain = NULL;
    *stream_obj = self->stream_obj;
    self->stream_obj = NULL;
    self->state = STATE_CLOSED;
    self->pending = 0;
    self->capture_id = 0;
    self->nentries = 0;
    self->gen++;
    for (int p = 0; p < self->npoints; p++) {
        point *pt = &self->points[p];
        for (int l = 0; l < pt->nlayers; l++) {
            row *r = pt->rows[l];
            if (!r)
                continue;
            if (r->event && d) {
                CUresult s = d->fn.cuEventDestroy(r->event);
                if (s != CUDA_SUCCESS && first == CUDA_SUCCESS) {
                    first = s;
                    *failed = "cuEventDestroy";
                }
            }
            r->event = NULL;
            r->next = *chain;
            *chain = r;
        }
        PyMem_Free(pt->rows);
        pt->rows = NULL;
        pt->nlayers = 0;
    }
    if (self->join_event && d) {
        CUresult s = d->fn.cuEventDestroy(self->join_event);
        if (s != CUDA_SUCCESS && first == CUDA_SUCCESS) {
            first = s;
            *failed = "cuEventDestroy";
        }
    }
    self->join_event = NULL;
    if (self->side && d) {
        CUresult s = d->fn.cuStreamDestroy(self->side);
        if (s != CUDA_SUCCESS && first == CUDA_SUCCESS) {
            first = s;
            *failed = "cuStreamDestroy";
        }
    }
    self->side = NULL;
    return first;
}

/* ---- argument helpers ---- */

/* ValueError: batch o out of 1..MAX_BATCH.  NULL. */
static PyObject *bad_batch(PyObject *o)
{
    return l2p_raise_shown(PyExc_ValueError, o, "batch must be in 1..%d, got ", MAX_BATCH);
}

static int as_index(PyObject *o, const char *what, long *out)
{
    if (!PyLong_Check(o) || PyBool_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    *out = PyLong_AsLong(o);   /* an int subclass is read as it is: no __index__ */
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        *out = LONG_MAX;   /* out of any table: "not registered" */
    }
    return 0;
}

/* add()'s batches as a tuple of ints in 1..MAX_BATCH: an int, or an iterable read one
 * item at a time and refused past MAX_BATCH items (an endless one would fill memory);
 * a dict is refused (it iterates its keys: a cap table passed by mistake; plan.py's
 * check_batches refuses any Mapping, which C cannot tell without running Python). */
static PyObject *collect_batches(PyObject *batches)
{
    if (PyLong_Check(batches)) {   /* a bool refused as an item is */
        long b;
        if (as_index(batches, "each batch", &b) < 0)
            return NULL;
        if (b < 1 || b > MAX_BATCH)
            return bad_batch(batches);
        return PyTuple_Pack(1, batches);
    }
    if (PyDict_Check(batches))
        return PyErr_Format(PyExc_TypeError, "batches must be an int or an iterable of ints, "
                            "not a dict (%s: it iterates its keys)", Py_TYPE(batches)->tp_name);
    PyObject *it = PyObject_GetIter(batches);
    if (!it)   /* not iterable: said in add()'s words, any other error passed on */
        return !PyErr_ExceptionMatches(PyExc_TypeError) ? NULL
               : l2p_format_from_cause(PyExc_TypeError, "batches must be an int or an iterable "
                                       "of ints, not %s", Py_TYPE(batches)->tp_name);
    PyObject *list = PyList_New(0), *item = NULL;
    while (list && (item = PyIter_Next(it))) {
        long b;
        if (as_index(item, "each batch", &b) < 0)
            goto fail;
        if (b < 1 || b > MAX_BATCH) {
            bad_batch(item);
            goto fail;
        }
        if (PyList_GET_SIZE(list) == MAX_BATCH) {
            PyErr_Format(PyExc_ValueError, "batches holds more than %d items, as many as "
                         "there are batch sizes: name each batch once", MAX_BATCH);
            goto fail;
        }
        if (PyList_Append(list, item) < 0)
            goto fail;
        Py_CLEAR(item);
    }
    Py_DECREF(it);
    if (!list || PyErr_Occurred()) {
        Py_XDECREF(list);
        return NULL;
    }
    PyObject *tuple = PyList_AsTuple(list);
    Py_DECREF(list);
    return tuple;
fail:
    Py_XDECREF(item);
    Py_DECREF(it);
    Py_DECREF(list);
    return NULL;
}

/* 'inline' / 'branch' / 'leaf' (and None with allow_none: the controller's).  The names
 * are python/l2prefetch/mechanisms.py's registry: tests/test_mechanisms.py checks that
 * this accepts exactly those and that both messages list them. */
static int parse_graph_fork(PyObject *obj, int allow_none, int *out)
{
    if (allow_none && obj == Py_None) {
        *out = GRAPH_FORK_DEFAULT;
        return 0;
    }
    const char *allowed = allow_none ? "'inline', 'branch', 'leaf' or None (the controller's)"
                                     : "'inline' (the default), 'branch' or 'leaf'";
    if (!PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "graph_fork must be %s, not %s", allowed, Py_TYPE(obj)->tp_name);
        return -1;
    }
    for (int i = 0; i < GRAPH_FORK_COUNT; i++)
        if (PyUnicode_CompareWithASCIIString(obj, graph_fork_names[i]) == 0) {
            *out = i;
            return 0;
        }
    PyErr_Format(PyExc_ValueError, "graph_fork must be %s, not %R", allowed, obj);
    return -1;
}

static int check_open(controller *self)
{
    if (self->state == STATE_OPEN)
        return 0;
    if (self->state == STATE_CLOSED)
        PyErr_SetString(state_of(self)->error, "this PrefetchController is closed: make a new one");
    else
        PyErr_SetString(state_of(self)->error,
                        "this PrefetchController is not initialised: its __init__ did not run, "
                        "failed or is still running (a subclass's __init__ must call "
                        "super().__init__(device, ...))");
    return -1;
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

/* ---- construction ---- */

/* Allocation only: the arguments are __init__'s (so a subclass's own
 * constructor arguments are never read as ours). */
static PyObject *controller_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    controller *self = (controller *)type->tp_alloc(type, 0);
    if (self)
        self->device = -1;
    return (PyObject *)self;
}

static int controller_init(controller *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"device", "graph_fork", "eager", NULL};
    l2p_state *st = state_of(self);
    if (self->state != STATE_UNINIT) {
        PyErr_Format(st->error,
                     "PrefetchController.__init__() called on a controller that is %s (cuda:%d): "
                     "it would change nothing; make a new controller",
                     self->state == STATE_INITIALISING ? "being initialised" : "initialised already",
                     self->device);
        return -1;
    }
    PyObject *device_obj = Py_None, *graph_fork_obj = NULL, *eager_obj = Py_True;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O$OO:PrefetchController", kwlist, &device_obj,
                                     &graph_fork_obj, &eager_obj))
        return -1;
    if (!PyBool_Check(eager_obj)) {
        PyErr_Format(PyExc_TypeError, "eager must be a bool, not %s", Py_TYPE(eager_obj)->tp_name);
        return -1;
    }
    int device, graph_fork = GRAPH_FORK_INLINE;
    if (graph_fork_obj && parse_graph_fork(graph_fork_obj, 0, &graph_fork) < 0)
        return -1;
    self->state = STATE_INITIALISING;   /* a re-entrant __init__ is refused */
    if (l2p_device_arg(device_obj, &device) < 0)   /* may run Python code */
        goto fail;
    self->device = device;
    self->graph_fork = graph_fork;
    self->eager = eager_obj == Py_True;
    self->enabled = !l2p_env_flag("L2PREFETCH_DISABLE");
    if (!self->enabled) {
        self->state = STATE_OPEN;
        return 0;
    }
    /* No Python code from here on. */
    l2p_driver *d = l2p_hold_driver(st);
    if (!d)
        goto fail;
    self->drv = d;
    if (!(self->dev = l2p_use_device(st, d, device)))
        goto fail;
    if (!self->eager && !d->fn.cuStreamGetCaptureInfo) {
        PyErr_Format(PyExc_ValueError,
                     "eager=False needs the capture state of a stream (cuStreamGetCaptureInfo, "
                     "CUDA driver 12.3 or newer); this driver is %d.%d: leave eager=True",
                     d->version / 1000, d->version % 1000 / 10);
        goto fail;
    }
    const char *op;
    CUresult r = l2p_ctx_push(d, self->dev->ctx, &op);
    if (r == CUDA_SUCCESS) {
        op = "cuStreamCreateWithPriority";
        r = d->fn.cuStreamCreateWithPriority(&self->side, CU_STREAM_NON_BLOCKING, 0);
        if (r == CUDA_SUCCESS) {
            op = "cuEventCreate";
            r = d->fn.cuEventCreate(&self->join_event, CU_EVENT_DISABLE_TIMING);
        }
        r = l2p_ctx_pop(d, r, &op);   /* on failure teardown() below destroys what was made */
    }
    if (r != CUDA_SUCCESS) {
        l2p_raise_cuda(st, d, op, r);
        goto fail;
    }
    self->state = STATE_OPEN;
    return 0;
fail:
    /* Back to a blank controller: what was created is destroyed (nothing was
     * added, so there are no rows), and __init__ may be called again. */
    if (self->drv) {
        row *chain;
        PyObject *stream_obj;
        const char *failed;
        (void)teardown(self, &chain, &stream_obj, &failed);
        l2p_driver_decref(self->drv);
        self->drv = NULL;
        self->dev = NULL;
    }
    self->state = STATE_UNINIT;
    return -1;
}

static int controller_traverse(controller *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->stream_obj);
    for (int p = 0; p < self->npoints; p++)
        for (int l = 0; l < self->points[p].nlayers; l++) {
            row *r = self->points[p].rows[l];
            for (int i = 0; r && i < r->n; i++)
                Py_VISIT(r->slots[i].ranges);
        }
    return 0;
}

/* Releases what teardown() detached, reporting a failed destroy as
 * unraisable (a destructor never raises). */
static void end_quietly(controller *self)
{
    row *chain;
    PyObject *stream_obj;
    const char *failed;
    CUresult r = teardown(self, &chain, &stream_obj, &failed);
    if (r != CUDA_SUCCESS)
        l2p_report_in_dealloc(self->drv, failed, r, (PyObject *)self);
    free_rows(chain);
    Py_XDECREF(stream_obj);
}

/* Only the garbage collector calls it, on a controller that is garbage: it
 * ends the controller as dealloc would. */
static int controller_clear(controller *self)
{
    end_quietly(self);
    return 0;
}

/* The point names add() interned, and their array. */
static void free_points(controller *self)
{
    for (int p = 0; p < self->npoints; p++)
        Py_DECREF(self->points[p].name);
    PyMem_Free(self->points);
}

static void controller_dealloc(controller *self)
{
    l2p_dealloc_begin((PyObject *)self, self->weakreflist);
    end_quietly(self);
    free_points(self);
    l2p_dealloc_end((PyObject *)self, self->drv);
}

/* ---- add ---- */

PyDoc_STRVAR(add_doc,
"add($self, point, layer, batches, ranges, /, *, graph_fork=None)\n--\n\n"
"Register ranges (a PreparedWeightRanges of this device) for (point, layer, b)\n"
"for each b in batches (an int or an iterable of ints), replacing what was\n"
"there.  graph_fork ('inline', 'branch' or 'leaf') overrides the controller's for\n"
"these keys: how their forks go into a CUDA graph being captured (eager forks\n"
"are the same either way); None keeps the controller's.  The (point, layer)\n"
"event is created and recorded once here, before any capture can begin.");

/* items (n of them, room for *cap) with room for one more: *cap doubled, from
 * first, when full.  The array (moved or not), or NULL with MemoryError, the
 * old one untouched. */
static void *room_for_one(void *items, int n, int *cap, int first, size_t size)
{
    if (n < *cap)
        return items;
    int grown = *cap ? 2 * *cap : first;
    void *more = PyMem_Realloc(items, (size_t)grown * size);
    if (!more) {
        PyErr_NoMemory();
        return NULL;
    }
    *cap = grown;
    return more;
}

/* Whether (name, layer) has its row (and so its event) now. */
static int has_row(controller *self, PyObject *name, long layer)
{
    return find_row(self, find_point(self, name), layer) != NULL;
}

/* The point id of name, appended when new (name: an interned exact str). */
static int point_id(controller *self, PyObject *name)
{
    int p = find_point(self, name);
    if (p >= 0)
        return p;
    point *pts = room_for_one(self->points, self->npoints, &self->cap_points, 4, sizeof *pts);
    if (!pts)
        return -1;
    self->points = pts;
    point *pt = &self->points[self->npoints];
    memset(pt, 0, sizeof *pt);
    pt->name = Py_NewRef(name);
    return self->npoints++;
}

/* The row of (p, layer), made with its event (recorded on cur) when new. */
static row *row_of(controller *self, int p, int layer, CUstream cur)
{
    point *pt = &self->points[p];
    if (layer >= pt->nlayers) {
        int n = pt->nlayers ? pt->nlayers : 8;
        while (n <= layer)
            n *= 2;
        if (n > MAX_LAYER + 1)
            n = MAX_LAYER + 1;
        row **rows = PyMem_Realloc(pt->rows, (size_t)n * sizeof *rows);
        if (!rows) {
            PyErr_NoMemory();
            return NULL;
        }
        memset(rows + pt->nlayers, 0, (size_t)(n - pt->nlayers) * sizeof *rows);
        pt->rows = rows;
        pt->nlayers = n;
    }
    if (pt->rows[layer])
        return pt->rows[layer];
    row *r = PyMem_Calloc(1, sizeof *r);
    if (!r) {
        PyErr_NoMemory();
        return NULL;
    }
    if (self->enabled) {
        l2p_driver *d = self->drv;
        const char *op;
        CUresult rc = l2p_ctx_push(d, self->dev->ctx, &op);
        if (rc == CUDA_SUCCESS) {
            op = "cuEventCreate";
            rc = d->fn.cuEventCreate(&r->event, CU_EVENT_DISABLE_TIMING);
            if (rc == CUDA_SUCCESS) {
                op = "cuEventRecord";
                rc = d->fn.cuEventRecord(r->event, cur);
                if (rc != CUDA_SUCCESS) {
                    (void)d->fn.cuEventDestroy(r->event);
                    r->event = NULL;
                }
            }
            CUresult made = rc;
            rc = l2p_ctx_pop(d, rc, &op);
            if (made == CUDA_SUCCESS && rc != CUDA_SUCCESS) {   /* the pop failed */
                (void)d->fn.cuEventDestroy(r->event);
                r->event = NULL;
            }
        }
        if (rc != CUDA_SUCCESS) {
            PyMem_Free(r);
            l2p_raise_cuda(state_of(self), d, op, rc);
            return NULL;
        }
    }
    pt->rows[layer] = r;
    return r;
}

/* Sets (batch -> ranges, mode) in r; a replaced table goes to *old (the
 * caller drops it after its commit). */
static int set_slot(controller *self, row *r, int batch, int mode, PyObject *ranges, PyObject **old)
{
    int i = slot_at(r, batch);
    if (i < r->n && r->slots[i].batch == batch) {
        *old = r->slots[i].ranges;
        r->slots[i].ranges = Py_NewRef(ranges);
        r->slots[i].mode = mode;
        return 0;
    }
    slot *slots = room_for_one(r->slots, r->n, &r->cap, 8, sizeof *slots);
    if (!slots)
        return -1;
    r->slots = slots;
    memmove(&r->slots[i + 1], &r->slots[i], (size_t)(r->n - i) * sizeof *r->slots);
    r->slots[i].batch = batch;
    r->slots[i].mode = mode;
    r->slots[i].ranges = Py_NewRef(ranges);
    r->n++;
    self->nentries++;
    return 0;
}

static const l2p_signature add_sig = {
    .name = "add",
    .params = (const char *const[]){"point", "layer", "batches", "ranges", "graph_fork", NULL},
    .posonly = 4, .maxpos = 4, .required = 4};

static PyObject *controller_add(controller *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames)
{
    PyObject *vals[5] = {NULL, NULL, NULL, NULL, Py_None};
    if (l2p_parse_args(&add_sig, args, nargs, kwnames, vals) < 0 || check_open(self) < 0)
        return NULL;
    l2p_state *st = state_of(self);
    PyObject *point = vals[0], *layer_obj = vals[1], *batches = vals[2], *ranges = vals[3],
             *mode_obj = vals[4];
    long layer;
    int mode;
    if (!PyUnicode_Check(point) || PyUnicode_GET_LENGTH(point) == 0)
        return PyErr_Format(PyExc_TypeError, "point must be a non-empty str, not %R", point);
    if (as_index(layer_obj, "layer", &layer) < 0)
        return NULL;
    if (layer < 0 || layer > MAX_LAYER)
        return l2p_raise_shown(PyExc_ValueError, layer_obj, "layer must be in 0..%d, got ",
                               MAX_LAYER);
    if (!l2p_prepared_check(st, ranges))
        return PyErr_Format(PyExc_TypeError, "ranges must be a PreparedWeightRanges, not %s", Py_TYPE(ranges)->tp_name);
    if (self->enabled && l2p_prepared_device(ranges) != self->device)
        return PyErr_Format(PyExc_ValueError,
                            "ranges are prepared for cuda:%d but this controller is for cuda:%d",
                            l2p_prepared_device(ranges), self->device);
    if (self->enabled && l2p_prepared_driver(ranges) != self->drv)
        return PyErr_Format(PyExc_ValueError, "ranges were prepared with another CUDA driver instance");
    if (parse_graph_fork(mode_obj, 1, &mode) < 0)
        return NULL;

    /* The name as an interned exact str: hashing, comparing and keeping it runs
     * no code of a str subclass. */
    PyObject *name = PyUnicode_FromObject(point);
    if (!name)
        return NULL;
    PyUnicode_InternInPlace(&name);
    PyObject **old = NULL, *result = NULL;
    Py_ssize_t nb = 0;
    /* Collect and check the batches before changing anything (Python code:
     * the iterable's). */
    PyObject *list = collect_batches(batches);
    if (!list)
        goto done;
    nb = PyTuple_GET_SIZE(list);
    if (nb == 0) {
        PyErr_SetString(PyExc_ValueError, "batches is empty: name at least one batch size");
        goto done;
    }
    if (!(old = PyMem_Calloc((size_t)nb, sizeof *old))) {
        PyErr_NoMemory();
        goto done;
    }
    /* The stream the new (point, layer) event is recorded on: torch's current
     * one; the legacy default stream without torch or without a CUDA torch (an
     * Exception there), while a BaseException (KeyboardInterrupt) propagates. */
    CUstream cur = NULL;
    if (self->enabled && !has_row(self, name, layer) && l2p_current_stream(self->device, &cur) < 0) {
        if (l2p_error_is_base())
            goto done;
        PyErr_Clear();
        cur = NULL;
    }

    /* ---- commit: no Python code from here on, the GIL stays held ---- */
    if (check_open(self) < 0)   /* closed by what ran above */
        goto done;
    int p = point_id(self, name);
    row *r = p < 0 ? NULL : row_of(self, p, (int)layer, cur);
    if (!r)
        goto done;
    self->gen++;
    for (Py_ssize_t i = 0; i < nb; i++)
        if (set_slot(self, r, (int)PyLong_AsLong(PyTuple_GET_ITEM(list, i)), mode, ranges, &old[i]) < 0)
            goto done;   /* the batches before this one stay registered */
    result = Py_NewRef(Py_None);
done:
    /* Replaced tables are released now that the controller is consistent. */
    for (Py_ssize_t i = 0; old && i < nb; i++)
        Py_XDECREF(old[i]);
    PyMem_Free(old);
    Py_XDECREF(list);
    Py_DECREF(name);
    return result;
}

/* ---- fork / join ---- */

/* point, layer, batch of key; no Python code runs (int subclasses are read as
 * they are). */
static int parse_key(PyObject *const *key, long *layer, long *batch)
{
    if (!PyUnicode_Check(key[0])) {
        PyErr_Format(PyExc_TypeError, "point must be a str, not %s", Py_TYPE(key[0])->tp_name);
        return -1;
    }
    return as_index(key[1], "layer", layer) < 0 || as_index(key[2], "batch", batch) < 0 ? -1 : 0;
}

/* The signatures of the methods that take a key or a stream. */
static const l2p_signature fork_sig = {
    .name = "fork",
    .params = (const char *const[]){"point", "layer", "batch", "stream", "activation", NULL},
    .posonly = 3, .maxpos = 4, .required = 3};
static const l2p_signature join_sig = {
    .name = "join", .params = (const char *const[]){"stream", NULL},
    .posonly = 0, .maxpos = 1, .required = 0};
static const char *const key_params[] = {"point", "layer", "batch", NULL};
static const l2p_signature get_sig = {
    .name = "get", .params = key_params, .posonly = 3, .maxpos = 3, .required = 3};
static const l2p_signature get_mode_sig = {
    .name = "get_mode", .params = key_params, .posonly = 3, .maxpos = 3, .required = 3};

/* The capture id of stream s in *id, 0 when it is not capturing (or the driver
 * cannot say: older than 12.3).  A failed query raises CudaError: it is never
 * read as "not capturing". */
static int capture_of(controller *self, CUstream s, unsigned long long *id)
{
    *id = 0;
    if (!self->drv->fn.cuStreamGetCaptureInfo)
        return 0;
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    unsigned long long cid = 0;
    CUresult r = self->drv->fn.cuStreamGetCaptureInfo(s, &status, &cid, NULL, NULL, NULL, NULL);
    if (r != CUDA_SUCCESS)
        return l2p_raise_cuda_int(state_of(self), self->drv, "cuStreamGetCaptureInfo", r);
    *id = status == CU_STREAM_CAPTURE_STATUS_ACTIVE ? cid : 0;
    return 0;
}

/* The fork's launch on stream cur, capturing capture cap ('inline' or 'leaf',
 * capture.c): a leaf is chained to the capture's previous leaf.  Nothing is left
 * pending.  On failure *failed names the driver call. */
static CUresult fork_in_capture(controller *self, PyObject *ranges, const l2p_range *extra,
                                CUstream cur, int mode, unsigned long long cap,
                                const char **failed)
{
    CUgraphNode chain = NULL, node = NULL;
    if (mode == GRAPH_FORK_LEAF && self->leaf_capture == cap)
        chain = self->leaf_tail;
    /* programmatic edges into the loader need sm_90 (NOTE [inline graph fork]) */
    int inl = mode == GRAPH_FORK_INLINE;
    CUresult r = l2p_capture_inline_launch(self->drv, cur, ranges, extra, inl,
                                           inl && self->dev->cc_major >= 9, chain, &node, failed);
    if (mode == GRAPH_FORK_LEAF && node) {
        self->leaf_tail = node;
        self->leaf_capture = cap;
    }
    return r;
}

/* The fork's launch on the side stream after what cur has queued (event ev, the
 * (point, layer)'s): eager, or a 'branch' in capture cap; pending until join().
 * On failure *failed names the driver call. */
static CUresult fork_to_side(controller *self, PyObject *ranges, const l2p_range *extra,
                             CUevent ev, CUstream cur, unsigned long long cap,
                             const char **failed)
{
    l2p_driver *d = self->drv;
    if (!self->pending)
        self->capture_id = cap;
    CUresult r = d->fn.cuEventRecord(ev, cur);
    if (r != CUDA_SUCCESS) {
        *failed = "cuEventRecord";
        return r;
    }
    if ((r = d->fn.cuStreamWaitEvent(self->side, ev, 0)) != CUDA_SUCCESS) {
        *failed = "cuStreamWaitEvent";
        return r;
    }
    self->pending = 1;
    *failed = "cuLaunchKernelEx";
    return l2p_prepared_launch_raw(ranges, self->side, extra);
}

/* At most this much of an activation is read: a decode step's (batch x hidden x 2
 * bytes) is far below it; a prefill's whole input would evict the loads it follows. */
#define WARM_MAX_BYTES (1ull << 20)

/* The range of a fork's activation in *out, its first WARM_MAX_BYTES: 1, or 0 when it
 * has none (empty, or under 16 bytes), -1 with an exception.  Any non-empty activation
 * must be memory of the controller's device, whatever its size, with storage of its own
 * (a wrapper tensor such as a DTensor reports a CUDA device and data pointer 0: the
 * loader would read address 0).  Runs the activation's Python code (ranges.c). */
static int activation_range(controller *self, PyObject *activation, l2p_range *out)
{
    l2p_weight_device dev = {0};
    int rc = l2p_span_of(activation, out, &dev);
    if (rc < 0) {
        if (!l2p_error_is_base())
            l2p_add_note("l2prefetch: while reading fork()'s activation");
        return -1;
    }
    if (dev.empty)
        return 0;
    if (dev.kind != L2P_DEV_OTHER && dev.ptr == 0) {
        PyErr_SetString(PyExc_ValueError, "fork(): activation has no storage of its own (its "
                        "data pointer is 0: a wrapper tensor such as a DTensor, or a nested "
                        "tensor); pass the tensor that holds its memory (DTensor.to_local()), "
                        "or None");
        return -1;
    }
    if (dev.kind == L2P_DEV_UNKNOWN) {   /* __cuda_array_interface__: ask the driver */
        int ordinal = -1;
        if (ensure_context(self) < 0)   /* the query needs one current */
            return -1;
        CUresult r = self->drv->fn.cuPointerGetAttribute(
            &ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, (CUdeviceptr)dev.ptr);
        if (r != CUDA_SUCCESS && r != CUDA_ERROR_INVALID_VALUE)   /* the driver's own fault */
            return l2p_raise_cuda_int(state_of(self), self->drv, "cuPointerGetAttribute", r);
        dev.kind = r == CUDA_SUCCESS && ordinal >= 0 ? L2P_DEV_CUDA : L2P_DEV_OTHER;
        dev.index = ordinal;
    }
    if (dev.kind != L2P_DEV_CUDA) {
        PyErr_Format(PyExc_ValueError, "fork(): activation is not in CUDA device memory; pass a "
                     "tensor on this controller's device, cuda:%d (what the site's next kernel "
                     "reads), or None", self->device);
        return -1;
    }
    if (dev.index != self->device) {
        PyErr_Format(PyExc_ValueError, "fork(): activation is on cuda:%d, this controller on "
                     "cuda:%d; pass a tensor on cuda:%d, or None", dev.index, self->device,
                     self->device);
        return -1;
    }
    if (rc == 0)
        return 0;
    if (out->nbytes > WARM_MAX_BYTES)
        out->nbytes = WARM_MAX_BYTES;
    return 1;
}

PyDoc_STRVAR(fork_doc,
"fork($self, point, layer, batch, /, stream=None, *, activation=None)\n--\n\n"
"Launch the table registered for (point, layer, batch) on the side stream,\n"
"after the work already queued on stream (default: torch's current stream).\n"
"Where that table was made with warm_activation=True, activation (a tensor on\n"
"this device: what the site's next kernel reads; its first MiB) is read last, in\n"
"this launch only, so the loads do not evict it.\n"
"While stream is being captured (graph_fork 'inline' or 'leaf', the controller's\n"
"or the key's), the launch goes on stream itself: with launch-order edges,\n"
"overlapping what follows ('inline'), or as a sink of the graph ('leaf').\n"
"Returns False, doing nothing, when nothing is registered\n"
"there, and with eager=False when stream is not being captured.");

static PyObject *controller_fork(controller *self, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames)
{
    PyObject *vals[5] = {NULL, NULL, NULL, Py_None, Py_None};
    long layer, batch;
    int p;
    if (l2p_parse_args(&fork_sig, args, nargs, kwnames, vals) < 0 ||
        parse_key(vals, &layer, &batch) < 0 || check_open(self) < 0)
        return NULL;
    PyObject *point = vals[0], *stream = vals[3], *activation = vals[4];
    slot *e = lookup(self, point, layer, batch, &p);
    if (!e || !self->enabled)
        Py_RETURN_FALSE;
    unsigned long long gen = self->gen;
    /* read only where the table warms (looked at now: what follows runs Python code) */
    int warm = activation != Py_None && l2p_prepared_warms(e->ranges), has_extra = 0;
    CUstream cur;
    l2p_range extra;
    if (l2p_parse_stream(stream, self->device, &cur) < 0)   /* may run Python code */
        return NULL;
    if (warm && !self->eager) {   /* it forks only while capturing: read it for a launch */
        unsigned long long early = 0;
        if ((self->gen != gen && check_open(self) < 0) || ensure_context(self) < 0 ||
            capture_of(self, cur, &early) < 0)
            return NULL;
        warm = early != 0;
    }
    if (warm && (has_extra = activation_range(self, activation, &extra)) < 0)   /* Python too */
        return NULL;
    if (self->gen != gen) {   /* the tables changed meanwhile: look again */
        if (check_open(self) < 0)
            return NULL;
        if (!(e = lookup(self, point, layer, batch, &p)))
            Py_RETURN_FALSE;
    }
    /* ---- commit: no Python code from here on, the GIL stays held ---- */
    l2p_state *st = state_of(self);
    l2p_driver *d = self->drv;
    if (!l2p_prepared_alive(e->ranges))
        return PyErr_Format(st->error, "the table registered for (%R, %ld, %ld) was cleared by the "
                            "garbage collector: add() a new one", point, layer, batch);
    if (ensure_context(self) < 0)
        return NULL;
    int mode = e->mode == GRAPH_FORK_DEFAULT ? self->graph_fork : e->mode;
    int inline_ok = (mode == GRAPH_FORK_INLINE || mode == GRAPH_FORK_LEAF) &&
                    l2p_capture_inline_available(d);
    unsigned long long cap = 0;
    if ((inline_ok || !self->pending || self->capture_id != 0 || !self->eager) &&
        capture_of(self, cur, &cap) < 0)
        return NULL;
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
    const char *failed;
    /* a table that replaced e's meanwhile may not warm: launch_raw then drops extra */
    const l2p_range *with = has_extra ? &extra : NULL;
    CUresult r = cap && inline_ok
                     ? fork_in_capture(self, e->ranges, with, cur, mode, cap, &failed)
                     : fork_to_side(self, e->ranges, with, self->points[p].rows[layer]->event,
                                    cur, cap, &failed);
    if (r != CUDA_SUCCESS)
        return l2p_raise_cuda(st, d, failed, r);
    self->points[p].forks++;
    self->points[p].bytes += l2p_prepared_nbytes(e->ranges) +
                             (with && l2p_prepared_warms(e->ranges) ? extra.nbytes : 0);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(join_doc,
"join($self, /, stream=None)\n--\n\n"
"If a fork is pending, make stream (default: torch's current stream) wait for\n"
"the side stream.  Call it at the end of every step, inside a captured graph too.\n"
"A fork pending in a capture joins in that capture only: elsewhere (another\n"
"capture, such as the next PIECEWISE piece's, or eagerly) join raises\n"
"l2prefetch.Error and drops it.");

static PyObject *controller_join(controller *self, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames)
{
    PyObject *stream = Py_None;
    if (l2p_parse_args(&join_sig, args, nargs, kwnames, &stream) < 0 || check_open(self) < 0)
        return NULL;
    if (!self->pending)
        Py_RETURN_NONE;
    CUstream cur;
    if (l2p_parse_stream(stream, self->device, &cur) < 0)   /* may run Python code */
        return NULL;
    /* ---- commit: no Python code from here on, the GIL stays held ---- */
    if (check_open(self) < 0)
        return NULL;
    if (!self->pending)   /* joined meanwhile */
        Py_RETURN_NONE;
    l2p_state *st = state_of(self);
    if (ensure_context(self) < 0)
        return NULL;
    /* A fork pending in a capture joins in that capture only: its branch cannot be
     * waited on from another graph or eagerly.  Read only then: an eager join pays no
     * capture-state read. */
    unsigned long long cap = 0;
    if (self->capture_id != 0 && capture_of(self, cur, &cap) < 0)
        return NULL;
    if (cap != self->capture_id) {
        self->pending = 0;
        self->capture_id = 0;
        return PyErr_Format(st->error,
                            "this controller's pending fork was made in a CUDA graph capture, "
                            "and this join() runs %s: call join() in the capture that forked, "
                            "at the end of every captured step (each PIECEWISE piece); that "
                            "capture is invalid", cap ? "in another capture" : "eagerly");
    }
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
    PyObject *key[3];
    long layer, batch;
    int p;
    if (l2p_parse_args(&get_sig, args, nargs, NULL, key) < 0 || parse_key(key, &layer, &batch) < 0)
        return NULL;
    slot *e = lookup(self, key[0], layer, batch, &p);
    return Py_NewRef(e ? e->ranges : Py_None);
}

static PyObject *controller_get_mode(controller *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *key[3];
    long layer, batch;
    int p;
    if (l2p_parse_args(&get_mode_sig, args, nargs, NULL, key) < 0 ||
        parse_key(key, &layer, &batch) < 0)
        return NULL;
    slot *e = lookup(self, key[0], layer, batch, &p);
    if (!e)
        Py_RETURN_NONE;
    return PyUnicode_FromString(graph_fork_names[e->mode == GRAPH_FORK_DEFAULT ? self->graph_fork : e->mode]);
}

/* keys() and stats() copy what they read (names by strong reference) before
 * building Python objects, which may run the garbage collector and any
 * finalizer, so that a change of the tables meanwhile cannot touch the copy. */
typedef struct {
    PyObject *name;
    int layer, batch;
} key_copy;

static PyObject *controller_keys(controller *self, PyObject *unused)
{
    Py_ssize_t n = 0, cap = self->nentries;
    key_copy *keys = PyMem_Malloc((size_t)(cap ? cap : 1) * sizeof *keys);
    if (!keys)
        return PyErr_NoMemory();
    for (int p = 0; p < self->npoints; p++)
        for (int l = 0; l < self->points[p].nlayers; l++) {
            row *r = self->points[p].rows[l];
            for (int i = 0; r && i < r->n && n < cap; i++, n++) {
                keys[n].name = Py_NewRef(self->points[p].name);
                keys[n].layer = l;
                keys[n].batch = r->slots[i].batch;
            }
        }
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list && i < n; i++) {
        PyObject *t = Py_BuildValue("(Oii)", keys[i].name, keys[i].layer, keys[i].batch);
        if (!t)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, i, t);
    }
    for (Py_ssize_t i = 0; i < n; i++)
        Py_DECREF(keys[i].name);
    PyMem_Free(keys);
    return list;
}

static Py_ssize_t controller_len(controller *self)
{
    return self->nentries;
}

static PyObject *controller_stats(controller *self, PyObject *unused)
{
    int n = self->npoints;
    point *copy = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *copy);
    if (!copy)
        return PyErr_NoMemory();
    for (int i = 0; i < n; i++) {
        copy[i] = self->points[i];
        Py_INCREF(copy[i].name);
    }
    PyObject *d = PyDict_New();
    for (int i = 0; d && i < n; i++) {
        PyObject *e = Py_BuildValue("{s:K,s:K}", "forks", copy[i].forks, "bytes", copy[i].bytes);
        if (!e || PyDict_SetItem(d, copy[i].name, e) < 0)
            Py_CLEAR(d);
        Py_XDECREF(e);
    }
    for (int i = 0; i < n; i++)
        Py_DECREF(copy[i].name);
    PyMem_Free(copy);
    return d;
}

static PyObject *controller_reset_stats(controller *self, PyObject *unused)
{
    for (int i = 0; i < self->npoints; i++)
        self->points[i].forks = self->points[i].bytes = 0;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(close_doc,
"close($self, /)\n--\n\n"
"Destroy the side stream and the events and drop the prepared tables (and so\n"
"the weights) now.  Idempotent; the controller refuses use afterwards.");

static PyObject *controller_close(controller *self, PyObject *unused)
{
    if (self->state == STATE_CLOSED)
        Py_RETURN_NONE;
    if (self->state == STATE_INITIALISING) {   /* from Python code its __init__ runs */
        check_open(self);
        return NULL;
    }
    row *chain;
    PyObject *stream_obj;
    const char *failed;
    CUresult r = teardown(self, &chain, &stream_obj, &failed);
    /* The controller is consistent (closed, empty): release what it held. */
    free_rows(chain);
    Py_XDECREF(stream_obj);
    if (r != CUDA_SUCCESS)
        return l2p_raise_cuda(state_of(self), self->drv, failed, r);
    Py_RETURN_NONE;
}

static PyObject *controller_enter(controller *self, PyObject *unused)
{
    if (check_open(self) < 0)
        return NULL;
    return Py_NewRef(self);
}

static PyObject *controller_exit(controller *self, PyObject *const *args, Py_ssize_t nargs)
{
    return controller_close(self, NULL);
}

static PyObject *controller_reduce(PyObject *self, PyObject *args)
{
    return PyErr_Format(PyExc_TypeError,
                        "cannot pickle a PrefetchController: it owns a CUDA stream and events of "
                        "this process; build one where it is used (PrefetchController.from_plan)");
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
    if (self->stream_obj)
        return Py_NewRef(self->stream_obj);
    PyObject *cuda = PyImport_ImportModule("torch.cuda");   /* Python code from here */
    if (!cuda)
        return NULL;
    PyObject *obj = PyObject_CallMethod(cuda, "ExternalStream", "Ki",
                                        (unsigned long long)(uintptr_t)self->side, self->device);
    Py_DECREF(cuda);
    if (!obj)
        return NULL;
    /* Closed meanwhile (the object names a destroyed stream), or made by another
     * call meanwhile (keep that one). */
    PyObject *result = NULL;
    if (check_open(self) == 0) {
        if (!self->stream_obj)
            self->stream_obj = Py_NewRef(obj);
        result = Py_NewRef(self->stream_obj);
    }
    Py_DECREF(obj);
    return result;
}

static PyObject *get_device(controller *self, void *c) { return PyLong_FromLong(self->device); }
static PyObject *get_enabled(controller *self, void *c) { return PyBool_FromLong(self->enabled); }
static PyObject *get_pending(controller *self, void *c) { return PyBool_FromLong(self->pending); }
static PyObject *get_closed(controller *self, void *c) { return PyBool_FromLong(self->state == STATE_CLOSED); }
static PyObject *get_graph_fork(controller *self, void *c)
{
    return PyUnicode_FromString(graph_fork_names[self->graph_fork]);
}
static PyObject *get_points(controller *self, void *c)
{
    int n = self->npoints;
    PyObject *t = PyTuple_New(n);   /* may run Python code; points only grow */
    for (int i = 0; t && i < n; i++)
        PyTuple_SET_ITEM(t, i, Py_NewRef(self->points[i].name));
    return t;
}
static PyObject *get_eager(controller *self, void *c) { return PyBool_FromLong(self->eager); }

#define L2P_GETTER_SELF controller
static PyGetSetDef controller_getset[] = {
    L2P_GETTER(stream, "The side stream as a torch.cuda.ExternalStream (None when disabled)."),
    L2P_GETTER(stream_handle, "The side stream's CUstream handle as an int (0 when disabled)."),
    L2P_GETTER(device, "CUDA device index."),
    L2P_GETTER(enabled, "False when L2PREFETCH_DISABLE was set at construction: forks do nothing."),
    L2P_GETTER(pending, "Whether a fork awaits join()."),
    L2P_GETTER(closed, "Whether close() was called."),
    L2P_GETTER(graph_fork,
               "How a fork goes into a CUDA graph being captured: 'inline' (the prefetch node on the\n"
               "captured stream with launch-order edges; the default), 'branch' (the side stream)\n"
               "or 'leaf' (a sink of the graph after the fork's node).\n"
               "add(..., graph_fork=) overrides it per key; get_mode() says what a key uses."),
    L2P_GETTER(points, "Point names in registration order."),
    L2P_GETTER(eager,
               "Whether fork() launches outside CUDA graph captures (False: only while capturing)."),
    {NULL},
};

static PyMethodDef controller_methods[] = {
    {"add", (PyCFunction)(void (*)(void))controller_add, METH_FASTCALL | METH_KEYWORDS, add_doc},
    {"fork", (PyCFunction)(void (*)(void))controller_fork, METH_FASTCALL | METH_KEYWORDS, fork_doc},
    {"join", (PyCFunction)(void (*)(void))controller_join, METH_FASTCALL | METH_KEYWORDS, join_doc},
    {"get", (PyCFunction)(void (*)(void))controller_get, METH_FASTCALL,
     "get($self, point, layer, batch, /)\n--\n\nThe PreparedWeightRanges registered there, or None."},
    {"get_mode", (PyCFunction)(void (*)(void))controller_get_mode, METH_FASTCALL,
     "get_mode($self, point, layer, batch, /)\n--\n\n"
     "How a fork of that key goes into a CUDA graph being captured: 'inline',\n"
     "'branch' or 'leaf' (its add()'s graph_fork, else the controller's), or None where\n"
     "nothing is registered."},
    {"keys", (PyCFunction)controller_keys, METH_NOARGS,
     "keys($self, /)\n--\n\nRegistered (point, layer, batch) keys: points in registration order,\n"
     "then layers and batches ascending."},
    {"stats", (PyCFunction)controller_stats, METH_NOARGS,
     "stats($self, /)\n--\n\n{point: {'forks': n, 'bytes': b}} since creation or reset_stats()."},
    {"reset_stats", (PyCFunction)controller_reset_stats, METH_NOARGS,
     "reset_stats($self, /)\n--\n\nZero the fork and byte counters."},
    {"close", (PyCFunction)controller_close, METH_NOARGS, close_doc},
    {"__enter__", (PyCFunction)controller_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))controller_exit, METH_FASTCALL, NULL},
    L2P_NO_PICKLE(controller_reduce),
    {NULL},
};

static PyMemberDef controller_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(controller, weakreflist), READONLY},
    {NULL},
};

static PyObject *controller_repr(controller *self)
{
    if (self->state == STATE_UNINIT || self->state == STATE_INITIALISING)
        return PyUnicode_FromString("<PrefetchController not initialised>");
    return PyUnicode_FromFormat("<PrefetchController cuda:%d %zd entries%s%s>", self->device,
                                self->nentries, self->enabled ? "" : " disabled",
                                self->state == STATE_CLOSED ? " closed" : "");
}

PyDoc_STRVAR(controller_doc,
"PrefetchController(device=None, *, graph_fork='inline', eager=True)\n--\n\n"
"Prefetch launches per (point, layer, batch) on one side stream of one CUDA\n"
"device (default: torch's current device).  graph_fork says how a fork goes\n"
"into a CUDA graph being captured: 'inline' puts the prefetch node on the\n"
"captured stream with launch-order edges (no side branch; driver 12.3+,\n"
"older drivers fall back), 'branch' forks to the side stream as in eager mode,\n"
"'leaf' puts it on the captured stream as a sink of the graph (nothing waits\n"
"for it; the modes are python/l2prefetch/mechanisms.py's registry);\n"
"add(..., graph_fork=) overrides it for some keys.\n"
"eager=False makes fork() outside a capture return False without launching:\n"
"a host-bound eager decode step pays a fork's host time and cannot gain.\n"
"With L2PREFETCH_DISABLE=1 in the environment at construction, nothing\n"
"touches the GPU and fork() returns False.\n\n"
"Threads: each call takes effect at one point, after whatever in it can run\n"
"Python code (a stream's properties, iterating batches): calls from several\n"
"threads are serialised there, never interleaved.  Cannot be pickled.");

L2P_DEFINE_TYPE(l2p_controller_spec, "PrefetchController", controller,
                Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
                {Py_tp_new, controller_new},
                {Py_tp_init, controller_init},
                {Py_tp_dealloc, controller_dealloc},
                {Py_tp_traverse, controller_traverse},
                {Py_tp_clear, controller_clear},
                {Py_tp_getset, controller_getset},
                {Py_tp_methods, controller_methods},
                {Py_tp_members, controller_members},
                {Py_tp_repr, controller_repr},
                {Py_mp_length, controller_len},
                {Py_tp_doc, (void *)controller_doc});
