/*
 * fakecuda.c: a recording stand-in for the CUDA driver (libcuda.so.1), built by
 * the l2prefetch test suite (tests/_fakecuda.py) so that the extension's driver
 * code can be exercised on CI machines that have no GPU.
 *
 * What it does
 *   - Exports the driver entry points l2prefetch uses, under their plain names
 *     and through cuGetProcAddress / cuGetProcAddress_v2 (which honour the ABI
 *     version: asking for a version above the configured driver version, or
 *     below the one ABI this file implements, reports "not found").
 *   - Writes one log line per call ("name key=value ... [-> CUDA_ERROR_X]"),
 *     counts calls per entry point, and counts live streams, events, modules and
 *     primary-context retains.  Destroying an unknown or dead handle returns
 *     CUDA_ERROR_INVALID_HANDLE and is counted as a bad destroy.
 *   - Fails the Nth next call of any entry point on request (fake_fail).
 *   - Checks what a real driver would reject and CI could otherwise miss: calls
 *     before cuInit, objects created without a current context, use of destroyed
 *     streams/events/modules/released contexts, launches whose dynamic shared
 *     memory exceeds what cuFuncSetAttribute allowed (48 KiB by default), bad
 *     launch dimensions, and work mixing streams/events/functions of different
 *     devices.
 *
 * What it leaves out
 *   - No GPU work, memory or real graphs.  Capture is one global state set
 *     with fake_set_capture(): while it is on, every stream reports ACTIVE and
 *     shares one dependency set of graph nodes; a successful launch adds a
 *     kernel node that depends on the set and becomes it (the log line shows
 *     " node=N deps=[M:tT/pP,...]": node indices, edge type and from-port) and
 *     keeps a copy of the launch's parameter (a loader's whole table) valid
 *     until fake_reset, as the driver keeps the node's;
 *     fake_add_capture_node() adds a node of another type (a memcpy, say);
 *     cuStreamUpdateCaptureDependencies replaces or extends the set and checks
 *     that a programmatic edge leaves a kernel node through port 1 or 2.
 *   - Only primary contexts exist; the context stack is per thread as in the
 *     real driver (fake_reset empties every thread's stack).
 *   - Module images are not parsed (the log only names their format), any
 *     function name is found, each cuModuleGetFunction returns a new handle.
 *   - Streams and events that this file did not create ("foreign" handles, e.g.
 *     torch's) are accepted and belong to device 0.
 *   - No CUDA headers: the few types are declared below (x86-64 layouts).
 *
 * Handles are never dereferenced by callers, so they are encoded integers:
 * kind << 48 | reset generation << 36 | (index + 1) << 4 (non-canonical
 * addresses, so a stray dereference faults at once).  Everything is guarded by
 * one mutex; log and counters are process-wide.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUstream;
typedef void *CUevent;

typedef struct {
    int id;
    char pad[4];
    union {
        char pad[64];
        int priority;                   /* id 8 */
        unsigned int sharedMemCarveout; /* id 14 */
    } value;
} CUlaunchAttribute;

typedef struct {
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned numAttrs;
} CUlaunchConfig;

_Static_assert(sizeof(CUlaunchAttribute) == 72, "CUlaunchAttribute layout");
_Static_assert(sizeof(CUlaunchConfig) == 56, "CUlaunchConfig layout");

enum {
    OK = 0, E_INVALID_VALUE = 1, E_OUT_OF_MEMORY = 2, E_NOT_INITIALIZED = 3,
    E_INVALID_DEVICE = 101, E_INVALID_CONTEXT = 201, E_INVALID_HANDLE = 400, E_NOT_FOUND = 500,
};

static const struct { int code; const char *name, *desc; } errors[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {200, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {209, "CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution on the device"},
    {218, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {719, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},
    {901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"},
    {904, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED", "capture was not joined"},
    {912, "CUDA_ERROR_LOSSY_QUERY", "attempted introspection would be semantically lossy"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

/* Entry points: name, the ABI version implemented here, whether cuInit is needed. */
#define ENTRY_POINTS(X)                                                                  \
    X(cuGetErrorName, 6000, 0) X(cuGetErrorString, 6000, 0) X(cuInit, 2000, 0)           \
    X(cuDriverGetVersion, 2020, 0) X(cuGetProcAddress, 11030, 0)                         \
    X(cuGetProcAddress_v2, 12000, 0) X(cuDeviceGetCount, 2000, 1) X(cuDeviceGet, 2000, 1) \
    X(cuDeviceGetAttribute, 2000, 1) X(cuDevicePrimaryCtxRetain, 7000, 1)                \
    X(cuDevicePrimaryCtxRelease, 11000, 1) X(cuCtxGetCurrent, 4000, 1)                   \
    X(cuCtxSetCurrent, 4000, 1) X(cuCtxPushCurrent, 4000, 1) X(cuCtxPopCurrent, 4000, 1)  \
    X(cuCtxGetDevice, 2000, 1) X(cuCtxGetStreamPriorityRange, 5050, 1)                   \
    X(cuModuleLoadData, 2000, 1) X(cuModuleUnload, 2000, 1)                              \
    X(cuModuleGetFunction, 2000, 1) X(cuFuncSetAttribute, 9000, 1)                       \
    X(cuLaunchKernelEx, 11060, 1) X(cuStreamCreateWithPriority, 5050, 1)                 \
    X(cuStreamDestroy, 4000, 1) X(cuStreamGetCtx, 9020, 1)                               \
    X(cuStreamGetCaptureInfo, 12030, 1) X(cuEventCreate, 2000, 1)                        \
    X(cuEventDestroy, 4000, 1) X(cuEventRecord, 2000, 1) X(cuStreamWaitEvent, 3020, 1)   \
    X(cuStreamSynchronize, 2000, 1) X(cuPointerGetAttribute, 4000, 1)                  \
    X(cuStreamUpdateCaptureDependencies, 12030, 1) X(cuGraphNodeGetType, 10000, 1)      \
    X(cuGraphGetNodes, 10000, 1) X(cuGraphKernelNodeGetParams, 12000, 1)                \
    X(cuGraphNodeSetEnabled, 11060, 1) X(cuGraphExecKernelNodeSetParams, 12000, 1)      \
    X(cuGraphGetEdges, 12030, 1) X(cuGraphClone, 10000, 1)                              \
    X(cuGraphNodeFindInClone, 10000, 1) X(cuGraphDestroyNode, 10000, 1)                 \
    X(cuGraphDestroy, 10000, 1) X(cuGraphInstantiateWithFlags, 11040, 1)                \
    X(cuGraphLaunch, 10000, 1) X(cuGraphExecDestroy, 10000, 1)

#define X_ENUM(n, v, i) EP_##n,
enum { ENTRY_POINTS(X_ENUM) EP_COUNT };
#define X_META(n, v, i) {#n, v, i},
static const struct { const char *name; int version, needs_init; } meta[EP_COUNT] = {ENTRY_POINTS(X_META)};

/* ---- state ---------------------------------------------------------------- */

enum { K_CTX = 1, K_MODULE, K_FUNC, K_STREAM, K_EVENT, K_GRAPH, K_NODE, K_EXEC, K_COUNT };
#define MAX_DEPS 32

typedef struct { unsigned char from_port, to_port, type, reserved[5]; } EdgeData;
_Static_assert(sizeof(EdgeData) == 8, "CUgraphEdgeData layout");
#define MAX_DEVICES 64
#define MAX_PENDING 256
#define MAX_OVERRIDES 32
#define CTX_STACK 64
#define LINE_CAP 2048

typedef struct {
    int live, device, max_dyn_smem; /* max_dyn_smem: functions, 0 = never set */
    int node_type;                            /* graph nodes: CUgraphNodeType */
    size_t module;                            /* functions: index of their module */
    char *name;                               /* functions: kernel name */
    void *func;                               /* kernel nodes: the function launched */
    struct NodeParams *params;                /* kernel nodes: their parameters' copy */
    void *deps[8];                            /* nodes: the capture's set when made */
    size_t ndeps;                             /*   (the edges into it; at most 8 kept) */
} Obj;

/* CUDA_KERNEL_NODE_PARAMS_v2 (x86-64 layout). */
typedef struct {
    void *func;
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    void **kernelParams, **extra;
    void *kern, *ctx;
} KernelNodeParams;
_Static_assert(sizeof(KernelNodeParams) == 72, "CUDA_KERNEL_NODE_PARAMS_v2 layout");

typedef struct { Obj *v; size_t n, cap; long live; } Table; /* every object of one kind */

/* A kernel node's parameters as cuGraphKernelNodeGetParams hands them out: kernelParams
 * -> {table}.  A heap block of its own, not part of the node's Obj, so that it stays
 * where it is when the node table grows (realloc), as long as the node exists (until
 * fake_reset), as the real driver keeps the copy it made at capture.  table is the
 * loader's parameter (L2pTable: count, granules, then ranges) at its whole capacity. */
typedef struct NodeParams {
    void *kernel_params[1];
    size_t capacity;                          /* ranges that table holds */
    uint64_t table[];
} NodeParams;

#define DEFAULTS .device_count = 1, .cc_major = 9, .cc_minor = 0, .driver_version = 13000

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER; /* guards S and every call */
static struct State {
    unsigned gen; /* bumped by fake_reset */
    int initialized, uninit_error, device_count, cc_major, cc_minor, driver_version;
    unsigned long long capture_id;
    void *dep_nodes[MAX_DEPS];                /* the capture's dependency set */
    EdgeData dep_edges[MAX_DEPS];
    size_t ndeps;
    int calls[EP_COUNT];
    struct { int ep, target, code, active; } pending[MAX_PENDING];
    struct { int attrib, value; } overrides[MAX_OVERRIDES];
    int n_overrides;
    long ctx_refs[MAX_DEVICES], bad_destroys;
    Table objs[K_COUNT];
    char *log;
    size_t log_len, log_cap;
} S = {.gen = 1, DEFAULTS};

#define LOCKED(...) do { pthread_mutex_lock(&mu); __VA_ARGS__; pthread_mutex_unlock(&mu); } while (0)

/* The context stack is per thread; a stack from an older reset generation is empty. */
static _Thread_local struct { unsigned gen; int n; CUcontext s[CTX_STACK]; } tl;

static void tl_sync(void) {
    if (tl.gen != S.gen) { tl.gen = S.gen; tl.n = 0; }
}

/* ---- handles -------------------------------------------------------------- */

static void *mkhandle(int kind, size_t idx) {
    return (void *)(uintptr_t)(((uint64_t)kind << 48) | ((uint64_t)(S.gen & 0xfff) << 36) |
                               ((uint64_t)(idx + 1) << 4));
}

static Obj *new_obj(int kind, int device, void **handle) {
    Table *t = &S.objs[kind];
    if (t->n == t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 64;
        Obj *v = realloc(t->v, cap * sizeof *v);
        if (!v) return NULL;
        t->v = v;
        t->cap = cap;
    }
    Obj *o = &t->v[t->n];
    memset(o, 0, sizeof *o);
    o->live = 1;
    o->device = device;
    *handle = mkhandle(kind, t->n++);
    if (kind != K_FUNC) t->live++;
    return o;
}

/* The object behind a handle this library made since the last reset (live or
 * dead), or NULL for a foreign handle. */
static Obj *find(int kind, const void *h) {
    uint64_t u = (uint64_t)(uintptr_t)h, idx = (u >> 4) & 0xffffffffu;
    if ((u >> 48) != (uint64_t)kind || ((u >> 36) & 0xfff) != (S.gen & 0xfff) || (u & 0xf) ||
        idx == 0 || idx > S.objs[kind].n)
        return NULL;
    return &S.objs[kind].v[idx - 1];
}

static int destroy_obj(int kind, const void *h) { /* destroy; 0 or E_INVALID_HANDLE */
    Obj *o = find(kind, h);
    if (!o || !o->live) { S.bad_destroys++; return E_INVALID_HANDLE; }
    o->live = 0;
    S.objs[kind].live--;
    return OK;
}

static Obj *func_obj(const void *h) { /* a function whose module is still loaded */
    Obj *f = find(K_FUNC, h);
    return f && S.objs[K_MODULE].v[f->module].live ? f : NULL;
}

static CUcontext ctx_handle(int dev) { return (CUcontext)(uintptr_t)((uint64_t)K_CTX << 48 | (uint64_t)(dev + 1) << 4); }

static int ctx_device(CUcontext c) { /* device of a retained primary context, else -1 */
    uint64_t u = (uint64_t)(uintptr_t)c, d = ((u >> 4) & 0xffff) - 1;
    if ((u >> 48) != K_CTX || (u & 0xf) || ((u >> 20) & 0xfffffff) || d >= (uint64_t)S.device_count)
        return -1;
    return S.ctx_refs[d] > 0 ? (int)d : -1;
}

static int cur_dev(void) {
    tl_sync();
    return tl.n ? ctx_device(tl.s[tl.n - 1]) : -1;
}

/* Device of a stream: legacy/per-thread default streams -> current context, our
 * streams -> where they were created, foreign ones -> device 0 (*foreign set). */
static CUresult stream_dev(CUstream s, int *dev, int *foreign) {
    uintptr_t u = (uintptr_t)s;
    *foreign = 0;
    if (u <= 2) return (*dev = cur_dev()) < 0 ? E_INVALID_CONTEXT : OK;
    Obj *o = find(K_STREAM, s);
    if (o) { *dev = o->device; return o->live ? OK : E_INVALID_HANDLE; }
    *foreign = 1;
    *dev = 0;
    return S.device_count > 0 ? OK : E_INVALID_CONTEXT;
}

static CUresult event_dev(CUevent e, int *dev) { /* -1 for foreign events */
    if (!e) return E_INVALID_HANDLE;
    Obj *o = find(K_EVENT, e);
    *dev = o ? o->device : -1;
    return !o || o->live ? OK : E_INVALID_HANDLE;
}

/* ---- log and call bookkeeping --------------------------------------------- */

static const char *err_name(int code) {
    for (size_t i = 0; i < sizeof errors / sizeof *errors; i++)
        if (errors[i].code == code) return errors[i].name;
    return NULL;
}

static int ep_index(const char *name) {
    for (int i = 0; name && i < EP_COUNT; i++)
        if (!strcmp(meta[i].name, name)) return i;
    return -1;
}

static void log_append(const char *line, size_t len) {
    if (S.log_len + len + 2 > S.log_cap) {
        size_t cap = S.log_cap ? S.log_cap : 1 << 16;
        while (S.log_len + len + 2 > cap) cap *= 2;
        char *p = realloc(S.log, cap);
        if (!p) return; /* drop the line rather than crash */
        S.log = p;
        S.log_cap = cap;
    }
    for (size_t i = 0; i < len; i++) /* one call, one line */
        S.log[S.log_len++] = (line[i] == '\n' || line[i] == '\r') ? '?' : line[i];
    S.log[S.log_len++] = '\n';
    S.log[S.log_len] = '\0';
}

/* One log line in the making; arguments stop at lim, leaving room for the result. */
typedef struct { int ep, rc; size_t len, lim; char buf[LINE_CAP]; } Call;

static void vaddf(Call *c, const char *fmt, va_list ap) {
    if (c->len + 1 >= c->lim) return;
    size_t room = c->lim - c->len;
    int n = vsnprintf(c->buf + c->len, room, fmt, ap);
    if (n > 0) c->len += (size_t)n < room ? (size_t)n : room - 1;
}

__attribute__((format(printf, 2, 3))) static void addf(Call *c, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vaddf(c, fmt, ap);
    va_end(ap);
}

/* start() takes the lock and names the call; the caller adds its arguments; gate()
 * counts the call and returns 1 when it must return c->rc at once (injected
 * failure, or cuInit not done yet).  end() finishes the line and unlocks. */
static void start(Call *c, int ep) {
    pthread_mutex_lock(&mu);
    c->ep = ep;
    c->rc = OK;
    c->len = 0;
    c->lim = LINE_CAP - 64;
    addf(c, "%s", meta[ep].name);
}

static int gate(Call *c) {
    int n = ++S.calls[c->ep];
    for (int i = 0; i < MAX_PENDING; i++)
        if (S.pending[i].active && S.pending[i].ep == c->ep && S.pending[i].target == n) {
            S.pending[i].active = 0;
            c->rc = S.pending[i].code;
            return 1;
        }
    if (meta[c->ep].needs_init && !S.initialized) { c->rc = E_NOT_INITIALIZED; return 1; }
    return 0;
}

static CUresult end(Call *c, CUresult rc) {
    c->lim = LINE_CAP;
    if (rc != OK) {
        const char *n = err_name(rc);
        if (n) addf(c, " -> %s", n);
        else addf(c, " -> CUDA_ERROR_%d", rc);
    }
    log_append(c->buf, c->len);
    pthread_mutex_unlock(&mu);
    return rc;
}

#define BEGIN(ep, fmt, ...)          \
    Call c;                          \
    start(&c, EP_##ep);              \
    addf(&c, " " fmt, __VA_ARGS__); \
    if (gate(&c)) return end(&c, c.rc)
#define BEGIN0(ep)      \
    Call c;             \
    start(&c, EP_##ep); \
    if (gate(&c)) return end(&c, c.rc)
#define H(p) ((unsigned long long)(uintptr_t)(p)) /* handles and pointers print as 0x%llx */

/* ---- entry points: errors, init, devices ---------------------------------- */

static CUresult error_text(Call *c, CUresult e, const char **out, int desc) {
    if (!out) return end(c, E_INVALID_VALUE);
    for (size_t i = 0; i < sizeof errors / sizeof *errors; i++)
        if (errors[i].code == e) { *out = desc ? errors[i].desc : errors[i].name; return end(c, OK); }
    *out = NULL;
    return end(c, E_INVALID_VALUE);
}

EXPORT CUresult cuGetErrorName(CUresult e, const char **out) {
    BEGIN(cuGetErrorName, "error=%d", e);
    return error_text(&c, e, out, 0);
}

EXPORT CUresult cuGetErrorString(CUresult e, const char **out) {
    BEGIN(cuGetErrorString, "error=%d", e);
    return error_text(&c, e, out, 1);
}

EXPORT CUresult cuInit(unsigned flags) {
    BEGIN(cuInit, "flags=0x%x", flags);
    if (flags) return end(&c, E_INVALID_VALUE);
    if (S.uninit_error) return end(&c, S.uninit_error);
    S.initialized = 1;
    return end(&c, OK);
}

EXPORT CUresult cuDriverGetVersion(int *v) {
    BEGIN0(cuDriverGetVersion);
    if (!v) return end(&c, E_INVALID_VALUE);
    *v = S.driver_version;
    addf(&c, " version=%d", *v);
    return end(&c, OK);
}

EXPORT CUresult cuDeviceGetCount(int *n) {
    BEGIN0(cuDeviceGetCount);
    if (!n) return end(&c, E_INVALID_VALUE);
    *n = S.device_count;
    addf(&c, " count=%d", *n);
    return end(&c, OK);
}

EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    BEGIN(cuDeviceGet, "ordinal=%d", ordinal);
    if (!d) return end(&c, E_INVALID_VALUE);
    if (ordinal < 0 || ordinal >= S.device_count) return end(&c, E_INVALID_DEVICE);
    *d = ordinal;
    return end(&c, OK);
}

EXPORT CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev) {
    BEGIN(cuDeviceGetAttribute, "attrib=%d dev=%d", attrib, dev);
    if (!pi) return end(&c, E_INVALID_VALUE);
    if (dev < 0 || dev >= S.device_count) return end(&c, E_INVALID_DEVICE);
    int v = 0;
    switch (attrib) {
    case 75: v = S.cc_major; break;
    case 76: v = S.cc_minor; break;
    case 16: v = 132; break;      /* multiprocessor count */
    case 38: v = 62914560; break; /* L2 cache bytes */
    case 97: v = 232448; break;   /* max opt-in shared memory per block */
    }
    for (int i = 0; i < S.n_overrides; i++)
        if (S.overrides[i].attrib == attrib) v = S.overrides[i].value;
    *pi = v;
    addf(&c, " value=%d", v);
    return end(&c, OK);
}

/* ---- contexts -------------------------------------------------------------- */

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    BEGIN(cuDevicePrimaryCtxRetain, "dev=%d", dev);
    if (!pctx) return end(&c, E_INVALID_VALUE);
    if (dev < 0 || dev >= S.device_count) return end(&c, E_INVALID_DEVICE);
    S.ctx_refs[dev]++;
    *pctx = ctx_handle(dev);
    addf(&c, " ctx=0x%llx", H(*pctx));
    return end(&c, OK);
}

EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    BEGIN(cuDevicePrimaryCtxRelease, "dev=%d", dev);
    if (dev < 0 || dev >= S.device_count) return end(&c, E_INVALID_DEVICE);
    if (S.ctx_refs[dev] <= 0) { S.bad_destroys++; return end(&c, E_INVALID_HANDLE); }
    S.ctx_refs[dev]--;
    return end(&c, OK);
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx) {
    BEGIN0(cuCtxGetCurrent);
    if (!pctx) return end(&c, E_INVALID_VALUE);
    tl_sync();
    *pctx = tl.n ? tl.s[tl.n - 1] : NULL;
    addf(&c, " ctx=0x%llx", H(*pctx));
    return end(&c, OK);
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    BEGIN(cuCtxSetCurrent, "ctx=0x%llx", H(ctx));
    if (ctx && ctx_device(ctx) < 0) return end(&c, E_INVALID_CONTEXT);
    tl_sync();
    if (!ctx) { if (tl.n) tl.n--; }   /* NULL pops (no-op on an empty stack) */
    else if (tl.n) tl.s[tl.n - 1] = ctx; /* replaces the top */
    else tl.s[tl.n++] = ctx;
    return end(&c, OK);
}

EXPORT CUresult cuCtxPushCurrent(CUcontext ctx) {
    BEGIN(cuCtxPushCurrent, "ctx=0x%llx", H(ctx));
    if (!ctx || ctx_device(ctx) < 0) return end(&c, E_INVALID_CONTEXT);
    tl_sync();
    if (tl.n == CTX_STACK) return end(&c, E_OUT_OF_MEMORY);
    tl.s[tl.n++] = ctx;
    return end(&c, OK);
}

EXPORT CUresult cuCtxPopCurrent(CUcontext *pctx) {
    BEGIN0(cuCtxPopCurrent);
    tl_sync();
    if (!tl.n) return end(&c, E_INVALID_CONTEXT);
    CUcontext top = tl.s[--tl.n];
    if (pctx) *pctx = top;
    addf(&c, " ctx=0x%llx", H(top));
    return end(&c, OK);
}

EXPORT CUresult cuCtxGetDevice(CUdevice *d) {
    BEGIN0(cuCtxGetDevice);
    int dev = cur_dev();
    if (dev < 0) return end(&c, E_INVALID_CONTEXT);
    if (!d) return end(&c, E_INVALID_VALUE);
    *d = dev;
    addf(&c, " dev=%d", dev);
    return end(&c, OK);
}

EXPORT CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest) {
    BEGIN0(cuCtxGetStreamPriorityRange);
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return end(&c, OK);
}

/* ---- modules and launches -------------------------------------------------- */

static const char *image_format(const unsigned char *p) {
    if (p[0] == 0x7f && p[1] == 'E' && p[2] == 'L' && p[3] == 'F') return "cubin";
    if (p[0] == 0x50 && p[1] == 0xed && p[2] == 0x55 && p[3] == 0xba) return "fatbin";
    if (p[0] == '/' || p[0] == '.' || p[0] == ' ' || p[0] == '\t' || p[0] == '\n') return "ptx";
    return "unknown";
}

EXPORT CUresult cuModuleLoadData(CUmodule *pm, const void *image) {
    BEGIN(cuModuleLoadData, "image=0x%llx", H(image));
    if (!pm || !image) return end(&c, E_INVALID_VALUE);
    addf(&c, " format=%s", image_format(image));
    int dev = cur_dev();
    if (dev < 0) return end(&c, E_INVALID_CONTEXT);
    if (!new_obj(K_MODULE, dev, pm)) return end(&c, E_OUT_OF_MEMORY);
    addf(&c, " module=0x%llx", H(*pm));
    return end(&c, OK);
}

EXPORT CUresult cuModuleUnload(CUmodule m) {
    BEGIN(cuModuleUnload, "module=0x%llx", H(m));
    return end(&c, destroy_obj(K_MODULE, m));
}

EXPORT CUresult cuModuleGetFunction(CUfunction *pf, CUmodule m, const char *name) {
    BEGIN(cuModuleGetFunction, "module=0x%llx name=%s", H(m), name ? name : "(null)");
    if (!pf || !name) return end(&c, E_INVALID_VALUE);
    Obj *mod = find(K_MODULE, m);
    if (!mod || !mod->live) return end(&c, E_INVALID_HANDLE);
    size_t mi = (size_t)(mod - S.objs[K_MODULE].v);
    char *copy = strdup(name);
    void *h;
    Obj *f = copy ? new_obj(K_FUNC, mod->device, &h) : NULL;
    if (!f) { free(copy); return end(&c, E_OUT_OF_MEMORY); }
    f->module = mi;
    f->name = copy;
    *pf = h;
    addf(&c, " func=0x%llx", H(h));
    return end(&c, OK);
}

EXPORT CUresult cuFuncSetAttribute(CUfunction fn, int attrib, int value) {
    BEGIN(cuFuncSetAttribute, "func=0x%llx attrib=%d value=%d", H(fn), attrib, value);
    Obj *f = func_obj(fn);
    if (!f) return end(&c, E_INVALID_HANDLE);
    if (attrib == 8) { /* CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES */
        int optin = 232448;
        for (int i = 0; i < S.n_overrides; i++)
            if (S.overrides[i].attrib == 97) optin = S.overrides[i].value;
        if (value < 0 || value > optin) return end(&c, E_INVALID_VALUE);
        f->max_dyn_smem = value;
    } else if (attrib == 9 && (value < -1 || value > 100)) { /* preferred carveout */
        return end(&c, E_INVALID_VALUE);
    }
    return end(&c, OK);
}

/* Index (1-based) of a node handle, 0 if it is none of ours. */
static size_t node_index(const void *h) {
    Obj *o = find(K_NODE, h);
    return o ? (size_t)(o - S.objs[K_NODE].v) + 1 : 0;
}

static void log_deps(Call *c) {
    addf(c, " deps=[");
    for (size_t i = 0; i < S.ndeps; i++)
        addf(c, "%s%zu:t%u/p%u", i ? "," : "", node_index(S.dep_nodes[i]), S.dep_edges[i].type,
             S.dep_edges[i].from_port);
    addf(c, "]");
}

/* A captured node of type: it depends on the current set, then is the set. */
static int capture_add_node(Call *c, int type) {
    void *h;
    Obj *o = new_obj(K_NODE, 0, &h);
    if (!o) return 0;
    o->node_type = type;
    for (size_t i = 0; i < S.ndeps && o->ndeps < 8; i++) o->deps[o->ndeps++] = S.dep_nodes[i];
    if (c) {
        addf(c, " node=%zu", node_index(h));
        log_deps(c);
    }
    S.dep_nodes[0] = h;
    memset(&S.dep_edges[0], 0, sizeof S.dep_edges[0]);
    S.ndeps = 1;
    return 1;
}

EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *cfg, CUfunction fn, void **params, void **extra) {
    Call c;
    start(&c, EP_cuLaunchKernelEx);
    Obj *f = func_obj(fn);
    if (!cfg) {
        addf(&c, " config=0x0 func=%s params=0x%llx extra=0x%llx", f ? f->name : "?", H(params), H(extra));
        return end(&c, gate(&c) ? c.rc : E_INVALID_VALUE);
    }
    addf(&c, " grid=%u,%u,%u block=%u,%u,%u smem=%u stream=0x%llx func=%s attrs=", cfg->gridDimX,
         cfg->gridDimY, cfg->gridDimZ, cfg->blockDimX, cfg->blockDimY, cfg->blockDimZ, cfg->sharedMemBytes,
         H(cfg->hStream), f ? f->name : "?");
    for (unsigned i = 0; cfg->attrs && i < cfg->numAttrs; i++) {
        const CUlaunchAttribute *a = &cfg->attrs[i];
        const char *sep = i ? "," : "";
        if (a->id == 8) addf(&c, "%spriority:%d", sep, a->value.priority);
        else if (a->id == 14) addf(&c, "%scarveout:%u", sep, a->value.sharedMemCarveout);
        else addf(&c, "%sid%d", sep, a->id);
    }
    if (!cfg->attrs || !cfg->numAttrs) addf(&c, "none");
    addf(&c, " params=0x%llx extra=0x%llx", H(params), H(extra));
    if (f && params && params[0] && !strncmp(f->name, "l2p_prefetch_", 13)) {
        /* a prefetch table, read now: a launch may pass a copy that is gone after it */
        const unsigned long long *t = params[0];
        addf(&c, " count=%llu granules=%llu", t[0], t[1]);
        if (t[0] && t[0] <= 128) addf(&c, " last=0x%llx+%llu", t[2 * t[0]], t[2 * t[0] + 1]);
    }
    if (gate(&c)) return end(&c, c.rc);
    if (!f) return end(&c, E_INVALID_HANDLE);
    int dev, foreign;
    CUresult rc = stream_dev(cfg->hStream, &dev, &foreign);
    if (rc) return end(&c, rc);
    unsigned long long threads = (unsigned long long)cfg->blockDimX * cfg->blockDimY * cfg->blockDimZ;
    if (!cfg->gridDimX || !cfg->gridDimY || !cfg->gridDimZ || cfg->gridDimY > 65535 ||
        cfg->gridDimZ > 65535 || cfg->blockDimX > 1024 || cfg->blockDimY > 1024 || cfg->blockDimZ > 64 ||
        !threads || threads > 1024 ||
        (cfg->numAttrs && !cfg->attrs))
        return end(&c, E_INVALID_VALUE);
    if (cfg->sharedMemBytes > (unsigned)(f->max_dyn_smem ? f->max_dyn_smem : 48 * 1024))
        return end(&c, E_INVALID_VALUE);
    if (!foreign && dev != f->device) return end(&c, E_INVALID_HANDLE);
    if (S.capture_id) {
        if (!capture_add_node(&c, 0)) return end(&c, E_OUT_OF_MEMORY);
        Obj *node = find(K_NODE, S.dep_nodes[0]);
        node->func = fn;
        /* A copy of the parameter, as the driver copies a kernel's parameters into
         * the node: a loader's (l2p_prefetch_CAP) is an L2pTable of CAP ranges; any
         * other kernel's, its first 16 bytes.  Only the count's ranges are read from
         * the caller (the rest of a table is zero). */
        unsigned cap = 0;
        if (sscanf(f->name, "l2p_prefetch_%u", &cap) != 1 || cap > 4096) cap = 0;
        NodeParams *np = calloc(1, sizeof *np + 16 + 16 * (size_t)cap);
        if (!np) return end(&c, E_OUT_OF_MEMORY);
        np->capacity = cap;
        if (params && params[0]) memcpy(np->table, params[0], 16);
        uint64_t count = np->table[0] > cap ? cap : np->table[0];
        if (count) memcpy(np->table + 2, (const char *)params[0] + 16, 16 * count);
        np->kernel_params[0] = np->table;
        node->params = np;
    }
    return end(&c, OK);
}

/* ---- streams and events ---------------------------------------------------- */

EXPORT CUresult cuStreamCreateWithPriority(CUstream *ps, unsigned flags, int priority) {
    BEGIN(cuStreamCreateWithPriority, "flags=0x%x priority=%d", flags, priority);
    if (!ps || (flags & ~1u)) return end(&c, E_INVALID_VALUE);
    int dev = cur_dev();
    if (dev < 0) return end(&c, E_INVALID_CONTEXT);
    if (!new_obj(K_STREAM, dev, ps)) return end(&c, E_OUT_OF_MEMORY);
    addf(&c, " stream=0x%llx", H(*ps));
    return end(&c, OK);
}

EXPORT CUresult cuStreamDestroy(CUstream s) {
    BEGIN(cuStreamDestroy, "stream=0x%llx", H(s));
    return end(&c, destroy_obj(K_STREAM, s));
}

EXPORT CUresult cuStreamGetCtx(CUstream s, CUcontext *pctx) {
    BEGIN(cuStreamGetCtx, "stream=0x%llx", H(s));
    if (!pctx) return end(&c, E_INVALID_VALUE);
    int dev, foreign;
    CUresult rc = stream_dev(s, &dev, &foreign);
    if (rc) return end(&c, rc);
    *pctx = ctx_handle(dev);
    addf(&c, " ctx=0x%llx", H(*pctx));
    return end(&c, OK);
}

EXPORT CUresult cuStreamGetCaptureInfo(CUstream s, int *status, unsigned long long *id, void **graph,
                                       const void **deps, const void **edges, size_t *ndeps) {
    BEGIN(cuStreamGetCaptureInfo, "stream=0x%llx", H(s));
    if (!status) return end(&c, E_INVALID_VALUE);
    int dev, foreign;
    CUresult rc = stream_dev(s, &dev, &foreign);
    if (rc) return end(&c, rc);
    *status = S.capture_id ? 1 : 0;
    if (id) *id = S.capture_id;
    if (graph) *graph = S.capture_id ? mkhandle(K_GRAPH, 0) : NULL;
    if (deps) *deps = S.capture_id ? (const void *)S.dep_nodes : NULL;
    if (edges) *edges = S.capture_id ? (const void *)S.dep_edges : NULL;
    if (ndeps) *ndeps = S.capture_id ? S.ndeps : 0;
    addf(&c, " status=%d id=%llu", *status, S.capture_id);
    return end(&c, OK);
}

EXPORT CUresult cuStreamUpdateCaptureDependencies(CUstream s, void **nodes, const EdgeData *edges,
                                                  size_t n, unsigned flags) {
    BEGIN(cuStreamUpdateCaptureDependencies, "stream=0x%llx n=%zu flags=%u", H(s), n, flags);
    int dev, foreign;
    CUresult rc = stream_dev(s, &dev, &foreign);
    if (rc) return end(&c, rc);
    if (flags > 1 || (n && !nodes)) return end(&c, E_INVALID_VALUE);
    if (!S.capture_id) return end(&c, 401); /* CUDA_ERROR_ILLEGAL_STATE */
    size_t base = flags == 1 ? 0 : S.ndeps;
    if (base + n > MAX_DEPS) return end(&c, E_INVALID_VALUE);
    for (size_t i = 0; i < n; i++) {
        Obj *o = find(K_NODE, nodes[i]);
        if (!o) return end(&c, E_INVALID_HANDLE);
        EdgeData e = {0};
        if (edges) e = edges[i];
        if (e.type > 1 || e.to_port || e.from_port > 2 || (e.from_port && o->node_type != 0) ||
            (e.type == 1 && (o->node_type != 0 || e.from_port == 0)))
            return end(&c, E_INVALID_VALUE);
    }
    for (size_t i = 0; i < n; i++) {
        S.dep_nodes[base + i] = nodes[i];
        if (edges) S.dep_edges[base + i] = edges[i];
        else memset(&S.dep_edges[base + i], 0, sizeof(EdgeData));
    }
    S.ndeps = base + n;
    log_deps(&c);
    return end(&c, OK);
}

EXPORT CUresult cuGraphNodeGetType(void *node, int *type) {
    BEGIN(cuGraphNodeGetType, "node=%zu", node_index(node));
    Obj *o = find(K_NODE, node);
    if (!o || !type) return end(&c, o ? E_INVALID_VALUE : E_INVALID_HANDLE);
    *type = o->node_type;
    addf(&c, " type=%d", *type);
    return end(&c, OK);
}

/* Graphs: one graph holds every node made since the last reset (the log names nodes by index). */
EXPORT CUresult cuGraphGetNodes(void *graph, void **nodes, size_t *n) {
    BEGIN(cuGraphGetNodes, "graph=0x%llx", H(graph));
    if (!n) return end(&c, E_INVALID_VALUE);
    size_t total = S.objs[K_NODE].n;
    if (nodes) {
        size_t k = *n < total ? *n : total;
        for (size_t i = 0; i < k; i++) nodes[i] = mkhandle(K_NODE, i);
        *n = k;
    } else {
        *n = total;
    }
    addf(&c, " n=%zu", *n);
    return end(&c, OK);
}

EXPORT CUresult cuGraphKernelNodeGetParams(void *node, KernelNodeParams *p) {
    BEGIN(cuGraphKernelNodeGetParams, "node=%zu", node_index(node));
    Obj *o = find(K_NODE, node);
    if (!o) return end(&c, E_INVALID_HANDLE);
    if (!p || o->node_type != 0) return end(&c, E_INVALID_VALUE);
    memset(p, 0, sizeof *p);
    p->func = o->func;
    p->gridDimX = p->gridDimY = p->gridDimZ = p->blockDimX = p->blockDimY = p->blockDimZ = 1;
    p->kernelParams = o->params ? o->params->kernel_params : NULL;
    return end(&c, OK);
}

EXPORT CUresult cuGraphNodeSetEnabled(void *exec, void *node, unsigned enabled) {
    BEGIN(cuGraphNodeSetEnabled, "exec=0x%llx node=%zu enabled=%u", H(exec), node_index(node), enabled);
    if (!find(K_NODE, node)) return end(&c, E_INVALID_HANDLE);
    return end(&c, OK);
}

EXPORT CUresult cuGraphExecKernelNodeSetParams(void *exec, void *node, const KernelNodeParams *p) {
    BEGIN(cuGraphExecKernelNodeSetParams, "exec=0x%llx node=%zu", H(exec), node_index(node));
    if (!find(K_NODE, node)) return end(&c, E_INVALID_HANDLE);
    if (!p || !p->kernelParams || !p->kernelParams[0]) return end(&c, E_INVALID_VALUE);
    Obj *f = func_obj(p->func);
    const unsigned long long *t = p->kernelParams[0];
    addf(&c, " func=%s grid=%u count=%llu", f ? f->name : "?", p->gridDimX, t[0]);
    if (t[0] && t[0] <= 128) addf(&c, " last=0x%llx+%llu", t[2 * t[0]], t[2 * t[0] + 1]);
    return end(&c, OK);
}

/* Every node's edges from the set it was captured on.  A clone (cuGraphClone) is a
 * graph object that shares the one graph's nodes: FindInClone returns the node itself
 * and DestroyNode only checks it; instantiating makes an exec object to destroy. */
EXPORT CUresult cuGraphGetEdges(void *graph, void **from, void **to, EdgeData *data, size_t *n) {
    BEGIN(cuGraphGetEdges, "graph=0x%llx", H(graph));
    if (!n || (!from) != (!to) || (data && !from)) return end(&c, E_INVALID_VALUE);
    if (from && !data) return end(&c, 912); /* CUDA_ERROR_LOSSY_QUERY: edges may carry data */
    size_t k = 0;
    for (size_t i = 0; i < S.objs[K_NODE].n; i++)
        for (size_t j = 0; j < S.objs[K_NODE].v[i].ndeps; j++, k++)
            if (from && k < *n) {
                from[k] = S.objs[K_NODE].v[i].deps[j];
                to[k] = mkhandle(K_NODE, i);
                memset(&data[k], 0, sizeof data[k]);
            }
    if (from && k > *n) k = *n;
    *n = k;
    addf(&c, " n=%zu", k);
    return end(&c, OK);
}

EXPORT CUresult cuGraphClone(void **clone, void *graph) {
    BEGIN(cuGraphClone, "graph=0x%llx", H(graph));
    if (!clone || !graph) return end(&c, E_INVALID_VALUE);
    if (!new_obj(K_GRAPH, 0, clone)) return end(&c, E_OUT_OF_MEMORY);
    addf(&c, " clone=0x%llx", H(*clone));
    return end(&c, OK);
}

EXPORT CUresult cuGraphNodeFindInClone(void **out, void *node, void *clone) {
    BEGIN(cuGraphNodeFindInClone, "node=%zu clone=0x%llx", node_index(node), H(clone));
    Obj *g = find(K_GRAPH, clone);
    if (!out || !g || !g->live || !find(K_NODE, node)) return end(&c, E_INVALID_VALUE);
    *out = node;
    return end(&c, OK);
}

EXPORT CUresult cuGraphDestroyNode(void *node) {
    BEGIN(cuGraphDestroyNode, "node=%zu", node_index(node));
    return end(&c, find(K_NODE, node) ? OK : E_INVALID_HANDLE);
}

EXPORT CUresult cuGraphDestroy(void *graph) {
    BEGIN(cuGraphDestroy, "graph=0x%llx", H(graph));
    return end(&c, destroy_obj(K_GRAPH, graph));
}

EXPORT CUresult cuGraphInstantiateWithFlags(void **exec, void *graph, unsigned long long flags) {
    BEGIN(cuGraphInstantiateWithFlags, "graph=0x%llx flags=%llu", H(graph), flags);
    Obj *g = find(K_GRAPH, graph);
    if (!exec || !g || !g->live) return end(&c, E_INVALID_VALUE);
    if (!new_obj(K_EXEC, 0, exec)) return end(&c, E_OUT_OF_MEMORY);
    addf(&c, " exec=0x%llx", H(*exec));
    return end(&c, OK);
}

EXPORT CUresult cuGraphLaunch(void *exec, CUstream s) {
    BEGIN(cuGraphLaunch, "exec=0x%llx stream=0x%llx", H(exec), H(s));
    Obj *e = find(K_EXEC, exec);
    return end(&c, e && e->live ? OK : E_INVALID_HANDLE);
}

EXPORT CUresult cuGraphExecDestroy(void *exec) {
    BEGIN(cuGraphExecDestroy, "exec=0x%llx", H(exec));
    return end(&c, destroy_obj(K_EXEC, exec));
}

EXPORT CUresult cuEventCreate(CUevent *pe, unsigned flags) {
    BEGIN(cuEventCreate, "flags=0x%x", flags);
    if (!pe || (flags & ~0xfu)) return end(&c, E_INVALID_VALUE);
    int dev = cur_dev();
    if (dev < 0) return end(&c, E_INVALID_CONTEXT);
    if (!new_obj(K_EVENT, dev, pe)) return end(&c, E_OUT_OF_MEMORY);
    addf(&c, " event=0x%llx", H(*pe));
    return end(&c, OK);
}

EXPORT CUresult cuEventDestroy(CUevent e) {
    BEGIN(cuEventDestroy, "event=0x%llx", H(e));
    return end(&c, destroy_obj(K_EVENT, e));
}

EXPORT CUresult cuEventRecord(CUevent e, CUstream s) {
    BEGIN(cuEventRecord, "event=0x%llx stream=0x%llx", H(e), H(s));
    int edev, sdev, foreign;
    CUresult rc = event_dev(e, &edev);
    if (!rc) rc = stream_dev(s, &sdev, &foreign);
    if (!rc && edev >= 0 && !foreign && edev != sdev) rc = E_INVALID_HANDLE; /* other context */
    return end(&c, rc);
}

EXPORT CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags) {
    BEGIN(cuStreamWaitEvent, "stream=0x%llx event=0x%llx flags=%u", H(s), H(e), flags);
    if (flags & ~1u) return end(&c, E_INVALID_VALUE);
    int edev, sdev, foreign;
    CUresult rc = event_dev(e, &edev);
    if (!rc) rc = stream_dev(s, &sdev, &foreign); /* cross-device waits are allowed */
    return end(&c, rc);
}

EXPORT CUresult cuStreamSynchronize(CUstream s) {
    BEGIN(cuStreamSynchronize, "stream=0x%llx", H(s));
    int dev, foreign;
    return end(&c, stream_dev(s, &dev, &foreign));
}

EXPORT CUresult cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr) {
    BEGIN(cuPointerGetAttribute, "attribute=%d ptr=0x%llx", attribute, ptr);
    unsigned long long d = (ptr >> 40) - 1; /* device d owns [(d+1)<<40, (d+2)<<40) */
    if (!data || attribute != 9 || ptr >> 40 == 0 || d >= (unsigned long long)S.device_count)
        return end(&c, E_INVALID_VALUE);
    *(int *)data = (int)d;
    addf(&c, " device=%d", (int)d);
    return end(&c, OK);
}

/* ---- cuGetProcAddress ------------------------------------------------------ */

EXPORT CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);
EXPORT CUresult cuGetProcAddress(const char *, void **, int, unsigned long long);

#define X_FN(n, v, i) (void *)n,
static void *const entry_fns[EP_COUNT] = {ENTRY_POINTS(X_FN)};

static CUresult lookup(const char *symbol, void **pfn, int version, int *status) {
    if (!symbol || !pfn) return E_INVALID_VALUE;
    int ep = ep_index(symbol);
    if (ep == EP_cuGetProcAddress && version >= meta[EP_cuGetProcAddress_v2].version)
        ep = EP_cuGetProcAddress_v2; /* as the driver: the newest ABI not above `version` */
    int st = ep < 0 ? 1 : (version > S.driver_version || version < meta[ep].version) ? 2 : 0;
    *pfn = st ? NULL : entry_fns[ep];
    if (status) *status = st; /* CU_GET_PROC_ADDRESS_{SUCCESS, SYMBOL_NOT_FOUND, VERSION_NOT_SUFFICIENT} */
    return st ? E_NOT_FOUND : OK;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                                    int *status) {
    BEGIN(cuGetProcAddress_v2, "symbol=%s version=%d flags=0x%llx", symbol ? symbol : "(null)", version, flags);
    return end(&c, lookup(symbol, pfn, version, status));
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
    BEGIN(cuGetProcAddress, "symbol=%s version=%d flags=0x%llx", symbol ? symbol : "(null)", version, flags);
    return end(&c, lookup(symbol, pfn, version, NULL));
}

/* ---- control API (tests, through ctypes) ----------------------------------- */

EXPORT void fake_reset(void) {
    pthread_mutex_lock(&mu);
    free(S.log);
    for (int k = 0; k < K_COUNT; k++) {
        for (size_t i = 0; i < S.objs[k].n; i++) {
            free(S.objs[k].v[i].name);
            free(S.objs[k].v[i].params);
        }
        free(S.objs[k].v);
    }
    /* a new generation: old handles become foreign, every thread's context stack empties */
    S = (struct State){.gen = S.gen + 1, DEFAULTS};
    pthread_mutex_unlock(&mu);
}

EXPORT void fake_configure(int device_count, int cc_major, int cc_minor, int driver_version) {
    if (device_count < 0) device_count = 0;
    if (device_count > MAX_DEVICES) device_count = MAX_DEVICES;
    LOCKED(S.device_count = device_count; S.cc_major = cc_major; S.cc_minor = cc_minor;
           S.driver_version = driver_version);
}

/* Extra: override cuDeviceGetAttribute(attrib) on every device until reset; 0 or -1 (full). */
EXPORT int fake_set_attribute(int attrib, int value) {
    int i;
    pthread_mutex_lock(&mu);
    for (i = 0; i < S.n_overrides && S.overrides[i].attrib != attrib; i++) {}
    if (i < MAX_OVERRIDES) {
        S.overrides[i].attrib = attrib;
        S.overrides[i].value = value;
        if (i == S.n_overrides) S.n_overrides++;
    }
    pthread_mutex_unlock(&mu);
    return i < MAX_OVERRIDES ? 0 : -1;
}

/* Returns 0, or -1 for an unknown entry point, nth < 1 or too many pending. */
EXPORT int fake_fail(const char *name, int nth, int code) {
    int ep = ep_index(name), rc = -1;
    if (ep < 0 || nth < 1) return -1;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_PENDING && rc; i++)
        if (!S.pending[i].active) {
            S.pending[i].active = 1;
            S.pending[i].ep = ep;
            S.pending[i].target = S.calls[ep] + nth;
            S.pending[i].code = code;
            rc = 0;
        }
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT int fake_calls(const char *name) { /* -1 for an unknown entry point */
    int ep = ep_index(name), n = -1;
    if (ep >= 0) LOCKED(n = S.calls[ep]);
    return n;
}

/* The whole log, one call per line; valid until the next call into this library,
 * so read it while no other thread calls the fake. */
EXPORT const char *fake_log(void) {
    const char *p;
    LOCKED(p = S.log ? S.log : "");
    return p;
}

EXPORT void fake_clear_log(void) {
    LOCKED(free(S.log); S.log = NULL; S.log_len = S.log_cap = 0);
}

EXPORT long fake_live(const char *kind) { /* -1 for an unknown kind */
    long n = -1;
    if (!kind) return -1;
    pthread_mutex_lock(&mu);
    if (!strcmp(kind, "stream")) n = S.objs[K_STREAM].live;
    else if (!strcmp(kind, "event")) n = S.objs[K_EVENT].live;
    else if (!strcmp(kind, "module")) n = S.objs[K_MODULE].live;
    else if (!strcmp(kind, "graph")) n = S.objs[K_GRAPH].live;
    else if (!strcmp(kind, "exec")) n = S.objs[K_EXEC].live;
    else if (!strcmp(kind, "context")) {
        n = 0;
        for (int d = 0; d < MAX_DEVICES; d++) n += S.ctx_refs[d];
    }
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT long fake_bad_destroys(void) {
    long n;
    LOCKED(n = S.bad_destroys);
    return n;
}

/* A new capture (or none) starts with an empty dependency set. */
EXPORT void fake_set_capture(unsigned long long id) { LOCKED(S.capture_id = id; S.ndeps = 0); }

/* Capture a node of type (CUgraphNodeType: 1 memcpy, 2 memset, ...) on the set;
 * returns its index, 0 when not capturing. */
EXPORT size_t fake_add_capture_node(int type) {
    size_t idx = 0;
    pthread_mutex_lock(&mu);
    if (S.capture_id && capture_add_node(NULL, type)) idx = node_index(S.dep_nodes[0]);
    pthread_mutex_unlock(&mu);
    return idx;
}

EXPORT void fake_set_uninitialized_error(int code) { LOCKED(S.uninit_error = code); }
