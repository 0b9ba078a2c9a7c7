"""The Redis broker transport, guarded so a Redis restart cannot kill a worker (issue #18, item 5).

Why: with kombu 5.7 a Redis restart can end a Celery worker with "Unrecoverable error:
AttributeError: 'NoneType' object has no attribute 'hostname'". On a lost connection Celery's
consumer calls `Connection.collect()` and then `Connection.close()`. `collect()` closes the
channels, but a channel whose BRPOP reply cannot be read (the socket is dead) raises before it
marks itself closed, and `Transport.close_connection` gives up at the first channel that raises
(the pidbox channel deleting its fanout binding over the dead socket); `collect()` swallows
both and then clears `transport.client`. The task channel is still open and still holds the
prefetched, unacknowledged messages. `close()` closes it again: it drops its pools, then
`QoS.restore_unacked` needs a new pool, built from `transport.client.hostname`, which is gone.
An AttributeError is neither a connection nor a channel error, so it escapes Celery's
reconnect loop and the worker exits. Upstream report: docs/upstream/kombu-restore-unacked.md.

The guard, two small overrides:
- `GuardedTransport.close_connection` closes every channel even when one of them fails, so the
  restore of unacknowledged messages is attempted while the transport is still whole;
- `GuardedChannel._connparams` raises the redis `ConnectionError` it really is when the
  transport was already closed, which every caller (Celery's reconnect loop, kombu's
  `ignore_errors`) handles as a lost broker: the worker reconnects.

Messages are only hints here (Postgres is the truth): one whose restore fails is re-published
by the sweeper. `BROKER_TRANSPORT` overrides the choice (e.g. `redis` for kombu's own).

Proof: `tests/faults/test_faults_redis_restart.py` (kombu's transport fails the close sequence, ours
does not; a real worker survives repeated Redis restarts with unacknowledged messages in
flight and every run finishes once).
"""

from __future__ import annotations

from typing import Any

import redis
from kombu.transport import redis as kombu_redis

GUARDED = "proj.transport:GuardedTransport"


class GuardedChannel(kombu_redis.Channel):
    """A kombu Redis channel that reports a closed transport as a lost connection."""

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        transport = self.connection
        if transport is None or transport.client is None:
            raise redis.exceptions.ConnectionError(
                "broker connection already closed (its channel is being closed after it)"
            )
        return super()._connparams(asynchronous=asynchronous)


class GuardedTransport(kombu_redis.Transport):
    """kombu's Redis transport with `GuardedChannel` and a close that closes every channel."""

    Channel = GuardedChannel

    def close_connection(self, connection: Any) -> None:
        errors: list[BaseException] = []
        self.cycle.close()
        for channels in (self._avail_channels, self.channels):
            while channels:
                channel = channels.pop()
                try:
                    channel.close()
                except self.connection_errors as exc:  # the broker is gone: close the others
                    errors.append(exc)
        if errors:
            raise errors[0]


def transport_for(broker_url: str | None, explicit: str | None = None) -> str | None:
    """The kombu transport Celery should use: `explicit` if set, ours for `redis://` URLs.

    `rediss://` keeps kombu's own: kombu derives its TLS defaults from that transport name.
    """
    if explicit:
        return explicit
    scheme = (broker_url or "").split("://", 1)[0].lower()
    return GUARDED if scheme == "redis" else None
