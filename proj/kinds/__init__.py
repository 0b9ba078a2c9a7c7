"""The service's kinds. Importing this package registers them with the engine."""

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
