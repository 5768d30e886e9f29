/*
 * refs.h: the life of a plain-C instance of a loaded library that the module
 * state and the objects made with it share (driver.c's l2p_driver, nvrtc.c's
 * l2p_nvrtc; plain C).  One definition for both, so that their rule cannot
 * drift: made with one reference, counts taken and dropped under the GIL, the
 * last drop frees the instance, and dropping NULL does nothing.
 */
#ifndef L2P_REFS_H
#define L2P_REFS_H

#include <stdio.h>
#include <stdlib.h>

/* Defines static type *type_new(void *handle, const char *path, char *msg,
 * size_t msglen) for a struct type with `long refs`, `void *handle` and
 * `char path[]` fields: a zeroed instance of the library dlopen()ed at path,
 * with one reference; NULL with "out of memory" in msg.  path fits the field:
 * the callers refuse a path longer than PATH_MAX before dlopen() (paths.h). */
#define L2P_DEFINE_NEW(type)                                                              \
    static type *type##_new(void *handle, const char *path, char *msg, size_t msglen)     \
    {                                                                                     \
        type *p = calloc(1, sizeof *p);                                                   \
        if (!p) {                                                                         \
            snprintf(msg, msglen, "out of memory");                                       \
            return NULL;                                                                  \
        }                                                                                 \
        p->refs = 1;                                                                      \
        p->handle = handle;                                                               \
        snprintf(p->path, sizeof p->path, "%s", path);                                    \
        return p;                                                                         \
    }

/* Defines type_incref(type *) and type_decref(type *) for a struct type with a
 * `long refs` field (1 when made); free_last(type *) releases what the instance
 * holds and frees it when the last reference goes. */
#define L2P_DEFINE_REFS(type, free_last)                                                  \
    void type##_incref(type *p)                                                           \
    {                                                                                     \
        p->refs++;                                                                        \
    }                                                                                     \
                                                                                          \
    void type##_decref(type *p)                                                           \
    {                                                                                     \
        if (p && --p->refs <= 0)                                                          \
            free_last(p);                                                                 \
    }

#endif
