"""Capture: the calls of one rollout, recorded as sampled, become one canonical trajectory.

A rollout is one ephemeral agent on one task. Every chat completion it makes through the gateway
is recorded as a :class:`Turn`: the messages it sent, the exact prompt ids the gateway rendered,
the sampled completion ids with their behaviour log-probs, the sampling settings, the adapter
version that answered, its latency and the tool calls parsed out of it. When the rollout is
finished (or given up on) its turns become one :class:`~flow_assets.logs.schema.Trajectory`:

    for each turn k:   a step carrying the turn's tokens
                       kind "tool" (it called a tool; ``tool`` = the first call's name,
                       ``input`` = the calls), "answer" (the last turn, no call) or "message"
    then for each call of turn k that a later request answered (a ``tool`` message with its
    ``tool_call_id``): an "observation" step with the tool's name, arguments and result, and
    no tokens (a tool result is context the policy reads, never trained).

A call's ``status`` is ``"error"`` when its result text starts with ``Error`` (the tau-bench
convention; OpenAI's tool messages carry no error flag), and so is the turn that made it. A turn
whose text attempted a tool call that did not parse is a ``message`` (or ``answer``) with status
``"error"``; the reason is listed in the trajectory's ``metadata.tool_call_errors``.

A rollout that fails (the agent raised, hung, never called the model, or was never finished)
still lands: outcome
``success: false, score: 0`` and ``metadata.error = {"kind", "message"}``, with every turn it
made. Nothing the gateway sampled is dropped.

A turn sampled under a constraint (``response_format`` or a ``tool_choice`` that forces a call,
:mod:`flow_assets.policy.constrained`) says so in :attr:`Choice.constrained`, and the trajectory
lists those turns in ``metadata.constrained_turns`` (``{"turn", "constraint"}``). Their
``logprobs`` are of the MASKED distribution that sampled the tokens (renormalised over the tokens
the grammar allowed), not of the policy's own distribution. Rounds therefore train such a turn
without them (:func:`flow_assets.policy.rollouts.training_samples`: ratio 1, the on-policy
gradient of the unmasked policy at those tokens); recomputing the behaviour log-probs under the
same mask would keep the ratio exact, and is not done.

A streamed call whose client disconnected before the stream ended is recorded with
``delivered=False``: the agent never acted on it, so it is no step (never trained); the
trajectory's ``metadata.undelivered_turns`` counts its tokens.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from flow_assets.logs.schema import Outcome, Step, Trajectory


@dataclass(frozen=True)
class Choice:
    """One sampled completion of a call.

    Attributes:
        completion_ids: sampled ids (the end-of-turn token included when produced).
        logprobs: ``[len(completion_ids)]`` behaviour log-probs, natural log, at the call's temperature.
        text: the completion decoded without special tokens (stop string removed).
        content: the text outside tool calls (``None`` when there is none).
        tool_calls: OpenAI ``tool_calls`` (``id``, ``type``, ``function.name``, ``function.arguments``).
        finish_reason: ``stop``, ``length`` or ``tool_calls``.
        tool_call_error: why an attempted tool call did not parse (then the text is the content).
        constrained: what constrained the sampling (``"json_schema"``, ``"json_object"``,
            ``"tool_choice:required"``, ``"tool_choice:function"``), ``None`` when nothing did.
            The ``logprobs`` of a constrained choice are of the masked, renormalised distribution
            that actually sampled it, not of the policy's own: trainers must not take them as the
            policy's behaviour log-probs without the mask (module docstring).
    """

    completion_ids: list[int]
    logprobs: list[float]
    text: str
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    tool_call_error: str | None = None
    constrained: str | None = None


@dataclass(frozen=True)
class Turn:
    """One chat completion call of a rollout, as the gateway served it.

    Attributes:
        messages: the request's messages, as sent.
        prompt_ids: the rendered chat template, token ids (what the policy was given).
        choices: the ``n`` completions (an agent usually asks for one).
        model: the model name the request asked for; ``adapter_version`` the version that answered.
        temperature / top_p: the sampling settings used (after any rollout override).
        latency_ms: wall time from request to response, milliseconds.
        delivered: ``False`` for a streamed call whose client went away before the stream ended:
            the agent never acted on it, so it is no step of the trajectory (never trained) and
            is only counted in ``metadata.undelivered_turns``.
        upstream_model: set when proxy mode forwarded the call to a model server the gateway does
            not host (:mod:`flow_assets.serving.gateway.upstream`): the model that answered. Such a
            turn is text only: ``prompt_ids`` and the choices' ids and log-probs are empty, and its
            step carries no token fields.
        usage: the upstream's token counts (``prompt_tokens``, ``completion_tokens``) of a forwarded
            turn, as it reported them (``None``: it reported none, or the turn was not forwarded).
    """

    messages: list[dict[str, Any]]
    prompt_ids: list[int]
    choices: list[Choice]
    model: str
    adapter_version: str
    temperature: float
    top_p: float
    latency_ms: float
    delivered: bool = True
    upstream_model: str | None = None
    usage: dict[str, int] | None = None

    def token_count(self, kind: str) -> int:
        """``kind`` ``"prompt"`` or ``"completion"``: tokens of this turn (all choices), counted from
        its ids, or from the upstream's usage for a forwarded turn (0 when it reported none)."""
        if self.upstream_model is not None:
            return int((self.usage or {}).get(f"{kind}_tokens") or 0)
        if kind == "prompt":
            return len(self.prompt_ids)
        return sum(len(c.completion_ids) for c in self.choices)


@dataclass
class RolloutSettings:
    """What the harness (or a user) says about a rollout when it opens it; all optional.

    Attributes:
        task_id / query / agent_id: the canonical trajectory's fields (``query`` defaults to the
            first user message; ``task_id`` and ``agent_id`` may also come with ``finish``).
        trajectory_id: defaults to the rollout id.
        batch: the log batch it lands in (``None``: the gateway's rolling batch).
        source: the landing sub-directory of that batch (default: the gateway's).
        land: ``False`` for rollouts that must not become training logs (held-out evaluation).
        model: serve this model name whatever the agent asks for (evaluation of a candidate).
        temperature / top_p: override the agent's sampling settings (collection at T = 1,
            greedy evaluation at T = 0); the settings used are recorded either way.
        seed: the rollout's sampling seed: call ``k`` of the rollout (counted from 0 in the
            order its calls reach the gateway) samples with :func:`call_seed` of it, whatever
            seed the agent sent and whatever the call is batched with, so the same agent on the
            same task samples the same completions. ``None``: the agent's own seed, else the
            gateway's (which depend on the order calls arrive in). A gateway on the dynamic
            batcher (vLLM backend) records it but keeps its own seeds: that batcher generates
            only calls of one seed together.
        metadata: merged into the trajectory's metadata.
    """

    task_id: str | None = None
    query: str | None = None
    agent_id: str | None = None
    trajectory_id: str | None = None
    batch: str | None = None
    source: str | None = None
    land: bool = True
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def call_seed(rollout_seed: int, call: int) -> int:
    """The sampling seed of call ``call`` (0, 1, ...) of a rollout seeded ``rollout_seed``:
    output ``call + 1`` of SplitMix64 seeded with it (:func:`~flow_assets.policy.decode.row_streams`),
    cut to 63 bits so that it is a valid OpenAI ``seed`` (a signed 64-bit integer) when forwarded
    to an upstream.

    Returns:
        An integer in ``[0, 2^63)``.
    """
    from flow_assets.policy.decode import row_streams

    return row_streams(rollout_seed, call + 1)[call] >> 1


@dataclass
class OpenRollout:
    """A rollout between its first call (or open) and its finish."""

    rollout_id: str
    settings: RolloutSettings
    turns: list[Turn] = field(default_factory=list)
    opened_at: float = 0.0
    last_activity: float = 0.0
    started_at: float = field(default_factory=time.time)
    in_flight: int = 0  # calls being served now: the rollout is not idle, whatever their length
    calls: int = 0  # calls begun (the next call's index, for its seed)
    failed_calls: list[dict[str, Any]] = field(default_factory=list)  # refused calls: {"version", "status", "message"}


class RolloutError(ValueError):
    """A rollout request cannot be served (unknown or already finished rollout, missing task id)."""


def _is_error(result: Any) -> bool:
    return isinstance(result, str) and result.lstrip().startswith("Error")


def _chosen(turn: Turn, next_turn: Turn | None) -> Choice:
    """The choice the agent continued with: the one whose tool calls or content the next request
    sent back as an assistant message; else the first."""
    if next_turn is not None and len(turn.choices) > 1:
        sent = [m for m in next_turn.messages[len(turn.messages) :] if m.get("role") == "assistant"][:1]
        for choice in turn.choices:
            if sent and (
                {c["id"] for c in choice.tool_calls} & {c.get("id") for c in sent[0].get("tool_calls") or []}
                or (choice.content is not None and choice.content == sent[0].get("content"))
            ):
                return choice
    return turn.choices[0]


def _arguments(call: dict[str, Any]) -> Any:
    try:
        return json.loads(call["function"]["arguments"])
    except (json.JSONDecodeError, TypeError, KeyError):
        return call.get("function", {}).get("arguments")


def turn_steps(turns: list[Turn]) -> list[Step]:
    """The steps of a rollout's turns (module docstring), indexed 0..n-1."""
    return [Step(index=i, **s) for i, s in enumerate(_step_fields(turns))]


def _step_fields(turns: list[Turn]) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = []
    for k, turn in enumerate(turns):
        nxt = turns[k + 1] if k + 1 < len(turns) else None
        choice = _chosen(turn, nxt)
        results = {}
        if nxt is not None:
            results = {m.get("tool_call_id"): m.get("content") for m in nxt.messages if m.get("role") == "tool"}
        calls = choice.tool_calls
        answered = [(c, results[c["id"]]) for c in calls if c["id"] in results]
        kind = "tool" if calls else ("answer" if nxt is None else "message")
        ids = turn.upstream_model is None  # a forwarded turn is text only
        steps.append(
            dict(
                kind=kind,
                module="policy",
                tool=calls[0]["function"]["name"] if calls else None,
                input={"tool_calls": [{"id": c["id"], "name": c["function"]["name"], "arguments": _arguments(c)} for c in calls]}
                if calls else None,
                output=choice.text,
                status="error" if choice.tool_call_error or any(_is_error(r) for _, r in answered) else "ok",
                duration_ms=turn.latency_ms,
                token_ids=list(choice.completion_ids) if ids else None,
                logprobs=list(choice.logprobs) if ids else None,
                prompt_token_ids=list(turn.prompt_ids) if ids else None,
                temperature=turn.temperature,
                top_p=turn.top_p,
            )
        )  # fmt: skip
        for call, result in answered:
            steps.append(
                dict(
                    kind="observation",
                    tool=call["function"]["name"],
                    input=_arguments(call),
                    output=result,
                    status="error" if _is_error(result) else "ok",
                )
            )
    return steps


def tool_call_errors(turns: list[Turn]) -> list[dict[str, Any]]:
    """``{"turn", "reason"}`` for every turn whose (chosen) completion attempted a tool call that
    did not parse; ``turn`` counts LLM calls from 0."""
    return [
        {"turn": k, "reason": choice.tool_call_error}
        for k, turn in enumerate(turns)
        if (choice := _chosen(turn, turns[k + 1] if k + 1 < len(turns) else None)).tool_call_error
    ]


def constrained_turns(turns: list[Turn]) -> list[dict[str, Any]]:
    """``{"turn", "constraint"}`` for every turn whose (chosen) completion was sampled under a
    constraint (:attr:`Choice.constrained`); ``turn`` counts LLM calls from 0."""
    return [
        {"turn": k, "constraint": choice.constrained}
        for k, turn in enumerate(turns)
        if (choice := _chosen(turn, turns[k + 1] if k + 1 < len(turns) else None)).constrained
    ]


def _first_user_message(turns: list[Turn]) -> str:
    for turn in turns[:1]:
        for m in turn.messages:
            if m.get("role") == "user":
                content = m.get("content")
                if isinstance(content, list):
                    return "".join(p.get("text", "") for p in content if isinstance(p, dict))
                return content or ""
    return ""


def build_trajectory(
    rollout: OpenRollout,
    outcome: Outcome | None,
    final_answer: str | None = None,
    metadata: dict[str, Any] | None = None,
    error: dict[str, str] | None = None,
) -> Trajectory:
    """The canonical trajectory of a finished rollout.

    ``final_answer`` defaults to the content of the last turn when it made no tool call; an
    ``error`` (``{"kind", "message"}``) makes the outcome a failure with score 0; ``outcome``
    ``None`` without an error is an *unlabelled* trajectory (stored, no reward until a judge or a
    later label gives one).

    Raises:
        pydantic.ValidationError: the result is not a valid trajectory (e.g. empty ``task_id``).
    """
    s = rollout.settings
    turns = [t for t in rollout.turns if t.delivered]
    if final_answer is None and turns:
        last = _chosen(turns[-1], None)
        final_answer = last.content if not last.tool_calls else None
    steps = turn_steps(turns)
    meta = {
        **s.metadata,
        **(metadata or {}),
        "rollout_id": rollout.rollout_id,
        "llm_calls": len(turns),
        "tool_calls": sum(1 for st in steps if st.kind == "observation"),
        "prompt_tokens": sum(t.token_count("prompt") for t in turns),
        "completion_tokens": sum(len(st.token_ids or []) for st in steps)
        + sum(t.token_count("completion") for t in turns if t.upstream_model is not None),
    }
    if forwarded := [t for t in turns if t.upstream_model is not None]:
        # proxy mode: text only, trained as a text log (flow_assets.serving.gateway.upstream)
        meta["capture"] = "text" if len(forwarded) == len(turns) else "mixed"
        meta["upstream_models"] = list(dict.fromkeys(t.upstream_model for t in forwarded))
        if unreported := sum(1 for t in forwarded if not t.usage):
            # e.g. llama-cpp-python's server streams no usage chunk: those turns count 0 tokens above
            meta["usage_unreported_turns"] = unreported
    if s.seed is not None:
        meta["seed"] = s.seed  # the rollout's sampling seed: its calls' seeds follow (call_seed)
    if errors := tool_call_errors(turns):
        meta["tool_call_errors"] = errors
    if constrained := constrained_turns(turns):
        meta["constrained_turns"] = constrained
    if undelivered := [t for t in rollout.turns if not t.delivered]:
        meta["undelivered_turns"] = [
            {"prompt_tokens": t.token_count("prompt"), "completion_tokens": t.token_count("completion"),
             "latency_ms": t.latency_ms, "reason": "client_disconnected"}
            for t in undelivered
        ]  # fmt: skip
    versions = list(dict.fromkeys(t.adapter_version for t in turns))
    if rollout.failed_calls:
        # a call the policy's version refused (its prompt too long for the context, an upstream
        # error) is that version's failure: the trajectory names it even when no call succeeded,
        # so a live A/B counts a challenger whose every call fails
        meta["failed_calls"] = list(rollout.failed_calls)
        versions = list(dict.fromkeys(versions + [f["version"] for f in rollout.failed_calls]))
    if len(versions) > 1:
        meta["adapter_versions"] = versions
    if error is not None:
        meta["error"] = error
        outcome = Outcome(success=False, score=0.0)
    return Trajectory(
        trajectory_id=s.trajectory_id or rollout.rollout_id,
        task_id=s.task_id or f"rollout:{rollout.rollout_id}",
        agent_id=s.agent_id or "gateway",
        adapter_version=versions[0] if versions else None,
        query=s.query if s.query is not None else _first_user_message(turns),
        steps=steps,
        final_answer=final_answer,
        outcome=outcome,
        timestamp=datetime.fromtimestamp(rollout.started_at, timezone.utc).isoformat(),
        metadata=meta,
    )


class RolloutRecorder:
    """Open rollouts by id, their turns, and their trajectories when they finish.

    Thread-safe (the gateway's event loop and its reaper share it).

    Args:
        timeout_s: a rollout without activity for this long is landed by :meth:`reap`:
            *unlabelled* when it made a delivered call (the agent never sent its reward; the
            judge can score it), as an error (``no_llm_call``) when it made none.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, timeout_s: float = 600.0, clock=time.monotonic):
        self.timeout_s = timeout_s
        self.clock = clock
        self._open: dict[str, OpenRollout] = {}
        self._finished: set[str] = set()
        self._lock = threading.Lock()

    def open(self, settings: RolloutSettings, rollout_id: str | None = None) -> str:
        """Open a rollout (the id is made when not given).

        Raises:
            RolloutError: the id is in use or already finished.
        """
        rollout_id = rollout_id or uuid.uuid4().hex
        with self._lock:
            if rollout_id in self._open or rollout_id in self._finished:
                raise RolloutError(f"rollout {rollout_id!r} already exists")
            now = self.clock()
            self._open[rollout_id] = OpenRollout(rollout_id, settings, opened_at=now, last_activity=now)
        return rollout_id

    def settings(self, rollout_id: str) -> RolloutSettings:
        """The settings of a rollout, opening it with defaults when it is unknown; starts no call
        (:meth:`begin_call` does).

        Raises:
            RolloutError: the rollout was already finished.
        """
        return self._settings(rollout_id, False)[0]

    def begin_call(self, rollout_id: str) -> tuple[RolloutSettings, int | None]:
        """A call of the rollout starts: it counts as activity, and :meth:`reap` leaves the
        rollout alone until :meth:`call_ended`. Opens the rollout with defaults on its first call.

        Returns:
            The rollout's settings and the call's sampling seed (:func:`call_seed` of the
            rollout's seed and the call's index; ``None`` when the rollout has no seed).

        Raises:
            RolloutError: the rollout was already finished.
        """
        return self._settings(rollout_id, True)

    def _settings(self, rollout_id: str, calling: bool) -> tuple[RolloutSettings, int | None]:
        with self._lock:
            if rollout_id in self._finished:
                raise RolloutError(f"rollout {rollout_id!r} is already finished")
            now = self.clock()
            if rollout_id not in self._open:
                self._open[rollout_id] = OpenRollout(rollout_id, RolloutSettings(), opened_at=now, last_activity=now)
            rollout = self._open[rollout_id]
            if not calling:
                return rollout.settings, None
            rollout.in_flight += 1
            rollout.last_activity = now
            index, rollout.calls = rollout.calls, rollout.calls + 1
        seed = rollout.settings.seed
        return rollout.settings, None if seed is None else call_seed(seed, index)

    def call_ended(self, rollout_id: str) -> None:
        """A call begun with :meth:`begin_call` is over (served or failed)."""
        with self._lock:
            rollout = self._open.get(rollout_id)
            if rollout is not None and rollout.in_flight > 0:
                rollout.in_flight -= 1
                rollout.last_activity = self.clock()

    def record(self, rollout_id: str, turn: Turn) -> None:
        """Append a served call to its rollout.

        Raises:
            RolloutError: the rollout is not open (finished meanwhile).
        """
        with self._lock:
            rollout = self._open.get(rollout_id)
            if rollout is None:
                raise RolloutError(f"rollout {rollout_id!r} is not open")
            rollout.turns.append(turn)
            rollout.last_activity = self.clock()

    def record_failure(self, rollout_id: str, version: str, status: int, message: str) -> None:
        """A call of the rollout that the policy's ``version`` refused or failed with HTTP
        ``status`` (kept in the trajectory's ``metadata.failed_calls``; :func:`build_trajectory`).
        A rollout that is not open is ignored: the call's answer already told the agent."""
        with self._lock:
            rollout = self._open.get(rollout_id)
            if rollout is not None:
                rollout.failed_calls.append({"version": version, "status": status, "message": message[:500]})
                rollout.last_activity = self.clock()

    def finish(
        self,
        rollout_id: str,
        outcome: Outcome | None,
        final_answer: str | None = None,
        metadata: dict[str, Any] | None = None,
        error: dict[str, str] | None = None,
        unlabelled: bool = False,
        **settings: Any,
    ) -> tuple[Trajectory, RolloutSettings]:
        """Close a rollout: its trajectory and settings (where it is to land). ``settings``
        (``task_id``, ``query``, ``agent_id``) fill what the rollout was opened without.
        ``unlabelled``: close it without an outcome (:func:`build_trajectory`).

        Raises:
            RolloutError: unknown or already finished rollout, or neither outcome nor error
                (nor ``unlabelled``).
            pydantic.ValidationError: the trajectory is invalid (the rollout stays open).
        """
        if outcome is None and error is None and not unlabelled:
            raise RolloutError("finish needs an outcome (success or score) or an error")
        with self._lock:
            rollout = self._open.get(rollout_id)
            if rollout is None:
                state = "already finished" if rollout_id in self._finished else "unknown"
                raise RolloutError(f"rollout {rollout_id!r} is {state}")
            for name, value in settings.items():
                if value is not None and getattr(rollout.settings, name) is None:
                    setattr(rollout.settings, name, value)
            if not any(t.delivered for t in rollout.turns) and error is None:
                error = {"kind": "no_llm_call", "message": "the rollout finished without calling the model"}
            trajectory = build_trajectory(rollout, outcome, final_answer, metadata, error)
            del self._open[rollout_id]
            self._finished.add(rollout_id)
        return trajectory, rollout.settings

    def reap(self, reason: str = "not_finished", everything: bool = False) -> list[tuple[Trajectory, RolloutSettings]]:
        """Land the rollouts idle for longer than ``timeout_s``: unlabelled, with
        ``metadata["unfinished"] = {"reason", "message"}`` (``reason`` is ``reason``), since the
        agent that never sent a reward may still have acted well and a judge can score the flow.
        With ``everything`` (the gateway stops) every open rollout lands, as an error of kind
        ``reason``: its episode may have been cut mid-way."""
        now = self.clock()
        with self._lock:
            stale = [r for r in self._open.values() if everything or (not r.in_flight and now - r.last_activity > self.timeout_s)]
        landed = []
        for rollout in stale:
            message = (
                "the gateway stopped before the rollout was finished" if everything
                else f"no call and no finish for {now - rollout.last_activity:.0f} s (timeout {self.timeout_s:.0f} s)"
            )  # fmt: skip
            try:
                if everything:
                    landed.append(self.finish(rollout.rollout_id, None, error={"kind": reason, "message": message}))
                else:
                    unfinished = {"unfinished": {"reason": reason, "message": message}}
                    landed.append(self.finish(rollout.rollout_id, None, metadata=unfinished, unlabelled=True))
            except RolloutError:
                continue  # finished meanwhile
        return landed

    def known(self, rollout_id: str) -> bool:
        """Whether ``rollout_id`` is open or was finished (an API key that names no such rollout
        is an ordinary key, not a rollout id)."""
        with self._lock:
            return rollout_id in self._open or rollout_id in self._finished

    @property
    def open_count(self) -> int:
        """Rollouts open now."""
        return len(self._open)
