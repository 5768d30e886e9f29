/*
 * module.c: l2prefetch._C, the top: the method table, the exceptions, the
 * two-phase init and the module state's lifetime, and device_info (the one
 * module function that reads several units).  Nothing below calls into it;
 * importing it touches no GPU and loads no CUDA library (state.c opens them
 * on first use).
 */
#include "l2p.h"

static PyObject *py_device_info(PyObject *module, PyObject *arg)
{
    l2p_state *st = l2p_get_state(module);
    int device;
    if (l2p_device_arg(arg, &device) < 0)
        return NULL;
    l2p_driver *d = l2p_use_driver(st);
    if (!d)
        return NULL;
    l2p_device *dev = l2p_use_device(st, d, device);
    if (!dev)
        return NULL;
    int v = l2p_variant_default(dev->cc_major * 10 + dev->cc_minor);
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:s}", "device", device, "sm",
                         dev->cc_major * 10 + dev->cc_minor, "sm_count", dev->sm_count, "l2_bytes",
                         dev->l2_bytes, "smem_optin", dev->smem_optin, "least_priority",
                         dev->least_priority, "greatest_priority", dev->greatest_priority,
                         "driver_version", d->version, "default_kernel",
                         v >= 0 ? l2p_variants[v].name : "");
}

static PyMethodDef module_methods[] = {
    {"compute_ranges", (PyCFunction)(void (*)(void))l2p_py_compute_ranges, METH_FASTCALL | METH_KEYWORDS,
     "compute_ranges(weights, byte_cap=0)\n--\n\n"
     "The (ptr, nbytes) byte ranges a prefetch of weights covers: in order, each\n"
     "non-empty weight's lowest to highest byte (the first 16-byte aligned), the\n"
     "total capped at byte_cap bytes (the README, \"Ranges\").  Arithmetic, no GPU:\n"
     "tensors on any device (each range must lie in its untyped_storage()), or\n"
     "objects with __cuda_array_interface__."},
    {"compile", (PyCFunction)(void (*)(void))l2p_py_compile, METH_FASTCALL | METH_KEYWORDS,
     "compile(variant, sm, *, ptx=False)\n--\n\n"
     "Compile a kernel variant with NVRTC for sm (e.g. 90) without a GPU; returns\n"
     "a dict with the image, the log (with ptxas resource use) and the options."},
    {"kernel_variants", l2p_py_variants, METH_NOARGS,
     "kernel_variants()\n--\n\nThe kernel variants: {name: {min_sm, block, smem, doc, defines}}."},
    {"stream_source", l2p_py_stream_source, METH_NOARGS,
     "stream_source()\n--\n\nHow the current stream is found: 'shim', 'python' or 'unresolved'."},
    {"driver_info", l2p_py_driver_info, METH_NOARGS,
     "driver_info()\n--\n\nThe CUDA driver in use: {path, version, device_count} (loads it)."},
    {"nvrtc_info", l2p_py_nvrtc_info, METH_NOARGS,
     "nvrtc_info()\n--\n\nThe NVRTC in use: {path, version, archs} (loads it)."},
    {"device_info", py_device_info, METH_O,
     "device_info(device, /)\n--\n\nAttributes of a CUDA device as l2prefetch sees them."},
    {"clear_kernel_cache", l2p_py_clear_kernel_cache, METH_NOARGS,
     "clear_kernel_cache()\n--\n\nForget the in-process compiled kernels (the disk cache stays)."},
    {"kernel_cache_info", l2p_py_kernel_cache_info, METH_NOARGS,
     "kernel_cache_info()\n--\n\n"
     "How each kernel image in the in-process cache was obtained: a list of\n"
     "{variant, arch, ptx, source ('compiled' or 'disk'), ms, nvrtc_version}, ms\n"
     "being the time of the NVRTC compile or of the disk-cache read and check.\n"
     "clear_kernel_cache() empties it.  Nothing is logged from C: l2prefetch's\n"
     "Python side logs it."},
    {"env_flag", l2p_py_env_flag, METH_O,
     "env_flag(name, /)\n--\n\n"
     "Whether environment variable name holds a true value: 1, true, yes or on,\n"
     "in any case, blanks around it ignored.  The one rule for every L2PREFETCH_*\n"
     "flag, in C and in Python."},
    {"_kernel_image", (PyCFunction)(void (*)(void))l2p_py_kernel_image, METH_FASTCALL,
     "Testing hook: the cached image for (variant, sm) as (bytes, is_ptx)."},
    {"_compile_source", (PyCFunction)(void (*)(void))l2p_py_compile_source, METH_FASTCALL,
     "Testing hook: compile source with options to CUBIN (raises NvrtcError)."},
    {"_floor_fork_join", (PyCFunction)(void (*)(void))l2p_py_floor_fork_join, METH_FASTCALL,
     "Benchmark hook: n fork+join driver sequences of prepared from C; total ns."},
    {"_graph_loader_nodes", (PyCFunction)(void (*)(void))l2p_py_graph_loader_nodes, METH_FASTCALL,
     "_graph_loader_nodes(graph, /)\n--\n\n"
     "The kernel nodes of template graph (a raw CUgraph handle) that launch l2prefetch's\n"
     "kernels, as a tuple of raw node handles (the tuner's in-place switch)."},
    {"_graph_set_loaders", (PyCFunction)(void (*)(void))l2p_py_graph_set_loaders, METH_FASTCALL,
     "_graph_set_loaders(exec, nodes, state, extras=None, /)\n--\n\n"
     "Switch those nodes of executable graph exec to state 'on' (the captured loads),\n"
     "'empty' (an empty table) or 'off' (disabled), or to a table each, for the next\n"
     "replays; extras: per node, a range read after its table's (or None)."},
    {"_graph_edges", (PyCFunction)(void (*)(void))l2p_py_graph_edges, METH_FASTCALL,
     "_graph_edges(graph, /)\n--\n\n"
     "Every edge of template graph as a tuple of (from, to) raw node handles."},
    {"_graph_instantiate_without", (PyCFunction)(void (*)(void))l2p_py_graph_instantiate_without,
     METH_FASTCALL,
     "_graph_instantiate_without(graph, nodes, /)\n--\n\n"
     "A clone of template graph without those nodes (and their edges), instantiated: a\n"
     "GraphExec, which holds the driver that made it (launch(stream), close())."},
    {"_use_driver", l2p_py_use_driver, METH_O, "Testing hook: the driver library new objects use."},
    {"_use_nvrtc", l2p_py_use_nvrtc, METH_O, "Testing hook: the NVRTC library compiles use."},
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
    st->graph_exec_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &l2p_graph_exec_spec, NULL);
    if (!st->graph_exec_type || PyModule_AddType(module, st->graph_exec_type) < 0)
        return -1;
    if (PyModule_AddIntConstant(module, "MAX_RANGES", (long)L2P_MAX_TABLE) < 0)
        return -1;
    return 0;
}

/* One field of the state st, for L2P_STATE_OBJECTS (Py_VISIT's way: names in scope). */
#define VISIT_FIELD(field) Py_VISIT(st->field);
#define CLEAR_FIELD(field) Py_CLEAR(st->field);

static int module_traverse(PyObject *module, visitproc visit, void *arg)
{
    l2p_state *st = l2p_get_state(module);
    L2P_STATE_OBJECTS(VISIT_FIELD)
    return 0;
}

static int module_clear(PyObject *module)
{
    l2p_state *st = l2p_get_state(module);
    L2P_STATE_OBJECTS(CLEAR_FIELD)
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
