"""The Celery app the engine publishes and runs its in-process worker with.

Why a binding and not an import: the app imports every kind, and every kind imports the engine.
When the engine imported the app back, a kinds module whose first line was `from proj import db`
built the app (and its list of served queues) before its own kinds were declared, and its runs
stayed `pending` for ever (`tests/integration/test_wiring.py`). Now the wiring module
(`proj/celery.py`) builds the app and binds it here; the engine only asks for it.

A process that never imported the wiring (a script that declares kinds, then uses the port) gets
it on first use: `app()` imports the module named by `CELERY_APP` (default `proj.celery`), which
binds itself, as `celery -A proj` would find it.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

from proj.engine.errors import EngineNotWired
from proj.settings import get_settings

_lock = threading.Lock()
_bound: Any = None  # a celery.Celery: Celery ships no type information


def bind(app: Any) -> None:
    """Make `app` the one the engine publishes through (called by the wiring as it builds it)."""
    global _bound
    _bound = app


def bound() -> Any:
    """The bound app, or None when no wiring ran in this process yet."""
    return _bound


def app() -> Any:
    """The bound app; import the configured wiring first when nothing is bound yet."""
    if _bound is not None:
        return _bound
    with _lock:
        if _bound is None:
            module = get_settings().celery_app
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise EngineNotWired(
                    f"cannot import the Celery wiring {module!r} (CELERY_APP): {exc}"
                ) from exc
    if _bound is None:
        raise EngineNotWired(
            f"{get_settings().celery_app!r} (CELERY_APP) was imported but bound no app: "
            "it must call proj.engine.broker.bind(app)"
        )
    return _bound
