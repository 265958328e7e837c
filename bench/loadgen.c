/* loadgen: the load generator of kestrel-py's benchmarks, in C so that the server is what is measured.
 *
 * CLIENTS connections each work on their own queue (PREFIX0, PREFIX1, ...), each in a process of its
 * own, or with -p PROCESSES spread over that many processes, each driving its share on one epoll loop
 * (as memtier and redis-benchmark do), so that 1,000 connections need no more processes, and no more of
 * the machine's scheduling, than 4. There each connection still runs request/response, the same code as
 * a process of its own: a coroutine (ucontext) that yields to the loop where a blocking call would wait.
 * A round puts BATCH items of SIZE bytes and takes them back, request/response; an item is one put
 * plus one get. Every request is timed; the items/s and per-request latency percentiles go to stdout.
 *
 *   thrift     Kestrel's Thrift service, framed binary: put(q, items) then get(q, BATCH); with -a MS
 *              the get opens reads that abort after MS unless confirmed, and a confirm(q, ids) follows
 *   memcache   set q / get q, for Kestrel's memcache port and memcached alike (BATCH > 1: pipelined);
 *              with -o the get is a reliable read, as Kestrel's clients make it: get q/open, then
 *              get q/close confirms it (BATCH 1: a connection holds one open read)
 *   redis      RPUSH q v1..vBATCH / LPOP q [BATCH]; with -P, BATCH single-item commands pipelined
 *   beanstalk  put / reserve-with-timeout 0 / delete on tube q (BATCH > 1: pipelined)
 *
 * With -Q QUEUES the clients share QUEUES queues (PREFIX0 .. PREFIX<QUEUES-1>) instead: with more queues
 * than clients each client's rounds go round its share of them, one queue a round; with fewer, client
 * k works on queue k mod QUEUES; every client then puts the same bytes. With -F FILL (thrift, memcache, redis)
 * each queue first gets FILL items that stay there, so the queues the load visits are not empty. -W
 * skips the warm-up round on each queue (an earlier run made them), so that a run with many queues
 * spends its time on the load alone.
 *
 * Taken items are checked against what was put (length for memcache, whose peer memcached keeps only
 * the last value of a key; bytes and order for the rest). Exit status 0 when every round got back
 * what it put, 1 on any error or lost item. No library beyond libc: cc -O2 -o loadgen loadgen.c
 *
 *   loadgen PROTOCOL PORT [-c CLIENTS] [-p PROCESSES] [-b BATCH] [-s SIZE] [-n ITEMS] [-t SECONDS] [-a MS]
 *           [-o] [-q PREFIX] [-H HOST] [-P] [-j] [-Q QUEUES] [-F FILL] [-W]
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

/* ---- latency histogram: 32 linear sub-buckets per power of two of nanoseconds (~3% resolution) ---- */

#define SUB_BITS 5
#define SUB (1 << SUB_BITS)
#define BUCKETS (SUB * 40)
enum { OP_PUT, OP_GET, OP_ACK, OP_ROUND, OPS };

typedef struct {
    uint64_t count[OPS][BUCKETS];
    uint64_t put, got, wrong;
    double seconds;
    int failed;
    char error[240];
} report_t;

static int bucket_of(uint64_t ns) {
    if (ns < SUB) return (int)ns;
    int top = 63 - __builtin_clzll(ns);          /* ns in [2^top, 2^(top+1)) */
    int shift = top - SUB_BITS;
    int b = (shift + 1) * SUB + (int)((ns >> shift) - SUB);
    return b < BUCKETS ? b : BUCKETS - 1;
}

static double bucket_ns(int b) {                 /* the middle of a bucket's range */
    if (b < SUB) return b;
    int shift = b / SUB - 1;
    uint64_t low = (uint64_t)(SUB + b % SUB) << shift;
    return (double)low + (double)((uint64_t)1 << shift) / 2;
}

/* ---- the process's state, and the connection being served (its fields are swapped in and out) ---- */

static report_t *me;
static int sock = -1;
static char queue[64];
static int batch = 1, size = 128, pipelined, abort_ms, open_reads, queues, fill, warm = 1;
static char **items;
static int clients_total;
static int multiplexed;                          /* this process drives several connections */
static void wait_for(uint32_t events);         /* a multiplexed connection's wait for its socket */
static void *current_connection(void);

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(me->error, sizeof me->error, fmt, ap);
    va_end(ap);
    me->failed = 1;
    _exit(1);
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* Outgoing bytes gather in one buffer and leave with one write per request (or pipelined burst). */
typedef struct { char *p; size_t len, cap; } out_t;
static out_t out;

static void emit(const void *p, size_t n) {
    if (out.len + n > out.cap) {
        out.cap = (out.len + n) * 2;
        out.p = realloc(out.p, out.cap);
        if (!out.p) fail("out of memory");
    }
    memcpy(out.p + out.len, p, n);
    out.len += n;
}

static void emitf(const char *fmt, ...) {
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    emit(tmp, (size_t)n);
}

static void send_out(void) {
    size_t done = 0;
    while (done < out.len) {
        ssize_t k = send(sock, out.p + done, out.len - done, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && errno == EAGAIN && multiplexed) { wait_for(EPOLLOUT); continue; }
        if (k <= 0) fail("send to %s: %s", queue, strerror(errno));
        done += (size_t)k;
    }
    out.len = 0;
}

/* Incoming bytes: a growable window [head, tail) over one buffer. */
typedef struct { char *p; size_t head, tail, cap; } in_t;
static in_t in;

static void receive_more(void) {
    if (in.head == in.tail) in.head = in.tail = 0;
    if (in.tail == in.cap) {
        if (in.head) {
            memmove(in.p, in.p + in.head, in.tail - in.head);
            in.tail -= in.head;
            in.head = 0;
        } else {
            in.cap = in.cap ? in.cap * 2 : 1 << 16;
            in.p = realloc(in.p, in.cap);
            if (!in.p) fail("out of memory");
        }
    }
    ssize_t k;
    for (;;) {
        k = recv(sock, in.p + in.tail, in.cap - in.tail, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && errno == EAGAIN && multiplexed) { wait_for(EPOLLIN); continue; }
        break;
    }
    if (k == 0) fail("the server closed the connection");
    if (k < 0) fail("recv: %s", strerror(errno));
    in.tail += (size_t)k;
}

static char *take(size_t n) {                    /* the next n bytes, valid until the next take */
    while (in.tail - in.head < n) receive_more();
    char *p = in.p + in.head;
    in.head += n;
    return p;
}

static char *take_line(void) {                   /* the next line without its CRLF, NUL-terminated */
    size_t scanned = 0;
    for (;;) {
        char *start = in.p + in.head;
        size_t avail = in.tail - in.head;
        char *lf = avail > scanned ? memchr(start + scanned, '\n', avail - scanned) : NULL;
        if (lf) {
            size_t n = (size_t)(lf - start);
            in.head += n + 1;
            if (n && start[n - 1] == '\r') n--;
            start[n] = 0;
            return start;
        }
        scanned = avail;
        receive_more();
    }
}

static void expect_value(const char *got, size_t n, int index) {
    if (n != (size_t)size) { me->wrong++; return; }
    if (index >= 0 && memcmp(got, items[index], n) != 0) me->wrong++;
}

/* ---- Thrift: Kestrel's service in the strict binary protocol, framed ---- */

enum { T_STOP = 0, T_I32 = 8, T_I64 = 10, T_STRING = 11, T_STRUCT = 12, T_SET = 14, T_LIST = 15 };
static int32_t seqid;

static void be16(uint16_t v) { v = htons(v); emit(&v, 2); }
static void be32(uint32_t v) { v = htonl(v); emit(&v, 4); }
static void be64(uint64_t v) { be32((uint32_t)(v >> 32)); be32((uint32_t)v); }
static void field(uint8_t type, int16_t id) { emit(&type, 1); be16((uint16_t)id); }
static void tbinary(const char *p, size_t n) { be32((uint32_t)n); emit(p, n); }

static void call_begin(const char *method) {
    emit("\0\0\0\0", 4);                          /* the frame length, filled in by call_end */
    be32(0x80010001u);                            /* version 1, message type CALL */
    tbinary(method, strlen(method));
    be32((uint32_t)++seqid);
    field(T_STRING, 1);
    tbinary(queue, strlen(queue));
}

static void call_end(void) {
    emit("", 1);                                  /* T_STOP ends the argument struct */
    uint32_t n = htonl((uint32_t)(out.len - 4));
    memcpy(out.p, &n, 4);
    send_out();
}

/* A reader over one reply frame. */
typedef struct { const unsigned char *p, *end; } frame_t;
static frame_t fr;

static const unsigned char *need(size_t n) {
    if ((size_t)(fr.end - fr.p) < n) fail("thrift reply truncated");
    const unsigned char *p = fr.p;
    fr.p += n;
    return p;
}
static uint8_t r8(void) { return *need(1); }
static uint16_t r16(void) { const unsigned char *p = need(2); return (uint16_t)(p[0] << 8 | p[1]); }
static uint32_t r32(void) { uint32_t v; memcpy(&v, need(4), 4); return ntohl(v); }
static uint64_t r64(void) { uint64_t hi = r32(); return hi << 32 | r32(); }

static void skip_value(uint8_t type) {
    switch (type) {
    case 2: case 3: need(1); break;               /* bool, byte */
    case 4: case T_I64: need(8); break;           /* double, i64 */
    case 6: need(2); break;                       /* i16 */
    case T_I32: need(4); break;
    case T_STRING: need(r32()); break;
    case T_STRUCT:
        for (uint8_t t; (t = r8()) != T_STOP;) { r16(); skip_value(t); }
        break;
    case 13: { uint8_t k = r8(), v = r8(); uint32_t n = r32(); while (n--) { skip_value(k); skip_value(v); } break; }
    case T_SET: case T_LIST: { uint8_t e = r8(); uint32_t n = r32(); while (n--) skip_value(e); break; }
    default: fail("thrift reply has a field of unknown type %d", type);
    }
}

/* Reads the reply to `method` and positions the reader on its success value of `type`. */
static void reply_begin(const char *method, uint8_t type) {
    uint32_t len;
    memcpy(&len, take(4), 4);
    len = ntohl(len);
    fr.p = (const unsigned char *)take(len);
    fr.end = fr.p + len;
    uint32_t version = r32();
    uint32_t name_len = r32();
    const unsigned char *name = need(name_len);
    if ((int32_t)r32() != seqid) fail("thrift %s: reply to another call", method);
    if (name_len != strlen(method) || memcmp(name, method, name_len) != 0)
        fail("thrift %s: reply names another method", method);
    if ((version & 0xff) == 3) {                  /* TApplicationException: 1: message, 2: type */
        for (uint8_t t; (t = r8()) != T_STOP;) {
            if (r16() == 1 && t == T_STRING) {
                uint32_t n = r32();
                fail("thrift %s failed: %.*s", method, (int)n, (const char *)need(n));
            }
            skip_value(t);
        }
        fail("thrift %s failed", method);
    }
    if ((version & 0xffff0000u) != 0x80010000u || (version & 0xff) != 2)
        fail("thrift %s: not a reply (header %08x)", method, version);
    for (uint8_t t; (t = r8()) != T_STOP;) {
        int16_t id = (int16_t)r16();
        if (id == 0 && t == type) return;
        skip_value(t);
    }
    fail("thrift %s: the reply carries no result", method);
}

static int64_t *ids;

static long thrift_round(void) {
    uint64_t t0 = now_ns();
    call_begin("put");
    field(T_LIST, 2);
    emit((char[]){T_STRING}, 1);
    be32((uint32_t)batch);
    for (int i = 0; i < batch; i++) tbinary(items[i], (size_t)size);
    call_end();
    reply_begin("put", T_I32);
    uint32_t accepted = r32();
    uint64_t t1 = now_ns();
    me->count[OP_PUT][bucket_of(t1 - t0)]++;
    me->put += accepted;
    if (accepted != (uint32_t)batch) fail("thrift put: %u of %d items accepted", accepted, batch);

    call_begin("get");
    field(T_I32, 2); be32((uint32_t)batch);
    field(T_I32, 3); be32(0);
    field(T_I32, 4); be32((uint32_t)abort_ms);
    call_end();
    reply_begin("get", T_LIST);
    if (r8() != T_STRUCT) fail("thrift get: the reply is not a list of Item");
    uint32_t n = r32();
    for (uint32_t k = 0; k < n; k++) {
        int64_t id = 0;
        for (uint8_t t; (t = r8()) != T_STOP;) {
            int16_t fid = (int16_t)r16();
            if (fid == 1 && t == T_STRING) {
                uint32_t len = r32();
                expect_value((const char *)need(len), len, k < (uint32_t)batch ? (int)k : -1);
            } else if (fid == 2 && t == T_I64) {
                id = (int64_t)r64();
            } else {
                skip_value(t);
            }
        }
        if (k < (uint32_t)batch) ids[k] = id;
    }
    uint64_t t2 = now_ns();
    me->count[OP_GET][bucket_of(t2 - t1)]++;
    me->got += n;
    if (abort_ms > 0 && n > 0) {
        call_begin("confirm");
        field(T_SET, 2);
        emit((char[]){T_I64}, 1);
        be32(n);
        for (uint32_t k = 0; k < n; k++) be64((uint64_t)ids[k]);
        call_end();
        reply_begin("confirm", T_I32);
        uint32_t confirmed = r32();
        if (confirmed != n) fail("thrift confirm: %u of %u ids were open", confirmed, n);
        me->count[OP_ACK][bucket_of(now_ns() - t2)]++;
    }
    return n;
}

/* ---- memcache (Kestrel's queue dialect and memcached) ---- */

static long memcache_round(void) {
    uint64_t t0 = now_ns();
    for (int i = 0; i < batch; i++) {
        emitf("set %s 0 0 %d\r\n", queue, size);
        emit(items[i], (size_t)size);
        emit("\r\n", 2);
    }
    send_out();
    for (int i = 0; i < batch; i++) {
        char *line = take_line();
        if (strcmp(line, "STORED") != 0) fail("memcache set: %s", line);
        me->put++;
    }
    uint64_t t1 = now_ns();
    me->count[OP_PUT][bucket_of(t1 - t0)]++;
    for (int i = 0; i < batch; i++) emitf(open_reads ? "get %s/open\r\n" : "get %s\r\n", queue);
    send_out();
    long got = 0;
    for (int i = 0; i < batch; i++) {
        char *line = take_line();
        if (strcmp(line, "END") == 0) continue;
        char *last = strrchr(line, ' ');
        if (strncmp(line, "VALUE ", 6) != 0 || !last) fail("memcache get: %s", line);
        size_t n = strtoul(last + 1, NULL, 10);
        expect_value(take(n + 2), n, -1);
        if (strcmp(take_line(), "END") != 0) fail("memcache get: no END after the value");
        got++;
    }
    uint64_t t2 = now_ns();
    me->count[OP_GET][bucket_of(t2 - t1)]++;
    me->got += (uint64_t)got;
    if (open_reads && got > 0) {
        emitf("get %s/close\r\n", queue);
        send_out();
        char *line = take_line();
        if (strcmp(line, "END") != 0) fail("memcache get/close: %s", line);
        me->count[OP_ACK][bucket_of(now_ns() - t2)]++;
    }
    return got;
}

/* ---- Redis (RESP2) ---- */

static void resp_command(int argc, const char **argv, const size_t *lens) {
    emitf("*%d\r\n", argc);
    for (int i = 0; i < argc; i++) {
        emitf("$%zu\r\n", lens[i]);
        emit(argv[i], lens[i]);
        emit("\r\n", 2);
    }
}

static long resp_integer(const char *what) {
    char *line = take_line();
    if (line[0] != ':') fail("redis %s: %s", what, line);
    return strtol(line + 1, NULL, 10);
}

static int resp_bulk(int index) {                /* 1 for a value, 0 for nil */
    char *line = take_line();
    if (line[0] != '$') fail("redis LPOP: %s", line);
    long n = strtol(line + 1, NULL, 10);
    if (n < 0) return 0;
    expect_value(take((size_t)n + 2), (size_t)n, index);
    return 1;
}

static long redis_round(void) {
    size_t qlen = strlen(queue);
    uint64_t t0 = now_ns();
    if (pipelined || batch == 1) {
        for (int i = 0; i < batch; i++)
            resp_command(3, (const char *[]){"RPUSH", queue, items[i]}, (size_t[]){5, qlen, (size_t)size});
        send_out();
        for (int i = 0; i < batch; i++) resp_integer("RPUSH");
    } else {
        emitf("*%d\r\n$5\r\nRPUSH\r\n$%zu\r\n%s\r\n", batch + 2, qlen, queue);
        for (int i = 0; i < batch; i++) {
            emitf("$%d\r\n", size);
            emit(items[i], (size_t)size);
            emit("\r\n", 2);
        }
        send_out();
        resp_integer("RPUSH");
    }
    me->put += (uint64_t)batch;
    uint64_t t1 = now_ns();
    me->count[OP_PUT][bucket_of(t1 - t0)]++;
    long got = 0;
    if (pipelined || batch == 1) {
        for (int i = 0; i < batch; i++)
            resp_command(2, (const char *[]){"LPOP", queue}, (size_t[]){4, qlen});
        send_out();
        for (int i = 0; i < batch; i++) got += resp_bulk(i);
    } else {
        char count[16];
        int clen = snprintf(count, sizeof count, "%d", batch);
        resp_command(3, (const char *[]){"LPOP", queue, count}, (size_t[]){4, qlen, (size_t)clen});
        send_out();
        char *line = take_line();
        if (line[0] != '*') fail("redis LPOP: %s", line);
        long n = strtol(line + 1, NULL, 10);
        for (long i = 0; i < n; i++) got += resp_bulk(i < batch ? (int)i : -1);
    }
    me->count[OP_GET][bucket_of(now_ns() - t1)]++;
    me->got += (uint64_t)got;
    return got;
}

/* ---- beanstalkd ---- */

static unsigned long long *jobs;

static long beanstalk_round(void) {
    uint64_t t0 = now_ns();
    for (int i = 0; i < batch; i++) {
        emitf("put 0 0 60 %d\r\n", size);
        emit(items[i], (size_t)size);
        emit("\r\n", 2);
    }
    send_out();
    for (int i = 0; i < batch; i++) {
        char *line = take_line();
        if (strncmp(line, "INSERTED ", 9) != 0) fail("beanstalk put: %s", line);
        me->put++;
    }
    uint64_t t1 = now_ns();
    me->count[OP_PUT][bucket_of(t1 - t0)]++;
    for (int i = 0; i < batch; i++) emit("reserve-with-timeout 0\r\n", 24);
    send_out();
    int got = 0;
    for (int i = 0; i < batch; i++) {
        char *line = take_line();
        if (strcmp(line, "TIMED_OUT") == 0) continue;
        unsigned long long id;
        size_t n;
        if (sscanf(line, "RESERVED %llu %zu", &id, &n) != 2) fail("beanstalk reserve: %s", line);
        expect_value(take(n + 2), n, got);
        jobs[got++] = id;
    }
    uint64_t t2 = now_ns();
    me->count[OP_GET][bucket_of(t2 - t1)]++;
    for (int i = 0; i < got; i++) emitf("delete %llu\r\n", jobs[i]);
    send_out();
    for (int i = 0; i < got; i++) {
        char *line = take_line();
        if (strcmp(line, "DELETED") != 0) fail("beanstalk delete: %s", line);
    }
    me->count[OP_ACK][bucket_of(now_ns() - t2)]++;
    me->got += (uint64_t)got;
    return got;
}

/* ---- filling a queue: FILL items put and left there (thrift, memcache and redis) ---- */

static void fill_queue(const char *protocol) {
    if (!strcmp(protocol, "thrift")) {            /* one put of FILL items */
        call_begin("put");
        field(T_LIST, 2);
        emit((char[]){T_STRING}, 1);
        be32((uint32_t)fill);
        for (int j = 0; j < fill; j++) tbinary(items[j % batch], (size_t)size);
        call_end();
        reply_begin("put", T_I32);
        if (r32() != (uint32_t)fill) fail("thrift put while filling: not every item accepted");
        return;
    }
    for (int j = 0; j < fill; j++) {
        const char *item = items[j % batch];
        if (!strcmp(protocol, "memcache")) {
            emitf("set %s 0 0 %d\r\n", queue, size);
            emit(item, (size_t)size);
            emit("\r\n", 2);
        } else {
            resp_command(3, (const char *[]){"RPUSH", queue, item}, (size_t[]){5, strlen(queue), (size_t)size});
        }
    }
    send_out();
    for (int j = 0; j < fill; j++) {
        if (!strcmp(protocol, "memcache")) {
            char *line = take_line();
            if (strcmp(line, "STORED") != 0) fail("memcache set while filling: %s", line);
        } else {
            resp_integer("RPUSH");
        }
    }
}

/* ---- one connection: connect, warm up, then rounds until the deadline ---- */

static const char *protocol, *host, *port, *prefix;
static long rounds;
static double seconds_to_run;
static uint64_t start, deadline;                 /* set at the start barrier */
static int epfd = -1;

static void connect_to(void) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res;
    int rc = getaddrinfo(host, port, &hints, &res);
    if (rc) fail("%s:%s: %s", host, port, gai_strerror(rc));
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        sock = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (sock >= 0 && connect(sock, a->ai_addr, a->ai_addrlen) == 0) break;
        if (sock >= 0) close(sock);
        sock = -1;
    }
    freeaddrinfo(res);
    if (sock < 0) fail("connect to %s:%s: %s", host, port, strerror(errno));
    int one = 1;
    setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static long (*round_of(void))(void) {
    return !strcmp(protocol, "thrift") ? thrift_round
         : !strcmp(protocol, "memcache") ? memcache_round
         : !strcmp(protocol, "redis") ? redis_round : beanstalk_round;
}

/* Its queues: first + stride * r for r = 0 .. mine - 1 (one of its own without -Q). */
static int first_queue(int index) { return queues > 0 ? index % queues : index; }
static int stride(void) { return queues > 0 ? clients_total : 1; }
static int queues_of(int index) {
    return queues > index ? (queues - index + clients_total - 1) / clients_total : 1;
}

/* Connects connection `index` and warms it up: its items, its queues made (and filled). */
static void prepare(int index) {
    snprintf(queue, sizeof queue, "%s%d", prefix, first_queue(index));
    unsigned seed = 2654435761u * (unsigned)((queues > 0 ? 0 : index) + 1);
    items = calloc((size_t)batch, sizeof *items);
    ids = calloc((size_t)batch, sizeof *ids);
    jobs = calloc((size_t)batch, sizeof *jobs);
    if (!items || !ids || !jobs) fail("out of memory");
    for (int i = 0; i < batch; i++) {
        items[i] = malloc((size_t)size + 1);
        if (!items[i]) fail("out of memory");
        for (int j = 0; j < size; j++) items[i][j] = (char)('a' + (seed = seed * 1103515245u + 12345u) % 26);
    }
    connect_to();
    if (multiplexed) {
        struct epoll_event ev = {.events = EPOLLIN};
        ev.data.ptr = current_connection();
        if (fcntl(sock, F_SETFL, O_NONBLOCK) || epoll_ctl(epfd, EPOLL_CTL_ADD, sock, &ev))
            fail("epoll: %s", strerror(errno));
    }
    long (*round)(void) = round_of();
    if (round == beanstalk_round) {
        emitf("use %s\r\nwatch %s\r\nignore default\r\n", queue, queue);
        send_out();
        for (int i = 0; i < 3; i++) take_line();
    }
    for (int r = 0; warm && r < queues_of(index); r++) {   /* warm-up: creates the queues, not counted */
        snprintf(queue, sizeof queue, "%s%d", prefix, first_queue(index) + stride() * r);
        round();
        if (fill) fill_queue(protocol);
    }
}

static void run_rounds(int index) {
    long (*round)(void) = round_of();
    int mine = queues_of(index);
    for (long r = 0; rounds <= 0 || r < rounds; r++) {
        if (mine > 1) snprintf(queue, sizeof queue, "%s%ld", prefix, first_queue(index) + stride() * (r % mine));
        uint64_t t = now_ns();
        long got = round();
        uint64_t done = now_ns();
        me->count[OP_ROUND][bucket_of(done - t)]++;
        if (got < batch) fail("%s: a round put %d items and got %ld back", queue, batch, got);
        if (deadline && done >= deadline) break;
    }
}

/* Both barriers: this process is ready (all its connections warm), then every process starts. */
static void barrier(int ready_fd, int start_fd) {
    memset(me->count, 0, sizeof me->count);
    me->put = me->got = me->wrong = 0;
    char c = 'r';
    if (write(ready_fd, &c, 1) != 1) fail("start barrier");
    close(ready_fd);                              /* so that the parent sees every client ready or gone */
    if (read(start_fd, &c, 1) < 0) fail("start barrier");
    start = now_ns();
    deadline = seconds_to_run > 0 ? start + (uint64_t)(seconds_to_run * 1e9) : 0;
}

/* A process with one connection: blocking calls, as a simple client makes them. */
static void client(int index, int ready_fd, int start_fd) {
    prepare(index);
    barrier(ready_fd, start_fd);
    run_rounds(index);
    me->seconds = (double)(now_ns() - start) / 1e9;
    _exit(0);
}

/* ---- a process with many connections: each a coroutine with the code above, switched on epoll ---- */

enum { RUNNING, WAITING, READY, DONE };
#define STACK (256 * 1024)

typedef struct {
    ucontext_t ctx;
    int index, state;
    int sock;                                     /* the connection's globals while another runs */
    char queue[64];
    out_t out;
    in_t in;
    frame_t fr;
    int32_t seqid;
    char **items;
    int64_t *ids;
    unsigned long long *jobs;
} conn_t;

static conn_t *cur;
static ucontext_t loop_ctx;
static int parked[DONE + 1];                      /* connections in each state */

static void *current_connection(void) { return cur; }

static void save(conn_t *c) {
    c->sock = sock; memcpy(c->queue, queue, sizeof queue); c->out = out; c->in = in; c->fr = fr;
    c->seqid = seqid; c->items = items; c->ids = ids; c->jobs = jobs;
}

static void load(conn_t *c) {
    sock = c->sock; memcpy(queue, c->queue, sizeof queue); out = c->out; in = c->in; fr = c->fr;
    seqid = c->seqid; items = c->items; ids = c->ids; jobs = c->jobs;
}

static void park(int state) {                   /* back to the loop until resumed */
    conn_t *c = cur;
    save(c);
    c->state = state;
    parked[state]++;
    swapcontext(&c->ctx, &loop_ctx);
}

static void resume(conn_t *c) {
    parked[c->state]--;
    c->state = RUNNING;
    cur = c;
    load(c);
    swapcontext(&loop_ctx, &c->ctx);
}

static void wait_for(uint32_t events) {
    struct epoll_event ev = {.events = EPOLLIN | events, .data.ptr = cur};
    if (events != EPOLLIN) epoll_ctl(epfd, EPOLL_CTL_MOD, sock, &ev);
    park(WAITING);
    ev.events = EPOLLIN;
    if (events != EPOLLIN) epoll_ctl(epfd, EPOLL_CTL_MOD, sock, &ev);
}

static void connection(void) {
    int index = cur->index;
    prepare(index);
    park(READY);
    run_rounds(index);
    park(DONE);
}

static void serve_until(int state, int count) {  /* resume connections as their sockets wake */
    struct epoll_event evs[64];
    while (parked[state] < count) {
        int n = epoll_wait(epfd, evs, 64, -1);
        if (n < 0 && errno != EINTR) fail("epoll_wait: %s", strerror(errno));
        for (int i = 0; i < n; i++) {
            conn_t *c = evs[i].data.ptr;
            if (c->state == WAITING) resume(c);
        }
    }
}

static void many_clients(int process, int processes, int ready_fd, int start_fd) {
    int count = (clients_total - process + processes - 1) / processes;
    conn_t *conns = calloc((size_t)count, sizeof *conns);
    epfd = epoll_create1(EPOLL_CLOEXEC);
    if (!conns || epfd < 0) fail("setting up %d connections: %s", count, strerror(errno));
    for (int k = 0; k < count; k++) {
        conn_t *c = &conns[k];
        c->index = process + k * processes;
        c->sock = -1;
        char *stack = mmap(NULL, STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (stack == MAP_FAILED || getcontext(&c->ctx)) fail("a coroutine's stack: %s", strerror(errno));
        c->ctx.uc_stack.ss_sp = stack;
        c->ctx.uc_stack.ss_size = STACK;
        c->ctx.uc_link = &loop_ctx;
        makecontext(&c->ctx, connection, 0);
        parked[RUNNING]++;
        resume(c);                                /* connects, then warms up until its first wait */
    }
    serve_until(READY, count);
    barrier(ready_fd, start_fd);
    for (int k = 0; k < count; k++) resume(&conns[k]);
    serve_until(DONE, count);
    me->seconds = (double)(now_ns() - start) / 1e9;
    _exit(0);
}

/* ---- the parent: start, wait, merge, report ---- */

static double percentile(const uint64_t *count, uint64_t total, double p) {
    uint64_t rank = (uint64_t)ceil(p * (double)total), seen = 0;
    if (rank == 0) rank = 1;
    for (int b = 0; b < BUCKETS; b++) {
        seen += count[b];
        if (seen >= rank) return bucket_ns(b) / 1000.0;
    }
    return 0;
}

static void usage(void) {
    fprintf(stderr, "usage: loadgen thrift|memcache|redis|beanstalk PORT [-c CLIENTS] [-p PROCESSES] [-b BATCH] [-s SIZE]\n"
                    "       [-n ITEMS per client] [-t SECONDS] [-a AUTO_ABORT_MS] [-o: memcache open reads]\n"
                    "       [-q PREFIX] [-H HOST] [-P] [-j]\n"
                    "       [-Q QUEUES shared by the clients] [-F FILL items left in each queue] [-W: no warm-up]\n");
    exit(2);
}

int main(int argc, char **argv) {
    if (argc < 3) usage();
    protocol = argv[1], port = argv[2], host = "127.0.0.1", prefix = "loadgen";
    if (strcmp(protocol, "thrift") && strcmp(protocol, "memcache") && strcmp(protocol, "redis") &&
        strcmp(protocol, "beanstalk")) usage();
    int clients = 4, processes = 0, json = 0;
    long per_client = 0;
    double seconds = 0;
    optind = 3;
    for (int o; (o = getopt(argc, argv, "c:p:b:s:n:t:a:oq:H:PjQ:F:W")) != -1;) {
        switch (o) {
        case 'c': clients = atoi(optarg); break;
        case 'p': processes = atoi(optarg); break;
        case 'b': batch = atoi(optarg); break;
        case 's': size = atoi(optarg); break;
        case 'n': per_client = atol(optarg); break;
        case 't': seconds = atof(optarg); break;
        case 'a': abort_ms = atoi(optarg); break;
        case 'o': open_reads = 1; break;
        case 'q': prefix = optarg; break;
        case 'H': host = optarg; break;
        case 'P': pipelined = 1; break;
        case 'j': json = 1; break;
        case 'Q': queues = atoi(optarg); break;
        case 'F': fill = atoi(optarg); break;
        case 'W': warm = 0; break;
        default: usage();
        }
    }
    if (clients < 1 || batch < 1 || size < 1 || (per_client <= 0 && seconds <= 0)) {
        fprintf(stderr, "loadgen: CLIENTS, BATCH and SIZE must be positive, and -n or -t given\n");
        return 2;
    }
    if (open_reads && (strcmp(protocol, "memcache") || batch != 1)) {
        fprintf(stderr, "loadgen: -o is for memcache, one item a round\n");
        return 2;
    }
    if (queues < 0 || fill < 0 || (fill && !strcmp(protocol, "beanstalk")) ||
        (queues && !strcmp(protocol, "beanstalk"))) {
        fprintf(stderr, "loadgen: -Q and -F take a count; -F and -Q are not for beanstalk\n");
        return 2;
    }
    if (processes < 0) {
        fprintf(stderr, "loadgen: PROCESSES must be positive\n");
        return 2;
    }
    if (processes == 0 || processes > clients) processes = clients;
    multiplexed = processes < clients;
    clients_total = clients;
    rounds = per_client > 0 ? (per_client + batch - 1) / batch : 0;
    seconds_to_run = seconds;

    report_t *reports = mmap(NULL, sizeof(report_t) * (size_t)processes, PROT_READ | PROT_WRITE,
                             MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (reports == MAP_FAILED) { perror("mmap"); return 1; }
    int ready[2], start[2];
    if (pipe(ready) || pipe(start)) { perror("pipe"); return 1; }
    for (int k = 0; k < processes; k++) {
        pid_t pid = fork();
        if (pid < 0) { perror("fork"); return 1; }
        if (pid == 0) {
            me = &reports[k];
            close(ready[0]);
            close(start[1]);
            if (multiplexed) many_clients(k, processes, ready[1], start[0]);
            client(k, ready[1], start[0]);
        }
    }
    close(ready[1]);
    close(start[0]);
    int arrived = 0;
    for (char c; arrived < processes && read(ready[0], &c, 1) == 1;) arrived++;
    close(start[1]);                              /* every waiting client's read returns: go */
    while (wait(NULL) > 0) {}

    report_t all = {0};
    double slowest = 0;
    int failures = 0;
    for (int k = 0; k < processes; k++) {
        report_t *r = &reports[k];
        if (r->failed || r->seconds == 0) {
            fprintf(stderr, "loadgen: %s %d: %s\n", multiplexed ? "process" : "client", k, r->failed ? r->error : "did not finish");
            failures++;
            continue;
        }
        all.put += r->put;
        all.got += r->got;
        all.wrong += r->wrong;
        if (r->seconds > slowest) slowest = r->seconds;
        for (int op = 0; op < OPS; op++)
            for (int b = 0; b < BUCKETS; b++) all.count[op][b] += r->count[op][b];
    }
    double rate = slowest > 0 ? (double)all.got / slowest : 0;
    static const char *names[OPS] = {"put", "get", "ack", "round"};
    if (json) {
        printf("{\"protocol\": \"%s\", \"clients\": %d, \"batch\": %d, \"size\": %d, \"put\": %llu, "
               "\"items\": %llu, \"wrong\": %llu, \"failed_clients\": %d, \"seconds\": %.6f, "
               "\"items_per_s\": %.1f, \"latency_us\": {",
               protocol, clients, batch, size, (unsigned long long)all.put, (unsigned long long)all.got,
               (unsigned long long)all.wrong, failures, slowest, rate);
    } else {
        printf("%s  %d clients, batch %d, %d B: %llu items in %.3f s = %.0f items/s (%llu wrong, %d clients failed)\n",
               protocol, clients, batch, size, (unsigned long long)all.got, slowest, rate,
               (unsigned long long)all.wrong, failures);
        printf("  %-6s %10s %9s %9s %9s %9s %9s   (microseconds per request)\n",
               "", "requests", "p50", "p90", "p99", "p99.9", "max");
    }
    int first = 1;
    for (int op = 0; op < OPS; op++) {
        uint64_t total = 0;
        int top = 0;
        for (int b = 0; b < BUCKETS; b++) if (all.count[op][b]) { total += all.count[op][b]; top = b; }
        if (!total) continue;
        double p50 = percentile(all.count[op], total, .5), p90 = percentile(all.count[op], total, .9),
               p99 = percentile(all.count[op], total, .99), p999 = percentile(all.count[op], total, .999),
               max = bucket_ns(top) / 1000.0;
        if (json)
            printf("%s\"%s\": {\"requests\": %llu, \"p50\": %.1f, \"p90\": %.1f, \"p99\": %.1f, "
                   "\"p99.9\": %.1f, \"max\": %.1f}", first ? "" : ", ", names[op],
                   (unsigned long long)total, p50, p90, p99, p999, max);
        else
            printf("  %-6s %10llu %9.1f %9.1f %9.1f %9.1f %9.1f\n", names[op], (unsigned long long)total,
                   p50, p90, p99, p999, max);
        first = 0;
    }
    if (json) printf("}}\n");
    return failures || all.wrong || all.got != all.put ? 1 : 0;
}
