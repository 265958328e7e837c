/* fdatasync of many descriptors at once, on threads kept for it, without the interpreter lock.
 *
 * What a group-commit round needs (storage/group_commit.py): the file system joins concurrent
 * fsyncs into one commit, but Python threads each take the interpreter lock to start and to report
 * an fsync, and on a busy machine those hand-offs cost more than the fsyncs. Here the lock is
 * released once for the whole round, and the round's descriptors are shared out among threads
 * that wait for the next round once done (the calling thread takes its share too, so a round ends
 * even when no thread can be started). Optional: without a C compiler the round uses Python threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <unistd.h>

#define MAX_WORKERS 64

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work = PTHREAD_COND_INITIALIZER;    /* a round has descriptors to take */
static pthread_cond_t done = PTHREAD_COND_INITIALIZER;    /* the round's last fsync finished */
static pthread_mutex_t one_round = PTHREAD_MUTEX_INITIALIZER; /* one caller at a time */
static int workers;          /* threads started (they never end) */
static const int *round_fds; /* the round in progress: its descriptors, */
static int *round_errors;    /* where each fsync's errno goes (0: success), */
static Py_ssize_t round_size, next_job, unfinished; /* the next to take, and those not finished */

/* Take and run the round's descriptors until none is left; called and returns with `lock` held. */
static void take_jobs(void) {
    while (next_job < round_size) {
        Py_ssize_t i = next_job++;
        int fd = round_fds[i];
        pthread_mutex_unlock(&lock);
        int error = fdatasync(fd) == 0 ? 0 : errno;
        pthread_mutex_lock(&lock);
        round_errors[i] = error;
        if (--unfinished == 0) {
            pthread_cond_signal(&done);
        }
    }
}

static void *serve(void *unused) {
    (void)unused;
    pthread_mutex_lock(&lock);
    for (;;) {
        while (next_job >= round_size) {
            pthread_cond_wait(&work, &lock);
        }
        take_jobs();
    }
    return NULL;
}

/* A forked child has none of its parent's threads; its locks are taken afresh. */
static void forget_workers(void) {
    pthread_mutex_init(&lock, NULL);
    pthread_mutex_init(&one_round, NULL);
    pthread_cond_init(&work, NULL);
    pthread_cond_init(&done, NULL);
    workers = 0;
    round_size = next_job = unfinished = 0;
}

static void run_round(const int *fds, int *errors, Py_ssize_t n) {
    pthread_mutex_lock(&one_round);
    pthread_mutex_lock(&lock);
    round_fds = fds;
    round_errors = errors;
    round_size = n;
    next_job = 0;
    unfinished = n;
    while (workers < MAX_WORKERS && workers < n - 1) { /* the caller is one of the hands */
        pthread_t thread;
        pthread_attr_t attr;
        if (pthread_attr_init(&attr) != 0) {
            break;
        }
        pthread_attr_setstacksize(&attr, 64 * 1024);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int started = pthread_create(&thread, &attr, serve, NULL) == 0;
        pthread_attr_destroy(&attr);
        if (!started) {
            break; /* fewer hands: the round still ends, more slowly */
        }
        workers++;
    }
    for (Py_ssize_t i = 1; i < n && i <= workers; i++) {
        pthread_cond_signal(&work); /* as many hands as the round needs, not every idle thread */
    }
    take_jobs();
    while (unfinished > 0) {
        pthread_cond_wait(&done, &lock);
    }
    round_size = next_job = 0;
    pthread_mutex_unlock(&lock);
    pthread_mutex_unlock(&one_round);
}

static PyObject *fsync_many(PyObject *self, PyObject *fds) {
    PyObject *seq = PySequence_Fast(fds, "fsync_many takes a list of file descriptors");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int *descriptors = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(int));
    int *errors = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(int));
    if (descriptors == NULL || errors == NULL) {
        PyMem_Free(descriptors);
        PyMem_Free(errors);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if ((fd == -1 && PyErr_Occurred()) || fd < 0 || fd > INT_MAX) {
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_ValueError, "not a file descriptor: %ld", fd);
            }
            PyMem_Free(descriptors);
            PyMem_Free(errors);
            Py_DECREF(seq);
            return NULL;
        }
        descriptors[i] = (int)fd;
    }
    Py_DECREF(seq);

    if (n > 0) {
        Py_BEGIN_ALLOW_THREADS
        run_round(descriptors, errors, n);
        Py_END_ALLOW_THREADS
    }

    PyObject *result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *code = PyLong_FromLong(errors[i]);
        if (code == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, code);
    }
    PyMem_Free(descriptors);
    PyMem_Free(errors);
    return result;
}

static PyMethodDef methods[] = {
    {"fsync_many", fsync_many, METH_O,
     "fsync_many(fds) -> list of errno (0 for success): fdatasync every descriptor concurrently."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fsync_many", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fsync_many(void) {
    pthread_atfork(NULL, NULL, forget_workers);
    return PyModule_Create(&module);
}
