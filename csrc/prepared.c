/*
 * prepared.c: PreparedWeightRanges, one owner for a prefetch: it retains the
 * weights, holds an immutable range table for one CUDA device, the compiled
 * function, and a launch configuration filled once, so that launch() only sets
 * the stream and calls cuLaunchKernelEx.
 *
 * The range table is the kernel's parameter block (kernels/prefetch.cu,
 * L2pTable): no device memory to allocate or free, and captured CUDA graphs
 * copy it into the kernel node.  The smallest table capacity that fits is used.
 *
 * With warm_activation the table keeps one slot free: a fork may append the
 * activation at its site (controller.c), so that the loads end by reading back
 * what the next kernel reads first and they would otherwise evict (RESULTS run 36).
 */
#include "l2p.h"

#include "structmember.h"

/* The kernel's parameter block: kernels/prefetch.cu's L2pTable<CAP>, CAP the
 * capacity (l2p_capacities), l2p_range being its L2pRange.  The one place its
 * layout is written in C. */
typedef struct {
    uint64_t count;           /* ranges used */
    uint64_t granules;        /* sum of nbytes / 16 over them */
    l2p_range ranges[];       /* CAP entries, those past count zero */
} param_block;
_Static_assert(sizeof(param_block) == 16 && offsetof(param_block, ranges) == 16 &&
                   sizeof(l2p_range) == 16 && offsetof(l2p_range, nbytes) == 8,
               "the layout of prefetch.cu's L2pTable: two u64, then (u64 ptr, u64 nbytes) ranges");

struct l2p_prepared {
    PyObject_HEAD
    l2p_driver *drv;
    l2p_device *dev;
    int device;
    PyObject *weights;        /* tuple, retained for our lifetime */
    PyObject *storages;       /* tuple: the storages of the weights that gave ranges */
    PyObject *ranges_tuple;   /* ((ptr, nbytes), ...) */
    Py_ssize_t nranges;
    uint64_t nbytes;
    int grid;
    int carveout;             /* -2: None */
    int priority;             /* 0 or 1 */
    int warm;                 /* warm_activation: one slot kept for a fork's activation */
    unsigned capacity;        /* l2p_capacities[cap]: the table's ranges */
    int variant;
    CUfunction func;
    CUlaunchConfig cfg;
    CUlaunchAttribute attrs[2];
    void *params[1];          /* the launch's parameter array: {table}, as long as we live */
    param_block *table;       /* the kernel's one parameter */
    PyObject *weakreflist;
};

#define NO_CARVEOUT (-2)

int l2p_prepared_check(l2p_state *st, PyObject *obj)
{
    return PyObject_TypeCheck(obj, st->prepared_type);
}

int l2p_prepared_device(PyObject *obj)
{
    return ((l2p_prepared *)obj)->device;
}

uint64_t l2p_prepared_nbytes(PyObject *obj)
{
    return ((l2p_prepared *)obj)->nbytes;
}

l2p_driver *l2p_prepared_driver(PyObject *obj)
{
    return ((l2p_prepared *)obj)->drv;
}

int l2p_prepared_alive(PyObject *obj)
{
    return ((l2p_prepared *)obj)->weights != NULL;
}

int l2p_prepared_warms(PyObject *obj)
{
    return ((l2p_prepared *)obj)->warm;
}

/* The kernel's parameter array: self's own ({table}), or (extra given and self
 * warms) slot, pointing at a copy of the table in buf with extra in the kept slot.
 * A launch and a graph node copy their parameters, so slot and buf can live on the
 * caller's stack. */
static void **params_with(l2p_prepared *self, const l2p_range *extra, uint64_t *buf,
                          void **slot)
{
    if (!extra || !self->warm)
        return self->params;
    param_block *copy = (param_block *)buf;
    memcpy(copy, self->table, sizeof *copy + self->capacity * sizeof copy->ranges[0]);
    copy->ranges[copy->count++] = *extra;
    copy->granules += extra->nbytes / 16;
    slot[0] = copy;
    return slot;
}

CUresult l2p_prepared_launch_raw(PyObject *obj, CUstream stream, const l2p_range *extra)
{
    l2p_prepared *self = (l2p_prepared *)obj;
    uint64_t buf[L2P_TABLE_WORDS];
    void *slot[1];
    self->cfg.hStream = stream;
    return self->drv->fn.cuLaunchKernelEx(&self->cfg, self->func,
                                          params_with(self, extra, buf, slot), NULL);
}

void l2p_prepared_node_params(PyObject *obj, CUDA_KERNEL_NODE_PARAMS *p, const l2p_range *extra,
                              uint64_t *buf, void **slot)
{
    l2p_prepared *self = (l2p_prepared *)obj;
    memset(p, 0, sizeof *p);
    p->func = self->func;
    p->gridDimX = self->cfg.gridDimX;
    p->gridDimY = self->cfg.gridDimY;
    p->gridDimZ = self->cfg.gridDimZ;
    p->blockDimX = self->cfg.blockDimX;
    p->blockDimY = self->cfg.blockDimY;
    p->blockDimZ = self->cfg.blockDimZ;
    p->sharedMemBytes = self->cfg.sharedMemBytes;
    p->kernelParams = params_with(self, extra, buf, slot);
}

static int check_int(PyObject *o, const char *what, long lo, long hi, long *out)
{
    if (!PyLong_Check(o) || PyBool_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        v = lo - 1;
    }
    if (v < lo || v > hi)
        return l2p_raise_shown(PyExc_ValueError, o, "%s must be in %ld..%ld, got ", what, lo,
                               hi), -1;
    *out = v;
    return 0;
}

/* Which device the weights are on; raises on CPU tensors and on mixed devices. */
static int weights_device(l2p_state *st, PyObject *weights, l2p_weight_device *devs,
                          PyObject *names, int *device)
{
    Py_ssize_t n = PyTuple_GET_SIZE(weights);
    int found = -1;
    Py_ssize_t first = -1;
    l2p_driver *d = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (devs[i].kind == L2P_DEV_OTHER) {
            PyErr_Format(PyExc_ValueError,
                         "weight %zd is on %S, not on a CUDA device: PreparedWeightRanges needs CUDA "
                         "tensors (move it with .cuda())", i, PyList_GET_ITEM(names, i));
            return -1;
        }
        if (!devs[i].empty && devs[i].ptr == 0) {   /* the loader would read address 0 */
            PyErr_Format(PyExc_ValueError,
                         "weight %zd (on %S) has no storage of its own: its data pointer is 0 "
                         "(a wrapper tensor such as a DTensor, or a nested tensor); pass the "
                         "tensor that holds its memory (DTensor.to_local())",
                         i, PyList_GET_ITEM(names, i));
            return -1;
        }
        if (devs[i].kind == L2P_DEV_UNKNOWN) {
            if (devs[i].empty)
                continue;
            if (!d && !(d = l2p_use_driver(st)))
                return -1;
            int ordinal = -1;
            CUresult r = d->fn.cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                                     (CUdeviceptr)devs[i].ptr);
            if (r != CUDA_SUCCESS) {
                /* PyErr_Format has no %llx before Python 3.12 */
                char addr[24];
                const char *ename = NULL;
                PyOS_snprintf(addr, sizeof addr, "0x%llx", (unsigned long long)devs[i].ptr);
                if (d->fn.cuGetErrorName(r, &ename) != CUDA_SUCCESS || !ename)
                    ename = "unknown error";
                PyErr_Format(PyExc_ValueError,
                             "weight %zd (__cuda_array_interface__ at %s) is not CUDA device "
                             "memory the driver knows (cuPointerGetAttribute failed: %s)",
                             i, addr, ename);
                return -1;
            }
            devs[i].index = ordinal;
            devs[i].kind = L2P_DEV_CUDA;
        }
        if (found < 0) {
            found = devs[i].index;
            first = i;
        } else if (devs[i].index != found) {
            PyErr_Format(PyExc_ValueError,
                         "weights are on different devices: weight %zd on cuda:%d, weight %zd on "
                         "cuda:%d; all weights of one PreparedWeightRanges must be on one CUDA device",
                         first, found, i, devs[i].index);
            return -1;
        }
    }
    *device = found;
    return 0;
}

/* self's parameter block, capacity index cap, and its ranges tuple, from its
 * nranges ranges.  The (ptr, nbytes) pairs are made first and the tuple last,
 * with no allocation while it is filled: a collection started by one (and the
 * finalizers it runs) would find a tracked tuple with NULL slots. */
static int fill_table(l2p_prepared *self, const l2p_range *ranges, int cap)
{
    Py_ssize_t n = self->nranges, made = 0;
    int rc = -1;
    PyObject **pairs = PyMem_Calloc((size_t)n + 1, sizeof *pairs);
    self->table = PyMem_Calloc(1, sizeof *self->table +
                                      (size_t)l2p_capacities[cap] * sizeof self->table->ranges[0]);
    if (!pairs || !self->table) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t granules = 0;
    for (; made < n; made++) {
        self->table->ranges[made] = ranges[made];
        granules += ranges[made].nbytes / 16;
        self->nbytes += ranges[made].nbytes;
        pairs[made] = Py_BuildValue("(KK)", (unsigned long long)ranges[made].ptr,
                                    (unsigned long long)ranges[made].nbytes);
        if (!pairs[made])
            goto done;
    }
    if (!(self->ranges_tuple = PyTuple_New(n)))
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {   /* each pair's reference moves into the tuple */
        PyTuple_SET_ITEM(self->ranges_tuple, i, pairs[i]);
        pairs[i] = NULL;
    }
    self->table->count = (uint64_t)n;
    self->table->granules = granules;
    self->params[0] = self->table;
    rc = 0;
done:
    for (Py_ssize_t i = 0; pairs && i < made; i++)
        Py_XDECREF(pairs[i]);
    PyMem_Free(pairs);
    return rc;
}

/* self's launch configuration and attributes, from its variant, grid,
 * priority and carveout. */
static void fill_config(l2p_prepared *self)
{
    const l2p_variant *v = &l2p_variants[self->variant];
    CUlaunchConfig *c = &self->cfg;
    c->gridDimX = (unsigned)self->grid;
    c->gridDimY = c->gridDimZ = 1;
    c->blockDimX = v->block;
    c->blockDimY = c->blockDimZ = 1;
    c->sharedMemBytes = v->smem;
    c->attrs = self->attrs;
    c->numAttrs = 0;
    if (self->priority) {   /* the context's greatest (most urgent) priority */
        CUlaunchAttribute *a = &self->attrs[c->numAttrs++];
        a->id = CU_LAUNCH_ATTRIBUTE_PRIORITY;
        a->value.priority = self->dev->greatest_priority;
    }
    if (self->carveout != NO_CARVEOUT) {
        CUlaunchAttribute *a = &self->attrs[c->numAttrs++];
        a->id = CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT;
        a->value.sharedMemCarveout = (unsigned)self->carveout;
    }
}

static PyObject *prepared_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"weights", "byte_cap", "grid", "carveout", "priority", "kernel",
                             "device", "warm_activation", NULL};
    PyObject *weights, *cap_obj = NULL, *grid_obj = NULL, *carveout_obj = Py_None,
                       *priority_obj = Py_False, *kernel_obj = Py_None, *device_obj = Py_None,
                       *warm_obj = Py_False;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|$OOOOOOO:PreparedWeightRanges", kwlist,
                                     &weights, &cap_obj, &grid_obj, &carveout_obj, &priority_obj,
                                     &kernel_obj, &device_obj, &warm_obj))
        return NULL;
    l2p_state *st = l2p_state_of_type(type);
    long byte_cap = 0, grid = 32, carveout = NO_CARVEOUT;
    if (cap_obj && check_int(cap_obj, "byte_cap", 0, LONG_MAX, &byte_cap) < 0)
        return NULL;
    if (byte_cap > 0 && byte_cap < 16)   /* plan.MIN_BYTE_CAP: PlanEntry refuses it alike */
        return PyErr_Format(PyExc_ValueError, "byte_cap must be 0 (no cap) or at least 16 bytes "
                            "(ranges are cut to 16-byte units, so a smaller cap loads nothing), "
                            "got %ld", byte_cap);
    if (grid_obj && check_int(grid_obj, "grid", 1, 65535, &grid) < 0)
        return NULL;
    if (carveout_obj != Py_None && check_int(carveout_obj, "carveout (percent of the unified L1/shared memory, -1 for the default)", -1, 100, &carveout) < 0)
        return NULL;
    if (!PyBool_Check(priority_obj))
        return PyErr_Format(PyExc_TypeError, "priority must be a bool, not %s", Py_TYPE(priority_obj)->tp_name);
    if (!PyBool_Check(warm_obj))
        return PyErr_Format(PyExc_TypeError, "warm_activation must be a bool, not %s", Py_TYPE(warm_obj)->tp_name);
    int warm = warm_obj == Py_True;
    if (kernel_obj != Py_None && !PyUnicode_Check(kernel_obj))
        return PyErr_Format(PyExc_TypeError, "kernel must be a variant name (str) or None, not %s", Py_TYPE(kernel_obj)->tp_name);
    int asked_device = -1;
    if (l2p_parse_device(device_obj, &asked_device) < 0)
        return NULL;

    l2p_range *ranges = NULL;
    l2p_weight_device *devs = NULL;
    PyObject *names = NULL, *storages = NULL;
    Py_ssize_t nranges = 0;
    PyObject *tuple = l2p_compute_ranges(weights, byte_cap, &ranges, &nranges, &devs, &names,
                                         &storages);
    if (!tuple)
        return NULL;
    l2p_prepared *self = NULL;
    l2p_driver *held = NULL;
    int device = -1;
    if (weights_device(st, tuple, devs, names, &device) < 0)
        goto done;
    if (device >= 0 && asked_device >= 0 && device != asked_device) {
        PyErr_Format(PyExc_ValueError, "device=cuda:%d but the weights are on cuda:%d", asked_device, device);
        goto done;
    }
    if (device < 0) {
        device = asked_device;
        if (device < 0 && l2p_default_device(&device) < 0)
            goto done;
    }
    if (nranges + warm > (Py_ssize_t)L2P_MAX_TABLE) {
        PyErr_Format(PyExc_ValueError,
                     "%zd ranges, but one PreparedWeightRanges holds at most %u%s: split the weights "
                     "over several (or cap them with byte_cap)",
                     nranges, L2P_MAX_TABLE - warm, warm ? " with warm_activation=True" : "");
        goto done;
    }

    /* Held to the end: the allocations and the compile below can run Python
     * code (a finalizer, a warning filter) that swaps the module's driver. */
    l2p_driver *d = l2p_hold_driver(st);
    if (!d)
        goto done;
    held = d;
    l2p_device *dev = l2p_use_device(st, d, device);
    if (!dev)
        goto done;
    int sm = dev->cc_major * 10 + dev->cc_minor;
    int variant = kernel_obj == Py_None ? l2p_variant_default(sm)
                                        : l2p_variant_arg(kernel_obj);
    if (variant < 0) {
        if (!PyErr_Occurred())   /* the variant table names no default for sm */
            PyErr_Format(PyExc_ValueError, "no default kernel variant for sm_%d: pass kernel=", sm);
        goto done;
    }
    if (l2p_variant_check_sm(variant, sm, device) < 0)
        goto done;
    const l2p_variant *v = &l2p_variants[variant];
    if (v->smem > (unsigned)dev->smem_optin) {
        PyErr_Format(PyExc_ValueError, "kernel variant '%s' needs %u bytes of shared memory per CTA; "
                     "cuda:%d allows %d", v->name, v->smem, device, dev->smem_optin);
        goto done;
    }
    if (carveout != NO_CARVEOUT && d->version < L2P_CARVEOUT_DRIVER_VERSION) {
        PyErr_Format(PyExc_ValueError, "carveout needs a CUDA 12.4 driver or newer (this one is %d.%d); "
                     "pass carveout=None", d->version / 1000, (d->version % 1000) / 10);
        goto done;
    }
    int cap = 0;
    while ((Py_ssize_t)l2p_capacities[cap] < nranges + warm)
        cap++;

    self = (l2p_prepared *)type->tp_alloc(type, 0);
    if (!self)
        goto done;
    /* Out of the collector's sight until whole: the compile and the allocations
     * below can run Python code (a finalizer) that would find it through
     * gc.get_objects() with no table, no ranges and no kernel. */
    PyObject_GC_UnTrack(self);
    self->drv = d;
    l2p_driver_incref(d);
    self->dev = dev;
    self->device = device;
    self->weights = tuple;
    tuple = NULL;
    self->storages = storages;
    storages = NULL;
    self->nranges = nranges;
    self->grid = (int)grid;
    self->carveout = (int)carveout;
    self->priority = priority_obj == Py_True;
    self->warm = warm;
    self->capacity = l2p_capacities[cap];
    self->variant = variant;
    if (l2p_kernel_function(st, d, dev, variant, cap, &self->func) < 0 ||
        fill_table(self, ranges, cap) < 0) {
        Py_CLEAR(self);
        goto done;
    }
    fill_config(self);
    PyObject_GC_Track(self);
done:
    Py_XDECREF(tuple);
    Py_XDECREF(storages);
    PyMem_Free(ranges);
    PyMem_Free(devs);
    Py_XDECREF(names);
    l2p_driver_decref(held);
    return (PyObject *)self;   /* NULL on failure */
}

static int prepared_traverse(l2p_prepared *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->weights);
    Py_VISIT(self->storages);
    return 0;
}

static int prepared_clear(l2p_prepared *self)
{
    Py_CLEAR(self->weights);
    Py_CLEAR(self->storages);
    return 0;
}

static void prepared_dealloc(l2p_prepared *self)
{
    l2p_dealloc_begin((PyObject *)self, self->weakreflist);
    prepared_clear(self);
    Py_CLEAR(self->ranges_tuple);
    PyMem_Free(self->table);
    l2p_dealloc_end((PyObject *)self, self->drv);
}

PyDoc_STRVAR(launch_doc,
"launch($self, /, stream=None)\n--\n\n"
"Launch the prefetch on stream: a torch.cuda.Stream, an int CUstream handle, or\n"
"None for torch's current stream on this table's device.  Returns None; the\n"
"kernel runs asynchronously.");

static const l2p_signature launch_sig = {
    .name = "launch", .params = (const char *const[]){"stream", NULL},
    .posonly = 0, .maxpos = 1, .required = 0};

static PyObject *prepared_launch(l2p_prepared *self, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames)
{
    PyObject *stream = Py_None;
    if (l2p_parse_args(&launch_sig, args, nargs, kwnames, &stream) < 0)
        return NULL;
    l2p_state *st = l2p_state_of_type(Py_TYPE(self));
    CUstream s;
    if (l2p_parse_stream(stream, self->device, &s) < 0)   /* may run Python code */
        return NULL;
    if (!self->weights)
        return PyErr_Format(st->error,
                            "this PreparedWeightRanges was cleared by the garbage collector (a "
                            "reference cycle it was part of is being freed): it cannot launch");
    CUresult r = l2p_ensure_current(self->drv, self->dev);
    if (r == CUDA_ERROR_INVALID_CONTEXT)
        return PyErr_Format(PyExc_RuntimeError,
                            "another CUDA context is current on this thread, but this table is for "
                            "cuda:%d: launch it under torch.cuda.device(%d)", self->device, self->device);
    if (r != CUDA_SUCCESS)
        return l2p_raise_cuda(st, self->drv, "cuCtxGetCurrent/cuCtxSetCurrent", r);
    if (stream != Py_None && PyLong_Check(stream) && s != NULL) {
        CUcontext ctx = NULL;
        r = self->drv->fn.cuStreamGetCtx(s, &ctx);
        if (r != CUDA_SUCCESS)
            return l2p_raise_cuda(st, self->drv, "cuStreamGetCtx", r);
        if (ctx != self->dev->ctx) {
            char handle[24];   /* PyErr_Format has no %llx before Python 3.12 */
            PyOS_snprintf(handle, sizeof handle, "0x%llx", (unsigned long long)(uintptr_t)s);
            return PyErr_Format(PyExc_ValueError,
                                "stream %s belongs to another device's context; this table is "
                                "for cuda:%d", handle, self->device);
        }
    }
    r = l2p_prepared_launch_raw((PyObject *)self, s, NULL);
    if (r != CUDA_SUCCESS)
        return l2p_raise_cuda(st, self->drv, "cuLaunchKernelEx", r);
    Py_RETURN_NONE;
}

static PyObject *get_weights(l2p_prepared *self, void *c) { return Py_NewRef(self->weights ? self->weights : Py_None); }
static PyObject *get_ranges(l2p_prepared *self, void *c) { return Py_NewRef(self->ranges_tuple); }
static PyObject *get_nbytes(l2p_prepared *self, void *c) { return PyLong_FromUnsignedLongLong(self->nbytes); }
static PyObject *get_grid(l2p_prepared *self, void *c) { return PyLong_FromLong(self->grid); }
static PyObject *get_block(l2p_prepared *self, void *c) { return PyLong_FromUnsignedLong(self->cfg.blockDimX); }
static PyObject *get_smem(l2p_prepared *self, void *c) { return PyLong_FromUnsignedLong(self->cfg.sharedMemBytes); }
static PyObject *get_priority(l2p_prepared *self, void *c) { return PyBool_FromLong(self->priority); }
static PyObject *get_device(l2p_prepared *self, void *c) { return PyLong_FromLong(self->device); }
static PyObject *get_warm_activation(l2p_prepared *self, void *c) { return PyBool_FromLong(self->warm); }
static PyObject *get_kernel(l2p_prepared *self, void *c) { return PyUnicode_FromString(l2p_variants[self->variant].name); }
static PyObject *get_carveout(l2p_prepared *self, void *c)
{
    if (self->carveout == NO_CARVEOUT)
        Py_RETURN_NONE;
    return PyLong_FromLong(self->carveout);
}
static PyObject *get_launch_priority(l2p_prepared *self, void *c)
{
    if (!self->priority)
        Py_RETURN_NONE;
    return PyLong_FromLong(self->dev->greatest_priority);
}

#define L2P_GETTER_SELF l2p_prepared
static PyGetSetDef prepared_getset[] = {
    L2P_GETTER(weights, "The weights, retained for this object's lifetime (with the storage of "
                        "each tensor that gave a range)."),
    L2P_GETTER(ranges, "((ptr, nbytes), ...): the byte ranges launched."),
    L2P_GETTER(nbytes, "Total bytes one launch pulls into L2."),
    L2P_GETTER(grid, "CTAs per launch."),
    L2P_GETTER(block, "Threads per CTA (fixed by the kernel variant)."),
    L2P_GETTER(smem, "Dynamic shared memory per CTA in bytes."),
    L2P_GETTER(carveout, "Preferred shared-memory carveout (percent) or None."),
    L2P_GETTER(priority, "Whether launches carry the greatest stream priority."),
    L2P_GETTER(launch_priority, "The priority value launches carry, or None."),
    L2P_GETTER(device, "CUDA device index."),
    L2P_GETTER(kernel, "Kernel variant name."),
    L2P_GETTER(warm_activation, "Whether a fork may append its site's activation (one slot kept)."),
    {NULL},
};

static PyObject *prepared_repr(l2p_prepared *self)
{
    return PyUnicode_FromFormat("<PreparedWeightRanges cuda:%d %zd ranges, %llu bytes, kernel=%s grid=%d>",
                                self->device, self->nranges, (unsigned long long)self->nbytes,
                                l2p_variants[self->variant].name, self->grid);
}

static PyObject *prepared_reduce(PyObject *self, PyObject *args)
{
    return PyErr_Format(PyExc_TypeError,
                        "cannot pickle a PreparedWeightRanges: it holds device addresses and a "
                        "compiled function of this process; prepare the weights again where they "
                        "are used");
}

static PyMethodDef prepared_methods[] = {
    {"launch", (PyCFunction)(void (*)(void))prepared_launch, METH_FASTCALL | METH_KEYWORDS, launch_doc},
    L2P_NO_PICKLE(prepared_reduce),
    {NULL},
};

static PyMemberDef prepared_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(l2p_prepared, weakreflist), READONLY},
    {NULL},
};

PyDoc_STRVAR(prepared_doc,
"PreparedWeightRanges(weights, *, byte_cap=0, grid=32, carveout=None, priority=False,\n"
"                     kernel=None, device=None, warm_activation=False)\n--\n\n"
"The byte ranges of weights (tensors on one CUDA device), the compiled prefetch\n"
"kernel and a ready launch configuration.  byte_cap (bytes, 0 for none, else at\n"
"least 16) caps the total in order; grid is the CTA count (1..65535); carveout\n"
"(-1..100) and priority=True (the context's greatest stream priority) become launch\n"
"attributes; kernel names a variant (default: 'ring' on sm_90+, 'load' on\n"
"sm_80-sm_89).  With no weights, device= picks the device (an empty launch: the\n"
"control for measurements).  warm_activation=True keeps one range free for\n"
"PrefetchController.fork(..., activation=): the loads then end by reading the\n"
"tensor the site's next kernel reads, which they would otherwise evict.  The\n"
"weights and, for tensors, the storages their ranges lie in stay alive with this\n"
"object: model.to(dtype) after prepare swaps each parameter's storage, and the\n"
"ranges then read the old bytes (prepare again to load the new ones).");

L2P_DEFINE_TYPE(l2p_prepared_spec, "PreparedWeightRanges", l2p_prepared,
                Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
                {Py_tp_new, prepared_new},
                {Py_tp_dealloc, prepared_dealloc},
                {Py_tp_traverse, prepared_traverse},
                {Py_tp_clear, prepared_clear},
                {Py_tp_getset, prepared_getset},
                {Py_tp_methods, prepared_methods},
                {Py_tp_members, prepared_members},
                {Py_tp_repr, prepared_repr},
                {Py_tp_doc, (void *)prepared_doc});
