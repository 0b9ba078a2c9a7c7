"""A loopback TCP proxy that can cut a connection after the request was sent upstream, and an
iptables blackhole for a port (a network partition: nothing is closed, nothing answers).

The proxy models "qBittorrent accepted the add but the reply never arrived": the upstream
processes the request, the client sees a dropped connection and must not add the torrent twice.
With `cuts=0` it only forwards, giving one worker its own port to partition.
"""

from __future__ import annotations

import contextlib
import select
import socket
import subprocess
import threading
from dataclasses import dataclass, field

import pytest


@dataclass
class CutProxy:
    """Forward 127.0.0.1:<port> → upstream; drop the reply of the first `cuts` matching requests."""

    upstream: tuple[str, int]
    match: bytes
    cuts: int = 1
    cut_done: int = 0
    requests_seen: int = 0
    _server: socket.socket = field(init=False)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def port(self) -> int:
        return int(self._server.getsockname()[1])

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _should_cut(self, data: bytes) -> bool:
        if self.match not in data:
            return False
        with self._lock:
            self.requests_seen += 1
            if self.cut_done < self.cuts:
                self.cut_done += 1
                return True
        return False

    def _pipe(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError:  # the upstream is down (a restart, a test's teardown): refuse the client
            client.close()
            return
        cutting = False
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([client, upstream], [], [], 0.5)
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is client:
                        cutting = cutting or self._should_cut(data)
                        upstream.sendall(data)
                    elif cutting:
                        # The upstream answered: the request was processed. Drop the reply.
                        return
                    else:
                        client.sendall(data)
        except OSError:
            return
        finally:
            for s in (client, upstream):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self._stop.set()
        self._server.close()


class Blackhole:
    """iptables rules dropping every packet to and from one loopback port (both directions)."""

    def __init__(self, port: int) -> None:
        self.rules = [
            ["INPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP"],
            ["INPUT", "-p", "tcp", "--sport", str(port), "-j", "DROP"],
        ]
        self.on = False

    def cut(self) -> None:
        for rule in self.rules:
            done = subprocess.run(["iptables", "-I", *rule], capture_output=True, text=True)
            if done.returncode != 0:
                pytest.fail(f"iptables cannot drop packets here (root needed): {done.stderr}")
        self.on = True

    def heal(self) -> None:
        if self.on:
            for rule in self.rules:
                subprocess.run(["iptables", "-D", *rule], capture_output=True)
            self.on = False
