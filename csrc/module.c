/*
 * module.c: l2prefetch._C, the module: two-phase init, module state (types,
 * exceptions, the driver and NVRTC in use, the per-process kernel cache), and
 * the module-level functions.  Importing it touches no GPU and loads no CUDA
 * library; that happens on first use (l2p_use_driver, l2p_use_nvrtc).
 */
#include "l2p.h"

/* Set by l2p_device_ready() (driver.c): the call that failed. */

#include <ctype.h>
#include <stdlib.h>
#include <strings.h>

l2p_state *l2p_get_state(PyObject *module)
{
    return (l2p_state *)PyModule_GetState(module);
}

int l2p_env_flag(const char *name)
{
    const char *v = getenv(name);
    if (!v)
        return 0;
    return strcmp(v, "1") == 0 || strcasecmp(v, "true") == 0 || strcasecmp(v, "yes") == 0 ||
           strcasecmp(v, "on") == 0;
}

static PyObject *raise_unavailable(l2p_state *st, const char *msg, const char *reason)
{
    PyObject *text = PyUnicode_FromString(msg);
    PyObject *exc = text ? PyObject_CallOneArg(st->unavailable_error, text) : NULL;
    Py_XDECREF(text);
    if (!exc)
        return NULL;
    PyObject *r = PyUnicode_FromString(reason);
    if (r && PyObject_SetAttrString(exc, "reason", r) == 0)
        PyErr_SetObject(st->unavailable_error, exc);
    Py_XDECREF(r);
    Py_DECREF(exc);
    return NULL;
}

l2p_driver *l2p_use_driver(l2p_state *st)
{
    if (st->driver)
        return st->driver;
    l2p_load_error why;
    CUresult status;
    char msg[3072];
    l2p_driver *d = l2p_driver_open(&why, &status, msg, sizeof msg);
    if (d) {
        st->driver = d;
        return d;
    }
    static const char *const reasons[] = {"ok", "not_found", "load_failed", "symbol_missing",
                                          "driver_too_old", "init_failed"};
    if (why == L2P_LOAD_INIT_FAILED && status == CUDA_ERROR_NO_DEVICE)
        snprintf(msg + strlen(msg), sizeof msg - strlen(msg), ": the driver sees no CUDA device");
    raise_unavailable(st, msg, reasons[why]);
    return NULL;
}

/* Folders where the nvidia-cuda-nvrtc wheels put NVRTC, under each sys.path
 * entry, then CUDA_HOME and /usr/local/cuda. */
l2p_nvrtc *l2p_use_nvrtc(l2p_state *st)
{
    if (st->nvrtc)
        return st->nvrtc;
    static const char *const wheel_dirs[] = {"nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"};
    PyObject *dirs = PyList_New(0);
    if (!dirs)
        return NULL;
    PyObject *path = PySys_GetObject("path");   /* borrowed */
    for (Py_ssize_t i = 0; path && PyList_Check(path) && i < PyList_GET_SIZE(path); i++) {
        PyObject *entry = PyList_GET_ITEM(path, i);
        if (!PyUnicode_Check(entry) || PyUnicode_GET_LENGTH(entry) == 0)
            continue;
        for (size_t k = 0; k < sizeof wheel_dirs / sizeof *wheel_dirs; k++) {
            PyObject *d = PyUnicode_FromFormat("%U/%s", entry, wheel_dirs[k]);
            if (!d || PyList_Append(dirs, d) < 0) {
                Py_XDECREF(d);
                Py_DECREF(dirs);
                return NULL;
            }
            Py_DECREF(d);
        }
    }
    const char *home = getenv("CUDA_HOME");
    if (!home || !*home)
        home = getenv("CUDA_PATH");
    PyObject *extra[2] = {home && *home ? PyUnicode_FromFormat("%s/lib64", home) : NULL,
                          PyUnicode_FromString("/usr/local/cuda/lib64")};
    for (int k = 0; k < 2; k++)
        if (extra[k]) {
            PyList_Append(dirs, extra[k]);
            Py_DECREF(extra[k]);
        }
    Py_ssize_t n = PyList_GET_SIZE(dirs);
    const char **cdirs = PyMem_Calloc((size_t)n + 1, sizeof *cdirs);
    if (!cdirs) {
        Py_DECREF(dirs);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        cdirs[i] = PyUnicode_AsUTF8(PyList_GET_ITEM(dirs, i));
    int found = 0;
    char msg[6144];
    l2p_nvrtc *nv = l2p_nvrtc_open(cdirs, (int)n, &found, msg, sizeof msg);
    PyMem_Free(cdirs);
    Py_DECREF(dirs);
    if (!nv) {
        raise_unavailable(st, msg, found ? "nvrtc_load_failed" : "nvrtc_not_found");
        return NULL;
    }
    st->nvrtc = nv;
    return nv;
}

/* ---- module functions ---- */

static PyObject *py_driver_info(PyObject *module, PyObject *unused)
{
    l2p_state *st = l2p_get_state(module);
    l2p_driver *d = l2p_use_driver(st);
    if (!d)
        return NULL;
    return Py_BuildValue("{s:s,s:i,s:i}", "path", d->path, "version", d->version, "device_count",
                         d->device_count);
}

static PyObject *py_nvrtc_info(PyObject *module, PyObject *unused)
{
    l2p_state *st = l2p_get_state(module);
    l2p_nvrtc *n = l2p_use_nvrtc(st);
    if (!n)
        return NULL;
    PyObject *archs = PyList_New(n->num_archs);
    for (int i = 0; archs && i < n->num_archs; i++)
        PyList_SET_ITEM(archs, i, PyLong_FromLong(n->archs[i]));
    if (!archs)
        return NULL;
    return Py_BuildValue("{s:s,s:(ii),s:N}", "path", n->path, "version", n->major, n->minor,
                         "archs", archs);
}

static PyObject *py_device_info(PyObject *module, PyObject *arg)
{
    l2p_state *st = l2p_get_state(module);
    int device;
    if (l2p_device_arg(arg, &device) < 0)
        return NULL;
    l2p_driver *d = l2p_use_driver(st);
    if (!d)
        return NULL;
    l2p_device *dev;
    CUresult r = l2p_device_ready(d, device, &dev);
    if (r != CUDA_SUCCESS) {
        char op[96];
        PyOS_snprintf(op, sizeof op, "%s (preparing cuda:%d)", l2p_device_ready_failed_call, device);
        return l2p_raise_cuda(st, d, op, r);
    }
    int v = l2p_variant_default(dev->cc_major * 10 + dev->cc_minor);
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:s}", "device", device, "sm",
                         dev->cc_major * 10 + dev->cc_minor, "sm_count", dev->sm_count, "l2_bytes",
                         dev->l2_bytes, "smem_optin", dev->smem_optin, "least_priority",
                         dev->least_priority, "greatest_priority", dev->greatest_priority,
                         "driver_version", d->version, "default_kernel",
                         v >= 0 ? l2p_variants[v].name : "");
}

/* _use_driver(path=None): testing hook.  New objects use the driver at path
 * (the recording stand-in), or the default one again with None.  Existing
 * objects keep the driver they were created with. */
static PyObject *py_use_driver(PyObject *module, PyObject *arg)
{
    l2p_state *st = l2p_get_state(module);
    l2p_driver *old = st->driver;
    st->driver = NULL;
    if (arg != Py_None) {
        if (!PyUnicode_Check(arg)) {
            st->driver = old;
            return PyErr_Format(PyExc_TypeError, "path must be a str or None, not %s", Py_TYPE(arg)->tp_name);
        }
        const char *prev = getenv("L2PREFETCH_LIBCUDA");
        char *saved = prev ? strdup(prev) : NULL;
        setenv("L2PREFETCH_LIBCUDA", PyUnicode_AsUTF8(arg), 1);
        l2p_driver *d = l2p_use_driver(st);
        if (saved) {
            setenv("L2PREFETCH_LIBCUDA", saved, 1);
            free(saved);
        } else {
            unsetenv("L2PREFETCH_LIBCUDA");
        }
        if (!d) {
            st->driver = old;
            return NULL;
        }
    }
    if (old)
        l2p_driver_decref(old);
    Py_RETURN_NONE;
}

/* _use_nvrtc(path=None): testing hook, like _use_driver, for NVRTC; also
 * forgets the in-process kernel cache. */
static PyObject *py_use_nvrtc(PyObject *module, PyObject *arg)
{
    l2p_state *st = l2p_get_state(module);
    if (arg != Py_None && !PyUnicode_Check(arg))
        return PyErr_Format(PyExc_TypeError, "path must be a str or None, not %s", Py_TYPE(arg)->tp_name);
    l2p_nvrtc *old = st->nvrtc;
    st->nvrtc = NULL;
    if (arg != Py_None) {
        const char *prev = getenv("L2PREFETCH_LIBNVRTC");
        char *saved = prev ? strdup(prev) : NULL;
        setenv("L2PREFETCH_LIBNVRTC", PyUnicode_AsUTF8(arg), 1);
        l2p_nvrtc *n = l2p_use_nvrtc(st);
        if (saved) {
            setenv("L2PREFETCH_LIBNVRTC", saved, 1);
            free(saved);
        } else {
            unsetenv("L2PREFETCH_LIBNVRTC");
        }
        if (!n) {
            st->nvrtc = old;
            return NULL;
        }
    }
    if (old) {
        free(old->archs);
        free(old);   /* the library stays loaded */
    }
    PyDict_Clear(st->cubins);
    Py_RETURN_NONE;
}

static PyObject *py_clear_kernel_cache(PyObject *module, PyObject *unused)
{
    PyDict_Clear(l2p_get_state(module)->cubins);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"compute_ranges", (PyCFunction)(void (*)(void))l2p_py_compute_ranges, METH_FASTCALL | METH_KEYWORDS,
     "compute_ranges(weights, byte_cap=0)\n--\n\n"
     "The (ptr, nbytes) byte ranges a prefetch of weights covers, with the seed's\n"
     "rules (see the README).  Pure arithmetic: tensors on any device, or objects\n"
     "with __cuda_array_interface__."},
    {"compile", (PyCFunction)(void (*)(void))l2p_py_compile, METH_FASTCALL | METH_KEYWORDS,
     "compile(variant, sm, *, ptx=False)\n--\n\n"
     "Compile a kernel variant with NVRTC for sm (e.g. 90) without a GPU; returns\n"
     "a dict with the image, the log (with ptxas resource use) and the options."},
    {"kernel_variants", l2p_py_variants, METH_NOARGS,
     "kernel_variants()\n--\n\nThe kernel variants: {name: {min_sm, block, smem, doc, defines}}."},
    {"stream_source", l2p_py_stream_source, METH_NOARGS,
     "stream_source()\n--\n\nHow the current stream is found: 'shim', 'python' or 'unresolved'."},
    {"driver_info", py_driver_info, METH_NOARGS,
     "driver_info()\n--\n\nThe CUDA driver in use: {path, version, device_count} (loads it)."},
    {"nvrtc_info", py_nvrtc_info, METH_NOARGS,
     "nvrtc_info()\n--\n\nThe NVRTC in use: {path, version, archs} (loads it)."},
    {"device_info", py_device_info, METH_O,
     "device_info(device)\n--\n\nAttributes of a CUDA device as l2prefetch sees them."},
    {"clear_kernel_cache", py_clear_kernel_cache, METH_NOARGS,
     "clear_kernel_cache()\n--\n\nForget the in-process compiled kernels (the disk cache stays)."},
    {"_kernel_image", (PyCFunction)(void (*)(void))l2p_py_kernel_image, METH_FASTCALL,
     "Testing hook: the cached image for (variant, sm) as (bytes, is_ptx)."},
    {"_compile_source", (PyCFunction)(void (*)(void))l2p_py_compile_source, METH_FASTCALL,
     "Testing hook: compile source with options to CUBIN (raises NvrtcError)."},
    {"_floor_fork_join", (PyCFunction)(void (*)(void))l2p_py_floor_fork_join, METH_FASTCALL,
     "Benchmark hook: n fork+join driver sequences of prepared from C; total ns."},
    {"_use_driver", py_use_driver, METH_O, "Testing hook: the driver library new objects use."},
    {"_use_nvrtc", py_use_nvrtc, METH_O, "Testing hook: the NVRTC library compiles use."},
    {NULL},
};

static PyObject *new_exception(PyObject *module, const char *name, PyObject *base, const char *doc)
{
    char full[128];
    PyOS_snprintf(full, sizeof full, "l2prefetch.%s", name);
    PyObject *exc = PyErr_NewExceptionWithDoc(full, doc, base, NULL);
    if (!exc)
        return NULL;
    if (PyModule_AddObjectRef(module, name, exc) < 0) {
        Py_DECREF(exc);
        return NULL;
    }
    return exc;
}

static int module_exec(PyObject *module)
{
    l2p_state *st = l2p_get_state(module);
    st->cubins = PyDict_New();
    if (!st->cubins)
        return -1;
    if (!(st->error = new_exception(module, "Error", PyExc_RuntimeError,
                                    "Base class of l2prefetch's run-time errors.")))
        return -1;
    if (!(st->cuda_error = new_exception(module, "CudaError", st->error,
                                         "A CUDA driver call failed: .code, .name, .operation.")))
        return -1;
    if (!(st->nvrtc_error = new_exception(module, "NvrtcError", st->error,
                                          "NVRTC failed: .code, .name, .operation, .log, .options, .source (numbered).")))
        return -1;
    if (!(st->unavailable_error = new_exception(
              module, "CudaUnavailableError", PyExc_ImportError,
              "The CUDA driver or NVRTC cannot be used here: not found, found but not loadable, "
              "missing a symbol, too old, or no device.  .reason says which.")))
        return -1;
    st->prepared_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &l2p_prepared_spec, NULL);
    if (!st->prepared_type || PyModule_AddType(module, st->prepared_type) < 0)
        return -1;
    st->controller_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &l2p_controller_spec, NULL);
    if (!st->controller_type || PyModule_AddType(module, st->controller_type) < 0)
        return -1;
    if (PyModule_AddIntConstant(module, "MAX_RANGES", (long)l2p_capacities[L2P_NUM_CAPACITIES - 1]) < 0)
        return -1;
    return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg)
{
    l2p_state *st = l2p_get_state(module);
    Py_VISIT(st->prepared_type);
    Py_VISIT(st->controller_type);
    Py_VISIT(st->error);
    Py_VISIT(st->cuda_error);
    Py_VISIT(st->nvrtc_error);
    Py_VISIT(st->unavailable_error);
    Py_VISIT(st->cubins);
    return 0;
}

static int module_clear(PyObject *module)
{
    l2p_state *st = l2p_get_state(module);
    Py_CLEAR(st->prepared_type);
    Py_CLEAR(st->controller_type);
    Py_CLEAR(st->error);
    Py_CLEAR(st->cuda_error);
    Py_CLEAR(st->nvrtc_error);
    Py_CLEAR(st->unavailable_error);
    Py_CLEAR(st->cubins);
    return 0;
}

static void module_free(void *module)
{
    l2p_state *st = l2p_get_state((PyObject *)module);
    module_clear((PyObject *)module);
    if (st->driver) {
        l2p_driver_decref(st->driver);
        st->driver = NULL;
    }
    if (st->nvrtc) {
        free(st->nvrtc->archs);
        free(st->nvrtc);
        st->nvrtc = NULL;
    }
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL},
};

PyModuleDef l2p_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "l2prefetch._C",
    .m_doc = "The C core of l2prefetch: ranges, prepared tables, the controller, the driver and NVRTC loaders.",
    .m_size = sizeof(l2p_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void)
{
    return PyModuleDef_Init(&l2p_module_def);
}
