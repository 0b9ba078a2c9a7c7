"""The compose stack's fixtures (tests/support/compose.py), as a pytest plugin: the test files
name it in `pytest_plugins`, which registers it once per session, so `images` and the stack are
set up once for both files (a fixture imported into each module runs once per module)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.compose import Stack, start_stack
from tests.support.dockerkit import images  # noqa: F401 - the session fixture, once per session


class Stacks:
    """The session's stack, started at the first ask, again after one is spent."""

    def __init__(self, tmp: pytest.TempPathFactory) -> None:
        self.tmp = tmp
        self.current: Stack | None = None

    def get(self) -> Stack:
        if self.current is None or self.current.spent:
            if self.current is not None:
                self.current.down()
            self.current = start_stack(self.tmp.mktemp("compose"))
        return self.current

    def close(self) -> None:
        if self.current is not None and not self.current.spent:
            self.current.down()


@pytest.fixture(scope="session")
def compose_stacks(images: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stacks]:  # noqa: F811
    stacks = Stacks(tmp_path_factory)
    try:
        yield stacks
    finally:
        stacks.close()


@pytest.fixture
def stack(compose_stacks: Stacks) -> Stack:
    """The shared stack, up (not necessarily healthy yet: the tests wait for that themselves)."""
    return compose_stacks.get()
