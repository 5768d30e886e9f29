/*
 * l2p.h: what the C units of l2prefetch._C share: the module state's layout,
 * the frame of its heap types, and the entry points of each unit, in the
 * order the units build on each other (DESIGN.md): errors, args, state,
 * ranges, stream, kernels, prepared, capture, graphexec, graph, controller,
 * bench; module.c, the top, exports only the module.
 */
#ifndef L2P_H
#define L2P_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "driver.h"
#include "nvrtc.h"

/* The module state (made by module.c, held and reached through state.c). */
typedef struct {
    PyTypeObject *prepared_type;
    PyTypeObject *controller_type;
    PyTypeObject *graph_exec_type;
    PyObject *error;             /* l2prefetch.Error(RuntimeError) */
    PyObject *cuda_error;        /* CudaError(Error): .code .name .operation */
    PyObject *nvrtc_error;       /* NvrtcError(Error): .code .name .log .options */
    PyObject *unavailable_error; /* CudaUnavailableError(ImportError) */
    l2p_driver *driver;          /* the driver new objects use; NULL until first use */
    l2p_nvrtc *nvrtc;            /* NULL until the first compile */
    PyObject *cubins;            /* {(arch, variant, nvrtc version): bytes}: compile once */
    PyObject *kernel_info;       /* same keys: {variant, arch, ptx, source, ms, nvrtc_version} */
    int cache_warned;            /* kernels.c's WARN_* bits: the kinds of disk-cache trouble
                                    warned about already (once per process each) */
} l2p_state;

/* The state's Python objects, each a strong reference: module.c visits and
 * clears them from this one list, so that the two cannot drift apart. */
#define L2P_STATE_OBJECTS(X)                                                            \
    X(prepared_type) X(controller_type) X(graph_exec_type) X(error) X(cuda_error)       \
    X(nvrtc_error) X(unavailable_error) X(cubins) X(kernel_info)

/* The frame the heap types (prepared.c, graphexec.c, controller.c) share. */

/* Defines PyType_Spec spec: the heap type l2prefetch._C.<pyname> (a string
 * literal) of ctype instances, with tpflags and the slots after them (the
 * table's end added). */
#define L2P_DEFINE_TYPE(spec, pyname, ctype, tpflags, ...)                                  \
    static PyType_Slot spec##_slots[] = {__VA_ARGS__, {0, NULL}};                           \
    PyType_Spec spec = {                                                                    \
        .name = "l2prefetch._C." pyname,                                                    \
        .basicsize = sizeof(ctype),                                                         \
        .flags = (tpflags),                                                                 \
        .slots = spec##_slots,                                                              \
    }

/* A PyGetSetDef row: the read-only attribute name, read by get_<name>, which
 * takes the L2P_GETTER_SELF * (the object's C type, defined by the file above
 * its table) and a closure.  The _Generic has no other branch, so a get_<name>
 * of any other signature fails to compile rather than hide behind the cast to
 * getter. */
#define L2P_GETTER(name, doc)                                                               \
    {#name, _Generic(get_##name, PyObject *(*)(L2P_GETTER_SELF *, void *): (getter)get_##name), \
     NULL, doc, NULL}

/* The PyMethodDef rows __reduce_ex__ and __reduce__, both served by reduce (a
 * function raising TypeError): for objects holding this process's CUDA
 * resources, which pickle and copy cannot carry elsewhere. */
#define L2P_NO_PICKLE(reduce)                                                               \
    {"__reduce_ex__", (reduce), METH_VARARGS, NULL}, {"__reduce__", (reduce), METH_VARARGS, NULL}

/* A tp_dealloc begins, for a GC type with weak references: untracked, the
 * weak references cleared. */
static inline void l2p_dealloc_begin(PyObject *self, PyObject *weakreflist)
{
    PyObject_GC_UnTrack(self);
    if (weakreflist)
        PyObject_ClearWeakRefs(self);
}

/* A tp_dealloc ends, once the object released what else it holds: its driver
 * instance dropped (NULL: none), the object freed, then its type's reference. */
static inline void l2p_dealloc_end(PyObject *self, l2p_driver *drv)
{
    PyTypeObject *tp = Py_TYPE(self);
    l2p_driver_decref(drv);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* errors.c: status -> exception, in one place.  All return NULL / -1. */
PyObject *l2p_raise_cuda(l2p_state *st, l2p_driver *d, const char *operation, CUresult status);
int l2p_raise_cuda_int(l2p_state *st, l2p_driver *d, const char *operation, CUresult status);
PyObject *l2p_raise_nvrtc(l2p_state *st, l2p_nvrtc *n, const char *operation, nvrtcResult status,
                          const char *log, PyObject *options, const char *source);
/* Shutdown-safe report from a destructor: ignores DEINITIALIZED and
 * CONTEXT_IS_DESTROYED, otherwise writes an unraisable warning. */
void l2p_report_in_dealloc(l2p_driver *d, const char *operation, CUresult status, PyObject *obj);
/* obj.name into *out (new reference): 1 found, 0 no such attribute (the
 * AttributeError cleared), -1 any other exception (left set). */
int l2p_optional_attr(PyObject *obj, const char *name, PyObject **out);
/* With an exception set: whether it is not an Exception (KeyboardInterrupt,
 * SystemExit, ...): such ones are passed through, never converted. */
int l2p_error_is_base(void);
/* Replaces the set exception by type(format % ...) whose __cause__ it is.  NULL. */
PyObject *l2p_format_from_cause(PyObject *type, const char *format, ...);
/* repr(o) for a message (new reference, NULL with the repr's error set): an int past
 * 160 bits named by its size and sign instead (its repr may pass CPython's 4300-digit
 * limit, and would fill the message).  An error set before the call stays set. */
PyObject *l2p_shown(PyObject *o);
/* Raises type(format % ... + l2p_shown(value)): a message that ends in the value.  NULL. */
PyObject *l2p_raise_shown(PyObject *type, PyObject *value, const char *format, ...);
/* Adds a note (PEP 678) to the set exception, e.g. which weight it was reading. */
void l2p_add_note(const char *format, ...);

/* args.c: arguments parsed the same way everywhere. */
typedef struct {
    const char *name;           /* the function's, for messages: "fork" */
    const char *const *params;  /* every parameter's name in order, NULL-terminated */
    int posonly;                /* the first posonly are positional only */
    int maxpos;                 /* how many may be given by position (the rest: keyword only) */
    int required;               /* the first required must be given */
} l2p_signature;
/* The arguments of a METH_FASTCALL (| METH_KEYWORDS) call by sig into vals:
 * each one given is stored there (borrowed), the others keep what the caller
 * put there (its defaults).  TypeError as CPython words it for a wrong count,
 * an unknown keyword, a value given twice or a missing one.  Matching runs no
 * Python code (keywords are compared as text, never through __eq__/__hash__);
 * only the unknown-keyword error formats the key with repr(), and returns. */
int l2p_parse_args(const l2p_signature *sig, PyObject *const *args, Py_ssize_t nargs,
                   PyObject *kwnames, PyObject **vals);
/* The device of a `device=` argument: None (-1), an int, 'cuda'/'cuda:N' or a
 * torch.device.  Other types are TypeError, other values ValueError. */
int l2p_parse_device(PyObject *obj, int *out);
/* torch's current CUDA device when torch is imported, else 0 (a torch that
 * cannot say counts as 0); -1 only with a BaseException. */
int l2p_default_device(int *out);
/* l2p_parse_device, with None meaning l2p_default_device. */
int l2p_device_arg(PyObject *obj, int *out);
/* The items of seq (any iterable: copied into a new tuple, *held, that nothing
 * else can change while the array is in use) as a NULL-terminated array of *n
 * C strings borrowed from it: each an instance of type, &PyUnicode_Type (its
 * UTF-8) or &PyBytes_Type; another item is TypeError "<what> must be <type>,
 * not <its type>".  A string holding a NUL is cut there, as any C string is.
 * Only the copy runs Python code: the __iter__ of seq if it is no tuple or
 * list, and the finalizers of a collection its allocation starts.  PyMem_Free
 * the array, then drop *held; NULL with an exception. */
const char **l2p_c_strings(PyObject *seq, PyTypeObject *type, const char *what, PyObject **held,
                           Py_ssize_t *n);

/* state.c: the module state and what it holds. */
l2p_state *l2p_get_state(PyObject *module);
/* The state of our module for one of our types or a subclass of one. */
l2p_state *l2p_state_of_type(PyTypeObject *type);
/* The driver and NVRTC of this module, opened on first use (raise on failure).
 * Borrowed from the state: a caller that goes on to run Python code (an
 * allocation, a copy of a sequence, a warning) takes its reference at once,
 * before any such call: l2p_hold_driver / l2p_hold_nvrtc are the two steps in
 * one, the caller dropping it (l2p_driver_decref / l2p_nvrtc_decref) when done. */
l2p_driver *l2p_use_driver(l2p_state *st);
l2p_nvrtc *l2p_use_nvrtc(l2p_state *st);
l2p_driver *l2p_hold_driver(l2p_state *st);
l2p_nvrtc *l2p_hold_nvrtc(l2p_state *st);
/* Forgets the in-process kernel images and their info (the disk cache stays). */
void l2p_forget_kernels(l2p_state *st);
/* Device `device` of d, made ready (l2p_device_ready), or NULL with an
 * exception: ValueError when d has no such device, else CudaError whose
 * operation is "<the failed call> (preparing cuda:N)". */
l2p_device *l2p_use_device(l2p_state *st, l2p_driver *d, int device);
/* The value of an environment flag, the one rule for C and Python (_C.env_flag):
 * 1 for 1/true/yes/on in any case, with surrounding blanks ignored. */
int l2p_env_flag(const char *name);
PyObject *l2p_py_env_flag(PyObject *module, PyObject *arg);
PyObject *l2p_py_driver_info(PyObject *module, PyObject *unused);
PyObject *l2p_py_nvrtc_info(PyObject *module, PyObject *unused);
PyObject *l2p_py_use_driver(PyObject *module, PyObject *arg);
PyObject *l2p_py_use_nvrtc(PyObject *module, PyObject *arg);

/* ranges.c */
/* A byte range; also the kernel's L2pRange in the parameter block (prepared.c). */
typedef struct {
    uint64_t ptr;     /* first byte, 16-byte aligned */
    uint64_t nbytes;  /* bytes from ptr; need not be a multiple of 16 */
} l2p_range;

typedef struct {
    int kind;           /* L2P_DEV_* */
    int index;          /* device index, -1 when unknown */
    int empty;          /* no bytes */
    uint64_t ptr;       /* first byte when not empty */
} l2p_weight_device;
enum { L2P_DEV_UNKNOWN = 0, L2P_DEV_CUDA = 1, L2P_DEV_OTHER = 2 };

/* Ranges of `weights` (a sequence) with the reference design's rules.  On success returns
 * a new tuple of the weights and fills *ranges (PyMem_Malloc'd, *n entries,
 * *n may be 0) and, if devices is not NULL, one entry per weight
 * (PyMem_Malloc'd); if storages is not NULL, a new tuple of the untyped_storage() of
 * each tensor that gave a range (what keeps its bytes allocated).  Each tensor's
 * range must lie in its storage.  Raises TypeError/ValueError/OverflowError otherwise. */
PyObject *l2p_compute_ranges(PyObject *weights, long long byte_cap, l2p_range **ranges,
                             Py_ssize_t *n, l2p_weight_device **devices, PyObject **device_names,
                             PyObject **storages);
/* The bytes of one tensor (or __cuda_array_interface__ object) as a range for a
 * fork's activation: its span, the start rounded up to 16 bytes (the kernel's
 * granule) and the size cut to match, so no byte outside it is read.  Returns 1
 * with *out filled, 0 when nothing is left (empty, or under 16 bytes), -1 with an
 * exception; *dev is filled whenever it returns >= 0 (its ptr the first byte, before
 * the rounding), so a small object's device can be checked too.  Runs the object's
 * Python code, as weights' reading does. */
int l2p_span_of(PyObject *obj, l2p_range *out, l2p_weight_device *dev);
PyObject *l2p_py_compute_ranges(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames);

/* stream.c: torch's current stream without Python, through the AOTI shim. */
int l2p_current_stream(int device, CUstream *out);
/* stream: None (current), int handle, or an object with .cuda_stream (and
 * .device.index checked against device). */
int l2p_parse_stream(PyObject *stream, int device, CUstream *out);
PyObject *l2p_py_stream_source(PyObject *module, PyObject *unused);
PyObject *l2p_py_set_stream_source(PyObject *module, PyObject *arg);

/* kernels.c: variants, compile (memory and disk cache), module load. */
typedef struct {
    const char *name;
    int min_sm;          /* lowest compute capability x 10 */
    const char *defines; /* -D options that select it */
    unsigned int block;
    unsigned int smem;   /* dynamic shared memory per CTA */
    const char *doc;
} l2p_variant;
extern const l2p_variant l2p_variants[];
extern const int l2p_num_variants;
extern const unsigned int l2p_capacities[L2P_NUM_CAPACITIES];
int l2p_variant_find(const char *name);
/* The variant a str object names, or -1 with ValueError. */
int l2p_variant_arg(PyObject *name);
int l2p_variant_default(int sm);
/* Whether variant runs on sm (x10); ValueError otherwise, naming device when it
 * is >= 0 (the sm of a device) and what l2prefetch needs when sm is below every
 * variant's minimum. */
int l2p_variant_check_sm(int variant, int sm, int device);
/* Compiled code for (sm, variant) as bytes: memory cache, disk cache, NVRTC. */
PyObject *l2p_kernel_image(l2p_state *st, int sm, int variant, int *is_ptx);
/* The function for (device, variant, capacity index), loading the module once. */
int l2p_kernel_function(l2p_state *st, l2p_driver *d, l2p_device *dev, int variant, int cap,
                        CUfunction *out);
PyObject *l2p_py_compile(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                         PyObject *kwnames);
PyObject *l2p_py_variants(PyObject *module, PyObject *unused);
PyObject *l2p_py_kernel_image(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *l2p_py_kernel_cache_info(PyObject *module, PyObject *unused);
PyObject *l2p_py_clear_kernel_cache(PyObject *module, PyObject *unused);
PyObject *l2p_py_compile_source(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* prepared.c */
extern PyType_Spec l2p_prepared_spec;
typedef struct l2p_prepared l2p_prepared;
int l2p_prepared_check(l2p_state *st, PyObject *obj);
int l2p_prepared_device(PyObject *obj);
uint64_t l2p_prepared_nbytes(PyObject *obj);
/* Whether its weights are still held (tp_clear of a cycle drops them): a
 * cleared table must not launch. */
int l2p_prepared_alive(PyObject *obj);
/* Whether it keeps a slot for a fork's activation (warm_activation=True). */
int l2p_prepared_warms(PyObject *obj);
/* Launch on stream; returns CUresult (no exception).  extra (or NULL) is appended
 * to the table for this launch only, where it warms. */
CUresult l2p_prepared_launch_raw(PyObject *obj, CUstream stream, const l2p_range *extra);
/* The 64-bit words of the largest parameter block (a buffer for a table with extra). */
#define L2P_TABLE_WORDS (2 + 2 * L2P_MAX_TABLE)
/* prepared's launch as a kernel node's parameters (func, dimensions, its table, with
 * extra as in l2p_prepared_launch_raw): p->kernelParams is prepared's own array
 * when nothing is appended, else slot, whose one entry points at the table's copy in
 * buf (L2P_TABLE_WORDS words); slot and buf must live until the params are used. */
void l2p_prepared_node_params(PyObject *obj, CUDA_KERNEL_NODE_PARAMS *p, const l2p_range *extra,
                              uint64_t *buf, void **slot);
l2p_driver *l2p_prepared_driver(PyObject *obj);

/* capture.c: the inline graph fork (NOTE [inline graph fork]). */
int l2p_capture_inline_available(const l2p_driver *d);
/* Capture prepared's launch on s (capturing) as a node after s's last nodes;
 * with order_edge the next node gets a launch-order edge from it ('inline'),
 * else nothing depends on it ('leaf'); with early (and order_edge, no chain) its
 * edges from kernel nodes are programmatic (sm_90+ only); extra as in
 * l2p_prepared_launch_raw.  On failure *failed names the driver call. */
CUresult l2p_capture_inline_launch(l2p_driver *d, CUstream s, PyObject *prepared,
                                   const l2p_range *extra, int order_edge, int early, CUgraphNode chain,
                                   CUgraphNode *node, const char **failed);

/* graphexec.c: GraphExec, an executable graph held with the driver that made it. */
extern PyType_Spec l2p_graph_exec_spec;
/* A new GraphExec that owns exec and holds d (its own reference); on failure
 * exec is destroyed through d and NULL returned with the exception. */
PyObject *l2p_graph_exec_new(l2p_state *st, l2p_driver *d, CUgraphExec exec);

/* graph.c: loader nodes of a captured graph, switched in place; the graph without them. */
PyObject *l2p_py_graph_loader_nodes(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *l2p_py_graph_set_loaders(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *l2p_py_graph_edges(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *l2p_py_graph_instantiate_without(PyObject *module, PyObject *const *args,
                                           Py_ssize_t nargs);

/* controller.c */
extern PyType_Spec l2p_controller_spec;

/* bench.c */
PyObject *l2p_py_floor_fork_join(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* module.c: the module; its definition is its identity, which
 * l2p_state_of_type looks a subclass's module up by (the one name a unit
 * takes from module.c: data, never a call). */
extern PyModuleDef l2p_module_def;

#endif /* L2P_H */
