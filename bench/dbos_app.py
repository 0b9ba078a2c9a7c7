"""The DBOS side of bench/dbos_compare.py: a 5-step no-op workflow and a queue worker process.

    python -m bench.dbos_app --url postgresql://…/proj_bench_dbos --queue Q --executor E \
        --worker-concurrency C --poll S

One process = one DBOS executor (`DBOS.launch()`) that dequeues only from queue Q
(`DBOS.listen_queues`), at most C workflows at a time (`worker_concurrency`), polling every S
seconds. Each workflow runs five `@DBOS.step()` no-ops; DBOS checkpoints every step's output in
Postgres (`dbos.operation_outputs`) before the next one runs, which is what makes them durable
steps, as ours are. Needs the `bench` extra (`pip install -e '.[bench]'`).
"""

from __future__ import annotations

import argparse
import signal
import threading

from dbos import DBOS

APP_NAME = "proj-bench"
APP_VERSION = "bench-1"
WORKFLOW = "noop5"
STEPS = 5


@DBOS.step()
def noop(i: int, k: int) -> None:
    return None


@DBOS.workflow()
def noop5(i: int) -> int:
    for k in range(STEPS):
        noop(i, k)
    return i


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one DBOS queue worker process")
    p.add_argument("--url", required=True, help="DBOS system database (postgresql://…)")
    p.add_argument("--queue", required=True)
    p.add_argument("--executor", required=True, help="executor id (unique per process)")
    p.add_argument("--worker-concurrency", type=int, default=1, help="0: no limit (DBOS' default)")
    p.add_argument("--poll", type=float, default=1.0, help="queue polling interval, seconds")
    args = p.parse_args(argv)

    DBOS(
        config={
            "name": APP_NAME,
            "system_database_url": args.url,
            "executor_id": args.executor,
            "application_version": APP_VERSION,
            "log_level": "WARNING",
        }
    )
    DBOS.listen_queues([args.queue])
    DBOS.launch()
    DBOS.register_queue(
        args.queue,
        worker_concurrency=args.worker_concurrency or None,
        polling_interval_sec=args.poll,
        on_conflict="always_update",
    )
    print("dbos worker ready", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    DBOS.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
