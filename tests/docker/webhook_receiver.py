"""A requester's webhook endpoint on the compose network: every POST becomes a JSON line in
/hooks/hooks.jsonl (with its Idempotency-Key), which the test reads on the host."""

from __future__ import annotations

import json
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        line = {
            "key": self.headers.get("Idempotency-Key"),
            "path": self.path,
            "body": json.loads(body or b"null"),
        }
        with open("/hooks/hooks.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    # PID 1 in its container ignores SIGTERM unless it handles it: every `down` waited Docker's
    # 10 s for this receiver and then killed it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ThreadingHTTPServer(("0.0.0.0", 8000), Handler).serve_forever()
