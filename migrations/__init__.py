"""Alembic scripts of every schema (engine, ledger, outbox, acq); shipped with `proj` so an installed
wheel can `proj migrate` (`proj.engine.preflight.MIGRATIONS`)."""
