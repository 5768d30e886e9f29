/*
 * driver.c: loading libcuda and filling the driver table (see NOTE [one door]
 * in driver.h).  Nothing here touches the GPU until l2p_driver_open() is
 * called, which happens on first use, never at import.
 */
#define _GNU_SOURCE
#include "driver.h"
#include "paths.h"
#include "refs.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef CUresult (*proc_address_v2)(const char *, void **, int, unsigned long long, int *);
typedef CUresult (*driver_version_fn)(int *);

/* Folders where drivers live outside the loader's default path: the NVIDIA
 * container runtime's mount and WSL. */
static const char *const extra_dirs[] = {"/usr/local/nvidia/lib64", "/usr/lib/wsl/lib"};

L2P_DEFINE_NEW(l2p_driver)

static void *try_open(const char *path, char *tried, size_t triedlen, int *found_any)
{
    const char *err = NULL;
    int missing;
    /* A path with a slash must name a regular file (paths.h: a FIFO would hang
     * dlopen); one that does not exist is "not found".  Anything else (not a
     * regular file, wrong ELF class, missing dependency) is a load failure
     * worth its text. */
    int kind = strchr(path, '/') ? l2p_library_file(path, &err) : L2P_FILE_OK;
    if (kind == L2P_FILE_OK) {
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (h)
            return h;
        err = dlerror();
        missing = !strchr(path, '/') && err && strstr(err, "cannot open shared object file");
        if (missing)
            err = "not found";
    } else {
        missing = kind == L2P_FILE_MISSING;
    }
    if (!missing)
        *found_any = 1;
    size_t used = strlen(tried);
    char shown[96];
    snprintf(tried + used, triedlen - used, "%s  %s: %s", used ? "\n" : "",
             l2p_shown_path(path, shown, sizeof shown), err ? err : "dlopen failed");
    return NULL;
}

l2p_driver *l2p_driver_open(l2p_load_error *why, CUresult *status, char *msg, size_t msglen)
{
    char tried[2 * PATH_MAX] = "";
    int found_any = 0;
    void *h = NULL;
    const char *opened = NULL;
    char buf[512];
    const char *override = getenv("L2PREFETCH_LIBCUDA");

    *status = CUDA_SUCCESS;
    if (override && *override) {
        h = try_open(override, tried, sizeof tried, &found_any);
        opened = override;
    } else {
        h = try_open("libcuda.so.1", tried, sizeof tried, &found_any);
        opened = "libcuda.so.1";
        for (size_t i = 0; !h && i < sizeof extra_dirs / sizeof *extra_dirs; i++) {
            snprintf(buf, sizeof buf, "%s/libcuda.so.1", extra_dirs[i]);
            h = try_open(buf, tried, sizeof tried, &found_any);
            opened = buf;
        }
    }
    if (!h) {
        *why = found_any ? L2P_LOAD_FAILED : L2P_LOAD_NOT_FOUND;
        snprintf(msg, msglen,
                 found_any ? "the CUDA driver library was found but could not be loaded:\n%s"
                           : "the CUDA driver library (libcuda.so.1) was not found; looked in:\n%s\n"
                             "Install the NVIDIA driver, or point L2PREFETCH_LIBCUDA at libcuda.so.1.",
                 tried);
        return NULL;
    }

    proc_address_v2 get = (proc_address_v2)dlsym(h, "cuGetProcAddress_v2");
    driver_version_fn version = (driver_version_fn)dlsym(h, "cuDriverGetVersion");
    int v = 0;
    if (version && version(&v) != CUDA_SUCCESS)
        v = 0;
    if (!get || v < L2P_MIN_DRIVER_VERSION) {
        *why = L2P_LOAD_TOO_OLD;
        snprintf(msg, msglen,
                 "the CUDA driver in %s is too old (version %d.%d): l2prefetch needs a CUDA %d.%d "
                 "driver or newer (cuGetProcAddress_v2, cuLaunchKernelEx)",
                 opened, v / 1000, (v % 1000) / 10, L2P_MIN_DRIVER_VERSION / 1000,
                 (L2P_MIN_DRIVER_VERSION % 1000) / 10);
        return NULL;
    }

    l2p_driver *d = l2p_driver_new(h, opened, msg, msglen);   /* fits: try_open refused longer */
    if (!d) {
        *why = L2P_LOAD_FAILED;
        return NULL;
    }
    d->version = v;

    int symbol_status = 0;
#define L2P_RESOLVE(name, ver, req, params)                                               \
    if (get(#name, (void **)&d->fn.name, ver, 0, &symbol_status) != CUDA_SUCCESS ||       \
        symbol_status != 0)                                                               \
        d->fn.name = NULL;                                                                \
    if (!d->fn.name && req) {                                                             \
        *why = L2P_LOAD_SYMBOL_MISSING;                                                   \
        snprintf(msg, msglen, "the CUDA driver in %s (version %d) has no %s (ABI %d)",     \
                 opened, v, #name, ver);                                                  \
        free(d);                                                                          \
        return NULL;                                                                      \
    }
    L2P_DRIVER_FUNCTIONS(L2P_RESOLVE)
#undef L2P_RESOLVE

    const char *call = "cuInit";   /* the step that failed, for the message */
    CUresult r = d->fn.cuInit(0);
    if (r == CUDA_SUCCESS) {
        call = "cuDeviceGetCount";
        r = d->fn.cuDeviceGetCount(&d->device_count);
    }
    if (r == CUDA_SUCCESS && d->device_count > 0) {
        call = "allocating the table of devices";
        d->devices = calloc((size_t)d->device_count, sizeof *d->devices);
        if (!d->devices)
            r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (r != CUDA_SUCCESS) {
        *why = L2P_LOAD_INIT_FAILED;
        *status = r;
        const char *name = NULL;
        if (d->fn.cuGetErrorName(r, &name) != CUDA_SUCCESS || !name)
            name = "unknown error";
        snprintf(msg, msglen, "%s failed: %s (driver %s)", call, name, opened);
        free(d->devices);
        free(d);
        return NULL;
    }
    *why = L2P_LOAD_OK;
    return d;
}

/* The last reference gone: the modules unloaded, the primary contexts released. */
static void driver_free(l2p_driver *d)
{
    for (int i = 0; i < d->device_count; i++) {
        l2p_device *dev = &d->devices[i];
        if (!dev->ready)
            continue;
        /* Errors here (the context may be gone at shutdown) change nothing we
         * could act on: the module dies with its context either way. */
        for (int k = 0; k < L2P_MAX_VARIANTS; k++)
            if (dev->modules[k])
                (void)d->fn.cuModuleUnload(dev->modules[k]);
        (void)d->fn.cuDevicePrimaryCtxRelease(dev->dev);
    }
    free(d->devices);
    free(d);   /* the library stays loaded: unloading a driver is never safe */
}

L2P_DEFINE_REFS(l2p_driver, driver_free)

/* The driver call behind l2p_device_ready()'s last failure, so that callers can
 * name it (set and read under the GIL; declared in driver.h). */
const char *l2p_device_ready_failed_call = "";
#define STEP(call) (l2p_device_ready_failed_call = #call, d->fn.call)

CUresult l2p_device_ready(l2p_driver *d, int ordinal, l2p_device **out)
{
    l2p_device_ready_failed_call = "cuDeviceGet";
    if (ordinal < 0 || ordinal >= d->device_count)
        return d->device_count ? CUDA_ERROR_INVALID_DEVICE : CUDA_ERROR_NO_DEVICE;
    l2p_device *dev = &d->devices[ordinal];
    *out = dev;
    if (dev->ready)
        return CUDA_SUCCESS;
    CUresult r = STEP(cuDeviceGet)(&dev->dev, ordinal);
    if (r == CUDA_SUCCESS)
        r = STEP(cuDeviceGetAttribute)(&dev->cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev->dev);
    if (r == CUDA_SUCCESS)
        r = STEP(cuDeviceGetAttribute)(&dev->cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev->dev);
    if (r == CUDA_SUCCESS)
        r = STEP(cuDeviceGetAttribute)(&dev->sm_count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev->dev);
    if (r == CUDA_SUCCESS)
        r = STEP(cuDeviceGetAttribute)(&dev->l2_bytes, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, dev->dev);
    if (r == CUDA_SUCCESS)
        r = STEP(cuDeviceGetAttribute)(&dev->smem_optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev->dev);
    if (r != CUDA_SUCCESS)
        return r;
    r = STEP(cuDevicePrimaryCtxRetain)(&dev->ctx, dev->dev);
    if (r != CUDA_SUCCESS)
        return r;
    r = l2p_ctx_push(d, dev->ctx, &l2p_device_ready_failed_call);
    if (r == CUDA_SUCCESS) {
        r = STEP(cuCtxGetStreamPriorityRange)(&dev->least_priority, &dev->greatest_priority);
        r = l2p_ctx_pop(d, r, &l2p_device_ready_failed_call);
    }
    if (r != CUDA_SUCCESS) {
        (void)d->fn.cuDevicePrimaryCtxRelease(dev->dev);
        dev->ctx = NULL;
        return r;
    }
    dev->ready = 1;
    return CUDA_SUCCESS;
}
#undef STEP
