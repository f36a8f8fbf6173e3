/* The HTTP readers of the L7 fast path and the batch HTTP checks, in C
 * (healthgate/http_scan.py says what they accept; tests/unit/test_http_scan.py
 * checks them against the Python reader, httptools and the probes' parse_head).
 *
 * plain_request(data: bytes) -> int   1 GET, 2 HEAD, 0 not a plain request
 * whole_response(data: bytes) -> int  the status of exactly one whole,
 *                                     reusable response, or 0
 *
 * Both only read `data`, never past its end, in one pass; neither allocates.
 *
 * FastProxy, FastUpstream: the bases of the L7 fast path's two protocol
 * objects (dataplane/http.py's HttpProxy, dataplane/upstream.py's
 * UpstreamConnection), whose data_received forward a plain request and its
 * whole response without running Python (see below).
 * Built by the package's build hook (hatch_build.py) when a C compiler and
 * Python's headers are there; without them, the Python path runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <structmember.h>
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <time.h>

/* RFC 9110 token characters */
static unsigned char is_tchar[256];
static void init_tables(void) {
    const char *extra = "!#$%&'*+.^_`|~-";
    for (int c = '0'; c <= '9'; c++) is_tchar[c] = 1;
    for (int c = 'a'; c <= 'z'; c++) is_tchar[c] = 1;
    for (int c = 'A'; c <= 'Z'; c++) is_tchar[c] = 1;
    for (const char *p = extra; *p; p++) is_tchar[(unsigned char)*p] = 1;
}

/* a header value's characters: tab and visible ASCII with space */
#define VALUE_CHAR(c) ((c) == '\t' || ((c) >= ' ' && (c) <= '~'))

static int lower(int c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

/* the name [p, p+n) equals the lower-case `word`, ignoring case */
static int name_is(const unsigned char *p, Py_ssize_t n, const char *word) {
    size_t len = strlen(word);
    if ((size_t)n != len) return 0;
    for (size_t i = 0; i < len; i++)
        if (lower(p[i]) != word[i]) return 0;
    return 1;
}

static const char *const not_plain[] = {
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade",
    "transfer-encoding", "content-length", "expect", "x-forwarded-for",
    "forwarded", "x-real-ip", "x-forwarded-host", "x-forwarded-proto", "x-forwarded-port",
    "x-forwarded-server", "x-forwarded-scheme", "x-original-forwarded-for", "true-client-ip",
    "x-client-ip", "x-cluster-client-ip", "cf-connecting-ip", "fastly-client-ip", NULL,
};

#define MAX_HEADERS 100 /* http_scan.MAX_HEADERS */

/* One header line at *pos: name, ':', value, CRLF. Sets the name's and the
 * value's spans; 0 when the line is not of that shape. */
static int header_line(const unsigned char *s, Py_ssize_t len, Py_ssize_t *pos,
                       Py_ssize_t *name, Py_ssize_t *name_len, Py_ssize_t *value,
                       Py_ssize_t *value_len) {
    Py_ssize_t i = *pos;
    *name = i;
    while (i < len && is_tchar[s[i]]) i++;
    if (i == *name || i >= len || s[i] != ':') return 0;
    *name_len = i - *name;
    i++;
    *value = i;
    while (i < len && VALUE_CHAR(s[i])) i++;
    if (i + 1 >= len || s[i] != '\r' || s[i + 1] != '\n') return 0;
    *value_len = i - *value;
    *pos = i + 2;
    return 1;
}

static long plain(const unsigned char *s, Py_ssize_t len, Py_ssize_t max_headers) {
    long method;
    Py_ssize_t i, headers = 0, hosts = 0;
    if (len < 4 || memcmp(s + len - 4, "\r\n\r\n", 4) != 0) return 0;
    if (len >= 4 && memcmp(s, "GET ", 4) == 0) {
        method = 1;
        i = 4;
    } else if (len >= 5 && memcmp(s, "HEAD ", 5) == 0) {
        method = 2;
        i = 5;
    } else {
        return 0;
    }
    if (i >= len || s[i] != '/') return 0;
    while (i < len && s[i] >= '!' && s[i] <= '~') i++;
    if (len - i < 11 || memcmp(s + i, " HTTP/1.1\r\n", 11) != 0) return 0;
    i += 11;
    for (;;) {
        Py_ssize_t name, name_len, value, value_len;
        if (i + 1 < len && s[i] == '\r' && s[i + 1] == '\n')
            return i + 2 == len && hosts == 1 ? method : 0;
        if (!header_line(s, len, &i, &name, &name_len, &value, &value_len)) return 0;
        if (++headers > max_headers || memchr(s + name, '_', name_len) != NULL) return 0;
        if (name_is(s + name, name_len, "host")) {
            hosts++;
            continue;
        }
        for (const char *const *w = not_plain; *w; w++)
            if (name_is(s + name, name_len, *w)) return 0;
    }
}

/* the value [p, p+n) without its surrounding spaces and tabs */
static void trim(const unsigned char *s, Py_ssize_t *p, Py_ssize_t *n) {
    while (*n > 0 && (s[*p] == ' ' || s[*p] == '\t')) {
        (*p)++;
        (*n)--;
    }
    while (*n > 0 && (s[*p + *n - 1] == ' ' || s[*p + *n - 1] == '\t')) (*n)--;
}

static long whole_ex(const unsigned char *s, Py_ssize_t len, int may_close) {
    Py_ssize_t i = 9;
    long status;
    long long length = -1;
    if (len < 13 || memcmp(s, "HTTP/1.1 ", 9) != 0) return 0;
    if (s[9] < '2' || s[9] > '5' || s[10] < '0' || s[10] > '9' || s[11] < '0' || s[11] > '9' ||
        s[12] != ' ')
        return 0;
    status = (s[9] - '0') * 100 + (s[10] - '0') * 10 + (s[11] - '0');
    if (status == 204 || status == 304) return 0;
    i = 13;
    while (i < len && VALUE_CHAR(s[i])) i++;
    if (i + 1 >= len || s[i] != '\r' || s[i + 1] != '\n') return 0;
    i += 2;
    for (;;) {
        Py_ssize_t name, name_len, value, value_len;
        if (i + 1 < len && s[i] == '\r' && s[i + 1] == '\n') {
            i += 2;
            break;
        }
        if (!header_line(s, len, &i, &name, &name_len, &value, &value_len)) return 0;
        if (name_is(s + name, name_len, "content-length")) {
            if (length >= 0) return 0; /* twice */
            trim(s, &value, &value_len);
            if (value_len < 1 || value_len > 18) return 0;
            length = 0;
            for (Py_ssize_t k = value; k < value + value_len; k++) {
                if (s[k] < '0' || s[k] > '9') return 0;
                length = length * 10 + (s[k] - '0');
            }
        } else if (name_is(s + name, name_len, "connection")) {
            trim(s, &value, &value_len);
            if (!name_is(s + value, value_len, "keep-alive") &&
                !(may_close && name_is(s + value, value_len, "close")))
                return 0;
        } else if (name_is(s + name, name_len, "transfer-encoding")) {
            return 0;
        }
    }
    if (length < 0 || (long long)(len - i) != length) return 0;
    return status;
}

static long whole(const unsigned char *s, Py_ssize_t len) { return whole_ex(s, len, 0); }

static PyObject *plain_request(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    Py_ssize_t max_headers = MAX_HEADERS;
    if (nargs < 1 || nargs > 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "plain_request(data: bytes, max_headers: int = 100)");
        return NULL;
    }
    if (nargs == 2) {
        max_headers = PyLong_AsSsize_t(args[1]);
        if (max_headers == -1 && PyErr_Occurred()) return NULL;
    }
    return PyLong_FromLong(
        plain((const unsigned char *)PyBytes_AS_STRING(args[0]), PyBytes_GET_SIZE(args[0]),
              max_headers));
}

static PyObject *whole_response(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "bytes expected");
        return NULL;
    }
    return PyLong_FromLong(
        whole((const unsigned char *)PyBytes_AS_STRING(arg), PyBytes_GET_SIZE(arg)));
}


/* ---- The fast path's two protocol objects (dataplane/http.py and
 * dataplane/upstream.py subclass them; without this module their Python
 * bases do the same). FastProxy.data_received makes the first try of a
 * plain request - route, pooled connection, counters, the request written,
 * its per-try deadline - and FastUpstream.data_received forwards a whole
 * response and pools the connection again, without a Python call between
 * them. Anything else (no pooled connection, a route without a first-try
 * chooser, a retried status, a split or chunked response, any field not of
 * the type expected) calls the Python methods that do it: _fast, _parse,
 * fast_whole. Each step here mirrors those methods line for line. */

/* ---- Counters: one upstream's counts on one listener (dataplane/counters.py
 * says what they mean; PyCounters is its Python twin, same fields). The fast
 * path counts a success here without a Python call; every error is counted
 * by the Python path (dataplane/counters.py: error). */
/* answered hops by latency (dataplane/counters.py's LATENCY_BOUNDS, seconds) */
#define LAT_N 24
static const double lat_bounds[LAT_N - 1] = {
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1,    0.15,  0.2,   0.3,   0.5,   0.75,   1.0,  2.0,   5.0,  10.0, 30.0};

typedef struct {
    PyObject_HEAD
    long long served, errors, gateway;
    long run, gateway_run, peak, peak_gateway;
    long trip, trip_gateway; /* the outlier detector's thresholds of these runs (0: none) */
    PyObject *kinds, *run_kinds, *peak_kinds; /* dict, list, list */
    long long lat[LAT_N];
} Counters;

static double monotonic_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* (time.monotonic()'s clock) */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void counters_latency(Counters *c, double seconds) {
    int i = 0;
    while (i < LAT_N - 1 && seconds > lat_bounds[i]) i++;
    c->lat[i] += 1;
}

static PyObject *counters_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    (void)args;
    (void)kwds;
    Counters *self = (Counters *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->kinds = PyDict_New();
    self->run_kinds = PyList_New(0);
    self->peak_kinds = PyList_New(0);
    if (self->kinds == NULL || self->run_kinds == NULL || self->peak_kinds == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int counters_traverse(Counters *self, visitproc visit, void *arg) {
    Py_VISIT(self->kinds);
    Py_VISIT(self->run_kinds);
    Py_VISIT(self->peak_kinds);
    return 0;
}

static int counters_clear(Counters *self) {
    Py_CLEAR(self->kinds);
    Py_CLEAR(self->run_kinds);
    Py_CLEAR(self->peak_kinds);
    return 0;
}

static void counters_dealloc(Counters *self) {
    PyObject_GC_UnTrack(self);
    counters_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject CountersType;

/* dataplane/counters.py's success(): one hop that went well */
static int counters_success(Counters *c) {
    c->served += 1;
    c->run = 0;
    c->gateway_run = 0;
    if (c->run_kinds != NULL && PyList_Check(c->run_kinds) && PyList_GET_SIZE(c->run_kinds))
        return PyList_SetSlice(c->run_kinds, 0, PY_SSIZE_T_MAX, NULL);
    return 0;
}

static PyObject *counters_add_latency(Counters *self, PyObject *arg) {
    double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred()) return NULL;
    counters_latency(self, seconds);
    Py_RETURN_NONE;
}

static PyObject *counters_get_lat(Counters *self, void *closure) {
    (void)closure;
    PyObject *out = PyTuple_New(LAT_N);
    if (out == NULL) return NULL;
    for (int i = 0; i < LAT_N; i++) {
        PyObject *n = PyLong_FromLongLong(self->lat[i]);
        if (n == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, n);
    }
    return out;
}

static PyMethodDef counters_methods[] = {
    {"add_latency", (PyCFunction)counters_add_latency, METH_O,
     "An answered hop's latency, in seconds."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef counters_getset[] = {
    {"lat", (getter)counters_get_lat, NULL, "Answered hops per latency bucket, in all.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef counters_members[] = {
    {"served", T_LONGLONG, offsetof(Counters, served), 0, NULL},
    {"errors", T_LONGLONG, offsetof(Counters, errors), 0, NULL},
    {"gateway", T_LONGLONG, offsetof(Counters, gateway), 0, NULL},
    {"run", T_LONG, offsetof(Counters, run), 0, NULL},
    {"gateway_run", T_LONG, offsetof(Counters, gateway_run), 0, NULL},
    {"peak", T_LONG, offsetof(Counters, peak), 0, NULL},
    {"peak_gateway", T_LONG, offsetof(Counters, peak_gateway), 0, NULL},
    {"trip", T_LONG, offsetof(Counters, trip), 0, NULL},
    {"trip_gateway", T_LONG, offsetof(Counters, trip_gateway), 0, NULL},
    {"kinds", T_OBJECT_EX, offsetof(Counters, kinds), 0, NULL},
    {"run_kinds", T_OBJECT_EX, offsetof(Counters, run_kinds), 0, NULL},
    {"peak_kinds", T_OBJECT_EX, offsetof(Counters, peak_kinds), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject CountersType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "healthgate._speedups.Counters",
    .tp_doc = "One upstream's counts on one listener (dataplane/counters.py's PyCounters, in C).",
    .tp_basicsize = sizeof(Counters),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = counters_new,
    .tp_dealloc = (destructor)counters_dealloc,
    .tp_traverse = (traverseproc)counters_traverse,
    .tp_clear = (inquiry)counters_clear,
    .tp_free = PyObject_GC_Del,
    .tp_members = counters_members,
    .tp_methods = counters_methods,
    .tp_getset = counters_getset,
};

/* ---- Gauge: requests in flight on one listener (dataplane/retry.py's
 * RetryBudget reads it; PyGauge is its Python twin). The fast path counts
 * its exchange here, up when it starts and down when it ends. */
typedef struct {
    PyObject_HEAD
    long long n;
} Gauge;

static PyMemberDef gauge_members[] = {
    {"n", T_LONGLONG, offsetof(Gauge, n), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject GaugeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "healthgate._speedups.Gauge",
    .tp_doc = "Requests in flight on one listener (dataplane/retry.py's PyGauge, in C).",
    .tp_basicsize = sizeof(Gauge),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_members = gauge_members,
};

static PyObject *s_write, *s_is_closing, *s_close, *s_fast, *s_parse, *s_fast_whole,
    *s_wake_worker, *s_add, *s_timer, *s_tick, *s_requests, *s_fast_path, *s_served;

typedef struct {
    PyObject_HEAD
    PyObject *address, *transport, *owner, *sink;
    int status;
    char closed, reused, head_only, got_bytes;
    double t0; /* when the exchange's request was sent (time.monotonic()) */
} Upstream;

typedef struct {
    PyObject_HEAD
    PyObject *transport, *first, *current, *queue, *upstream, *active, *stats, *upstreams, *idle,
        *pending, *deadlines, *loop, *xff, *fast_request, *fast_groups, *fast_region,
        *fast_counted, *pin, *gauge;
    Py_ssize_t max_head, max_idle, max_headers;
    char inflight, touched, closed;
} Proxy;

static PyTypeObject UpstreamType, ProxyType;

#define UPSTREAM_FIELDS(X) X(address) X(transport) X(owner) X(sink)
#define PROXY_FIELDS(X)                                                                 \
    X(transport) X(first) X(current) X(queue) X(upstream) X(active) X(stats) X(upstreams) \
    X(idle) \
    X(pending) X(deadlines) X(loop) X(xff) X(fast_request) X(fast_groups) X(fast_region) \
    X(fast_counted) X(pin) X(gauge)

/* every object field starts as None (never NULL while the object lives) */
#define SET_NONE(f) self->f = Py_NewRef(Py_None);
#define VISIT(f) Py_VISIT(self->f);
#define TO_NONE(f) Py_XSETREF(self->f, Py_NewRef(Py_None));
#define TO_NULL(f) Py_CLEAR(self->f);

/* new (every field None), traverse, clear (to None), dealloc of one type */
#define LIFECYCLE(prefix, Type, FIELDS)                                               \
    static PyObject *prefix##_new(PyTypeObject *type, PyObject *args, PyObject *kwds) { \
        (void)args;                                                                   \
        (void)kwds;                                                                   \
        Type *self = (Type *)type->tp_alloc(type, 0);                                 \
        if (self != NULL) {                                                           \
            FIELDS(SET_NONE)                                                          \
        }                                                                             \
        return (PyObject *)self;                                                      \
    }                                                                                 \
    static int prefix##_traverse(Type *self, visitproc visit, void *arg) {            \
        FIELDS(VISIT)                                                                 \
        return 0;                                                                     \
    }                                                                                 \
    static int prefix##_clear(Type *self) {                                           \
        FIELDS(TO_NONE)                                                               \
        return 0;                                                                     \
    }                                                                                 \
    static void prefix##_dealloc(Type *self) {                                        \
        PyObject_GC_UnTrack(self);                                                    \
        FIELDS(TO_NULL)                                                               \
        Py_TYPE(self)->tp_free((PyObject *)self);                                     \
    }

LIFECYCLE(upstream, Upstream, UPSTREAM_FIELDS)
LIFECYCLE(proxy, Proxy, PROXY_FIELDS)

/* d[key] = d.get(key, 0) + 1 */
static int count_up(PyObject *d, PyObject *key) {
    PyObject *old = PyDict_GetItemWithError(d, key), *new;
    if (old == NULL) {
        if (PyErr_Occurred()) return -1;
        new = PyLong_FromLong(1);
    } else {
        PyObject *one = PyLong_FromLong(1);
        new = PyNumber_Add(old, one);
        Py_DECREF(one);
    }
    if (new == NULL) return -1;
    int r = PyDict_SetItem(d, key, new);
    Py_DECREF(new);
    return r;
}

/* count_down (dataplane/tcp.py): one fewer in flight to `key` */
static int count_down(PyObject *d, PyObject *key) {
    PyObject *old = PyDict_GetItemWithError(d, key);
    if (old == NULL) return PyErr_Occurred() ? -1 : 0; /* (1 - 1: nothing to remove) */
    long left = PyLong_AsLong(old);
    if (left == -1 && PyErr_Occurred()) return -1;
    left -= 1;
    if (left > 0) {
        PyObject *new = PyLong_FromLong(left);
        if (new == NULL) return -1;
        int r = PyDict_SetItem(d, key, new);
        Py_DECREF(new);
        return r;
    }
    return PyDict_DelItem(d, key);
}

/* transport.is_closing(): 1, 0 or -1 */
static int is_closing(PyObject *transport) {
    Py_INCREF(transport); /* (held across the call, as every object called below) */
    PyObject *r = PyObject_CallMethodNoArgs(transport, s_is_closing);
    Py_DECREF(transport);
    if (r == NULL) return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

static int call_drop(PyObject *result) {
    if (result == NULL) return -1;
    Py_DECREF(result);
    return 0;
}

/* target.name(arg), holding target across the call */
static int call_one(PyObject *target, PyObject *name, PyObject *arg) {
    Py_INCREF(target);
    int r = call_drop(PyObject_CallMethodOneArg(target, name, arg));
    Py_DECREF(target);
    return r;
}

/* UpstreamPool.idle: a pooled connection to `address` (a new reference), or NULL */
static int pool_idle(PyObject *idle, PyObject *address, Upstream **out) {
    *out = NULL;
    PyObject *conns = PyDict_GetItemWithError(idle, address);
    if (conns == NULL) return PyErr_Occurred() ? -1 : 0;
    if (!PyList_Check(conns)) {
        PyErr_SetString(PyExc_TypeError, "the pool's idle connections are not a list");
        return -1;
    }
    Py_ssize_t n;
    int found = 0;
    Py_INCREF(conns); /* (held across is_closing, which runs the transport's code) */
    while ((n = PyList_GET_SIZE(conns)) > 0) {
        PyObject *c = Py_NewRef(PyList_GET_ITEM(conns, n - 1));
        if (PyList_SetSlice(conns, n - 1, n, NULL) < 0) {
            Py_DECREF(c);
            found = -1;
            break;
        }
        if (!PyObject_TypeCheck(c, &UpstreamType)) {
            Py_DECREF(c);
            PyErr_SetString(PyExc_TypeError, "a pooled connection is not an UpstreamConnection");
            found = -1;
            break;
        }
        Upstream *u = (Upstream *)c;
        if (!u->closed && u->transport != Py_None) {
            int closing = is_closing(u->transport);
            if (closing < 0) {
                Py_DECREF(c);
                found = -1;
                break;
            }
            if (!closing) {
                u->reused = 1;
                *out = u;
                found = 1;
                break;
            }
        }
        Py_DECREF(c);
    }
    Py_DECREF(conns);
    return found;
}

/* UpstreamPool.release */
static int pool_release(Proxy *self, Upstream *conn) {
    PyObject *conns = PyDict_GetItemWithError(self->idle, conn->address);
    if (conns == NULL) {
        if (PyErr_Occurred()) return -1;
        conns = PyList_New(0);
        if (conns == NULL) return -1;
        int r = PyDict_SetItem(self->idle, conn->address, conns);
        Py_DECREF(conns); /* (the dict holds it) */
        if (r < 0) return -1;
    } else if (!PyList_Check(conns)) {
        PyErr_SetString(PyExc_TypeError, "the pool's idle connections are not a list");
        return -1;
    }
    if (conn->closed || PyList_GET_SIZE(conns) >= self->max_idle) {
        if (conn->transport == Py_None) return 0;
        PyObject *transport = Py_NewRef(conn->transport);
        int r = call_drop(PyObject_CallMethodNoArgs(transport, s_close));
        Py_DECREF(transport);
        return r;
    }
    Py_SETREF(conn->sink, Py_NewRef(Py_None));
    return PyList_Append(conns, (PyObject *)conn);
}

/* HttpProxy._fast_end */
static int proxy_fast_end(Proxy *self) {
    if (PyDict_DelItem(self->pending, (PyObject *)self) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError)) return -1;
        PyErr_Clear();
    }
    if (self->fast_counted != Py_None && self->active != Py_None) {
        if (count_down(self->active, self->fast_counted) < 0) return -1;
        Py_SETREF(self->fast_counted, Py_NewRef(Py_None));
    }
    Py_SETREF(self->upstream, Py_NewRef(Py_None));
    if (self->inflight && Py_IS_TYPE(self->gauge, &GaugeType)) ((Gauge *)self->gauge)->n -= 1;
    self->inflight = 0;
    return 0;
}

/* the fields the C path reads are of the types it expects (else the Python path) */
static int proxy_shaped(Proxy *self) {
    return PyDict_Check(self->stats) && PyDict_Check(self->upstreams) &&
           PyDict_Check(self->idle) &&
           PyDict_Check(self->pending) && PyBytes_Check(self->xff) &&
           (self->active == Py_None || PyDict_Check(self->active)) && self->first != Py_None;
}

/* HttpProxy._fast with a first-try chooser: 1 sent, 0 the general path, -1 error */
static int proxy_fast(Proxy *self, PyObject *data, int head_only) {
    PyObject *choice = PyObject_CallOneArg(self->first, data); /* (the request: affinity) */
    if (choice == NULL) return -1;
    if (choice == Py_None) {
        Py_DECREF(choice);
        return 0;
    }
    if (!PyTuple_Check(choice) || PyTuple_GET_SIZE(choice) != 2) {
        Py_DECREF(choice);
        PyErr_SetString(PyExc_TypeError, "first(data) must give (address, region) or None");
        return -1;
    }
    if (!PyBytes_Check(self->xff)) { /* (the chooser's code ran since proxy_shaped) */
        Py_DECREF(choice);
        PyErr_SetString(PyExc_TypeError, "_xff must be bytes");
        return -1;
    }
    PyObject *address = PyTuple_GET_ITEM(choice, 0), *region = PyTuple_GET_ITEM(choice, 1);
    Upstream *conn;
    int found = pool_idle(self->idle, address, &conn);
    if (found <= 0) {
        if (found == 0) Py_SETREF(self->pin, Py_NewRef(address));
        Py_DECREF(choice);
        return found;
    }
    PyObject *request = NULL, *deadlines = NULL;
    if (count_up(self->stats, s_requests) < 0 || count_up(self->stats, s_fast_path) < 0)
        goto error;
    Py_ssize_t n = PyBytes_GET_SIZE(data) - 2, x = PyBytes_GET_SIZE(self->xff);
    request = PyBytes_FromStringAndSize(NULL, n + x);
    if (request == NULL) goto error;
    memcpy(PyBytes_AS_STRING(request), PyBytes_AS_STRING(data), n);
    memcpy(PyBytes_AS_STRING(request) + n, PyBytes_AS_STRING(self->xff), x);
    self->inflight = 1;
    if (Py_IS_TYPE(self->gauge, &GaugeType)) ((Gauge *)self->gauge)->n += 1;
    Py_SETREF(self->upstream, Py_NewRef((PyObject *)conn));
    Py_SETREF(self->fast_request, Py_NewRef(request));
    Py_SETREF(self->fast_groups, Py_NewRef(Py_None));
    Py_SETREF(self->fast_region, Py_NewRef(region));
    if (self->active != Py_None) {
        if (count_up(self->active, address) < 0) goto error;
        Py_SETREF(self->fast_counted, Py_NewRef(address));
    }
    /* UpstreamConnection.start_fast */
    Py_SETREF(conn->owner, Py_NewRef((PyObject *)self));
    conn->head_only = (char)head_only;
    conn->got_bytes = 0;
    conn->status = 0;
    conn->t0 = monotonic_now();
    if (call_one(conn->transport, s_write, request) < 0) goto error;
    /* TryDeadlines.add */
    deadlines = Py_NewRef(self->deadlines);
    PyObject *timer = PyObject_GetAttr(deadlines, s_timer);
    if (timer == NULL) goto error;
    int idle_timer = timer == Py_None;
    Py_DECREF(timer);
    if (idle_timer) {
        if (call_drop(PyObject_CallMethodObjArgs(deadlines, s_add, (PyObject *)self, self->loop,
                                                 NULL)) < 0)
            goto error;
    } else {
        PyObject *tick = PyObject_GetAttr(deadlines, s_tick);
        if (tick == NULL) goto error;
        int r = PyDict_SetItem(self->pending, (PyObject *)self, tick);
        Py_DECREF(tick);
        if (r < 0) goto error;
    }
    Py_DECREF(deadlines);
    Py_DECREF(request);
    Py_DECREF(conn);
    Py_DECREF(choice);
    return 1;
error:
    Py_XDECREF(request);
    Py_XDECREF(deadlines);
    Py_DECREF(conn);
    Py_DECREF(choice);
    return -1;
}

static PyObject *proxy_data_received(Proxy *self, PyObject *data) {
    self->touched = 1; /* (the idle timeout counts from the guard's next sweep) */
    if (!self->inflight && self->current == Py_None && PyBytes_Check(data) &&
        PyBytes_GET_SIZE(data) <= self->max_head) {
        Py_ssize_t queued = PyObject_Length(self->queue);
        if (queued < 0) return NULL;
        long plain_method = queued ? 0
                                   : plain((const unsigned char *)PyBytes_AS_STRING(data),
                                           PyBytes_GET_SIZE(data), self->max_headers);
        if (plain_method) {
            int sent;
            if (proxy_shaped(self)) {
                sent = proxy_fast(self, data, plain_method == 2);
            } else {
                PyObject *r = PyObject_CallMethodObjArgs((PyObject *)self, s_fast, data,
                                                         plain_method == 2 ? Py_True : Py_False,
                                                         NULL);
                if (r == NULL) return NULL;
                sent = PyObject_IsTrue(r);
                Py_DECREF(r);
            }
            if (sent < 0) return NULL;
            if (sent) Py_RETURN_NONE;
        }
    }
    return PyObject_CallMethodOneArg((PyObject *)self, s_parse, data);
}

/* a success of `conn`'s upstream on this listener, and its latency: its
 * Counters, else HttpProxy._served */
static int count_served(Proxy *self, Upstream *conn) {
    PyObject *c = PyDict_GetItemWithError(self->upstreams, conn->address);
    if (c == NULL && PyErr_Occurred()) return -1;
    if (c != NULL && Py_IS_TYPE(c, &CountersType)) {
        counters_latency((Counters *)c, monotonic_now() - conn->t0);
        return counters_success((Counters *)c);
    }
    return call_one((PyObject *)self, s_served, conn->address);
}

/* HttpProxy.fast_whole, for an answer below 500 */
static int proxy_fast_whole(Proxy *self, Upstream *conn, PyObject *data) {
    if (pool_release(self, conn) < 0) return -1;
    if (!self->closed && self->transport != Py_None) {
        PyObject *client = Py_NewRef(self->transport);
        int closing = is_closing(client);
        int r = closing;
        if (closing == 0) {
            r = call_one(client, s_write, data);
            if (r == 0) r = count_served(self, conn);
        }
        Py_DECREF(client);
        if (r < 0) return -1;
    }
    if (proxy_fast_end(self) < 0) return -1;
    Py_ssize_t queued = PyObject_Length(self->queue);
    if (queued < 0) return -1;
    if (queued) return call_drop(PyObject_CallMethodNoArgs((PyObject *)self, s_wake_worker));
    return 0;
}

static PyObject *upstream_data_received(Upstream *self, PyObject *data) {
    int first = !self->got_bytes; /* (only an exchange's first read may be whole) */
    self->got_bytes = 1;
    if (first && self->owner != Py_None && !self->head_only && self->sink == Py_None &&
        PyBytes_Check(data)) {
        /* the usual answer to a fast-path request: one whole response in one read */
        long status = whole((const unsigned char *)PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data));
        if (status) {
            PyObject *owner = self->owner; /* (its reference, moved here) */
            int r;
            self->status = (int)status;
            self->owner = Py_NewRef(Py_None);
            /* (an answer of 500 or more is an error: the Python path counts it) */
            if (PyObject_TypeCheck(owner, &ProxyType) && status < 500 &&
                proxy_shaped((Proxy *)owner)) {
                r = proxy_fast_whole((Proxy *)owner, self, data);
            } else {
                PyObject *code = PyLong_FromLong(status);
                r = code == NULL ? -1
                                 : call_drop(PyObject_CallMethodObjArgs(owner, s_fast_whole,
                                                                        (PyObject *)self, data,
                                                                        code, NULL));
                Py_XDECREF(code);
            }
            Py_DECREF(owner);
            if (r < 0) return NULL;
            Py_RETURN_NONE;
        }
    }
    return PyObject_CallMethodOneArg((PyObject *)self, s_parse, data);
}

static PyMethodDef upstream_methods[] = {
    {"data_received", (PyCFunction)upstream_data_received, METH_O,
     "A read from the upstream: a whole response to a fast-path request is forwarded here; "
     "anything else goes to _parse."},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef proxy_methods[] = {
    {"data_received", (PyCFunction)proxy_data_received, METH_O,
     "A read from the client: a plain request's first try is made here; anything else "
     "goes to _fast (no first-try chooser) or _parse."},
    {NULL, NULL, 0, NULL},
};

#define OBJ(name, type, field) {name, T_OBJECT, offsetof(type, field), 0, NULL}
#define FLAG(name, type, field) {name, T_BOOL, offsetof(type, field), 0, NULL}

static PyMemberDef upstream_members[] = {
    OBJ("address", Upstream, address),
    OBJ("transport", Upstream, transport),
    OBJ("owner", Upstream, owner),
    OBJ("sink", Upstream, sink),
    {"status", T_INT, offsetof(Upstream, status), 0, NULL},
    {"t0", T_DOUBLE, offsetof(Upstream, t0), 0, NULL},
    FLAG("closed", Upstream, closed),
    FLAG("reused", Upstream, reused),
    FLAG("head_only", Upstream, head_only),
    FLAG("got_bytes", Upstream, got_bytes),
    {NULL, 0, 0, 0, NULL},
};

static PyMemberDef proxy_members[] = {
    OBJ("transport", Proxy, transport),
    OBJ("first", Proxy, first),
    OBJ("current", Proxy, current),
    OBJ("queue", Proxy, queue),
    OBJ("upstream", Proxy, upstream),
    OBJ("active", Proxy, active),
    OBJ("stats", Proxy, stats),
    OBJ("upstreams", Proxy, upstreams),
    OBJ("_idle", Proxy, idle),
    OBJ("_pending", Proxy, pending),
    OBJ("_deadlines", Proxy, deadlines),
    OBJ("loop", Proxy, loop),
    OBJ("_xff", Proxy, xff),
    OBJ("_fast_request", Proxy, fast_request),
    OBJ("_fast_groups", Proxy, fast_groups),
    OBJ("_fast_region", Proxy, fast_region),
    OBJ("_fast_counted", Proxy, fast_counted),
    OBJ("_pin", Proxy, pin),
    OBJ("_gauge", Proxy, gauge),
    {"_max_head", T_PYSSIZET, offsetof(Proxy, max_head), 0, NULL},
    {"_max_idle", T_PYSSIZET, offsetof(Proxy, max_idle), 0, NULL},
    {"_max_headers", T_PYSSIZET, offsetof(Proxy, max_headers), 0, NULL},
    FLAG("inflight", Proxy, inflight),
    FLAG("touched", Proxy, touched),
    FLAG("closed", Proxy, closed),
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject UpstreamType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "healthgate._speedups.FastUpstream",
    .tp_doc = "The C part of dataplane/upstream.py's UpstreamConnection.",
    .tp_basicsize = sizeof(Upstream),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = upstream_new,
    .tp_dealloc = (destructor)upstream_dealloc,
    .tp_traverse = (traverseproc)upstream_traverse,
    .tp_clear = (inquiry)upstream_clear,
    .tp_free = PyObject_GC_Del,
    .tp_methods = upstream_methods,
    .tp_members = upstream_members,
};

static PyTypeObject ProxyType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "healthgate._speedups.FastProxy",
    .tp_doc = "The C part of dataplane/http.py's HttpProxy.",
    .tp_basicsize = sizeof(Proxy),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = proxy_new,
    .tp_dealloc = (destructor)proxy_dealloc,
    .tp_traverse = (traverseproc)proxy_traverse,
    .tp_clear = (inquiry)proxy_clear,
    .tp_free = PyObject_GC_Del,
    .tp_methods = proxy_methods,
    .tp_members = proxy_members,
};

/* ---- The batch prober's two system calls per TCP check (probes/batch.py):
 * connect a pooled non-blocking socket to an address packed once per
 * endpoint, and dissolve the association again (connect to AF_UNSPEC: the
 * kernel sends the RST and the socket can be connected anew). Python's
 * connect_ex parses an address tuple per call, and ctypes costs ~0.4 us;
 * each of these is one system call. They return 0 or the errno. */

static int fd_arg(PyObject *arg, int *fd) {
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || v > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "not a file descriptor");
        return -1;
    }
    *fd = (int)v;
    return 0;
}

static PyObject *connect_fd(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int fd;
    if (nargs != 2 || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "connect_fd(fd: int, address: bytes)");
        return NULL;
    }
    if (fd_arg(args[0], &fd) < 0) return NULL;
    Py_ssize_t len = PyBytes_GET_SIZE(args[1]);
    if (len != sizeof(struct sockaddr_in) && len != sizeof(struct sockaddr_in6)) {
        PyErr_SetString(PyExc_ValueError, "not a packed sockaddr_in or sockaddr_in6");
        return NULL;
    }
    int r = connect(fd, (const struct sockaddr *)PyBytes_AS_STRING(args[1]), (socklen_t)len);
    return PyLong_FromLong(r == 0 ? 0 : errno);
}

static PyObject *disconnect_fd(PyObject *self, PyObject *arg) {
    (void)self;
    int fd;
    if (fd_arg(arg, &fd) < 0) return NULL;
    struct sockaddr unspec;
    memset(&unspec, 0, sizeof unspec);
    unspec.sa_family = AF_UNSPEC;
    int r = connect(fd, &unspec, sizeof unspec);
    return PyLong_FromLong(r == 0 ? 0 : errno);
}

/* the kept-alive lane and the steady results' path (see there) */
#include "_kept.c"

static PyMethodDef methods[] = {
    {"plain_request", (PyCFunction)(void (*)(void))plain_request, METH_FASTCALL,
     "1 for a plain GET, 2 for a plain HEAD, 0 otherwise (see http_scan.py)."},
    {"connect_fd", (PyCFunction)(void (*)(void))connect_fd, METH_FASTCALL,
     "connect(fd, packed sockaddr): 0 or the errno (EINPROGRESS: under way)."},
    {"disconnect_fd", disconnect_fd, METH_O,
     "connect(fd, AF_UNSPEC): dissolve the association (a TCP reset); 0 or the errno."},
    {"whole_response", whole_response, METH_O,
     "The status of exactly one whole, reusable HTTP/1.1 response, or 0."},
    {"steady_table", (PyCFunction)(void (*)(void))steady_table, METH_FASTCALL,
     "Steady results into an endpoint table's arrays; the records not taken."},
    {"steady_history", (PyCFunction)(void (*)(void))steady_history, METH_FASTCALL,
     "Steady results into an outcome history's open runs; the records not taken."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "healthgate._speedups",
    "HTTP readers in C (healthgate/http_scan.py).", -1, methods,
};

#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;

PyMODINIT_FUNC PyInit__speedups(void) {
    init_tables();
    INTERN(s_write, "write")
    INTERN(s_is_closing, "is_closing")
    INTERN(s_close, "close")
    INTERN(s_fast, "_fast")
    INTERN(s_parse, "_parse")
    INTERN(s_fast_whole, "fast_whole")
    INTERN(s_wake_worker, "_wake_worker")
    INTERN(s_add, "add")
    INTERN(s_timer, "_timer")
    INTERN(s_tick, "tick")
    INTERN(s_requests, "requests")
    INTERN(s_fast_path, "fast_path")
    INTERN(s_served, "_served")
    INTERN(s_count, "count")
    INTERN(s_code, "code")
    INTERN(s_last, "last")
    if (PyType_Ready(&UpstreamType) < 0 || PyType_Ready(&ProxyType) < 0 ||
        PyType_Ready(&CountersType) < 0 || PyType_Ready(&GaugeType) < 0 || PyType_Ready(&LaneType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "FastUpstream", (PyObject *)&UpstreamType) < 0 ||
        PyModule_AddObjectRef(m, "FastProxy", (PyObject *)&ProxyType) < 0 ||
        PyModule_AddObjectRef(m, "Counters", (PyObject *)&CountersType) < 0 ||
        PyModule_AddObjectRef(m, "Gauge", (PyObject *)&GaugeType) < 0 ||
        PyModule_AddObjectRef(m, "KeptLane", (PyObject *)&LaneType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
