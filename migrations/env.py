"""Alembic environment: one DATABASE_URL for engine, ledger, outbox and business schemas."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from proj.settings import get_settings, sqlalchemy_url

config = context.config


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or ""
    return sqlalchemy_url(url) if url else get_settings().require_database_url()


def run_migrations_offline() -> None:
    context.configure(url=_url(), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


# Held for the whole upgrade, so that `proj migrate` started by several processes at once (the
# compose `migrate` service beside a `docker compose run migrate`, one replica per host) migrates
# once: the others wait, then read the version table and find nothing to do. One transaction
# (not one per migration): a transaction-scoped lock is released by the commit or the
# connection's end, even through a transaction pooler, and a failed upgrade leaves the schema
# where it was (tests/integration/test_compose_review.py::
# test_migrate_started_by_several_containers_at_once_migrates_once).
LOCK_MIGRATE = "SELECT pg_advisory_xact_lock(hashtextextended('proj:migrate', 0))"


def run_migrations_online() -> None:
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, transaction_per_migration=False)
        with context.begin_transaction():
            context.execute(LOCK_MIGRATE)
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
