"""Issue 20 without services: a child step is a step like any other (names, the step lock), and
the declarations refuse what cannot work."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from proj.engine.kind import Kind, RetryPolicy, child, group, step
from proj.engine.versions import current_steps, violations


class In(BaseModel):
    n: int = 0


def _kind(*stages, **kw) -> Kind:  # noqa: ANN002, ANN003
    return Kind(name="fam", version=1, retry=RetryPolicy.db(), input_model=In, canvas=stages, **kw)


def test_a_child_step_is_a_step_of_the_lock() -> None:
    k = _kind(
        step("prep", lambda c: 1),
        child("verify", kind="import", input=lambda c: {}),
        child("each", kind="notify", input=lambda c: {}, over=lambda c: [1, 2]),
    )
    assert k.step_names() == ["prep", "verify", "each"]
    assert k.canvas[1].single and k.canvas[2].over is not None
    assert k.step_def("verify").child is not None and k.step_def("verify").fn is None
    lock = current_steps([k])
    assert lock == {"fam@1": ["prep", "verify", "each"]}
    renamed = _kind(step("prep", lambda c: 1), child("check", kind="import", input=lambda c: {}))
    assert violations(lock, current_steps([renamed]))


def test_group_refuses_a_child_step_and_a_deadline_must_be_positive() -> None:
    with pytest.raises(ValueError, match="single steps"):
        group(step("a", lambda c: 1), child("b", kind="import", input=lambda c: {}))
    with pytest.raises(ValueError, match="deadline_s"):
        _kind(step("a", lambda c: 1), deadline_s=0)
    assert _kind(step("a", lambda c: 1), deadline_s=5).deadline_s == 5
