/*
 * ranges.c: the byte ranges of a list of weights, with the seed's rules.
 *
 * Weights are torch tensors (read through data_ptr/shape/stride/element_size,
 * so any device works: this is arithmetic) or objects with
 * __cuda_array_interface__ (v2/v3; strides in bytes or None).  Each non-empty
 * weight covers its lowest to its highest byte: with strides s_i and sizes n_i
 * the span is (sum of (n_i - 1) * s_i over positive strides, minus the same over
 * negative ones) + one element, which for non-negative strides is the seed's
 * 1 + sum((n - 1) * stride) elements.  A range must start 16-byte aligned (the
 * kernel moves 16-byte granules).  With a byte cap, each size is
 * min(size, remaining) rounded down to 16, the cap is spent in order, and the
 * walk stops once fewer than 16 bytes remain.  All arithmetic is checked: a
 * span that would not fit in 63 bits is an OverflowError, never a wrong range.
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
} weight_info;

static void info_clear(weight_info *w)
{
    Py_CLEAR(w->device);
    Py_CLEAR(w->dtype);
    Py_CLEAR(w->shape);
}

static int is_tensor_like(PyObject *o)
{
    return PyObject_HasAttrString(o, "data_ptr") && PyObject_HasAttrString(o, "element_size") &&
           PyObject_HasAttrString(o, "stride");
}

static int get_u64(PyObject *o, uint64_t *out, Py_ssize_t index, const char *what)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "weight %zd: %s must be a non-negative integer, got %R",
                     index, what, o);
        return -1;
    }
    *out = v;
    return 0;
}

/* lo/hi offsets (bytes) of a strided view; item = element size. */
static int span_of(PyObject *shape, PyObject *strides, int64_t scale, int64_t item,
                   Py_ssize_t index, int *empty, int64_t *lo, int64_t *span)
{
    Py_ssize_t nd = PySequence_Size(shape);
    if (nd < 0)
        return -1;
    if (strides && strides != Py_None && PySequence_Size(strides) != nd) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "weight %zd: shape %R and strides %R differ in length",
                         index, shape, strides);
        return -1;
    }
    int64_t neg = 0, pos = 0, numel = 1;
    *empty = 0;
    for (Py_ssize_t i = 0; i < nd; i++) {
        PyObject *n_obj = PySequence_GetItem(shape, i);
        if (!n_obj)
            return -1;
        long long n = PyLong_AsLongLong(n_obj);
        Py_DECREF(n_obj);
        if (n == -1 && PyErr_Occurred())
            return -1;
        if (n < 0) {
            PyErr_Format(PyExc_ValueError, "weight %zd: negative size %lld in shape %R", index, n, shape);
            return -1;
        }
        if (n == 0)
            *empty = 1;
        if (!strides || strides == Py_None) {
            if (__builtin_mul_overflow(numel, n ? n : 1, &numel))
                goto overflow;
            continue;
        }
        PyObject *s_obj = PySequence_GetItem(strides, i);
        if (!s_obj)
            return -1;
        long long s = PyLong_AsLongLong(s_obj);
        Py_DECREF(s_obj);
        if (s == -1 && PyErr_Occurred())
            return -1;
        int64_t step, off;
        if (__builtin_mul_overflow((int64_t)s, scale, &step) ||
            __builtin_mul_overflow(step, (int64_t)(n ? n - 1 : 0), &off))
            goto overflow;
        if (off < 0 ? __builtin_add_overflow(neg, off, &neg) : __builtin_add_overflow(pos, off, &pos))
            goto overflow;
    }
    if (*empty)
        return 0;
    if (!strides || strides == Py_None) {   /* C-contiguous */
        *lo = 0;
        if (__builtin_mul_overflow(numel, item, span))
            goto overflow;
        return 0;
    }
    *lo = neg;
    if (__builtin_sub_overflow(pos, neg, span) || __builtin_add_overflow(*span, item, span))
        goto overflow;
    return 0;
overflow:
    PyErr_Format(PyExc_OverflowError,
                 "weight %zd: the span of shape %R with strides %R does not fit in 64 bits",
                 index, shape, strides ? strides : Py_None);
    return -1;
}

static int describe_tensor(PyObject *w, Py_ssize_t index, weight_info *out)
{
    int rc = -1;
    PyObject *ptr = NULL, *stride = NULL, *es = NULL, *device = NULL, *type = NULL, *idx = NULL;
    out->shape = PyObject_GetAttrString(w, "shape");
    PyObject *dtype = PyObject_GetAttrString(w, "dtype");
    out->dtype = dtype ? PyObject_Str(dtype) : NULL;
    Py_XDECREF(dtype);
    if (!out->shape || !out->dtype)
        goto done;
    if (!(device = PyObject_GetAttrString(w, "device")) || !(out->device = PyObject_Str(device)) ||
        !(type = PyObject_GetAttrString(device, "type")) ||
        !(idx = PyObject_GetAttrString(device, "index")))
        goto done;
    out->dev.kind = PyUnicode_Check(type) && PyUnicode_CompareWithASCIIString(type, "cuda") == 0
                        ? L2P_DEV_CUDA
                        : L2P_DEV_OTHER;
    out->dev.index = idx == Py_None ? -1 : (int)PyLong_AsLong(idx);
    if (out->dev.index == -1 && PyErr_Occurred())
        goto done;
    if (!(ptr = PyObject_CallMethod(w, "data_ptr", NULL)) ||
        !(stride = PyObject_CallMethod(w, "stride", NULL)) ||
        !(es = PyObject_CallMethod(w, "element_size", NULL)))
        goto done;
    long long item = PyLong_AsLongLong(es);
    if (item == -1 && PyErr_Occurred())
        goto done;
    uint64_t base;
    int64_t lo = 0, span = 0;
    if (get_u64(ptr, &base, index, "data_ptr()") < 0 ||
        span_of(out->shape, stride, item, item, index, &out->empty, &lo, &span) < 0)
        goto done;
    if (!out->empty) {
        if (lo < 0 && base < (uint64_t)(-lo)) {
            PyErr_Format(PyExc_ValueError, "weight %zd: strides reach below address 0", index);
            goto done;
        }
        out->lo = base + (uint64_t)lo;
        out->nbytes = (uint64_t)span;
        if (out->lo + (out->nbytes - 1) < out->lo) {   /* its last byte */
            PyErr_Format(PyExc_OverflowError, "weight %zd: its range runs past the end of the "
                         "64-bit address space", index);
            goto done;
        }
    }
    rc = 0;
done:
    Py_XDECREF(ptr);
    Py_XDECREF(stride);
    Py_XDECREF(es);
    Py_XDECREF(device);
    Py_XDECREF(type);
    Py_XDECREF(idx);
    return rc;
}

static int describe_cai(PyObject *w, PyObject *cai, Py_ssize_t index, weight_info *out)
{
    if (!PyDict_Check(cai)) {
        PyErr_Format(PyExc_TypeError, "weight %zd: __cuda_array_interface__ must be a dict, not %s",
                     index, Py_TYPE(cai)->tp_name);
        return -1;
    }
    PyObject *shape = PyDict_GetItemString(cai, "shape");
    PyObject *typestr = PyDict_GetItemString(cai, "typestr");
    PyObject *data = PyDict_GetItemString(cai, "data");
    PyObject *strides = PyDict_GetItemString(cai, "strides");
    if (!shape || !PyTuple_Check(shape) || !typestr || !PyUnicode_Check(typestr) || !data ||
        !PyTuple_Check(data) || PyTuple_GET_SIZE(data) < 1) {
        PyErr_Format(PyExc_ValueError,
                     "weight %zd: __cuda_array_interface__ needs 'shape' (tuple), 'typestr' (str) "
                     "and 'data' ((ptr, readonly)); got %R", index, cai);
        return -1;
    }
    const char *ts = PyUnicode_AsUTF8(typestr);
    long item = ts && strlen(ts) >= 3 ? strtol(ts + 2, NULL, 10) : 0;
    if (item <= 0) {
        PyErr_Format(PyExc_ValueError, "weight %zd: typestr %R gives no item size", index, typestr);
        return -1;
    }
    out->shape = Py_NewRef(shape);
    out->dtype = Py_NewRef(typestr);
    out->device = PyUnicode_FromString("cuda (from __cuda_array_interface__)");
    out->dev.kind = L2P_DEV_UNKNOWN;
    out->dev.index = -1;
    if (!out->device)
        return -1;
    uint64_t base;
    int64_t lo = 0, span = 0;
    if (get_u64(PyTuple_GET_ITEM(data, 0), &base, index, "the data pointer") < 0 ||
        span_of(shape, strides, 1, item, index, &out->empty, &lo, &span) < 0)
        return -1;
    if (!out->empty) {
        if (lo < 0 && base < (uint64_t)(-lo)) {
            PyErr_Format(PyExc_ValueError, "weight %zd: strides reach below address 0", index);
            return -1;
        }
        out->lo = base + (uint64_t)lo;
        out->nbytes = (uint64_t)span;
        if (out->lo + (out->nbytes - 1) < out->lo) {   /* its last byte */
            PyErr_Format(PyExc_OverflowError, "weight %zd: its range runs past the end of the "
                         "64-bit address space", index);
            return -1;
        }
    }
    return 0;
}

static int describe(PyObject *w, Py_ssize_t index, weight_info *out)
{
    memset(out, 0, sizeof *out);
    if (is_tensor_like(w))
        return describe_tensor(w, index, out);
    PyObject *cai = PyObject_GetAttrString(w, "__cuda_array_interface__");
    if (!cai) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "weight %zd is a %s, not a tensor: weights must be torch tensors or objects "
                     "with __cuda_array_interface__", index, Py_TYPE(w)->tp_name);
        return -1;
    }
    int rc = describe_cai(w, cai, index, out);
    Py_DECREF(cai);
    return rc;
}

PyObject *l2p_compute_ranges(PyObject *weights, long long byte_cap, l2p_range **ranges,
                             Py_ssize_t *n, l2p_weight_device **devices, PyObject **device_names)
{
    *ranges = NULL;
    *n = 0;
    if (devices)
        *devices = NULL;
    if (device_names)
        *device_names = NULL;
    if (PyUnicode_Check(weights) || PyBytes_Check(weights) || is_tensor_like(weights) ||
        PyObject_HasAttrString(weights, "__cuda_array_interface__"))
        return PyErr_Format(PyExc_TypeError,
                            "weights must be a sequence of tensors, not a single %s; wrap it: (w,)",
                            Py_TYPE(weights)->tp_name);
    PyObject *tuple = PySequence_Tuple(weights);
    if (!tuple) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "weights must be a sequence of tensors, not %s",
                         Py_TYPE(weights)->tp_name);
        }
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
    if (!out || (devices && !devs) || (device_names && !names)) {
        PyErr_NoMemory();
        goto error;
    }
    uint64_t remaining = (uint64_t)byte_cap;
    Py_ssize_t used = 0;
    int spent = 0;   /* the cap is spent: later weights give no range (seed: the walk
                        stops), but are still described for the device checks */
    for (Py_ssize_t i = 0; i < count; i++) {
        weight_info w;
        if (spent && !devs)
            break;
        if (describe(PyTuple_GET_ITEM(tuple, i), i, &w) < 0) {
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
        if (w.empty || spent) {
            info_clear(&w);
            continue;
        }
        if (w.lo % 16) {
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
        uint64_t size = w.nbytes;
        if (byte_cap) {
            size = (size < remaining ? size : remaining) / 16 * 16;
            remaining -= size;
        }
        if (size) {
            out[used].ptr = w.lo;
            out[used].nbytes = size;
            used++;
        }
        info_clear(&w);
        if (byte_cap && remaining < 16)
            spent = 1;
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
    Py_DECREF(tuple);
    return NULL;
}

/* compute_ranges(weights, byte_cap=0) -> list[tuple[int, int]] */
PyObject *l2p_py_compute_ranges(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames)
{
    PyObject *weights = NULL, *cap_obj = NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs > 2)
        return PyErr_Format(PyExc_TypeError, "compute_ranges() takes at most 2 arguments (%zd given)", nargs);
    if (nargs > 0)
        weights = args[0];
    if (nargs > 1)
        cap_obj = args[1];
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *k = PyTuple_GET_ITEM(kwnames, i);
        if (PyUnicode_CompareWithASCIIString(k, "weights") == 0 && !weights)
            weights = args[nargs + i];
        else if (PyUnicode_CompareWithASCIIString(k, "byte_cap") == 0 && !cap_obj)
            cap_obj = args[nargs + i];
        else
            return PyErr_Format(PyExc_TypeError, "compute_ranges() got an unexpected or repeated keyword argument %R", k);
    }
    if (!weights)
        return PyErr_Format(PyExc_TypeError, "compute_ranges() missing required argument 'weights'");
    long long cap = 0;
    if (cap_obj) {
        if (!PyLong_Check(cap_obj) || PyBool_Check(cap_obj))
            return PyErr_Format(PyExc_TypeError, "byte_cap must be an int (bytes), not %s",
                                Py_TYPE(cap_obj)->tp_name);
        cap = PyLong_AsLongLong(cap_obj);
        if (cap == -1 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_OverflowError, "byte_cap=%R does not fit in 63 bits", cap_obj);
            }
            return NULL;
        }
    }
    l2p_range *ranges;
    Py_ssize_t n;
    PyObject *tuple = l2p_compute_ranges(weights, cap, &ranges, &n, NULL, NULL);
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
