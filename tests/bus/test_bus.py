"""The RabbitMQ message-bus source: the join rules on their own, and the consumer against the real
broker on this machine, killed with SIGKILL mid-stream and restarted: every record lands once."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from flow_assets.logs.formats.flat import stream_flat
from flow_assets.bus.consumer import DEFAULT_URL, BusConfig, landed_ids, publish, quarantine_path
from flow_assets.bus.joiner import Delivery, Joiner
from flow_assets.bus.messages import message_id, parse_message

FLOWOPT = str(Path(sys.executable).with_name("flowopt"))


def _delivery(queue: str, ident: str, body: dict, at: float, tag: int = 0) -> Delivery:
    message, reason = parse_message(queue, json.dumps(body).encode())
    assert reason is None, reason
    return Delivery(queue, tag, ident, message, at)


def _task(n, at=0.0, tag=0):
    return _delivery("tasks", f"t{n}", {"task_id": f"task-{n}", "input": f"question {n}", "metadata": {"src": "test"}}, at, tag)


def _response(n, at=0.0, tag=0, adapter=None, ident=None):
    body = {"task_id": f"task-{n}", "response": f"answer {n}", "agent_id": "agent-a", "metadata": {"turns": 1}}
    if adapter:
        body["adapter_version"] = adapter
    return _delivery("responses", ident or f"r{n}{adapter or ''}", body, at, tag)


def _reward(n, score, at=0.0, tag=0, adapter=None):
    body = {"task_id": f"task-{n}", "score": score, "scoring_agent_id": "judge-1", "metadata": {"rubric": "v1"}}
    if adapter:
        body["adapter_version"] = adapter
    return _delivery("rewards", f"w{n}{adapter or ''}", body, at, tag)


# -- the join rules ------------------------------------------------------------------------------------
def test_a_response_and_its_reward_become_one_flat_record_with_the_tasks_input():
    joiner = Joiner(unlabelled_timeout_s=10, task_ttl_s=100)
    for d in (_reward(1, 0.9, tag=3), _response(1, tag=2), _task(1, tag=1)):  # any arrival order
        assert joiner.add(d) == []
    out = joiner.step(now=1.0)
    (record,) = out.records
    assert (record["task_id"], record["input"], record["response"], record["score"]) == ("task-1", "question 1", "answer 1", 0.9)
    assert record["interaction_id"] == "r1" and record["metadata"]["turns"] == 1
    assert record["metadata"]["bus"] == {"task_message_id": "t1", "response_message_id": "r1", "reward_message_id": "w1",
                                         "scoring_agent_id": "judge-1", "reward_metadata": {"rubric": "v1"}, "task_metadata": {"src": "test"}}  # fmt: skip
    assert sorted(out.record_tags) == [2, 3] and out.quarantine == [] and out.ack_now == []
    assert joiner.tasks  # kept for later responses to the same task, until its TTL
    later = joiner.step(now=200.0)
    assert later.ack_now == [1] and not joiner.tasks and later.quarantine == []


def test_redeliveries_are_duplicates_and_rewards_join_by_adapter_version():
    joiner = Joiner(unlabelled_timeout_s=10, task_ttl_s=100, landed_ids={"r9"})
    assert joiner.add(_response(9, tag=5, ident="r9")) == [5]  # landed before a crash: ack, drop
    joiner.add(_task(2))
    joiner.add(_response(2, tag=1, adapter="v3"))
    joiner.add(_response(2, tag=2, adapter="v4"))
    assert joiner.add(_response(2, tag=9, adapter="v4")) == [9]  # the same message id again
    joiner.add(_reward(2, 1.0, tag=3, adapter="v4"))
    joiner.add(_reward(2, 0.0, tag=4, adapter="v3"))
    out = joiner.step(now=1.0)
    assert {(r["adapter_version"], r["score"]) for r in out.records} == {("v3", 0.0), ("v4", 1.0)}
    assert joiner.duplicates == 2


def test_a_response_without_reward_lands_unlabelled_after_the_timeout_and_orphans_are_quarantined():
    joiner = Joiner(unlabelled_timeout_s=10, task_ttl_s=30)
    joiner.add(_task(1, at=0))
    joiner.add(_response(1, at=0, tag=1))
    joiner.add(_response(2, at=0, tag=2))  # its task never comes
    joiner.add(_reward(3, 0.5, at=0, tag=3))  # its response never comes
    joiner.add(_task(4, at=0, tag=4))  # nobody answers it
    assert joiner.step(now=5).records == []  # still waiting
    out = joiner.step(now=10)
    (record,) = out.records
    assert "score" not in record and record["task_id"] == "task-1" and out.record_tags == [1]
    reasons = {e["message_id"]: e["reason"] for e, _ in out.quarantine}
    assert reasons == {"r2": "no task message for task_id 'task-2' within 10 s", "w3": "no response for task_id 'task-3' within 10 s"}
    late = joiner.step(now=40)
    assert [e["reason"] for e, _ in late.quarantine] == ["no response to this task within 30 s"] and late.ack_now == [0]
    (unlabelled,) = stream_flat_records([record])
    assert unlabelled.outcome is None  # the flat parser reads it as unlabelled


def stream_flat_records(records):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "b.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        stream = stream_flat(path)
        return [r.trajectory for r in stream if hasattr(r, "trajectory")]


def test_malformed_messages_get_a_reason_naming_the_field():
    assert parse_message("rewards", b'{"task_id": "t", "score": "high", "scoring_agent_id": "j"}')[1].startswith("score:")
    assert parse_message("responses", b'{"task_id": "t", "response": "r"}')[1] == "agent_id: Field required"
    assert parse_message("tasks", b'{"task_id": "t", "input": "q", "extra": 1}')[1] == "extra: Extra inputs are not permitted"
    assert parse_message("tasks", b"\xff\xfe")[1] == "body is not UTF-8 (byte 0)"
    assert parse_message("tasks", b"[1]")[1] == "body is a JSON list, not an object"
    assert parse_message("tasks", b"{oops")[1].startswith("body is not JSON")
    assert parse_message("rewards", b'{"task_id": "t", "score": 1, "scoring_agent_id": "j"}')[1] is None  # an integer score
    assert message_id(b"x", None) == message_id(b"x", "") != message_id(b"y", None) and message_id(b"x", "m-1") == "m-1"


# -- the consumer on the real broker ----------------------------------------------------------------------
def _broker_up() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture
def queues():
    if not _broker_up():
        pytest.skip("RabbitMQ is not reachable at 127.0.0.1:5672 (start it with `rabbitmq-server -detached`)")
    import pika

    prefix = f"flowopt-test-{uuid.uuid4().hex[:8]}-"
    yield prefix
    connection = pika.BlockingConnection(pika.URLParameters(DEFAULT_URL))
    channel = connection.channel()
    config = BusConfig(queue_prefix=prefix)
    for kind in ("tasks", "responses", "rewards"):
        channel.queue_delete(queue=config.queue(kind))  # flowopt's tap
        channel.queue_delete(queue=prefix + kind)  # an agent's own queue, where a test made one
        channel.exchange_delete(exchange=config.exchange(kind))
    connection.close()


def _consumer(landing: Path, prefix: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [FLOWOPT, "bus", "consume", "--landing", str(landing), "--queue-prefix", prefix, "--max-records", "150", "--window-seconds", "2",
         "--unlabelled-timeout", "3", "--task-ttl", "5", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.slow
def test_a_consumer_killed_mid_stream_and_restarted_lands_every_record_exactly_once(queues, tmp_path, dagster_instance):
    n = 300
    messages = []
    for i in range(n):
        messages.append(("tasks", f"task-msg-{i}", {"task_id": f"q{i}", "input": f"what is {i}+1?", "metadata": {}}))
        messages.append(("responses", f"resp-{i}", {"task_id": f"q{i}", "response": str(i + 1 - (i % 3 == 0)), "agent_id": "adder",
                                                     "adapter_version": "v1" if i % 2 else "v2", "metadata": {}}))  # fmt: skip
        if i % 10:  # every tenth response never gets a reward: it must land unlabelled
            messages.append(("rewards", f"rew-{i}", {"task_id": f"q{i}", "score": float(i % 3 != 0), "scoring_agent_id": "checker", "metadata": {}}))
    messages.append(("rewards", "bad-1", b'{"task_id": "q1", "score": "NaN-ish", "scoring_agent_id": "checker"}'))
    messages.append(("responses", "bad-2", b"\xff not utf-8"))
    landing = tmp_path / "landing"
    first = _consumer(landing, queues)
    publish(DEFAULT_URL, messages[: len(messages) // 2], queues)
    deadline = time.monotonic() + 60
    while not list((landing / "bus").glob("*.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.05)
    publish(DEFAULT_URL, messages[len(messages) // 2 :], queues)
    time.sleep(0.3)
    os.kill(first.pid, signal.SIGKILL)  # mid-stream: some batches landed, some messages unacknowledged
    first.wait(timeout=30)
    before = sum(len(p.read_text().splitlines()) for p in (landing / "bus").glob("*.jsonl"))
    assert 1 <= before < n, first.stderr.read()[-3000:]  # killed mid-stream
    second = _consumer(landing, queues, "--idle-exit", "4")
    out, err = second.communicate(timeout=180)
    assert second.returncode == 0, err[-3000:]
    stats = json.loads(out)
    assert not list((landing / "bus").glob(".*.tmp"))
    records = [json.loads(line) for path in sorted((landing / "bus").glob("*.jsonl")) for line in path.read_text().splitlines()]
    ids = [r["interaction_id"] for r in records]
    assert len(ids) == n and len(set(ids)) == n  # exactly N records, none twice
    unlabelled = {r["task_id"] for r in records if "score" not in r}
    assert unlabelled == {f"q{i}" for i in range(0, n, 10)}
    assert all(r["input"] == f"what is {r['task_id'][1:]}+1?" for r in records)
    quarantined = [json.loads(line) for line in quarantine_path(landing).read_text().splitlines()]
    assert {q["message_id"]: q["reason"].split(":")[0] for q in quarantined} == {"bad-1": "score", "bad-2": "body is not UTF-8 (byte 0)"}
    assert "body_base64" in next(q for q in quarantined if q["message_id"] == "bad-2")
    ids_back, tasks_back = landed_ids(landing)
    assert {f"resp-{i}" for i in range(n)} <= ids_back and len(tasks_back) == n
    assert stats["landed_records"] == n - before  # the restart landed only what was missing
    # the landed files go through the real data plane: one batch each, N distinct trajectories
    from flow_assets.definitions import build_definitions
    from flow_assets.runtime.local import execute_requests, tick_sensor
    from resources.lake import TrajectoryLake

    defs = build_definitions(str(tmp_path / "lake"), str(landing), models_root=str(tmp_path / "models"), settle_seconds=0)
    done = execute_requests(defs, dagster_instance, "log_batch_job", tick_sensor(defs, dagster_instance, "new_logs_sensor"))
    assert done.succeeded and not done.failed and all(k.startswith("bus.") for k in done.succeeded)
    trajectories = TrajectoryLake(root=str(tmp_path / "lake")).scan("trajectories").collect()
    assert trajectories.height == n and trajectories["trajectory_id"].n_unique() == n
    assert trajectories["outcome_success"].null_count() == len(unlabelled)


# -- one bad message is one quarantined message (issue #25, case 3) -----------------------------------------
def _nested(levels: int) -> bytes:
    return b'{"a": ' * levels + b"1" + b"}" * levels


def test_bodies_too_deep_or_too_large_get_a_reason_and_parsing_never_raises():
    head = b'{"task_id": "t", "response": "r", "agent_id": "a", "metadata": '
    reason = parse_message("responses", head + _nested(100_000) + b"}")[1]  # json.loads: RecursionError
    assert reason.startswith("body nests deeper than 64 levels")
    assert parse_message("responses", head + _nested(63) + b"}")[1] is None  # the body is level 1
    assert parse_message("responses", head + _nested(64) + b"}")[1] == "body nests deeper than 64 levels"
    assert parse_message("responses", head + b"{\"x\": " + b"[" * 70 + b"]" * 70 + b"}}", max_depth=80)[1] is None
    assert parse_message("tasks", b'{"task_id": "t", "input": "' + b"x" * 2000 + b'"}', max_bytes=1000)[1] == "body is 2,029 bytes, over the limit of 1,000"


def _triples(n: int, tag: str = "") -> list:
    messages = []
    for i in range(n):
        messages.append(("tasks", f"task-msg-{tag}{i}", {"task_id": f"q{tag}{i}", "input": f"what is {i}+1?", "metadata": {}}))
        messages.append(("responses", f"resp-{tag}{i}", {"task_id": f"q{tag}{i}", "response": str(i + 1), "agent_id": "adder", "metadata": {"n": {"m": [i]}}}))
        messages.append(("rewards", f"rew-{tag}{i}", {"task_id": f"q{tag}{i}", "score": 1.0, "scoring_agent_id": "checker", "metadata": {}}))
    return messages


def test_a_message_nested_100000_levels_is_quarantined_and_the_20_triples_behind_it_land(queues, tmp_path):
    import pika

    from flow_assets.bus.consumer import BusConsumer

    deep = b'{"task_id": "q0", "response": "x", "agent_id": "a", "metadata": ' + _nested(100_000) + b"}"
    big = json.dumps({"task_id": "q1", "response": "y" * 900_000, "agent_id": "a", "metadata": {}}).encode()
    publish(DEFAULT_URL, [("responses", "deep-1", deep), ("rewards", "deep-2", deep.replace(b'"response": "x", "agent_id"', b'"score": 1, "scoring_agent_id"')),
                          ("responses", "big-1", big), *_triples(20)], queues)  # fmt: skip
    landing = tmp_path / "landing"
    config = BusConfig(landing=landing, queue_prefix=queues, window_s=0.2, unlabelled_timeout_s=30, task_ttl_s=60, idle_exit_s=1.0, max_message_bytes=800_000)
    stats = BusConsumer(config).run()  # the old consumer raised RecursionError here, on every restart
    assert (stats.landed_records, stats.quarantined) == (20, 3)
    records = [json.loads(line) for path in (landing / "bus").glob("*.jsonl") for line in path.read_text().splitlines()]
    assert sorted(r["interaction_id"] for r in records) == sorted(f"resp-{i}" for i in range(20)) and all(r["score"] == 1.0 for r in records)
    quarantined = {q["message_id"]: q for q in map(json.loads, quarantine_path(landing).read_text().splitlines())}
    assert quarantined["deep-1"]["reason"].startswith("body nests deeper than 64 levels") and quarantined["deep-1"]["queue"] == "responses"
    assert quarantined["deep-1"]["body_text"].encode() == deep  # kept whole, to be looked at
    assert quarantined["deep-2"]["queue"] == "rewards" and quarantined["deep-2"]["reason"].startswith("body nests deeper")
    assert quarantined["big-1"]["reason"] == f"body is {len(big):,} bytes, over the limit of 800,000" and quarantined["big-1"]["body_text"].encode() == big
    connection = pika.BlockingConnection(pika.URLParameters(DEFAULT_URL))
    try:  # the bad messages were acknowledged, not left to stop the next run
        channel = connection.channel()
        assert [channel.queue_declare(config.queue(k), passive=True).method.message_count for k in ("responses", "rewards")] == [0, 0]
    finally:
        connection.close()
    again = BusConsumer(config).run()  # a restart: nothing new, nothing twice
    assert (again.landed_records, again.quarantined) == (0, 0)


# -- a tap on the bus, not a competitor (issue #25, case 10) -------------------------------------------------
class _Agent(threading.Thread):
    """A team's agent as deployed before flowopt came: its own durable queue ``<prefix><source>``
    bound to the fanout exchange ``<prefix><source>``; each message is answered with
    ``answer(body) -> (message id, reply)`` published to the exchange ``<prefix><sink>``."""

    def __init__(self, prefix: str, source: str, sink: str, answer):
        super().__init__(daemon=True)
        self.prefix, self.source, self.sink, self.answer = prefix, source, sink, answer
        self.received: list[str] = []
        self.ready, self.stop, self.error = threading.Event(), threading.Event(), None

    def run(self):
        import pika

        try:
            connection = pika.BlockingConnection(pika.URLParameters(DEFAULT_URL))
            channel, out = connection.channel(), connection.channel()
            for name in (self.source, self.sink):
                channel.exchange_declare(self.prefix + name, "fanout", durable=True)
            channel.queue_declare(self.prefix + self.source, durable=True)
            channel.queue_bind(self.prefix + self.source, self.prefix + self.source)
            out.confirm_delivery()

            def on_message(ch, method, properties, body):
                self.received.append(properties.message_id)
                ident, reply = self.answer(json.loads(body))
                props = pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent, message_id=ident)
                out.basic_publish(self.prefix + self.sink, self.sink, json.dumps(reply).encode(), properties=props)
                ch.basic_ack(method.delivery_tag)

            channel.basic_qos(prefetch_count=20)
            channel.basic_consume(self.prefix + self.source, on_message)
            self.ready.set()
            while not self.stop.is_set():
                connection.process_data_events(time_limit=0.05)
            connection.close()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
            self.ready.set()


def _orchestrate(prefix: str, numbers: range) -> None:
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(DEFAULT_URL))
    channel = connection.channel()
    channel.confirm_delivery()
    for i in numbers:
        body = json.dumps({"task_id": f"q{i}", "input": f"what is {i}+1?", "metadata": {}}).encode()
        channel.basic_publish(prefix + "tasks", "tasks", body, pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent, message_id=f"task-msg-{i}"))
    connection.close()


def _landed(landing: Path) -> list[dict]:
    return [json.loads(line) for path in sorted((landing / "bus").glob("*.jsonl")) for line in path.read_text().splitlines()]


def test_flowopt_reads_copies_so_the_worker_and_scorer_get_every_message_through_a_sigkill(queues, tmp_path):
    from flow_assets.bus.consumer import declare

    def work(task):
        return f"resp-{task['task_id']}", {"task_id": task["task_id"], "response": str(int(task["input"][8:-3]) + 1), "agent_id": "adder", "metadata": {}}

    def score(response):
        return f"rew-{response['task_id']}", {"task_id": response["task_id"], "score": 1.0, "scoring_agent_id": "checker", "metadata": {}}

    worker, scorer = _Agent(queues, "tasks", "responses", work), _Agent(queues, "responses", "rewards", score)
    for agent in (worker, scorer):
        agent.start()
        assert agent.ready.wait(30) and agent.error is None, agent.error
    declare(BusConfig(queue_prefix=queues))  # `flowopt bus declare`: the taps exist before the orchestrator publishes
    landing = tmp_path / "landing"
    args = ("--max-records", "10", "--window-seconds", "0.2", "--unlabelled-timeout", "30", "--task-ttl", "60")
    first = _consumer(landing, queues, *args)
    try:
        _orchestrate(queues, range(50))
        deadline = time.monotonic() + 60
        while not _landed(landing) and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGKILL)  # mid-stream: at most 50 of 100 landed, messages unacknowledged
        first.wait(timeout=30)
        before = len(_landed(landing))
        assert 1 <= before <= 50, first.stderr.read()[-3000:]
        second = _consumer(landing, queues, *args)
        _orchestrate(queues, range(50, 100))
        deadline = time.monotonic() + 90
        while (len({r["interaction_id"] for r in _landed(landing)}) < 100 or len(scorer.received) < 100) and time.monotonic() < deadline and second.poll() is None:
            time.sleep(0.05)
        while_running = (len(worker.received), len(scorer.received))  # not only once flowopt stops and its unacknowledged messages go back
        second.send_signal(signal.SIGTERM)
        out, err = second.communicate(timeout=60)
    finally:
        for agent in (worker, scorer):
            agent.stop.set()
            agent.join(timeout=10)
        for process in (first, locals().get("second")):
            if process is not None and process.poll() is None:
                process.kill()
    assert second.returncode == 0, err[-3000:]
    assert worker.error is None and scorer.error is None
    assert while_running == (100, 100)  # the consumer of a shared queue left the worker 50 and the scorer 25 of 100
    assert sorted(worker.received) == sorted(f"task-msg-{i}" for i in range(100))  # 100 of 100, none taken by flowopt
    assert sorted(scorer.received) == sorted(f"resp-q{i}" for i in range(100))
    records = _landed(landing)
    assert len(records) == 100 and len({r["interaction_id"] for r in records}) == 100  # none twice
    assert {r["task_id"] for r in records} == {f"q{i}" for i in range(100)} and all(r["score"] == 1.0 for r in records)
    assert all(r["response"] == str(int(r["task_id"][1:]) + 1) and r["input"] == f"what is {r['task_id'][1:]}+1?" for r in records)
    assert not quarantine_path(landing).exists() and json.loads(out)["landed_records"] == 100 - before


def test_an_exchange_of_another_type_is_refused_with_its_name(queues):
    import pika

    from flow_assets.bus.consumer import BusTopologyError, declare

    connection = pika.BlockingConnection(pika.URLParameters(DEFAULT_URL))
    connection.channel().exchange_declare(queues + "tasks", "direct", durable=True)
    connection.close()
    with pytest.raises(BusTopologyError, match=f"exchange '{queues}tasks': the broker refused it as a durable fanout exchange: PRECONDITION_FAILED"):
        declare(BusConfig(queue_prefix=queues))
    declared = declare(BusConfig(queue_prefix=queues + "t-", exchange_type="topic"))  # a team's topic exchanges: the tap binds with #
    assert declared[0] == (f"{queues}t-tasks", f"{queues}t-flowopt.tasks")
    connection = pika.BlockingConnection(pika.URLParameters(DEFAULT_URL))
    channel = connection.channel()
    for kind in ("tasks", "responses", "rewards"):
        channel.queue_delete(f"{queues}t-flowopt.{kind}")
        channel.exchange_delete(f"{queues}t-{kind}")
    connection.close()
