"""Bad input at every entry point, property-based (DESIGN.md §5).

Each bad input must get a typed error (`proj.engine.errors.EngineError`, `outbox.OutboxError`, a
4xx from /admin) and leave what is stored unchanged: row counts and checksums of the engine's
runs, steps and signals, the outbox and the download tasks are compared before and after.
"""

from __future__ import annotations

import contextlib
import math
import re
import string
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

import outbox
from proj import db
from proj.acquisition import service, torrents
from proj.engine import runs
from proj.engine.errors import (
    BadIdempotencyKey,
    BadInput,
    BadTopic,
    EngineError,
    IdempotencyConflict,
    InvalidInput,
    PayloadTooLarge,
    UnknownKind,
)
from proj.engine.kind import get_kind, kind_names
from proj.settings import get_settings
from tests.conftest import new_key
from tests.support.services import sql

pytestmark = pytest.mark.timeout(180)

TABLES = ("engine.task_run", "engine.step", "engine.task_signal", "outbox.outbox_event", "acq.download_task")
SNAPSHOT = " UNION ALL ".join(
    f"SELECT '{t}', count(*), md5(coalesce(string_agg(x::text, '|' ORDER BY x::text), '')) FROM {t} x"
    for t in TABLES
)
TYPED = (EngineError, outbox.OutboxError)


def snapshot() -> dict[str, tuple[int, str]]:
    """Row count and checksum of every row of each table that bad input must not touch."""
    return {t: (n, h) for t, n, h in sql(SNAPSHOT)}


def rejected(call: Callable[[], Any], *errors: type[BaseException]) -> BaseException:
    """`call` raises one of `errors` (typed, by default any of ours) and nothing stored changed."""
    before = snapshot()
    with pytest.raises(errors or TYPED) as info:
        call()
    assert snapshot() == before, f"{info.value!r} left stored data changed"
    return info.value


SETTINGS = settings(
    max_examples=40,
    deadline=None,
    database=None,  # no .hypothesis/ directory in the work tree
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture
def stored() -> dict[str, Any]:
    """Data that must survive every bad call: a run, a signal, an outbox event, a download task."""
    key = "keep-" + new_key()
    ref = runs.enqueue("probe", {"n": 7}, idempotency_key=key)
    runs.signal("keep:" + key, {"ok": True})
    with db.transaction() as s:
        outbox.add(s, "probe", key, {"n": 7})
    return {"key": key, "run_id": ref.task_run_id}


# ----------------------------------------------------------------------------- strategies

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)
not_json = (
    st.binary(max_size=8)
    | st.sets(st.integers(), max_size=3)
    | st.builds(object)
    | st.just(float("nan"))
    | st.just(float("inf"))
    | st.complex_numbers(allow_nan=False, allow_infinity=False)
)
# Strings Postgres cannot store (text and jsonb): a NUL, a lone surrogate.
unstorable_text = st.builds(
    lambda a, bad, b: a + bad + b,
    st.text(max_size=5),
    st.sampled_from(["\x00", "\ud800", "\udfff"]),
    st.text(max_size=5),
)
anything = json_values | not_json | unstorable_text

ENGINE_KINDS = sorted(kind_names())
# Kinds whose model has a required field: `{}` must be refused.
REQUIRED = sorted(
    k for k in ENGINE_KINDS if any(f.is_required() for f in get_kind(k).input_model.model_fields.values())
)


# ----------------------------------------------------------------------------- enqueue


@SETTINGS
@given(name=st.text(max_size=40) | st.none() | st.integers())
def test_enqueue_unknown_kind(stored, name) -> None:
    assume(name not in kind_names())
    rejected(lambda: runs.enqueue(name, {}, idempotency_key=new_key()), UnknownKind)


@SETTINGS
@given(kind=st.sampled_from(ENGINE_KINDS), inp=st.dictionaries(st.text(max_size=20), anything, max_size=5))
def test_enqueue_any_input_is_validated_or_refused(stored, kind, inp) -> None:
    """Random inputs for every kind (tests' and the service's): a run only for a valid input,
    otherwise a typed error and nothing written."""
    model = get_kind(kind).input_model
    before = snapshot()
    try:
        ref = runs.enqueue(kind, inp, idempotency_key=new_key())
    except BadInput:
        assert snapshot() == before
        return
    stored_input = sql("SELECT input FROM engine.task_run WHERE id = %s", (ref.task_run_id,))[0][0]
    model.model_validate(stored_input)  # what was stored is valid for the kind


@SETTINGS
@given(kind=st.sampled_from(REQUIRED))
def test_enqueue_missing_required_fields(stored, kind) -> None:
    rejected(lambda: runs.enqueue(kind, {}, idempotency_key=new_key()), InvalidInput)


@SETTINGS
@given(kind=st.sampled_from(ENGINE_KINDS), inp=st.lists(json_scalars, max_size=3) | json_scalars | not_json)
def test_enqueue_input_not_a_mapping(stored, kind, inp) -> None:
    rejected(lambda: runs.enqueue(kind, inp, idempotency_key=new_key()), InvalidInput)


@SETTINGS
@given(
    case=st.sampled_from(
        [
            ("acquire", "download_task_id"),
            ("import", "download_task_id"),
            ("retire_seed", "seed_until"),
            ("compensate", "run_id"),
            ("relocate", "library_item_id"),
            ("relocate", "new_root"),
            ("reconcile_downloads", "bucket"),
            ("gated", "key"),
            ("probe", "n"),
            ("fan", "items"),
        ]
    ),
    bad=st.sampled_from(["", "not-a-uuid", "relative/path", [], {}, None, "1.5x", 1.5, [1, 2]])
    | not_json
    | unstorable_text,
)
def test_enqueue_malformed_fields_of_real_and_test_kinds(stored, case, bad) -> None:
    kind, field = case
    good = {
        "acquire": {"download_task_id": str(uuid.uuid4())},
        "import": {"download_task_id": str(uuid.uuid4()), "generation": 1},
        "retire_seed": {"download_task_id": str(uuid.uuid4()), "seed_until": "2030-01-01T00:00:00Z"},
        "compensate": {"run_id": str(uuid.uuid4()), "kind": "acquire", "input": {}},
        "relocate": {"library_item_id": 1, "new_root": "/srv/library"},
        "reconcile_downloads": {"bucket": 1},
        "gated": {"key": "k"},
        "probe": {"n": 1},
        "fan": {"items": 2},
    }[kind]
    inp = {**good, field: bad}
    model = get_kind(kind).input_model
    try:
        model.model_validate(inp)
        valid = True
    except Exception:
        valid = False
    # Some values coerce (`"" ` is a fine gated key); the rest must be refused, typed.
    if valid:
        with contextlib.suppress(BadInput):  # valid for the model but unstorable (NUL, NaN)
            runs.enqueue(kind, inp, idempotency_key=new_key())
        return
    rejected(lambda: runs.enqueue(kind, inp, idempotency_key=new_key()), InvalidInput)


@SETTINGS
@given(
    case=st.sampled_from(
        [
            ("gated", "key", "text"),
            ("compensate", "kind", "text"),
            ("compensate", "input", "any"),
            ("relocate", "new_root", "path"),
            ("probe", "slow_s", "float"),
            ("probe", "slow_step", "text"),
        ]
    ),
    data=st.data(),
)
def test_enqueue_values_the_model_accepts_but_postgres_cannot_store(stored, case, data) -> None:
    """NUL characters, lone surrogates, NaN/Infinity and objects pass a lax model (str, float,
    `Any`) but not jsonb: refused up front with `InvalidInput`, never a database error."""
    kind, field, shape = case
    base = {
        "gated": {"key": "k"},
        "compensate": {"run_id": str(uuid.uuid4()), "kind": "acquire", "input": {}},
        "relocate": {"library_item_id": 1, "new_root": "/srv"},
        "probe": {},
    }[kind]
    if shape == "float":
        bad: Any = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    elif shape == "any":
        # (NaN in an `Any` field is dumped as null by pydantic's JSON mode: stored, not refused)
        bad = {"v": data.draw(st.builds(object) | unstorable_text)}
    elif shape == "path":
        bad = "/srv/" + data.draw(unstorable_text)
    else:
        bad = data.draw(unstorable_text)
    rejected(lambda: runs.enqueue(kind, {**base, field: bad}, idempotency_key=new_key()), InvalidInput)


@SETTINGS
@given(size=st.integers(min_value=1, max_value=4).map(lambda k: k * 70_000))
def test_enqueue_oversized_inputs(stored, size) -> None:
    blob = "x" * size
    rejected(
        lambda: runs.enqueue(
            "compensate",
            {"run_id": str(uuid.uuid4()), "kind": "acquire", "input": {"blob": blob}},
            idempotency_key=new_key(),
        ),
        PayloadTooLarge,
    )
    rejected(lambda: runs.enqueue("gated", {"key": blob}, idempotency_key=new_key()), PayloadTooLarge)


bad_keys = (
    st.just("")
    | st.text(alphabet=" \t\n\r", min_size=1, max_size=5)
    | st.text(min_size=513, max_size=600)
    | st.none()
    | st.integers()
    | st.binary(min_size=1, max_size=10)
    | unstorable_text
)


@SETTINGS
@given(key=bad_keys)
def test_enqueue_bad_idempotency_keys(stored, key) -> None:
    rejected(lambda: runs.enqueue("probe", {"n": 1}, idempotency_key=key), BadIdempotencyKey)


@SETTINGS
@given(a=st.integers(-1000, 1000), b=st.integers(-1000, 1000))
def test_enqueue_conflicting_key(stored, a, b) -> None:
    assume(a != b)
    key = new_key()
    first = runs.enqueue("probe", {"n": a}, idempotency_key=key)
    assert runs.enqueue("probe", {"n": a}, idempotency_key=key).task_run_id == first.task_run_id
    err = rejected(lambda: runs.enqueue("probe", {"n": b}, idempotency_key=key), IdempotencyConflict)
    assert err.existing_run_id == first.task_run_id
    # The stored run keeps its input (and the long-stored one is untouched too).
    assert sql("SELECT input->>'n' FROM engine.task_run WHERE id = %s", (first.task_run_id,)) == [(str(a),)]
    assert sql("SELECT input->>'n' FROM engine.task_run WHERE id = %s", (stored["run_id"],)) == [("7",)]


@SETTINGS
@given(
    priority=st.integers(min_value=2**31) | st.integers(max_value=-(2**31)) | st.floats() | st.text(),
)
def test_enqueue_bad_priority(stored, priority) -> None:
    rejected(lambda: runs.enqueue("probe", {}, idempotency_key=new_key(), priority=priority), InvalidInput)


@SETTINGS
@given(at=st.text(max_size=20) | st.integers() | st.floats() | st.just(object()))
def test_enqueue_bad_available_at(stored, at) -> None:
    rejected(lambda: runs.enqueue("probe", {}, idempotency_key=new_key(), available_at=at), InvalidInput)


@SETTINGS
@given(version=st.integers(min_value=3, max_value=10**6) | st.integers(max_value=0))
def test_enqueue_unknown_version(stored, version) -> None:
    rejected(lambda: runs.enqueue("probe", {}, idempotency_key=new_key(), version=version), UnknownKind)


# ----------------------------------------------------------------------------- outbox.add


def add_in_txn(kind: Any, key: Any, payload: Any) -> None:
    with db.transaction() as s:
        outbox.add(s, kind, key, payload)


@SETTINGS
@given(
    kind=st.just("")
    | st.text(alphabet=" \t\n", min_size=1, max_size=4)
    | st.text(min_size=201, max_size=260)
    | st.none()
    | st.integers()
    | unstorable_text,
)
def test_outbox_bad_kind(stored, kind) -> None:
    rejected(lambda: add_in_txn(kind, new_key(), {"n": 1}), outbox.BadEvent)


@SETTINGS
@given(key=bad_keys)
def test_outbox_bad_key(stored, key) -> None:
    rejected(lambda: add_in_txn("probe", key, {"n": 1}), outbox.BadEvent)


@SETTINGS
@given(
    payload=st.lists(json_scalars, max_size=3)
    | json_scalars
    | not_json
    | st.dictionaries(st.text(max_size=5), not_json | unstorable_text, min_size=1, max_size=3)
    | st.dictionaries(unstorable_text, json_scalars, min_size=1, max_size=2)
    | st.builds(lambda v: {"deep": [{"x": v}]}, not_json | unstorable_text)
)
def test_outbox_bad_payload(stored, payload) -> None:
    rejected(lambda: add_in_txn("probe", new_key(), payload), outbox.BadEvent)


def test_outbox_oversized_payload(stored) -> None:
    big = {"blob": "x" * (outbox.core.MAX_PAYLOAD_BYTES + 1)}
    rejected(lambda: add_in_txn("probe", new_key(), big), outbox.BadEvent)


@SETTINGS
@given(a=json_values, b=json_values)
def test_outbox_conflict(stored, a, b) -> None:
    assume(not any(isinstance(v, float) and math.isnan(v) for v in _leaves(a) + _leaves(b)))
    key = new_key()
    try:
        add_in_txn("probe", key, {"v": a})
    except outbox.BadEvent:
        return  # NaN/Infinity inside: refused, covered above
    if _canon({"v": a}) == _canon({"v": b}):
        add_in_txn("probe", key, {"v": b})  # the same event again: fine
        return
    try:
        add_in_txn("probe", "probe-" + new_key(), {"v": b})  # `b` itself must be storable
    except outbox.BadEvent:
        return
    rejected(lambda: add_in_txn("probe", key, {"v": b}), outbox.OutboxConflict)


def _leaves(v: Any) -> list[Any]:
    if isinstance(v, dict):
        return [x for val in v.values() for x in _leaves(val)]
    if isinstance(v, list):
        return [x for val in v for x in _leaves(val)]
    return [v]


def _canon(v: Any) -> str:
    import json

    return json.dumps(v, sort_keys=True)


# ----------------------------------------------------------------------------- signal

TOPIC_OK = string.ascii_letters + string.digits + "_.-"
bad_topics = (
    st.just("")
    | st.text(min_size=1, max_size=10).map(lambda s: f"a {s}")  # a space
    | st.text(min_size=1, max_size=10).map(lambda s: f"{s} ")
    | st.text(alphabet=TOPIC_OK, min_size=65, max_size=80)  # name too long
    | st.text(alphabet=TOPIC_OK, min_size=201, max_size=220).map(lambda s: f"download:{s}")
    | st.integers(min_value=57, max_value=90).map(lambda n: "t" + ":abcdefgh" * n)  # > 512 in all
    | st.builds(
        lambda a, c, b: f"{a}{c}{b}",
        st.text(alphabet=TOPIC_OK, min_size=1, max_size=5),
        st.sampled_from(["\x00", "\n", "\r", "\t", "\x1b", "\x7f", "\u200b", "\u2028", "é", "\ud800"]),
        st.text(alphabet=TOPIC_OK, max_size=5),
    )
    | st.builds(lambda a: f"{a}\n", st.text(alphabet=TOPIC_OK, min_size=1, max_size=8))  # trailing newline
    | st.builds(lambda a: f"download:{a}\n", st.text(alphabet="0123456789abcdef", min_size=1, max_size=40))
    | st.none()
    | st.integers()
    | st.binary(max_size=5)
)


@SETTINGS
@given(topic=bad_topics)
def test_signal_bad_topics(stored, topic) -> None:
    rejected(lambda: runs.signal(topic), BadTopic)


def _not_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


# A signal payload goes through `to_jsonable_python` (UUIDs, datetimes, models, sets and UTF-8
# bytes become JSON); what still cannot be stored must be refused.
signal_junk = (
    st.builds(object)
    | st.just(float("nan"))
    | st.just(float("-inf"))
    | st.binary(min_size=1, max_size=6).filter(_not_utf8)
    | st.just(b"a\x00b")
    | unstorable_text
)


@SETTINGS
@given(payload=signal_junk | st.builds(lambda v: {"x": [v]}, signal_junk))
def test_signal_bad_payloads(stored, payload) -> None:
    rejected(lambda: runs.signal("ok:topic", payload), BadInput)


def test_signal_oversized_payload(stored) -> None:
    big = {"blob": "x" * (get_settings().max_input_bytes + 1)}
    rejected(lambda: runs.signal("ok:topic", big), PayloadTooLarge)


# ----------------------------------------------------------------------------- torrents


def bencode(v: Any) -> bytes:
    if isinstance(v, bool):
        v = int(v)
    if isinstance(v, int):
        return b"i%de" % v
    if isinstance(v, str):
        v = v.encode("utf-8", "surrogatepass")
    if isinstance(v, bytes):
        return b"%d:%s" % (len(v), v)
    if isinstance(v, list):
        return b"l" + b"".join(bencode(x) for x in v) + b"e"
    if isinstance(v, dict):
        items = sorted((k.encode() if isinstance(k, str) else k, x) for k, x in v.items())
        return b"d" + b"".join(bencode(k) + bencode(x) for k, x in items) + b"e"
    raise TypeError(type(v))


def request(data: bytes, **kw: Any) -> uuid.UUID:
    with db.sessions().begin() as s:
        return service.request_download(s, requester=kw.pop("requester", "eve"), torrent=data, **kw)


@SETTINGS
@given(data=st.binary(max_size=512))
def test_torrent_random_bytes(stored, data) -> None:
    rejected(lambda: request(data), torrents.BadTorrent)


segment = st.sampled_from(["..", ".", "", "/", "/etc", "a/b", "a\\b", "x\x00y", "ok", "sub", "f.bin"])
name_st = st.sampled_from(["..", ".", "", "/abs", "../up", "a/../b", "ok", "show"])


def _info(name: Any, files: list[list[Any]] | None, length: Any = 5) -> dict[str, Any]:
    info: dict[str, Any] = {"name": name, "piece length": 16384, "pieces": b"\x00" * 20}
    if files is None:
        info["length"] = length
    else:
        info["files"] = [{"path": p, "length": length} for p in files]
    return info


def _safe(rel: str) -> bool:
    return not rel.startswith("/") and all(seg not in ("", ".", "..") for seg in rel.split("/"))


@SETTINGS
@given(name=name_st, paths=st.lists(st.lists(segment, max_size=4), min_size=1, max_size=4))
def test_torrent_paths_never_escape(stored, name, paths) -> None:
    """Multi-file torrents built from risky segments: refused, or every path is a plain relative
    path under the task's folder, no two files collide and no file is another's folder."""
    data = bencode({"info": _info(name, paths)})
    before = snapshot()
    try:
        meta = torrents.parse(data)
    except torrents.BadTorrent:
        rejected(lambda: request(data), torrents.BadTorrent)
        return
    assert _safe(meta.name), meta.name
    rels = [f.rel_path for f in meta.files]
    assert all(_safe(r) for r in rels), rels
    assert len(set(rels)) == len(rels), f"duplicate file paths accepted: {rels}"
    dirs = {"/".join(r.split("/")[:i]) for r in rels for i in range(1, r.count("/") + 1)}
    assert not dirs & set(rels), f"a file is also a folder: {rels}"
    assert snapshot() == before


@SETTINGS
@given(
    paths=st.lists(
        st.lists(st.sampled_from(["a", "b", "c.bin"]), min_size=1, max_size=3), min_size=1, max_size=4
    )
)
def test_torrent_colliding_paths(stored, paths) -> None:
    """Plain names only, so collisions are frequent: two files on one path, or a file that is
    another file's folder, cannot be laid out on disk and must be refused at request time."""
    rels = ["/".join(p) for p in paths]
    folders = {"/".join(p[:i]) for p in paths for i in range(1, len(p))}
    data = bencode({"info": _info("show", paths)})
    if len(set(rels)) != len(rels) or folders & set(rels):
        rejected(lambda: request(data), torrents.BadTorrent)
    else:
        assert [f.rel_path for f in torrents.parse(data).files] == rels


@SETTINGS
@given(
    name=st.binary(min_size=1, max_size=12),
    segs=st.lists(st.lists(st.binary(max_size=6), max_size=3), max_size=3),
)
def test_torrent_raw_byte_names(stored, name, segs) -> None:
    """Arbitrary bytes as names: either refused (`BadTorrent`) or stored; never a database error."""
    data = bencode({"info": _info(name, segs or None)})
    before = snapshot()
    try:
        request(data)
    except torrents.BadTorrent:
        assert snapshot() == before


@SETTINGS
@given(
    name=name_st | st.sampled_from(["x\x00", "a\\b"]),
    length=st.sampled_from([5, -1, "5", None, [], {}]),
)
def test_torrent_single_file_names_and_lengths(stored, name, length) -> None:
    data = bencode({"info": _info(name, None, length if length is not None else 5)})
    try:
        meta = torrents.parse(data)
    except torrents.BadTorrent:
        rejected(lambda: request(data), torrents.BadTorrent)
        return
    assert _safe(meta.name) and all(f.size >= 0 for f in meta.files)


@SETTINGS
@given(
    top=st.sampled_from([[], 42, "str", {}, {"info": 1}, {"info": []}, {"info": {}}, {"info": {"name": "x"}}])
)
def test_torrent_wrong_shapes(stored, top) -> None:
    rejected(lambda: request(bencode(top)), torrents.BadTorrent)


def test_torrent_oversized(stored) -> None:
    data = bencode({"comment": "x" * (torrents.MAX_TORRENT_BYTES + 1), "info": _info("ok", None)})
    rejected(lambda: request(data), torrents.BadTorrent)


@SETTINGS
@given(
    kw=st.sampled_from(
        [
            {"requester": ""},
            {"requester": "x" * 201},
            {"webhook_url": "ftp://example"},
            {"webhook_url": "javascript:alert(1)"},
            {"requester": "a\x00b"},
            {"title": "t\x00"},
        ]
    )
)
def test_request_bad_fields(stored, kw) -> None:
    data = bencode({"info": _info("ok.bin", None)})
    rejected(lambda: request(data, **kw), BadInput)


# ----------------------------------------------------------------------------- /admin forms

PASSWORD = "pw-" + uuid.uuid4().hex


@pytest.fixture
def admin(stored) -> Iterator[TestClient]:
    from proj.admin.app import create_app

    settings_ = get_settings().model_copy(update={"admin_password": SecretStr(PASSWORD)})
    with TestClient(create_app(settings_)) as c:
        c.auth = ("admin", PASSWORD)
        yield c


def csrf(client: TestClient) -> str:
    m = re.search(r'name="csrf_token" value="([^"]+)"', client.get("/admin/parked").text)
    assert m
    return m.group(1)


def posted(client: TestClient, path: str, data: dict[str, Any], *want: int) -> None:
    before = snapshot()
    r = client.post(path, data=data, follow_redirects=False)
    assert r.status_code in want, (path, r.status_code, r.text[:300])
    assert snapshot() == before, f"POST {path} changed stored data"


@SETTINGS
@given(
    action=st.sampled_from(["retry", "abandon", "cancel"]),
    run_id=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)
    | st.uuids().map(str),
)
def test_admin_bad_run_ids(admin, action, run_id) -> None:
    """A run id that is no run: 404 (or 405 when it routes elsewhere), never 5xx, nothing changes."""
    token = csrf(admin)
    posted(admin, f"/admin/runs/{quote(run_id, safe='')}/{action}", {"csrf_token": token}, 404, 405)


@SETTINGS
@given(
    action=st.sampled_from(["retry", "abandon", "cancel"]),
    token=st.none() | st.just("") | st.text(alphabet=string.ascii_letters + string.digits, max_size=43),
)
def test_admin_posts_without_csrf(admin, stored, action, token) -> None:
    data = {} if token is None else {"csrf_token": token}
    posted(admin, f"/admin/runs/{stored['run_id']}/{action}", data, 403)
    posted(admin, "/admin/signal", {**data, "topic": "approval:x"}, 403)


@SETTINGS
@given(
    reason=st.builds(
        lambda a, b: a + "\x00" + b, st.text(max_size=5, alphabet=string.printable), st.text(max_size=5)
    ).filter(lambda s: not any(0xD800 <= ord(c) <= 0xDFFF for c in s))
)
def test_admin_cancel_with_an_unstorable_reason(admin, stored, reason) -> None:
    token = csrf(admin)
    posted(admin, f"/admin/runs/{stored['run_id']}/cancel", {"csrf_token": token, "reason": reason}, 400)


@SETTINGS
@given(topic=bad_topics.filter(lambda t: isinstance(t, str) and "\ud800" not in t))
def test_admin_signal_bad_topic(admin, topic) -> None:
    """The form answers with the engine's error (flash after redirect) and stores nothing."""
    token = csrf(admin)
    if topic.strip() and runs.TOPIC_RE.fullmatch(topic.strip()) and len(topic.strip()) <= runs.MAX_TOPIC_LEN:
        return  # only surrounding whitespace was wrong: the form strips it, a valid topic
    before = snapshot()
    r = admin.post("/admin/signal", data={"csrf_token": token, "topic": topic})
    assert r.status_code in (200, 400, 422), r.status_code  # 422: FastAPI's "field required"
    assert r.status_code != 200 or "bad signal topic" in r.text
    assert snapshot() == before


def test_enqueue_with_now(stored) -> None:
    """Sanity: the snapshot sees a real write (so 'unchanged' above means something)."""
    before = snapshot()
    runs.enqueue("probe", {}, idempotency_key=new_key(), available_at=datetime.now(UTC))
    assert snapshot() != before
