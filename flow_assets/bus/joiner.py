"""Joining the bus's messages into flat log records (pure: no broker, an injected clock).

A response and a reward with the same ``task_id`` (and the same ``adapter_version`` when both
name one) become one record of the ``flat`` log format, with the task's ``input``::

    {task_id, input, response, score, agent_id, adapter_version, timestamp, metadata,
     interaction_id = the response's message id}

``metadata`` is the response's, plus ``bus``: the three message ids, the scoring agent and the
reward's metadata. Rules, and why:

- A response whose reward has not come within ``unlabelled_timeout_s`` is landed *unlabelled*
  (no score): it is still a trajectory; a judge or later feedback can label it.
- A response whose task has not come within that time, or a reward whose response has not, is
  quarantined with the reason (nothing is dropped, nothing is guessed).
- Several responses waiting for rewards of one task and adapter are paired first come, first
  served.
- A task stays (unacknowledged) while responses may still come for it, up to ``task_ttl_s``
  after it was last used; later responses need its input. It is then acknowledged without a
  record of its own (its content is in the records of its responses), or quarantined as
  "no response" if no response ever came.
- Responses and rewards whose message id is already landed are duplicates (redeliveries after a
  crash between landing and acknowledging): acknowledged and counted, never landed twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from flow_assets.bus.messages import ResponseMessage, RewardMessage, TaskMessage


@dataclass
class Delivery:
    """One delivered message: its queue, broker delivery tag, message id, content and when it
    arrived (seconds, the joiner's clock)."""

    queue: str
    tag: int
    message_id: str
    message: Any
    at: float


@dataclass
class Output:
    """What the consumer must do: land ``records`` (then acknowledge ``record_tags``), write
    ``quarantine`` entries (then acknowledge their tags), acknowledge ``ack_now`` at once
    (duplicates, expired tasks)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    record_tags: list[int] = field(default_factory=list)
    record_ids: list[str] = field(default_factory=list)
    quarantine: list[tuple[dict[str, Any], int]] = field(default_factory=list)
    ack_now: list[int] = field(default_factory=list)


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).isoformat()


class Joiner:
    """The join state between two landings.

    Args:
        unlabelled_timeout_s: seconds a response waits for its reward (and a response or reward
            for its partner) before it is landed unlabelled (or quarantined).
        task_ttl_s: seconds a task is kept after it arrived or was last used.
        landed_ids: response and reward message ids already in landed files or the quarantine
            (rebuilt from them at start-up).
        answered_task_ids: message ids of tasks that already have a landed record (a task
            redelivered after a restart is then not quarantined as unanswered).
    """

    def __init__(self, unlabelled_timeout_s: float, task_ttl_s: float, landed_ids: set[str] | None = None, answered_task_ids: set[str] | None = None):
        self.unlabelled_timeout_s = unlabelled_timeout_s
        self.task_ttl_s = task_ttl_s
        self.landed = set(landed_ids or ())
        self.tasks: dict[str, Delivery] = {}
        self.task_used: dict[str, float] = {}
        self.answered: set[str] = set()  # task ids that had at least one record
        self.answered_messages = set(answered_task_ids or ())
        self.responses: list[Delivery] = []
        self.rewards: list[Delivery] = []
        self.duplicates = 0

    def pending(self) -> int:
        """Messages held (unacknowledged) by the joiner."""
        return len(self.tasks) + len(self.responses) + len(self.rewards)

    def add(self, delivery: Delivery) -> list[int]:
        """Take one valid message. Returns delivery tags to acknowledge at once (a duplicate, or
        an older copy of a task that a newer one replaces)."""
        if delivery.queue == "tasks":
            older = self.tasks.get(delivery.message.task_id)
            self.tasks[delivery.message.task_id] = delivery
            self.task_used.setdefault(delivery.message.task_id, delivery.at)
            return [older.tag] if older is not None else []
        if delivery.message_id in self.landed or any(d.message_id == delivery.message_id for d in (*self.responses, *self.rewards)):
            self.duplicates += 1
            return [delivery.tag]
        (self.responses if delivery.queue == "responses" else self.rewards).append(delivery)
        return []

    def _record(self, response: Delivery, task: Delivery, reward: Delivery | None) -> dict[str, Any]:
        r: ResponseMessage = response.message
        t: TaskMessage = task.message
        bus: dict[str, Any] = {"task_message_id": task.message_id, "response_message_id": response.message_id}
        record: dict[str, Any] = {
            "task_id": r.task_id, "input": t.input, "response": r.response, "agent_id": r.agent_id,
            "adapter_version": r.adapter(), "timestamp": _iso(response.at), "interaction_id": response.message_id,
        }  # fmt: skip
        if reward is not None:
            w: RewardMessage = reward.message
            record["score"] = w.score
            bus.update(reward_message_id=reward.message_id, scoring_agent_id=w.scoring_agent_id, reward_metadata=w.metadata)
        if t.metadata:
            bus["task_metadata"] = t.metadata
        record["metadata"] = {**r.metadata, "bus": bus}
        return record

    def step(self, now: float) -> Output:
        """Pair what can be paired, and time out what waited too long (rules in the module
        docstring). The records' message ids count as landed from here on: the consumer lands
        them before it takes another message."""
        out = Output()
        waiting: list[Delivery] = []
        for response in self.responses:
            task = self.tasks.get(response.message.task_id)
            adapter = response.message.adapter()
            reward = next(
                (w for w in self.rewards if w.message.task_id == response.message.task_id and (w.message.adapter() in (None, adapter))),
                None,
            )
            expired = now - response.at >= self.unlabelled_timeout_s
            if task is not None and (reward is not None or expired):
                if reward is not None:
                    self.rewards.remove(reward)
                out.records.append(self._record(response, task, reward))
                out.record_tags += [response.tag] + ([reward.tag] if reward is not None else [])
                out.record_ids += [response.message_id] + ([reward.message_id] if reward is not None else [])
                self.task_used[task.message.task_id] = now
                self.answered.add(task.message.task_id)
            elif task is None and expired:
                out.quarantine.append((self._quarantined(response, f"no task message for task_id {response.message.task_id!r} within {self.unlabelled_timeout_s:g} s"), response.tag))
            else:
                waiting.append(response)
        self.responses = waiting
        kept: list[Delivery] = []
        for reward in self.rewards:
            if now - reward.at >= self.unlabelled_timeout_s and not any(r.message.task_id == reward.message.task_id for r in self.responses):
                out.quarantine.append((self._quarantined(reward, f"no response for task_id {reward.message.task_id!r} within {self.unlabelled_timeout_s:g} s"), reward.tag))
            else:
                kept.append(reward)
        self.rewards = kept
        for task_id, task in list(self.tasks.items()):
            if now - self.task_used.get(task_id, task.at) >= self.task_ttl_s and not any(r.message.task_id == task_id for r in self.responses):
                del self.tasks[task_id]
                self.task_used.pop(task_id, None)
                answered = task_id in self.answered or task.message_id in self.answered_messages
                self.answered.discard(task_id)
                if answered:
                    out.ack_now.append(task.tag)
                else:
                    out.quarantine.append((self._quarantined(task, f"no response to this task within {self.task_ttl_s:g} s"), task.tag))
        self.landed.update(out.record_ids)
        self.landed.update(entry["message_id"] for entry, _ in out.quarantine if entry["queue"] != "tasks")
        return out

    @staticmethod
    def _quarantined(delivery: Delivery, reason: str) -> dict[str, Any]:
        return {"queue": delivery.queue, "message_id": delivery.message_id, "reason": reason, "received_at": _iso(delivery.at),
                "body": delivery.message.model_dump(mode="json")}  # fmt: skip
