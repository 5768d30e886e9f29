/*
 * module.c: l2prefetch._C, the module: two-phase init, module state (types,
 * exceptions, the driver and NVRTC in use, the per-process kernel cache), and
 * the module-level functions.  Importing it touches no GPU and loads no CUDA
 * library; that happens on first use (l2p_use_driver, l2p_use_nvrtc).
 */
#include "l2p.h"

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
    while (*v == ' ' || (*v >= '\t' && *v <= '\r'))   /* ASCII blanks, as C's isspace */
        v++;
    size_t len = strlen(v);
    while (len && (v[len - 1] == ' ' || (v[len - 1] >= '\t' && v[len - 1] <= '\r')))
        len--;
    static const char *const yes[] = {"1", "true", "yes", "on"};
    for (size_t i = 0; i < sizeof yes / sizeof *yes; i++)
        if (len == strlen(yes[i]) && strncasecmp(v, yes[i], len) == 0)
            return 1;
    return 0;
}

/* _C.env_flag(name) -> bool: l2p_env_flag, for the Python side's flags. */
static PyObject *py_env_flag(PyObject *module, PyObject *arg)
{
    if (!PyUnicode_Check(arg))
        return PyErr_Format(PyExc_TypeError, "name must be a str, not %s", Py_TYPE(arg)->tp_name);
    Py_ssize_t len;
    const char *name = PyUnicode_AsUTF8AndSize(arg, &len);
    if (!name)
        return NULL;
    if ((size_t)len != strlen(name))
        return PyErr_Format(PyExc_ValueError, "name must not contain a NUL character");
    return PyBool_FromLong(l2p_env_flag(name));
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

/* The site-packages folders of this interpreter: site.getsitepackages() and,
 * when enabled, the user site (pip install --user); sysconfig's purelib and
 * platlib where site lacks getsitepackages (old virtualenv).  A new list. */
static PyObject *site_packages(void)
{
    PyObject *out = PyList_New(0), *site = out ? PyImport_ImportModule("site") : NULL;
    PyObject *dirs = NULL, *user = NULL, *enabled = NULL;
    if (!site)
        goto error;
    if (l2p_optional_attr(site, "getsitepackages", &dirs) < 0)
        goto error;
    if (dirs) {
        Py_SETREF(dirs, PyObject_CallNoArgs(dirs));
    } else {
        PyObject *sysconfig = PyImport_ImportModule("sysconfig");
        PyObject *paths = sysconfig ? PyObject_CallMethod(sysconfig, "get_paths", NULL) : NULL;
        Py_XDECREF(sysconfig);
        if (paths && PyDict_Check(paths)) {
            PyObject *pure = PyDict_GetItemString(paths, "purelib");
            PyObject *plat = PyDict_GetItemString(paths, "platlib");
            dirs = Py_BuildValue("[OO]", pure ? pure : Py_None, plat ? plat : Py_None);
        }
        Py_XDECREF(paths);
    }
    if (!dirs)
        goto error;
    PyObject *iter = PyObject_GetIter(dirs), *item;
    if (!iter)
        goto error;
    while ((item = PyIter_Next(iter))) {
        int rc = PyList_Append(out, item);
        Py_DECREF(item);
        if (rc < 0)
            break;
    }
    Py_DECREF(iter);
    if (PyErr_Occurred())
        goto error;
    if (l2p_optional_attr(site, "ENABLE_USER_SITE", &enabled) < 0)
        goto error;
    if (enabled == Py_True) {
        if (!(user = PyObject_CallMethod(site, "getusersitepackages", NULL)) ||
            PyList_Append(out, user) < 0)
            goto error;
    }
    Py_DECREF(site);
    Py_DECREF(dirs);
    Py_XDECREF(user);
    Py_XDECREF(enabled);
    return out;
error:
    Py_XDECREF(out);
    Py_XDECREF(site);
    Py_XDECREF(dirs);
    Py_XDECREF(user);
    Py_XDECREF(enabled);
    return NULL;
}

/* The site-packages folders as bytes for the file system (undecodable bytes
 * kept), for nvrtc.c's search (the order: nvrtc.h, l2p_nvrtc_open); a folder
 * that cannot be encoded, or holds a NUL, is left out.  A new list. */
static PyObject *site_dirs(void)
{
    PyObject *dirs = PyList_New(0), *sites = dirs ? site_packages() : NULL;
    if (!sites) {
        Py_XDECREF(dirs);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(sites); i++) {
        PyObject *entry = PyList_GET_ITEM(sites, i);
        if (!PyUnicode_Check(entry) || PyUnicode_GET_LENGTH(entry) == 0)
            continue;
        PyObject *b = PyUnicode_EncodeFSDefault(entry);
        if (!b || (size_t)PyBytes_GET_SIZE(b) != strlen(PyBytes_AS_STRING(b))) {
            Py_XDECREF(b);   /* not encodable, or a NUL inside: no such folder */
            if (l2p_error_is_base())
                goto error;
            PyErr_Clear();
            continue;
        }
        int rc = PyList_Append(dirs, b);
        Py_DECREF(b);
        if (rc < 0)
            goto error;
    }
    Py_DECREF(sites);
    return dirs;
error:
    Py_DECREF(dirs);
    Py_DECREF(sites);
    return NULL;
}

l2p_nvrtc *l2p_use_nvrtc(l2p_state *st)
{
    if (st->nvrtc)
        return st->nvrtc;
    PyObject *dirs = site_dirs();
    if (!dirs)
        return NULL;
    /* No Python code from here on: the list and its bytes stay as they are. */
    Py_ssize_t n = PyList_GET_SIZE(dirs);
    const char **cdirs = PyMem_Calloc((size_t)n + 1, sizeof *cdirs);
    if (!cdirs) {
        Py_DECREF(dirs);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        cdirs[i] = PyBytes_AS_STRING(PyList_GET_ITEM(dirs, i));
    int found = 0;
    char msg[6144];
    l2p_nvrtc *nv = l2p_nvrtc_open(cdirs, (int)n, &found, msg, sizeof msg);
    PyMem_Free(cdirs);
    Py_DECREF(dirs);
    if (!nv) {
        raise_unavailable(st, msg, found ? "nvrtc_load_failed" : "nvrtc_not_found");
        return NULL;
    }
    if (st->nvrtc) {   /* another thread opened one while site ran Python code */
        l2p_nvrtc_decref(nv);
        return st->nvrtc;
    }
    st->nvrtc = nv;
    return nv;
}

/* ---- module functions ---- */

/* The info functions hold the instance they read across the allocations that
 * build their result (a collection there can run a finalizer that swaps it). */
static PyObject *py_driver_info(PyObject *module, PyObject *unused)
{
    l2p_state *st = l2p_get_state(module);
    l2p_driver *d = l2p_use_driver(st);
    if (!d)
        return NULL;
    l2p_driver_incref(d);
    PyObject *path = PyUnicode_DecodeFSDefault(d->path);
    PyObject *r = path ? Py_BuildValue("{s:N,s:i,s:i}", "path", path, "version", d->version,
                                       "device_count", d->device_count)
                       : NULL;
    l2p_driver_decref(d);
    return r;
}

static PyObject *py_nvrtc_info(PyObject *module, PyObject *unused)
{
    l2p_state *st = l2p_get_state(module);
    l2p_nvrtc *n = l2p_use_nvrtc(st);
    if (!n)
        return NULL;
    l2p_nvrtc_incref(n);
    PyObject *r = NULL, *path = NULL, *archs = PyList_New(n->num_archs);
    for (int i = 0; archs && i < n->num_archs; i++) {
        PyObject *a = PyLong_FromLong(n->archs[i]);
        if (!a)
            Py_CLEAR(archs);
        else
            PyList_SET_ITEM(archs, i, a);
    }
    if (archs && (path = PyUnicode_DecodeFSDefault(n->path)))
        r = Py_BuildValue("{s:N,s:(ii),s:N}", "path", path, "version", n->major, n->minor,
                          "archs", archs);
    else
        Py_XDECREF(archs);
    l2p_nvrtc_decref(n);
    return r;
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

/* setenv(name, path) for a testing hook; path encoded for the file system.
 * 0, or -1 with an exception (a path that cannot be encoded, or holds a NUL). */
static int set_env_path(const char *name, PyObject *path)
{
    PyObject *bytes = NULL;
    if (!PyUnicode_FSConverter(path, &bytes))
        return -1;
    int rc = setenv(name, PyBytes_AS_STRING(bytes), 1);
    Py_DECREF(bytes);
    if (rc != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

/* Runs open(st) with $name set to path for its duration; the old value back after. */
static void *with_env_path(l2p_state *st, const char *name, PyObject *path,
                           void *(*open)(l2p_state *))
{
    const char *prev = getenv(name);
    char *saved = prev ? strdup(prev) : NULL;
    if (prev && !saved) {
        PyErr_NoMemory();
        return NULL;
    }
    void *result = set_env_path(name, path) == 0 ? open(st) : NULL;
    if (saved) {
        setenv(name, saved, 1);
        free(saved);
    } else {
        unsetenv(name);
    }
    return result;
}

static void *open_driver(l2p_state *st) { return l2p_use_driver(st); }
static void *open_nvrtc(l2p_state *st) { return l2p_use_nvrtc(st); }

/* _use_driver(path=None): testing hook.  New objects use the driver at path
 * (the recording stand-in), or the default one again with None.  Existing
 * objects keep the driver they were created with. */
static PyObject *py_use_driver(PyObject *module, PyObject *arg)
{
    l2p_state *st = l2p_get_state(module);
    if (arg != Py_None && !PyUnicode_Check(arg))
        return PyErr_Format(PyExc_TypeError, "path must be a str or None, not %s", Py_TYPE(arg)->tp_name);
    l2p_driver *old = st->driver;
    st->driver = NULL;
    if (arg != Py_None && !with_env_path(st, "L2PREFETCH_LIBCUDA", arg, open_driver)) {
        st->driver = old;
        return NULL;
    }
    if (old)
        l2p_driver_decref(old);
    Py_RETURN_NONE;
}

/* _use_nvrtc(path=None): testing hook, like _use_driver, for NVRTC; also
 * forgets the in-process kernel cache.  A compile in flight keeps the NVRTC it
 * started with (it holds a reference). */
static PyObject *py_use_nvrtc(PyObject *module, PyObject *arg)
{
    l2p_state *st = l2p_get_state(module);
    if (arg != Py_None && !PyUnicode_Check(arg))
        return PyErr_Format(PyExc_TypeError, "path must be a str or None, not %s", Py_TYPE(arg)->tp_name);
    l2p_nvrtc *old = st->nvrtc;
    st->nvrtc = NULL;
    if (arg != Py_None && !with_env_path(st, "L2PREFETCH_LIBNVRTC", arg, open_nvrtc)) {
        st->nvrtc = old;
        return NULL;
    }
    l2p_nvrtc_decref(old);   /* the library stays loaded */
    PyDict_Clear(st->cubins);
    PyDict_Clear(st->kernel_info);
    Py_RETURN_NONE;
}

static PyObject *py_clear_kernel_cache(PyObject *module, PyObject *unused)
{
    PyDict_Clear(l2p_get_state(module)->cubins);
    PyDict_Clear(l2p_get_state(module)->kernel_info);
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
    {"kernel_cache_info", l2p_py_kernel_cache_info, METH_NOARGS,
     "kernel_cache_info()\n--\n\n"
     "How each kernel image in the in-process cache was obtained: a list of\n"
     "{variant, arch, ptx, source ('compiled' or 'disk'), ms, nvrtc_version}, ms\n"
     "being the time of the NVRTC compile or of the disk-cache read and check.\n"
     "clear_kernel_cache() empties it.  Nothing is logged from C: l2prefetch's\n"
     "Python side logs it."},
    {"env_flag", py_env_flag, METH_O,
     "env_flag(name)\n--\n\n"
     "Whether environment variable name holds a true value: 1, true, yes or on,\n"
     "in any case, blanks around it ignored.  The one rule for every L2PREFETCH_*\n"
     "flag, in C and in Python."},
    {"_kernel_image", (PyCFunction)(void (*)(void))l2p_py_kernel_image, METH_FASTCALL,
     "Testing hook: the cached image for (variant, sm) as (bytes, is_ptx)."},
    {"_compile_source", (PyCFunction)(void (*)(void))l2p_py_compile_source, METH_FASTCALL,
     "Testing hook: compile source with options to CUBIN (raises NvrtcError)."},
    {"_floor_fork_join", (PyCFunction)(void (*)(void))l2p_py_floor_fork_join, METH_FASTCALL,
     "Benchmark hook: n fork+join driver sequences of prepared from C; total ns."},
    {"_use_driver", py_use_driver, METH_O, "Testing hook: the driver library new objects use."},
    {"_use_nvrtc", py_use_nvrtc, METH_O, "Testing hook: the NVRTC library compiles use."},
    {"_set_stream_source", l2p_py_set_stream_source, METH_O,
     "Testing hook: 'python' forces torch's Python current-stream fallback; None resolves again."},
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
    st->kernel_info = PyDict_New();
    if (!st->cubins || !st->kernel_info)
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
    Py_VISIT(st->kernel_info);
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
    Py_CLEAR(st->kernel_info);
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
    l2p_nvrtc_decref(st->nvrtc);
    st->nvrtc = NULL;
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
