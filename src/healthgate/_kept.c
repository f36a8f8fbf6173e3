/* The lane: a steady check's whole cycle in C (probes/lane.py says what it
 * is for and when a key is in it). Part of the _speedups module: _speedups.c
 * includes this file (it uses its `whole_ex`).
 *
 * KeptLane holds keys whose checks succeed, in three modes: an HTTP check on
 * a kept connection (KEPT), a plain TCP check (TCP) and an HTTP check on a
 * connection of its own per probe (FRESH). For each it keeps the request
 * and the kept connection's descriptor or the endpoint's address, the timing
 * of SPEC §2.1 (probes/timetable.py's rule, the same arithmetic) and a
 * deadline. Its start() sends the request (or connects) of every key due;
 * its poll() reads the answers (one epoll set of its own), and an answer
 * that is one whole response with an expected status (and, for
 * responseContains, the text in the first body_searched bytes of its body)
 * - for TCP, the handshake's end - is a steady success: packed into the
 * bytes it returns (STEADY_RECORD), the key re-armed, no Python object made
 * per check. Anything else - a partial, unexpected or closing answer, a
 * refused or reset connection, a timeout, a connection that spoke while
 * idle, a send that failed - hands the key back to Python (it leaves the
 * lane; a FRESH check's socket with it when the probe goes on), which
 * finishes the probe as the batch prober always has.
 *
 * steady_table() and steady_history() take those records into an endpoint
 * table's arrays (health/endpoints.py: EndpointTable.on_steady) and an
 * outcome history's open runs (health/history.py: OutcomeHistory.steady);
 * each returns the records it could not take (the endpoint is not HEALTHY,
 * the run is not the same), which take the Python path. */
#include <stdint.h>
#include <sys/epoll.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

/* one steady result: the key (an endpoint slot), the HTTP status, the latency */
typedef struct {
    int32_t key;
    uint16_t status;
    uint16_t pad;
    double latency;
} SteadyRecord;

#define LANE_BUCKETS 14 /* probes/stats.py's PROBE_BUCKETS, and +Inf */
#define LANE_EVENTS 64
#define LANE_POOL 256 /* disconnected TCP sockets kept for reuse, per address family */

/* what a key's check is (its mode) */
#define MODE_KEPT 0  /* HTTP on a kept connection, which Python's socket owns */
#define MODE_TCP 1   /* connect: the handshake's end is the answer */
#define MODE_FRESH 2 /* HTTP on a connection of its own: connect, send, read, reset */
#define MODE_EXPECT 3 /* TCP with send or expect (SPEC §10): connect, send, the answer's first
                         bytes, reset */

/* `sent`: 0 idle (due), 1 under way (KEPT: the request out; TCP and FRESH:
 * connecting), 2 FRESH's request out */
typedef struct {
    long key; /* -1: a free slot */
    int fd;   /* KEPT: the kept connection's; TCP and FRESH: the lane's own
                 socket while a check is under way, else -1 */
    int mode, lo, hi, sent;
    PyObject *request; /* bytes: HTTP's request (TCP: b"") */
    PyObject *address; /* bytes: TCP's and FRESH's packed sockaddr (KEPT: NULL) */
    PyObject *needle;  /* bytes: responseContains (b"": none) */
    double interval, timeout, due, started, deadline;
    Py_ssize_t heap_at[2]; /* where in each heap (due, deadline); -1: not in it */
} Kept;

typedef struct {
    PyObject_HEAD
    int ep;
    Kept *k;
    Py_ssize_t n, cap;
    Py_ssize_t *free_slots, nfree;
    Py_ssize_t *heap[2], heap_n[2]; /* 0: idle keys by due time, 1: keys sent, by deadline */
    PyObject *index;                /* key -> slot */
    double late_threshold;
    unsigned char *buf;
    Py_ssize_t bufsize;       /* the largest whole answer + 1 */
    Py_ssize_t body_searched; /* bytes of a body searched for responseContains */
    uint64_t rng;
    double edges[LANE_BUCKETS - 1];
    long long started, late, finished, buckets[LANE_BUCKETS];
    double ok_sum;
    SteadyRecord *steady; /* this tick's steady records, until poll() returns them */
    Py_ssize_t nsteady, capsteady;
    int pool[2][LANE_POOL], npool[2]; /* TCP sockets: [0] IPv4, [1] IPv6 */
    Py_ssize_t *by_fd, nfd;            /* a TCP socket's slot while it connects, else -1 */
    Py_ssize_t connecting;             /* own-socket checks under way (each a descriptor) */
} Lane;

/* a TCP socket is in the epoll set for as long as it lives (its events
 * say which descriptor: TCP_EVENT | fd), a kept connection only while in
 * the lane (its events say which slot) */
#define TCP_EVENT (1ULL << 63)

static double heap_key(Lane *L, int w, Py_ssize_t i) {
    return w ? L->k[i].deadline : L->k[i].due;
}

static void heap_set(Lane *L, int w, Py_ssize_t at, Py_ssize_t i) {
    L->heap[w][at] = i;
    L->k[i].heap_at[w] = at;
}

static void heap_up(Lane *L, int w, Py_ssize_t at) {
    Py_ssize_t i = L->heap[w][at];
    double key = heap_key(L, w, i);
    while (at > 0) {
        Py_ssize_t parent = (at - 1) / 2;
        if (heap_key(L, w, L->heap[w][parent]) <= key) break;
        heap_set(L, w, at, L->heap[w][parent]);
        at = parent;
    }
    heap_set(L, w, at, i);
}

static void heap_down(Lane *L, int w, Py_ssize_t at) {
    Py_ssize_t i = L->heap[w][at], n = L->heap_n[w];
    double key = heap_key(L, w, i);
    for (;;) {
        Py_ssize_t c = 2 * at + 1;
        if (c >= n) break;
        if (c + 1 < n && heap_key(L, w, L->heap[w][c + 1]) < heap_key(L, w, L->heap[w][c])) c++;
        if (heap_key(L, w, L->heap[w][c]) >= key) break;
        heap_set(L, w, at, L->heap[w][c]);
        at = c;
    }
    heap_set(L, w, at, i);
}

static void heap_push(Lane *L, int w, Py_ssize_t i) {
    Py_ssize_t at = L->heap_n[w]++;
    heap_set(L, w, at, i);
    heap_up(L, w, at);
}

static void heap_remove(Lane *L, int w, Py_ssize_t i) {
    Py_ssize_t at = L->k[i].heap_at[w];
    if (at < 0) return;
    Py_ssize_t last = --L->heap_n[w];
    L->k[i].heap_at[w] = -1;
    if (at == last) return;
    Py_ssize_t moved = L->heap[w][last];
    heap_set(L, w, at, moved);
    heap_down(L, w, at);
    heap_up(L, w, L->k[moved].heap_at[w]);
}

static double lane_spread(Lane *L) { /* splitmix64, as a fraction in [0, 1) */
    uint64_t z = (L->rng += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return (double)((z ^ (z >> 31)) >> 11) * (1.0 / 9007199254740992.0);
}

/* a TCP, FRESH or EXPECT check's socket: a pooled one (disconnected), else a new one
 * that resets as it closes or disconnects (no FIN exchange, no TIME_WAIT) */
static int own_socket(Lane *L, int family) {
    int f = family == AF_INET6;
    if (L->npool[f] > 0) return L->pool[f][--L->npool[f]];
    int fd = socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct linger reset = {1, 0};
    /* edge-triggered: a connect's end is an edge; a disconnect's events
     * find no slot, and what a reused socket's new connect is not, the
     * kernel filters as it reports (SYN_SENT polls as nothing) */
    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET,
                             .data.u64 = TCP_EVENT | (uint64_t)fd};
    if (fd >= L->nfd) {
        Py_ssize_t n = L->nfd ? L->nfd : 1024;
        while (n <= fd) n *= 2;
        Py_ssize_t *grown = PyMem_Realloc(L->by_fd, n * sizeof(Py_ssize_t));
        if (grown == NULL) {
            close(fd);
            errno = ENOMEM;
            return -1;
        }
        for (Py_ssize_t x = L->nfd; x < n; x++) grown[x] = -1;
        L->by_fd = grown;
        L->nfd = n;
    }
    if (setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof reset) < 0 ||
        epoll_ctl(L->ep, EPOLL_CTL_ADD, fd, &ev) < 0) {
        int err = errno;
        close(fd);
        errno = err;
        return -1;
    }
    return fd;
}

/* dissolve the association (the RST) and keep the socket, or close it (which
 * takes it out of the epoll set) */
static void tcp_release(Lane *L, int family, int fd) {
    int f = family == AF_INET6;
    struct sockaddr unspec;
    memset(&unspec, 0, sizeof unspec);
    unspec.sa_family = AF_UNSPEC;
    if (L->npool[f] < LANE_POOL && connect(fd, &unspec, sizeof unspec) == 0)
        L->pool[f][L->npool[f]++] = fd;
    else
        close(fd);
}

static int key_family(Kept *k) {
    return ((const struct sockaddr *)PyBytes_AS_STRING(k->address))->sa_family;
}

/* a slot leaves the lane: out of its epoll set, its heaps and its index */
static void lane_free(Lane *L, Py_ssize_t i) {
    Kept *k = &L->k[i];
    if (k->mode != MODE_KEPT && k->fd >= 0) { /* a check under way, failed or timed out */
        L->by_fd[k->fd] = -1;
        L->connecting--;
        tcp_release(L, key_family(k), k->fd);
    } else if (k->fd >= 0 && L->ep >= 0) {
        epoll_ctl(L->ep, EPOLL_CTL_DEL, k->fd, NULL);
    }
    k->fd = -1;
    heap_remove(L, 0, i);
    heap_remove(L, 1, i);
    PyObject *key = PyLong_FromLong(k->key);
    if (key == NULL || PyDict_DelItem(L->index, key) < 0) PyErr_Clear();
    Py_XDECREF(key);
    Py_CLEAR(k->request);
    Py_CLEAR(k->address);
    Py_CLEAR(k->needle);
    k->key = -1;
    L->free_slots[L->nfree++] = i;
}

static int lane_grow(Lane *L) {
    Py_ssize_t cap = L->cap ? L->cap * 2 : 1024;
    Kept *k = PyMem_Realloc(L->k, cap * sizeof(Kept));
    if (k == NULL) return -1;
    L->k = k;
    Py_ssize_t **arrays[3] = {&L->free_slots, &L->heap[0], &L->heap[1]};
    for (int a = 0; a < 3; a++) { /* (each kept as it grows: a failure leaves all valid) */
        Py_ssize_t *grown = PyMem_Realloc(*arrays[a], cap * sizeof(Py_ssize_t));
        if (grown == NULL) return -1;
        *arrays[a] = grown;
    }
    L->cap = cap;
    return 0;
}

static PyObject *lane_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"late_threshold", "max_response", "edges", "seed",
                             "body_searched", NULL};
    double late_threshold;
    Py_ssize_t max_response, body_searched;
    PyObject *edges;
    unsigned long long seed;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "dnOKn", kwlist, &late_threshold, &max_response,
                                     &edges, &seed, &body_searched))
        return NULL;
    PyObject *fast = PySequence_Fast(edges, "edges: a sequence of floats");
    if (fast == NULL) return NULL;
    if (PySequence_Fast_GET_SIZE(fast) != LANE_BUCKETS - 1 || max_response < 16 ||
        max_response > (1 << 24)) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "edges: 13 bucket bounds; max_response: 16 B to 16 MiB");
        return NULL;
    }
    Lane *L = (Lane *)type->tp_alloc(type, 0);
    if (L == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    L->ep = -1;
    for (int b = 0; b < LANE_BUCKETS - 1; b++) {
        L->edges[b] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fast, b));
        if (L->edges[b] == -1.0 && PyErr_Occurred()) {
            Py_DECREF(fast);
            Py_DECREF(L);
            return NULL;
        }
    }
    Py_DECREF(fast);
    L->late_threshold = late_threshold;
    L->body_searched = body_searched;
    L->rng = seed;
    L->bufsize = max_response + 1;
    L->buf = PyMem_Malloc(L->bufsize);
    L->index = PyDict_New();
    if (L->buf == NULL || L->index == NULL) {
        Py_DECREF(L);
        return PyErr_NoMemory();
    }
    L->ep = epoll_create1(EPOLL_CLOEXEC);
    if (L->ep < 0) {
        Py_DECREF(L);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return (PyObject *)L;
}

static void lane_release(Lane *L) {
    for (Py_ssize_t i = 0; i < L->n; i++) {
        if (L->k[i].key >= 0 && L->k[i].mode != MODE_KEPT && L->k[i].fd >= 0) {
            L->by_fd[L->k[i].fd] = -1;
            close(L->k[i].fd);
        }
        Py_CLEAR(L->k[i].request);
        Py_CLEAR(L->k[i].address);
        Py_CLEAR(L->k[i].needle);
    }
    L->connecting = 0;
    for (int f = 0; f < 2; f++) {
        while (L->npool[f] > 0) close(L->pool[f][--L->npool[f]]);
    }
    L->nsteady = 0;
    L->n = L->nfree = L->heap_n[0] = L->heap_n[1] = 0;
    if (L->index != NULL) PyDict_Clear(L->index);
    if (L->ep >= 0) close(L->ep);
    L->ep = -1;
}

static void lane_dealloc(Lane *L) {
    lane_release(L);
    Py_CLEAR(L->index);
    PyMem_Free(L->k);
    PyMem_Free(L->free_slots);
    PyMem_Free(L->heap[0]);
    PyMem_Free(L->heap[1]);
    PyMem_Free(L->buf);
    PyMem_Free(L->steady);
    PyMem_Free(L->by_fd);
    Py_TYPE(L)->tp_free((PyObject *)L);
}

static int lane_open(Lane *L) {
    if (L->ep >= 0) return 0;
    PyErr_SetString(PyExc_ValueError, "the lane is closed");
    return -1;
}

/* the key's number: an endpoint slot, 0 to 2**31 - 1 */
static int key_arg(PyObject *arg, long *key) {
    *key = PyLong_AsLong(arg);
    if (*key == -1 && PyErr_Occurred()) return -1;
    if (*key < 0 || *key > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "key: 0 to 2**31 - 1");
        return -1;
    }
    return 0;
}

/* a key joins (enter, enter_tcp, enter_fresh): its slot, its index entry,
 * its kept connection in the epoll set (fd >= 0), due at `due` */
static PyObject *lane_add(Lane *L, PyObject *keyobj, long key, int fd, int mode,
                          PyObject *request, PyObject *address, PyObject *needle, double interval,
                          double timeout, double due, int lo, int hi) {
    if (lane_open(L) < 0) return NULL;
    if (!(interval > 0) || !(timeout > 0)) {
        PyErr_SetString(PyExc_ValueError, "interval and timeout must be above 0");
        return NULL;
    }
    int known = PyDict_Contains(L->index, keyobj);
    if (known != 0) {
        if (known > 0) PyErr_Format(PyExc_ValueError, "key %ld is in the lane already", key);
        return NULL;
    }
    if (L->nfree == 0 && L->n == L->cap && lane_grow(L) < 0) return PyErr_NoMemory();
    Py_ssize_t i = L->nfree ? L->free_slots[--L->nfree] : L->n++;
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.u64 = (uint64_t)i};
    if (fd >= 0 && epoll_ctl(L->ep, EPOLL_CTL_ADD, fd, &ev) < 0) {
        L->free_slots[L->nfree++] = i;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *slot = PyLong_FromSsize_t(i);
    if (slot == NULL || PyDict_SetItem(L->index, keyobj, slot) < 0) {
        Py_XDECREF(slot);
        if (fd >= 0) epoll_ctl(L->ep, EPOLL_CTL_DEL, fd, NULL);
        L->free_slots[L->nfree++] = i;
        return NULL;
    }
    Py_DECREF(slot);
    Kept *k = &L->k[i];
    k->key = key;
    k->fd = fd;
    k->mode = mode;
    k->lo = lo;
    k->hi = hi;
    k->sent = 0;
    k->request = Py_NewRef(request);
    k->address = Py_XNewRef(address);
    k->needle = Py_NewRef(needle);
    k->interval = interval;
    k->timeout = timeout;
    k->due = due;
    k->started = k->deadline = 0.0;
    k->heap_at[0] = k->heap_at[1] = -1;
    heap_push(L, 0, i);
    Py_RETURN_NONE;
}

/* enter(key, fd, request, interval, timeout, due, lo, hi, needle): a key's
 * kept connection (idle) joins the lane, its next probe due at `due` */
static PyObject *lane_enter(Lane *L, PyObject *const *args, Py_ssize_t nargs) {
    long key;
    int fd, lo, hi;
    double interval, timeout, due;
    if (nargs != 9 || !PyBytes_Check(args[2]) || !PyBytes_Check(args[8])) {
        PyErr_SetString(PyExc_TypeError, "enter(key, fd, request: bytes, interval, timeout, due, "
                                         "lo, hi, needle: bytes)");
        return NULL;
    }
    if (key_arg(args[0], &key) < 0 || fd_arg(args[1], &fd) < 0) return NULL;
    interval = PyFloat_AsDouble(args[3]);
    timeout = PyFloat_AsDouble(args[4]);
    due = PyFloat_AsDouble(args[5]);
    lo = (int)PyLong_AsLong(args[6]);
    hi = (int)PyLong_AsLong(args[7]);
    if (PyErr_Occurred()) return NULL;
    return lane_add(L, args[0], key, fd, MODE_KEPT, args[2], NULL, args[8], interval, timeout, due,
                    lo, hi);
}

static int address_arg(PyObject *arg) {
    Py_ssize_t len = PyBytes_Check(arg) ? PyBytes_GET_SIZE(arg) : 0;
    sa_family_t family = len >= (Py_ssize_t)sizeof(sa_family_t)
                             ? ((const struct sockaddr *)PyBytes_AS_STRING(arg))->sa_family
                             : AF_UNSPEC;
    if (!(family == AF_INET && len == sizeof(struct sockaddr_in)) &&
        !(family == AF_INET6 && len == sizeof(struct sockaddr_in6))) {
        PyErr_SetString(PyExc_ValueError, "address: a packed sockaddr_in or sockaddr_in6");
        return -1;
    }
    return 0;
}

/* enter_tcp(key, address, interval, timeout, due[, send, expect]): a TCP
 * check joins the lane, its next probe due at `due`; `address`: the
 * endpoint as a packed sockaddr_in(6). Plain (a connect, its handshake's end
 * the answer), or with bytes to send once connected and the answer's first
 * bytes expected (either may be b"") */
static PyObject *lane_enter_tcp(Lane *L, PyObject *const *args, Py_ssize_t nargs) {
    long key;
    if ((nargs != 5 && nargs != 7) ||
        (nargs == 7 && (!PyBytes_Check(args[5]) || !PyBytes_Check(args[6])))) {
        PyErr_SetString(PyExc_TypeError, "enter_tcp(key, address: bytes, interval, timeout, due"
                                         "[, send: bytes, expect: bytes])");
        return NULL;
    }
    if (key_arg(args[0], &key) < 0 || address_arg(args[1]) < 0) return NULL;
    double interval = PyFloat_AsDouble(args[2]), timeout = PyFloat_AsDouble(args[3]),
           due = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (nargs == 7 && (PyBytes_GET_SIZE(args[5]) || PyBytes_GET_SIZE(args[6]))) {
        if (PyBytes_GET_SIZE(args[6]) >= L->bufsize) {
            PyErr_SetString(PyExc_ValueError, "expect: longer than an answer read");
            return NULL;
        }
        return lane_add(L, args[0], key, -1, MODE_EXPECT, args[5], args[1], args[6], interval,
                        timeout, due, 0, 0);
    }
    PyObject *none = PyBytes_FromStringAndSize(NULL, 0);
    if (none == NULL) return NULL;
    PyObject *r = lane_add(L, args[0], key, -1, MODE_TCP, none, args[1], none, interval, timeout,
                           due, 0, 0);
    Py_DECREF(none);
    return r;
}

/* enter_fresh(key, address, request, interval, timeout, due, lo, hi,
 * needle): an HTTP check on a connection of its own per probe joins the
 * lane, its next probe due at `due` */
static PyObject *lane_enter_fresh(Lane *L, PyObject *const *args, Py_ssize_t nargs) {
    long key;
    if (nargs != 9 || !PyBytes_Check(args[2]) || !PyBytes_Check(args[8])) {
        PyErr_SetString(PyExc_TypeError,
                        "enter_fresh(key, address: bytes, request: bytes, interval, timeout, due, "
                        "lo, hi, needle: bytes)");
        return NULL;
    }
    if (key_arg(args[0], &key) < 0 || address_arg(args[1]) < 0) return NULL;
    double interval = PyFloat_AsDouble(args[3]), timeout = PyFloat_AsDouble(args[4]),
           due = PyFloat_AsDouble(args[5]);
    int lo = (int)PyLong_AsLong(args[6]), hi = (int)PyLong_AsLong(args[7]);
    if (PyErr_Occurred()) return NULL;
    if (PyBytes_GET_SIZE(args[2]) == 0) {
        PyErr_SetString(PyExc_ValueError, "request: empty");
        return NULL;
    }
    return lane_add(L, args[0], key, -1, MODE_FRESH, args[2], args[1], args[8], interval, timeout,
                    due, lo, hi);
}

/* leave(key): the key out of the lane (its spec changed, it is removed).
 * None: it was not in it; else whether a request of it was out. */
static PyObject *lane_leave(Lane *L, PyObject *key) {
    PyObject *slot = PyDict_GetItemWithError(L->index, key);
    if (slot == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    Py_ssize_t i = PyLong_AsSsize_t(slot);
    int sent = L->k[i].sent;
    lane_free(L, i);
    return PyBool_FromLong(sent);
}

/* a key handed back: (key, kind, started, due, data, events); it has left */
#define HANDBACK_ANSWER 0 /* an answer to read (data: what was read of it) */
#define HANDBACK_TIMEOUT 1
#define HANDBACK_IDLE 2    /* the idle connection spoke or closed */
#define HANDBACK_UNSENT 3  /* the request could not be sent (data: b"", events: the errno) */
#define HANDBACK_FAILED 4  /* TCP or FRESH: the connection failed (events: the errno; 0: closed) */
#define HANDBACK_HANDED 5  /* FRESH: an answer to read on, on the lane's socket (fd), now Python's */
#define HANDBACK_SENDING 6 /* FRESH: the request part sent (events: how much) on the socket (fd) */
/* each as (key, kind, started, due, data, events, fd): fd -1 but for a
 * socket handed over */
static int hand_back_fd(Lane *L, PyObject **out, Py_ssize_t i, int kind,
                        const unsigned char *data, Py_ssize_t len, long events, int fd) {
    Kept *k = &L->k[i];
    if (*out == NULL && (*out = PyList_New(0)) == NULL) return -1;
    PyObject *item = Py_BuildValue("(liddy#li)", k->key, kind, k->started, k->due,
                                   data ? (const char *)data : "", len, events, fd);
    int r = item == NULL ? -1 : PyList_Append(*out, item);
    Py_XDECREF(item);
    lane_free(L, i);
    return r;
}

static int hand_back(Lane *L, PyObject **out, Py_ssize_t i, int kind, const unsigned char *data,
                     Py_ssize_t len, long events) {
    return hand_back_fd(L, out, i, kind, data, len, events, -1);
}

/* a FRESH check goes on in Python, on the lane's socket, which leaves the
 * lane's epoll set and its care (closed here if Python cannot be told) */
static int hand_over(Lane *L, PyObject **out, Py_ssize_t i, int kind, const unsigned char *data,
                     Py_ssize_t len, long events) {
    Kept *k = &L->k[i];
    int fd = k->fd;
    epoll_ctl(L->ep, EPOLL_CTL_DEL, fd, NULL);
    L->by_fd[fd] = -1;
    L->connecting--;
    k->fd = -1;
    int r = hand_back_fd(L, out, i, kind, data, len, events, fd);
    if (r < 0) close(fd);
    return r;
}

/* responseContains: the needle within the first body_searched bytes of the
 * body of the whole answer in L->buf (as probes/batch.py's _body) */
static int body_has(Lane *L, Py_ssize_t len, PyObject *needle) {
    const unsigned char *end = memmem(L->buf, (size_t)len, "\r\n\r\n", 4);
    if (end == NULL) return 0;
    const unsigned char *body = end + 4;
    Py_ssize_t blen = len - (body - L->buf);
    if (blen > L->body_searched) blen = L->body_searched;
    return memmem(body, (size_t)blen, PyBytes_AS_STRING(needle),
                  (size_t)PyBytes_GET_SIZE(needle)) != NULL;
}

static void count_ok(Lane *L, double latency) {
    int b = 0;
    while (b < LANE_BUCKETS - 1 && latency > L->edges[b]) b++;
    L->buckets[b]++;
    L->ok_sum += latency;
    L->finished++;
}

/* a steady success of slot i at `now`: its record kept for poll() to
 * return, counted, and the key re-armed (probes/timetable.py's next_due) */
static int lane_steady(Lane *L, Py_ssize_t i, double now, long status) {
    Kept *k = &L->k[i];
    if (L->nsteady == L->capsteady) {
        Py_ssize_t cap = L->capsteady ? L->capsteady * 2 : 64;
        SteadyRecord *grown = PyMem_Realloc(L->steady, cap * sizeof(SteadyRecord));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        L->steady = grown;
        L->capsteady = cap;
    }
    double latency = now - k->started;
    L->steady[L->nsteady++] = (SteadyRecord){(int32_t)k->key, (uint16_t)status, 0, latency};
    count_ok(L, latency);
    double offset = k->due - k->started;
    k->due = offset < -k->interval / 2 ? now + lane_spread(L) * k->interval
                                       : now + k->interval + offset;
    k->sent = 0;
    heap_remove(L, 1, i);
    heap_push(L, 0, i);
    return 0;
}

/* the status of the answer in L->buf[0:len] when it is a steady success of
 * k's check: one whole response (FRESH: one that may close), an expected
 * status, the responseContains text; else 0 (the Python path says why) */
static long verdict(Lane *L, Kept *k, Py_ssize_t len) {
    if (len <= 0 || len >= L->bufsize) return 0;
    long status = whole_ex(L->buf, len, k->mode == MODE_FRESH);
    if (status != 0 && PyBytes_GET_SIZE(k->needle) > 0 && !body_has(L, len, k->needle)) return 0;
    return status >= k->lo && status <= k->hi ? status : 0;
}

/* the lane's own socket of slot i, done with: out of its care, reset and pooled */
static void own_release(Lane *L, Kept *k) {
    L->by_fd[k->fd] = -1;
    L->connecting--;
    tcp_release(L, key_family(k), k->fd);
    k->fd = -1;
}

/* FRESH and EXPECT: the answer is in (or the connection spoke): a steady
 * success, or the check handed over to Python with what was read */
static int fresh_read(Lane *L, PyObject **out, Py_ssize_t i, uint32_t ev, double now) {
    Kept *k = &L->k[i];
    ssize_t got = recv(k->fd, L->buf, (size_t)L->bufsize, MSG_DONTWAIT);
    if (got < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        return hand_back(L, out, i, HANDBACK_FAILED, NULL, 0, errno); /* (reset, say) */
    }
    long status = 0;
    int steady;
    if (k->mode == MODE_EXPECT) { /* (fewer bytes than expected: Python reads on) */
        Py_ssize_t want = PyBytes_GET_SIZE(k->needle);
        steady = got >= want && memcmp(L->buf, PyBytes_AS_STRING(k->needle), (size_t)want) == 0;
    } else {
        steady = (status = verdict(L, k, got)) != 0;
    }
    if (!steady) return hand_over(L, out, i, HANDBACK_HANDED, L->buf, got, ev);
    own_release(L, k);
    return lane_steady(L, i, now, status);
}

/* FRESH and EXPECT: connected (or not yet: then EAGAIN, and again at the
 * connect's end); the request goes out whole (else Python sends the rest);
 * EXPECT with nothing expected is done then */
static int fresh_send(Lane *L, PyObject **out, Py_ssize_t i, uint32_t ev, double now) {
    Kept *k = &L->k[i];
    Py_ssize_t len = PyBytes_GET_SIZE(k->request);
    ssize_t sent = len ? send(k->fd, PyBytes_AS_STRING(k->request), (size_t)len,
                              MSG_NOSIGNAL | MSG_DONTWAIT)
                       : 0;
    if (sent < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOTCONN) return 0;
        return hand_back(L, out, i, HANDBACK_FAILED, NULL, 0, errno);
    }
    if (sent < len) return hand_over(L, out, i, HANDBACK_SENDING, NULL, 0, (long)sent);
    if (k->mode == MODE_EXPECT && PyBytes_GET_SIZE(k->needle) == 0) { /* (sent: that was all) */
        own_release(L, k);
        return lane_steady(L, i, now, 0);
    }
    k->sent = 2;
    /* (edge-triggered: what the peer said with the connect's end comes no more) */
    return ev & (EPOLLIN | EPOLLRDHUP | EPOLLHUP) ? fresh_read(L, out, i, ev, now) : 0;
}

/* a TCP, FRESH or EXPECT check of slot i begins (it has left the due heap),
 * on its socket: the connect done at once (TCP: a steady success; else the
 * request sent), failed at once (handed back) or under way (its socket known
 * by its descriptor, its deadline in the heap) */
static int own_start(Lane *L, PyObject **out, Py_ssize_t i, double now) {
    Kept *k = &L->k[i];
    if (PyBytes_GET_SIZE(k->request)) { /* (as batch.py: the handshake's ACK goes with it) */
        int no = 0;
        setsockopt(k->fd, IPPROTO_TCP, TCP_QUICKACK, &no, sizeof no);
    }
    Py_ssize_t len = PyBytes_GET_SIZE(k->address);
    int r = connect(k->fd, (const struct sockaddr *)PyBytes_AS_STRING(k->address), (socklen_t)len)
                ? errno
                : 0;
    if (r == EINPROGRESS || (r == 0 && k->mode != MODE_TCP)) {
        /* (EINPROGRESS on loopback too: the SYN+ACK waits for the socket's lock,
         * and is in once connect returns - so the request goes now, as
         * batch.py's, and its answer may be read in this same tick) */
        L->by_fd[k->fd] = i;
        L->connecting++;
        k->deadline = now + k->timeout;
        heap_push(L, 1, i);
        return k->mode == MODE_TCP ? 0 : fresh_send(L, out, i, 0, now);
    }
    tcp_release(L, key_family(k), k->fd);
    k->fd = -1;
    if (r == 0) return lane_steady(L, i, now, 0);
    return hand_back(L, out, i, HANDBACK_FAILED, NULL, 0, r);
}

/* start(now, horizon, budget_end[, room]) -> (handed back or None,
 * deferred): send the request (TCP, FRESH, EXPECT: connect) of every key
 * due before `horizon`; stop (deferred) once the monotonic clock passes
 * budget_end, and (not deferred: until some end) at such a key when `room`
 * of them are under way. A TCP check done at once is in the records
 * the next poll() returns. */
static PyObject *lane_start(Lane *L, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "start(now, horizon, budget_end[, room])");
        return NULL;
    }
    double now = PyFloat_AsDouble(args[0]), horizon = PyFloat_AsDouble(args[1]),
           budget_end = PyFloat_AsDouble(args[2]);
    Py_ssize_t room = nargs == 4 ? PyLong_AsSsize_t(args[3]) : PY_SSIZE_T_MAX;
    if (PyErr_Occurred() || lane_open(L) < 0) return NULL;
    PyObject *out = NULL;
    int deferred = 0, launched = 0;
    while (L->heap_n[0] > 0) {
        Py_ssize_t i = L->heap[0][0];
        Kept *k = &L->k[i];
        if (k->due >= horizon) break;
        if (launched && !(launched % 32) && monotonic_now() > budget_end) {
            deferred = 1;
            break;
        }
        int own = k->mode != MODE_KEPT;
        if (own && L->connecting >= room) break; /* (late then, and counted late) */
        launched++;
        if (own) {
            if ((k->fd = own_socket(L, key_family(k))) < 0) { /* (out of descriptors, say) */
                if (hand_back(L, &out, i, HANDBACK_UNSENT, NULL, 0, errno) < 0) goto fail;
                continue;
            }
        } else {
            Py_ssize_t len = PyBytes_GET_SIZE(k->request);
            ssize_t sent = send(k->fd, PyBytes_AS_STRING(k->request), (size_t)len,
                                MSG_NOSIGNAL | MSG_DONTWAIT);
            if (sent != len) { /* (a partial send on a health check: the Python path's) */
                if (hand_back(L, &out, i, HANDBACK_UNSENT, NULL, 0, sent < 0 ? errno : 0) < 0)
                    goto fail;
                continue;
            }
        }
        heap_remove(L, 0, i);
        k->sent = 1;
        k->started = now;
        L->started++;
        if (now - k->due > L->late_threshold) L->late++;
        if (own) {
            if (own_start(L, &out, i, now) < 0) goto fail;
            continue;
        }
        k->deadline = now + k->timeout;
        heap_push(L, 1, i);
    }
    return Py_BuildValue("(NO)", out ? out : Py_NewRef(Py_None), deferred ? Py_True : Py_False);
fail:
    Py_XDECREF(out);
    return NULL;
}

/* an event of a TCP, FRESH or EXPECT check's socket (slot i): its connect's
 * end (TCP: a steady success; else the request sent) or failure, the answer */
static int own_event(Lane *L, PyObject **out, Py_ssize_t i, uint32_t ev, double now) {
    Kept *k = &L->k[i];
    if (k->sent == 2) /* (writable only: the connect's end, the request sent already) */
        return ev & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR) ? fresh_read(L, out, i, ev, now)
                                                                 : 0;
    if (ev & (EPOLLERR | EPOLLHUP)) { /* refused, unreachable, reset: as batch.py's _connected */
        int err = 0;
        socklen_t size = sizeof err;
        if (getsockopt(k->fd, SOL_SOCKET, SO_ERROR, &err, &size) < 0) err = errno;
        return hand_back(L, out, i, HANDBACK_FAILED, NULL, 0, err);
    }
    if (k->mode != MODE_TCP) return fresh_send(L, out, i, ev, now);
    own_release(L, k);
    return lane_steady(L, i, now, 0);
}

/* poll(now, budget_end) -> (steady records: bytes, handed back or None,
 * backlog): read what the lane's connections said, then time out what is
 * past its deadline; the records include those of the last start() */
static PyObject *lane_poll(Lane *L, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "poll(now, budget_end)");
        return NULL;
    }
    double now = PyFloat_AsDouble(args[0]), budget_end = PyFloat_AsDouble(args[1]);
    if (PyErr_Occurred() || lane_open(L) < 0) return NULL;
    struct epoll_event events[LANE_EVENTS];
    PyObject *out = NULL;
    int backlog = 0, got;
    do {
        got = epoll_wait(L->ep, events, LANE_EVENTS, 0);
        if (got < 0) {
            if (errno == EINTR) continue;
            PyErr_SetFromErrno(PyExc_OSError);
            goto fail;
        }
        for (int e = 0; e < got; e++) {
            uint64_t data = events[e].data.u64;
            uint32_t ev = events[e].events;
            if (data & TCP_EVENT) {
                Py_ssize_t fd = (Py_ssize_t)(data & ~TCP_EVENT);
                Py_ssize_t i = fd < L->nfd ? L->by_fd[fd] : -1;
                if (i >= 0 && own_event(L, &out, i, ev, now) < 0) goto fail;
                continue; /* (-1: pooled, its own disconnect) */
            }
            Py_ssize_t i = (Py_ssize_t)data;
            if (i >= L->n || L->k[i].key < 0) continue; /* (left earlier in this batch) */
            Kept *k = &L->k[i];
            if (!k->sent) {
                if (hand_back(L, &out, i, HANDBACK_IDLE, NULL, 0, ev) < 0) goto fail;
                continue;
            }
            ssize_t got_bytes = recv(k->fd, L->buf, (size_t)L->bufsize, MSG_DONTWAIT);
            if (got_bytes < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
            /* (a closing connection is not kept: the Python path's) */
            long status = ev & (EPOLLRDHUP | EPOLLHUP | EPOLLERR) ? 0 : verdict(L, k, got_bytes);
            if (status == 0) {
                Py_ssize_t len = got_bytes > 0 ? got_bytes : 0;
                if (hand_back(L, &out, i, HANDBACK_ANSWER, L->buf, len, ev) < 0) goto fail;
                continue;
            }
            if (lane_steady(L, i, now, status) < 0) goto fail;
        }
        if (got == LANE_EVENTS && monotonic_now() > budget_end) {
            backlog = 1; /* (timeouts wait: an answer may be in but not yet read) */
            break;
        }
    } while (got == LANE_EVENTS);
    while (!backlog && L->heap_n[1] > 0 && L->k[L->heap[1][0]].deadline <= now) {
        if (hand_back(L, &out, L->heap[1][0], HANDBACK_TIMEOUT, NULL, 0, 0) < 0) goto fail;
    }
    PyObject *records = PyBytes_FromStringAndSize((const char *)L->steady,
                                                  L->nsteady * (Py_ssize_t)sizeof(SteadyRecord));
    if (records == NULL) goto fail;
    L->nsteady = 0;
    return Py_BuildValue("(NNO)", records, out ? out : Py_NewRef(Py_None),
                         backlog ? Py_True : Py_False);
fail:
    Py_XDECREF(out);
    return NULL;
}

/* take_counts() -> (started, late, finished, sum of latencies, buckets):
 * what the lane did since the last call */
static PyObject *lane_take_counts(Lane *L, PyObject *unused) {
    (void)unused;
    PyObject *buckets = PyTuple_New(LANE_BUCKETS);
    if (buckets == NULL) return NULL;
    for (int b = 0; b < LANE_BUCKETS; b++) {
        PyObject *n = PyLong_FromLongLong(L->buckets[b]);
        if (n == NULL) {
            Py_DECREF(buckets);
            return NULL;
        }
        PyTuple_SET_ITEM(buckets, b, n);
        L->buckets[b] = 0;
    }
    PyObject *r =
        Py_BuildValue("(LLLdN)", L->started, L->late, L->finished, L->ok_sum, buckets);
    L->started = L->late = L->finished = 0;
    L->ok_sum = 0.0;
    return r;
}

static PyObject *lane_close(Lane *L, PyObject *unused) {
    (void)unused;
    lane_release(L);
    Py_RETURN_NONE;
}

static PyObject *lane_next_due(Lane *L, void *closure) {
    (void)closure;
    if (L->heap_n[0] == 0) Py_RETURN_NONE;
    return PyFloat_FromDouble(L->k[L->heap[0][0]].due);
}

static PyObject *lane_in_flight(Lane *L, void *closure) {
    (void)closure;
    return PyLong_FromSsize_t(L->heap_n[1]);
}

static PyObject *lane_connecting(Lane *L, void *closure) {
    (void)closure;
    return PyLong_FromSsize_t(L->connecting);
}

static Py_ssize_t lane_len(Lane *L) { return L->ep >= 0 ? PyDict_Size(L->index) : 0; }

static PyMethodDef lane_methods[] = {
    {"enter", (PyCFunction)(void (*)(void))lane_enter, METH_FASTCALL,
     "enter(key, fd, request, interval, timeout, due, lo, hi, needle): a kept connection joins."},
    {"enter_tcp", (PyCFunction)(void (*)(void))lane_enter_tcp, METH_FASTCALL,
     "enter_tcp(key, address, interval, timeout, due): a plain TCP check joins."},
    {"enter_fresh", (PyCFunction)(void (*)(void))lane_enter_fresh, METH_FASTCALL,
     "enter_fresh(key, address, request, interval, timeout, due, lo, hi, needle): an HTTP "
     "check on a connection of its own per probe joins."},
    {"leave", (PyCFunction)lane_leave, METH_O,
     "leave(key): None if not in the lane, else whether a request of it was out."},
    {"start", (PyCFunction)(void (*)(void))lane_start, METH_FASTCALL,
     "start(now, horizon, budget_end[, room]) -> (handed back or None, deferred)."},
    {"poll", (PyCFunction)(void (*)(void))lane_poll, METH_FASTCALL,
     "poll(now, budget_end) -> (steady records, handed back or None, backlog)."},
    {"take_counts", (PyCFunction)lane_take_counts, METH_NOARGS,
     "(started, late, finished, latency sum, buckets) since the last call."},
    {"close", (PyCFunction)lane_close, METH_NOARGS, "Forget every key (not their sockets)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef lane_getset[] = {
    {"next_due", (getter)lane_next_due, NULL, "The earliest due time of an idle key, or None.",
     NULL},
    {"in_flight", (getter)lane_in_flight, NULL, "Keys whose request is out.", NULL},
    {"connecting", (getter)lane_connecting, NULL,
     "TCP and fresh HTTP checks under way (each holds a descriptor).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods lane_as_sequence = {.sq_length = (lenfunc)lane_len};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "healthgate._speedups.KeptLane",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Steady kept-alive HTTP and plain TCP checks, whole in C (probes/lane.py).",
    .tp_new = lane_new,
    .tp_dealloc = (destructor)lane_dealloc,
    .tp_methods = lane_methods,
    .tp_getset = lane_getset,
    .tp_as_sequence = &lane_as_sequence,
};

/* ---- steady records into an endpoint table and an outcome history */

static int writable(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != itemsize || view->ndim != 1) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "%s: an array of %zd-byte items", what, itemsize);
        return -1;
    }
    return 0;
}

static int records_of(PyObject *packed, const SteadyRecord **rec, Py_ssize_t *n) {
    if (!PyBytes_Check(packed) || PyBytes_GET_SIZE(packed) % sizeof(SteadyRecord)) {
        PyErr_SetString(PyExc_TypeError, "steady records: bytes of 16-byte records");
        return -1;
    }
    *rec = (const SteadyRecord *)PyBytes_AS_STRING(packed);
    *n = PyBytes_GET_SIZE(packed) / (Py_ssize_t)sizeof(SteadyRecord);
    return 0;
}

/* the records not taken, as bytes (b"" when all were) */
static PyObject *left_over(const SteadyRecord *rec, const unsigned char *taken, Py_ssize_t n) {
    Py_ssize_t left = 0;
    for (Py_ssize_t r = 0; r < n; r++) left += !taken[r];
    PyObject *out = PyBytes_FromStringAndSize(NULL, left * (Py_ssize_t)sizeof(SteadyRecord));
    if (out == NULL) return NULL;
    SteadyRecord *dst = (SteadyRecord *)PyBytes_AS_STRING(out);
    for (Py_ssize_t r = 0; r < n; r++)
        if (!taken[r]) *dst++ = rec[r];
    return out;
}

/* steady_table(now, records, healthy, state, ok, fail, outcome, status,
 * latency, time, details) -> the records not taken: EndpointTable.on_results'
 * steady path (a success of an endpoint in state `healthy`) per record */
static PyObject *steady_table(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    static const char *names[] = {"state", "ok", "fail", "outcome", "status", "latency", "time"};
    static const Py_ssize_t sizes[] = {1, 1, 1, 1, 2, 4, 8};
    if (nargs != 11 || !PyDict_Check(args[10])) {
        PyErr_SetString(PyExc_TypeError,
                        "steady_table(now, records, healthy, state, ok, fail, outcome, status, "
                        "latency, time, details: dict)");
        return NULL;
    }
    double now = PyFloat_AsDouble(args[0]);
    long healthy = PyLong_AsLong(args[2]);
    const SteadyRecord *rec;
    Py_ssize_t n;
    if (PyErr_Occurred() || records_of(args[1], &rec, &n) < 0) return NULL;
    Py_buffer v[7];
    int got = 0;
    for (; got < 7; got++)
        if (writable(args[3 + got], &v[got], sizes[got], names[got]) < 0) break;
    PyObject *result = NULL;
    unsigned char *taken = NULL;
    if (got == 7 && (taken = PyMem_Calloc(n ? n : 1, 1)) == NULL) PyErr_NoMemory();
    if (taken != NULL) {
        unsigned char *state = v[0].buf, *ok = v[1].buf, *fail = v[2].buf, *outcome = v[3].buf;
        uint16_t *status = v[4].buf;
        float *latency = v[5].buf;
        double *when = v[6].buf;
        PyObject *details = args[10];
        int has_details = PyDict_GET_SIZE(details) > 0;
        for (Py_ssize_t r = 0; r < n; r++) {
            Py_ssize_t s = rec[r].key;
            int fits = 1;
            for (int b = 0; b < 7; b++) fits &= s < v[b].len / sizes[b];
            if (s < 0 || !fits || state[s] != healthy) continue; /* (the Python path's) */
            if (ok[s] < 255) ok[s]++;
            fail[s] = 0;
            outcome[s] = 0; /* Outcome.OK */
            status[s] = rec[r].status;
            latency[s] = (float)rec[r].latency;
            when[s] = now;
            if (has_details) {
                PyObject *key = PyLong_FromSsize_t(s);
                if (key == NULL) goto done;
                int had = PyDict_Contains(details, key);
                if (had > 0) had = PyDict_DelItem(details, key);
                Py_DECREF(key);
                if (had < 0) goto done;
                has_details = PyDict_GET_SIZE(details) > 0;
            }
            taken[r] = 1;
        }
        result = left_over(rec, taken, n);
    }
done:
    PyMem_Free(taken);
    for (int b = 0; b < got; b++) PyBuffer_Release(&v[b]);
    return result;
}

static PyObject *s_count, *s_code, *s_last;

static int attr_long(PyObject *obj, PyObject *name, long long *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

static int set_long(PyObject *obj, PyObject *name, long long value) {
    PyObject *v = PyLong_FromLongLong(value);
    if (v == NULL) return -1;
    int r = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return r;
}

/* steady_history(by_key, t, records, exact) -> the records not taken:
 * OutcomeHistory.record's first step per record (a result that extends an
 * open run past its exact part: count + 1, last = t) */
static PyObject *steady_history(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4 || !PyDict_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "steady_history(by_key: dict, t, records, exact)");
        return NULL;
    }
    long long t = PyLong_AsLongLong(args[1]), exact = PyLong_AsLongLong(args[3]);
    const SteadyRecord *rec;
    Py_ssize_t n;
    if (PyErr_Occurred() || records_of(args[2], &rec, &n) < 0) return NULL;
    unsigned char *taken = PyMem_Calloc(n ? n : 1, 1);
    if (taken == NULL) return PyErr_NoMemory();
    PyObject *result = NULL;
    for (Py_ssize_t r = 0; r < n; r++) {
        PyObject *key = PyLong_FromLong(rec[r].key);
        if (key == NULL) goto done;
        PyObject *h = PyDict_GetItemWithError(args[0], key);
        Py_DECREF(key);
        if (h == NULL) {
            if (PyErr_Occurred()) goto done;
            continue;
        }
        long long count, code, last;
        if (attr_long(h, s_count, &count) < 0 || attr_long(h, s_code, &code) < 0 ||
            attr_long(h, s_last, &last) < 0)
            goto done;
        if (count < exact || code != ((long long)rec[r].status << 4) || t < last) continue;
        if (set_long(h, s_count, count + 1) < 0 || set_long(h, s_last, t) < 0) goto done;
        taken[r] = 1;
    }
    result = left_over(rec, taken, n);
done:
    PyMem_Free(taken);
    return result;
}
