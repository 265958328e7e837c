/* Pipelined runs of plain memcache commands in a connection's receive buffer (see
 * src/kestrel/service/memcache/runs.py): a run of `set`s to one queue with one exptime
 * (`scan_sets`), or of `get`s of one queue (`scan_gets`), and the replies of a run of gets (`values`).
 *
 * Read one by one, a pipelined burst of 100 sets and 100 gets cost about 15 µs of Python per item.
 * These functions recognise only the exact common shapes, `set <key> <flags> <exptime> <bytes>\r\n`
 * (optionally ` noreply` before the CRLF) with its data and CRLF complete in the buffer, and
 * `get <key>\r\n` without options, each line within `max_line` and each item within `max_item`; a
 * run ends before the first command of another shape, queue or expiry. `commands.parse_line` reads
 * every other line, and is the reference tests/memcache/test_memcache_runs.py checks every run
 * against (`values`: against `runs.values_python`); `make sanitize` runs those tests with this built
 * under AddressSanitizer and UBSan. Nothing is allocated for a command before its bounds are checked.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define U32_MAX 4294967295ULL
#define ITEM_MAX 2147483647ULL

/* A key byte of the fast shape: printable ASCII, no space (and, for a get, no '/': no options). */
static int key_byte(unsigned char c) {
    return c > 0x20 && c < 0x7f;
}

/* 1 to 10 decimal digits at b[*i], their value in *value; 0 for anything else. */
static int digits(const unsigned char *b, Py_ssize_t *i, Py_ssize_t end, unsigned long long *value) {
    Py_ssize_t start = *i;
    unsigned long long v = 0;
    while (*i < end && b[*i] >= '0' && b[*i] <= '9') {
        if (*i - start == 10) {
            return 0;
        }
        v = v * 10 + (unsigned long long)(b[*i] - '0');
        (*i)++;
    }
    *value = v;
    return *i > start;
}

/* The last place where the '\n' of a line starting at pos may be: within the buffer and within
 * `max_line` (the general path refuses a line whose '\n' is further). */
static Py_ssize_t last_newline(Py_ssize_t pos, Py_ssize_t end, Py_ssize_t max_line) {
    return pos + max_line < end - 1 ? pos + max_line : end - 1;
}

typedef struct {
    Py_ssize_t key, key_len;  /* where the key is in the buffer */
    unsigned long long exptime, size;
    int noreply;
    Py_ssize_t data;  /* where the item's data starts, after the line's CRLF */
} SetLine;

/* A plain set line at b[pos:] and its complete data, or 0. */
static int set_line(const unsigned char *b, Py_ssize_t pos, Py_ssize_t end, Py_ssize_t max_line,
                    unsigned long long max_item, SetLine *line) {
    Py_ssize_t i = pos + 4;
    unsigned long long flags;
    if (end - pos < 4 || memcmp(b + pos, "set ", 4) != 0) {
        return 0;
    }
    Py_ssize_t last = last_newline(pos, end, max_line);
    line->key = i;
    while (i < last && key_byte(b[i])) {
        i++;
    }
    line->key_len = i - line->key;
    if (line->key_len == 0 || i >= last || b[i++] != ' ' || !digits(b, &i, last, &flags) || flags > U32_MAX
            || i >= last || b[i++] != ' ' || !digits(b, &i, last, &line->exptime) || line->exptime > U32_MAX
            || i >= last || b[i++] != ' ' || !digits(b, &i, last, &line->size) || line->size > ITEM_MAX
            || line->size > max_item) {
        return 0;
    }
    line->noreply = 0;
    if (last - i >= 8 && memcmp(b + i, " noreply", 8) == 0) {
        line->noreply = 1;
        i += 8;
    }
    if (i + 1 > last || b[i] != '\r' || b[i + 1] != '\n') {
        return 0;
    }
    line->data = i + 2;
    if ((unsigned long long)(end - line->data) < line->size + 2) {
        return 0;  /* the item is still to come */
    }
    Py_ssize_t data_end = line->data + (Py_ssize_t)line->size;
    return b[data_end] == '\r' && b[data_end + 1] == '\n';
}

static int buffer_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, Py_buffer *view,
                       Py_ssize_t *numbers, const char *name) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, want);
        return -1;
    }
    for (Py_ssize_t n = 1; n < want; n++) {
        numbers[n - 1] = PyLong_AsSsize_t(args[n]);
        if (numbers[n - 1] == -1 && PyErr_Occurred()) {
            return -1;
        }
    }
    if (PyObject_GetBuffer(args[0], view, PyBUF_SIMPLE) < 0) {
        return -1;
    }
    if (numbers[0] < 0 || numbers[1] > view->len || numbers[0] > numbers[1]) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "pos and end must be within the buffer");
        return -1;
    }
    return 0;
}

/* scan_sets(buf, pos, end, max_line, max_item, limit) -> (key, exptime, datas, answered, pos) | None */
static PyObject *scan_sets(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer view;
    Py_ssize_t n[5];
    if (buffer_args(args, nargs, 6, &view, n, "scan_sets") < 0) {
        return NULL;
    }
    const unsigned char *b = view.buf;
    Py_ssize_t pos = n[0], end = n[1], max_line = n[2], limit = n[4];
    unsigned long long max_item = n[3] < 0 ? 0 : (unsigned long long)n[3];
    SetLine first, line;
    PyObject *result = NULL, *datas = NULL, *answered = NULL;
    if (limit < 1 || !set_line(b, pos, end, max_line, max_item, &first)) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    datas = PyList_New(0);
    answered = PyByteArray_FromStringAndSize(NULL, 0);
    if (datas == NULL || answered == NULL) {
        goto done;
    }
    line = first;
    do {
        PyObject *data = PyBytes_FromStringAndSize((const char *)b + line.data, (Py_ssize_t)line.size);
        if (data == NULL || PyList_Append(datas, data) < 0) {
            Py_XDECREF(data);
            goto done;
        }
        Py_DECREF(data);
        char flag = line.noreply ? 0 : 1;
        if (PyByteArray_Resize(answered, PyList_GET_SIZE(datas)) < 0) {
            goto done;
        }
        PyByteArray_AS_STRING(answered)[PyList_GET_SIZE(datas) - 1] = flag;
        pos = line.data + (Py_ssize_t)line.size + 2;
    } while (PyList_GET_SIZE(datas) < limit && set_line(b, pos, end, max_line, max_item, &line)
             && line.key_len == first.key_len && memcmp(b + line.key, b + first.key, (size_t)first.key_len) == 0
             && line.exptime == first.exptime);
    PyObject *flags = PyBytes_FromStringAndSize(PyByteArray_AS_STRING(answered), PyByteArray_GET_SIZE(answered));
    if (flags != NULL) {  /* the tuple made directly: Py_BuildValue parses its format at every call */
        PyObject *key = PyBytes_FromStringAndSize((const char *)b + first.key, first.key_len);
        PyObject *exptime = PyLong_FromUnsignedLongLong(first.exptime);
        PyObject *after = PyLong_FromSsize_t(pos);
        if (key != NULL && exptime != NULL && after != NULL) {
            result = PyTuple_Pack(5, key, exptime, datas, flags, after);
        }
        Py_XDECREF(after);
        Py_XDECREF(exptime);
        Py_XDECREF(key);
        Py_DECREF(flags);
    }
done:
    Py_XDECREF(datas);
    Py_XDECREF(answered);
    PyBuffer_Release(&view);
    return result;
}

/* A plain get line at b[pos:]: the end of its key, or 0. */
static Py_ssize_t get_line(const unsigned char *b, Py_ssize_t pos, Py_ssize_t end, Py_ssize_t max_line) {
    Py_ssize_t i = pos + 4;
    if (end - pos < 4 || memcmp(b + pos, "get ", 4) != 0) {
        return 0;
    }
    Py_ssize_t last = last_newline(pos, end, max_line);
    while (i < last && key_byte(b[i]) && b[i] != '/') {
        i++;
    }
    if (i == pos + 4 || i + 1 > last || b[i] != '\r' || b[i + 1] != '\n') {
        return 0;
    }
    return i;
}

/* scan_gets(buf, pos, end, max_line, limit) -> (key, count, pos) | None */
static PyObject *scan_gets(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer view;
    Py_ssize_t n[4];
    if (buffer_args(args, nargs, 5, &view, n, "scan_gets") < 0) {
        return NULL;
    }
    const unsigned char *b = view.buf;
    Py_ssize_t pos = n[0], end = n[1], max_line = n[2], limit = n[3];
    Py_ssize_t key_end = limit < 1 ? 0 : get_line(b, pos, end, max_line);
    if (key_end == 0) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    Py_ssize_t key = pos + 4, key_len = key_end - key, line_len = key_len + 6, count = 0;
    do {
        count++;
        pos += line_len;
    } while (count < limit && end - pos >= line_len && max_line >= line_len - 1
             && memcmp(b + pos, b + key - 4, (size_t)line_len) == 0);
    PyObject *result = NULL;  /* the tuple made directly, as above */
    PyObject *name = PyBytes_FromStringAndSize((const char *)b + key, key_len);
    PyObject *gets = PyLong_FromSsize_t(count);
    PyObject *after = PyLong_FromSsize_t(pos);
    if (name != NULL && gets != NULL && after != NULL) {
        result = PyTuple_Pack(3, name, gets, after);
    }
    Py_XDECREF(after);
    Py_XDECREF(gets);
    Py_XDECREF(name);
    PyBuffer_Release(&view);
    return result;
}

/* The number of decimal digits of n. */
static Py_ssize_t width(Py_ssize_t n) {
    Py_ssize_t w = 1;
    while (n >= 10) {
        n /= 10;
        w++;
    }
    return w;
}

/* values(key, datas, misses) -> bytes: a VALUE block and END per data, then END per miss. */
static PyObject *values(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyBytes_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "values(key: bytes, datas: list[bytes], misses: int)");
        return NULL;
    }
    Py_ssize_t misses = PyLong_AsSsize_t(args[2]);
    if (misses == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (misses < 0) {
        PyErr_SetString(PyExc_ValueError, "misses must not be negative");
        return NULL;
    }
    PyObject *key = args[0], *datas = args[1];
    Py_ssize_t key_len = PyBytes_GET_SIZE(key), count = PyList_GET_SIZE(datas);
    Py_ssize_t total = misses * 5;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *data = PyList_GET_ITEM(datas, i);
        if (!PyBytes_Check(data)) {
            PyErr_SetString(PyExc_TypeError, "values: every data must be bytes");
            return NULL;
        }
        Py_ssize_t size = PyBytes_GET_SIZE(data);
        /* "VALUE " key " 0 " size "\r\n" data "\r\nEND\r\n" */
        total += 6 + key_len + 3 + width(size) + 2 + size + 7;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) {
        return NULL;
    }
    char *p = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *data = PyList_GET_ITEM(datas, i);
        Py_ssize_t size = PyBytes_GET_SIZE(data), w = width(size), n = size;
        memcpy(p, "VALUE ", 6);
        p += 6;
        memcpy(p, PyBytes_AS_STRING(key), (size_t)key_len);
        p += key_len;
        memcpy(p, " 0 ", 3);
        p += 3;
        for (Py_ssize_t d = w - 1; d >= 0; d--) {
            p[d] = (char)('0' + n % 10);
            n /= 10;
        }
        p += w;
        memcpy(p, "\r\n", 2);
        p += 2;
        memcpy(p, PyBytes_AS_STRING(data), (size_t)size);
        p += size;
        memcpy(p, "\r\nEND\r\n", 7);
        p += 7;
    }
    for (Py_ssize_t i = 0; i < misses; i++) {
        memcpy(p, "END\r\n", 5);
        p += 5;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"scan_sets", (PyCFunction)(void (*)(void))scan_sets, METH_FASTCALL,
     "A run of plain sets to one queue with one exptime: (key, exptime, datas, answered, end), or None."},
    {"scan_gets", (PyCFunction)(void (*)(void))scan_gets, METH_FASTCALL,
     "A run of plain gets of one queue: (key, count, end), or None."},
    {"values", (PyCFunction)(void (*)(void))values, METH_FASTCALL,
     "The replies of a run of gets: a VALUE block and END per data, then END per miss."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kestrel.service.memcache._scan",
    "Pipelined runs of plain memcache commands, compiled (see src/kestrel/service/memcache/runs.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__scan(void) {
    return PyModule_Create(&module);
}
