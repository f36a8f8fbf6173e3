"""What one client connection of an L7 front end may cost: the bounds of
:class:`HttpSettings`, each a named setting with a default
(docs/operations.md, "Limits and protections").

* **heads**: at most ``max_head_bytes``, counted as they arrive (431 beyond),
  whole within the guard's header timeout (408; dataplane/guard.py);
* **bodies**: at most ``max_body_bytes`` each (413 beyond), buffered so
  that a request can be retried in the next region; a body must arrive
  within ``body_timeout`` of its head, and a whole request within
  ``request_timeout`` of its first byte (408 beyond; time the front end
  itself stopped reading does not count);
* **buffered bytes**: a connection holds at most
  ``max_buffered_per_connection`` bytes of request bodies - the one being
  read and those waiting behind the request in flight; past that it is not
  read until they drain (back-pressure). All connections together hold at
  most the guard's ``max_buffered`` (dataplane/guard.py): a body that would
  pass it gets 503 and its connection is closed. Before these bounds, 33
  pipelined POSTs of 8 MiB on one connection, behind an upstream that reads
  and never answers, grew serve by 280 MiB (the 32 waiting requests were
  read whole); ~30 such connections would have had it killed;
* **pipelining**: at most ``max_pipelined`` requests waiting behind the one
  in flight - their heads counted with the buffered bytes - ; past that the
  connection stops being read, and what a read brought beyond is held
  unparsed, until they drain;
* **headers**: at most ``max_headers`` lines a request (431 beyond), a
  chunked body's trailers dropped (never merged into the head);
* **answers not read**: a client that stops reading an answer for
  ``write_timeout`` seconds is disconnected;
* **tries**: ``per_try_timeout`` to the first byte of a response,
  ``connect_timeout`` to an upstream connection; ``max_idle_per_upstream``
  pooled connections per upstream address.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HttpSettings:
    per_try_timeout: float = 2.0  # seconds to the first byte of the response
    connect_timeout: float = 1.0
    max_body_bytes: int = 8 * 1024 * 1024
    max_head_bytes: int = 64 * 1024
    max_pipelined: int = 32
    max_idle_per_upstream: int = 64
    max_buffered_per_connection: int = 16 * 1024 * 1024  # (at least one whole body)
    body_timeout: float = 30.0
    request_timeout: float = 60.0
    max_headers: int = 100  # header lines per request (431 beyond; trailers dropped)
    # an answer the client does not read: its connection is closed this long
    # after the client stopped reading (what it held is freed)
    write_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.max_buffered_per_connection < self.max_body_bytes:
            object.__setattr__(self, "max_buffered_per_connection", self.max_body_bytes)
