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

A Redis that refuses writes (`maxmemory` reached under `noeviction`: "OOM command not allowed",
also for every command queued in a MULTI; or "MISCONF" when it cannot persist) still answers
BRPOP, so a worker takes a queued message, and then kombu's `QoS.append` fails writing its
restore record (ZADD + HSET). That error escaped the event loop as "Unrecoverable error:
OutOfMemoryError" and the worker exited, with the popped message gone; a worker (re)started
meanwhile exited too, on its restore scan's mutex or its queues' LLEN in a MULTI. `GuardedQoS`
delivers the message without the record: the record only lets kombu put back a message whose
worker died before acknowledging it, and ours acknowledge on receipt (`task_acks_late=False`)
while Postgres re-sends lost steps anyway. `GuardedChannel` declares queues without writing what
Redis holds already. Proof:
`tests/faults/test_faults_redis_memory.py::test_redis_at_maxmemory_noeviction_loses_no_step`.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str

GUARDED = "proj.transport:GuardedTransport"

log = logging.getLogger(__name__)

# What a Redis that refuses writes answers: "OOM command not allowed when used memory >
# 'maxmemory'" under `noeviction` (every write, and every command queued in a MULTI), "MISCONF"
# when it cannot persist. Both are `ResponseError`s, which Celery's consumer loop does not catch.
REFUSED = redis.exceptions.ResponseError


class GuardedQoS(kombu_redis.QoS):
    """kombu's Redis QoS, for a Redis that refuses writes: what it took is still delivered.

    Its restore records (`unacked`, `unacked_index`, the restore mutex) are kombu's bookkeeping,
    not the message: written, acknowledged away and scanned as Redis allows, skipped when it
    refuses (`REFUSED`). A record left behind (its ack refused) is re-sent after the visibility
    timeout, a duplicate hint the step's row turns away (invariant 1).
    """

    def append(self, message: Any, delivery_tag: str) -> None:
        try:
            super().append(message, delivery_tag)
        except REFUSED as exc:
            _refused("its restore record", delivery_tag, exc)
            virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        try:
            self._remove_from_indices(delivery_tag).execute()
        except REFUSED as exc:
            _refused("removing its restore record", delivery_tag, exc)
        virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        try:
            super().reject(delivery_tag, requeue=requeue)
        except REFUSED as exc:  # a requeue refused: the sweeper re-sends the step
            _refused("rejecting it", delivery_tag, exc)
            virtual.QoS.ack(self, delivery_tag)

    def restore_unacked(self, client: Any = None) -> None:
        """kombu's, a restore Redis refuses left to the visibility scan: its record stays (the
        transaction was discarded whole), so the message is re-sent once Redis takes writes.
        Why: a channel closed while it held an unacknowledged message raised the refusal out of
        `Connection.close()`, past `GuardedTransport.close_connection`'s other channels
        (`tests/faults/test_faults_redis_memory.py::
        test_a_channel_holding_an_unacknowledged_message_closes_while_redis_refuses_writes`)."""
        with self.channel.conn_or_acquire(client) as conn:
            for tag in self._delivered:
                try:
                    self.restore_by_tag(tag, client=conn)
                except REFUSED as exc:
                    _refused("restoring it", tag, exc)
        self._delivered.clear()

    def restore_visible(self, start: int = 0, num: int = 10, interval: int = 10) -> None:
        try:
            super().restore_visible(start=start, num=num, interval=interval)
        except REFUSED as exc:  # its mutex refused: the next scan tries again
            log.warning("broker refused the scan for unacknowledged messages: %s", exc)


def _refused(what: str, delivery_tag: str, exc: BaseException) -> None:
    log.warning("broker refused %s for message %s, carrying on without: %s", what, delivery_tag, exc)


class GuardedChannel(kombu_redis.Channel):
    """A kombu Redis channel that reports a closed transport as a lost connection and delivers
    what it took even when Redis refuses writes (`GuardedQoS`)."""

    QoS = GuardedQoS

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        transport = self.connection
        if transport is None or transport.client is None:
            raise redis.exceptions.ConnectionError(
                "broker connection already closed (its channel is being closed after it)"
            )
        return super()._connparams(asynchronous=asynchronous)

    def _size(self, queue: str) -> int:
        """The queue's length, without MULTI: a Redis at `maxmemory` refuses every command queued
        in a transaction, LLEN too, and this runs as a worker declares its queues at start."""
        with self.conn_or_acquire() as client, client.pipeline(transaction=False) as pipe:
            for pri in self.priority_steps:
                pipe.llen(self._q_for_pri(queue, pri))
            return sum(n for n in pipe.execute() if isinstance(n, int))

    def queue_bind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> None:
        """kombu's, taking a binding that did not reach Redis back out of the connection's state.

        Why: kombu records the binding in `self.state` before `_queue_bind` writes it, and skips
        the write when the state has it. A binding refused (`_queue_bind`'s lost connection) on
        a connection its caller kept (a producer whose publish retries ran out stays in the
        pool) was never written: the next declaration found it in the state, and a message
        published to the exchange reached no queue (`tests/faults/test_faults_redis_memory.py::
        test_a_binding_redis_refused_is_written_when_the_same_connection_declares_it_again`)."""
        try:
            super().queue_bind(queue, exchange, routing_key, arguments, **kwargs)
        except redis.exceptions.ConnectionError:
            self._forget_binding(queue, exchange or "amq.direct", routing_key, arguments)
            raise

    def _forget_binding(self, queue: str, exchange: str, routing_key: str, arguments: Any) -> None:
        """Undo what `queue_bind` recorded before its write failed: the binding and its table row."""
        self.state.binding_delete(queue, exchange, routing_key)
        meta = self.typeof(exchange).prepare_bind(queue, exchange, routing_key, arguments)
        table = self.state.exchanges.get(exchange, {}).get("table", [])
        if meta in table:
            table.remove(meta)

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        """Record the binding; when Redis refuses writes, carry on if the binding is recorded
        already (every restart of a worker re-binds its queues) or not needed (a fanout, remote
        control, is delivered by PUBLISH, not through this table). A new binding is reported as
        the lost connection it amounts to: a worker reconnects until Redis takes writes, a
        publish fails and its step is left to the sweeper."""
        try:
            super()._queue_bind(exchange, routing_key, pattern, queue)
        except REFUSED as exc:
            if self.typeof(exchange).type != "fanout" and not self._bound(
                exchange, routing_key, pattern, queue
            ):
                raise redis.exceptions.ConnectionError(
                    f"broker refuses writes, cannot bind {queue}: {exc}"
                ) from exc
            log.warning("broker refused re-binding queue %s to %s, bound already: %s", queue, exchange, exc)

    def _bound(self, exchange: str, routing_key: str, pattern: str, queue: str) -> bool:
        """Whether Redis holds the binding. By SMEMBERS, which kombu's prefixing client prefixes
        with a `global_keyprefix` (SISMEMBER it does not: with one, a binding was never found,
        `tests/faults/test_faults_redis_memory.py::
        test_a_worker_with_a_global_keyprefix_re_binds_its_queues_while_redis_refuses_writes`)."""
        member = self.sep.join([routing_key or "", pattern or "", queue or ""])
        with self.conn_or_acquire() as client:
            return member in {bytes_to_str(m) for m in client.smembers(self.keyprefix_queue % (exchange,))}


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
