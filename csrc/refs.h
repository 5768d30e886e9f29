/*
 * refs.h: the reference count of a plain-C instance that the module state and
 * the objects made with it share (driver.c's l2p_driver, nvrtc.c's l2p_nvrtc;
 * plain C).  One definition for both, so that their rule cannot drift: counts
 * are taken and dropped under the GIL, the last drop frees the instance, and
 * dropping NULL does nothing.
 */
#ifndef L2P_REFS_H
#define L2P_REFS_H

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
