"""The retry decision of the L7 front end, as the table in dataplane/retry.py."""

import pytest

from healthgate.dataplane.retry import NextTry, next_try

NEXT_ENDPOINT, NEXT_REGION, GIVE_UP = NextTry.NEXT_ENDPOINT, NextTry.NEXT_REGION, NextTry.GIVE_UP


@pytest.mark.parametrize(
    ("idempotent", "sent", "timed_out", "expected"),
    [
        (True, False, False, NEXT_ENDPOINT),  # a refused connect
        (True, True, False, NEXT_ENDPOINT),  # a reset, or a 503 to retry
        (True, True, True, NEXT_REGION),  # the region hangs
        (True, False, True, NEXT_REGION),  # a connect that hung
        (False, False, False, NEXT_ENDPOINT),  # nothing reached an upstream
        (False, False, True, NEXT_REGION),
        (False, True, False, GIVE_UP),  # a POST may have been acted on
        (False, True, True, GIVE_UP),
    ],
)
def test_next_try(idempotent: bool, sent: bool, timed_out: bool, expected: NextTry) -> None:
    assert next_try(idempotent, sent, timed_out) is expected
