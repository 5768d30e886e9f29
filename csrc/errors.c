/*
 * errors.c: a CUDA or NVRTC status becomes a Python exception here and
 * nowhere else.  Message format: "<operation> failed: <NAME>: <description>".
 */
#include "l2p.h"

static int set_attrs(PyObject *exc, PyObject *code, const char *name, const char *operation)
{
    PyObject *n = PyUnicode_FromString(name);
    PyObject *o = PyUnicode_FromString(operation);
    int rc = (n && o && PyObject_SetAttrString(exc, "code", code) == 0 &&
              PyObject_SetAttrString(exc, "name", n) == 0 &&
              PyObject_SetAttrString(exc, "operation", o) == 0)
                 ? 0
                 : -1;
    Py_XDECREF(n);
    Py_XDECREF(o);
    return rc;
}

PyObject *l2p_raise_cuda(l2p_state *st, l2p_driver *d, const char *operation, CUresult status)
{
    const char *name = NULL, *desc = NULL;
    char fallback[48];
    if (d && (d->fn.cuGetErrorName(status, &name) != CUDA_SUCCESS || !name))
        name = NULL;
    if (d && (d->fn.cuGetErrorString(status, &desc) != CUDA_SUCCESS || !desc))
        desc = NULL;
    if (!name) {
        PyOS_snprintf(fallback, sizeof fallback, "CUDA error %d", status);
        name = fallback;
    }
    PyObject *msg = desc ? PyUnicode_FromFormat("%s failed: %s: %s", operation, name, desc)
                         : PyUnicode_FromFormat("%s failed: %s", operation, name);
    if (!msg)
        return NULL;
    PyObject *exc = PyObject_CallOneArg(st->cuda_error, msg);
    Py_DECREF(msg);
    if (!exc)
        return NULL;
    PyObject *code = PyLong_FromLong(status);
    if (code && set_attrs(exc, code, name, operation) == 0)
        PyErr_SetObject(st->cuda_error, exc);
    Py_XDECREF(code);
    Py_DECREF(exc);
    return NULL;
}

int l2p_raise_cuda_int(l2p_state *st, l2p_driver *d, const char *operation, CUresult status)
{
    l2p_raise_cuda(st, d, operation, status);
    return -1;
}

PyObject *l2p_raise_nvrtc(l2p_state *st, l2p_nvrtc *n, const char *operation, nvrtcResult status,
                          const char *log, PyObject *options, const char *source)
{
    const char *name = n ? n->fn.nvrtcGetErrorString(status) : NULL;
    char fallback[48];
    if (!name) {
        PyOS_snprintf(fallback, sizeof fallback, "NVRTC error %d", status);
        name = fallback;
    }
    /* The numbered source, so a log's "prefetch.cu(42)" can be read at once. */
    PyObject *numbered = PyUnicode_FromString("");
    int line = 1;
    for (const char *p = source; numbered && p && *p; line++) {
        const char *e = strchr(p, '\n');
        Py_ssize_t len = e ? (Py_ssize_t)(e - p) : (Py_ssize_t)strlen(p);
        /* no "%.*s" in PyUnicode_FromFormat before Python 3.12 */
        PyObject *text = PyUnicode_DecodeUTF8(p, len, "replace");
        PyObject *l = text ? PyUnicode_FromFormat("%4d  %U\n", line, text) : NULL;
        Py_XDECREF(text);
        PyObject *joined = l ? PyUnicode_Concat(numbered, l) : NULL;
        Py_XDECREF(l);
        Py_SETREF(numbered, joined);
        p = e ? e + 1 : NULL;
    }
    if (!numbered)
        return NULL;
    PyObject *opts = options ? PyObject_Repr(options) : PyUnicode_FromString("[]");
    PyObject *msg = opts ? PyUnicode_FromFormat("%s failed: %s\noptions: %U\nlog:\n%s", operation,
                                                name, opts, log ? log : "")
                         : NULL;
    PyObject *exc = msg ? PyObject_CallOneArg(st->nvrtc_error, msg) : NULL;
    PyObject *code = exc ? PyLong_FromLong(status) : NULL;
    PyObject *logobj = code ? PyUnicode_FromString(log ? log : "") : NULL;
    if (logobj && set_attrs(exc, code, name, operation) == 0 &&
        PyObject_SetAttrString(exc, "log", logobj) == 0 &&
        PyObject_SetAttrString(exc, "options", options ? options : Py_None) == 0 &&
        PyObject_SetAttrString(exc, "source", numbered) == 0)
        PyErr_SetObject(st->nvrtc_error, exc);
    Py_XDECREF(logobj);
    Py_XDECREF(code);
    Py_XDECREF(exc);
    Py_XDECREF(msg);
    Py_XDECREF(opts);
    Py_DECREF(numbered);
    return NULL;
}

void l2p_report_in_dealloc(l2p_driver *d, const char *operation, CUresult status, PyObject *obj)
{
    if (status == CUDA_SUCCESS || status == CUDA_ERROR_DEINITIALIZED ||
        status == CUDA_ERROR_CONTEXT_IS_DESTROYED)
        return;
    const char *name = NULL;
    if (!d || d->fn.cuGetErrorName(status, &name) != CUDA_SUCCESS || !name)
        name = "unknown CUDA error";
    /* A destructor must not raise: keep any pending exception, report ours as
     * unraisable.  obj is being deallocated (refcount 0): handing it to the
     * unraisable hook would take a new reference and dealloc it a second time
     * when dropped, so the hook gets obj's type (alive until dealloc ends). */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_Format(PyExc_RuntimeWarning, "l2prefetch: %s failed while releasing a %s: %s", operation,
                 obj ? Py_TYPE(obj)->tp_name : "resource", name);
    PyErr_WriteUnraisable(obj ? (PyObject *)Py_TYPE(obj) : NULL);
    PyErr_Restore(type, value, tb);
}

/* ---- conversions of a Python-level exception ---- */

/* The raised exception as one normalised object (traceback attached), cleared;
 * NULL when none is set. */
static PyObject *take_exception(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (!type)
        return NULL;
    PyErr_NormalizeException(&type, &value, &tb);
    if (value && tb)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

/* Raises exc again (steals it). */
static void give_exception(PyObject *exc)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
#endif
}

int l2p_optional_attr(PyObject *obj, const char *name, PyObject **out)
{
    *out = PyObject_GetAttrString(obj, name);
    if (*out)
        return 1;
    if (!PyErr_ExceptionMatches(PyExc_AttributeError))
        return -1;
    PyErr_Clear();
    return 0;
}

int l2p_error_is_base(void)
{
    return PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception);
}

PyObject *l2p_format_from_cause(PyObject *type, const char *format, ...)
{
    PyObject *cause = take_exception();
    va_list va;
    va_start(va, format);
    PyErr_FormatV(type, format, va);
    va_end(va);
    if (!cause)
        return NULL;
    PyObject *exc = take_exception();
    if (!exc) {
        Py_DECREF(cause);
        return NULL;
    }
    PyException_SetCause(exc, Py_NewRef(cause));   /* both steal */
    PyException_SetContext(exc, cause);
    give_exception(exc);
    return NULL;
}

static PyObject *shown(PyObject *o)
{
    int overflow = 0;
    if (PyLong_Check(o)) {   /* its value read as int's: no code of a subclass runs */
        PyLong_AsLongLongAndOverflow(o, &overflow);
        if (PyErr_Occurred())
            return NULL;
    }
    if (!overflow)
        return PyObject_Repr(o);
    /* int.bit_length itself, not a subclass's; past 160 bits (49 digits, python's
     * plan.shown alike) the size is named: a repr may exceed CPython's digit limit */
    PyObject *bits = PyObject_CallMethod((PyObject *)&PyLong_Type, "bit_length", "O", o);
    if (!bits)
        return NULL;
    long n = PyLong_AsLong(bits);
    PyObject *r = n > 160 ? PyUnicode_FromFormat("<%s int of %ld bits>",
                                                 overflow < 0 ? "a negative" : "an", n)
                          : PyObject_Repr(o);
    Py_DECREF(bits);
    return r;
}

PyObject *l2p_shown(PyObject *o)
{
    /* an error already set (the cause of the caller's message) is set again after */
    PyObject *pending = take_exception();
    PyObject *r = shown(o);
    if (r && pending)
        give_exception(pending);
    else
        Py_XDECREF(pending);
    return r;
}

PyObject *l2p_raise_shown(PyObject *type, PyObject *value, const char *format, ...)
{
    PyObject *shown = l2p_shown(value);
    if (!shown)
        return NULL;
    va_list va;
    va_start(va, format);
    PyObject *head = PyUnicode_FromFormatV(format, va);
    va_end(va);
    if (head)
        PyErr_Format(type, "%U%U", head, shown);
    Py_XDECREF(head);
    Py_DECREF(shown);
    return NULL;
}

void l2p_add_note(const char *format, ...)
{
    PyObject *exc = take_exception();
    if (!exc)
        return;
    va_list va;
    va_start(va, format);
    PyObject *note = PyUnicode_FromFormatV(format, va);
    va_end(va);
    PyObject *r = note ? PyObject_CallMethod(exc, "add_note", "O", note) : NULL;
    if (!r)
        PyErr_Clear();   /* the note is a courtesy: keep the exception it was for */
    Py_XDECREF(r);
    Py_XDECREF(note);
    give_exception(exc);
}
