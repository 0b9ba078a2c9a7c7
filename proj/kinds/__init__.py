"""The service's kinds. Importing this package registers them with the engine."""

from proj.kinds import demo  # noqa: F401
