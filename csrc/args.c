/*
 * args.c: the arguments calls parse the same way: a METH_FASTCALL signature
 * (positional and keyword arguments, with the messages CPython's own
 * functions give), a CUDA device (`device=` of PreparedWeightRanges and
 * PrefetchController, device_info's), and a sequence of strings as the
 * `const char **` a plain-C call takes (NVRTC's options, the site-packages
 * folders nvrtc.c searches).  The signature runs no Python code, nor do the
 * strings once their sequence is copied; parsing a torch.device, or asking
 * torch for its current device, does: callers do it before what they read of
 * their own.
 */
#include "l2p.h"

#include <stdlib.h>

/* A device index as an int in 0..INT_MAX; ValueError naming obj otherwise. */
static int device_index(PyObject *obj, PyObject *index, int *out)
{
    int overflow = 0;
    long v = PyLong_AsLongAndOverflow(index, &overflow);
    if (v == -1 && !overflow && PyErr_Occurred())
        return -1;
    if (overflow < 0 || (!overflow && v < 0))
        return l2p_raise_shown(PyExc_ValueError, obj, "device must be >= 0, got "), -1;
    if (overflow > 0 || v > INT_MAX) {
        PyObject *shown = l2p_shown(obj);
        if (shown) {
            PyErr_Format(PyExc_ValueError, "device %U is not a CUDA device index (too large)",
                         shown);
            Py_DECREF(shown);
        }
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* The device of a `device=` argument: None, an int, "cuda:N"/"cuda", or a
 * torch.device.  -1 for None.  Other types are TypeError; other values
 * (negative or huge indices, other device types) ValueError. */
int l2p_parse_device(PyObject *obj, int *out)
{
    *out = -1;
    if (!obj || obj == Py_None)
        return 0;
    if (PyLong_Check(obj) && !PyBool_Check(obj))
        return device_index(obj, obj, out);
    if (PyUnicode_Check(obj)) {
        const char *s = PyUnicode_AsUTF8(obj);
        if (s && strcmp(s, "cuda") == 0)
            return 0;
        if (s && strncmp(s, "cuda:", 5) == 0 && s[5] >= '0' && s[5] <= '9') {
            char *end = NULL;
            long v = strtol(s + 5, &end, 10);
            if (*end == '\0' && v <= INT_MAX) {
                *out = (int)v;
                return 0;
            }
        }
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "device must be a CUDA device ('cuda' or 'cuda:N'), got %R", obj);
        return -1;
    }
    PyObject *type = NULL;
    int found = PyBool_Check(obj) ? 0 : l2p_optional_attr(obj, "type", &type);
    if (found < 0)
        return -1;   /* its own exception: a property that raised, KeyboardInterrupt */
    if (!found) {    /* not a torch.device either */
        PyErr_Format(PyExc_TypeError,
                     "device must be a CUDA device (an int, 'cuda:N' or a torch.device), not %s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    int rc = -1;
    PyObject *index = NULL;
    if (PyUnicode_Check(type) && PyUnicode_CompareWithASCIIString(type, "cuda") == 0 &&
        l2p_optional_attr(obj, "index", &index) < 0) {
        Py_DECREF(type);
        return -1;
    }
    if (index && (index == Py_None || (PyLong_Check(index) && !PyBool_Check(index)))) {
        rc = index == Py_None ? 0 : device_index(obj, index, out);
    } else {
        PyErr_Format(PyExc_ValueError,
                     "device must be a CUDA device (an int, 'cuda:N' or a torch.device), got %R", obj);
    }
    Py_DECREF(type);
    Py_XDECREF(index);
    return rc;
}

/* torch's current CUDA device when torch is imported, else 0 (also where
 * torch.cuda.current_device() fails with an Exception: a CPU-only torch).
 * -1 with a BaseException (KeyboardInterrupt) passed through. */
int l2p_default_device(int *out)
{
    *out = 0;
    PyObject *torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");   /* borrowed: only tested */
    if (!torch || torch == Py_None)
        return 0;
    PyObject *cuda = PyImport_ImportModule("torch.cuda");
    PyObject *d = cuda ? PyObject_CallMethod(cuda, "current_device", NULL) : NULL;
    Py_XDECREF(cuda);
    if (!d) {
        if (l2p_error_is_base())
            return -1;
        PyErr_Clear();
        return 0;
    }
    int overflow = 0;
    long v = PyLong_Check(d) ? PyLong_AsLongAndOverflow(d, &overflow) : -1;
    Py_DECREF(d);
    PyErr_Clear();
    if (!overflow && v >= 0 && v <= INT_MAX)
        *out = (int)v;
    return 0;
}

int l2p_device_arg(PyObject *obj, int *out)
{
    if (l2p_parse_device(obj, out) < 0)
        return -1;
    if (*out < 0)
        return l2p_default_device(out);
    return 0;
}

/* ---- fast-call arguments ---- */

#define MAX_PARAMS 16

int l2p_parse_args(const l2p_signature *sig, PyObject *const *args, Py_ssize_t nargs,
                   PyObject *kwnames, PyObject **vals)
{
    const char *f = sig->name;
    int n = 0;
    while (sig->params[n])
        n++;
    assert(n <= MAX_PARAMS && sig->posonly <= sig->maxpos && sig->maxpos <= n);
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    /* No count of positional + keyword arguments: with at most maxpos positional ones and
     * each keyword naming a distinct parameter not given yet, there are at most n, and a
     * value given twice is reported as such (as CPython does), not as a count. */
    if (nargs > sig->maxpos) {
        if (sig->maxpos == 0)
            PyErr_Format(PyExc_TypeError, "%s() takes no positional arguments", f);
        else
            PyErr_Format(PyExc_TypeError, "%s() takes %s %d positional argument%s (%zd given)", f,
                         sig->required < sig->maxpos ? "at most" : "exactly", sig->maxpos,
                         sig->maxpos == 1 ? "" : "s", nargs);
        return -1;
    }
    char given[MAX_PARAMS] = {0};
    for (Py_ssize_t i = 0; i < nargs; i++) {
        vals[i] = args[i];
        given[i] = 1;
    }
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);   /* an exact or subclassed str */
        int j = sig->posonly;
        while (j < n && PyUnicode_CompareWithASCIIString(key, sig->params[j]) != 0)
            j++;
        if (j == n) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", f, key);
            return -1;
        }
        if (given[j]) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", f,
                         sig->params[j]);
            return -1;
        }
        vals[j] = args[nargs + k];
        given[j] = 1;
    }
    for (int j = 0; j < sig->required; j++) {
        if (given[j])
            continue;
        if (j < sig->posonly)
            PyErr_Format(PyExc_TypeError, "%s() takes %s %d positional argument%s (%zd given)", f,
                         sig->required < sig->maxpos ? "at least" : "exactly", sig->required,
                         sig->required == 1 ? "" : "s", nargs);
        else
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s' (pos %d)", f,
                         sig->params[j], j + 1);
        return -1;
    }
    return 0;
}

/* ---- strings for a plain-C call ---- */

const char **l2p_c_strings(PyObject *seq, PyTypeObject *type, const char *what, PyObject **held,
                           Py_ssize_t *n)
{
    PyObject *items = PySequence_Tuple(seq);   /* the last Python code: __iter__, a collection */
    if (!items)
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(items);
    const char **out = PyMem_Calloc((size_t)count + 1, sizeof *out);
    if (!out) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *o = PyTuple_GET_ITEM(items, i);
        if (!PyObject_TypeCheck(o, type)) {
            PyErr_Format(PyExc_TypeError, "%s must be %s, not %s", what, type->tp_name,
                         Py_TYPE(o)->tp_name);
            goto fail;
        }
        if (!(out[i] = PyBytes_Check(o) ? PyBytes_AS_STRING(o) : PyUnicode_AsUTF8(o)))
            goto fail;
    }
    *held = items;
    *n = count;
    return out;
fail:
    PyMem_Free(out);
    Py_DECREF(items);
    return NULL;
}
