/* The HTTP readers of the L7 fast path and the batch HTTP checks, in C
 * (healthgate/http_scan.py says what they accept; tests/unit/test_http_scan.py
 * checks them against the Python reader, httptools and the probes' parse_head).
 *
 * plain_request(data: bytes) -> int   1 GET, 2 HEAD, 0 not a plain request
 * whole_response(data: bytes) -> int  the status of exactly one whole,
 *                                     reusable response, or 0
 *
 * Both only read `data`, never past its end, in one pass; neither allocates.
 * Built by the package's build hook (hatch_build.py) when a C compiler and
 * Python's headers are there; without them, the Python path runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

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
    "forwarded", "x-real-ip", NULL,
};

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

static long plain(const unsigned char *s, Py_ssize_t len) {
    long method;
    Py_ssize_t i;
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
            return i + 2 == len ? method : 0;
        if (!header_line(s, len, &i, &name, &name_len, &value, &value_len)) return 0;
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

static long whole(const unsigned char *s, Py_ssize_t len) {
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
            if (!name_is(s + value, value_len, "keep-alive")) return 0;
        } else if (name_is(s + name, name_len, "transfer-encoding")) {
            return 0;
        }
    }
    if (length < 0 || (long long)(len - i) != length) return 0;
    return status;
}

static PyObject *scan(PyObject *arg, long (*reader)(const unsigned char *, Py_ssize_t)) {
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "bytes expected");
        return NULL;
    }
    return PyLong_FromLong(
        reader((const unsigned char *)PyBytes_AS_STRING(arg), PyBytes_GET_SIZE(arg)));
}

static PyObject *plain_request(PyObject *self, PyObject *arg) {
    (void)self;
    return scan(arg, plain);
}

static PyObject *whole_response(PyObject *self, PyObject *arg) {
    (void)self;
    return scan(arg, whole);
}

static PyMethodDef methods[] = {
    {"plain_request", plain_request, METH_O,
     "1 for a plain GET, 2 for a plain HEAD, 0 otherwise (see http_scan.py)."},
    {"whole_response", whole_response, METH_O,
     "The status of exactly one whole, reusable HTTP/1.1 response, or 0."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "healthgate._speedups",
    "HTTP readers in C (healthgate/http_scan.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    init_tables();
    return PyModule_Create(&module);
}
