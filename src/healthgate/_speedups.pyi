# The C speedups (_speedups.c; http_scan.py says what they accept).
def plain_request(data: bytes, max_headers: int = 100, /) -> int: ...
def whole_response(data: bytes, /) -> int: ...

# The bases of dataplane/http.py's HttpProxy and dataplane/upstream.py's
# UpstreamConnection (their fields are declared there, on the Python bases
# that mypy reads: _PyFastEntry, _PyUpstreamEntry).
class FastProxy:
    def data_received(self, data: bytes, /) -> None: ...

class FastUpstream:
    def data_received(self, data: bytes, /) -> None: ...

# The batch prober's connect and disconnect (probes/batch.py): 0 or the errno.
def connect_fd(fd: int, address: bytes, /) -> int: ...
def disconnect_fd(fd: int, /) -> int: ...

# One upstream's counts on one listener (dataplane/counters.py's PyCounters).
class Counters:
    served: int
    errors: int
    gateway: int
    run: int
    gateway_run: int
    peak: int
    peak_gateway: int
    trip: int
    trip_gateway: int
    kinds: dict[str, int]
    run_kinds: list[str]
    peak_kinds: list[str]
    @property
    def lat(self) -> tuple[int, ...]: ...
    def add_latency(self, seconds: float, /) -> None: ...

# Requests in flight on one listener (dataplane/retry.py's PyGauge).
class Gauge:
    n: int
