"""`proj`: the operator's command line (migrate, runs, show, signal, cancel, resolve, demo …)."""

from __future__ import annotations

import json
import uuid

import typer
from rich.console import Console
from rich.table import Table

cli = typer.Typer(help="Durable Celery steps with ledger discipline.", no_args_is_help=True)
console = Console()


def migrate_to_head() -> str:
    """Upgrade the database to the newest migration; returns the head revision."""
    from alembic import command

    from proj.engine.preflight import alembic_config, head_revision
    from proj.settings import get_settings

    command.upgrade(alembic_config(get_settings().require_database_url()), "head")
    return head_revision()


@cli.command()
def migrate() -> None:
    """Apply database migrations (workers never migrate on start)."""
    head = migrate_to_head()
    console.print(f"[green]schema at {head}[/green]")


@cli.command()
def sweep() -> None:
    """Run one sweeper tick now (what beat does every SWEEP_INTERVAL_S)."""
    from proj.engine.sweeper import sweep as do_sweep

    console.print_json(json.dumps(do_sweep().__dict__))


@cli.command()
def show(run_id: str) -> None:
    """Show one run."""
    from proj.engine import runs

    view = runs.get(uuid.UUID(run_id))
    if view is None:
        console.print(f"[red]no run {run_id}[/red]")
        raise typer.Exit(1)
    console.print_json(json.dumps(view.__dict__, default=str))


@cli.command("runs")
def list_runs(kind: str | None = None, status: str | None = None, limit: int = typer.Option(20)) -> None:
    """List recent runs, newest first."""
    from sqlalchemy import text

    from proj import db

    where, params = ["true"], {"limit": limit}
    if kind:
        where.append("kind = :kind")
        params["kind"] = kind
    if status:
        where.append("status = :status")
        params["status"] = status
    with db.transaction() as s:
        rows = s.execute(
            text(
                "SELECT id, kind, version, status, current_step, created_at FROM engine.task_run "
                f"WHERE {' AND '.join(where)} ORDER BY created_at DESC LIMIT :limit"
            ),
            params,
        ).all()
    table = Table("run", "kind", "status", "step", "created")
    for r in rows:
        table.add_row(
            str(r.id),
            f"{r.kind}@{r.version}",
            r.status,
            r.current_step or "",
            r.created_at.isoformat(timespec="seconds"),
        )
    console.print(table)


@cli.command()
def signal(topic: str, payload: str = typer.Option("null", help="JSON payload")) -> None:
    """Store a signal and wake the runs waiting on TOPIC (e.g. qBittorrent's on-finish hook)."""
    from proj.engine import runs

    woken = runs.signal(topic, json.loads(payload))
    console.print(f"signal {topic}: {woken} run(s) woken")


@cli.command()
def cancel(run_id: str, reason: str = typer.Option("operator", help="why")) -> None:
    """Cancel a run: business first, then no further step starts."""
    from proj.engine import runs

    runs.cancel(uuid.UUID(run_id), reason)
    console.print(f"cancel requested for {run_id}")


@cli.command()
def resolve(
    run_id: str,
    retry: bool = typer.Option(False, "--retry", help="retry from the failed step"),
    abandon: bool = typer.Option(False, "--abandon", help="give up, with compensation"),
) -> None:
    """Decide a dead letter (a failed run)."""
    from proj.engine import runs

    if retry == abandon:
        console.print("[red]choose exactly one of --retry or --abandon[/red]")
        raise typer.Exit(2)
    rid = uuid.UUID(run_id)
    if retry:
        console.print(f"{runs.retry_failed(rid)} step(s) sent back to work")
    else:
        runs.abandon(rid, "operator")
        console.print("abandoned")


@cli.command("lock-steps")
def lock_steps() -> None:
    """Record step names per kind@version in proj/kinds/steps.lock.json (append-only)."""
    from proj.engine.versions import LOCK_PATH, write_lock

    merged = write_lock()
    console.print(f"{len(merged)} kind version(s) locked in {LOCK_PATH}")


@cli.command()
def demo(parts: int = typer.Option(4, help="fan-out width of the demo pipeline")) -> None:
    """Run the demo pipeline end to end (embedded Postgres and Redis when none are configured)."""
    from proj.demo import run_demo

    raise typer.Exit(run_demo(parts=parts))


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
