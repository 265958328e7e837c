/* The compiled twin of the binary protocol's two per-item loops: the list of binaries a batch `put`
 * carries (`BinaryReader.read_binary_list`) and the list of Items a batch `get` answers
 * (`BinaryWriter.write_flat_structs` for (bytes, i64) structs).
 *
 * A batch of 100 spends about a third of its Python time in these two loops. Both functions here
 * take only the plain case and answer None for anything else (a length that is negative, over the
 * byte budget or past the data at hand; a value that is not a (bytes, int) pair), without having
 * read or written anything: the Python loop then runs from the same place and names the fault, so
 * every rule and message stays written once, in Python. tests/test_thrift_lists.py compares the two
 * on intact and damaged lists. Optional: without a C compiler the Python loops serve alone.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { T_STOP = 0, T_I64 = 10, T_STRING = 11 };

static int32_t read_be32(const unsigned char *p) {
    return (int32_t)((uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3]);
}

static unsigned char *write_be16(unsigned char *p, int v) {
    p[0] = (unsigned char)(v >> 8);
    p[1] = (unsigned char)v;
    return p + 2;
}

static unsigned char *write_be32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
    return p + 4;
}

static unsigned char *write_be64(unsigned char *p, uint64_t v) {
    p = write_be32(p, (uint32_t)(v >> 32));
    return write_be32(p, (uint32_t)v);
}

/* read_binary_list(buf, pos, end, count, budget) -> (list of bytes, pos) | None */
static PyObject *read_binary_list(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "read_binary_list takes buf, pos, end, count, budget");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    Py_ssize_t end = PyLong_AsSsize_t(args[2]);
    Py_ssize_t count = PyLong_AsSsize_t(args[3]);
    long long budget = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred()) {
        goto done;
    }
    if (end > view.len) {
        end = view.len;
    }
    /* Every element needs at least its 4-byte length: a count the data cannot hold is the Python
     * loop's to refuse or read on for, before anything is allocated here. */
    if (pos < 0 || count < 0 || pos > end || count > (end - pos) / 4) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    const unsigned char *buf = view.buf;
    PyObject *items = PyList_New(count);
    if (items == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (end - pos < 4) {
            Py_DECREF(items);
            result = Py_NewRef(Py_None);
            goto done;
        }
        int32_t n = read_be32(buf + pos);
        pos += 4;
        if (n < 0 || n > budget || n > end - pos) {
            Py_DECREF(items);
            result = Py_NewRef(Py_None);
            goto done;
        }
        budget -= n;
        PyObject *item = PyBytes_FromStringAndSize((const char *)buf + pos, n);
        if (item == NULL) {
            Py_DECREF(items);
            goto done;
        }
        PyList_SET_ITEM(items, i, item);
        pos += n;
    }
    result = Py_BuildValue("(Nn)", items, pos);
done:
    PyBuffer_Release(&view);
    return result;
}

/* write_items(fid1, fid2, pairs) -> bytes | None: each (data, number) pair as a struct of a binary
 * field `fid1` and an i64 field `fid2`, then STOP, one after another. */
static PyObject *write_items(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "write_items takes fid1, fid2 and a list of (bytes, int)");
        return NULL;
    }
    long fid1 = PyLong_AsLong(args[0]);
    long fid2 = PyLong_AsLong(args[1]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (fid1 < -32768 || fid1 > 32767 || fid2 < -32768 || fid2 > 32767) {
        Py_RETURN_NONE;
    }
    PyObject *pairs = args[2];
    Py_ssize_t count = PyList_GET_SIZE(pairs);
    const Py_ssize_t fixed = 3 + 4 + 3 + 8 + 1;  /* two field headers, a length, an i64, STOP */
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *pair = PyList_GET_ITEM(pairs, i);
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2
                || !PyBytes_CheckExact(PyTuple_GET_ITEM(pair, 0))
                || !PyLong_CheckExact(PyTuple_GET_ITEM(pair, 1))) {
            Py_RETURN_NONE;
        }
        Py_ssize_t n = PyBytes_GET_SIZE(PyTuple_GET_ITEM(pair, 0));
        if (n > INT32_MAX || total > PY_SSIZE_T_MAX - fixed - n) {
            Py_RETURN_NONE;
        }
        total += fixed + n;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) {
        return NULL;
    }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *pair = PyList_GET_ITEM(pairs, i);
        PyObject *data = PyTuple_GET_ITEM(pair, 0);
        int overflow = 0;
        long long number = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(pair, 1), &overflow);
        if (overflow) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        Py_ssize_t n = PyBytes_GET_SIZE(data);
        *p++ = T_STRING;
        p = write_be16(p, (int)fid1);
        p = write_be32(p, (uint32_t)n);
        memcpy(p, PyBytes_AS_STRING(data), (size_t)n);
        p += n;
        *p++ = T_I64;
        p = write_be16(p, (int)fid2);
        p = write_be64(p, (uint64_t)number);
        *p++ = T_STOP;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"read_binary_list", (PyCFunction)(void (*)(void))read_binary_list, METH_FASTCALL,
     "The list's elements and the position after them, or None where the Python loop must read."},
    {"write_items", (PyCFunction)(void (*)(void))write_items, METH_FASTCALL,
     "The (bytes, i64) structs laid out one after another, or None where the Python loop must write."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "service._thrift_lists",
    "The binary protocol's per-item list loops, compiled (see service/thrift_protocol.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__thrift_lists(void) {
    return PyModule_Create(&module);
}
