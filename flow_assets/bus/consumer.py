"""The message-bus source: a RabbitMQ consumer that lands agent logs as files (``flowopt bus consume``).

It is a tap on the bus, not a competitor for its messages. Agents publish to three durable
exchanges, ``tasks``, ``responses`` and ``rewards`` (fanout by default, or topic; an optional
name prefix), and each consumer of the bus binds its own queue to them: the agent's ``tasks``
queue, the scorer's ``responses`` queue, and flowopt's tap queues ``flowopt.tasks``,
``flowopt.responses`` and ``flowopt.rewards`` (:func:`declare_topology`). RabbitMQ copies each
message to every bound queue, so an agent and a scorer still receive every message while
flowopt reads its own copies (consuming a shared queue would split its messages between the
consumers). flowopt consumes its three tap queues on one channel with ``pika``, joins them (:mod:`flow_assets.bus.joiner`) and writes
a batch of flat records to ``<landing>/bus/<UTC time>-<n>.jsonl`` when ``max_records`` are ready
or ``window_s`` seconds after the first one; ``new_logs_sensor`` then makes each file a log
batch (source ``bus``).

Delivery guarantee: at least once from the broker, exactly once into the landing directory.

- A message is acknowledged only after what holds it is durable: the batch file written to a
  hidden temporary name, flushed, ``fsync``'ed, renamed, and the directory ``fsync``'ed; or its
  quarantine entry appended and ``fsync``'ed. A consumer killed at any point leaves the
  unacknowledged messages to be redelivered.
- Redeliveries of what was landed before the kill are recognised by message id: at start-up the
  ids are read back from the landed files themselves (and the quarantine file), so no state can
  lag behind a rename.
- Malformed messages go to ``<landing>/.bus/quarantine.jsonl`` with the reason, queue, message
  id and raw body (text, or base64 when not UTF-8); a hidden directory, so the sensor never
  ingests it. Bodies over ``max_message_bytes`` or nested deeper than ``max_depth`` are
  malformed messages, and any other error while one message is read is caught around that
  message alone: one bad message is one quarantined (and acknowledged) message, never a
  consumer that exits and meets the same message again on every restart.
- Messages waiting for their partner stay unacknowledged: ``prefetch`` (default 10,000) must
  exceed what can wait at once (about the message rate times ``unlabelled_timeout_s``), or the
  broker stops delivering until a timeout frees some.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from flow_assets.bus.joiner import Delivery, Joiner, Output
from flow_assets.bus.messages import MAX_DEPTH, MAX_MESSAGE_BYTES, QUEUES, message_id, parse_message
from flow_assets.settings import DEFAULT_AMQP_URL, DEFAULT_LANDING

EXCHANGE_TYPES = ("fanout", "topic")

DEFAULT_URL = DEFAULT_AMQP_URL


@dataclass(frozen=True)
class BusConfig:
    """Settings of one consumer.

    Attributes:
        url: AMQP URL of the broker (``FLOWOPT_AMQP_URL``).
        landing: the landing directory; batches go to its ``bus/`` sub-directory.
        queue_prefix: prepended to the exchange names ``tasks`` / ``responses`` / ``rewards`` and
            to the tap queues' names.
        tap: the tap queues are ``<queue_prefix><tap>.<kind>``.
        exchange_type: ``fanout`` (every message to every bound queue) or ``topic`` (the tap
            binds with ``#``, every routing key); must match an exchange that already exists.
        max_records: records per batch file.
        window_s: seconds after the first ready record that a smaller batch is landed anyway.
        unlabelled_timeout_s: seconds a response waits for its reward (joiner docstring).
        task_ttl_s: seconds a task is kept for later responses.
        prefetch: most unacknowledged messages the broker hands this consumer.
        max_message_bytes: a larger body is quarantined unparsed.
        max_depth: a body nested deeper (objects / arrays) is quarantined.
        idle_exit_s: exit after this many seconds with no message and nothing pending (None:
            run until SIGTERM / SIGINT).
    """

    url: str = DEFAULT_URL
    landing: Path = Path(DEFAULT_LANDING)
    queue_prefix: str = ""
    tap: str = "flowopt"
    exchange_type: str = "fanout"
    max_records: int = 1000
    window_s: float = 60.0
    unlabelled_timeout_s: float = 600.0
    task_ttl_s: float = 3600.0
    prefetch: int = 10_000
    idle_exit_s: float | None = None
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_depth: int = MAX_DEPTH

    def exchange(self, kind: str) -> str:
        """The exchange agents publish messages of ``kind`` to: ``<queue_prefix><kind>``."""
        return f"{self.queue_prefix}{kind}"

    def queue(self, kind: str) -> str:
        """flowopt's own tap queue for ``kind``: ``<queue_prefix><tap>.<kind>``."""
        return f"{self.queue_prefix}{self.tap}.{kind}"


class BusTopologyError(RuntimeError):
    """The broker refused flowopt's exchanges or tap queues (e.g. an exchange of that name
    already exists with another type); the message names the exchange or queue."""


def declare_topology(channel, config: BusConfig) -> list[tuple[str, str]]:
    """Declare, idempotently, the three durable exchanges (``config.exchange_type``) and
    flowopt's durable tap queues, each bound to its exchange. Returns ``(exchange, tap queue)``
    per kind. Messages published before this ran reach only the queues bound then: declare
    first (``flowopt bus declare``), then let agents publish.

    Raises:
        ValueError: an exchange type other than fanout / topic.
        BusTopologyError: the broker refused a declaration (the channel is closed then).
    """
    import pika.exceptions

    if config.exchange_type not in EXCHANGE_TYPES:
        raise ValueError(f"exchange type {config.exchange_type!r}: expected one of {', '.join(EXCHANGE_TYPES)}")
    key = "#" if config.exchange_type == "topic" else ""  # fanout ignores the key
    declared = []
    for kind in QUEUES:
        exchange, queue = config.exchange(kind), config.queue(kind)
        try:
            channel.exchange_declare(exchange=exchange, exchange_type=config.exchange_type, durable=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            raise BusTopologyError(f"exchange {exchange!r}: the broker refused it as a durable {config.exchange_type} exchange: {exc.reply_text}") from None
        try:
            channel.queue_declare(queue=queue, durable=True)
            channel.queue_bind(queue=queue, exchange=exchange, routing_key=key)
        except pika.exceptions.ChannelClosedByBroker as exc:
            raise BusTopologyError(f"tap queue {queue!r} on exchange {exchange!r}: {exc.reply_text}") from None
        declared.append((exchange, queue))
    return declared


def declare(config: BusConfig) -> list[tuple[str, str]]:
    """Connect, :func:`declare_topology`, disconnect (``flowopt bus declare``).

    Raises:
        pika.exceptions.AMQPConnectionError: the broker cannot be reached.
        BusTopologyError: see :func:`declare_topology`.
    """
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(config.url))
    try:
        return declare_topology(connection.channel(), config)
    finally:
        if connection.is_open:
            connection.close()


@dataclass
class BusStats:
    """What one consumer run did (counts of messages and records)."""

    received: int = 0
    landed_records: int = 0
    unlabelled_records: int = 0
    batches: list[str] = field(default_factory=list)
    quarantined: int = 0
    duplicates: int = 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, lines: list[str]) -> None:
    """Write ``lines`` to ``path`` so that, once this returns, the file survives a crash: a hidden
    temporary name (the landing sensor skips it), flush, fsync, rename, fsync of the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        fh.write("".join(line + "\n" for line in lines))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def append_durably(path: Path, lines: list[str]) -> None:
    """Append ``lines`` to ``path`` and fsync it (the quarantine file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", encoding="utf-8") as fh:
        fh.write("".join(line + "\n" for line in lines))
        fh.flush()
        os.fsync(fh.fileno())
    if new:
        _fsync_dir(path.parent)


def quarantine_path(landing: Path) -> Path:
    """Where malformed and orphaned messages are kept: ``<landing>/.bus/quarantine.jsonl``."""
    return landing / ".bus" / "quarantine.jsonl"


def landed_ids(landing: Path) -> tuple[set[str], set[str]]:
    """``(response and reward message ids, task message ids)`` already landed under
    ``<landing>/bus`` or quarantined, read back from the files (a line that does not parse is
    skipped: it cannot hold an id this consumer wrote)."""
    ids, tasks = set(), set()
    for path in sorted((landing / "bus").glob("*.jsonl")) if (landing / "bus").is_dir() else []:
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                bus = json.loads(line)["metadata"]["bus"]
            except (ValueError, KeyError, TypeError, RecursionError):
                continue
            ids.update(v for k, v in bus.items() if k in ("response_message_id", "reward_message_id") and isinstance(v, str))
            if isinstance(bus.get("task_message_id"), str):
                tasks.add(bus["task_message_id"])
    quarantine = quarantine_path(landing)
    if quarantine.exists():
        for line in quarantine.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(entry, dict) and entry.get("queue") != "tasks" and isinstance(entry.get("message_id"), str):
                ids.add(entry["message_id"])
    return ids, tasks


class BusConsumer:
    """One consumer process (module docstring). ``clock`` is injectable for tests of the
    windows; it returns seconds."""

    def __init__(self, config: BusConfig, clock=time.time):
        self.config = config
        self.clock = clock
        ids, tasks = landed_ids(config.landing)
        self.joiner = Joiner(config.unlabelled_timeout_s, config.task_ttl_s, ids, tasks)
        self.stats = BusStats()
        self.ready: list[tuple[dict[str, Any], list[int]]] = []
        self.ready_since: float | None = None
        self.seq = 0
        self.stopping = False
        self.channel = None

    # -- broker callbacks -------------------------------------------------------------------------
    def _on_message(self, kind: str):
        def callback(channel, method, properties, body: bytes) -> None:
            self.stats.received += 1
            ident = message_id(body, getattr(properties, "message_id", None))
            try:
                message, reason = parse_message(kind, body, self.config.max_message_bytes, self.config.max_depth)
                acks = [] if message is None else self.joiner.add(Delivery(kind, method.delivery_tag, ident, message, self.clock()))
            except Exception as exc:  # noqa: BLE001 - around this one message only, never the connection
                message, reason = None, f"cannot be read: {type(exc).__name__}: {exc}"
            if message is None:
                # a failure to write the quarantine is not the message's fault: it propagates, unacknowledged
                self._quarantine([(self._raw_entry(kind, ident, body, reason), method.delivery_tag)])
                return
            for tag in acks:
                channel.basic_ack(tag)

        return callback

    def _raw_entry(self, kind: str, ident: str, body: bytes, reason: str) -> dict[str, Any]:
        try:
            raw: dict[str, Any] = {"body_text": body.decode("utf-8")}
        except UnicodeDecodeError:
            raw = {"body_base64": base64.b64encode(body).decode("ascii")}
        return {"queue": kind, "message_id": ident, "reason": reason, "received_at": datetime.now(timezone.utc).isoformat(), **raw}

    def _quarantine(self, entries: list[tuple[dict[str, Any], int]]) -> None:
        if not entries:
            return
        append_durably(quarantine_path(self.config.landing), [json.dumps(e, ensure_ascii=False) for e, _ in entries])
        for _, tag in entries:
            self.channel.basic_ack(tag)
        self.stats.quarantined += len(entries)

    # -- landing ------------------------------------------------------------------------------------
    def _take(self, out: Output) -> None:
        for tag in out.ack_now:
            self.channel.basic_ack(tag)
        self._quarantine(out.quarantine)
        tags = iter(out.record_tags)
        for record in out.records:
            mine = [next(tags)] + ([next(tags)] if "score" in record else [])
            self.ready.append((record, mine))
        if self.ready and self.ready_since is None:
            self.ready_since = self.clock()

    def land(self) -> None:
        """Write the ready records as one batch file, then acknowledge their messages."""
        if not self.ready:
            return
        batch, self.ready, self.ready_since = self.ready[: self.config.max_records], self.ready[self.config.max_records :], None
        if self.ready:
            self.ready_since = self.clock()
        self.seq += 1
        name = f"{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%S%fZ')}-{os.getpid()}-{self.seq:04d}.jsonl"
        path = self.config.landing / "bus" / name
        write_durably(path, [json.dumps(record, ensure_ascii=False) for record, _ in batch])
        for _, tags in batch:  # only now: the file is durable
            for tag in tags:
                self.channel.basic_ack(tag)
        self.stats.batches.append(str(path))
        self.stats.landed_records += len(batch)
        self.stats.unlabelled_records += sum(1 for record, _ in batch if "score" not in record)

    def _due(self) -> bool:
        return len(self.ready) >= self.config.max_records or (
            self.ready_since is not None and self.clock() - self.ready_since >= self.config.window_s
        )

    # -- the loop -------------------------------------------------------------------------------------
    def run(self) -> BusStats:
        """Consume until SIGTERM / SIGINT (or ``idle_exit_s``); lands what is ready before it stops.

        Raises:
            pika.exceptions.AMQPConnectionError: the broker cannot be reached.
        """
        import pika

        params = pika.URLParameters(self.config.url)
        connection = pika.BlockingConnection(params)
        self.channel = channel = connection.channel()
        channel.basic_qos(prefetch_count=self.config.prefetch)
        declare_topology(channel, self.config)
        for kind in QUEUES:
            channel.basic_consume(queue=self.config.queue(kind), on_message_callback=self._on_message(kind))

        def stop(signum, frame):
            self.stopping = True

        previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
        last_activity = self.clock()
        try:
            while not self.stopping:
                before = self.stats.received
                connection.process_data_events(time_limit=0.2)
                if self.stats.received != before:
                    last_activity = self.clock()
                self._take(self.joiner.step(self.clock()))
                while self._due():
                    self.land()
                idle = self.clock() - last_activity
                if self.config.idle_exit_s is not None and idle >= self.config.idle_exit_s and not self.ready and not self.joiner.responses and not self.joiner.rewards:
                    break
            self._take(self.joiner.step(self.clock()))
            while self.ready:
                self.land()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.stats.duplicates = self.joiner.duplicates
            if connection.is_open:
                connection.close()  # unacknowledged messages (still waiting) go back to their queues
        return self.stats


def publish(url: str, messages: list[tuple[str, str, dict[str, Any] | bytes]], queue_prefix: str = "", config: BusConfig | None = None) -> int:
    """Publish ``(kind, message id, body)`` messages to the exchange of their kind, as an agent
    does: persistent, with their message id, routing key ``kind``; a body that is bytes is sent
    as it is (to test quarantine). The topology (``config``, else the defaults with
    ``queue_prefix``) is declared first, so flowopt's tap queues get a copy even before
    ``flowopt bus consume`` first ran. Returns how many were sent, each confirmed by the broker.

    Raises:
        ValueError: an unknown kind.
        BusTopologyError: see :func:`declare_topology`.
        pika.exceptions.AMQPConnectionError: the broker cannot be reached.
    """
    import pika

    unknown = sorted({kind for kind, _, _ in messages if kind not in QUEUES})
    if unknown:  # before anything is sent: all or none
        raise ValueError(f"unknown queue {unknown[0]!r} (expected one of {', '.join(QUEUES)})")
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        config = config or BusConfig(url=url, queue_prefix=queue_prefix)
        declare_topology(channel, config)
        channel.confirm_delivery()  # each publish returns once the broker has it
        for kind, ident, body in messages:
            payload = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8")
            channel.basic_publish(
                exchange=config.exchange(kind), routing_key=kind, body=payload,
                properties=pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent, message_id=ident, content_type="application/json"),
            )  # fmt: skip
    finally:
        connection.close()
    return len(messages)
