/*
 * ranges.c: the byte ranges of a list of weights, with the reference design's
 * rules.
 *
 * Weights are torch tensors (read through data_ptr/shape/stride/element_size,
 * so any device works: this is arithmetic) or objects with
 * __cuda_array_interface__ (v2/v3; strides in bytes or None).  Each non-empty
 * weight covers its lowest to its highest byte: with strides s_i and sizes n_i
 * the span is (sum of (n_i - 1) * s_i over positive strides, minus the same over
 * negative ones) + one element, which for non-negative strides is the reference
 * design's 1 + sum((n - 1) * stride) elements.  A range must start 16-byte aligned (the
 * kernel moves 16-byte granules).  With a byte cap, each size is
 * min(size, remaining) rounded down to 16, the cap is spent in order, and the
 * walk stops giving ranges once fewer than 16 bytes remain; the weights after
 * that are still read and checked (types, shapes, spans, alignment), so that the
 * same list is valid or invalid whatever the cap.  A weight with a zero in its shape is
 * empty: no range, no alignment or span check, whatever its other sizes.  All
 * arithmetic is checked: a span that would not fit in 63 bits is an
 * OverflowError, never a wrong range.
 *
 * Reading a weight runs Python code (properties, __index__ of each size,
 * __len__/__iter__ of a shape that is no tuple), which may change or free what
 * was read before.  So every object read is held by a strong reference (the
 * interface dict's items are taken out of it at once), shapes and strides are
 * copied to C integers before any arithmetic, and only a missing attribute
 * means "not a tensor": any other exception passes through, an Exception with a
 * note naming the weight, a BaseException (KeyboardInterrupt) untouched.
 * compute_ranges also binds each tensor's range to its untyped_storage()
 * (bind_storage): the range must lie inside it, and PreparedWeightRanges keeps it.
 */
#include "l2p.h"

typedef struct {
    int empty;
    uint64_t lo;        /* first byte */
    uint64_t nbytes;    /* span in bytes */
    l2p_weight_device dev;
    PyObject *device;   /* str for messages */
    PyObject *dtype;    /* str for messages */
    PyObject *shape;    /* tuple for messages */
    PyObject *storage;  /* a tensor's untyped_storage(), when bound (bind_storage) */
} weight_info;

/* What a message calls the object read: "weight N" (index >= 0) or "the activation"
 * (index -1, l2p_span_of's fork() activation).  WHO gives each use its own buffer,
 * alive to the end of the statement that formats the message. */
static const char *who(Py_ssize_t index, char *buf, size_t size)
{
    if (index < 0)
        return "the activation";
    PyOS_snprintf(buf, size, "weight %zd", index);
    return buf;
}
#define WHO(index) who((index), (char[32]){0}, 32)

static void info_clear(weight_info *w)
{
    Py_CLEAR(w->device);
    Py_CLEAR(w->dtype);
    Py_CLEAR(w->shape);
    Py_CLEAR(w->storage);
}

/* After a failed call into a weight's own code: a note saying which weight it
 * was (BaseExceptions pass untouched).  Returns -1. */
static int noted(Py_ssize_t index, const char *what)
{
    if (!l2p_error_is_base())
        l2p_add_note("l2prefetch: while reading %s of %s", what, WHO(index));
    return -1;
}

/* obj.name() as a new reference; NULL with a note naming WHAT of weight index. */
static PyObject *call_noted(PyObject *obj, const char *name, Py_ssize_t index, const char *what)
{
    PyObject *result = PyObject_CallMethod(obj, name, NULL);
    if (!result)
        noted(index, what);
    return result;
}

/* 1 when o has data_ptr, element_size and stride (a tensor), 0 when it lacks
 * one, -1 when looking raised anything but AttributeError. */
static int is_tensor_like(PyObject *o)
{
    static const char *const names[] = {"data_ptr", "element_size", "stride"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        PyObject *a;
        int r = l2p_optional_attr(o, names[i], &a);
        Py_XDECREF(a);
        if (r <= 0)
            return r;
    }
    return 1;
}

/* 1 when o has __cuda_array_interface__, 0 when not, -1 on another error. */
static int has_interface(PyObject *o)
{
    PyObject *a;
    int r = l2p_optional_attr(o, "__cuda_array_interface__", &a);
    Py_XDECREF(a);
    return r;
}

static int get_u64(PyObject *o, uint64_t *out, Py_ssize_t index, const char *what)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (l2p_error_is_base())
            return -1;
        PyObject *shown = l2p_shown(o);
        if (shown) {
            l2p_format_from_cause(PyExc_ValueError, "%s: %s must be a non-negative integer, got %U",
                                  WHO(index), what, shown);
            Py_DECREF(shown);
        }
        return -1;
    }
    *out = v;
    return 0;
}

/* obj (a size, a stride, an element size) as an int64 through its __index__;
 * errors name the weight and what obj is. */
static int get_i64(PyObject *obj, Py_ssize_t index, const char *what, Py_ssize_t pos, int64_t *out)
{
    char label[64];
    if (pos >= 0)
        PyOS_snprintf(label, sizeof label, "%s element %zd", what, pos);
    else
        PyOS_snprintf(label, sizeof label, "%s", what);
    PyObject *num = PyNumber_Index(obj);
    if (!num) {
        if (PyErr_ExceptionMatches(PyExc_TypeError))
            return (l2p_format_from_cause(PyExc_TypeError, "%s: %s must be an int, not %s",
                                          WHO(index), label, Py_TYPE(obj)->tp_name), -1);
        return noted(index, label);
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(num, &overflow);
    if (overflow) {
        PyObject *shown = l2p_shown(num);
        if (shown) {
            PyErr_Format(PyExc_OverflowError, "%s: %s is %U, which does not fit in 64 bits",
                         WHO(index), label, shown);
            Py_DECREF(shown);
        }
        Py_DECREF(num);
        return -1;
    }
    Py_DECREF(num);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)v;
    return 0;
}

/* seq as a tuple (a new reference): the object itself when it is one, else a
 * copy made by iterating it. */
static PyObject *as_tuple(PyObject *seq, Py_ssize_t index, const char *what)
{
    if (PyTuple_Check(seq))
        return Py_NewRef(seq);
    PyObject *t = PySequence_Tuple(seq);
    if (!t) {
        if (PyErr_ExceptionMatches(PyExc_TypeError))
            l2p_format_from_cause(PyExc_TypeError, "%s: %s must be a sequence of ints, not %s",
                                  WHO(index), what, Py_TYPE(seq)->tp_name);
        else
            noted(index, what);
    }
    return t;
}

#define SMALL_NDIM 16

/* lo/hi offsets (bytes) of a strided view; item = element size.  shape and
 * strides (NULL: C-contiguous) are tuples the caller holds. */
static int span_of(PyObject *shape, PyObject *strides, int64_t scale, int64_t item,
                   Py_ssize_t index, int *empty, int64_t *lo, int64_t *span)
{
    Py_ssize_t nd = PyTuple_GET_SIZE(shape);
    if (strides && PyTuple_GET_SIZE(strides) != nd) {
        PyErr_Format(PyExc_ValueError, "%s: shape %R and strides %R differ in length",
                     WHO(index), shape, strides);
        return -1;
    }
    int64_t small[2 * SMALL_NDIM];
    int64_t *dims = nd <= SMALL_NDIM ? small : PyMem_Calloc(2 * (size_t)nd, sizeof *dims);
    if (!dims) {
        PyErr_NoMemory();
        return -1;
    }
    int64_t *steps = dims + nd;
    int rc = -1;
    *empty = 0;
    /* Every size and stride first, through __index__ (Python code): the
     * arithmetic below then reads only C integers. */
    for (Py_ssize_t i = 0; i < nd; i++) {
        if (get_i64(PyTuple_GET_ITEM(shape, i), index, "shape", i, &dims[i]) < 0)
            goto done;
        if (dims[i] < 0) {
            PyErr_Format(PyExc_ValueError, "%s: negative size %lld in shape %R", WHO(index),
                         (long long)dims[i], shape);
            goto done;
        }
        if (dims[i] == 0)
            *empty = 1;
    }
    for (Py_ssize_t i = 0; strides && i < nd; i++)
        if (get_i64(PyTuple_GET_ITEM(strides, i), index, "strides", i, &steps[i]) < 0)
            goto done;
    rc = 0;
    if (*empty)   /* no bytes, whatever the other sizes */
        goto done;
    int64_t neg = 0, pos = 0, numel = 1;
    for (Py_ssize_t i = 0; i < nd; i++) {
        if (!strides) {
            if (__builtin_mul_overflow(numel, dims[i], &numel))
                goto overflow;
            continue;
        }
        int64_t step, off;
        if (__builtin_mul_overflow(steps[i], scale, &step) ||
            __builtin_mul_overflow(step, dims[i] - 1, &off))
            goto overflow;
        if (off < 0 ? __builtin_add_overflow(neg, off, &neg) : __builtin_add_overflow(pos, off, &pos))
            goto overflow;
    }
    if (!strides) {   /* C-contiguous */
        *lo = 0;
        if (__builtin_mul_overflow(numel, item, span))
            goto overflow;
        goto done;
    }
    *lo = neg;
    if (__builtin_sub_overflow(pos, neg, span) || __builtin_add_overflow(*span, item, span))
        goto overflow;
    goto done;
overflow:
    rc = -1;
    PyErr_Format(PyExc_OverflowError,
                 "%s: the span of shape %R with strides %R does not fit in 64 bits",
                 WHO(index), shape, strides ? strides : Py_None);
done:
    if (dims != small)
        PyMem_Free(dims);
    return rc;
}

/* Fills out->empty/lo/nbytes: the span of out->shape (span_of: strides in
 * units of scale bytes, NULL when C-contiguous; item bytes an element) placed
 * at address base.  Both readers of a weight, tensor and interface, end here. */
static int place(weight_info *out, uint64_t base, PyObject *strides, int64_t scale, int64_t item,
                 Py_ssize_t index)
{
    int64_t lo = 0, span = 0;
    if (span_of(out->shape, strides, scale, item, index, &out->empty, &lo, &span) < 0)
        return -1;
    if (out->empty)
        return 0;
    if (lo < 0 && base < (uint64_t)(-lo)) {
        PyErr_Format(PyExc_ValueError, "%s: strides reach below address 0", WHO(index));
        return -1;
    }
    out->lo = base + (uint64_t)lo;
    out->nbytes = (uint64_t)span;
    if (out->lo + (out->nbytes - 1) < out->lo) {   /* its last byte */
        PyErr_Format(PyExc_OverflowError, "%s: its range runs past the end of the "
                     "64-bit address space", WHO(index));
        return -1;
    }
    return 0;
}

/* The CUDA device index of a weight's device.index: None (unknown: the driver
 * says, from the pointer) or an int in 0..INT_MAX. */
static int device_index(PyObject *idx, Py_ssize_t index, weight_info *out)
{
    if (idx == Py_None) {
        out->dev.kind = L2P_DEV_UNKNOWN;
        out->dev.index = -1;
        return 0;
    }
    if (!PyLong_Check(idx) || PyBool_Check(idx)) {
        PyErr_Format(PyExc_TypeError, "%s: device.index must be None or an int, not %s",
                     WHO(index), Py_TYPE(idx)->tp_name);
        return -1;
    }
    int overflow = 0;
    long v = PyLong_AsLongAndOverflow(idx, &overflow);
    if (v == -1 && !overflow && PyErr_Occurred())
        return -1;
    if (overflow || v < 0 || v > INT_MAX) {
        return l2p_raise_shown(PyExc_ValueError, idx,
                               "%s: device.index must be a CUDA device index in 0..%d, got ",
                               WHO(index), INT_MAX), -1;
    }
    out->dev.index = (int)v;
    return 0;
}

/* A tensor's bytes bound to the memory that holds them: its untyped_storage(),
 * whose range must contain the weight's.  Holding the storage, not only the
 * tensor, keeps the bytes allocated: model.to(dtype) or .half() keeps each
 * Parameter but swaps its storage, and the old one would be freed (and unmapped
 * by empty_cache) under a table that still points at it.  A tensor-like object
 * without untyped_storage is bound to itself, as an interface object is.  What
 * no reference prevents: a storage resized in place (FSDP's resize_(0)) frees
 * its bytes under the held object; such weights are not for prefetching. */
static int bind_storage(PyObject *w, Py_ssize_t index, weight_info *out)
{
    PyObject *method;
    int found = l2p_optional_attr(w, "untyped_storage", &method);
    if (found <= 0)
        return found < 0 ? noted(index, "untyped_storage") : 0;
    int rc = -1;
    PyObject *storage = PyObject_CallNoArgs(method), *ptr = NULL, *size = NULL;
    Py_DECREF(method);
    if (!storage) {
        noted(index, "untyped_storage()");
        goto done;
    }
    if (!(ptr = call_noted(storage, "data_ptr", index, "untyped_storage().data_ptr()")) ||
        !(size = call_noted(storage, "nbytes", index, "untyped_storage().nbytes()")))
        goto done;
    uint64_t lo, nbytes;
    if (get_u64(ptr, &lo, index, "untyped_storage().data_ptr()") < 0 ||
        get_u64(size, &nbytes, index, "untyped_storage().nbytes()") < 0)
        goto done;
    if (out->lo < lo || out->nbytes > nbytes || out->lo - lo > nbytes - out->nbytes) {
        char mine[24], its[24];
        PyOS_snprintf(mine, sizeof mine, "0x%llx", (unsigned long long)out->lo);
        PyOS_snprintf(its, sizeof its, "0x%llx", (unsigned long long)lo);
        PyErr_Format(PyExc_ValueError,
                     "%s (shape %S, dtype %S, on %S): its %llu bytes at %s lie outside its "
                     "untyped_storage() (%llu bytes at %s): its storage was resized or freed "
                     "(as FSDP does), or data_ptr() disagrees with it; prefetch weights whose "
                     "storage holds them", WHO(index), out->shape, out->dtype, out->device,
                     (unsigned long long)out->nbytes, mine, (unsigned long long)nbytes, its);
        goto done;
    }
    out->storage = Py_NewRef(storage);
    rc = 0;
done:
    Py_XDECREF(storage);
    Py_XDECREF(ptr);
    Py_XDECREF(size);
    return rc;
}

static int describe_tensor(PyObject *w, Py_ssize_t index, int bind, weight_info *out)
{
    int rc = -1;
    PyObject *shape_obj = NULL, *dtype = NULL, *ptr = NULL, *stride_obj = NULL, *stride = NULL,
             *es = NULL, *device = NULL, *type = NULL, *idx = NULL;
    if (!(shape_obj = PyObject_GetAttrString(w, "shape"))) {
        noted(index, "shape");
        goto done;
    }
    if (!(out->shape = as_tuple(shape_obj, index, "shape")))
        goto done;
    if (!(dtype = PyObject_GetAttrString(w, "dtype")) || !(out->dtype = PyObject_Str(dtype))) {
        noted(index, "dtype");
        goto done;
    }
    if (!(device = PyObject_GetAttrString(w, "device")) || !(out->device = PyObject_Str(device)) ||
        !(type = PyObject_GetAttrString(device, "type")) ||
        !(idx = PyObject_GetAttrString(device, "index"))) {
        noted(index, "device");
        goto done;
    }
    out->dev.kind = PyUnicode_Check(type) && PyUnicode_CompareWithASCIIString(type, "cuda") == 0
                        ? L2P_DEV_CUDA
                        : L2P_DEV_OTHER;
    out->dev.index = -1;
    if (out->dev.kind == L2P_DEV_CUDA && device_index(idx, index, out) < 0)
        goto done;
    if (!(ptr = call_noted(w, "data_ptr", index, "data_ptr()")) ||
        !(stride_obj = call_noted(w, "stride", index, "stride()")) ||
        !(es = call_noted(w, "element_size", index, "element_size()")))
        goto done;
    uint64_t base;
    int64_t item;
    if (get_u64(ptr, &base, index, "data_ptr()") < 0 ||
        !(stride = as_tuple(stride_obj, index, "stride()")) ||
        get_i64(es, index, "element_size()", -1, &item) < 0)
        goto done;
    if (item < 1) {
        PyErr_Format(PyExc_ValueError, "%s: element_size() must be >= 1, got %R", WHO(index), es);
        goto done;
    }
    rc = place(out, base, stride, item, item, index);
    if (rc == 0 && bind && !out->empty && base != 0)   /* 0: storageless (prepared.c refuses) */
        rc = bind_storage(w, index, out);
done:
    Py_XDECREF(shape_obj);
    Py_XDECREF(dtype);
    Py_XDECREF(ptr);
    Py_XDECREF(stride_obj);
    Py_XDECREF(stride);
    Py_XDECREF(es);
    Py_XDECREF(device);
    Py_XDECREF(type);
    Py_XDECREF(idx);
    return rc;
}

/* cai[key] as a new reference, NULL (no exception) when missing. */
static PyObject *cai_item(PyObject *cai, const char *key)
{
    PyObject *k = PyUnicode_FromString(key);
    PyObject *v = k ? PyDict_GetItemWithError(cai, k) : NULL;
    Py_XDECREF(k);
    return Py_XNewRef(v);
}

static int describe_cai(PyObject *w, PyObject *cai, Py_ssize_t index, weight_info *out)
{
    if (!PyDict_Check(cai)) {
        PyErr_Format(PyExc_TypeError, "%s: __cuda_array_interface__ must be a dict, not %s",
                     WHO(index), Py_TYPE(cai)->tp_name);
        return -1;
    }
    /* Strong references to the four items first: what reads them below can run
     * Python code that empties or changes the dict. */
    int rc = -1;
    PyObject *shape = cai_item(cai, "shape"), *typestr = NULL, *data = NULL, *strides_obj = NULL,
             *strides = NULL;
    if (!PyErr_Occurred())
        typestr = cai_item(cai, "typestr");
    if (!PyErr_Occurred())
        data = cai_item(cai, "data");
    if (!PyErr_Occurred())
        strides_obj = cai_item(cai, "strides");
    if (PyErr_Occurred())
        goto done;
    if (!shape || !PyTuple_Check(shape) || !typestr || !PyUnicode_Check(typestr) || !data ||
        !PyTuple_Check(data) || PyTuple_GET_SIZE(data) < 1) {
        PyErr_Format(PyExc_ValueError,
                     "%s: __cuda_array_interface__ needs 'shape' (tuple), 'typestr' (str) "
                     "and 'data' ((ptr, readonly)); got %R", WHO(index), cai);
        goto done;
    }
    const char *ts = PyUnicode_AsUTF8(typestr);
    if (!ts) {
        PyErr_Clear();
        ts = "";
    }
    long item = strlen(ts) >= 3 ? strtol(ts + 2, NULL, 10) : 0;
    if (item <= 0 || item == LONG_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: typestr %R gives no item size", WHO(index), typestr);
        goto done;
    }
    out->shape = Py_NewRef(shape);
    out->dtype = Py_NewRef(typestr);
    out->device = PyUnicode_FromString("cuda (from __cuda_array_interface__)");
    out->dev.kind = L2P_DEV_UNKNOWN;
    out->dev.index = -1;
    if (!out->device)
        goto done;
    if (strides_obj && strides_obj != Py_None &&
        !(strides = as_tuple(strides_obj, index, "__cuda_array_interface__ strides")))
        goto done;
    uint64_t base;
    if (get_u64(PyTuple_GET_ITEM(data, 0), &base, index, "the data pointer") < 0)
        goto done;
    rc = place(out, base, strides, 1, item, index);
done:
    Py_XDECREF(shape);
    Py_XDECREF(typestr);
    Py_XDECREF(data);
    Py_XDECREF(strides_obj);
    Py_XDECREF(strides);
    return rc;
}

static int describe(PyObject *w, Py_ssize_t index, int bind, weight_info *out)
{
    memset(out, 0, sizeof *out);
    int tensor = is_tensor_like(w);
    if (tensor < 0)
        return noted(index, "the attributes");
    if (tensor)
        return describe_tensor(w, index, bind, out);
    PyObject *cai = PyObject_GetAttrString(w, "__cuda_array_interface__");
    if (!cai) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError))
            l2p_format_from_cause(PyExc_TypeError,
                                  "%s is a %s, not a tensor: it must be a torch tensor "
                                  "or an object with __cuda_array_interface__",
                                  WHO(index), Py_TYPE(w)->tp_name);
        else
            noted(index, "__cuda_array_interface__");
        return -1;
    }
    int rc = describe_cai(w, cai, index, out);
    Py_DECREF(cai);
    return rc;
}

int l2p_span_of(PyObject *obj, l2p_range *out, l2p_weight_device *dev)
{
    weight_info w;
    int rc = describe(obj, -1, 0, &w);
    if (rc == 0) {
        uint64_t lo = (w.lo + 15) & ~(uint64_t)15, skip = lo - w.lo;
        *dev = w.dev;
        dev->empty = w.empty;
        dev->ptr = w.lo;
        if (!w.empty && w.nbytes >= skip + 16) {
            out->ptr = lo;
            out->nbytes = w.nbytes - skip;
            rc = 1;
        }
    }
    info_clear(&w);
    return rc;
}

PyObject *l2p_compute_ranges(PyObject *weights, long long byte_cap, l2p_range **ranges,
                             Py_ssize_t *n, l2p_weight_device **devices, PyObject **device_names,
                             PyObject **storages)
{
    *ranges = NULL;
    *n = 0;
    if (devices)
        *devices = NULL;
    if (device_names)
        *device_names = NULL;
    if (storages)
        *storages = NULL;
    int single = PyUnicode_Check(weights) || PyBytes_Check(weights);
    if (!single && (single = is_tensor_like(weights)) == 0)
        single = has_interface(weights);
    if (single < 0)
        return NULL;
    if (single)
        return PyErr_Format(PyExc_TypeError,
                            "weights must be a sequence of tensors, not a single %s; wrap it: (w,)",
                            Py_TYPE(weights)->tp_name);
    if (PyAnySet_Check(weights) || PyDict_Check(weights))
        return PyErr_Format(PyExc_TypeError,
                            "weights must be an ordered sequence of tensors (a list or tuple), not "
                            "a %s: ranges are made and capped in the weights' order",
                            Py_TYPE(weights)->tp_name);
    PyObject *tuple = PySequence_Tuple(weights);
    if (!tuple) {
        if (PyErr_ExceptionMatches(PyExc_TypeError))
            l2p_format_from_cause(PyExc_TypeError, "weights must be a sequence of tensors, not %s",
                                  Py_TYPE(weights)->tp_name);
        return NULL;
    }
    if (byte_cap < 0) {
        Py_DECREF(tuple);
        return PyErr_Format(PyExc_ValueError, "byte_cap must be >= 0 bytes (0: no cap), got %lld", byte_cap);
    }
    Py_ssize_t count = PyTuple_GET_SIZE(tuple);
    l2p_range *out = PyMem_Calloc((size_t)count + 1, sizeof *out);
    l2p_weight_device *devs = devices ? PyMem_Calloc((size_t)count + 1, sizeof *devs) : NULL;
    PyObject *names = device_names ? PyList_New(count) : NULL;
    PyObject *kept = storages ? PyList_New(0) : NULL;   /* of the weights that give a range */
    if (!out || (devices && !devs) || (device_names && !names) || (storages && !kept)) {
        PyErr_NoMemory();
        goto error;
    }
    uint64_t remaining = (uint64_t)byte_cap;
    Py_ssize_t used = 0;
    int spent = 0;   /* the cap is spent: later weights give no range (the reference
                        design's walk stops), but are still read and checked */
    for (Py_ssize_t i = 0; i < count; i++) {
        weight_info w;
        if (describe(PyTuple_GET_ITEM(tuple, i), i, 1, &w) < 0) {
            info_clear(&w);
            goto error;
        }
        if (devs) {
            devs[i] = w.dev;
            devs[i].empty = w.empty;
            devs[i].ptr = w.lo;
        }
        if (names)
            PyList_SET_ITEM(names, i, Py_NewRef(w.device));
        if (w.empty) {
            info_clear(&w);
            continue;
        }
        if (w.lo % 16) {   /* past a spent cap too: no cap changes the verdict */
            char addr[24];
            PyOS_snprintf(addr, sizeof addr, "0x%llx", (unsigned long long)w.lo);
            PyErr_Format(PyExc_ValueError,
                         "L2 prefetch ranges must start 16-byte aligned: weight %zd (shape %S, "
                         "dtype %S, on %S) starts at %s, %d bytes past a 16-byte boundary; "
                         "use a tensor whose data_ptr() is a multiple of 16 (e.g. .clone() it, "
                         "or slice at offsets that keep the alignment)",
                         i, w.shape, w.dtype, w.device, addr, (int)(w.lo % 16));
            info_clear(&w);
            goto error;
        }
        if (spent) {
            info_clear(&w);
            continue;
        }
        uint64_t size = w.nbytes;
        if (byte_cap) {
            size = (size < remaining ? size : remaining) / 16 * 16;
            remaining -= size;
        }
        if (size) {
            out[used].ptr = w.lo;
            out[used].nbytes = size;
            used++;
            if (kept && w.storage && PyList_Append(kept, w.storage) < 0) {
                info_clear(&w);
                goto error;
            }
        }
        info_clear(&w);
        if (byte_cap && remaining < 16)
            spent = 1;
    }
    if (kept) {
        PyObject *held = PyList_AsTuple(kept);
        Py_SETREF(kept, held);
        if (!kept)
            goto error;
        *storages = kept;
    }
    *ranges = out;
    *n = used;
    if (devices)
        *devices = devs;
    if (device_names)
        *device_names = names;
    return tuple;
error:
    PyMem_Free(out);
    PyMem_Free(devs);
    Py_XDECREF(names);
    Py_XDECREF(kept);
    Py_DECREF(tuple);
    return NULL;
}

static const l2p_signature compute_ranges_sig = {
    .name = "compute_ranges", .params = (const char *const[]){"weights", "byte_cap", NULL},
    .posonly = 0, .maxpos = 2, .required = 1};

/* compute_ranges(weights, byte_cap=0) -> list[tuple[int, int]] */
PyObject *l2p_py_compute_ranges(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames)
{
    PyObject *vals[2] = {NULL, NULL};
    if (l2p_parse_args(&compute_ranges_sig, args, nargs, kwnames, vals) < 0)
        return NULL;
    PyObject *weights = vals[0], *cap_obj = vals[1];
    long long cap = 0;
    if (cap_obj) {
        if (!PyLong_Check(cap_obj) || PyBool_Check(cap_obj))
            return PyErr_Format(PyExc_TypeError, "byte_cap must be an int (bytes), not %s",
                                Py_TYPE(cap_obj)->tp_name);
        cap = PyLong_AsLongLong(cap_obj);
        if (cap == -1 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Clear();
                PyObject *shown = l2p_shown(cap_obj);
                if (shown) {
                    PyErr_Format(PyExc_OverflowError, "byte_cap=%U does not fit in 63 bits",
                                 shown);
                    Py_DECREF(shown);
                }
            }
            return NULL;
        }
    }
    l2p_range *ranges;
    Py_ssize_t n;
    PyObject *tuple = l2p_compute_ranges(weights, cap, &ranges, &n, NULL, NULL, NULL);
    if (!tuple)
        return NULL;
    Py_DECREF(tuple);
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list && i < n; i++) {
        PyObject *t = Py_BuildValue("(KK)", (unsigned long long)ranges[i].ptr,
                                    (unsigned long long)ranges[i].nbytes);
        if (!t) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, t);
    }
    PyMem_Free(ranges);
    return list;
}
