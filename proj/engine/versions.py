"""Version discipline (invariant 10): a committed lock of step names per kind@version.

Within a version, steps may only be appended. A run stores its version and its steps by stage
index, so renaming, removing, reordering or inserting a step under the same version would make
in-flight runs execute the wrong code; such a change needs a new version instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from proj.engine.kind import Kind, all_kinds

LOCK_PATH = Path(__file__).resolve().parents[1] / "kinds" / "steps.lock.json"


def service_kinds() -> list[Kind]:
    """The service's own kinds (declared under `proj.`), not test or plugin kinds."""
    return [k for k in all_kinds() if k.input_model.__module__.startswith("proj.")]


def current_steps(kinds: list[Kind] | None = None) -> dict[str, list[str]]:
    return {f"{k.name}@{k.version}": k.step_names() for k in (kinds or service_kinds())}


def read_lock(path: Path = LOCK_PATH) -> dict[str, list[str]]:
    return json.loads(path.read_text()) if path.exists() else {}


def violations(lock: dict[str, list[str]], current: dict[str, list[str]]) -> list[str]:
    """What breaks the lock: changed prefixes of locked versions, and versions not locked yet.

    A locked version that is gone from the code is allowed (it drained and was retired).
    """
    problems: list[str] = []
    for key, locked in sorted(lock.items()):
        steps = current.get(key)
        if steps is None:
            continue
        if steps[: len(locked)] != locked:
            problems.append(
                f"{key}: steps {locked} became {steps}; only appending is allowed within a "
                "version, bump the version instead"
            )
    for key in sorted(set(current) - set(lock)):
        problems.append(f"{key} is not in {LOCK_PATH.name}: run `proj lock-steps` and commit it")
    return problems


def write_lock(path: Path = LOCK_PATH) -> dict[str, list[str]]:
    """Record new versions and appended steps; refuses to rewrite a locked prefix."""
    lock, current = read_lock(path), current_steps()
    bad = [p for p in violations(lock, current) if "not in" not in p]
    if bad:
        raise ValueError("; ".join(bad))
    merged = {**lock, **current}
    path.write_text(json.dumps(dict(sorted(merged.items())), indent=2) + "\n")
    return merged
