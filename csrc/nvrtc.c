/*
 * nvrtc.c: loading NVRTC (the search order: nvrtc.h, l2p_nvrtc_open) and
 * compiling with it.  Plain C: statuses out, exceptions made by the caller
 * (errors.c); the site-packages folders come from the caller (state.c asks
 * Python for them).
 */
#define _GNU_SOURCE
#include "nvrtc.h"
#include "paths.h"
#include "refs.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const sonames[] = {"libnvrtc.so.13", "libnvrtc.so.12"};
#define N_SONAMES (sizeof sonames / sizeof *sonames)
/* Where the nvidia-cuda-nvrtc wheels (CUDA 13, CUDA 12) put it under site-packages. */
static const char *const wheel_dirs[] = {"nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"};
#define N_WHEEL_DIRS (sizeof wheel_dirs / sizeof *wheel_dirs)

L2P_DEFINE_NEW(l2p_nvrtc)

static void note(char *tried, size_t len, const char *path, const char *what)
{
    size_t used = strlen(tried);
    char shown[96];
    int n = snprintf(tried + used, len - used, "%s  %s: %s", used ? "\n" : "",
                     l2p_shown_path(path, shown, sizeof shown), what);
    if (n >= 0 && (size_t)n >= len - used && len >= 4)   /* the list is full: say so */
        memcpy(tried + len - 4, "...", 4);
}

/* A library that loaded was found, even when it cannot be used (a symbol
 * missing, nvrtcVersion failing): *found is set either way. */
static l2p_nvrtc *finish(void *h, const char *path, int *found, char *msg, size_t msglen)
{
    *found = 1;
    l2p_nvrtc *n = l2p_nvrtc_new(h, path, msg, msglen);   /* fits: longer paths were refused */
    if (!n)
        return NULL;
#define L2P_NVRTC_RESOLVE(name, req, ret, params)                                        \
    *(void **)&n->fn.name = dlsym(h, #name);                                             \
    if (!n->fn.name && req) {                                                            \
        snprintf(msg, msglen, "NVRTC in %s has no %s", path, #name);                     \
        free(n);                                                                         \
        return NULL;                                                                     \
    }
    L2P_NVRTC_FUNCTIONS(L2P_NVRTC_RESOLVE)
#undef L2P_NVRTC_RESOLVE
    nvrtcResult vr = n->fn.nvrtcVersion(&n->major, &n->minor);
    if (vr != NVRTC_SUCCESS) {   /* named as errors.c names a status */
        const char *name = n->fn.nvrtcGetErrorString(vr);
        snprintf(msg, msglen, "nvrtcVersion failed for %s: %s", path,
                 name ? name : "unknown NVRTC status");
        free(n);
        return NULL;
    }
    /* NVRTC dlopen()s libnvrtc-builtins.so.MAJOR.MINOR by name at its first
     * compile; where it sits beside the library we opened (the pip wheels,
     * which set no RPATH), load it first so that lookup finds it. */
    const char *slash = strrchr(path, '/');
    if (slash) {
        char builtins[PATH_MAX];
        const char *why;
        int len = snprintf(builtins, sizeof builtins, "%.*s/libnvrtc-builtins.so.%d.%d",
                           (int)(slash - path), path, n->major, n->minor);
        if (len > 0 && (size_t)len < sizeof builtins &&
            l2p_library_file(builtins, &why) == L2P_FILE_OK)
            n->builtins = dlopen(builtins, RTLD_NOW | RTLD_GLOBAL);
    }
    if (n->fn.nvrtcGetNumSupportedArchs && n->fn.nvrtcGetSupportedArchs &&
        n->fn.nvrtcGetNumSupportedArchs(&n->num_archs) == NVRTC_SUCCESS && n->num_archs > 0) {
        n->archs = calloc((size_t)n->num_archs, sizeof *n->archs);
        if (!n->archs || n->fn.nvrtcGetSupportedArchs(n->archs) != NVRTC_SUCCESS) {
            free(n->archs);
            n->archs = NULL;
            n->num_archs = 0;
        }
    }
    return n;
}

/* Tries each soname in dir; the handle, or NULL with each attempt noted in
 * tried (*found set when a file was there).  path receives what was tried. */
static void *open_in(const char *dir, int *found, char *tried, size_t triedlen, char *path,
                     size_t pathlen)
{
    for (size_t i = 0; i < N_SONAMES; i++) {
        const char *why;
        if (!l2p_join_path(path, pathlen, dir, sonames[i])) {
            note(tried, triedlen, dir, "not searched: the path is longer than PATH_MAX");
            return NULL;
        }
        int kind = l2p_library_file(path, &why);
        if (kind != L2P_FILE_OK) {   /* a FIFO there would hang dlopen (paths.h) */
            note(tried, triedlen, path, why);
            if (kind == L2P_FILE_UNUSABLE)
                *found = 1;
            continue;
        }
        *found = 1;
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (h)
            return h;
        const char *err = dlerror();
        note(tried, triedlen, path, err ? err : "dlopen failed");
    }
    return NULL;
}

l2p_nvrtc *l2p_nvrtc_open(const char *const *site_dirs, int n_sites, int *found, char *msg,
                          size_t msglen)
{
    char tried[4 * PATH_MAX] = "";
    char path[PATH_MAX], dir[PATH_MAX];
    const char *override = getenv("L2PREFETCH_LIBNVRTC");
    void *h;

    *found = 0;
    if (override && *override) {
        /* A path must name a regular file (paths.h); a bare name is the loader's. */
        const char *err = NULL;
        int kind = strchr(override, '/') ? l2p_library_file(override, &err) : L2P_FILE_OK;
        if (kind == L2P_FILE_OK) {
            if ((h = dlopen(override, RTLD_NOW | RTLD_LOCAL)))
                return finish(h, override, found, msg, msglen);
            err = dlerror();
            *found = strchr(override, '/') || !(err && strstr(err, "cannot open shared object file"));
        } else {
            *found = kind == L2P_FILE_UNUSABLE;
        }
        char shown[96];
        snprintf(msg, msglen, "NVRTC from L2PREFETCH_LIBNVRTC=%s could not be loaded: %s",
                 l2p_shown_path(override, shown, sizeof shown), err ? err : "dlopen failed");
        return NULL;
    }
    /* Reuse the NVRTC the process already has (torch loads one lazily). */
    for (size_t i = 0; i < N_SONAMES; i++) {
        h = dlopen(sonames[i], RTLD_NOW | RTLD_NOLOAD);
        if (h)
            return finish(h, sonames[i], found, msg, msglen);
    }
    /* A folder whose path does not fit is noted and skipped, never cut short. */
    for (int k = 0; k < n_sites; k++)
        for (size_t w = 0; w < N_WHEEL_DIRS; w++) {
            if (!l2p_join_path(dir, sizeof dir, site_dirs[k], wheel_dirs[w])) {
                note(tried, sizeof tried, site_dirs[k], "not searched: the path is longer than PATH_MAX");
                continue;
            }
            if ((h = open_in(dir, found, tried, sizeof tried, path, sizeof path)))
                return finish(h, path, found, msg, msglen);
        }
    const char *home = getenv("CUDA_HOME");
    const char *home_var = "CUDA_HOME";
    if (!home || !*home) {
        home = getenv("CUDA_PATH");
        home_var = "CUDA_PATH";
    }
    if (home && *home) {
        if (!l2p_join_path(dir, sizeof dir, home, "lib64"))
            note(tried, sizeof tried, home_var, "not searched: its value is longer than PATH_MAX");
        else if ((h = open_in(dir, found, tried, sizeof tried, path, sizeof path)))
            return finish(h, path, found, msg, msglen);
    }
    if ((h = open_in("/usr/local/cuda/lib64", found, tried, sizeof tried, path, sizeof path)))
        return finish(h, path, found, msg, msglen);
    for (size_t i = 0; i < N_SONAMES; i++) {
        h = dlopen(sonames[i], RTLD_NOW | RTLD_LOCAL);
        if (h)
            return finish(h, sonames[i], found, msg, msglen);
        const char *err = dlerror();
        int missing = !err || strstr(err, "cannot open shared object file");
        if (!missing)
            *found = 1;
        note(tried, sizeof tried, sonames[i], missing ? "not on the loader's path" : err);
    }
    snprintf(msg, msglen,
             "NVRTC (libnvrtc.so.13 or .so.12) %s; looked in:\n%s\n"
             "Install it with `pip install nvidia-cuda-nvrtc`, or point L2PREFETCH_LIBNVRTC at it.",
             *found ? "was found but could not be loaded" : "was not found", tried);
    return NULL;
}

/* The last reference gone: the struct freed; the library stays loaded. */
static void nvrtc_free(l2p_nvrtc *n)
{
    free(n->archs);
    free(n);
}

L2P_DEFINE_REFS(l2p_nvrtc, nvrtc_free)

int l2p_nvrtc_pick_arch(const l2p_nvrtc *n, int sm, int *ptx)
{
    *ptx = 0;
    if (!n->archs)            /* an NVRTC too old to say: trust it */
        return sm;
    int best = 0;
    for (int i = 0; i < n->num_archs; i++) {
        if (n->archs[i] == sm)
            return sm;
        if (n->archs[i] < sm && n->archs[i] > best)
            best = n->archs[i];
    }
    *ptx = best != 0;
    return best;
}

nvrtcResult l2p_nvrtc_compile(const l2p_nvrtc *n, const char *source, const char *name,
                              const char *const *options, int num_options, int ptx,
                              char **image, size_t *size, char **log, const char **failed)
{
    nvrtcProgram prog = NULL;
    nvrtcResult r, compiled;
    size_t logsize = 0;

    *image = NULL;
    *size = 0;
    *log = NULL;
    if (!ptx && (!n->fn.nvrtcGetCUBINSize || !n->fn.nvrtcGetCUBIN))
        ptx = 1;
    r = n->fn.nvrtcCreateProgram(&prog, source, name, 0, NULL, NULL);
    if (r != NVRTC_SUCCESS) {
        *failed = "nvrtcCreateProgram";
        return r;
    }
    compiled = n->fn.nvrtcCompileProgram(prog, num_options, options);
    if (n->fn.nvrtcGetProgramLogSize(prog, &logsize) == NVRTC_SUCCESS && logsize > 0) {
        *log = malloc(logsize + 1);
        if (*log && n->fn.nvrtcGetProgramLog(prog, *log) != NVRTC_SUCCESS)
            (*log)[0] = '\0';
        if (*log)
            (*log)[logsize] = '\0';
    }
    r = compiled;
    if (r != NVRTC_SUCCESS) {
        *failed = "nvrtcCompileProgram";
        goto done;
    }
    r = ptx ? n->fn.nvrtcGetPTXSize(prog, size) : n->fn.nvrtcGetCUBINSize(prog, size);
    if (r != NVRTC_SUCCESS) {
        *failed = ptx ? "nvrtcGetPTXSize" : "nvrtcGetCUBINSize";
        goto done;
    }
    *image = malloc(*size ? *size : 1);
    if (!*image) {
        *failed = "malloc";
        r = 1; /* NVRTC_ERROR_OUT_OF_MEMORY */
        goto done;
    }
    r = ptx ? n->fn.nvrtcGetPTX(prog, *image) : n->fn.nvrtcGetCUBIN(prog, *image);
    if (r != NVRTC_SUCCESS) {
        *failed = ptx ? "nvrtcGetPTX" : "nvrtcGetCUBIN";
        free(*image);
        *image = NULL;
        *size = 0;
    }
done:
    n->fn.nvrtcDestroyProgram(&prog);
    return r;
}
