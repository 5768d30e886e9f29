/*
 * kernels.c: the prefetch kernel variants, compiled once per (architecture,
 * variant) per process, cached on disk, and loaded once per (device, variant).
 *
 * NOTE [kernel cache]: the CUBIN for (arch, variant) is compiled by NVRTC at
 * most once per process (l2p_state.cubins) and stored under
 * $L2PREFETCH_CACHE_DIR, else $XDG_CACHE_HOME/l2prefetch, else
 * ~/.cache/l2prefetch, unless L2PREFETCH_NO_DISK_CACHE=1.  The file name is
 * readable (variant, arch, NVRTC version) and ends in the hash of a key that
 * holds everything that changes the binary: the variant, the target, the
 * NVRTC version and the identity of its library file (size and modification
 * time: a patch release, or another toolkit's NVRTC of the same version,
 * compiles anew), the embedded kernel source's hash, every option, and the
 * cache format.  A file holds that key and the SHA-256 of key and payload; a
 * file that is damaged, or whose key is not the one its name stands for (a
 * file renamed onto another's name), is a miss: recompiled and replaced, with
 * a warning.  Writes go to a new temporary file renamed into place, so
 * concurrent processes never see half a file.  Trouble with the cache warns
 * once per kind (folder, file, write) and the compile goes on.
 *
 * NOTE [kernel cache trust] (csrc/DESIGN.md, "The kernel cache"): the payload
 * runs on the GPU, and a SHA-256 anyone can compute proves nothing about who
 * wrote it, so the cache trusts the owner of its folder (and root) and no one
 * else: a folder that another user owns, or that has a group or other write
 * bit (sticky or not), is not used (cache_open); a file is read only through
 * the checked folder's descriptor, without following a link or blocking, when
 * it is a regular file passing the same check (cache_read); a new file is
 * created O_EXCL | O_NOFOLLOW, mode 0600, and renamed into place (cache_write).
 *
 * The compile releases the GIL, so two threads can compile the same (arch,
 * variant) at once: it holds a reference to its NVRTC and copies of its
 * options, the first image stored in l2p_state.cubins is the one kept, and a
 * device loads its module only if no other thread loaded it meanwhile
 * (checked again under the GIL after the image is ready), so no module is
 * loaded twice or leaked.  l2p_state.kernel_info says, for each image in the
 * memory cache, whether it was compiled or read from the disk cache and how
 * long that took (_C.kernel_cache_info(); the Python side logs it: no Python
 * logging from C, where a handler could run anything).
 */
#define _GNU_SOURCE
#include "l2p.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kernel_source.h"

#define CACHE_MAGIC "L2PCACHE2\n"   /* 2: the key inside the hashed content */
#define CACHE_MAGIC_LEN 10
#define CACHE_HEAD (CACHE_MAGIC_LEN + 65)   /* the magic, the SHA-256 in hex, '\n' */
#define CACHE_MAX_BYTES (16 << 20)          /* images are tens of KiB */
#define CACHE_MAX_TEXT "16 MiB"

const unsigned int l2p_capacities[L2P_NUM_CAPACITIES] = {8, 32, L2P_MAX_TABLE};

/* The NVRTC library file's identity for the cache key: its size and modification time,
 * found from one of its functions (the path NVRTC was opened by may be a bare soname);
 * "unknown" where that fails (the version alone then keys it). */
static void nvrtc_identity(const l2p_nvrtc *n, char *out, size_t len)
{
    Dl_info info;
    struct stat sb;
    if (dladdr((void *)n->fn.nvrtcVersion, &info) && info.dli_fname &&
        stat(info.dli_fname, &sb) == 0)
        snprintf(out, len, "%lld bytes, %lld.%09ld", (long long)sb.st_size,
                 (long long)sb.st_mtim.tv_sec, (long)sb.st_mtim.tv_nsec);
    else
        snprintf(out, len, "unknown");
}

/* The loaders a plan (or the tuner) chooses between; chunk, stage and block
 * sizes were chosen by the sweep in benchmarks/RESULTS.md, run 10, kernels. */
const l2p_variant l2p_variants[] = {
    /* The sm_90 default: 4 x 32 KiB in flight per CTA.  On the H200 at grid 32 it
     * loads 16 MiB in 10.1 us and 32 MiB in 14.6 us (benchmarks/RESULTS.md,
     * Headlines); smaller chunks or more stages were no faster. */
    {"ring", 90, "-DL2P_KIND=1 -DL2P_CHUNK=32768 -DL2P_STAGES=4 -DL2P_BLOCK=32", 32, 131072,
     "cp.async.bulk copies into a 4 x 32 KiB shared-memory ring (real loads; sm_90 default)"},
    {"bulk_prefetch", 90, "-DL2P_KIND=2 -DL2P_CHUNK=16384 -DL2P_BLOCK=32", 32, 0,
     "cp.async.bulk.prefetch.L2 of 16 KiB pieces (no shared memory)"},
    {"line_prefetch", 80, "-DL2P_KIND=3 -DL2P_BLOCK=128", 128, 0,
     "prefetch.global.L2 of every 128-byte line"},
    {"load", 80, "-DL2P_KIND=4 -DL2P_BLOCK=256", 256, 0,
     "16-byte ld.global.cg loads, 256 threads (sm_80-sm_89 default)"},
};
const int l2p_num_variants = (int)(sizeof l2p_variants / sizeof *l2p_variants);
_Static_assert(sizeof l2p_variants / sizeof *l2p_variants <= L2P_MAX_VARIANTS,
               "raise L2P_MAX_VARIANTS in driver.h");

int l2p_variant_find(const char *name)
{
    if (!name)
        return -1;
    for (int i = 0; i < l2p_num_variants; i++)
        if (strcmp(l2p_variants[i].name, name) == 0)
            return i;
    return -1;
}

int l2p_variant_arg(PyObject *name)
{
    Py_ssize_t len;
    const char *s = PyUnicode_AsUTF8AndSize(name, &len);
    int v = -1;
    if (s && (size_t)len == strlen(s))
        v = l2p_variant_find(s);
    else
        PyErr_Clear();   /* not UTF-8, or a NUL inside: no variant */
    if (v < 0)
        PyErr_Format(PyExc_ValueError, "unknown kernel variant %R; l2prefetch.kernel_variants() lists them",
                     name);
    return v;
}

int l2p_variant_default(int sm)
{
    return l2p_variant_find(sm >= 90 ? "ring" : "load");
}

int l2p_variant_check_sm(int variant, int sm, int device)
{
    const l2p_variant *v = &l2p_variants[variant];
    if (sm >= v->min_sm)
        return 0;
    int lowest = v->min_sm;
    for (int i = 0; i < l2p_num_variants; i++)
        if (l2p_variants[i].min_sm < lowest)
            lowest = l2p_variants[i].min_sm;
    char where[48], floor[96] = "";
    if (device >= 0)
        PyOS_snprintf(where, sizeof where, "; cuda:%d is sm_%d", device, sm);
    else
        PyOS_snprintf(where, sizeof where, ", not sm_%d", sm);
    if (sm < lowest)
        PyOS_snprintf(floor, sizeof floor, " (l2prefetch needs compute capability %d.%d or newer)",
                      lowest / 10, lowest % 10);
    PyErr_Format(PyExc_ValueError, "kernel variant '%s' needs sm_%d or newer%s%s", v->name,
                 v->min_sm, where, floor);
    return -1;
}

/* The arch n builds for sm (l2p_nvrtc_pick_arch: *ptx set when it is PTX for
 * a lower one), or 0 with RuntimeError when n supports nothing at or below sm:
 * the NVRTC found cannot serve this GPU, whoever asked. */
static int pick_arch(const l2p_nvrtc *n, int sm, int *ptx)
{
    int arch = l2p_nvrtc_pick_arch(n, sm, ptx);
    if (arch == 0)
        PyErr_Format(PyExc_RuntimeError, "NVRTC %d.%d (%s) supports no architecture at or below sm_%d",
                     n->major, n->minor, n->path, sm);
    return arch;
}

/* ---- hashing (hashlib: the cache is not on any hot path) ---- */

static PyObject *sha256_hex(const void *data, Py_ssize_t len)
{
    PyObject *hashlib = PyImport_ImportModule("hashlib");
    if (!hashlib)
        return NULL;
    PyObject *h = PyObject_CallMethod(hashlib, "sha256", "y#", (const char *)data, len);
    Py_DECREF(hashlib);
    if (!h)
        return NULL;
    PyObject *hex = PyObject_CallMethod(h, "hexdigest", NULL);
    Py_DECREF(h);
    return hex;
}

/* ---- the disk cache (NOTE [kernel cache trust]) ---- */

/* st->cache_warned: each kind of trouble is warned about once per process. */
enum { WARN_FOLDER = 1, WARN_FILE = 2, WARN_WRITE = 4 };

/* The folder of the disk cache for one lookup: opened once, checked on the
 * descriptor, every file reached relative to it (openat), so what was checked
 * is what is read and written even if its path is renamed meanwhile. */
typedef struct {
    int fd;                  /* -1: no disk cache for this lookup */
    const char *var;         /* the variable its path came from, for messages */
    char path[PATH_MAX];
} cache_folder;

/* A warning of kind once per process, never a failure: the compile result is
 * good without the cache (a warning filter that raises is ignored here). */
static void warn_cache(l2p_state *st, int kind, const char *format, ...)
{
    if (st->cache_warned & kind)
        return;
    st->cache_warned |= kind;
    char text[PATH_MAX + 512];
    va_list ap;
    va_start(ap, format);
    vsnprintf(text, sizeof text, format, ap);
    va_end(ap);
    /* paths are bytes in any encoding: what is not UTF-8 is shown as \xNN */
    PyObject *msg = PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "backslashreplace");
    const char *m = msg ? PyUnicode_AsUTF8(msg) : NULL;
    if (!m || PyErr_WarnEx(PyExc_RuntimeWarning, m, 1) < 0)
        PyErr_Clear();
    Py_XDECREF(msg);
}

#define SILENCE "(set L2PREFETCH_CACHE_DIR, or L2PREFETCH_NO_DISK_CACHE=1 to silence)"

/* mkdir -p path (mode 0755 less the umask). */
static int make_dirs(const char *path)
{
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) {
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(buf, 0755) != 0 && errno != EEXIST)
            return -1;
        *p = '/';
    }
    return mkdir(buf, 0755) == 0 || errno == EEXIST ? 0 : -1;
}

/* Who may have written what a descriptor holds: NULL when only this user (or
 * root) can have, else why not.  Mode bits only; ACLs are not read. */
static const char *untrusted(const struct stat *sb)
{
    if (sb->st_uid != geteuid() && sb->st_uid != 0)
        return "is owned by another user";
    if (sb->st_mode & (S_IWGRP | S_IWOTH))
        return "is writable by its group or by others";
    return NULL;
}

/* Opens the cache folder (made when missing) into cf->fd, or leaves it -1:
 * L2PREFETCH_NO_DISK_CACHE, no folder named, or one that cannot be used or is
 * not trusted (warned once). */
static void cache_open(l2p_state *st, cache_folder *cf)
{
    cf->fd = -1;
    if (l2p_env_flag("L2PREFETCH_NO_DISK_CACHE"))
        return;
    const char *dir, *suffix;
    if ((dir = getenv("L2PREFETCH_CACHE_DIR")) && *dir) {
        cf->var = "L2PREFETCH_CACHE_DIR";
        suffix = "";
    } else if ((dir = getenv("XDG_CACHE_HOME")) && *dir) {
        cf->var = "XDG_CACHE_HOME";
        suffix = "/l2prefetch";
    } else if ((dir = getenv("HOME")) && *dir) {
        cf->var = "HOME";
        suffix = "/.cache/l2prefetch";
    } else {
        return;
    }
    int len = snprintf(cf->path, sizeof cf->path, "%s%s", dir, suffix);
    if (len < 0 || (size_t)len >= sizeof cf->path) {
        warn_cache(st, WARN_FOLDER,
                   "l2prefetch: the kernel cache folder from %s is %zu bytes long, longer than "
                   "any path this system opens (PATH_MAX %d); going on without the disk cache " SILENCE,
                   cf->var, strlen(dir) + strlen(suffix), PATH_MAX);
        return;
    }
    int fd = open(cf->path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT && make_dirs(cf->path) == 0)
        fd = open(cf->path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    struct stat sb;
    const char *why = fd < 0 || fstat(fd, &sb) != 0 ? strerror(errno) : untrusted(&sb);
    if (why) {
        warn_cache(st, WARN_FOLDER,
                   "l2prefetch: kernel cache folder %s (from %s) %s%s; going on without the "
                   "disk cache " SILENCE,
                   cf->path, cf->var, fd < 0 ? "cannot be used: " : "", why);
        if (fd >= 0)
            close(fd);
        return;
    }
    cf->fd = fd;
}

static void cache_close(cache_folder *cf)
{
    if (cf->fd >= 0)
        close(cf->fd);
    cf->fd = -1;
}

/* A cache file: CACHE_MAGIC, the SHA-256 (hex) of everything after its line,
 * '\n', the key (the text the file name hashes), '\n', the payload.  The file
 * of key under name in cf: new bytes of its payload, or NULL (no exception)
 * for a miss.  Anything there but such a file, made by this user or root and
 * bound to this key, is a miss with a warning: the caller compiles and
 * replaces it.  Opened without following a link and without blocking (a FIFO
 * at the name), read only when a regular file of at most CACHE_MAX_BYTES. */
static PyObject *cache_read(l2p_state *st, const cache_folder *cf, const char *name,
                            const char *key)
{
    int fd = openat(cf->fd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT)
        return NULL;
    PyObject *data = NULL, *payload = NULL, *hex = NULL;
    const char *why = NULL;
    struct stat sb;
    if (fd < 0)
        why = errno == ELOOP ? "is a symbolic link" : strerror(errno);
    else if (fstat(fd, &sb) != 0)
        why = strerror(errno);
    else if (!S_ISREG(sb.st_mode))
        why = "is not a regular file";
    else if (!(why = untrusted(&sb)) && sb.st_size > CACHE_MAX_BYTES)
        why = "is larger than any kernel image (" CACHE_MAX_TEXT ")";
    if (why)
        goto bad;
    Py_ssize_t size = (Py_ssize_t)sb.st_size, got = 0;
    if (!(data = PyBytes_FromStringAndSize(NULL, size)))
        goto error;
    char *p = PyBytes_AS_STRING(data);
    while (got < size) {
        ssize_t r = read(fd, p + got, (size_t)(size - got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        got += r;
    }
    size_t keylen = strlen(key);
    const char *body = p + CACHE_HEAD;
    if (got != size || size < CACHE_HEAD || memcmp(p, CACHE_MAGIC, CACHE_MAGIC_LEN) != 0 ||
        p[CACHE_HEAD - 1] != '\n') {
        why = "is not a kernel cache file of this version (or was cut short)";
        goto bad;
    }
    if (!(hex = sha256_hex(body, size - CACHE_HEAD)))
        goto error;
    const char *h = PyUnicode_AsUTF8(hex);
    if (!h)
        goto error;
    if (memcmp(h, p + CACHE_MAGIC_LEN, 64) != 0) {
        why = "is damaged (its SHA-256 does not match)";
        goto bad;
    }
    if ((size_t)(size - CACHE_HEAD) <= keylen || memcmp(body, key, keylen) != 0 ||
        body[keylen] != '\n') {
        why = "was made for another kernel (its key is not this file name's)";
        goto bad;
    }
    payload = PyBytes_FromStringAndSize(body + keylen + 1, size - CACHE_HEAD - (Py_ssize_t)keylen - 1);
    if (!payload)
        goto error;
    goto out;
bad:
    warn_cache(st, WARN_FILE,
               "l2prefetch: kernel cache file %s/%s %s; compiling the kernel and replacing it",
               cf->path, name, why);
    goto out;
error:
    PyErr_Clear();   /* out of memory while reading: compile as if missing */
out:
    Py_XDECREF(hex);
    Py_XDECREF(data);
    if (fd >= 0)
        close(fd);
    return payload;
}

static int write_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t r = write(fd, p, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

/* Writes payload as the file of key under name in cf: a new temporary file
 * (O_EXCL | O_NOFOLLOW, mode 0600: never an existing file or a planted link)
 * in the same folder, renamed over name, so readers see the old file or the
 * whole new one. */
static void cache_write(l2p_state *st, const cache_folder *cf, const char *name, const char *key,
                        PyObject *payload)
{
    static unsigned serial;   /* under the GIL: this process's temporary names */
    size_t keylen = strlen(key);
    Py_ssize_t n = PyBytes_GET_SIZE(payload);
    PyObject *body = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)keylen + 1 + n);
    if (!body) {
        PyErr_Clear();
        return;
    }
    char *b = PyBytes_AS_STRING(body);
    memcpy(b, key, keylen);
    b[keylen] = '\n';
    memcpy(b + keylen + 1, PyBytes_AS_STRING(payload), (size_t)n);
    PyObject *hex = sha256_hex(b, PyBytes_GET_SIZE(body));
    const char *h = hex ? PyUnicode_AsUTF8(hex) : NULL;
    if (!h) {
        PyErr_Clear();
        Py_XDECREF(hex);
        Py_DECREF(body);
        return;
    }
    char head[CACHE_HEAD + 1], tmp[NAME_MAX + 1];
    snprintf(head, sizeof head, "%s%.64s\n", CACHE_MAGIC, h);
    int fd = -1;
    for (int tries = 0; fd < 0 && tries < 16; tries++) {
        snprintf(tmp, sizeof tmp, "%.200s.%ld.%u.tmp", name, (long)getpid(), serial++);
        fd = openat(cf->fd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd < 0 && errno != EEXIST)
            break;
    }
    int ok = fd >= 0 && write_all(fd, head, CACHE_HEAD) == 0 &&
             write_all(fd, b, (size_t)PyBytes_GET_SIZE(body)) == 0;
    int err = errno;
    if (fd >= 0 && close(fd) != 0 && ok) {
        ok = 0;
        err = errno;
    }
    if (ok && renameat(cf->fd, tmp, cf->fd, name) != 0) {
        ok = 0;
        err = errno;
    }
    if (!ok) {
        if (fd >= 0)
            (void)unlinkat(cf->fd, tmp, 0);
        warn_cache(st, WARN_WRITE,
                   "l2prefetch: kernel cache file %s/%s cannot be written (%s); going on without "
                   "it " SILENCE, cf->path, fd >= 0 ? name : tmp, strerror(err));
    }
    Py_DECREF(hex);
    Py_DECREF(body);
}

/* ---- compiling ---- */

static PyObject *compile_options(const l2p_variant *v, int arch, int ptx)
{
    PyObject *opts = PyList_New(0);
    if (!opts)
        return NULL;
    PyObject *o = PyUnicode_FromFormat("--gpu-architecture=%s_%d", ptx ? "compute" : "sm", arch);
    if (!o || PyList_Append(opts, o) < 0)
        goto error;
    Py_DECREF(o);
    const char *fixed[] = {"-std=c++17", "--ptxas-options=-v"};
    for (size_t i = 0; i < sizeof fixed / sizeof *fixed; i++) {
        o = PyUnicode_FromString(fixed[i]);
        if (!o || PyList_Append(opts, o) < 0)
            goto error;
        Py_DECREF(o);
    }
    PyObject *defs = PyUnicode_FromString(v->defines);
    if (!defs)
        goto error_list;
    PyObject *split = PyUnicode_Split(defs, NULL, -1);
    Py_DECREF(defs);
    if (!split)
        goto error_list;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(split); i++)
        if (PyList_Append(opts, PyList_GET_ITEM(split, i)) < 0) {
            Py_DECREF(split);
            goto error_list;
        }
    Py_DECREF(split);
    return opts;
error:
    Py_XDECREF(o);
error_list:
    Py_DECREF(opts);
    return NULL;
}

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

/* Compiles source with options (a sequence of str) on n; returns (image bytes,
 * log str) or raises NvrtcError carrying the log, the options and the numbered
 * source.  The caller holds a reference to n (taken before anything that can
 * run Python: copying the options can start a collection, whose finalizers may
 * swap the module's NVRTC) and keeps source alive.  The compile runs without the GIL on
 * a tuple of the options, so nothing it reads can be freed meanwhile. */
static PyObject *nvrtc_build(l2p_state *st, l2p_nvrtc *n, const char *source, PyObject *options,
                             int ptx)
{
    PyObject *opts;   /* a tuple of the options, that the strings are borrowed from */
    Py_ssize_t nopts;
    const char **argv = l2p_c_strings(options, &PyUnicode_Type, "NVRTC options", &opts, &nopts);
    if (!argv)
        return NULL;
    char *image = NULL, *log = NULL;
    size_t size = 0;
    const char *failed = NULL;
    nvrtcResult r;
    Py_BEGIN_ALLOW_THREADS
    r = l2p_nvrtc_compile(n, source, "prefetch.cu", argv, (int)nopts, ptx, &image, &size, &log, &failed);
    Py_END_ALLOW_THREADS
    PyMem_Free(argv);
    PyObject *result = NULL;
    if (r != NVRTC_SUCCESS) {
        PyObject *list = PySequence_List(opts);
        if (list)
            l2p_raise_nvrtc(st, n, failed, r, log ? log : "", list, source);
        Py_XDECREF(list);
    } else {
        /* PTX is text with a terminating NUL that the driver wants; keep it. */
        result = Py_BuildValue("(y#s)", image, (Py_ssize_t)size, log ? log : "");
    }
    free(image);
    free(log);
    Py_DECREF(opts);
    return result;
}

/* Remembers how the image under key was obtained (_C.kernel_cache_info()). */
static int record_info(l2p_state *st, PyObject *key, const l2p_variant *v, int arch, int ptx,
                       const l2p_nvrtc *n, const char *how, double ms)
{
    PyObject *info = Py_BuildValue("{s:s,s:i,s:O,s:s,s:d,s:(ii)}", "variant", v->name, "arch", arch,
                                   "ptx", ptx ? Py_True : Py_False, "source", how, "ms", ms,
                                   "nvrtc_version", n->major, n->minor);
    if (!info)
        return -1;
    int rc = PyDict_SetItem(st->kernel_info, key, info);
    Py_DECREF(info);
    return rc;
}

/* image for (sm, variant); *is_ptx tells PTX from CUBIN.  Runs Python code
 * (hashlib, warnings) and releases the GIL to compile: it holds its NVRTC
 * instance throughout and stores its image only if no other thread stored one
 * for the same key meanwhile. */
PyObject *l2p_kernel_image(l2p_state *st, int sm, int variant, int *is_ptx)
{
    const l2p_variant *v = &l2p_variants[variant];
    l2p_nvrtc *n = l2p_hold_nvrtc(st);
    if (!n)
        return NULL;
    PyObject *key = NULL, *opts = NULL, *image = NULL, *result = NULL, *keytext = NULL;
    const char *kt = NULL;   /* keytext's text */
    cache_folder cf;
    cf.fd = -1;
    int ptx = 0;
    int arch = pick_arch(n, sm, &ptx);
    if (arch == 0)
        goto done;
    *is_ptx = ptx;
    if (!(key = Py_BuildValue("(isii)", arch, v->name, n->major, n->minor)))
        goto done;
    PyObject *hit = PyDict_GetItemWithError(st->cubins, key);
    if (hit || PyErr_Occurred()) {
        result = Py_XNewRef(hit);
        goto done;
    }
    if (ptx && PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                                "l2prefetch: NVRTC %d.%d cannot build SASS for sm_%d; building "
                                "PTX for compute_%d and letting the driver finish it",
                                n->major, n->minor, sm, arch) < 0)
        goto done;
    if (!(opts = compile_options(v, arch, ptx)))
        goto done;
    cache_open(st, &cf);
    double t0 = now_ms();
    const char *how = "disk";
    char name[NAME_MAX + 1];
    if (cf.fd >= 0) {
        /* The key: everything that changes the binary.  The file name ends in
         * its hash and the file holds it (cache_read checks it). */
        PyObject *joined = PyUnicode_FromString(" ");
        PyObject *optstr = joined ? PyUnicode_Join(joined, opts) : NULL;
        Py_XDECREF(joined);
        PyObject *src = optstr ? sha256_hex(L2P_KERNEL_SOURCE, (Py_ssize_t)strlen(L2P_KERNEL_SOURCE)) : NULL;
        char lib[96];
        nvrtc_identity(n, lib, sizeof lib);
        keytext = src ? PyUnicode_FromFormat("l2prefetch kernel cache 2|variant %s|%s_%d|nvrtc %d.%d "
                                             "(%s)|source %U|options %U",
                                             v->name, ptx ? "compute" : "sm", arch, n->major,
                                             n->minor, lib, src, optstr)
                      : NULL;
        Py_XDECREF(optstr);
        Py_XDECREF(src);
        kt = keytext ? PyUnicode_AsUTF8(keytext) : NULL;
        PyObject *hex = kt ? sha256_hex(kt, (Py_ssize_t)strlen(kt)) : NULL;
        const char *h = hex ? PyUnicode_AsUTF8(hex) : NULL;
        if (!h) {
            Py_XDECREF(hex);
            goto done;
        }
        snprintf(name, sizeof name, "prefetch-%s-%s_%d-nvrtc%d.%d-%.16s.%s", v->name,
                 ptx ? "compute" : "sm", arch, n->major, n->minor, h, ptx ? "ptx" : "cubin");
        Py_DECREF(hex);
        image = cache_read(st, &cf, name, kt);
    }
    if (!image) {
        how = "compiled";
        PyObject *built = nvrtc_build(st, n, L2P_KERNEL_SOURCE, opts, ptx);
        if (!built)
            goto done;
        image = Py_NewRef(PyTuple_GET_ITEM(built, 0));
        Py_DECREF(built);
    }
    double ms = now_ms() - t0;
    /* Another thread may have stored this key while the GIL was released. */
    if ((hit = PyDict_GetItemWithError(st->cubins, key)) || PyErr_Occurred()) {
        result = Py_XNewRef(hit);
        goto done;
    }
    if (PyDict_SetItem(st->cubins, key, image) < 0 ||
        record_info(st, key, v, arch, ptx, n, how, ms) < 0)
        goto done;
    if (cf.fd >= 0 && how[0] == 'c')
        cache_write(st, &cf, name, kt, image);
    result = Py_NewRef(image);
done:
    cache_close(&cf);
    Py_XDECREF(keytext);
    Py_XDECREF(image);
    Py_XDECREF(opts);
    Py_XDECREF(key);
    l2p_nvrtc_decref(n);
    return result;
}

int l2p_kernel_function(l2p_state *st, l2p_driver *d, l2p_device *dev, int variant, int cap,
                        CUfunction *out)
{
    const l2p_variant *v = &l2p_variants[variant];
    if (!dev->modules[variant]) {
        int sm = dev->cc_major * 10 + dev->cc_minor, is_ptx = 0;
        PyObject *image = l2p_kernel_image(st, sm, variant, &is_ptx);
        if (!image)
            return -1;
        if (dev->modules[variant]) {   /* loaded by another thread during the compile */
            Py_DECREF(image);
            *out = dev->functions[variant][cap];
            return 0;
        }
        /* From here to the end no Python code runs and the GIL is held: the load
         * and dev->modules[variant] are one step for other threads. */
        CUmodule mod = NULL;
        const char *op;
        CUresult r = l2p_ctx_push(d, dev->ctx, &op);
        if (r == CUDA_SUCCESS) {
            op = "cuModuleLoadData";
            r = d->fn.cuModuleLoadData(&mod, PyBytes_AS_STRING(image));
            for (int c = 0; r == CUDA_SUCCESS && c < L2P_NUM_CAPACITIES; c++) {
                char name[64];
                snprintf(name, sizeof name, "l2p_prefetch_%u", l2p_capacities[c]);
                op = "cuModuleGetFunction";
                r = d->fn.cuModuleGetFunction(&dev->functions[variant][c], mod, name);
                if (r == CUDA_SUCCESS && v->smem > 48 * 1024) {
                    op = "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)";
                    r = d->fn.cuFuncSetAttribute(dev->functions[variant][c],
                                                 CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                 (int)v->smem);
                }
            }
            if (r != CUDA_SUCCESS && mod) {
                (void)d->fn.cuModuleUnload(mod);
                mod = NULL;
            }
            r = l2p_ctx_pop(d, r, &op);
            if (r != CUDA_SUCCESS && mod)   /* the pop failed */
                (void)d->fn.cuModuleUnload(mod);
        }
        Py_DECREF(image);
        if (r != CUDA_SUCCESS) {
            memset(dev->functions[variant], 0, sizeof dev->functions[variant]);
            return l2p_raise_cuda_int(st, d, op, r);
        }
        dev->modules[variant] = mod;
    }
    *out = dev->functions[variant][cap];
    return 0;
}

/* _C.compile(variant, sm, *, ptx=False) -> dict: the NVRTC output for sm
 * (no GPU needed): {"variant", "arch", "ptx", "image", "log", "options"}.  With
 * ptx=True it compiles PTX text (for instruction counts) and skips the caches. */
static const l2p_signature compile_sig = {
    .name = "compile", .params = (const char *const[]){"variant", "sm", "ptx", NULL},
    .posonly = 0, .maxpos = 2, .required = 2};

PyObject *l2p_py_compile(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                         PyObject *kwnames)
{
    l2p_state *st = l2p_get_state(module);
    PyObject *vals[3] = {NULL, NULL, Py_False};
    if (l2p_parse_args(&compile_sig, args, nargs, kwnames, vals) < 0)
        return NULL;
    if (!PyUnicode_Check(vals[0]))
        return PyErr_Format(PyExc_TypeError, "variant must be a str, not %s",
                            Py_TYPE(vals[0])->tp_name);
    int variant = l2p_variant_arg(vals[0]);
    if (variant < 0)
        return NULL;
    if (!PyLong_Check(vals[1]) || PyBool_Check(vals[1]))
        return PyErr_Format(PyExc_TypeError, "sm must be an int (e.g. 90), not %s",
                            Py_TYPE(vals[1])->tp_name);
    long sm = PyLong_AsLong(vals[1]);
    if (sm == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        sm = LONG_MAX;
    }
    if (sm < 0 || sm > 10000)
        return l2p_raise_shown(PyExc_ValueError, vals[1],
                               "sm must be a compute capability x 10 (e.g. 90), got ");
    if (l2p_variant_check_sm(variant, (int)sm, -1) < 0)
        return NULL;
    int want_ptx = PyObject_IsTrue(vals[2]);
    if (want_ptx < 0)
        return NULL;
    l2p_nvrtc *n = l2p_hold_nvrtc(st);
    if (!n)
        return NULL;
    PyObject *result = NULL, *opts = NULL, *built = NULL;
    int ptx = 0, arch = pick_arch(n, (int)sm, &ptx);
    if (arch == 0)
        goto done;
    ptx = ptx || want_ptx;
    if (!(opts = compile_options(&l2p_variants[variant], arch, ptx)) ||
        !(built = nvrtc_build(st, n, L2P_KERNEL_SOURCE, opts, ptx)))
        goto done;
    result = Py_BuildValue("{s:s,s:i,s:O,s:O,s:O,s:O,s:(ii)}", "variant",
                           l2p_variants[variant].name, "arch", arch, "ptx",
                           ptx ? Py_True : Py_False, "image", PyTuple_GET_ITEM(built, 0),
                           "log", PyTuple_GET_ITEM(built, 1), "options", opts,
                           "nvrtc_version", n->major, n->minor);
done:
    Py_XDECREF(built);
    Py_XDECREF(opts);
    l2p_nvrtc_decref(n);
    return result;
}

/* _C.clear_kernel_cache(): forgets the in-process images (the disk cache stays). */
PyObject *l2p_py_clear_kernel_cache(PyObject *module, PyObject *unused)
{
    l2p_forget_kernels(l2p_get_state(module));
    Py_RETURN_NONE;
}

/* _C.kernel_cache_info() -> [{"variant", "arch", "ptx", "source", "ms", "nvrtc_version"}]:
 * how each image in the memory cache was obtained, "compiled" or "disk". */
PyObject *l2p_py_kernel_cache_info(PyObject *module, PyObject *unused)
{
    l2p_state *st = l2p_get_state(module);
    PyObject *values = PyDict_Values(st->kernel_info);   /* a snapshot */
    if (!values)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(values);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *copy = PyDict_Copy(PyList_GET_ITEM(values, i));   /* callers may change theirs */
        if (!copy)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, copy);
    }
    Py_DECREF(values);
    return out;
}

/* _C.kernel_variants() -> {name: {"min_sm", "block", "smem", "doc", "defines"}} */
PyObject *l2p_py_variants(PyObject *module, PyObject *unused)
{
    PyObject *d = PyDict_New();
    for (int i = 0; d && i < l2p_num_variants; i++) {
        const l2p_variant *v = &l2p_variants[i];
        PyObject *e = Py_BuildValue("{s:i,s:I,s:I,s:s,s:s}", "min_sm", v->min_sm, "block", v->block,
                                    "smem", v->smem, "doc", v->doc, "defines", v->defines);
        if (!e || PyDict_SetItemString(d, v->name, e) < 0) {
            Py_XDECREF(e);
            Py_CLEAR(d);
            break;
        }
        Py_DECREF(e);
    }
    return d;
}

/* _C._kernel_image(variant, sm) -> (bytes, is_ptx): testing hook for the
 * caches (memory, then disk, then NVRTC). */
PyObject *l2p_py_kernel_image(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyUnicode_Check(args[0]))
        return PyErr_Format(PyExc_TypeError, "_kernel_image(variant: str, sm: int)");
    int variant = l2p_variant_arg(args[0]);
    if (variant < 0)
        return NULL;
    long sm = PyLong_Check(args[1]) ? PyLong_AsLong(args[1]) : -1;
    if (sm < 1 || sm > 10000) {
        PyErr_Clear();
        return l2p_raise_shown(PyExc_ValueError, args[1], "sm must be an int in 1..10000, got ");
    }
    int is_ptx = 0;
    PyObject *image = l2p_kernel_image(l2p_get_state(module), (int)sm, variant, &is_ptx);
    if (!image)
        return NULL;
    return Py_BuildValue("(NO)", image, is_ptx ? Py_True : Py_False);
}

/* _C._compile_source(source, options) -> bytes: testing hook for NVRTC errors. */
PyObject *l2p_py_compile_source(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyUnicode_Check(args[0]) || !PyList_Check(args[1]))
        return PyErr_Format(PyExc_TypeError, "_compile_source(source: str, options: list[str])");
    const char *src = PyUnicode_AsUTF8(args[0]);
    if (!src)
        return NULL;
    l2p_state *st = l2p_get_state(module);
    l2p_nvrtc *n = l2p_hold_nvrtc(st);   /* before nvrtc_build copies the options (a collection) */
    if (!n)
        return NULL;
    PyObject *built = nvrtc_build(st, n, src, args[1], 0);
    l2p_nvrtc_decref(n);
    if (!built)
        return NULL;
    PyObject *image = Py_NewRef(PyTuple_GET_ITEM(built, 0));
    Py_DECREF(built);
    return image;
}
