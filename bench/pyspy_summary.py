"""Summarise a py-spy speedscope profile of the worker (from `bench.throughput --profile X.json`).

Only samples of prefork children (stacks through billiard's `workloop`) count. Prints the share of
child time spent under each engine frame (`proj/…`, by function and line) and a few library
frames that tell where it goes: Postgres round trips, pool pre-ping, commits, broker publishes.

    .venv/bin/python -m bench.pyspy_summary /tmp/prof.json [--top 40]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

LIBRARY = (
    "Connection.wait",  # psycopg: waiting for Postgres to answer
    "Cursor.execute",
    "do_ping",  # SQLAlchemy pool_pre_ping
    "DefaultDialect.do_commit",
    "Celery.send_task",
    "Producer._publish",
    "EventDispatcher.publish",
)


def summarise(path: Path) -> tuple[float, Counter[str]]:
    data = json.loads(path.read_text())
    frames = data["shared"]["frames"]
    total = 0.0
    shares: Counter[str] = Counter()
    for profile in data["profiles"]:
        for stack, weight in zip(profile["samples"], profile["weights"], strict=True):
            chain = [frames[i] for i in stack]
            if not any(f["name"].endswith("workloop") for f in chain):
                continue
            total += weight
            seen: set[str] = set()
            for f in chain:
                file = f.get("file", "")
                if "/proj/" in file and "site-packages" not in file:
                    key = f"{f['name']} ({file.rsplit('/proj/', 1)[1]}:{f.get('line')})"
                elif any(f["name"].endswith(name) for name in LIBRARY):
                    key = f["name"]
                else:
                    continue
                if key not in seen:
                    seen.add(key)
                    shares[key] += weight
    return total, shares


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profile", type=Path)
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    total, shares = summarise(args.profile)
    print(f"prefork children: {total:.1f} s of samples")
    for key, value in shares.most_common(args.top):
        print(f"  {100 * value / total:5.1f}%  {key}")


if __name__ == "__main__":
    main()
