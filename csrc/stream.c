/*
 * stream.c: which CUDA stream "the current stream" is, without Python.
 *
 * PyTorch's stable C shim exports aoti_torch_get_current_cuda_stream(device,
 * &stream) from libtorch_cuda.so.  We look it up at run time in the copy torch
 * already loaded (dlopen with RTLD_NOLOAD: we never load or link libtorch, and
 * never build against a particular torch).  Where it is missing (CPU-only or
 * old torch) we fall back, once and for good, to
 * torch.cuda.current_stream(device).cuda_stream through Python.  The lookup
 * is retried until torch has been imported, so importing l2prefetch before
 * torch costs nothing.
 *
 * The Python fallback and a stream object's cuda_stream / device properties
 * run Python code: callers look nothing of theirs up before these calls that
 * they use after them (see DESIGN.md, "calls take effect at one point").
 */
#define _GNU_SOURCE
#include "l2p.h"

#include <dlfcn.h>

typedef int32_t (*shim_fn)(int32_t device, void **stream);

static enum { UNRESOLVED, SHIM, PYTHON } source = UNRESOLVED;
static shim_fn shim;

static void resolve(void)
{
    PyObject *modules = PyImport_GetModuleDict();
    PyObject *torch = PyDict_GetItemString(modules, "torch");
    if (!torch || torch == Py_None)
        return;   /* torch not imported yet (None: import blocked): decide later */
    const char *names[] = {"libtorch_cuda.so", "libtorch_hip.so"};
    for (size_t i = 0; i < sizeof names / sizeof *names && !shim; i++) {
        void *h = dlopen(names[i], RTLD_LAZY | RTLD_NOLOAD);
        if (h)
            shim = (shim_fn)dlsym(h, "aoti_torch_get_current_cuda_stream");
    }
    if (!shim)
        shim = (shim_fn)dlsym(RTLD_DEFAULT, "aoti_torch_get_current_cuda_stream");
    source = shim ? SHIM : PYTHON;
}

static int python_stream(int device, CUstream *out)
{
    PyObject *cuda = PyImport_ImportModule("torch.cuda");
    if (!cuda)
        return -1;
    PyObject *s = PyObject_CallMethod(cuda, "current_stream", "i", device);
    Py_DECREF(cuda);
    if (!s)
        return -1;
    PyObject *h = PyObject_GetAttrString(s, "cuda_stream");
    Py_DECREF(s);
    if (!h)
        return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(h);
    Py_DECREF(h);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (CUstream)(uintptr_t)v;
    return 0;
}

int l2p_current_stream(int device, CUstream *out)
{
    if (source == SHIM) {
        void *s = NULL;
        if (shim(device, &s) == 0) {
            *out = (CUstream)s;
            return 0;
        }
        PyErr_Format(PyExc_RuntimeError,
                     "torch could not give the current CUDA stream of device %d "
                     "(aoti_torch_get_current_cuda_stream failed)", device);
        return -1;
    }
    if (source == UNRESOLVED) {
        resolve();
        if (source == UNRESOLVED) {
            PyErr_SetString(PyExc_RuntimeError,
                            "no stream was given and torch is not imported, so there is no "
                            "'current stream': pass stream= (an int CUstream handle or a "
                            "torch.cuda.Stream)");
            return -1;
        }
        return l2p_current_stream(device, out);
    }
    return python_stream(device, out);
}

/* 0 when stream (an object with .cuda_stream) is on cuda:device, or does not
 * say which (.device.index); -1 with ValueError naming both when it is on
 * another, or with what its properties raised. */
static int check_stream_device(PyObject *stream, int device)
{
    PyObject *dev = NULL, *idx = NULL;
    int rc = -1;
    if (l2p_optional_attr(stream, "device", &dev) < 0 ||
        (dev && l2p_optional_attr(dev, "index", &idx) < 0))
        goto done;
    if (idx && PyLong_Check(idx) && !PyBool_Check(idx)) {
        int overflow = 0;
        long v = PyLong_AsLongAndOverflow(idx, &overflow);
        if (v == -1 && !overflow && PyErr_Occurred())
            goto done;
        if (overflow || v != device) {
            PyErr_Format(PyExc_ValueError,
                         "the stream is on %S but the prefetch is for cuda:%d: pass a stream of cuda:%d",
                         dev, device, device);
            goto done;
        }
    }
    rc = 0;
done:
    Py_XDECREF(idx);
    Py_XDECREF(dev);
    return rc;
}

int l2p_parse_stream(PyObject *stream, int device, CUstream *out)
{
    if (stream == NULL || stream == Py_None)
        return l2p_current_stream(device, out);
    if (PyLong_Check(stream) && !PyBool_Check(stream)) {
        unsigned long long v = PyLong_AsUnsignedLongLong(stream);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return l2p_raise_shown(PyExc_ValueError, stream,
                                   "stream handle must be a non-negative int, got "), -1;
        }
        *out = (CUstream)(uintptr_t)v;
        return 0;
    }
    PyObject *handle = NULL;
    int found = PyBool_Check(stream) ? 0 : l2p_optional_attr(stream, "cuda_stream", &handle);
    if (found < 0)
        return -1;   /* the property raised: its exception, not ours */
    if (!found) {
        PyErr_Format(PyExc_TypeError,
                     "stream must be None, an int CUstream handle or a torch.cuda.Stream, not %s", Py_TYPE(stream)->tp_name);
        return -1;
    }
    int rc = -1;
    if (check_stream_device(stream, device) < 0)
        goto done;
    /* One level only: a .cuda_stream that is itself an object (a Mock, say) is
     * an error, not something to unwrap without end. */
    if (!PyLong_Check(handle) || PyBool_Check(handle)) {
        PyErr_Format(PyExc_TypeError, "stream.cuda_stream must be an int CUstream handle, not %s",
                     Py_TYPE(handle)->tp_name);
        goto done;
    }
    rc = l2p_parse_stream(handle, device, out);
done:
    Py_DECREF(handle);
    return rc;
}

/* _C.stream_source() -> "shim" | "python" | "unresolved" */
PyObject *l2p_py_stream_source(PyObject *module, PyObject *unused)
{
    if (source == UNRESOLVED)
        resolve();
    return PyUnicode_FromString(source == SHIM ? "shim" : source == PYTHON ? "python" : "unresolved");
}

/* _C._set_stream_source(name): testing hook.  "python" forces the Python
 * fallback (torch.cuda.current_stream), None forgets the choice (resolved again
 * on next use), "shim" resolves and fails if there is no shim. */
PyObject *l2p_py_set_stream_source(PyObject *module, PyObject *arg)
{
    if (arg == Py_None) {
        source = UNRESOLVED;
        shim = NULL;
        Py_RETURN_NONE;
    }
    if (PyUnicode_Check(arg) && PyUnicode_CompareWithASCIIString(arg, "python") == 0) {
        source = PYTHON;
        Py_RETURN_NONE;
    }
    if (PyUnicode_Check(arg) && PyUnicode_CompareWithASCIIString(arg, "shim") == 0) {
        source = UNRESOLVED;
        shim = NULL;
        resolve();
        if (source == SHIM)
            Py_RETURN_NONE;
        return PyErr_Format(PyExc_RuntimeError, "no aoti_torch_get_current_cuda_stream in this process");
    }
    return PyErr_Format(PyExc_ValueError, "stream source must be 'python', 'shim' or None, not %R", arg);
}
