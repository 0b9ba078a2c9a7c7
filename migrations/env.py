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


def run_migrations_online() -> None:
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, transaction_per_migration=True)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
