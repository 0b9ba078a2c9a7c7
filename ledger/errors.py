"""Typed errors of the ledger: each says what was refused and what was left untouched."""

from __future__ import annotations

import uuid


class LedgerError(Exception):
    """Base of every error the ledger raises on purpose."""


class CommitRefused(LedgerError):
    """This attempt may no longer write: a newer attempt owns the operation, or the caller's fence
    (its lease) is gone. Nothing was written; a stored result is untouched."""

    def __init__(self, op_key: str, token: uuid.UUID, action: str, why: str) -> None:
        super().__init__(
            f"ledger operation {op_key!r}: attempt {token} may not {action}: {why}; "
            "nothing was written and any stored result is untouched"
        )
        self.op_key = op_key
        self.token = token
        self.action = action
        self.why = why


class PlanConflict(LedgerError, ValueError):
    """The operation key is already planned with a different plan; the stored row is untouched."""

    def __init__(self, op_key: str, stored: object, given: object) -> None:
        super().__init__(
            f"ledger operation {op_key!r} is already planned as {stored!r}, not {given!r}: "
            "one key names one effect"
        )
        self.op_key = op_key
        self.stored = stored
        self.given = given


class AttemptInProgress(LedgerError):
    """An attempt younger than `takeover_after_s` exists; taking it over could double the effect."""


class BadOperation(LedgerError, ValueError):
    """An empty or oversized key, or a plan/result that is not JSON."""
