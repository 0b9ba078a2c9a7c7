"""Durable Celery steps with ledger discipline, for a self-hosted media acquisition service."""

from proj.celery import app

__all__ = ("app",)
