"""Settings from the environment (pydantic-settings).

Everything operational is an environment variable so that `celery -A proj worker`, beat, the
admin and the CLI all read one configuration. Secrets are `SecretStr` so they never print.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Process-wide configuration; read once per process."""

    model_config = SettingsConfigDict(env_prefix="", extra="ignore", case_sensitive=False)

    database_url: str | None = Field(default=None, description="Postgres URL, shared by all")
    broker_url: str | None = Field(default=None, description="Celery broker (redis:// or amqp://)")
    db_pooler: Literal["none", "session", "transaction"] = Field(
        default="none",
        description="what DATABASE_URL reaches: Postgres itself, or a pooler (PgBouncer) in this mode",
    )
    liveness_database_url: str | None = Field(
        default=None,
        description="direct Postgres URL for the liveness sessions (required with DB_POOLER=transaction)",
    )
    broker_transport: str | None = Field(
        default=None,
        description="kombu transport; default: ours guarded against restarts for redis:// (proj.transport)",
    )

    lease_ttl_s: float = Field(default=15.0, gt=0.5, description="step lease length")
    sweep_interval_s: float = Field(default=1.0, gt=0, description="beat period of the sweeper")
    reap_interval_s: float = Field(
        default=0.25,
        ge=0,
        description="how often a worker process looks for steps of dead workers (0: leases only)",
    )
    reap_grace_s: float = Field(
        default=0.4,
        ge=0,
        description=(
            "how long a worker's liveness lock stays free before its steps are taken over: more than "
            "REAP_INTERVAL_S plus a reconnect, so a live worker whose session dropped takes it back first"
        ),
    )
    republish_after_s: float = Field(
        default=30.0, gt=0, description="re-publish a pending step whose message seems lost"
    )
    republish_unconsumed_s: float = Field(
        default=600.0,
        gt=0,
        description="... to a version queue no live worker says it consumes: this seldom (never lost)",
    )

    inline_steps: int = Field(
        default=10,
        ge=0,
        description="a worker runs up to N next steps of a linear chain itself, without a message (0: off)",
    )
    inline_budget_s: float = Field(
        default=2.0, ge=0, description="and stops continuing inline once one delivery has run this long"
    )

    wake_batch: int = Field(
        default=16,
        ge=1,
        le=500,
        description="steps woken together (signal, timers) travel N to a message (1: one each)",
    )

    db_pool_size: int = Field(default=3, ge=1)
    db_ping_idle_s: float = Field(
        default=1.0,
        ge=0,
        description="ping a pooled connection on checkout only if it sat idle this long (0: always)",
    )
    db_max_overflow: int = Field(default=2, ge=0)
    db_idle_in_transaction_s: float = Field(
        default=60.0,
        ge=0,
        description="Postgres ends a session of ours idle inside a transaction this long (0: never;"
        " not set behind a transaction pooler: PgBouncer's idle_transaction_timeout does it there)",
    )
    worker_concurrency: int = Field(default=2, ge=1)
    disable_prefetch: bool = Field(
        default=True,
        description="a worker whose processes are all busy takes no message from Redis (0: prefetch)",
    )
    expected_workers: int = Field(
        default=2, ge=1, description="worker processes (hosts x nodes) sharing the database"
    )
    reserved_connections: int = Field(
        default=10, ge=0, description="headroom kept free for beat, admin, CLI and psql"
    )

    engine_serve: str = Field(
        default="",
        description="versions this worker serves, e.g. 'demo@1,demo@2'; empty = current+previous",
    )
    celery_app: str = Field(
        default="proj.celery",
        description="the wiring module that builds the Celery app and binds it to the engine",
    )
    engine_extra_kinds: str = Field(
        default="", description="comma-separated modules declaring extra kinds (tests, plugins)"
    )
    max_input_bytes: int = Field(default=65536, ge=1024)
    fault_kill_after_effect: str = Field(
        default="", description="fault injection: SIGKILL self after this effect kind's first attempt"
    )
    fault_kill_scope: str = Field(
        default="process",
        pattern="^(process|group)$",
        description="fault injection: SIGKILL only the process, or its whole process group (a worker)",
    )
    fault_chunk_delay_s: float = Field(default=0.0, ge=0, description="fault injection: slow copies")
    fault_kill_after_child_enqueue: bool = Field(
        default=False,
        description="fault injection: SIGKILL self right after a child step committed a new child",
    )
    fault_duplicate_publish: int = Field(
        default=1, ge=1, le=5, description="fault injection: send every step message N times"
    )

    library_root: str = Field(default="/var/lib/proj/library", description="where imports land")
    download_dir: str = Field(
        default="/var/lib/proj/downloads", description="qBittorrent's save path for our torrents"
    )
    qbt_peers: str = Field(default="", description="peers to introduce after adding, host:port,…")
    acq_approval_timeout_s: float = Field(default=300.0, gt=0)
    acq_download_recheck_s: float = Field(default=600.0, gt=0)
    seed_time_s: float = Field(default=7 * 24 * 3600.0, ge=0)
    copy_chunk_bytes: int = Field(default=8 * 1024 * 1024, ge=4096)
    periodic_reconcile_s: float = Field(default=300.0, gt=0)
    periodic_verify_s: float = Field(default=24 * 3600.0, gt=0)
    verify_cycle_runs: int = Field(
        default=30,
        ge=1,
        description="verify_library re-hashes each library file once every N runs at least (1: every run)",
    )
    verify_min_hash_bytes: int = Field(
        default=64 * 1024**3,
        ge=0,
        description="and at least this many bytes per run (a library this small: whole, each run)",
    )
    periodic_purge_s: float = Field(default=24 * 3600.0, gt=0)
    retention_days: float = Field(default=30.0, ge=0)
    qbt_url: str | None = None
    qbt_username: str | None = None
    qbt_password: SecretStr | None = None
    qbt_login_retry_s: float = Field(
        default=900.0,
        ge=0,
        description="credentials qBittorrent refused are not tried again for this long, by any worker",
    )
    admin_username: str = "admin"
    admin_password: SecretStr | None = None
    api_token: SecretStr | None = Field(
        default=None, description="bearer token of the JSON API under /api (off when unset)"
    )
    hook_token: SecretStr | None = Field(
        default=None, description="bearer token of /api/hooks/qbittorrent only (off when unset)"
    )
    max_torrent_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, le=64 * 1024 * 1024, description="largest .torrent accepted"
    )
    metrics_token: SecretStr | None = Field(
        default=None, description="bearer token of /metrics (open, like Flower's, when unset)"
    )
    metrics_timeout_s: float = Field(
        default=2.0,
        gt=0,
        le=30,
        description="a scrape's bound: Postgres connect and statement timeout, broker timeouts",
    )
    metrics_slow_s: float = Field(
        default=120.0,
        gt=0,
        description="re-read the history (finished counts, histograms) at most this often",
    )
    metrics_slow_timeout_s: float = Field(
        default=60.0, gt=0, description="statement timeout of that background history read"
    )
    log_format: str = Field(
        default="text", pattern="^(text|json)$", description="'json': one JSON object per log line"
    )
    admin_secret: SecretStr | None = Field(
        default=None, description="signs the admin session cookie (CSRF); random per start if unset"
    )

    @field_validator("engine_serve")
    @classmethod
    def _serve_list(cls, v: str) -> str:
        """`ENGINE_SERVE` is `kind@version,…`. Before, `acquire` (no version) ended a worker's
        start on `IndexError: list index out of range` and `acquire@x` on an int() ValueError,
        in Celery's "Unable to load celery application" traceback
        (`tests/integration/test_operator_review.py::test_a_malformed_engine_serve_is_a_bad_setting`)."""
        for part in filter(None, (p.strip() for p in v.split(","))):
            name, at, version = part.partition("@")
            if not (name.strip() and at and version.strip().isdigit() and int(version) >= 1):
                raise ValueError(f"{part!r} is not kind@version (e.g. 'acquire@1,acquire@2')")
        return v

    def require_database_url(self) -> str:
        """Return the SQLAlchemy URL (psycopg 3 driver) or explain what is missing."""
        if not self.database_url:
            raise RuntimeError(
                "DATABASE_URL is not set. Point it at Postgres, e.g. "
                "DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test "
                "(or run `proj demo`, which starts an embedded one)."
            )
        if not self.database_url.startswith(POSTGRES_SCHEMES):
            scheme, sep, _ = self.database_url.partition("://")
            given = f"this one starts with {scheme + sep!r}" if sep else "this one has no scheme"
            raise RuntimeError(
                f"DATABASE_URL must be a Postgres URL, postgresql://user@host:5432/db ({given})"
            )
        return sqlalchemy_url(self.database_url)


POSTGRES_SCHEMES = ("postgres://", "postgresql://", "postgresql+psycopg://")
"""The URLs `DATABASE_URL` may take: Postgres through psycopg 3, the only driver installed.
Anything else (`mysql://`, `sqlite:///…`, a URL without a scheme) failed deep inside SQLAlchemy
with a bare `ModuleNotFoundError`, `ArgumentError` or `TypeError`, `proj doctor` included
(`tests/integration/test_operator_review.py::test_a_database_url_that_is_not_postgres_says_so`)."""


def sqlalchemy_url(url: str) -> str:
    """Normalise postgres:// and postgresql:// URLs to the psycopg 3 dialect.

    A libpq multi-host URL (`postgresql://u@h1:5432,h2:5432/db?target_session_attrs=read-write`,
    for failover) becomes SQLAlchemy's form, one `host=h:port` query item per host.
    """
    for prefix in POSTGRES_SCHEMES:
        if url.startswith(prefix):
            return "postgresql+psycopg://" + _hosts_as_query(url[len(prefix) :])
    return url


def _hosts_as_query(rest: str) -> str:
    """`u@h1:p1,h2:p2/db?q` → `u@/db?host=h1:p1&host=h2:p2&q` (a single host is left alone)."""
    netloc, sep, tail = rest.partition("/")
    user, at, hosts = netloc.rpartition("@")
    if "," not in hosts:
        return rest
    path, qsep, query = tail.partition("?")
    items = [f"host={h}" for h in hosts.split(",")] + ([query] if query else [])
    return f"{user}{at}/{path}?" + "&".join(items)


def libpq_url(url: str) -> str:
    """The libpq form of a configured URL (the `+psycopg` dialect marker removed), as given."""
    for prefix in ("postgresql+psycopg://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql://" + url[len(prefix) :]
    return url


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process' settings. Tests that change the environment call `get_settings.cache_clear()`."""
    return Settings()
