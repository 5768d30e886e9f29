/*
 * paths.h: what a library path must be before dlopen() gets it (driver.c,
 * nvrtc.c; plain C).  dlopen() opens its file with a plain blocking open(), so
 * a FIFO planted at a library's name would hang the process: only a regular
 * file is handed to it (links followed, as dlopen follows them; the check and
 * the open are two steps, but every path checked is one the user named or a
 * fixed install folder).  A path is never cut short to fit a buffer: one that
 * does not fit in PATH_MAX, which no open() accepts, is refused by name.
 */
#ifndef L2P_PATHS_H
#define L2P_PATHS_H

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

enum { L2P_FILE_OK = 0, L2P_FILE_MISSING = 1, L2P_FILE_UNUSABLE = 2 };

/* Whether path names a regular file: L2P_FILE_OK; L2P_FILE_MISSING when there
 * is nothing there (or the path is too long to name anything); else
 * L2P_FILE_UNUSABLE.  *why says which, for the caller's list of places tried. */
static inline int l2p_library_file(const char *path, const char **why)
{
    struct stat sb;
    if (strlen(path) >= PATH_MAX) {
        *why = "not found: the path is longer than PATH_MAX";
        return L2P_FILE_MISSING;
    }
    if (stat(path, &sb) != 0) {
        int err = errno;
        int missing = err == ENOENT || err == ENOTDIR || err == ENAMETOOLONG;
        *why = missing ? "not found" : strerror(err);
        return missing ? L2P_FILE_MISSING : L2P_FILE_UNUSABLE;
    }
    if (S_ISREG(sb.st_mode)) {
        *why = NULL;
        return L2P_FILE_OK;
    }
    *why = S_ISDIR(sb.st_mode)    ? "not a regular file (a directory)"
           : S_ISFIFO(sb.st_mode) ? "not a regular file (a FIFO)"
                                  : "not a regular file";
    return L2P_FILE_UNUSABLE;
}

/* snprintf(out, len, "%s/%s", dir, name), or 0 (out unchanged meaning nothing)
 * when the result would not fit: such a path is too long to open anyway. */
static inline int l2p_join_path(char *out, size_t len, const char *dir, const char *name)
{
    size_t a = strlen(dir), b = strlen(name);
    if (a + 1 + b >= len)
        return 0;
    memcpy(out, dir, a);
    out[a] = '/';
    memcpy(out + a + 1, name, b + 1);
    return 1;
}

/* path as a message shows it: itself, or when longer than PATH_MAX (a value
 * no open() takes, which would fill the message) its first 64 bytes and its
 * length, written into buf. */
static inline const char *l2p_shown_path(const char *path, char *buf, size_t len)
{
    size_t n = strlen(path);
    if (n < PATH_MAX)
        return path;
    snprintf(buf, len, "%.64s... (%zu bytes)", path, n);
    return buf;
}

#endif /* L2P_PATHS_H */
