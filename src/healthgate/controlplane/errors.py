"""Refusals: what the control plane says when it will not do something.

Every refusal carries a :class:`Refusal` kind; the API maps kinds to HTTP
codes (``api/errors.py``) and the CLI to exit codes. Nothing anywhere
decides by the text of a message.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

from healthgate.model.validation import Issue


class Refusal(Enum):
    INVALID = "invalid"  # the input is wrong (fields, references, rules)
    NOT_FOUND = "not found"
    CONFLICT = "conflict"  # it exists already
    IN_USE = "in use"  # others refer to what would be deleted
    PRECONDITION_FAILED = "precondition failed"  # a stale fingerprint
    UNSAFE = "unsafe"  # a shift the safety rule refuses, or a change to one that has ended
    UNAVAILABLE = "unavailable"  # the store cannot take writes now


class ControlError(Exception):
    """A refused request; the API turns it into its one error shape."""

    def __init__(self, kind: Refusal, message: str, details: Sequence[Issue] = ()) -> None:
        self.kind = kind
        self.message = message
        self.details = list(details)
        super().__init__(message)
