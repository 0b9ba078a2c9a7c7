"""`proj`: the operator's command line (migrate, runs, show, signal, cancel, resolve, demo …)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from proj import logs
from proj.engine.preflight import migrate_to_head

cli = typer.Typer(help="Durable Celery steps with ledger discipline.", no_args_is_help=True)
console = Console(emoji=False, highlight=False)
errors = Console(emoji=False, highlight=False, stderr=True, soft_wrap=True)

__all__ = ["cli", "error_line", "main", "migrate_to_head"]


@cli.command()
def migrate() -> None:
    """Apply database migrations (workers never migrate on start)."""
    from alembic.util.exc import CommandError

    try:
        with console.status("migrating the database …"):
            head = migrate_to_head()
    except CommandError as exc:
        # The version table names a revision this code has no script for: a newer version
        # migrated the database (a rollback to the previous image after an upgrade).
        if "Can't locate revision" not in str(exc):
            raise
        errors.print(
            f"[red]{escape(str(exc))}: the database was migrated by a newer version of proj; "
            "run that version (its image), or restore the database from before the upgrade[/red]"
        )
        raise typer.Exit(1) from None
    console.print(f"[green]schema at {head}[/green]")


@cli.command()
def sweep() -> None:
    """Run one sweeper tick now (what beat does every SWEEP_INTERVAL_S)."""
    from proj.engine.sweeper import sweep as do_sweep

    console.print_json(json.dumps(do_sweep().__dict__))


STATUS_STYLE = {
    "succeeded": "green",
    "failed": "bold red",
    "canceled": "yellow",
    "waiting": "magenta",
    "running": "cyan",
    "pending": "white",
}


def _family_tree(view: Any, fam: Any) -> Any:
    """The run's parent above it and its child runs below, each with its status (`proj show <id>`)."""
    from rich.tree import Tree

    def label(kind: str, version: int, rid: Any, status: str, step: str | None = None) -> str:
        style = STATUS_STYLE.get(status, "white")
        via = f"{step} → " if step else ""
        return f"{via}{kind}@{version} {rid} [{style}]{status}[/{style}]"

    me = f"[bold]{label(view.kind, view.version, view.id, view.status)}[/bold]"
    if fam.parent is not None:
        p = fam.parent
        top = Tree(f"parent: {label(p.kind, p.version, p.id, p.status)}")
        node = top.add(me)
    else:
        top = node = Tree(me)
    at: dict[int, Any] = {0: node}
    for c in fam.children:
        at[c.depth] = at[c.depth - 1].add(label(c.kind, c.version, c.id, c.status, c.step))
    return top


@cli.command()
def show(run_id: str, as_json: bool = typer.Option(False, "--json", help="the raw TaskRunView")) -> None:
    """Show one run: status, business timeline, steps and live progress."""
    from proj import db
    from proj.admin import queries
    from proj.engine import runs

    rid = queries.parse_uuid(run_id)
    view = runs.get(rid) if rid else None
    if view is None:
        console.print(f"[red]no run {run_id}[/red]")
        raise typer.Exit(1)
    if as_json:
        console.print_json(json.dumps(view.__dict__, default=str))
        return
    import proj.celery  # noqa: F401  - kinds register their timeline hooks

    with db.transaction() as s:
        d = queries.run_detail(s, view.id)
    assert d is not None
    style = STATUS_STYLE.get(view.status, "white")
    head = Table.grid(padding=(0, 2))
    head.add_row("run", f"{view.id}  {view.kind}@{view.version}  [{style}]{view.status}[/{style}]")
    head.add_row("key", d.run.idempotency_key)
    head.add_row("step", f"{view.current_step or '-'} (attempt {view.attempts})")
    if view.wait_topic:
        head.add_row("parked", f"{view.wait_topic} until {view.wait_until}")
    if view.deadline_at:
        head.add_row("deadline", str(view.deadline_at))
    if view.pending_reason:
        head.add_row("stuck?", f"[yellow]{view.pending_reason}[/yellow]")
    if view.last_error:
        head.add_row("error", f"[red]{view.last_error.get('type')}: {view.last_error.get('message')}[/red]")
    console.print(head)
    if d.family is not None and (d.family.parent is not None or d.family.children):
        console.print(_family_tree(view, d.family))
    for p in d.progress:
        pct = f"{p['pct']:.1f}%" if p["pct"] is not None else "?"
        console.print(f"progress {p['step']}: {pct} {p['message'] or ''}")
    timeline = Table("when", "source", "event", "detail", title="business timeline", title_justify="left")
    colors = {"ok": "green", "error": "red", "warn": "yellow", "active": "cyan", "info": "white"}
    for e in d.timeline:
        c = colors.get(e.state, "white")
        when = e.at.strftime("%Y-%m-%d %H:%M:%S") if e.at else "-"
        timeline.add_row(when, e.source, f"[{c}]{e.title}[/{c}]", e.detail)
    console.print(timeline)
    if view.status == "failed":
        console.print(f"decide with: proj resolve {view.id} --retry | --abandon")


LIST_MAX = 10_000
"""The most lines `proj runs --limit` and `proj outbox --limit` ask for: a larger number ended on
Postgres' `bigint out of range` (a DataError line), or read a whole history into the terminal
(`tests/integration/test_operator_review.py::test_huge_option_values_are_refused_as_usage_errors`)."""


@cli.command("runs")
def list_runs(
    kind: str | None = None,
    version: int | None = None,
    status: str | None = None,
    search: str | None = typer.Option(None, "--search", "-q", help="run id (prefix) or part of a key"),
    limit: int = typer.Option(20, max=LIST_MAX, help=f"runs to list (1..{LIST_MAX})"),
) -> None:
    """List recent runs, newest first."""
    from proj import db
    from proj.admin import queries
    from proj.engine.status import RunStatus

    if status is not None and status not in tuple(RunStatus):
        errors.print(f"[red]unknown status {status!r}: one of {', '.join(RunStatus)}[/red]")
        raise typer.Exit(2)
    if version is not None and version < 1 or limit < 1:
        errors.print("[red]--version and --limit must be 1 or more[/red]")
        raise typer.Exit(2)
    f = queries.RunFilter(kind=kind or "", version=str(version or ""), status=status or "", q=search or "")
    with db.transaction() as s:
        rows, more = queries.list_runs(s, f, limit=limit)
    header = ("run", "kind", "status", "step", "key", "created")
    lines = [
        (
            str(r.id),
            f"{r.kind}@{r.version}",
            r.status,
            r.current_step or "",
            r.idempotency_key,
            r.created_at.isoformat(timespec="seconds"),
        )
        for r in rows
    ]
    if not console.is_terminal:  # piped: whole values, one run per line, tab-separated
        for line in [header, *lines]:
            print("\t".join(line))
    else:
        table = Table(*header)
        table.columns[0].no_wrap = True  # copied into `proj show ID` / `resolve` / `cancel`: never cut
        for run_id, kv, st, step, key, created in lines:
            style = STATUS_STYLE.get(st, "white")
            short = key if len(key) <= 40 else key[:39] + "…"
            table.add_row(run_id, kv, f"[{style}]{st}[/{style}]", step, short, created)
        console.print(table)
    if more:  # on stderr: piped, stdout stays one run per line
        errors.print(f"[dim]more than {limit}: use --limit or filters[/dim]")


@cli.command("qbt-login-retry")
def qbt_login_retry() -> None:
    """Let the workers log in to qBittorrent again now: after fixing its password on its side."""
    from proj.acquisition.qbt import forget_login_refusals

    n = forget_login_refusals()
    typer.echo(f"forgot {n} refused qBittorrent login(s): each worker tries its credentials at its next step")


@cli.command()
def signal(topic: str, payload: str = typer.Option("null", help="JSON payload")) -> None:
    """Store a signal and wake the runs waiting on TOPIC (e.g. qBittorrent's on-finish hook)."""
    from proj.engine import runs

    try:
        body = json.loads(payload)
    except ValueError as exc:  # before: "JSONDecodeError: Expecting value: line 1 column 1 (char 0)"
        errors.print(f"[red]--payload must be JSON (e.g. '{{\"ok\": true}}'): {escape(str(exc))}[/red]")
        raise typer.Exit(2) from None
    woken = runs.signal(topic, body)
    console.print(f"signal {topic}: {woken} run(s) woken")


@cli.command()
def cancel(
    run_or_request: str = typer.Argument(..., metavar="ID", help="a request id or a run id"),
    reason: str = typer.Option("operator", help="why"),
    by: str = typer.Option(None, help="who cancels (default: your user name)"),
) -> None:
    """Cancel a request (its runs, with compensation) or one run: business first.

    A request records who canceled it in its audit trail; a run, which has no such field, records
    it in its cancel reason ("REASON (by WHO)"). A run that finishes between the check below and
    the cancel is said to have finished, exit 1, never "cancel requested": `runs.cancel` says
    whether its statement landed
    (`tests/integration/test_cli.py::test_cancel_of_a_run_that_finishes_before_it_lands_says_so`)."""
    from proj import db
    from proj.acquisition import service
    from proj.acquisition.models import DownloadTask
    from proj.engine import runs
    from proj.engine.status import TERMINAL

    ident = _uuid_or_exit(run_or_request)
    who = _who(by)
    with db.transaction() as s:
        is_request = s.get(DownloadTask, ident) is not None
    if is_request:
        with _business_errors():
            n = service.cancel_download(_engine(), db.sessions(), ident, reason, by=who)
        console.print(f"cancel requested for request {ident}: {n} run(s) stopping, compensation follows")
        return
    view = runs.get(ident)
    if view is not None and view.status in TERMINAL:
        hint = _abandon_hint(ident, view.status)
        errors.print(f"[red]run {ident} has finished ({view.status}): nothing to cancel{hint}[/red]")
        raise typer.Exit(1)
    with _business_errors():  # the request's rule for a run too: before, '' canceled as " (by …)"
        why = service.check_reason(reason)
    try:
        outcome = runs.cancel(ident, f"{why} (by {who})")
    except KeyError:
        errors.print(f"[red]no request or run {run_or_request}[/red]")
        raise typer.Exit(1) from None
    if not outcome.landed:  # it finished between the check above and the cancel's statement
        errors.print(
            f"[red]run {ident} finished ({outcome.status}) before the cancel landed: nothing to cancel"
            f"{_abandon_hint(ident, outcome.status)}[/red]"
        )
        raise typer.Exit(1)
    console.print(f"cancel requested for run {ident}")


def _abandon_hint(run_id: uuid.UUID, status: str) -> str:
    """A finished run is not canceled; a dead letter's compensation is `resolve --abandon`."""
    return f"; a dead letter: proj resolve {run_id} --abandon" if status == "failed" else ""


# ------------------------------------------------------------------------------ the front door


def _engine() -> object:
    import proj.celery  # noqa: F401  - kinds (cancel hooks, compensation) and the publishing app
    from proj.engine.celery_engine import CeleryTaskEngine

    return CeleryTaskEngine()


def _operator() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "cli"


def _who(by: str | None) -> str:
    """`--by`, or your user name when it is left out. Given but blank, it is a usage error, as
    the API refuses an empty `by`: before, `--by ''` was silently your user name
    (`tests/integration/test_cli.py::test_a_blank_by_is_a_usage_error`)."""
    if by is None:
        return _operator()
    if not by.strip():
        errors.print("[red]--by must name someone (leave it out for your user name)[/red]")
        raise typer.Exit(2)
    return by


def _uuid_or_exit(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        errors.print(f"[red]{value!r} is not an id (a UUID)[/red]")
        raise typer.Exit(2) from None


class _business_errors:  # noqa: N801 - used as a statement: `with _business_errors():`
    """Typed business errors become one red line and exit 1 (nothing was written)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        from proj.engine.errors import BadInput, EngineError

        if isinstance(exc, BadInput | EngineError):
            errors.print(f"[red]{type(exc).__name__}: {exc}[/red]")
            raise typer.Exit(1)
        return False


@cli.command()
def request(
    torrent_file: typer.FileBinaryRead = typer.Argument(..., metavar="FILE.torrent"),
    requester: str = typer.Option(..., help="who asks (on the timeline)"),
    title: str = typer.Option(None, help="default: the torrent's name"),
    webhook: str = typer.Option(None, help="http(s) URL told when the files are in the library"),
) -> None:
    """Request a download. Prints the request id on its own line, then its status."""
    from proj import db
    from proj.acquisition import service

    data = torrent_file.read(service.get_settings().max_torrent_bytes + 1)
    with _business_errors():
        sub = service.submit_request(
            db.sessions(), requester=requester, torrent=data, title=title, webhook_url=webhook
        )
        with db.transaction() as s:
            row = service.request_detail(s, sub.id).row
    print(sub.id)
    console.print(f"{row.status}: {row.title} ({row.files} file(s), {row.total_size} bytes) — approve with:")
    console.print(f"  proj approve {sub.id}")


@cli.command("requests")
def list_requests(
    status: str = typer.Option(None, help="only this status (requested, approved, … notified)"),
    requester: str = typer.Option(None),
    limit: int = typer.Option(50, min=1, max=200),
    after: str = typer.Option(
        None, metavar="ID", help="go on after this request (the hint below a full page)"
    ),
) -> None:
    """List requests, newest first: id, title, requester, status, progress, size, age."""
    from proj import db
    from proj.acquisition import service
    from proj.admin.app import fmt_ago, fmt_size
    from proj.engine.errors import BadInput

    with _business_errors(), db.transaction() as s:
        try:
            mark = uuid.UUID(after) if after else None
        except ValueError:
            raise BadInput(f"--after must be a request id, got {after!r}") from None
        rows, following = service.requests_page(
            s, status=status, requester=requester, limit=limit, after=mark
        )
    lines = [
        (
            str(r.id),
            r.title,
            r.requester,
            r.status,
            f"{r.progress_pct():.0f}%",
            fmt_size(r.total_size),
            fmt_ago(r.created_at),
        )
        for r in rows
    ]
    header = ("id", "title", "requester", "status", "progress", "size", "age")
    if not console.is_terminal:  # piped: whole values, one request per line, tab-separated
        for line in [header, *lines]:
            print("\t".join(line))
    else:
        table = Table(*header)
        table.columns[0].no_wrap = True  # copied into `proj approve ID`: never cut
        for line in lines:
            table.add_row(*line)
        console.print(table)
    if following is not None:  # on stderr when piped: the lines stay one request each
        errors.print(f"[dim]more: proj requests --after {following}[/dim]")
    if not rows:  # on stderr too: piped, stdout holds only the header and request lines
        errors.print("[dim]no requests: `proj request FILE.torrent --requester NAME` makes one[/dim]")


@cli.command()
def approve(
    request_id: str = typer.Argument(..., metavar="ID"),
    by: str = typer.Option(None, help="who approves (default: your user name)"),
) -> None:
    """Approve a request: the download starts (recorded on its timeline with who approved)."""
    from proj import db
    from proj.acquisition import service

    tid = _uuid_or_exit(request_id)
    who = _who(by)
    with _business_errors():
        service.approve_and_signal(_engine(), db.sessions(), tid, who)  # type: ignore[arg-type]
    console.print(f"approved {tid} by {who}")


@cli.command()
def reject(
    request_id: str = typer.Argument(..., metavar="ID"),
    reason: str = typer.Option(..., help="why (on the timeline)"),
    by: str = typer.Option(None, help="who rejects (default: your user name)"),
) -> None:
    """Reject a request that was not approved: no torrent is ever added."""
    from proj import db
    from proj.acquisition import service

    tid = _uuid_or_exit(request_id)
    who = _who(by)
    with _business_errors():
        service.reject_and_stop(_engine(), db.sessions(), tid, who, reason)  # type: ignore[arg-type]
    console.print(f"rejected {tid} by {who}: {reason}")


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
    rid = _uuid_or_exit(run_id)
    if retry:
        n = runs.retry_failed(rid)
        if not n:
            errors.print(f"[red]{escape(_not_retried(rid))}[/red]")
            raise typer.Exit(1)
        console.print(f"{n} step(s) sent back to work")
    else:
        if not runs.abandon(rid, "operator"):
            view = runs.get(rid)
            what = "no such run" if view is None else f"{view.status}, not a dead letter"
            errors.print(f"[red]{rid} is not a failed run ({what}): nothing abandoned[/red]")
            raise typer.Exit(1)
        console.print("abandoned")


def _not_retried(rid: uuid.UUID) -> str:
    """Why `resolve --retry` sent nothing back: not a dead letter, or one that may not run again
    (asked to cancel, past its deadline), which only abandon resolves."""
    from datetime import UTC, datetime

    from proj.engine import runs

    view = runs.get(rid)
    if view is None:
        return f"{rid} is not a failed run (no such run): nothing retried"
    if view.status != "failed":
        return f"{rid} is not a failed run ({view.status}): nothing retried"
    abandon = f"abandon it: proj resolve {rid} --abandon"
    if view.cancel_requested:
        return f"{rid} was asked to cancel, which a retry cannot withdraw: nothing retried; {abandon}"
    if view.deadline_at is not None and view.deadline_at <= datetime.now(UTC):
        return f"{rid} passed its deadline ({view.deadline_at.isoformat()}): nothing retried; {abandon}"
    return f"{rid} has no failed step to retry: nothing retried; {abandon}"


@cli.command()
def outbox(limit: int = typer.Option(10, min=0, max=LIST_MAX, help="dead events to list")) -> None:
    """Outbox backlog: pending/dispatched/dead counts, the oldest pending event, dead events."""
    from proj import db
    from proj.admin import queries

    with db.transaction() as s:
        box = queries.outbox_summary(s, limit=limit)
    if not box.present:  # a database not migrated: nothing to show, exit 1 like every other command
        errors.print("[red]no outbox table (outbox.outbox_event) in this database: run `proj migrate`[/red]")
        raise typer.Exit(1)
    counts = Table("status", "events")
    for st in ("pending", "dispatched", "dead"):
        counts.add_row(st, str(box.counts.get(st, 0)))
    console.print(counts)
    if box.oldest_pending is not None:
        e = box.oldest_pending
        console.print(
            f"oldest pending: #{e.id} {e.kind} key={e.idempotency_key} attempts={e.attempts} "
            f"next attempt {e.next_attempt_at.isoformat(timespec='seconds')}"
        )
    if box.dead:
        dead = Table("id", "kind", "key", "attempts", "last error", title="dead events", title_justify="left")
        for e in box.dead:
            err = (
                e.last_error.get("message", e.last_error) if isinstance(e.last_error, dict) else e.last_error
            )
            dead.add_row(str(e.id), e.kind, e.idempotency_key, str(e.attempts), str(err or "")[:120])
        console.print(dead)


@cli.command()
def doctor() -> None:
    """Check Postgres, the broker, qBittorrent, the schema and the connection budget; say what to fix."""
    from proj.doctor import run_checks

    with console.status("checking …") as status:
        checks = run_checks(on_check=lambda name: status.update(f"checking {name} …"))
    table = Table("check", "status", "detail", "fix")
    colors = {"OK": "green", "FAIL": "bold red", "WARN": "yellow", "SKIP": "dim"}
    for c in checks:
        col = colors[c.status]
        table.add_row(c.name, f"[{col}]{c.status}[/{col}]", c.detail, "" if c.status == "OK" else c.fix)
    console.print(table)
    failed = [c.name for c in checks if c.status == "FAIL"]
    if failed:
        console.print(f"[bold red]{len(failed)} check(s) failed: {', '.join(failed)}[/bold red]")
        raise typer.Exit(1)
    warned = [c.name for c in checks if c.status == "WARN"]
    if warned:
        console.print(f"[yellow]no check failed; {len(warned)} warning(s): {', '.join(warned)}[/yellow]")
        return
    console.print("[green]all checks passed[/green]")


LOOPBACK = ("127.0.0.1", "localhost", "::1")


@cli.command()
def admin(
    host: str = typer.Option("127.0.0.1", help="address to bind"),
    port: int = typer.Option(8088, min=1, max=65535, help="port to bind"),
    insecure_local: bool = typer.Option(
        False, "--insecure-local", help="allow no ADMIN_PASSWORD (no auth); loopback addresses only"
    ),
) -> None:
    """Serve the /admin web app (HTTP Basic auth: ADMIN_USERNAME / ADMIN_PASSWORD)."""
    import uvicorn

    from proj.admin.app import AdminConfigError, create_app

    if insecure_local and host not in LOOPBACK:
        console.print(f"[red]--insecure-local binds loopback only, not {host}: set ADMIN_PASSWORD[/red]")
        raise typer.Exit(2)
    try:
        app = create_app(insecure=insecure_local)
    except AdminConfigError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    who = (
        "no auth (insecure local mode)"
        if app.state.auth.password is None
        else f"user {app.state.auth.username}"
    )
    console.print(f"admin on http://{host}:{port}/admin ({who})")
    log_config = logs.uvicorn_log_config()  # LOG_FORMAT=json; None keeps uvicorn's own format
    extra: dict[str, Any] = {} if log_config is None else {"log_config": log_config}
    uvicorn.run(
        app, host=host, port=port, log_level="info", proxy_headers=False, server_header=False, **extra
    )


@cli.command()
def healthcheck(
    role: str = typer.Option(
        "worker", envvar="PROJ_ROLE", help="what this container runs: worker, beat, admin or flower"
    ),
    timeout: float = typer.Option(5.0, min=0.1, max=3600, help="seconds before it counts as unhealthy"),
    port: int = typer.Option(
        None, min=1, max=65535, envvar="PROJ_HEALTH_PORT", help="admin or flower: its port (8088, 5555)"
    ),
) -> None:
    """The Docker HEALTHCHECK (`proj-healthcheck`, which imports less): exit 0 when this
    container's process answers.

    worker: its Celery node (`celery@<hostname>`) answers a ping; admin: /admin/healthz answers;
    flower: /healthcheck answers; beat: Postgres and the broker answer (beat holds no port).
    """
    from proj import health

    try:
        ok, what = health.check(role, timeout, port)
    except ValueError:
        errors.print(f"[red]unknown role {role!r}: worker, beat, admin or flower[/red]")
        raise typer.Exit(2) from None
    console.print(f"{what}: {'healthy' if ok else 'not answering'}")
    raise typer.Exit(0 if ok else 1)


@cli.command("lock-steps")
def lock_steps() -> None:
    """Record step names per kind@version in proj/kinds/steps.lock.json (append-only)."""
    import proj.celery  # noqa: F401  - registers every kind: without them nothing new is recorded
    from proj.engine import versions

    try:
        merged = versions.write_lock(versions.LOCK_PATH)
    except ValueError as exc:  # a locked version's steps changed: a new version is needed
        errors.print(f"[red]refused: {escape(str(exc))}[/red]")
        raise typer.Exit(1) from None
    console.print(f"{len(merged)} kind version(s) locked in {versions.LOCK_PATH}")


@cli.command()
def demo(
    engine_only: bool = typer.Option(
        False, "--engine-only", help="run the small `demo` kind instead (no qBittorrent needed)"
    ),
    parts: int = typer.Option(4, min=1, help="fan-out width of the --engine-only pipeline"),
    serve: bool = typer.Option(
        False, "--serve", help="then keep the stack up and serve /admin and /api: try it yourself"
    ),
) -> None:
    """Walk a download request from approval to library file on a local qBittorrent swarm,
    printing its timeline (embedded Postgres and Redis when none are configured)."""
    from proj.demo import run_demo

    raise typer.Exit(run_demo(engine_only=engine_only, parts=parts, serve=serve))


def main() -> None:
    """The `proj` command. An error the operator can act on (the database or broker out of
    reach, a database not migrated, a bad setting, bad input) is one line saying what to do,
    exit 1, not a traceback; `PROJ_TRACEBACK=1` shows the traceback
    (`tests/integration/test_cli.py::test_errors_are_one_line_not_a_traceback`)."""
    import os

    try:
        logs.configure()  # LOG_FORMAT=json: engine lines of CLI commands as JSON on stderr
        cli()
    except Exception as exc:  # typer's own exits and usage errors never reach here
        if os.environ.get("PROJ_TRACEBACK"):
            raise
        errors.print(f"[red]{escape(error_line(exc))}[/red]")
        raise SystemExit(1) from None


def _unreachable() -> tuple[type[BaseException], ...]:
    import psycopg
    import redis
    from kombu.exceptions import OperationalError as BrokerError
    from sqlalchemy import exc as sa_exc

    return (
        sa_exc.OperationalError,
        sa_exc.InterfaceError,
        psycopg.OperationalError,
        BrokerError,
        redis.exceptions.ConnectionError,
        ConnectionError,
    )


def error_line(exc: BaseException) -> str:
    """One line for an error that ended a command, with what to do about it."""
    from pydantic import ValidationError

    first = (str(exc).strip().splitlines() or [""])[0]
    cause = getattr(exc, "orig", None)
    if isinstance(exc, ValidationError):
        what = "; ".join(f"{str(e['loc'][0]).upper()}: {e['msg']}" for e in exc.errors() if e.get("loc"))
        return f"bad setting: {what or first}"
    if type(cause).__name__ == "UndefinedTable":
        return f"the database is not migrated ({first}): run `proj migrate`"
    if isinstance(exc, _unreachable()):
        return (
            f"cannot reach the database or the broker ({first}): "
            "check DATABASE_URL and BROKER_URL, or run `proj doctor`"
        )
    return f"{type(exc).__name__}: {first}"


if __name__ == "__main__":
    main()
