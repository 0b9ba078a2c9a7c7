"""Durable Celery steps with ledger discipline, for a self-hosted media acquisition service.

`proj.app` (what `celery -A proj` finds) is built on first access, not on `import proj`: a kinds
module that starts with `from proj import db` must be able to declare its kinds before the app
reads them (`tests/integration/test_wiring.py`).
"""

from __future__ import annotations

from typing import Any

__all__ = ("app",)


def __getattr__(name: str) -> Any:
    if name == "app":
        from proj.celery import app

        return app
    raise AttributeError(f"module 'proj' has no attribute {name!r}")
