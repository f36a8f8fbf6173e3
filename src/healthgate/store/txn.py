"""The preconditions of a transaction, checked the same way by every store
that checks them itself (memory, SQLite): inside its transaction, before
anything is written."""

from __future__ import annotations

from collections.abc import Callable

from healthgate.store.base import EXISTS, PreconditionFailed, RevisionMoved, Txn


def check_txn(txn: Txn, revision: int, current: Callable[[str], int | None]) -> None:
    """Raise if ``txn`` may not commit on a store at ``revision`` whose
    documents have ``current(key)`` revisions (None: absent)."""
    if txn.base_revision is not None and txn.base_revision != revision:
        raise RevisionMoved(txn.base_revision, revision)
    for key, expected in txn.expect.items():
        actual = current(key)
        if expected == EXISTS:
            if actual is None:
                raise PreconditionFailed(key, expected, actual)
        elif actual != expected:
            raise PreconditionFailed(key, expected, actual)
