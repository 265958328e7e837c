/* fdatasync (or syncfs) of many descriptors at once, on threads kept for it, with no Python thread
 * involved.
 *
 * What a group-commit round needs (src/kestrel/storage/fsync/group_commit.py): the file system joins concurrent
 * fsyncs into one commit, but Python threads each take the interpreter lock to start and to report
 * an fsync, and on a busy machine those hand-offs cost more than the fsyncs. Here `start` shares a
 * round's descriptors out among C threads and returns at once; the thread that finishes the
 * round's last fsync adds 1 to an eventfd that the event loop watches, and `finish` then collects
 * the results. The interpreter lock is never taken by these threads. One round at a time.
 * A round may instead syncfs each descriptor's file system (KESTREL_FSYNC=syncfs, src/kestrel/storage/fsync/syncfs.py).
 *
 * On Linux a round runs on one CPU: `start` binds the calling thread (the event loop) and the
 * threads to the CPU it runs on, or to the one `prefer` named (the CPU that takes the disk's
 * completions: src/kestrel/storage/fsync/completion_cpu.py), and `finish` gives the loop back the
 * CPUs it had. A wake-up across CPUs (the loop waking a thread, the thread waking the loop, the
 * disk's interrupt waking the thread) cost 28-37 µs each on a virtual machine, against a few on one
 * CPU; between rounds the scheduler moves the loop as it likes (bound for good, it could not move
 * it off a CPU something else took over). bench/README.md, "The event loop and its fsync threads on
 * one CPU", has the figures.
 * Optional: without a C compiler the rounds use Python threads.
 */
#define _GNU_SOURCE /* sched_getcpu, sched_setaffinity, pthread_setaffinity_np, pthread_setname_np */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_WORKERS 64

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work = PTHREAD_COND_INITIALIZER; /* a round has descriptors to take */
static int workers;       /* threads started (they never end) */
static pthread_t worker_threads[MAX_WORKERS];
#ifdef __linux__
static int workers_cpu = -1; /* the CPU the threads are bound to (-1: none, or not all of them) */
static cpu_set_t loop_cpus;  /* the CPUs the loop may run on, while a round binds it to one */
static pthread_t loop_thread; /* the thread a round bound (`start`'s caller), */
static int loop_bound;        /* while it is bound (`finish` lets it go) */
static int preferred_cpu = -1; /* the CPU rounds run on where the loop may (`prefer`); -1: the loop's */
#endif
static int busy;          /* a round was started and not yet finished */
static int *round_fds;    /* the round in progress: its descriptors, */
static int *round_errors; /* where each fsync's errno goes (0: success), */
static int round_notify;  /* the eventfd told when the last fsync is done, */
static int round_syncfs;  /* whether it syncs whole file systems, */
static Py_ssize_t round_size, next_job, unfinished; /* the next to take, and those not finished */

/* Tell the event loop that the round is over: add 1 to its eventfd. */
static void notify(int fd) {
    uint64_t one = 1;
    while (write(fd, &one, sizeof one) < 0 && errno == EINTR) {
    }
}

/* 0, or the errno of the fdatasync of `fd` (or of the syncfs of its file system). */
static int sync_one(int fd, int whole_file_system) {
#ifdef __linux__
    int failed = whole_file_system ? syncfs(fd) != 0 : fdatasync(fd) != 0;
#else
    int failed = whole_file_system ? (errno = ENOSYS, 1) : fdatasync(fd) != 0;
#endif
    return failed ? errno : 0;
}

/* Take and run the round's descriptors until none is left; called and returns with `lock` held.
 * The eventfd is written with `lock` released: a thread preempted while holding it would stall the
 * event loop's next `finish` or `start` until it ran again (on a busy machine, hundreds of µs). */
static void take_jobs(void) {
    while (next_job < round_size) {
        Py_ssize_t i = next_job++;
        int fd = round_fds[i];
        pthread_mutex_unlock(&lock);
        int error = sync_one(fd, round_syncfs);
        pthread_mutex_lock(&lock);
        round_errors[i] = error;
        if (--unfinished == 0) {
            int notify_fd = round_notify;
            pthread_mutex_unlock(&lock);
            notify(notify_fd); /* the round is over: `finish` may free it from here on */
            pthread_mutex_lock(&lock);
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

#ifdef __linux__
/* Bind the round to one CPU: the one `prefer` named, where the loop (the caller, with `lock` held)
 * may run there, else the one it runs on; the threads, when that CPU changed since the last round,
 * and the loop until `finish`. Where it cannot (the CPU not told, or not allowed), the round runs
 * where the scheduler puts it. */
static void bind_round(void) {
    if (sched_getaffinity(0, sizeof loop_cpus, &loop_cpus) != 0) {
        return;
    }
    int cpu = preferred_cpu >= 0 && CPU_ISSET(preferred_cpu, &loop_cpus) ? preferred_cpu : sched_getcpu();
    if (cpu < 0 || cpu >= CPU_SETSIZE) {
        return;
    }
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    if (cpu != workers_cpu) {
        workers_cpu = -1;
        for (int i = 0; i < workers; i++) {
            if (pthread_setaffinity_np(worker_threads[i], sizeof one, &one) != 0) {
                return;
            }
        }
        workers_cpu = cpu;
    }
    loop_thread = pthread_self();
    loop_bound = sched_setaffinity(0, sizeof one, &one) == 0;
}

/* Give the loop back the CPUs it had before the round; all of them where that set is no longer
 * allowed (a cgroup's CPUs changed meanwhile), rather than leave it bound. Only from the thread the
 * round bound (`finish` is called on the loop that called `start`; a child forked by another
 * thread was never bound). */
static void free_loop(void) {
    if (!loop_bound) {
        return;
    }
    loop_bound = 0;
    if (!pthread_equal(pthread_self(), loop_thread)) {
        return;
    }
    if (sched_setaffinity(0, sizeof loop_cpus, &loop_cpus) != 0) {
        cpu_set_t every;
        memset(&every, 0xff, sizeof every);
        sched_setaffinity(0, sizeof every, &every);
    }
}
#endif

/* A forked child has none of its parent's threads, nor its round; its lock is taken afresh, and a
 * child forked while a round bound its thread runs where that thread could before the round. */
static void forget_workers(void) {
    pthread_mutex_init(&lock, NULL);
    pthread_cond_init(&work, NULL);
#ifdef __linux__
    free_loop();
    workers_cpu = -1;
#endif
    workers = 0;
    busy = 0;
    round_fds = round_errors = NULL; /* the parent's, still in use there: not freed here */
    round_size = next_job = unfinished = 0;
}

/* Start enough threads for `n` descriptors (up to MAX_WORKERS); how many there are. */
static int hire(Py_ssize_t n) {
    while (workers < MAX_WORKERS && workers < n) {
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
#ifdef __linux__
        pthread_setname_np(thread, "kestrel-fsync"); /* as `top -H` and /proc show it */
        workers_cpu = -1; /* a new thread runs anywhere: the next round binds them all */
#endif
        worker_threads[workers++] = thread;
    }
    return workers;
}

static PyObject *start(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *fds;
    int notify_fd;
    int whole_file_system = 0;
    if (!PyArg_ParseTuple(args, "Oi|p:start", &fds, &notify_fd, &whole_file_system)) {
        return NULL;
    }
    if (busy) {
        PyErr_SetString(PyExc_RuntimeError, "a round is already in progress: finish() it first");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(fds, "start takes a list of file descriptors");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int *descriptors = calloc(n > 0 ? (size_t)n : 1, sizeof(int));
    int *errors = calloc(n > 0 ? (size_t)n : 1, sizeof(int));
    if (descriptors == NULL || errors == NULL) {
        free(descriptors);
        free(errors);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if ((fd == -1 && PyErr_Occurred()) || fd < 0 || fd > INT_MAX) {
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_ValueError, "not a file descriptor: %ld", fd);
            }
            free(descriptors);
            free(errors);
            Py_DECREF(seq);
            return NULL;
        }
        descriptors[i] = (int)fd;
    }
    Py_DECREF(seq);

    pthread_mutex_lock(&lock);
    busy = 1;
    round_fds = descriptors;
    round_errors = errors;
    round_notify = notify_fd;
    round_syncfs = whole_file_system;
    round_size = n;
    next_job = 0;
    unfinished = n;
    Py_ssize_t hands = 0;
    if (n == 0) {
        pthread_mutex_unlock(&lock);
        notify(notify_fd);
        Py_RETURN_NONE;
    } else if (hire(n) == 0) {
        take_jobs(); /* no thread could be started: this one does the round, and notifies */
    } else {
        hands = n < workers ? n : workers; /* as many as the round needs, not every idle thread */
#ifdef __linux__
        bind_round();
#endif
    }
    pthread_mutex_unlock(&lock);
    for (Py_ssize_t i = 0; i < hands; i++) {
        pthread_cond_signal(&work); /* after the unlock: a thread woken takes the lock at once */
    }
    Py_RETURN_NONE;
}

static PyObject *finish(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    pthread_mutex_lock(&lock);
    if (!busy || unfinished > 0) {
        pthread_mutex_unlock(&lock);
        PyErr_SetString(PyExc_RuntimeError, busy ? "the round is not over: wait for its eventfd"
                                                 : "no round was started");
        return NULL;
    }
    Py_ssize_t n = round_size;
    int *errors = round_errors;
    free(round_fds);
    round_fds = round_errors = NULL;
    round_size = next_job = 0;
    busy = 0;
#ifdef __linux__
    free_loop();
#endif
    pthread_mutex_unlock(&lock);

    PyObject *result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *code = PyLong_FromLong(errors[i]);
        if (code == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, code);
    }
    free(errors);
    return result;
}

static PyObject *prefer(PyObject *self, PyObject *args) {
    (void)self;
    int cpu;
    if (!PyArg_ParseTuple(args, "i:prefer", &cpu)) {
        return NULL;
    }
#ifdef __linux__
    if (cpu < -1 || cpu >= CPU_SETSIZE) {
        PyErr_Format(PyExc_ValueError, "not a CPU: %d", cpu);
        return NULL;
    }
    pthread_mutex_lock(&lock);
    preferred_cpu = cpu;
    pthread_mutex_unlock(&lock);
#endif
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"start", start, METH_VARARGS,
     "start(fds, eventfd, syncfs=False): fdatasync every descriptor (or syncfs its file system) "
     "concurrently on C threads; the eventfd gets 1 when all are done."},
    {"finish", finish, METH_NOARGS,
     "finish() -> list of errno (0 for success), one per descriptor of the round that is over."},
    {"prefer", prefer, METH_VARARGS,
     "prefer(cpu): run the rounds on `cpu` wherever the calling thread may run there (-1: on the CPU "
     "the caller runs on, the default)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kestrel.storage.fsync._fsync_many", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fsync_many(void) {
    pthread_atfork(NULL, NULL, forget_workers);
    return PyModule_Create(&module);
}
