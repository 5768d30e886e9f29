/*
 * cuda_min.h: the few CUDA driver and NVRTC declarations l2prefetch uses.
 *
 * Vendored so that the build needs no CUDA toolkit: the extension dlopen()s
 * libcuda and NVRTC at run time and never links them.  Values and layouts are
 * those of cuda.h / nvrtc.h in CUDA 12.x and 13.0 (x86-64 and aarch64 Linux);
 * they are part of the driver's stable ABI.  Only what we call is here: no
 * per-thread-default-stream variants, no versioned macro renames (driver.c asks
 * cuGetProcAddress for each symbol with the ABI version it was written against).
 */
#ifndef L2P_CUDA_MIN_H
#define L2P_CUDA_MIN_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUkern_st *CUkernel;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEINITIALIZED = 4,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
};

/* CUdevice_attribute */
enum {
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
    CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97,
};

/* CUfunction_attribute */
enum { CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8 };

/* CUpointer_attribute */
enum { CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9 };

enum { CU_STREAM_NON_BLOCKING = 0x1 };
enum { CU_EVENT_DISABLE_TIMING = 0x2 };
/* CUstreamCaptureStatus */
enum { CU_STREAM_CAPTURE_STATUS_NONE = 0, CU_STREAM_CAPTURE_STATUS_ACTIVE = 1 };
/* CUstreamUpdateCaptureDependencies_flags */
enum { CU_STREAM_ADD_CAPTURE_DEPENDENCIES = 0, CU_STREAM_SET_CAPTURE_DEPENDENCIES = 1 };
/* CUgraphDependencyType and the kernel node's output ports (CUDA 12.3) */
enum { CU_GRAPH_DEPENDENCY_TYPE_DEFAULT = 0, CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC = 1 };
enum { CU_GRAPH_KERNEL_NODE_PORT_DEFAULT = 0, CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC = 1,
       CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER = 2 };

/* What an edge of a graph carries (CUDA 12.3); all zero is an ordinary edge. */
typedef struct CUgraphEdgeData_st {
    unsigned char from_port;
    unsigned char to_port;
    unsigned char type;
    unsigned char reserved[5];
} CUgraphEdgeData;

/* CUgraphNodeType (only the kernel node) */
enum { CU_GRAPH_NODE_TYPE_KERNEL = 0 };

/* CUDA_KERNEL_NODE_PARAMS_v2 (CUDA 12.0), what cuGraphKernelNodeGetParams and
 * cuGraphExecKernelNodeSetParams take at ABI version 12000. */
typedef struct CUDA_KERNEL_NODE_PARAMS_st {
    CUfunction func;
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    void **kernelParams;
    void **extra;
    CUkernel kern;
    CUcontext ctx;
} CUDA_KERNEL_NODE_PARAMS;

/* CUlaunchAttributeID (only the two we set) */
enum {
    CU_LAUNCH_ATTRIBUTE_PRIORITY = 8,
    CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 14,
};

typedef union CUlaunchAttributeValue_union {
    char pad[64];
    int priority;
    unsigned int sharedMemCarveout;
} CUlaunchAttributeValue;

typedef struct CUlaunchAttribute_st {
    int id;
    char pad[8 - sizeof(int)];
    CUlaunchAttributeValue value;
} CUlaunchAttribute;

typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

/* NVRTC */
typedef int nvrtcResult;
typedef struct _nvrtcProgram *nvrtcProgram;
enum { NVRTC_SUCCESS = 0 };

#endif /* L2P_CUDA_MIN_H */
