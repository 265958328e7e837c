/* The binary protocol's hot paths, compiled: reading a whole call frame (`read_call`, in place in a
 * receive buffer `read_framed_call`: the message header and the arguments), the list of binaries a
 * batch `put` carries (`read_binary_list`), and laying out a binary reply (`write_reply`: nothing, an
 * i32, or the Items or TimedItems of a get, from the items' data, ids and times apart).
 *
 * The Python readers and writers of src/kestrel/service/thrift/protocol.py and messages.py are the
 * reference: `read_message_begin` and `read_args` for a call, `read_binary_list_python` for a list,
 * `write_reply` for a reply. Every function here takes only the plain case and answers None for
 * anything else (a length that is negative, over a limit or past the frame; a field the method does
 * not have, of another type or given again; a string that is not UTF-8; a data that is not bytes or a number that
 * is not a plain int of its range), without having read or written anything: the Python code then
 * runs from the same place and names the fault, so every rule and message stays written once, in
 * Python. tests/thrift/test_thrift_binary.py compares the two on intact and damaged input, and
 * `make sanitize` runs it with the helper built under AddressSanitizer and UBSan. Optional: without
 * a C compiler the Python code serves alone.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { T_STOP = 0, T_I32 = 8, T_I64 = 10, T_STRING = 11, T_STRUCT = 12, T_LIST = 15 };
enum { CALL = 1, MAX_NAME = 256 };
/* How `read_call` reads each argument (the `kind` of a method's field table). */
enum { ARG_I32 = 0, ARG_I64 = 1, ARG_TEXT = 2, ARG_BINARY = 3, ARG_BINARY_LIST = 4, ARG_I64_LIST = 5 };

static int32_t read_be32(const unsigned char *p) {
    return (int32_t)((uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3]);
}

static int16_t read_be16(const unsigned char *p) {
    return (int16_t)((uint16_t)p[0] << 8 | (uint16_t)p[1]);
}

static int64_t read_be64(const unsigned char *p) {
    return (int64_t)((uint64_t)(uint32_t)read_be32(p) << 32 | (uint64_t)(uint32_t)read_be32(p + 4));
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

/* The elements of a list of binaries at buf[*pos:end], or NULL: None (nothing to say, the Python loop
 * decides) when *declined is set, else an exception. */
static PyObject *binary_list(const unsigned char *buf, Py_ssize_t *pos_io, Py_ssize_t end, Py_ssize_t count,
                             long long budget, int *declined) {
    Py_ssize_t pos = *pos_io;
    *declined = 1;
    /* Every element needs at least its 4-byte length: a count the data cannot hold is the Python
     * loop's to refuse or read on for, before anything is allocated here. */
    if (pos < 0 || count < 0 || pos > end || count > (end - pos) / 4) {
        return NULL;
    }
    PyObject *items = PyList_New(count);
    if (items == NULL) {
        *declined = 0;
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (end - pos < 4) {
            Py_DECREF(items);
            return NULL;
        }
        int32_t n = read_be32(buf + pos);
        pos += 4;
        if (n < 0 || n > budget || n > end - pos) {
            Py_DECREF(items);
            return NULL;
        }
        budget -= n;
        PyObject *item = PyBytes_FromStringAndSize((const char *)buf + pos, n);
        if (item == NULL) {
            Py_DECREF(items);
            *declined = 0;
            return NULL;
        }
        PyList_SET_ITEM(items, i, item);
        pos += n;
    }
    *pos_io = pos;
    *declined = 0;
    return items;
}

/* Whether the reader knows element type `t` (`BinaryReader.MIN_SIZE`): an empty list of it is read. */
static int known_type(int t) {
    switch (t) {
    case 2: case 3: case 4: case 6: case 8: case 10: case 11: case 12: case 13: case 14: case 15: case 16:
        return 1;
    default:
        return 0;
    }
}

/* The text arguments are queue names, and a client names the same few queues call after call: the
 * str of a name is kept, in a slot chosen by a hash of its bytes, and given again for the same bytes,
 * so that a call decodes no name its slot holds, and the queue's lookup finds the str's hash already
 * computed (a decode and a hash of the name: about a thirtieth of a request's instructions). Only
 * ASCII names are kept: their str holds the bytes as they came, one a character, to compare with. */
enum { NAME_SLOTS = 64, MAX_KEPT_NAME = 64 };
static PyObject *kept_names[NAME_SLOTS];

static PyObject *text(const char *start, int32_t n) {
    if (n > MAX_KEPT_NAME) {
        return PyUnicode_DecodeUTF8(start, n, "strict");
    }
    uint32_t hash = 2166136261u ^ (uint32_t)n;  /* FNV-1a */
    for (int32_t i = 0; i < n; i++) {
        hash = (hash ^ (unsigned char)start[i]) * 16777619u;
    }
    PyObject **slot = &kept_names[hash % NAME_SLOTS];
    PyObject *kept = *slot;
    if (kept != NULL && PyUnicode_GET_LENGTH(kept) == n && memcmp(PyUnicode_DATA(kept), start, (size_t)n) == 0) {
        return Py_NewRef(kept);
    }
    PyObject *value = PyUnicode_DecodeUTF8(start, n, "strict");
    if (value != NULL && PyUnicode_IS_ASCII(value)) {
        Py_XSETREF(*slot, Py_NewRef(value));
    }
    return value;
}

/* The value of one argument of `kind` at buf[*pos:end] (after its field header), or NULL as above. */
static PyObject *argument(int kind, const unsigned char *buf, Py_ssize_t *pos_io, Py_ssize_t end,
                          Py_ssize_t max_items, long long max_bytes, int *declined) {
    Py_ssize_t pos = *pos_io;
    PyObject *value = NULL;
    *declined = 1;
    switch (kind) {
    case ARG_I32:
        if (end - pos < 4) {
            return NULL;
        }
        value = PyLong_FromLong(read_be32(buf + pos));
        pos += 4;
        break;
    case ARG_I64:
        if (end - pos < 8) {
            return NULL;
        }
        value = PyLong_FromLongLong(read_be64(buf + pos));
        pos += 8;
        break;
    case ARG_TEXT:
    case ARG_BINARY: {
        if (end - pos < 4) {
            return NULL;
        }
        int32_t n = read_be32(buf + pos);
        if (n < 0 || n > end - pos - 4) {
            return NULL;
        }
        const char *start = (const char *)buf + pos + 4;
        if (kind == ARG_BINARY) {
            value = PyBytes_FromStringAndSize(start, n);
        } else {
            value = text(start, n);
            if (value == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                PyErr_Clear();  /* the Python reader names the byte */
                return NULL;
            }
        }
        pos += 4 + n;
        break;
    }
    case ARG_BINARY_LIST: {
        if (end - pos < 5) {
            return NULL;
        }
        int etype = (signed char)buf[pos];
        int32_t count = read_be32(buf + pos + 1);
        pos += 5;
        if (count == 0 && known_type(etype)) {  /* an empty list of any type the reader knows */
            value = PyList_New(0);
            break;
        }
        /* As `read_list_begin` checks a list of strings (4 bytes at least each), and batch limits. */
        if (etype != T_STRING || count < 0 || (long long)count * 4 > end - pos || count > max_items) {
            return NULL;
        }
        value = binary_list(buf, &pos, end, count, max_bytes, declined);
        if (value == NULL) {
            return NULL;
        }
        break;
    }
    case ARG_I64_LIST: {  /* a list or set of i64 (`confirm` and `abort`'s ids), read as a list */
        if (end - pos < 5) {
            return NULL;
        }
        int etype = (signed char)buf[pos];
        int32_t count = read_be32(buf + pos + 1);
        pos += 5;
        if (count == 0 && known_type(etype)) {
            value = PyList_New(0);
            break;
        }
        if (etype != T_I64 || count < 0 || (long long)count * 8 > end - pos || count > max_items) {
            return NULL;
        }
        value = PyList_New(count);
        for (Py_ssize_t i = 0; value != NULL && i < count; i++) {
            PyObject *number = PyLong_FromLongLong(read_be64(buf + pos));
            if (number == NULL) {
                Py_CLEAR(value);
                break;
            }
            PyList_SET_ITEM(value, i, number);
            pos += 8;
        }
        break;
    }
    default:
        return NULL;
    }
    *declined = 0;
    if (value != NULL) {
        *pos_io = pos;
    }
    return value;
}

/* The entry of `methods` for the method named buf[0:size] (borrowed), or NULL: each entry is (name
 * as UTF-8 bytes, the method, defaults, field rules), a handful of them, compared by length first. */
static PyObject *find_method(const unsigned char *name, Py_ssize_t size, PyObject *methods) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(methods); i++) {
        PyObject *entry = PyTuple_GET_ITEM(methods, i);
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 4 || !PyBytes_Check(PyTuple_GET_ITEM(entry, 0))) {
            continue;
        }
        PyObject *known = PyTuple_GET_ITEM(entry, 0);
        if (PyBytes_GET_SIZE(known) == size && memcmp(PyBytes_AS_STRING(known), name, (size_t)size) == 0
                && PyTuple_Check(PyTuple_GET_ITEM(entry, 2)) && PyBytes_Check(PyTuple_GET_ITEM(entry, 3))) {
            return entry;
        }
    }
    return NULL;
}

/* Field `fid`'s (position, wire type, kind) from a method's rules, `rules`: three bytes a field id,
 * the first NO_FIELD where the reader has none (read from bytes, as three ints from a tuple cost
 * about 80 instructions a field). 0 where it has none, or its position is not one of `slots`. */
enum { NO_FIELD = 0xff };
static int field_rule(PyObject *rules, int fid, Py_ssize_t slots, Py_ssize_t *position, long *ttype,
                      long *kind) {
    if (fid < 0 || fid >= PyBytes_GET_SIZE(rules) / 3) {
        return 0;
    }
    const unsigned char *rule = (const unsigned char *)PyBytes_AS_STRING(rules) + 3 * (Py_ssize_t)fid;
    *position = rule[0];
    *ttype = rule[1];
    *kind = rule[2];
    return rule[0] != NO_FIELD && *position < slots;
}

/* The call in buf[0:end]: a strict binary message header, a known method, a call, then fields the
 * method has, each of its type and once, up to STOP. `methods`: a tuple of (name as UTF-8 bytes, the method,
 * its defaults in argument order, its field rules: three bytes a field id, (position, wire type,
 * kind) or NO_FIELD first), as messages.py makes them from the contract. 1 with *method (the entry's method), *mtype, *seqid,
 * *values (the arguments in order, the defaults where the call has none; new references) and *pos
 * (where the call ends) set; 0 where the Python readers must read it; -1 with an exception. */
static int parse_call(const unsigned char *buf, Py_ssize_t end, PyObject *methods, Py_ssize_t max_items,
                      long long max_bytes, PyObject **method_out, int *mtype_out, int32_t *seqid_out,
                      PyObject **values_out, Py_ssize_t *pos_out) {
    if (end < 8) {
        return 0;
    }
    uint32_t first = (uint32_t)read_be32(buf);
    int32_t name_size = read_be32(buf + 4);
    if ((first & 0xffff0000u) != 0x80010000u || name_size < 0 || name_size > MAX_NAME
            || name_size > end - 8 - 4 || (name_size >= 2 && buf[8] == 0x80 && buf[9] == 0x01)) {
        return 0;
    }
    int mtype = (int)(first & 0xff);
    PyObject *entry = find_method(buf + 8, name_size, methods);  /* borrowed */
    if (entry == NULL || mtype != CALL) {
        return 0;
    }
    Py_ssize_t pos = 8 + name_size;
    int32_t seqid = read_be32(buf + pos);
    pos += 4;
    PyObject *defaults = PyTuple_GET_ITEM(entry, 2), *fields = PyTuple_GET_ITEM(entry, 3);
    Py_ssize_t slots = PyTuple_GET_SIZE(defaults);
    PyObject *values = PyTuple_New(slots);
    if (values == NULL) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < slots; i++) {
        PyTuple_SET_ITEM(values, i, Py_NewRef(PyTuple_GET_ITEM(defaults, i)));
    }
    uint64_t given = 0;  /* the arguments read so far, by position: a repeated one is Python's to count */
    for (;;) {
        if (pos >= end) {
            goto declined;
        }
        int ttype = buf[pos];
        if (ttype == T_STOP) {
            pos += 1;
            break;
        }
        if (end - pos < 3) {
            goto declined;
        }
        int fid = read_be16(buf + pos + 1);
        Py_ssize_t position;
        long wire_type, kind;
        if (!field_rule(fields, fid, slots, &position, &wire_type, &kind) || wire_type != ttype
                || position >= 64 || given & (UINT64_C(1) << position)) {
            goto declined;
        }
        given |= UINT64_C(1) << position;
        pos += 3;
        int declined;
        PyObject *value = argument((int)kind, buf, &pos, end, max_items, max_bytes, &declined);
        if (value == NULL) {
            if (declined) {
                goto declined;
            }
            Py_DECREF(values);
            return -1;
        }
        PyObject *old = PyTuple_GET_ITEM(values, position);  /* the tuple is still this reader's own */
        PyTuple_SET_ITEM(values, position, value);
        Py_DECREF(old);
    }
    *method_out = Py_NewRef(PyTuple_GET_ITEM(entry, 1));
    *mtype_out = mtype;
    *seqid_out = seqid;
    *values_out = values;
    *pos_out = pos;
    return 1;
declined:
    Py_DECREF(values);
    return 0;
}

/* The bytes of a buffer held still while a call reads them (`hold`, then `let_go`): an exact bytearray
 * (a receive buffer) has its export count taken as its own buffer protocol takes it, so that nothing
 * can resize it meanwhile (an allocation here may run the collector, and a finalizer Python code),
 * without a Py_buffer filled and released (235 instructions a call); bytes are immutable; anything
 * else goes through the buffer protocol. */
typedef struct {
    PyObject *owner;  /* the bytearray whose export is taken, else NULL */
    const unsigned char *buf;
    Py_ssize_t len;
    Py_buffer view;
    int viewed;
} Held;

static int hold(PyObject *obj, Held *held) {
    held->owner = NULL;
    held->viewed = 0;
    if (PyByteArray_CheckExact(obj)) {
        ((PyByteArrayObject *)obj)->ob_exports++;
        held->owner = obj;
        held->buf = (const unsigned char *)PyByteArray_AS_STRING(obj);
        held->len = PyByteArray_GET_SIZE(obj);
        return 0;
    }
    if (PyBytes_CheckExact(obj)) {
        held->buf = (const unsigned char *)PyBytes_AS_STRING(obj);
        held->len = PyBytes_GET_SIZE(obj);
        return 0;
    }
    if (PyObject_GetBuffer(obj, &held->view, PyBUF_SIMPLE) < 0) {
        return -1;
    }
    held->viewed = 1;
    held->buf = held->view.buf;
    held->len = held->view.len;
    return 0;
}

static void let_go(Held *held) {
    if (held->owner != NULL) {
        ((PyByteArrayObject *)held->owner)->ob_exports--;
    } else if (held->viewed) {
        PyBuffer_Release(&held->view);
    }
}

/* The call `parse_call` reads in `args[0]` (a buffer), with `args[first]` the methods and the two
 * after it max_items and max_bytes. `max_frame` < 0: the buffer is a frame's payload, answered
 * (method, mtype, seqid, args, pos); else it starts with a frame (a 4-byte size, then the payload)
 * read in place when whole and within `max_frame`, answered (method, seqid, args, end of the frame).
 * None where there is no such call. */
static PyObject *plain_call(PyObject *const *args, Py_ssize_t first, Py_ssize_t max_frame) {
    Held held;
    if (hold(args[0], &held) < 0) {
        return NULL;
    }
    PyObject *result = NULL, *method, *values;
    int mtype;
    int32_t seqid;
    Py_ssize_t pos;
    Py_ssize_t max_items = PyLong_AsSsize_t(args[first + 1]);
    long long max_bytes = PyLong_AsLongLong(args[first + 2]);
    if (!PyErr_Occurred()) {
        const unsigned char *buf = held.buf;
        Py_ssize_t start = 0, size = held.len;
        if (max_frame >= 0) {
            start = 4;
            size = held.len >= 4 ? read_be32(buf) : -1;
        }
        int read = 0;
        if (max_frame < 0 || (size >= 0 && size <= max_frame && size <= held.len - 4)) {
            read = parse_call(buf + start, size, args[first], max_items, max_bytes, &method, &mtype, &seqid,
                              &values, &pos);
        }
        if (read > 0) {  /* the tuple made directly, taking the references made for it */
            Py_ssize_t n = max_frame < 0 ? 5 : 4, i = 0;
            result = PyTuple_New(n);
            if (result == NULL) {
                Py_DECREF(values);
                Py_DECREF(method);
            } else {
                PyTuple_SET_ITEM(result, i++, method);
                if (max_frame < 0) {
                    PyTuple_SET_ITEM(result, i++, PyLong_FromLong(mtype));
                }
                PyTuple_SET_ITEM(result, i++, PyLong_FromLong(seqid));
                PyTuple_SET_ITEM(result, i++, values);
                PyTuple_SET_ITEM(result, i, PyLong_FromSsize_t(max_frame < 0 ? pos : start + size));
                for (i = 0; i < n; i++) {
                    if (PyTuple_GET_ITEM(result, i) == NULL) {  /* a number not made: no memory */
                        Py_CLEAR(result);
                        break;
                    }
                }
            }
        } else if (read == 0) {
            result = Py_NewRef(Py_None);
        }
    }
    let_go(&held);
    return result;
}

/* read_call(frame, methods, max_items, max_bytes) -> (method, mtype, seqid, args, pos) | None:
 * the call a whole frame's payload holds (`parse_call`). */
static PyObject *read_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "read_call takes frame, methods, max_items, max_bytes");
        return NULL;
    }
    return plain_call(args, 1, -1);
}

/* read_framed_call(buf, max_frame, methods, max_items, max_bytes) -> (method, seqid, args, end) | None:
 * the call of the frame at the start of a receive buffer (a 4-byte size, then the payload), read in
 * place, when the frame is whole, within `max_frame` and its call one `parse_call` reads; `end` is
 * where the frame ends. None for anything else: a frame still arriving, one refused, a call the
 * Python readers must read. */
static PyObject *read_framed_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "read_framed_call takes buf, max_frame, methods, max_items, max_bytes");
        return NULL;
    }
    Py_ssize_t max_frame = PyLong_AsSsize_t(args[1]);
    if (max_frame == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (max_frame < 0) {
        Py_RETURN_NONE;  /* no frame is within it */
    }
    return plain_call(args, 2, max_frame);
}

/* read_binary_list(buf, pos, end, count, budget) -> (list of bytes, pos) | None */
static PyObject *read_binary_list(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "read_binary_list takes buf, pos, end, count, budget");
        return NULL;
    }
    Held held;
    if (hold(args[0], &held) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    Py_ssize_t end = PyLong_AsSsize_t(args[2]);
    Py_ssize_t count = PyLong_AsSsize_t(args[3]);
    long long budget = PyLong_AsLongLong(args[4]);
    if (!PyErr_Occurred()) {
        if (end > held.len) {
            end = held.len;
        }
        int declined;
        PyObject *items = binary_list(held.buf, &pos, end, count, budget, &declined);
        if (items != NULL) {
            result = Py_BuildValue("(Nn)", items, pos);
        } else if (declined) {
            result = Py_NewRef(Py_None);
        }
    }
    let_go(&held);
    return result;
}

/* An int as a C long long, or 0 with *bad set where it is not an exact int or is past the range. */
static long long exact_int(PyObject *value, long long low, long long high, int *bad) {
    int overflow = 0;
    long long v = PyLong_CheckExact(value) ? PyLong_AsLongLongAndOverflow(value, &overflow) : 0;
    if (!PyLong_CheckExact(value) || overflow || v < low || v > high) {
        *bad = 1;
        return 0;
    }
    return v;
}

/* The list args[n] when it is an exact list of `count` elements, else NULL. */
static PyObject *list_of(PyObject *const *args, Py_ssize_t n, Py_ssize_t count) {
    PyObject *list = args[n];
    return PyList_CheckExact(list) && PyList_GET_SIZE(list) == count ? list : NULL;
}

/* A new bytes object of `size` bytes after `frame` bytes of room (0, or 4 for a frame header); the
 * header, when there is room for one, holds `size`, big-endian: Thrift's framed transport. */
static PyObject *framed(Py_ssize_t size, Py_ssize_t frame) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, frame + size);
    if (out != NULL && frame) {
        write_be32((unsigned char *)PyBytes_AS_STRING(out), (uint32_t)size);
    }
    return out;
}

/* write_reply(head, seqid[, result]) and write_reply(head, seqid, fids, datas, ids[, added, expiries])
 *   -> bytes | None
 * A binary reply: `head` (the message header up to the sequence id, the same for every reply of a
 * method), the sequence id, then the result struct: empty (a void method), an i32 `result`, or a
 * list of structs, one per data in `datas`: a binary field then i64 fields with the ids `fids`, the
 * i64s being the data's id (`ids`: one int for all, or a list) and, for TimedItems, its add time and
 * expiry (lists; an expiry of 0 is left out, the field being optional). */
static PyObject *reply(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t frame) {
    if (nargs < 2 || nargs == 4 || nargs == 6 || nargs > 7 || !PyBytes_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "write_reply(head, seqid[, result]) or "
                        "write_reply(head, seqid, fids, datas, ids[, added, expiries])");
        return NULL;
    }
    int bad = 0;
    long long seqid = exact_int(args[1], INT32_MIN, INT32_MAX, &bad);
    long long result = nargs == 3 ? exact_int(args[2], INT32_MIN, INT32_MAX, &bad) : 0;
    if (bad) {
        Py_RETURN_NONE;
    }
    Py_ssize_t head_len = PyBytes_GET_SIZE(args[0]);
    if (nargs <= 3) {  /* STOP, or field 0 as an i32 then STOP */
        PyObject *out = framed(head_len + 4 + (nargs == 3 ? 7 : 0) + 1, frame);
        if (out == NULL) {
            return NULL;
        }
        unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out) + frame;
        memcpy(p, PyBytes_AS_STRING(args[0]), (size_t)head_len);
        p = write_be32(p + head_len, (uint32_t)seqid);
        if (nargs == 3) {
            *p++ = T_I32;
            p = write_be16(p, 0);
            p = write_be32(p, (uint32_t)result);
        }
        *p = T_STOP;
        return out;
    }
    PyObject *fids = args[2], *datas = args[3], *ids = args[4];
    Py_ssize_t numbers = nargs == 5 ? 1 : 3;  /* i64 fields after the data */
    if (!PyTuple_CheckExact(fids) || PyTuple_GET_SIZE(fids) != 1 + numbers || !PyList_CheckExact(datas)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t count = PyList_GET_SIZE(datas);
    int one_id = PyLong_CheckExact(ids);
    PyObject *added = nargs == 7 ? list_of(args, 5, count) : NULL;
    PyObject *expiries = nargs == 7 ? list_of(args, 6, count) : NULL;
    if ((!one_id && list_of(args, 4, count) == NULL) || (nargs == 7 && (added == NULL || expiries == NULL))
            || count > INT32_MAX) {
        Py_RETURN_NONE;
    }
    int fid[4];
    for (Py_ssize_t f = 0; f <= numbers; f++) {
        fid[f] = (int)exact_int(PyTuple_GET_ITEM(fids, f), INT16_MIN, INT16_MAX, &bad);
    }
    long long number = one_id ? exact_int(ids, INT64_MIN, INT64_MAX, &bad) : 0;
    /* The size, every value checked on the way: nothing below runs Python code, the lists hold still. */
    Py_ssize_t total = head_len + 4 + 3 + 5 + 1;  /* seqid, field 0 as a list, its header, STOP */
    for (Py_ssize_t i = 0; i < count && !bad; i++) {
        PyObject *data = PyList_GET_ITEM(datas, i);
        if (!PyBytes_CheckExact(data) || PyBytes_GET_SIZE(data) > INT32_MAX) {
            Py_RETURN_NONE;
        }
        if (!one_id) {
            exact_int(PyList_GET_ITEM(ids, i), INT64_MIN, INT64_MAX, &bad);
        }
        Py_ssize_t fields = 3 + 4 + 11 + 1;  /* the binary's header and length, an i64 field, STOP */
        if (nargs == 7) {
            exact_int(PyList_GET_ITEM(added, i), INT64_MIN, INT64_MAX, &bad);
            fields += 11 + (exact_int(PyList_GET_ITEM(expiries, i), INT64_MIN, INT64_MAX, &bad) ? 11 : 0);
        }
        if (total > (frame ? INT32_MAX : PY_SSIZE_T_MAX) - fields - PyBytes_GET_SIZE(data)) {  /* a frame's size: an i32 */
            Py_RETURN_NONE;
        }
        total += fields + PyBytes_GET_SIZE(data);
    }
    if (bad) {
        Py_RETURN_NONE;
    }
    PyObject *out = framed(total, frame);
    if (out == NULL) {
        return NULL;
    }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out) + frame;
    memcpy(p, PyBytes_AS_STRING(args[0]), (size_t)head_len);
    p = write_be32(p + head_len, (uint32_t)seqid);
    *p++ = T_LIST;
    p = write_be16(p, 0);
    *p++ = T_STRUCT;
    p = write_be32(p, (uint32_t)count);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *data = PyList_GET_ITEM(datas, i);
        Py_ssize_t n = PyBytes_GET_SIZE(data);
        long long values[3] = {
            one_id ? number : PyLong_AsLongLong(PyList_GET_ITEM(ids, i)),
            nargs == 7 ? PyLong_AsLongLong(PyList_GET_ITEM(added, i)) : 0,
            nargs == 7 ? PyLong_AsLongLong(PyList_GET_ITEM(expiries, i)) : 0,
        };
        *p++ = T_STRING;
        p = write_be16(p, fid[0]);
        p = write_be32(p, (uint32_t)n);
        memcpy(p, PyBytes_AS_STRING(data), (size_t)n);
        p += n;
        for (Py_ssize_t f = 0; f < numbers; f++) {
            if (f == 2 && values[2] == 0) {
                continue;  /* no expiry */
            }
            *p++ = T_I64;
            p = write_be16(p, fid[f + 1]);
            p = write_be64(p, (uint64_t)values[f]);
        }
        *p++ = T_STOP;
    }
    *p = T_STOP;
    return out;
}

static PyObject *write_reply(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return reply(args, nargs, 0);
}

/* write_framed_reply(...) -> bytes | None: `write_reply`'s reply as one frame of the framed
 * transport, its 4-byte size first, laid out with it (no second string to join them). */
static PyObject *write_framed_reply(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return reply(args, nargs, 4);
}

static PyMethodDef methods[] = {
    {"read_call", (PyCFunction)(void (*)(void))read_call, METH_FASTCALL,
     "A whole call frame's method, type, sequence id, arguments and end, or None where Python must read."},
    {"read_framed_call", (PyCFunction)(void (*)(void))read_framed_call, METH_FASTCALL,
     "The call of the whole frame a receive buffer starts with, and where the frame ends, or None."},
    {"read_binary_list", (PyCFunction)(void (*)(void))read_binary_list, METH_FASTCALL,
     "The list's elements and the position after them, or None where the Python loop must read."},
    {"write_reply", (PyCFunction)(void (*)(void))write_reply, METH_FASTCALL,
     "A binary reply: void, an i32, or a list of Items or TimedItems; None where Python must write."},
    {"write_framed_reply", (PyCFunction)(void (*)(void))write_framed_reply, METH_FASTCALL,
     "write_reply's reply as one frame, its size first; None where Python must write."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kestrel.service.thrift._binary",
    "The binary protocol's hot paths, compiled (see src/kestrel/service/thrift/protocol.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__binary(void) {
    return PyModule_Create(&module);
}
