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

/* The most iterations one call runs: a benchmark takes 20,000 (a few ms on a GPU);
 * 10 million is a minute or so, and each one lands in the fake driver's call log. */
#define FLOOR_MAX_N 10000000L
/* Iterations between two checks for a signal (Ctrl-C): the loop holds the GIL. */
#define FLOOR_SIGNAL_EVERY 1024

/* _C._floor_fork_join(prepared, n, stream) -> total ns for n iterations.  n is in
 * 0..FLOOR_MAX_N (ValueError otherwise); a signal whose handler raises (Ctrl-C's
 * KeyboardInterrupt) ends the loop within FLOOR_SIGNAL_EVERY iterations, and the
 * call raises it after releasing its stream and events. */
PyObject *l2p_py_floor_fork_join(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    l2p_state *st = l2p_get_state(module);
    if (nargs != 3 || !l2p_prepared_check(st, args[0]) || !PyLong_Check(args[1]) || !PyLong_Check(args[2]))
        return PyErr_Format(PyExc_TypeError, "_floor_fork_join(prepared, n: int, stream: int)");
    PyObject *p = args[0];
    int overflow = 0;
    long n = PyLong_AsLongAndOverflow(args[1], &overflow);
    if (!PyErr_Occurred() && (overflow || n < 0 || n > FLOOR_MAX_N))
        return l2p_raise_shown(PyExc_ValueError, args[1], "_floor_fork_join: n must be in 0..%ld "
                               "(iterations of the fork/join sequence), got ", FLOOR_MAX_N);
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
    int interrupted = 0;
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
        if (i % FLOOR_SIGNAL_EVERY == FLOOR_SIGNAL_EVERY - 1 && PyErr_CheckSignals() < 0) {
            interrupted = 1;    /* the handler's exception is set: cleaned up, then raised */
            break;
        }
        op = "the fork/join sequence";
        if ((r = d->fn.cuEventRecord(ev, cur)) == CUDA_SUCCESS &&
            (r = d->fn.cuStreamWaitEvent(side, ev, 0)) == CUDA_SUCCESS &&
            (r = l2p_prepared_launch_raw(p, side, NULL)) == CUDA_SUCCESS &&
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
    if (interrupted)            /* the signal's exception outranks a failure after it */
        return NULL;
    if (r != CUDA_SUCCESS)
        return l2p_raise_cuda(st, d, op, r);
    return PyLong_FromLongLong(t1 - t0);
}
