"""The memo of refused qBittorrent credentials names them by a digest a reader of `acq.flag`
cannot turn back into the password (`proj.acquisition.qbt.credentials_digest`)."""

from __future__ import annotations

import hashlib
import time

from proj.acquisition.qbt import credentials_digest


def test_the_same_credentials_give_the_same_name_in_every_process() -> None:
    a = credentials_digest("http://qbt:8080", "admin", "secret")
    credentials_digest.cache_clear()  # computed again, as another process would
    assert credentials_digest("http://qbt:8080", "admin", "secret") == a
    assert len(a) == 64 and "secret" not in a


def test_changed_credentials_or_another_qbittorrent_give_another_name() -> None:
    a = credentials_digest("http://qbt:8080", "admin", "secret")
    assert credentials_digest("http://qbt:8080", "admin", "secret2") != a
    assert credentials_digest("http://qbt:8080", "admin2", "secret") != a
    assert credentials_digest("http://other:8080", "admin", "secret") != a
    # the fields stay apart: ("ab", "c") is not ("a", "bc")
    assert credentials_digest("u", "ab", "c") != credentials_digest("u", "a", "bc")


def test_the_name_is_no_fast_hash_of_the_password() -> None:
    """Before, it was the sha256 of URL, user and password: a GPU tries billions of guesses a
    second against that. Now each guess costs scrypt's 16 MiB, and the URL and user salt it."""
    plain = hashlib.sha256(b"http://qbt:8080\0admin\0secret").hexdigest()
    credentials_digest.cache_clear()
    started = time.perf_counter()
    got = credentials_digest("http://qbt:8080", "admin", "secret")
    took = time.perf_counter() - started
    assert got != plain
    salt = hashlib.sha256(b"proj qbt login memo\0http://qbt:8080\0admin").digest()
    assert got == hashlib.scrypt(b"secret", salt=salt, n=2**14, r=8, p=1, dklen=32).hex()
    print(f"one digest took {took * 1000:.0f} ms")  # shown with -s; not asserted (no timed assertions)
