"""Operation ledger: every external side effect happens once (DESIGN.md invariant 4).

Usable by any SQLAlchemy 2 / Postgres project; it imports nothing from `proj`.

Public API::

    from ledger import run_operation, Done, NotDone, Attempt, CommitRefused

    result = run_operation(
        session_factory,            # () -> Session, e.g. a sessionmaker
        "copy:/library/film.mkv",   # op key: names the effect in the outside world
        plan={"src": ..., "dst": ..., "sha256": ...},
        effect=do_copy,             # (Attempt) -> JSON result
        reconcile=check_copy,       # (Attempt) -> Done(result) | NotDone()
        run_id=..., step=..., effect_kind="file",
        fence=None,                 # (Session) -> None, raises when the caller's lease is gone
    )

- A stored result is returned without calling anything.
- An attempt without a result (its worker died, or froze) is taken over with a new token and
  `reconcile` decides: `Done(result)` finishes it, `NotDone()` redoes the effect.
- The result commit is fenced by the attempt token (and `fence`): a superseded attempt gets
  `CommitRefused`, and the stored row is untouched.

Errors: `CommitRefused`, `PlanConflict` (same key, other plan), `AttemptInProgress`
(`takeover_after_s`), `BadOperation` (bad key, plan or result that is not JSON).
Table: `ledger.asset_operation` (`ledger.models.AssetOperation`, metadata `ledger.models.Base`).
"""

from ledger.errors import AttemptInProgress, BadOperation, CommitRefused, LedgerError, PlanConflict
from ledger.models import AssetOperation, Base, OperationStatus, Resolution
from ledger.operation import (
    Attempt,
    Done,
    Fence,
    NotDone,
    SessionFactory,
    get_operation,
    run_operation,
    to_json,
)

__all__ = [
    "AssetOperation",
    "Attempt",
    "AttemptInProgress",
    "BadOperation",
    "Base",
    "CommitRefused",
    "Done",
    "Fence",
    "LedgerError",
    "NotDone",
    "OperationStatus",
    "PlanConflict",
    "Resolution",
    "SessionFactory",
    "get_operation",
    "run_operation",
    "to_json",
]
