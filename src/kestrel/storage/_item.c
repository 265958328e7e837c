/* The compiled twin of `storage.item.QItemPython`: one queue item in memory.
 *
 * A batch put makes one item per element and start-up replay one per record; made by the Python
 * class's `__init__`, that is a fifth of a batch round's Python time. This type has the same five
 * attributes, constructor, equality, repr and (absent) hash, and is made without running any
 * Python code. Its fields hold ints and bytes, which cannot refer back to an item, so it takes no
 * part in the cyclic garbage collector. tests/storage/test_item.py runs the same checks on both classes.
 * Beside it, functions over a batch of items, each with a Python twin in storage.item: a batch put's
 * items made in one call (`new_items`), a get's taken from the queue's head in one (`take_items`).
 * Optional: without a C compiler the build goes on and storage.item uses the Python class.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <limits.h>

typedef struct {
    PyObject_HEAD
    PyObject *add_time;
    PyObject *expiry;
    PyObject *data;
    PyObject *xid;
    PyObject *errors;
} QItem;

static PyObject *zero;

static PyTypeObject QItemType;

/* Items freed, kept for the next ones made (the type cannot be subclassed: each is a QItem). A get
 * frees its batch and the next put makes as many again: reusing them saves the allocator's work
 * both ways, about 150 instructions an item (callgrind, a Thrift put(100) + get(100) round). At
 * most `FREE_ITEMS` are kept (56 KB); beyond, a freed item goes back to the allocator. */
#define FREE_ITEMS 1024
static QItem *free_items[FREE_ITEMS];
static int free_count;

static PyObject *make(PyTypeObject *type, PyObject *add_time, PyObject *expiry, PyObject *data,
                      PyObject *xid, PyObject *errors) {
    QItem *self;
    if (type == &QItemType && free_count > 0) {
        self = free_items[--free_count];
        PyObject_Init((PyObject *)self, type);
    } else {
        self = (QItem *)type->tp_alloc(type, 0);
        if (self == NULL) {
            return NULL;
        }
    }
    self->add_time = Py_NewRef(add_time);
    self->expiry = Py_NewRef(expiry);
    self->data = Py_NewRef(data);
    self->xid = Py_NewRef(xid);
    self->errors = Py_NewRef(errors);
    return (PyObject *)self;
}

static PyObject *qitem_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"add_time", "expiry", "data", "xid", "errors", NULL};
    PyObject *add_time, *expiry, *data, *xid = zero, *errors = zero;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|OO:QItem", names, &add_time, &expiry, &data, &xid,
                                     &errors)) {
        return NULL;
    }
    return make(type, add_time, expiry, data, xid, errors);
}

/* The common call, positional arguments only, without building an argument tuple. */
static PyObject *qitem_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL || nargs < 3 || nargs > 5) {
        PyObject *tuple = PyTuple_New(nargs);
        if (tuple == NULL) {
            return NULL;
        }
        for (Py_ssize_t i = 0; i < nargs; i++) {
            PyTuple_SET_ITEM(tuple, i, Py_NewRef(args[i]));
        }
        PyObject *kwargs = NULL;
        if (kwnames != NULL) {
            kwargs = PyDict_New();
            for (Py_ssize_t i = 0; kwargs != NULL && i < PyTuple_GET_SIZE(kwnames); i++) {
                if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) {
                    Py_CLEAR(kwargs);
                }
            }
            if (kwargs == NULL) {
                Py_DECREF(tuple);
                return NULL;
            }
        }
        PyObject *item = qitem_new((PyTypeObject *)type, tuple, kwargs);
        Py_DECREF(tuple);
        Py_XDECREF(kwargs);
        return item;
    }
    return make((PyTypeObject *)type, args[0], args[1], args[2], nargs > 3 ? args[3] : zero,
                nargs > 4 ? args[4] : zero);
}

static void qitem_dealloc(QItem *self) {
    Py_XDECREF(self->add_time);
    Py_XDECREF(self->expiry);
    Py_XDECREF(self->data);
    Py_XDECREF(self->xid);
    Py_XDECREF(self->errors);
    if (Py_TYPE(self) == &QItemType && free_count < FREE_ITEMS) {
        free_items[free_count++] = self;
        return;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *qitem_repr(QItem *self) {
    return PyUnicode_FromFormat("QItem(add_time=%R, expiry=%R, data=%R, xid=%R)", self->add_time, self->expiry,
                                self->data, self->xid);
}

/* Equal when added at the same time with the same expiry and data, as the Python class says. */
static PyObject *qitem_richcompare(PyObject *a, PyObject *b, int op) {
    if ((op != Py_EQ && op != Py_NE) || !PyObject_TypeCheck(b, Py_TYPE(a))) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    QItem *x = (QItem *)a, *y = (QItem *)b;
    PyObject *fields[3][2] = {{x->add_time, y->add_time}, {x->expiry, y->expiry}, {x->data, y->data}};
    for (int i = 0; i < 3; i++) {
        if (fields[i][0] == NULL || fields[i][1] == NULL) {
            PyErr_SetString(PyExc_AttributeError, "QItem field deleted");
            return NULL;
        }
        int same = PyObject_RichCompareBool(fields[i][0], fields[i][1], Py_EQ);
        if (same < 0) {
            return NULL;
        }
        if (!same) {
            return PyBool_FromLong(op == Py_NE);
        }
    }
    return PyBool_FromLong(op == Py_EQ);
}

static PyMemberDef members[] = {
    {"add_time", T_OBJECT_EX, offsetof(QItem, add_time), 0, "when it was added (ms since the epoch)"},
    {"expiry", T_OBJECT_EX, offsetof(QItem, expiry), 0, "when it expires (ms since the epoch, 0 = never)"},
    {"data", T_OBJECT_EX, offsetof(QItem, data), 0, "its bytes"},
    {"xid", T_OBJECT_EX, offsetof(QItem, xid), 0, "its open read's id, or 0"},
    {"errors", T_OBJECT_EX, offsetof(QItem, errors), 0, "how many aborts it has been through"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject QItemType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kestrel.storage._item.QItem",
    .tp_basicsize = sizeof(QItem),
    .tp_dealloc = (destructor)qitem_dealloc,
    .tp_repr = (reprfunc)qitem_repr,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One queue item: its data, when it was added and when it expires; see src/kestrel/storage/item.py.",
    .tp_richcompare = qitem_richcompare,
    .tp_members = members,
    .tp_new = qitem_new,
    .tp_vectorcall = qitem_vectorcall,
};

/* The length of one item's data, or -1 with an exception set: bytes directly, anything else through
   its length, which may run Python code (the object is held meanwhile). */
static Py_ssize_t data_length(PyObject *data) {
    if (PyBytes_CheckExact(data)) {
        return PyBytes_GET_SIZE(data);
    }
    Py_INCREF(data);
    Py_ssize_t size = PyObject_Length(data);
    Py_DECREF(data);
    return size;
}

/* data_sizes(datas): (total bytes, largest) of a batch's data, in one pass (src/kestrel/storage/item.py). */
static PyObject *data_sizes(PyObject *module, PyObject *datas) {
    PyObject *seq = PySequence_Fast(datas, "data_sizes takes a sequence of bytes");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t total = 0, largest = 0;
    /* The length is read again each time round: `len` of something other than bytes runs Python. */
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        Py_ssize_t size = data_length(PySequence_Fast_GET_ITEM(seq, i));
        if (size < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        total += size;
        if (size > largest) {
            largest = size;
        }
    }
    Py_DECREF(seq);
    /* the tuple made directly: Py_BuildValue parses its format at every call (two a put) */
    PyObject *total_obj = PyLong_FromSsize_t(total);
    PyObject *largest_obj = total_obj == NULL ? NULL : PyLong_FromSsize_t(largest);
    PyObject *result = largest_obj == NULL ? NULL : PyTuple_Pack(2, total_obj, largest_obj);
    Py_XDECREF(total_obj);
    Py_XDECREF(largest_obj);
    return result;
}

/* One field of an item, this type's directly, another object's by name (a new reference). */
static PyObject *field(PyObject *item, size_t offset, const char *name) {
    if (!Py_IS_TYPE(item, &QItemType)) {
        return PyObject_GetAttrString(item, name);
    }
    PyObject *value = *(PyObject **)((char *)item + offset);
    if (value == NULL) {  /* deleted, as a member of this type can be */
        PyErr_Format(PyExc_AttributeError, "'QItem' object has no attribute '%s'", name);
        return NULL;
    }
    return Py_NewRef(value);
}

/* plain_size(items): the bytes of data of items none of which can expire, else -1 (src/kestrel/storage/item.py). */
static PyObject *plain_size(PyObject *module, PyObject *items) {
    PyObject *seq = PySequence_Fast(items, "plain_size takes a sequence of items");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {  /* see data_sizes */
        QItem *plain = (QItem *)PySequence_Fast_GET_ITEM(seq, i);
        if (Py_IS_TYPE(plain, &QItemType) && plain->expiry == zero && plain->data != NULL
                && PyBytes_CheckExact(plain->data)) {
            total += PyBytes_GET_SIZE(plain->data);  /* the usual item, read in place: no call, nothing held */
            continue;
        }
        PyObject *item = Py_NewRef(PySequence_Fast_GET_ITEM(seq, i));
        PyObject *expiry = field(item, offsetof(QItem, expiry), "expiry");
        int expires = expiry == NULL ? -1 : PyObject_IsTrue(expiry);
        Py_XDECREF(expiry);
        if (expires != 0) {
            Py_DECREF(item);
            Py_DECREF(seq);
            return expires < 0 ? NULL : PyLong_FromLong(-1);
        }
        PyObject *data = field(item, offsetof(QItem, data), "data");
        Py_DECREF(item);
        Py_ssize_t size = data == NULL ? -1 : data_length(data);
        Py_XDECREF(data);
        if (size < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        total += size;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(total);
}

/* item_data(items): [item.data, ...], the data of a get's items for the reply's encoder: a list of
   references, where (data, id) pairs would be an object made and freed for each item. */
static PyObject *item_data(PyObject *module, PyObject *items) {
    if (!PyList_CheckExact(items)) {
        PyErr_SetString(PyExc_TypeError, "item_data takes a list of items");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(items);
    PyObject *datas = PyList_New(n);
    if (datas == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {  /* read again by index each time round: see data_with_ids */
        if (i >= PyList_GET_SIZE(items)) {
            PyErr_SetString(PyExc_RuntimeError, "the items changed size while being read");
            Py_DECREF(datas);
            return NULL;
        }
        PyObject *item = Py_NewRef(PyList_GET_ITEM(items, i));
        PyObject *data = field(item, offsetof(QItem, data), "data");
        Py_DECREF(item);
        if (data == NULL) {
            Py_DECREF(datas);
            return NULL;
        }
        PyList_SET_ITEM(datas, i, data);
    }
    return datas;
}

/* data_with_ids(items, ids): [(item.data, id), ...], `ids` an int for every item or a list, one each. */
static PyObject *data_with_ids(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "data_with_ids takes items and ids");
        return NULL;
    }
    PyObject *items = args[0], *ids = args[1];
    if (!PyList_CheckExact(items) || !(PyLong_CheckExact(ids) || PyList_CheckExact(ids))) {
        PyErr_SetString(PyExc_TypeError, "data_with_ids takes a list of items and an int or a list of ids");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(items);
    if (PyList_CheckExact(ids) && PyList_GET_SIZE(ids) != n) {
        PyErr_Format(PyExc_ValueError, "%zd items but %zd ids", n, PyList_GET_SIZE(ids));
        return NULL;
    }
    PyObject *pairs = PyList_New(n);
    if (pairs == NULL) {
        return NULL;
    }
    /* Filled in place: nothing here runs Python code for an item of this type, and a list of other
       objects (whose attribute lookup might) is read again by index each time, its length checked. */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= PyList_GET_SIZE(items) || (PyList_CheckExact(ids) && i >= PyList_GET_SIZE(ids))) {
            PyErr_SetString(PyExc_RuntimeError, "the items changed size while being read");
            Py_DECREF(pairs);
            return NULL;
        }
        PyObject *item = Py_NewRef(PyList_GET_ITEM(items, i));
        PyObject *data = field(item, offsetof(QItem, data), "data");
        Py_DECREF(item);
        if (data == NULL) {
            Py_DECREF(pairs);
            return NULL;
        }
        PyObject *id = PyLong_CheckExact(ids) ? ids : PyList_GET_ITEM(ids, i);
        PyObject *pair = PyTuple_Pack(2, data, id);
        Py_DECREF(data);
        if (pair == NULL) {
            Py_DECREF(pairs);
            return NULL;
        }
        PyList_SET_ITEM(pairs, i, pair);
    }
    return pairs;
}

/* new_items(add_time, expiry, datas, first_id): [QItem(add_time, expiry, data, xid), ...], one for
   each of `datas`, their xids counting up from `first_id` (0: each xid 0). A batch put's items made
   in one step, with no call per item (src/kestrel/storage/item.py, `new_items_python`). */
static PyObject *new_items(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "new_items takes add_time, expiry, datas and first_id");
        return NULL;
    }
    PyObject *add_time = args[0], *expiry = args[1], *first = args[3];
    if (!PyLong_CheckExact(first)) {
        PyErr_SetString(PyExc_TypeError, "new_items takes an int first_id");
        return NULL;
    }
    int overflow = 0;
    long long first_id = PyLong_AsLongLongAndOverflow(first, &overflow);
    if (first_id == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[2], "new_items takes a sequence of data");
    if (seq == NULL) {
        return NULL;
    }
    /* Nothing below runs Python code, so the sequence cannot change while it is read. */
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *items = PyList_New(n);
    if (items == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    int counted = overflow == 0 && first_id != 0;
    int small = counted && first_id >= 0 && first_id <= LLONG_MAX - n;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *xid;
        if (overflow == 0 && first_id == 0) {
            xid = Py_NewRef(zero);
        } else if (small) {
            xid = PyLong_FromLongLong(first_id + i);
        } else {  /* ids past a long long (or below zero): as Python counts them */
            PyObject *step = PyLong_FromSsize_t(i);
            xid = step == NULL ? NULL : PyNumber_Add(first, step);
            Py_XDECREF(step);
        }
        PyObject *item = xid == NULL ? NULL
                         : make(&QItemType, add_time, expiry, PySequence_Fast_GET_ITEM(seq, i), xid, zero);
        Py_XDECREF(xid);
        if (item == NULL) {
            Py_DECREF(items);
            Py_DECREF(seq);
            return NULL;
        }
        PyList_SET_ITEM(items, i, item);
    }
    Py_DECREF(seq);
    return items;
}

/* collections.deque, and its methods a take calls (looked up once, at import). */
static PyObject *deque_type, *deque_popleft, *deque_clear;

/* Up to this many items are read from the deque by position (from its first block, so each read is
 * a step or two), which costs a get of one item about 700 instructions less than copying the whole
 * deque into a list (`PySequence_List`, its iterator and length hint) or iterating it. */
#define BY_INDEX 8

/* take_items(mem, count): up to `count` items from the head of the deque `mem` and their bytes of
   data, taken in one step when none of them can expire; else ([], -1) with `mem` as it was, for the
   caller to take them one by one (src/kestrel/storage/item.py, `take_items_python`). */
static PyObject *take_items(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !Py_IS_TYPE(args[0], (PyTypeObject *)deque_type) || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "take_items takes a deque and an int");
        return NULL;
    }
    PyObject *mem = args[0];
    Py_ssize_t count = PyNumber_AsSsize_t(args[1], NULL);  /* past a Py_ssize_t: clipped, as min() would */
    if (count == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t length = PyObject_Length(mem);
    if (length < 0) {
        return NULL;
    }
    Py_ssize_t n = count < 0 ? 0 : (count < length ? count : length);
    PyObject *taken;
    if (n <= BY_INDEX) {  /* a get of one item, the usual one: no list copy of the deque, no iterator */
        taken = PyList_New(n);
        for (Py_ssize_t i = 0; taken != NULL && i < n; i++) {
            PyObject *item = PySequence_GetItem(mem, i);
            if (item == NULL) {
                Py_CLEAR(taken);
                break;
            }
            PyList_SET_ITEM(taken, i, item);
        }
    } else if (n == length) {
        taken = PySequence_List(mem);
    } else {
        taken = PyList_New(n);
        PyObject *it = taken == NULL ? NULL : PyObject_GetIter(mem);
        for (Py_ssize_t i = 0; it != NULL && i < n; i++) {
            PyObject *item = PyIter_Next(it);
            if (item == NULL) {
                Py_CLEAR(it);
                break;
            }
            PyList_SET_ITEM(taken, i, item);
        }
        if (it == NULL) {
            if (!PyErr_Occurred() && taken != NULL) {
                PyErr_SetString(PyExc_RuntimeError, "the queue changed size while being read");
            }
            Py_XDECREF(taken);
            return NULL;
        }
        Py_DECREF(it);
    }
    if (taken == NULL) {
        return NULL;
    }
    PyObject *size = plain_size(module, taken);  /* runs Python code only for items of another type */
    if (size == NULL || PyObject_Length(mem) != length) {
        if (size != NULL) {
            PyErr_SetString(PyExc_RuntimeError, "the queue changed size while being read");
        }
        Py_XDECREF(size);
        Py_DECREF(taken);
        return NULL;
    }
    if (PyLong_AsSsize_t(size) < 0) {
        Py_DECREF(taken);
        return Py_BuildValue("([]N)", size);
    }
    if (n == length && n > 0) {
        PyObject *none = PyObject_CallOneArg(deque_clear, mem);
        if (none == NULL) {
            Py_DECREF(size);
            Py_DECREF(taken);
            return NULL;
        }
        Py_DECREF(none);
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {  /* popleft takes what was read: nothing ran between */
            PyObject *item = PyObject_CallOneArg(deque_popleft, mem);
            if (item == NULL) {
                Py_DECREF(size);
                Py_DECREF(taken);
                return NULL;
            }
            Py_DECREF(item);
        }
    }
    PyObject *result = PyTuple_Pack(2, taken, size);  /* as data_sizes makes its tuple */
    Py_DECREF(taken);
    Py_DECREF(size);
    return result;
}

static PyMethodDef functions[] = {
    {"data_with_ids", (PyCFunction)(void (*)(void))data_with_ids, METH_FASTCALL,
     "[(item.data, id), ...]: ids an int for every item or a list, one each."},
    {"data_sizes", data_sizes, METH_O, "(total bytes, largest) of a batch's data."},
    {"item_data", item_data, METH_O, "[item.data, ...] of a list of items."},
    {"plain_size", plain_size, METH_O, "The bytes of data of items none of which can expire, else -1."},
    {"new_items", (PyCFunction)(void (*)(void))new_items, METH_FASTCALL,
     "A batch put's items, one for each data, xids counting up from first_id (0: each 0)."},
    {"take_items", (PyCFunction)(void (*)(void))take_items, METH_FASTCALL,
     "Up to count items from the head of a deque and their bytes, when none can expire; else ([], -1)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kestrel.storage._item", "The queue item, compiled (see src/kestrel/storage/item.py).", -1, functions,
};

PyMODINIT_FUNC PyInit__item(void) {
    zero = PyLong_FromLong(0);
    if (zero == NULL || PyType_Ready(&QItemType) < 0) {
        return NULL;
    }
    PyObject *collections = PyImport_ImportModule("collections");
    if (collections == NULL) {
        return NULL;
    }
    deque_type = PyObject_GetAttrString(collections, "deque");
    Py_DECREF(collections);
    if (deque_type == NULL || !PyType_Check(deque_type)
        || (deque_popleft = PyObject_GetAttrString(deque_type, "popleft")) == NULL
        || (deque_clear = PyObject_GetAttrString(deque_type, "clear")) == NULL) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "QItem", (PyObject *)&QItemType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
