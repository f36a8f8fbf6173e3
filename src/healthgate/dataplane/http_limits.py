"""What one client connection of an L7 front end may cost: the bounds of
:class:`HttpSettings`, each a named setting with a default
(docs/operations.md, "Limits and protections").

* **heads**: at most ``max_head_bytes``, counted as they arrive (431 beyond),
  whole within the guard's header timeout (408; dataplane/guard.py);
* **bodies**: at most ``max_body_bytes`` each (413 beyond), buffered so
  that a request can be retried in the next region;
* **pipelining**: at most ``max_pipelined`` requests waiting behind the one
  in flight; past that the connection stops being read until they drain;
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
