"""The service's kinds. Importing this package registers them with the engine, and their
/admin timeline hooks (`proj.acquisition.timeline`)."""

from proj.acquisition import timeline as _timeline  # noqa: F401
from proj.kinds import (  # noqa: F401
    acquire,
    compensate,
    demo,
    importing,
    notify,
    purge,
    reconcile_downloads,
    relocate,
    retire_seed,
    verify_library,
)
