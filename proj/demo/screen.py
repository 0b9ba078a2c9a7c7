"""The one console every part of the demo prints to."""

from __future__ import annotations

from rich.console import Console

console = Console()
