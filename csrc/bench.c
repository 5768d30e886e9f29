/*
 * bench.c: the floor the controller's host cost is measured against
 * (benchmarks/sections/host.py): the fork and join driver sequence,
 * cuEventRecord + cuStreamWaitEvent + cuLaunchKernelEx, then the join's
 * cuEventRecord + cuStreamWaitEvent, called from C in a loop with nothing else.
 */
#include "l2p.h"

#include <time.h>

static long long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* _C._floor_fork_join(prepared, n, stream) -> total ns for n iterations. */
PyObject *l2p_py_floor_fork_join(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    l2p_state *st = l2p_get_state(module);
    if (nargs != 3 || !l2p_prepared_check(st, args[0]) || !PyLong_Check(args[1]) || !PyLong_Check(args[2]))
        return PyErr_Format(PyExc_TypeError, "_floor_fork_join(prepared, n: int, stream: int)");
    PyObject *p = args[0];
    long n = PyLong_AsLong(args[1]);
    CUstream cur = (CUstream)(uintptr_t)PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    l2p_driver *d = l2p_prepared_driver(p);
    l2p_device *dev = l2p_use_device(st, d, l2p_prepared_device(p));
    if (!dev)
        return NULL;
    CUresult r;
    CUstream side = NULL;
    CUevent ev = NULL, jev = NULL;
    long long t0 = 0, t1 = 0;
    const char *op = NULL;
    if ((r = l2p_ctx_push(d, dev->ctx, &op)) != CUDA_SUCCESS)
        return l2p_raise_cuda(st, d, op, r);
    if ((r = d->fn.cuStreamCreateWithPriority(&side, CU_STREAM_NON_BLOCKING, 0)) != CUDA_SUCCESS) {
        op = "cuStreamCreateWithPriority";
        goto done;
    }
    if ((r = d->fn.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING)) != CUDA_SUCCESS ||
        (r = d->fn.cuEventCreate(&jev, CU_EVENT_DISABLE_TIMING)) != CUDA_SUCCESS) {
        op = "cuEventCreate";
        goto done;
    }
    t0 = now_ns();
    for (long i = 0; i < n && r == CUDA_SUCCESS; i++) {
        op = "the fork/join sequence";
        if ((r = d->fn.cuEventRecord(ev, cur)) == CUDA_SUCCESS &&
            (r = d->fn.cuStreamWaitEvent(side, ev, 0)) == CUDA_SUCCESS &&
            (r = l2p_prepared_launch_raw(p, side)) == CUDA_SUCCESS &&
            (r = d->fn.cuEventRecord(jev, side)) == CUDA_SUCCESS)
            r = d->fn.cuStreamWaitEvent(cur, jev, 0);
    }
    t1 = now_ns();
    if (r == CUDA_SUCCESS) {
        op = "cuStreamSynchronize";
        r = d->fn.cuStreamSynchronize(side);
    }
done:
    if (ev)
        (void)d->fn.cuEventDestroy(ev);
    if (jev)
        (void)d->fn.cuEventDestroy(jev);
    if (side)
        (void)d->fn.cuStreamDestroy(side);
    r = l2p_ctx_pop(d, r, &op);
    if (r != CUDA_SUCCESS)
        return l2p_raise_cuda(st, d, op, r);
    return PyLong_FromLongLong(t1 - t0);
}
