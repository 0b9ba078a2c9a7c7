"""Kinds and helpers for the ledger and outbox tests (loaded in workers via ENGINE_EXTRA_KINDS).

`effects` performs two real, non-idempotent side effects through the ledger, each its own
operation: it appends a line to a file, and it POSTs to a local HTTP receiver that counts every
request. Faults are injected on the first attempt only, from the run's input: SIGKILL of the
worker process, or a hold (so the test can SIGSTOP the worker) before or after an effect.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel

from ledger import Attempt, CommitRefused, Done, NotDone
from proj.engine.context import StepContext
from proj.engine.effects import effect
from proj.engine.errors import LeaseLost
from proj.engine.kind import Kind, RetryPolicy, register, step

Where = Literal["file", "http"]
When = Literal["before", "after"]


# --------------------------------------------------------------------------------------------
# the outside world: a file and an HTTP receiver


def append_line(path: str | Path, line: str) -> None:
    """A non-idempotent file effect: append, fsync (a redo would leave a second line)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def lines_for(path: str | Path, op_key: str) -> list[str]:
    p = Path(path)
    if not p.exists():
        return []
    return [ln for ln in p.read_text().splitlines() if ln.split(" ", 1)[0] == op_key]


class Receiver:
    """A local HTTP server that counts every POST per key (no dedup: duplicates are visible)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def _key(self) -> str | None:
                return self.path.split("/ops/", 1)[1] if self.path.startswith("/ops/") else None

            def _reply(self, body: dict[str, Any], code: int = 200) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802
                key = self._key()
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if key is None:
                    return self._reply({"error": "not found"}, 404)
                with receiver.lock:
                    receiver.counts[key] += 1
                    n = receiver.counts[key]
                self._reply({"key": key, "n": n})

            def do_GET(self) -> None:  # noqa: N802
                key = self._key()
                if key is None:
                    return self._reply({"error": "not found"}, 404)
                with receiver.lock:
                    n = receiver.counts[key]
                self._reply({"key": key, "n": n})

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def count(self, key: str) -> int:
        with self.lock:
            return self.counts[key]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def post_effect(url: str, key: str) -> dict[str, Any]:
    r = httpx.post(f"{url}/ops/{key}", json={"key": key}, headers={"Idempotency-Key": key}, timeout=5)
    r.raise_for_status()
    return {"receipt": r.json()["n"]}


def http_reconcile(url: str, key: str) -> Done[dict[str, Any]] | NotDone:
    r = httpx.get(f"{url}/ops/{key}", timeout=5)
    r.raise_for_status()
    n = r.json()["n"]
    return Done({"receipt": n}) if n > 0 else NotDone("the receiver has no request for this key")


def file_reconcile(path: str, op_key: str) -> Done[dict[str, Any]] | NotDone:
    found = lines_for(path, op_key)
    if found:
        return Done({"path": path, "token": found[0].split(" ", 1)[1]})
    return NotDone(f"{path} has no line for {op_key}")


# --------------------------------------------------------------------------------------------
# the kind


class EffectsInput(BaseModel):
    op: str
    url: str
    path: str
    journal: str
    kill_in: Where | None = None
    kill_when: When = "after"
    hold_in: Where | None = None
    hold_when: When = "after"
    hold_s: float = 0.0


def journal(path: str, **fields: Any) -> None:
    """What the kind saw (refused commits), as JSON lines the test reads back."""
    append_line(path, json.dumps({"pid": os.getpid(), "at": time.time(), **fields}))


def read_journal(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    return [json.loads(ln) for ln in p.read_text().splitlines()] if p.exists() else []


def deliver(ctx: StepContext) -> dict[str, Any]:
    inp: EffectsInput = ctx.input
    first = ctx.attempt == 1

    def fault(where: Where, when: When, att: Attempt) -> None:
        if not first:
            return
        if inp.hold_in == where and inp.hold_when == when:
            journal(inp.journal, event="hold", where=where, when=when, attempt=ctx.attempt)
            deadline = time.monotonic() + inp.hold_s
            while time.monotonic() < deadline:
                time.sleep(0.05)
            if when == "before":
                att.check()  # the effect is irreversible: still ours?
        if inp.kill_in == where and inp.kill_when == when:
            journal(inp.journal, event="kill", where=where, when=when, attempt=ctx.attempt)
            os.kill(os.getpid(), signal.SIGKILL)

    def write_file(att: Attempt) -> dict[str, Any]:
        fault("file", "before", att)
        append_line(inp.path, f"{att.op_key} {att.token}")
        fault("file", "after", att)
        return {"path": inp.path, "token": str(att.token)}

    def post(att: Attempt) -> dict[str, Any]:
        fault("http", "before", att)
        result = post_effect(inp.url, inp.op)
        fault("http", "after", att)
        return result

    try:
        wrote = effect(
            ctx,
            f"file:{inp.op}",
            {"path": inp.path},
            write_file,
            lambda att: file_reconcile(inp.path, att.op_key),
            effect_kind="file",
        )
        sent = effect(
            ctx,
            f"http:{inp.op}",
            {"url": inp.url, "key": inp.op},
            post,
            lambda att: http_reconcile(inp.url, inp.op),
            effect_kind="http",
        )
    except (CommitRefused, LeaseLost) as exc:
        journal(inp.journal, event="refused", error=type(exc).__name__, message=str(exc), attempt=ctx.attempt)
        raise
    return {"file": wrote, "http": sent}


EFFECTS = register(
    Kind(
        name="effects",
        version=1,
        retry=RetryPolicy(max_attempts=4, initial_s=0.2, max_s=1.0),
        input_model=EffectsInput,
        canvas=(step("deliver", deliver),),
    )
)
