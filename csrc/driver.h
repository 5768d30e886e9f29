/*
 * driver.h: the one door to the CUDA driver.
 *
 * NOTE [one door]: no code in l2prefetch calls a cu* function directly.  Every
 * entry point is a typed pointer in l2p_driver.fn, filled once by
 * l2p_driver_open() through cuGetProcAddress with the ABI version the call was
 * written against (the table below).  Objects keep a reference to the driver
 * they were created with, so a test can swap in the recording stand-in
 * (tests/fakecuda) for new objects while old ones keep theirs.
 *
 * This layer never raises: it returns CUresult, and errors.c turns a status
 * into a Python exception in exactly one place.
 */
#ifndef L2P_DRIVER_H
#define L2P_DRIVER_H

#include <limits.h>

#include "cuda_min.h"

/* X(name, abi_version, required, return, params) */
#define L2P_DRIVER_FUNCTIONS(X)                                                        \
    X(cuGetErrorName, 6000, 1, (CUresult, const char **))                              \
    X(cuGetErrorString, 6000, 1, (CUresult, const char **))                            \
    X(cuInit, 2000, 1, (unsigned int))                                                 \
    X(cuDriverGetVersion, 2020, 1, (int *))                                            \
    X(cuDeviceGetCount, 2000, 1, (int *))                                              \
    X(cuDeviceGet, 2000, 1, (CUdevice *, int))                                         \
    X(cuDeviceGetAttribute, 2000, 1, (int *, int, CUdevice))                           \
    X(cuDevicePrimaryCtxRetain, 7000, 1, (CUcontext *, CUdevice))                      \
    X(cuDevicePrimaryCtxRelease, 11000, 1, (CUdevice))                                 \
    X(cuCtxGetCurrent, 4000, 1, (CUcontext *))                                         \
    X(cuCtxSetCurrent, 4000, 1, (CUcontext))                                           \
    X(cuCtxPushCurrent, 4000, 1, (CUcontext))                                          \
    X(cuCtxPopCurrent, 4000, 1, (CUcontext *))                                         \
    X(cuCtxGetStreamPriorityRange, 5050, 1, (int *, int *))                            \
    X(cuModuleLoadData, 2000, 1, (CUmodule *, const void *))                           \
    X(cuModuleUnload, 2000, 1, (CUmodule))                                             \
    X(cuModuleGetFunction, 2000, 1, (CUfunction *, CUmodule, const char *))            \
    X(cuFuncSetAttribute, 9000, 1, (CUfunction, int, int))                             \
    X(cuLaunchKernelEx, 11060, 1, (const CUlaunchConfig *, CUfunction, void **, void **)) \
    X(cuStreamCreateWithPriority, 5050, 1, (CUstream *, unsigned int, int))            \
    X(cuStreamDestroy, 4000, 1, (CUstream))                                            \
    X(cuStreamGetCtx, 9020, 1, (CUstream, CUcontext *))                                \
    X(cuStreamSynchronize, 2000, 1, (CUstream))                                        \
    X(cuEventCreate, 2000, 1, (CUevent *, unsigned int))                               \
    X(cuEventDestroy, 4000, 1, (CUevent))                                              \
    X(cuEventRecord, 2000, 1, (CUevent, CUstream))                                     \
    X(cuStreamWaitEvent, 3020, 1, (CUstream, CUevent, unsigned int))                   \
    X(cuPointerGetAttribute, 4000, 1, (void *, int, CUdeviceptr))                      \
    X(cuStreamGetCaptureInfo, 12030, 0,                                                \
      (CUstream, int *, unsigned long long *, CUgraph *, const CUgraphNode **,         \
       const CUgraphEdgeData **, size_t *))                                            \
    X(cuStreamUpdateCaptureDependencies, 12030, 0,                                     \
      (CUstream, CUgraphNode *, const CUgraphEdgeData *, size_t, unsigned int))          \
    X(cuGraphGetNodes, 10000, 0, (CUgraph, CUgraphNode *, size_t *))                    \
    X(cuGraphNodeGetType, 10000, 0, (CUgraphNode, int *))                               \
    X(cuGraphKernelNodeGetParams, 12000, 0, (CUgraphNode, CUDA_KERNEL_NODE_PARAMS *))   \
    X(cuGraphNodeSetEnabled, 11060, 0, (CUgraphExec, CUgraphNode, unsigned int))        \
    X(cuGraphExecKernelNodeSetParams, 12000, 0,                                        \
      (CUgraphExec, CUgraphNode, const CUDA_KERNEL_NODE_PARAMS *))                       \
    X(cuGraphGetEdges, 12030, 0,                                                       \
      (CUgraph, CUgraphNode *, CUgraphNode *, CUgraphEdgeData *, size_t *))              \
    X(cuGraphClone, 10000, 0, (CUgraph *, CUgraph))                                     \
    X(cuGraphNodeFindInClone, 10000, 0, (CUgraphNode *, CUgraphNode, CUgraph))          \
    X(cuGraphDestroyNode, 10000, 0, (CUgraphNode))                                      \
    X(cuGraphDestroy, 10000, 0, (CUgraph))                                              \
    X(cuGraphInstantiateWithFlags, 11040, 0, (CUgraphExec *, CUgraph, unsigned long long)) \
    X(cuGraphLaunch, 10000, 0, (CUgraphExec, CUstream))                                 \
    X(cuGraphExecDestroy, 10000, 0, (CUgraphExec))

/* The oldest driver we accept: cuGetProcAddress_v2 and cuLaunchKernelEx. */
#define L2P_MIN_DRIVER_VERSION 12000
/* CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT appeared in CUDA 12.4. */
#define L2P_CARVEOUT_DRIVER_VERSION 12040

#define L2P_MAX_VARIANTS 16
#define L2P_NUM_CAPACITIES 3
#define L2P_MAX_TABLE 128u   /* the largest of l2p_capacities */

typedef struct l2p_device {
    int ready;            /* attributes read and primary context retained */
    CUdevice dev;
    CUcontext ctx;        /* the device's primary context, retained once */
    int cc_major, cc_minor, sm_count, l2_bytes, smem_optin;
    int least_priority, greatest_priority;
    CUmodule modules[L2P_MAX_VARIANTS];                 /* by variant index */
    CUfunction functions[L2P_MAX_VARIANTS][L2P_NUM_CAPACITIES];
} l2p_device;

typedef struct l2p_driver {
    long refs;
    void *handle;               /* dlopen handle; never dlclose()d */
    char path[PATH_MAX];        /* what was opened */
    int version;                /* cuDriverGetVersion */
    struct {
#define L2P_DRIVER_FIELD(name, ver, req, params) CUresult (*name) params;
        L2P_DRIVER_FUNCTIONS(L2P_DRIVER_FIELD)
#undef L2P_DRIVER_FIELD
    } fn;
    int device_count;
    l2p_device *devices;        /* device_count entries */
} l2p_driver;

/* Why l2p_driver_open() failed. */
typedef enum {
    L2P_LOAD_OK = 0,
    L2P_LOAD_NOT_FOUND,       /* no libcuda.so.1 anywhere we looked */
    L2P_LOAD_FAILED,          /* found, but dlopen() failed (dlerror text kept) */
    L2P_LOAD_SYMBOL_MISSING,  /* a required entry point is missing */
    L2P_LOAD_TOO_OLD,         /* driver older than L2P_MIN_DRIVER_VERSION */
    L2P_LOAD_INIT_FAILED,     /* cuInit failed: *status holds the CUresult */
} l2p_load_error;

/* Open the driver: the path in $L2PREFETCH_LIBCUDA if set, else libcuda.so.1
 * from the loader's path and the usual driver folders.  Returns NULL with
 * *why, *status and msg filled on failure. */
l2p_driver *l2p_driver_open(l2p_load_error *why, CUresult *status, char *msg, size_t msglen);
/* References (refs.h, taken under the GIL).  The last decref unloads the
 * modules and releases the primary contexts (ignoring CUDA_ERROR_DEINITIALIZED
 * at shutdown). */
void l2p_driver_incref(l2p_driver *d);
void l2p_driver_decref(l2p_driver *d);

/* Reads the device's attributes and retains its primary context (once).  On
 * failure l2p_device_ready_failed_call names the driver call that failed. */
CUresult l2p_device_ready(l2p_driver *d, int ordinal, l2p_device **out);
extern const char *l2p_device_ready_failed_call;

/* Makes dev's primary context current on this thread when none is; fails with
 * CUDA_ERROR_INVALID_CONTEXT when another context is current. */
static inline CUresult l2p_ensure_current(l2p_driver *d, const l2p_device *dev)
{
    CUcontext cur = NULL;
    CUresult r = d->fn.cuCtxGetCurrent(&cur);
    if (r != CUDA_SUCCESS)
        return r;
    if (cur == dev->ctx)
        return CUDA_SUCCESS;
    if (cur == NULL)
        return d->fn.cuCtxSetCurrent(dev->ctx);
    return CUDA_ERROR_INVALID_CONTEXT;
}

/* A context pushed for the few calls that need it current, then popped:
 *
 *     const char *failed;
 *     CUresult r = l2p_ctx_push(d, ctx, &failed);
 *     if (r == CUDA_SUCCESS) {
 *         failed = "cuX";
 *         r = d->fn.cuX(...);
 *         r = l2p_ctx_pop(d, r, &failed);
 *     }
 *
 * A failed push sets *failed to "cuCtxPushCurrent".  The pop runs after every
 * successful push; its failure becomes the result (*failed "cuCtxPopCurrent")
 * only where the calls succeeded, so that what they made is undone by the
 * caller whenever the result is not CUDA_SUCCESS. */
static inline CUresult l2p_ctx_push(l2p_driver *d, CUcontext ctx, const char **failed)
{
    CUresult r = d->fn.cuCtxPushCurrent(ctx);
    if (r != CUDA_SUCCESS)
        *failed = "cuCtxPushCurrent";
    return r;
}

static inline CUresult l2p_ctx_pop(l2p_driver *d, CUresult r, const char **failed)
{
    CUcontext popped;
    CUresult p = d->fn.cuCtxPopCurrent(&popped);
    if (r == CUDA_SUCCESS && p != CUDA_SUCCESS) {
        *failed = "cuCtxPopCurrent";
        return p;
    }
    return r;
}

#endif /* L2P_DRIVER_H */
