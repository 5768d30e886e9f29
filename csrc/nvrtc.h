/*
 * nvrtc.h: NVRTC loaded at run time (see NOTE [one door] in driver.h: the same
 * rule holds for nvrtc* calls).
 */
#ifndef L2P_NVRTC_H
#define L2P_NVRTC_H

#include <limits.h>

#include "cuda_min.h"

#define L2P_NVRTC_FUNCTIONS(X)                                                          \
    X(nvrtcGetErrorString, 1, const char *, (nvrtcResult))                              \
    X(nvrtcVersion, 1, nvrtcResult, (int *, int *))                                     \
    X(nvrtcGetNumSupportedArchs, 0, nvrtcResult, (int *))                               \
    X(nvrtcGetSupportedArchs, 0, nvrtcResult, (int *))                                  \
    X(nvrtcCreateProgram, 1, nvrtcResult,                                               \
      (nvrtcProgram *, const char *, const char *, int, const char *const *,            \
       const char *const *))                                                            \
    X(nvrtcDestroyProgram, 1, nvrtcResult, (nvrtcProgram *))                            \
    X(nvrtcCompileProgram, 1, nvrtcResult, (nvrtcProgram, int, const char *const *))    \
    X(nvrtcGetProgramLogSize, 1, nvrtcResult, (nvrtcProgram, size_t *))                 \
    X(nvrtcGetProgramLog, 1, nvrtcResult, (nvrtcProgram, char *))                       \
    X(nvrtcGetPTXSize, 1, nvrtcResult, (nvrtcProgram, size_t *))                        \
    X(nvrtcGetPTX, 1, nvrtcResult, (nvrtcProgram, char *))                              \
    X(nvrtcGetCUBINSize, 0, nvrtcResult, (nvrtcProgram, size_t *))                      \
    X(nvrtcGetCUBIN, 0, nvrtcResult, (nvrtcProgram, char *))

typedef struct l2p_nvrtc {
    long refs;           /* the module state's, and one per compile in flight */
    void *handle;
    void *builtins;      /* libnvrtc-builtins preloaded from NVRTC's folder, or NULL */
    char path[PATH_MAX];
    int major, minor;
    int *archs;          /* supported sm numbers (x10), ascending */
    int num_archs;
    struct {
#define L2P_NVRTC_FIELD(name, req, ret, params) ret (*name) params;
        L2P_NVRTC_FUNCTIONS(L2P_NVRTC_FIELD)
#undef L2P_NVRTC_FIELD
    } fn;
} l2p_nvrtc;

/* Opens NVRTC, searching in this order: $L2PREFETCH_LIBNVRTC if set (nothing
 * else then); a libnvrtc already loaded in the process (.so.13, then .so.12);
 * the nvidia-cuda-nvrtc wheel folders (nvidia/cu13/lib, nvidia/cuda_nvrtc/lib)
 * under each of site_dirs, this interpreter's site-packages folders (never
 * other sys.path entries: the working directory is one with python -m, so a
 * planted nvidia/cu13/lib there would be loaded); $CUDA_HOME/lib64 (else
 * $CUDA_PATH/lib64); /usr/local/cuda/lib64; then the loader's path.  NULL with
 * msg (every place tried) on failure; *found tells "found but failed to load"
 * from "not found". */
l2p_nvrtc *l2p_nvrtc_open(const char *const *site_dirs, int n_sites, int *found, char *msg,
                          size_t msglen);

/* References (refs.h, taken under the GIL): a compile releases the GIL and keeps its
 * instance alive while _C._use_nvrtc replaces the module's.  The last decref
 * frees the struct; the library stays loaded. */
void l2p_nvrtc_incref(l2p_nvrtc *n);
void l2p_nvrtc_decref(l2p_nvrtc *n);

/* The arch NVRTC should build SASS for, given the device's sm (x10): the
 * device's own when supported; otherwise the highest supported below it with
 * *ptx set (the driver finishes the job); 0 when NVRTC supports nothing <= sm. */
int l2p_nvrtc_pick_arch(const l2p_nvrtc *n, int sm, int *ptx);

/* Compiles source to CUBIN (or PTX when ptx is set) for sm.  On success
 * *image and *size hold a malloc'd image; *log always holds a malloc'd log (may be
 * empty) or NULL.  On failure *failed names the NVRTC call that failed. */
nvrtcResult l2p_nvrtc_compile(const l2p_nvrtc *n, const char *source, const char *name,
                              const char *const *options, int num_options, int ptx,
                              char **image, size_t *size, char **log, const char **failed);

#endif /* L2P_NVRTC_H */
