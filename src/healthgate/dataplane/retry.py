"""What a failed try of an HTTP request leads to: a pure decision.

The L7 front end tries a request at the first region's endpoints, then the
next region's, in failover order. After a try fails, what may be done next
depends only on what happened:

=============  ==========  ==========  ==================================
request        sent?       timed out?  next
=============  ==========  ==========  ==================================
idempotent     either      no          the next endpoint (same region)
idempotent     either      yes         the next region: a region that
                                       hangs is not waited on endpoint by
                                       endpoint
not idempotent no          no          the next endpoint: nothing reached
                                       an upstream, so nothing can repeat
not idempotent no          yes         the next region
not idempotent yes         either      give up (502): the upstream may
                                       have acted on it; never send twice
=============  ==========  ==========  ==================================

"Sent" means any byte of the request may have reached the upstream: a
failed connect is not sent; a timeout or reset after writing is.
"""

from __future__ import annotations

from enum import Enum


class NextTry(Enum):
    NEXT_ENDPOINT = "next endpoint"
    NEXT_REGION = "next region"
    GIVE_UP = "give up"


def next_try(idempotent: bool, sent: bool, timed_out: bool) -> NextTry:
    if sent and not idempotent:
        return NextTry.GIVE_UP
    if timed_out:
        return NextTry.NEXT_REGION
    return NextTry.NEXT_ENDPOINT
