/*
 * graphexec.c: GraphExec, an executable CUDA graph that l2prefetch instantiated
 * (graph.c's _graph_instantiate_without), owned together with the driver
 * instance that made it.  launch(), close() and dealloc call that driver,
 * whatever driver the module uses by then (_C._use_driver swaps it), so no raw
 * CUgraphExec crosses into Python and none is destroyed through another
 * driver or twice.
 *
 * It holds no Python object (the driver instance is refcounted C), so it is not
 * GC-tracked.  What its nodes read and write (the template graph's memory pool)
 * is the caller's to keep alive: l2prefetch.tuning.rig.NoForks holds the torch
 * graph beside it.
 */
#include "l2p.h"

typedef struct {
    PyObject_HEAD
    l2p_driver *drv;     /* the instance that instantiated exec: held until dealloc */
    CUgraphExec exec;    /* NULL once closed */
} graph_exec;

PyObject *l2p_graph_exec_new(l2p_state *st, l2p_driver *d, CUgraphExec exec)
{
    PyTypeObject *type = st->graph_exec_type;
    graph_exec *self = (graph_exec *)type->tp_alloc(type, 0);
    if (!self) {
        (void)d->fn.cuGraphExecDestroy(exec);
        return NULL;
    }
    self->drv = d;
    l2p_driver_incref(d);
    self->exec = exec;
    return (PyObject *)self;
}

static int check_open(graph_exec *self, l2p_state *st)
{
    if (self->exec)
        return 0;
    PyErr_SetString(st->error, "this GraphExec is closed: instantiate the graph again");
    return -1;
}

PyDoc_STRVAR(launch_doc,
"launch($self, stream, /)\n--\n\n"
"cuGraphLaunch on stream, an int CUstream handle (0: the legacy default stream),\n"
"through the driver that instantiated the graph.");

static PyObject *graph_exec_launch(graph_exec *self, PyObject *stream)
{
    if (!PyLong_CheckExact(stream))   /* an exact int: no Python code below */
        return PyErr_Format(PyExc_TypeError, "stream must be an int handle, not %s",
                            Py_TYPE(stream)->tp_name);
    unsigned long long s = PyLong_AsUnsignedLongLong(stream);
    if (s == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    l2p_state *st = l2p_state_of_type(Py_TYPE(self));
    if (check_open(self, st) < 0)
        return NULL;
    CUresult r = self->drv->fn.cuGraphLaunch(self->exec, (CUstream)(uintptr_t)s);
    if (r != CUDA_SUCCESS)
        return l2p_raise_cuda(st, self->drv, "cuGraphLaunch", r);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(close_doc,
"close($self, /)\n--\n\n"
"Destroy the executable graph now (cuGraphExecDestroy, through the driver that\n"
"instantiated it).  Idempotent: a second close() does nothing; launch() refuses\n"
"afterwards.  A failed destroy raises CudaError and is not tried again.");

static PyObject *graph_exec_close(graph_exec *self, PyObject *unused)
{
    CUgraphExec exec = self->exec;
    if (!exec)
        Py_RETURN_NONE;
    self->exec = NULL;   /* destroyed once, whatever the driver answers */
    CUresult r = self->drv->fn.cuGraphExecDestroy(exec);
    if (r != CUDA_SUCCESS)
        return l2p_raise_cuda(l2p_state_of_type(Py_TYPE(self)), self->drv, "cuGraphExecDestroy", r);
    Py_RETURN_NONE;
}

/* Never raises: a pending exception is kept, a failed destroy is reported as
 * unraisable, CUDA_ERROR_DEINITIALIZED (interpreter exit) is ignored. */
static void graph_exec_dealloc(graph_exec *self)
{
    if (self->exec) {
        CUresult r = self->drv->fn.cuGraphExecDestroy(self->exec);
        self->exec = NULL;
        l2p_report_in_dealloc(self->drv, "cuGraphExecDestroy", r, (PyObject *)self);
    }
    l2p_dealloc_end((PyObject *)self, self->drv);
}

static PyObject *get_closed(graph_exec *self, void *c)
{
    return PyBool_FromLong(self->exec == NULL);
}

static PyObject *graph_exec_repr(graph_exec *self)
{
    if (!self->exec)
        return PyUnicode_FromString("<GraphExec closed>");
    char handle[24];   /* PyUnicode_FromFormat has no %llx before Python 3.12 */
    PyOS_snprintf(handle, sizeof handle, "0x%llx", (unsigned long long)(uintptr_t)self->exec);
    return PyUnicode_FromFormat("<GraphExec %s>", handle);
}

static PyMethodDef graph_exec_methods[] = {
    {"launch", (PyCFunction)graph_exec_launch, METH_O, launch_doc},
    {"close", (PyCFunction)graph_exec_close, METH_NOARGS, close_doc},
    {NULL},
};

#define L2P_GETTER_SELF graph_exec
static PyGetSetDef graph_exec_getset[] = {
    L2P_GETTER(closed, "Whether close() ran (the graph is destroyed)."),
    {NULL},
};

PyDoc_STRVAR(graph_exec_doc,
"An executable CUDA graph from _graph_instantiate_without(), with the driver that\n"
"instantiated it: launch(stream), close(); destroyed at the latest when collected.\n"
"Not made from Python.");

L2P_DEFINE_TYPE(l2p_graph_exec_spec, "GraphExec", graph_exec,
                Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
                {Py_tp_dealloc, graph_exec_dealloc},
                {Py_tp_methods, graph_exec_methods},
                {Py_tp_getset, graph_exec_getset},
                {Py_tp_repr, graph_exec_repr},
                {Py_tp_doc, (void *)graph_exec_doc});
