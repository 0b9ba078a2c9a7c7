"""A throw-away qbittorrent-nox on loopback, for tests and the demo.

Each `LocalQbittorrent` owns a profile directory (`--profile=DIR`) whose
`qBittorrent/config/qBittorrent.conf` is written before start, so two or more instances run side
by side without touching the user's real qBittorrent. Everything peer-discovery related (DHT,
PeX, LSD, UPnP/NAT-PMP) is off and both the Web UI and the BitTorrent port bind to 127.0.0.1, so
peers only meet when a caller introduces them with `add_peer`.

Config keys were checked against the qBittorrent 4.5.2 source (Debian 12 `qbittorrent-nox`) and
current upstream: "run on torrent finished" is `[AutoRun] enabled` / `program` in both.
`start()` reads the preferences back over the Web API and fails loudly if a future version
ignored any of them.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import hashlib
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

LOOPBACK = "127.0.0.1"
DEFAULT_BINARY = "qbittorrent-nox"

IniValue = bool | int | float | str | bytes | Path
IniConfig = Mapping[str, Mapping[str, IniValue]]

# PIDs of every qbittorrent-nox started by this process: stray-process checks and atexit cleanup.
_live_pids: set[int] = set()
_live_lock = threading.Lock()


class QbtHarnessError(RuntimeError):
    """The local qbittorrent-nox could not be started, configured or reached."""


# --------------------------------------------------------------------------- .torrent creation


def make_torrent(
    data_path: Path, tracker: str | None = None, piece_size: int | None = None
) -> tuple[bytes, str]:
    """Build a .torrent for a file or directory so tests need no fixture files.

    Returns the bencoded metainfo and the v1 infohash (lowercase hex). Seed it with
    `save_path=seed_save_path(data_path)`.
    """
    import torf  # local import: only harness users pay for it

    data_path = Path(data_path)
    if not data_path.exists():
        raise FileNotFoundError(data_path)
    t = torf.Torrent(
        path=data_path,
        trackers=[tracker] if tracker else None,
        piece_size=piece_size,
        created_by="proj.qbt.local",
    )
    t.generate()
    return t.dump(), str(t.infohash).lower()


def seed_save_path(data_path: Path) -> Path:
    """The `save_path` that makes qBittorrent find `data_path` as the torrent's content.

    The torrent's name is the file or directory name, so the content lives in its parent.
    """
    return Path(data_path).resolve().parent


# --------------------------------------------------------------------------- config helpers


def pbkdf2_password_hash(password: str, *, salt: bytes | None = None) -> str:
    """qBittorrent's `WebUI\\Password_PBKDF2` value, so a known password needs no UI step."""
    salt = salt if salt is not None else secrets.token_bytes(16)
    key = hashlib.pbkdf2_hmac("sha512", password.encode("utf-8"), salt, 100_000, dklen=64)
    return f"{base64.b64encode(salt).decode()}:{base64.b64encode(key).decode()}"


def _bindable(port: int, host: str = LOOPBACK) -> bool:
    """Whether `port` (TCP and its UDP twin) can be bound on `host` right now."""
    try:
        with (
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp,
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp,
        ):
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tcp.bind((host, port))
            udp.bind((host, port))
    except OSError:
        return False
    return True


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free right now (and its UDP twin too, for uTP); racy but retried."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind((host, 0))
            port = tcp.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind((host, port))
                except OSError:
                    continue
            return int(port)
    raise QbtHarnessError("no free port found on loopback")


def _ini_quote(text: str) -> str:
    """Quote a string the way QSettings' INI reader unquotes it (commas stay, no list split)."""
    out: list[str] = []
    hex_pending = False
    for ch in text:
        if ch in "\r\n\0":
            raise ValueError("newlines/NUL are not allowed in qBittorrent config values")
        if hex_pending and ch in "0123456789abcdefABCDEF":
            out.append(f"\\x{ord(ch):04x}")
            continue
        hex_pending = False
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ord(ch) > 0x7E or ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):04x}")
            hex_pending = True
        else:
            out.append(ch)
    body = "".join(out)
    if body.startswith("@"):
        body = "@" + body  # QSettings reserves a leading @ for typed values (@ByteArray...)
    return f'"{body}"'


def _ini_value(value: IniValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, bytes):  # already-encoded QSettings literal, e.g. @ByteArray(...)
        return '"' + value.decode("ascii") + '"'
    return _ini_quote(str(value))


def render_ini(config: IniConfig) -> str:
    """Render `{section: {"A/B": value}}` as a QSettings INI file (`/` in keys becomes `\\`)."""
    lines: list[str] = []
    for section, items in config.items():
        if not items:
            continue
        lines.append(f"[{section}]")
        for key, value in items.items():
            lines.append(f"{key.replace('/', chr(92))}={_ini_value(value)}")
        lines.append("")
    return "\n".join(lines)


@lru_cache(maxsize=8)
def _help_text(binary: str) -> str:
    try:
        proc = subprocess.run(
            [binary, "--help"], capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise QbtHarnessError(f"cannot run {binary!r}: {exc}") from exc
    return proc.stdout + proc.stderr


def qbittorrent_version(binary: str = DEFAULT_BINARY) -> str:
    """Installed qbittorrent-nox version string (e.g. 'v4.5.2'), for logs and skip decisions."""
    proc = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL
    )
    return (proc.stdout.strip().split() or ["unknown"])[-1]


def supports_confirm_legal_notice(binary: str = DEFAULT_BINARY) -> bool:
    """Newer qBittorrent (4.6+/5.x) wants `--confirm-legal-notice`; 4.5 rejects unknown flags."""
    return "--confirm-legal-notice" in _help_text(binary)


def _wait(predicate: Callable[[], T | None], timeout: float, interval: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        try:
            result = predicate()
            if result:
                return result
        except Exception as exc:  # noqa: BLE001 - polled operations fail transiently
            last_exc = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_exc!r})" if last_exc else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        time.sleep(interval)


# --------------------------------------------------------------------------- the process wrapper


class LocalQbittorrent:
    """One qbittorrent-nox process on 127.0.0.1 with a private profile directory.

    Ports default to free ones picked at start. `on_finished` is qBittorrent's "run external
    program on torrent finished" command line; it is split on spaces with double quotes grouping
    (no shell), and `%K` (the torrent id the API names it by), `%I` (v1 infohash), `%N` (name),
    `%F` (content path), `%G` (tags) ... are substituted. Use `sh -c "..."` (double quotes) for shell syntax.
    """

    def __init__(
        self,
        profile_dir: Path | None = None,
        *,
        save_path: Path | None = None,
        on_finished: str | None = None,
        username: str | None = None,
        password: str | None = None,
        localhost_auth_bypass: bool = True,
        webui_port: int | None = None,
        listen_port: int | None = None,
        upload_limit: int | None = None,
        download_limit: int | None = None,
        extra_config: IniConfig | None = None,
        binary: str = DEFAULT_BINARY,
        name: str = "qbt",
    ) -> None:
        if (username is None) != (password is None):
            raise ValueError("give both username and password, or neither")
        if not localhost_auth_bypass and password is None:
            raise ValueError("localhost_auth_bypass=False needs a username/password")
        self.name = name
        self._owns_profile = profile_dir is None
        self.profile_dir = (
            Path(tempfile.mkdtemp(prefix=f"qbt-{name}-")) if profile_dir is None else profile_dir
        ).resolve()
        self._save_path = (save_path or self.profile_dir / "downloads").resolve()
        self.on_finished = on_finished
        self.username = username
        self.__password = password
        self.localhost_auth_bypass = localhost_auth_bypass
        self._fixed_webui_port = webui_port
        self._fixed_listen_port = listen_port
        self._webui_port = webui_port or 0
        self._listen_port = listen_port or 0
        self.upload_limit = upload_limit
        self.download_limit = download_limit
        self.extra_config = extra_config or {}
        self.binary = binary
        self._proc: subprocess.Popen[bytes] | None = None
        self._out: Any = None

    def __repr__(self) -> str:  # never shows the password
        state = "running" if self.running else "stopped"
        where = f"webui={self.webui_url} dir={self.profile_dir}"
        return f"<LocalQbittorrent {self.name} {state} {where}>"

    # ------------------------------------------------------------------ properties

    @property
    def webui_url(self) -> str:
        """Base URL of the Web UI/API, e.g. http://127.0.0.1:PORT."""
        return f"http://{LOOPBACK}:{self._webui_port}"

    @property
    def webui_port(self) -> int:
        return self._webui_port

    @property
    def listen_port(self) -> int:
        """BitTorrent (TCP + uTP) port; peers reach this instance at 127.0.0.1:listen_port."""
        return self._listen_port

    @property
    def peer_address(self) -> str:
        """`127.0.0.1:listen_port`, the form `add_peer` takes."""
        return f"{LOOPBACK}:{self._listen_port}"

    @property
    def save_path(self) -> Path:
        """Default download directory of this instance."""
        return self._save_path

    @property
    def config_path(self) -> Path:
        return self.profile_dir / "qBittorrent" / "config" / "qBittorrent.conf"

    @property
    def log_path(self) -> Path:
        """qbittorrent-nox stdout/stderr; qBittorrent's own log is `qbt_log_path`."""
        return self.profile_dir / "qbittorrent-nox.out.log"

    @property
    def qbt_log_path(self) -> Path:
        return self.profile_dir / "qBittorrent" / "data" / "logs" / "qbittorrent.log"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------------ config

    def config(self) -> dict[str, dict[str, IniValue]]:
        """The INI content written before start (keys as in qBittorrent's settings storage)."""
        prefs: dict[str, IniValue] = {
            "WebUI/Enabled": True,
            "WebUI/Address": LOOPBACK,
            "WebUI/Port": self._webui_port,
            "WebUI/LocalHostAuth": not self.localhost_auth_bypass,
            "WebUI/UseUPnP": False,
            "WebUI/HostHeaderValidation": True,
            "WebUI/CSRFProtection": True,
            "General/Locale": "en",
        }
        if self.username is not None and self.__password is not None:
            prefs["WebUI/Username"] = self.username
            digest = pbkdf2_password_hash(self.__password)
            prefs["WebUI/Password_PBKDF2"] = f"@ByteArray({digest})".encode("ascii")
        session: dict[str, IniValue] = {
            "Session/Port": self._listen_port,
            "Session/InterfaceAddress": LOOPBACK,
            "Session/DHTEnabled": False,
            "Session/PeXEnabled": False,
            "Session/LSDEnabled": False,
            "Session/Encryption": 0,  # 0 = allow (prefer), 1 = require, 2 = disable
            "Session/QueueingSystemEnabled": False,
            "Session/IgnoreSlowTorrentsForQueueing": True,
            "Session/MultiConnectionsPerIp": True,  # every local peer shares 127.0.0.1
            "Session/AnonymousModeEnabled": False,
            "Session/AddTorrentPaused": False,
            "Session/DefaultSavePath": str(self._save_path),
            "Session/TempPathEnabled": False,
            "Session/DisableAutoTMMByDefault": True,
            "Session/AddExtensionToIncompleteFiles": False,
            "Session/Preallocation": False,
        }
        if self.upload_limit:
            session["Session/GlobalUPSpeedLimit"] = max(1, self.upload_limit // 1024)  # KiB/s
        if self.download_limit:
            session["Session/GlobalDLSpeedLimit"] = max(1, self.download_limit // 1024)
        autorun: dict[str, IniValue] = {"enabled": self.on_finished is not None}
        if self.on_finished is not None:
            autorun["program"] = self.on_finished
        cfg: dict[str, dict[str, IniValue]] = {
            "LegalNotice": {"Accepted": True},
            "Application": {
                "FileLogger/Enabled": True,
                "FileLogger/Path": str(self.profile_dir / "qBittorrent" / "data" / "logs"),
            },
            "Preferences": prefs,
            "BitTorrent": session,
            "Network": {"PortForwardingEnabled": False},
            "AutoRun": autorun,
        }
        for section, items in self.extra_config.items():
            cfg.setdefault(section, {}).update(items)
        return cfg

    def write_config(self) -> Path:
        """Write the profile's qBittorrent.conf (also what the Docker image's entrypoint does)."""
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        self._save_path.mkdir(parents=True, exist_ok=True)
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(render_ini(self.config()), encoding="ascii")
        os.chmod(tmp, 0o600)  # holds the password hash
        tmp.replace(self.config_path)
        return self.config_path

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 30) -> LocalQbittorrent:
        """Write the config, launch qbittorrent-nox and wait until the Web API answers."""
        if self.running:
            return self
        if shutil.which(self.binary) is None and not Path(self.binary).exists():
            raise QbtHarnessError(
                f"{self.binary!r} not found; install it (Debian: apt-get install qbittorrent-nox)"
            )
        attempts = 1 if (self._fixed_webui_port and self._fixed_listen_port) else 3
        last: Exception | None = None
        for _ in range(attempts):
            self._webui_port = self._fixed_webui_port or free_port()
            self._listen_port = self._fixed_listen_port or free_port()
            while self._listen_port == self._webui_port:
                self._listen_port = free_port()
            try:
                self._launch(timeout)
                self._verify_preferences()
                self._wait_listening()
                return self
            except QbtHarnessError as exc:  # most likely a port taken between pick and bind
                last = exc
                log.warning("qbittorrent %s failed to start, retrying: %s", self.name, exc)
                self.stop()
        raise QbtHarnessError(f"qbittorrent {self.name} did not start: {last}") from last

    def _launch(self, timeout: float) -> None:
        self.write_config()
        cmd = [self.binary, f"--profile={self.profile_dir}"]
        if supports_confirm_legal_notice(self.binary):
            cmd.append("--confirm-legal-notice")
        # QBT_* variables override command-line options; keep the caller's out of it.
        env = {k: v for k, v in os.environ.items() if not k.startswith("QBT_")}
        env.setdefault("LANG", "C.UTF-8")
        self._out = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.profile_dir,
            start_new_session=True,  # a Ctrl-C in the demo is ours to handle, not its
        )
        with _live_lock:
            _live_pids.add(self._proc.pid)
        log.info(
            "started qbittorrent-nox %s pid=%s webui=%s listen=%s profile=%s",
            self.name,
            self._proc.pid,
            self.webui_url,
            self._listen_port,
            self.profile_dir,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise QbtHarnessError(
                    f"exited with code {self._proc.returncode}; log tail:\n{self.log_tail()}"
                )
            if self._api_answers():
                return
            time.sleep(0.2)
        raise QbtHarnessError(f"Web API not up within {timeout}s; log tail:\n{self.log_tail()}")

    def _api_answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.webui_url}/api/v2/app/version", timeout=2) as r:
                return r.status == 200
        except urllib.error.HTTPError as exc:
            return exc.code in (401, 403)  # up, just wants a login
        except (OSError, ValueError):
            return False

    def _wait_listening(self, timeout: float = 10) -> None:
        """Fail (and so retry on fresh ports) unless qBittorrent accepts peers on its port.

        Why: a port picked free may be taken before qBittorrent binds it (any process' outgoing
        connection can be given it), and qBittorrent then runs, answers its API, and reaches no
        peer; a restarted instance's download stalled so in CI."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection((LOOPBACK, self._listen_port), timeout=1),
            ):
                return
            time.sleep(0.2)
        raise QbtHarnessError(
            f"not listening on {LOOPBACK}:{self._listen_port}; log tail:\n{self.log_tail()}"
        )

    def _verify_preferences(self) -> None:
        """Fail loudly when the running version ignored a config key we rely on."""
        prefs = self.client().app_preferences()
        expected: dict[str, Any] = {
            "dht": False,
            "pex": False,
            "lsd": False,
            "upnp": False,
            "queueing_enabled": False,
            "listen_port": self._listen_port,
            "autorun_enabled": self.on_finished is not None,
        }
        if self.on_finished is not None:
            expected["autorun_program"] = self.on_finished
        wrong = {k: (prefs.get(k), v) for k, v in expected.items() if prefs.get(k) != v}
        if wrong:
            raise QbtHarnessError(f"config not applied (got, want): {wrong}")

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM (lets it save resume data), then SIGKILL after `timeout` seconds."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    log.warning("qbittorrent %s ignored SIGTERM; killing", self.name)
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    proc.wait(timeout=10)
            with _live_lock:
                _live_pids.discard(proc.pid)
            log.info("stopped qbittorrent-nox %s pid=%s", self.name, proc.pid)
        if self._out is not None:
            self._out.close()
            self._out = None

    def restart(self, *, kill: bool = False, down_s: float = 0.0, timeout: float = 30) -> None:
        """Stop (SIGTERM, or SIGKILL with `kill`), stay down `down_s` seconds, start again on
        the same ports and profile: what an operator's restart or a crash looks like to clients."""
        if kill and self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
        self.stop()
        time.sleep(down_s)
        # The Web UI keeps its port (clients name it); the peer port too, unless another process
        # took it while this one was down: peers are introduced by address each time anyway.
        listen = self._listen_port if _bindable(self._listen_port) else None
        self._fixed_webui_port, self._fixed_listen_port = self._webui_port, listen
        self.start(timeout)

    def cleanup(self) -> None:
        """Stop and, if the profile dir was created here, delete it."""
        self.stop()
        if self._owns_profile:
            shutil.rmtree(self.profile_dir, ignore_errors=True)

    def __enter__(self) -> LocalQbittorrent:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ API access

    def client(self) -> Any:
        """A `qbittorrentapi.Client` for this instance, logged in when credentials were given."""
        import qbittorrentapi

        client = qbittorrentapi.Client(
            host=self.webui_url,
            username=self.username,
            password=self.__password,
            REQUESTS_ARGS={"timeout": 15},
            DISABLE_LOGGING_DEBUG_OUTPUT=True,
        )
        if self.username is not None:
            client.auth_log_in()
        return client

    def log_tail(self, lines: int = 40) -> str:
        """Last lines of both logs, for failure messages."""
        parts = []
        for path in (self.log_path, self.qbt_log_path):
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)


# --------------------------------------------------------------------------- API helpers


def wait_for_torrent(client: Any, infohash: str, timeout: float = 30) -> Any:
    """Wait until the session lists `infohash` (adding a torrent is asynchronous)."""

    def find() -> Any:
        found = client.torrents_info(torrent_hashes=infohash)
        return found[0] if found else None

    return _wait(find, timeout, 0.2, f"torrent {infohash} to appear")


def add_peer(client: Any, infohash: str, peer: str) -> None:
    """Introduce a peer ("127.0.0.1:PORT") to a torrent; the only discovery the harness has."""
    wait_for_torrent(client, infohash)
    client.torrents_add_peers(peers=peer, torrent_hashes=infohash)


def add_torrent(
    client: Any,
    torrent: bytes,
    infohash: str,
    *,
    save_path: Path | None = None,
    tags: str | list[str] | None = None,
    seed: bool = False,
    timeout: float = 30,
) -> Any:
    """Add .torrent bytes and wait until the session shows it; `seed=True` skips the hash check."""
    client.torrents_add(
        torrent_files={f"{infohash}.torrent": torrent},
        save_path=str(save_path) if save_path else None,
        tags=tags,
        is_skip_checking=True if seed else None,
        is_paused=False,
        use_auto_torrent_management=False,
    )
    return wait_for_torrent(client, infohash, timeout)


def wait_complete(client: Any, infohash: str, timeout: float = 60) -> Any:
    """Wait until the torrent has all its data (progress 1.0); returns its info."""

    def done() -> Any:
        info = client.torrents_info(torrent_hashes=infohash)
        return info[0] if info and info[0].progress >= 1.0 and info[0].amount_left == 0 else None

    return _wait(done, timeout, 0.25, f"torrent {infohash} to complete")


def wait_seeding(client: Any, infohash: str, timeout: float = 30) -> Any:
    """Wait until a seeder really has the data and can upload."""
    seeding_states = {"uploading", "stalledUP", "forcedUP", "queuedUP"}

    def ready() -> Any:
        info = client.torrents_info(torrent_hashes=infohash)
        return info[0] if info and info[0].state in seeding_states else None

    return _wait(ready, timeout, 0.2, f"torrent {infohash} to seed")


def live_pids() -> set[int]:
    """PIDs of qbittorrent-nox processes this Python process started and has not stopped."""
    with _live_lock:
        return {pid for pid in _live_pids if _pid_alive(pid)}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@atexit.register
def _kill_leftovers() -> None:
    for pid in live_pids():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
