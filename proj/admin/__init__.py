"""`/admin`: the operator's web app (`proj admin`). See `proj.admin.app` and `proj.admin.timeline`.

Importing this package stays cheap (no web framework), so kind modules can register timeline
hooks from `proj.admin.timeline` without pulling FastAPI into workers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI


def create_app(*args: Any, **kwargs: Any) -> FastAPI:
    """Build the admin ASGI app (lazy import of `proj.admin.app.create_app`)."""
    from proj.admin.app import create_app as _create

    return _create(*args, **kwargs)


__all__ = ["create_app"]
