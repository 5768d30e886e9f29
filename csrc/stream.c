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

int l2p_parse_stream(PyObject *stream, int device, CUstream *out)
{
    if (stream == NULL || stream == Py_None)
        return l2p_current_stream(device, out);
    if (PyLong_Check(stream) && !PyBool_Check(stream)) {
        unsigned long long v = PyLong_AsUnsignedLongLong(stream);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "stream handle must be a non-negative int, got %R", stream);
            return -1;
        }
        *out = (CUstream)(uintptr_t)v;
        return 0;
    }
    PyObject *handle = PyBool_Check(stream) ? NULL : PyObject_GetAttrString(stream, "cuda_stream");
    if (!handle) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "stream must be None, an int CUstream handle or a torch.cuda.Stream, not %s", Py_TYPE(stream)->tp_name);
        return -1;
    }
    PyObject *dev = PyObject_GetAttrString(stream, "device");
    if (dev) {
        PyObject *idx = PyObject_GetAttrString(dev, "index");
        if (idx && PyLong_Check(idx) && PyLong_AsLong(idx) != device) {
            PyErr_Format(PyExc_ValueError,
                         "the stream is on %S but the prefetch is for cuda:%d: pass a stream of cuda:%d",
                         dev, device, device);
            Py_DECREF(idx);
            Py_DECREF(dev);
            Py_DECREF(handle);
            return -1;
        }
        Py_XDECREF(idx);
        Py_DECREF(dev);
    }
    PyErr_Clear();
    /* One level only: a .cuda_stream that is itself an object (a Mock, say) is
     * an error, not something to unwrap without end. */
    if (!PyLong_Check(handle) || PyBool_Check(handle)) {
        PyErr_Format(PyExc_TypeError, "stream.cuda_stream must be an int CUstream handle, not %s",
                     Py_TYPE(handle)->tp_name);
        Py_DECREF(handle);
        return -1;
    }
    int rc = l2p_parse_stream(handle, device, out);
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
