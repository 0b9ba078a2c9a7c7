"""`demo`: a small durable pipeline (prepare → fan-out work → summarise) used by `proj demo`."""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, Field

from proj.engine.context import StepContext
from proj.engine.kind import Kind, RetryPolicy, fan_out, register, step


class DemoInput(BaseModel):
    title: str = Field(min_length=1, max_length=200)
    parts: int = Field(default=3, ge=0, le=100)


def prepare(ctx: StepContext) -> dict[str, object]:
    return {"chunks": [f"{ctx.input.title}#{i}" for i in range(ctx.input.parts)]}


def work(ctx: StepContext) -> str:
    return hashlib.sha256(str(ctx.item).encode()).hexdigest()[:12]


def summarise(ctx: StepContext) -> dict[str, object]:
    digests = ctx.result("work")
    return {"title": ctx.input.title, "parts": len(digests), "digests": digests}


DEMO = register(
    Kind(
        name="demo",
        version=1,
        retry=RetryPolicy.db(),
        input_model=DemoInput,
        canvas=(
            step("prepare", prepare),
            fan_out("work", work, over=lambda ctx: ctx.result("prepare")["chunks"]),
            step("summarise", summarise),
        ),
        description="prepare, fan out one step per part, summarise",
    )
)
