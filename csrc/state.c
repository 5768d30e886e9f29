/*
 * state.c: the module state and what it holds for every unit: the CUDA driver
 * and NVRTC, opened on first use (never at import), the parser of
 * L2PREFETCH_* flags, and the testing hooks that swap the driver or NVRTC.
 * Everything above it (ranges.c .. controller.c) reaches the state through
 * here, never through module.c.
 */
#include "l2p.h"

#include <stdlib.h>
#include <strings.h>

l2p_state *l2p_get_state(PyObject *module)
{
    return (l2p_state *)PyModule_GetState(module);
}

l2p_state *l2p_state_of_type(PyTypeObject *type)
{
    return (l2p_state *)PyModule_GetState(PyType_GetModuleByDef(type, &l2p_module_def));
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
PyObject *l2p_py_env_flag(PyObject *module, PyObject *arg)
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

/* msg names paths (L2PREFETCH_LIBCUDA's value, folders searched), which are
 * bytes in any encoding: bytes that are not UTF-8 are shown as \xNN escapes,
 * never a UnicodeDecodeError in place of the reason. */
static PyObject *raise_unavailable(l2p_state *st, const char *msg, const char *reason)
{
    PyObject *text = PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg), "backslashreplace");
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
    char msg[3 * PATH_MAX];   /* the places tried (driver.c) and a line around them */
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

l2p_device *l2p_use_device(l2p_state *st, l2p_driver *d, int device)
{
    l2p_device *dev;
    CUresult r = l2p_device_ready(d, device, &dev);
    if (r == CUDA_SUCCESS)
        return dev;
    if (r == CUDA_ERROR_INVALID_DEVICE || r == CUDA_ERROR_NO_DEVICE) {
        PyErr_Format(PyExc_ValueError, "cuda:%d does not exist (the driver sees %d device%s)",
                     device, d->device_count, d->device_count == 1 ? "" : "s");
        return NULL;
    }
    char op[96];
    PyOS_snprintf(op, sizeof op, "%s (preparing cuda:%d)", l2p_device_ready_failed_call, device);
    l2p_raise_cuda(st, d, op, r);
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
            /* strong references first: building the list can collect, and a finalizer
             * then may empty the dict (sysconfig's, or a replacement's) */
            PyObject *pure = Py_XNewRef(PyDict_GetItemString(paths, "purelib"));
            PyObject *plat = Py_XNewRef(PyDict_GetItemString(paths, "platlib"));
            dirs = Py_BuildValue("[NN]", pure ? pure : Py_NewRef(Py_None),
                                 plat ? plat : Py_NewRef(Py_None));
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

void l2p_forget_kernels(l2p_state *st)
{
    PyDict_Clear(st->cubins);
    PyDict_Clear(st->kernel_info);
}

l2p_nvrtc *l2p_use_nvrtc(l2p_state *st)
{
    if (st->nvrtc)
        return st->nvrtc;
    PyObject *dirs = site_dirs(), *held;
    if (!dirs)
        return NULL;
    Py_ssize_t n;
    const char **cdirs = l2p_c_strings(dirs, &PyBytes_Type, "site-packages folders", &held, &n);
    Py_DECREF(dirs);
    if (!cdirs)
        return NULL;
    int found = 0;
    char msg[5 * PATH_MAX];   /* the places tried (nvrtc.c) and a line around them */
    l2p_nvrtc *nv = l2p_nvrtc_open(cdirs, (int)n, &found, msg, sizeof msg);
    PyMem_Free(cdirs);
    Py_DECREF(held);
    if (!nv) {
        raise_unavailable(st, msg, found ? "nvrtc_load_failed" : "nvrtc_not_found");
        return NULL;
    }
    if (st->nvrtc) {   /* opened meanwhile, by Python code site or the copy ran */
        l2p_nvrtc_decref(nv);
        return st->nvrtc;
    }
    st->nvrtc = nv;
    return nv;
}

/* Defines l2p_hold_<lib> (l2p.h): l2p_use_<lib> with a reference of the
 * caller's own.  Below: l2p_hold_driver and l2p_hold_nvrtc. */
#define DEFINE_HOLD(lib)                                                                   \
    l2p_##lib *l2p_hold_##lib(l2p_state *st)                                               \
    {                                                                                      \
        l2p_##lib *p = l2p_use_##lib(st);                                                  \
        if (p)                                                                             \
            l2p_##lib##_incref(p);                                                         \
        return p;                                                                          \
    }

DEFINE_HOLD(driver)   /* l2p_hold_driver */
DEFINE_HOLD(nvrtc)    /* l2p_hold_nvrtc */

/* ---- module functions: the state ---- */

/* Py_BuildValue's O& converters for the info dicts: a path as str (decoded
 * as the file system does), NVRTC's supported archs as a list of int. */
static PyObject *fs_str(void *path)
{
    return PyUnicode_DecodeFSDefault(path);
}

static PyObject *archs_list(void *nvrtc)
{
    const l2p_nvrtc *n = nvrtc;
    PyObject *archs = PyList_New(n->num_archs);
    for (int i = 0; archs && i < n->num_archs; i++) {
        PyObject *a = PyLong_FromLong(n->archs[i]);
        if (!a)
            Py_CLEAR(archs);
        else
            PyList_SET_ITEM(archs, i, a);
    }
    return archs;
}

/* The info functions hold the instance they read across the allocations that
 * build their result (a collection there can run a finalizer that swaps it). */
PyObject *l2p_py_driver_info(PyObject *module, PyObject *unused)
{
    l2p_driver *d = l2p_hold_driver(l2p_get_state(module));
    if (!d)
        return NULL;
    PyObject *r = Py_BuildValue("{s:O&,s:i,s:i}", "path", fs_str, d->path, "version", d->version,
                                "device_count", d->device_count);
    l2p_driver_decref(d);
    return r;
}

PyObject *l2p_py_nvrtc_info(PyObject *module, PyObject *unused)
{
    l2p_nvrtc *n = l2p_hold_nvrtc(l2p_get_state(module));
    if (!n)
        return NULL;
    PyObject *r = Py_BuildValue("{s:O&,s:(ii),s:O&}", "path", fs_str, n->path, "version",
                                n->major, n->minor, "archs", archs_list, (void *)n);
    l2p_nvrtc_decref(n);
    return r;
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

/* Defines static int swap_<lib>(l2p_state *st, PyObject *arg) (and the
 * open_<lib> it hands with_env_path), the testing hooks' swap of st-><lib>: new objects use the library at path arg (a str:
 * opened now by l2p_use_<lib>, with $env naming it) or the default one again
 * (None: opened on next use).  Objects made before keep the instance they hold;
 * the old one is dropped (its library stays loaded).  When the open fails the
 * old one stays, unless another call opened one while this one ran Python code
 * (the search, the error).  0, or -1 with an exception. */
#define DEFINE_SWAP(lib, env)                                                              \
    static void *open_##lib(l2p_state *st) { return l2p_use_##lib(st); }                  \
                                                                                           \
    static int swap_##lib(l2p_state *st, PyObject *arg)                                    \
    {                                                                                      \
        if (arg != Py_None && !PyUnicode_Check(arg)) {                                     \
            PyErr_Format(PyExc_TypeError, "path must be a str or None, not %s",            \
                         Py_TYPE(arg)->tp_name);                                           \
            return -1;                                                                     \
        }                                                                                  \
        l2p_##lib *old = st->lib;                                                          \
        st->lib = NULL;                                                                    \
        if (arg != Py_None && !with_env_path(st, env, arg, open_##lib)) {                  \
            if (st->lib)   /* opened by another call meanwhile */                          \
                l2p_##lib##_decref(old);                                                   \
            else                                                                           \
                st->lib = old;                                                             \
            return -1;                                                                     \
        }                                                                                  \
        l2p_##lib##_decref(old);                                                           \
        return 0;                                                                          \
    }

DEFINE_SWAP(driver, "L2PREFETCH_LIBCUDA")   /* swap_driver, open_driver */
DEFINE_SWAP(nvrtc, "L2PREFETCH_LIBNVRTC")   /* swap_nvrtc, open_nvrtc */

/* _use_driver(path=None): testing hook.  New objects use the driver at path
 * (the recording stand-in), or the default one again with None.  Existing
 * objects keep the driver they were created with. */
PyObject *l2p_py_use_driver(PyObject *module, PyObject *arg)
{
    if (swap_driver(l2p_get_state(module), arg) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* _use_nvrtc(path=None): testing hook, like _use_driver, for NVRTC; also
 * forgets the in-process kernel cache.  A compile in flight keeps the NVRTC it
 * started with (it holds a reference). */
PyObject *l2p_py_use_nvrtc(PyObject *module, PyObject *arg)
{
    l2p_state *st = l2p_get_state(module);
    if (swap_nvrtc(st, arg) < 0)
        return NULL;
    l2p_forget_kernels(st);  /* images of the old NVRTC */
    Py_RETURN_NONE;
}
