"""The one check of an `Authorization: Bearer <token>` header, shared by the API's tokens
(`API_TOKEN`, `HOOK_TOKEN`: `api.token_refusal`) and the metrics token (`metrics.check_token`)."""

from __future__ import annotations

import secrets


def bearer_matches(authorization: str | None, expected: str) -> bool:
    """Whether the header is exactly `Bearer <expected>` (scheme in any case), compared in
    constant time.

    Header values reach the app decoded as latin-1: their bytes back are what the client sent,
    so a non-ASCII token (sent as UTF-8) matches too
    (`tests/integration/test_front_door_review.py::test_a_non_ascii_api_token_is_accepted`,
    `tests/integration/test_metrics.py::test_a_non_ascii_metrics_token_matches`).
    """
    scheme, _, value = (authorization or "").partition(" ")
    sent = value.strip().encode("latin-1", "replace")
    return scheme.lower() == "bearer" and secrets.compare_digest(sent, expected.encode())
