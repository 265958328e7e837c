/* Compiled twin of src/kestrel/storage/kestrel3/codec.py's `decode_puts_python`: the run of PUT
 * records a reader reads from a writer journal's buffer, as rows (id, error count, add time, expiry
 * or None, item). Start-up loads every item of every reader through it; record by record the
 * interpreter spent about a microsecond an item on the fields' reads and the record's object.
 * Anything but a whole, valid PUT ends the run, and the record-by-record Python path reads or
 * refuses it, so every check of the format stays written once, in Python.
 * tests/storage/test_kestrel3_decode_puts.py compares the two on valid, damaged and cut buffers.
 *
 * Optional: without a C compiler the build goes on and codec uses the Python loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* The two PUT command bytes (command 8, six or eight header words), as in codec.py. */
enum { PUT = 0x86, PUT_EXPIRING = 0x88 };

static uint32_t read_u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t read_u64(const unsigned char *p) {
    return (uint64_t)read_u32(p) | (uint64_t)read_u32(p + 4) << 32;
}

/* One row, or NULL with an exception set. */
static PyObject *row(uint64_t id, int32_t errors, int64_t add_time, const unsigned char *expiry,
                     const unsigned char *data, Py_ssize_t size) {
    PyObject *out = PyTuple_New(5);
    if (out == NULL) {
        return NULL;
    }
    PyObject *fields[5] = {
        PyLong_FromUnsignedLongLong(id),
        PyLong_FromLong(errors),
        PyLong_FromLongLong(add_time),
        expiry == NULL ? Py_NewRef(Py_None) : PyLong_FromLongLong((int64_t)read_u64(expiry)),
        PyBytes_FromStringAndSize((const char *)data, size),
    };
    int failed = 0;
    for (int i = 0; i < 5; i++) {
        if (fields[i] == NULL) {
            failed = 1;
            Py_INCREF(Py_None);
            fields[i] = Py_None;
        }
        PyTuple_SET_ITEM(out, i, fields[i]);
    }
    if (failed) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyObject *decode_puts(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "decode_puts takes 2 arguments (buf, pos), not %zd", nargs);
        return NULL;
    }
    if (!PyBytes_Check(args[0])) {
        PyErr_Format(PyExc_TypeError, "decode_puts reads bytes, not %.100s", Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (pos < 0) {
        PyErr_Format(PyExc_ValueError, "negative position %zd", pos);
        return NULL;
    }
    const unsigned char *buf = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t end = PyBytes_GET_SIZE(args[0]);
    PyObject *run = PyList_New(0);
    if (run == NULL) {
        return NULL;
    }
    while (pos < end) {
        int byte = buf[pos];
        Py_ssize_t start = pos + 1 + 4 * (byte & 0x0F);
        if ((byte != PUT && byte != PUT_EXPIRING) || start > end) {
            break;
        }
        const unsigned char *p = buf + pos + 1;
        int32_t size = (int32_t)read_u32(p);
        int32_t errors = (int32_t)read_u32(p + 4);
        uint64_t id = read_u64(p + 8);
        int64_t add_time = (int64_t)read_u64(p + 16);
        if (size < 0 || size > end - start || id == 0 || errors < 0) {
            break;
        }
        PyObject *item = row(id, errors, add_time, byte == PUT_EXPIRING ? p + 24 : NULL, buf + start, size);
        if (item == NULL || PyList_Append(run, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(run);
            return NULL;
        }
        Py_DECREF(item);
        pos = start + size;
    }
    return Py_BuildValue("(Nn)", run, pos);
}

static PyMethodDef methods[] = {
    {"decode_puts", (PyCFunction)(void (*)(void))decode_puts, METH_FASTCALL,
     "decode_puts(buf, pos) -> (rows, pos): the run of PUT records from pos"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kestrel.storage.kestrel3._codec", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__codec(void) {
    return PyModule_Create(&module);
}
