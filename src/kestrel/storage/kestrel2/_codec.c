/* Compiled twins of src/kestrel/storage/kestrel2/codec.py's per-record loops, each beside the Python reference it is
 * tested against.
 *
 * Reading: `decode_common`, the twin of `storage.codec.decode_common_python` (the run of common
 * records). Start-up replay and the Spark journal source spend most of their time in that loop,
 * about half a microsecond of interpreter work per record. This does the same walk in C. The rare
 * records the damage check questions are handed to `misplaced_end`, the Python function that
 * decides, so every rule stays written once in Python. Two outputs: the tuples replay applies
 * (`decode_common`), or the run's fields as column buffers (`decode_common_columns`), which the
 * journal source hands to Arrow without a Python object per record. tests/storage/test_decode_common.py
 * compares them on valid, damaged and cut buffers.
 *
 * Writing: `encode_addx_many`, the twin of `storage.codec.encode_addx_many_python` (the ADDX
 * records of a batch put, one string). It takes lists of plain bytes whose times fit the record
 * and answers None for anything else, which the Python function then encodes or refuses.
 *
 * Optional: without a C compiler the build goes on and codec uses the Python loops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Opcodes and sizes of Kestrel 2's journal format, as named in src/kestrel/storage/kestrel2/codec.py. */
enum { REMOVE = 1, ADDX = 2, CONFIRM_REMOVE = 6, ADD_XID = 7, REMOVE_TENTATIVE_XID = 9 };
enum { MAX_OPCODE = 9, ITEM_HEADER = 16 };

static int32_t read_i32(const unsigned char *p) {
    uint32_t v = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    return (int32_t)v;
}

static int64_t read_i64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) {
        v = v << 8 | p[i];
    }
    return (int64_t)v;
}

/* Whether a one-bit smaller `size` would end the item record whose data is buf[head:stop] on an
 * opcode byte (codec._may_be_misplaced). */
static int may_be_misplaced(const unsigned char *buf, Py_ssize_t head, Py_ssize_t stop, int32_t size) {
    uint32_t rest = (uint32_t)size;
    while (rest) {
        uint32_t bit = rest & (~rest + 1);
        rest ^= bit;
        if (stop - (Py_ssize_t)bit >= head && buf[stop - bit] <= MAX_OPCODE) {
            return 1;
        }
    }
    return 0;
}

/* Where the walk's records go: `add` returns -1 with a Python exception set on failure. */
typedef struct Sink Sink;
struct Sink {
    int (*add)(Sink *sink, int op, long long offset, int32_t xid, int64_t add_time, int64_t expiry,
               const unsigned char *data, Py_ssize_t size);
};

/* The walk of codec.decode_common_python, its records given to `sink`. Returns 0, or -1 with an
 * exception set; `*pos` and `*previous` are left as the Python function returns them. */
static int walk(PyObject *source, const unsigned char *buf, Py_ssize_t end, Py_ssize_t *pos_out,
                long long base, long long budget, int check_sizes, PyObject *misplaced_end,
                Sink *sink, Py_ssize_t *previous_out) {
    Py_ssize_t pos = *pos_out, previous = -1;
    long long total = 0;
    int failed = 0;
    while (pos >= 0 && pos < end) {
        int op = buf[pos];
        if (op == ADDX || op == ADD_XID) {
            Py_ssize_t head = pos + (op == ADDX ? 21 : 25);
            if (head > end) {
                break;
            }
            const unsigned char *p = buf + pos + 1;
            int32_t xid = 0;
            if (op == ADD_XID) {
                xid = read_i32(p);
                p += 4;
            }
            int32_t size = read_i32(p);
            int64_t add_time = read_i64(p + 4), expiry = read_i64(p + 12);
            Py_ssize_t stop = head + (Py_ssize_t)size - ITEM_HEADER;
            total += stop - head;
            if (size < ITEM_HEADER || stop > end || total >= budget) {
                break;
            }
            if (check_sizes && may_be_misplaced(buf, head, stop, size)) {
                PyObject *found = PyObject_CallFunction(misplaced_end, "Onn", source, pos, stop);
                if (found == NULL) {
                    failed = 1;
                    break;
                }
                int damaged = found != Py_None;
                Py_DECREF(found);
                if (damaged) {
                    break;
                }
            }
            if (sink->add(sink, op, base + pos, xid, add_time, expiry, buf + head, stop - head)) {
                failed = 1;
                break;
            }
            previous = pos;
            pos = stop;
        } else if (op == REMOVE) {
            if (pos + 1 >= end || buf[pos + 1] > MAX_OPCODE) {
                break;
            }
            if (sink->add(sink, op, base + pos, 0, 0, 0, NULL, 0)) {
                failed = 1;
                break;
            }
            previous = -1;
            pos += 1;
        } else if (op == CONFIRM_REMOVE || op == REMOVE_TENTATIVE_XID) {
            if (pos + 5 > end) {
                break;
            }
            if (sink->add(sink, op, base + pos, read_i32(buf + pos + 1), 0, 0, NULL, 0)) {
                failed = 1;
                break;
            }
            previous = -1;
            pos += 5;
        } else {
            break;
        }
    }
    *pos_out = pos;
    *previous_out = previous;
    return failed ? -1 : 0;
}

/* The arguments both functions take, the buffer held while the walk runs. */
typedef struct {
    PyObject *source, *misplaced_end;
    Py_buffer view;
    Py_ssize_t pos;
    long long base, budget;
    int check_sizes;
} Call;

static int parse(PyObject *args, const char *format, Call *call) {
    if (!PyArg_ParseTuple(args, format, &call->source, &call->pos, &call->base, &call->budget,
                          &call->check_sizes, &call->misplaced_end)) {
        return -1;
    }
    return PyObject_GetBuffer(call->source, &call->view, PyBUF_SIMPLE);
}

static int run_walk(Call *call, Sink *sink, Py_ssize_t *previous) {
    return walk(call->source, call->view.buf, call->view.len, &call->pos, call->base, call->budget,
                call->check_sizes, call->misplaced_end, sink, previous);
}

/* ---- tuples: (op, offset, xid, add_time, expiry, data) ---- */

typedef struct {
    Sink sink;
    PyObject *run, *no_data;
} TupleSink;

static int add_tuple(Sink *sink, int op, long long offset, int32_t xid, int64_t add_time,
                     int64_t expiry, const unsigned char *data, Py_ssize_t size) {
    TupleSink *self = (TupleSink *)sink;
    PyObject *bytes = data == NULL ? Py_NewRef(self->no_data)
                                   : PyBytes_FromStringAndSize((const char *)data, size);
    if (bytes == NULL) {
        return -1;
    }
    PyObject *record = Py_BuildValue("(iLiLLN)", op, offset, (int)xid, (long long)add_time,
                                     (long long)expiry, bytes);
    if (record == NULL) {
        return -1;
    }
    int failed = PyList_Append(self->run, record);
    Py_DECREF(record);
    return failed;
}

static PyObject *decode_common(PyObject *module, PyObject *args) {
    (void)module;
    Call call;
    if (parse(args, "OnLLpO:decode_common", &call) < 0) {
        return NULL;
    }
    TupleSink sink = {{add_tuple}, PyList_New(0), PyBytes_FromStringAndSize(NULL, 0)};
    Py_ssize_t previous = -1;
    PyObject *result = NULL;
    if (sink.run != NULL && sink.no_data != NULL && run_walk(&call, &sink.sink, &previous) == 0) {
        result = Py_BuildValue("(Onn)", sink.run, call.pos, previous);
    }
    Py_XDECREF(sink.run);
    Py_XDECREF(sink.no_data);
    PyBuffer_Release(&call.view);
    return result;
}

/* ---- columns: little-endian buffers as Arrow lays out fixed-width values and binary data ---- */

typedef struct {
    char *bytes;
    Py_ssize_t size, capacity;
} Column;

static int put(Column *column, const void *value, Py_ssize_t size) {
    if (column->size + size > column->capacity) {
        Py_ssize_t capacity = column->capacity > 0 ? column->capacity : 4096;
        while (capacity < column->size + size) {
            capacity *= 2;
        }
        char *grown = realloc(column->bytes, (size_t)capacity);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        column->bytes = grown;
        column->capacity = capacity;
    }
    if (size) {
        memcpy(column->bytes + column->size, value, (size_t)size);
    }
    column->size += size;
    return 0;
}

enum { OPCODES, OFFSETS, XIDS, ADD_TIMES, EXPIRIES, DATA_ENDS, DATA, COLUMNS };

typedef struct {
    Sink sink;
    Column columns[COLUMNS];
    Py_ssize_t count;
} ColumnSink;

static int add_columns(Sink *sink, int op, long long offset, int32_t xid, int64_t add_time,
                       int64_t expiry, const unsigned char *data, Py_ssize_t size) {
    ColumnSink *self = (ColumnSink *)sink;
    Column *c = self->columns;
    int8_t code = (int8_t)op;
    int64_t at = offset;
    if (c[DATA].size + size > c[DATA].capacity) { /* cannot happen: the data was sized to fit */
        PyErr_SetString(PyExc_SystemError, "decode_common_columns: data past its bound");
        return -1;
    }
    if (size > 0) { /* records without data pass no pointer at all */
        memcpy(c[DATA].bytes + c[DATA].size, data, (size_t)size);
        c[DATA].size += size;
    }
    int32_t data_end = (int32_t)c[DATA].size;
    if (put(&c[OPCODES], &code, 1) || put(&c[OFFSETS], &at, 8) || put(&c[XIDS], &xid, 4)
        || put(&c[ADD_TIMES], &add_time, 8) || put(&c[EXPIRIES], &expiry, 8)
        || put(&c[DATA_ENDS], &data_end, 4)) {
        return -1;
    }
    self->count++;
    return 0;
}

static PyObject *decode_common_columns(PyObject *module, PyObject *args) {
    (void)module;
    Call call;
    if (parse(args, "OnLLpO:decode_common_columns", &call) < 0) {
        return NULL;
    }
    ColumnSink sink = {{add_columns}, {{0}}, 0};
    int32_t zero = 0;
    Py_ssize_t previous = -1;
    PyObject *result = NULL, *fields = NULL;
    /* The data is less than the budget and lies in the buffer after `pos`, so a bytes object of
     * the smaller size holds it: written in place, cut to size at the end, never copied. Arrow's
     * 32-bit data ends bound it as well. */
    Py_ssize_t most = call.view.len - call.pos;
    if (call.budget < most) {
        most = (Py_ssize_t)call.budget;
    }
    most = most < 0 ? 0 : most > INT32_MAX ? INT32_MAX : most;
    PyObject *data = PyBytes_FromStringAndSize(NULL, most);
    if (data == NULL) {
        goto done;
    }
    sink.columns[DATA].bytes = PyBytes_AS_STRING(data);
    sink.columns[DATA].capacity = most;
    if (put(&sink.columns[DATA_ENDS], &zero, 4) < 0 || run_walk(&call, &sink.sink, &previous) < 0
        || _PyBytes_Resize(&data, sink.columns[DATA].size) < 0) {
        goto done;
    }
    fields = PyTuple_New(COLUMNS + 1);
    if (fields == NULL) {
        goto done;
    }
    PyTuple_SET_ITEM(fields, 0, PyLong_FromSsize_t(sink.count));
    for (int i = 0; i < DATA; i++) {
        PyTuple_SET_ITEM(fields, i + 1, PyBytes_FromStringAndSize(sink.columns[i].bytes, sink.columns[i].size));
    }
    PyTuple_SET_ITEM(fields, DATA + 1, data);
    data = NULL;
    for (int i = 0; i <= COLUMNS; i++) {
        if (PyTuple_GET_ITEM(fields, i) == NULL) {
            Py_CLEAR(fields);
            goto done;
        }
    }
    result = Py_BuildValue("(Nnn)", fields, call.pos, previous);
done:
    Py_XDECREF(data);
    for (int i = 0; i < DATA; i++) {
        free(sink.columns[i].bytes);
    }
    PyBuffer_Release(&call.view);
    return result;
}

static void write_le32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

static void write_le64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

/* encode_addx_many(add_time, expiry, items) -> bytes | None: called with its arguments as they
   are (no tuple made and parsed for them, every put). */
static PyObject *encode_addx_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "encode_addx_many() takes 3 arguments, not %zd", nargs);
        return NULL;
    }
    PyObject *add_time_obj = args[0], *expiry_obj = args[1], *items = args[2];
    if (!PyList_Check(items)) {
        PyErr_Format(PyExc_TypeError, "encode_addx_many() argument 3 must be list, not %.200s",
                     Py_TYPE(items)->tp_name);
        return NULL;
    }
    int overflow_time = 0, overflow_expiry = 0;
    long long add_time = PyLong_Check(add_time_obj)
        ? PyLong_AsLongLongAndOverflow(add_time_obj, &overflow_time) : (overflow_time = 1, 0);
    long long expiry = PyLong_Check(expiry_obj)
        ? PyLong_AsLongLongAndOverflow(expiry_obj, &overflow_expiry) : (overflow_expiry = 1, 0);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (overflow_time || overflow_expiry) {
        Py_RETURN_NONE;
    }
    Py_ssize_t count = PyList_GET_SIZE(items);
    const Py_ssize_t head = 1 + 4 + 8 + 8;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *data = PyList_GET_ITEM(items, i);
        if (!PyBytes_CheckExact(data)) {
            Py_RETURN_NONE;
        }
        Py_ssize_t n = PyBytes_GET_SIZE(data);
        if (n > INT32_MAX - ITEM_HEADER || total > PY_SSIZE_T_MAX - head - n) {
            Py_RETURN_NONE;
        }
        total += head + n;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) {
        return NULL;
    }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *data = PyList_GET_ITEM(items, i);
        Py_ssize_t n = PyBytes_GET_SIZE(data);
        p[0] = ADDX;
        write_le32(p + 1, (uint32_t)(ITEM_HEADER + n));
        write_le64(p + 5, (uint64_t)add_time);
        write_le64(p + 13, (uint64_t)expiry);
        memcpy(p + head, PyBytes_AS_STRING(data), (size_t)n);
        p += head + n;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"encode_addx_many", (PyCFunction)(void (*)(void))encode_addx_many, METH_FASTCALL,
     "encode_addx_many(add_time, expiry, items) -> the ADDX records as one string, or None"},
    {"decode_common", decode_common, METH_VARARGS,
     "decode_common(buf, pos, base, budget, check_sizes, misplaced_end) -> (run, pos, previous)"},
    {"decode_common_columns", decode_common_columns, METH_VARARGS,
     "decode_common_columns(buf, pos, base, budget, check_sizes, misplaced_end) -> "
     "((count, opcodes, offsets, xids, add_times, expiries, data_ends, data), pos, previous)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kestrel.storage.kestrel2._codec", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__codec(void) {
    return PyModule_Create(&module);
}
