"""One SQLAlchemy engine per process, shared by the task engine and business code (invariant 12).

Prefork children must not share the parent's sockets, so `reset_after_fork()` is wired to Celery's
`worker_process_init` signal.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session, sessionmaker

from proj.settings import get_settings

_lock = threading.Lock()
_engine: Engine | None = None
_sessions: sessionmaker[Session] | None = None


def get_engine() -> Engine:
    """The process' engine, created lazily with the explicit pool budget."""
    global _engine, _sessions
    if _engine is None:
        with _lock:
            if _engine is None:
                s = get_settings()
                _engine = create_engine(
                    s.require_database_url(),
                    pool_size=s.db_pool_size,
                    max_overflow=s.db_max_overflow,
                    pool_pre_ping=True,
                    pool_recycle=1800,
                    connect_args={"application_name": "proj", "connect_timeout": 5},
                )
                _sessions = sessionmaker(_engine, expire_on_commit=False)
    return _engine


def sessions() -> sessionmaker[Session]:
    """Session factory bound to the process engine."""
    get_engine()
    assert _sessions is not None
    return _sessions


@contextmanager
def transaction() -> Iterator[Session]:
    """A session in one transaction: commit on success, rollback on error."""
    with sessions().begin() as session:
        yield session


def reset_after_fork() -> None:
    """Drop inherited pooled connections in a forked child (they belong to the parent)."""
    if _engine is not None:
        _engine.dispose(close=False)


def dispose() -> None:
    """Close the pool and forget the engine (tests that change DATABASE_URL)."""
    global _engine, _sessions
    with _lock:
        if _engine is not None:
            _engine.dispose()
        _engine = None
        _sessions = None
