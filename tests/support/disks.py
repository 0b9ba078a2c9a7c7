"""A disk filled by someone else, for the disk-full fault tests."""

from __future__ import annotations

import os
from pathlib import Path


def fill(root: Path) -> Path:
    """Another writer takes every free byte of the disk holding `root`; its file."""
    filler = root / "someone-elses-file"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            pass
    return filler
