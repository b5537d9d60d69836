"""The scoring agent: an LLM judge behind any OpenAI-compatible endpoint, as a reward component.

Two modes:

- ``absolute``: one call per trajectory; the judge reads the rubric and the trajectory and replies
  ``{"score": s}`` with ``s`` in [0, 1] (an LLM-as-a-judge score, Zheng et al. 2023, "Judging
  LLM-as-a-Judge", single-answer grading).
- ``relative``: one call per group; the judge sees every trajectory of the group (the attempts at
  the same task) side by side and scores each in [0, 1] relative to the others, as RULER does
  (OpenPipe ART, "RULER: Relative Universal LLM-Elicited Rewards", 2025). GRPO only uses the
  differences inside a group (DeepSeekMath 2024, eq. 3), so a ranking of the group is exactly the
  signal it needs, and judges are more consistent ranking than grading. A group of one has
  nothing to rank against and is judged in absolute mode.

Failures never become rewards: a group whose call fails (timeout, HTTP error after the retries,
a reply that does not parse, a score out of range) is *dropped*: every trajectory of it gets a
null judge score and the reason, and the rewards table gives it a null reward, so it carries no
gradient. A zero would tell GRPO the attempts were bad.

Replies are cached by content hash (the SHA-256 of model, messages and sampling settings), so a
re-materialised partition or a retried run does not pay twice; only replies that parsed are
cached. Tokens are counted from the endpoint's ``usage``; cost is
``prompt_tokens * input_price + completion_tokens * output_price`` (USD per million tokens).

The HTTP client is the ``openai`` package's ``AsyncOpenAI`` (timeouts and retries with backoff on
connection errors, 408, 409, 429 and 5xx are its own); concurrency is bounded by a semaphore.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from flow_assets.logs.schema import Trajectory

MODES = ("absolute", "relative")
#: the columns of :func:`judgement_table`
JUDGEMENT_SCHEMA = {"trajectory_id": pl.String, "judge_score": pl.Float64, "judge_error": pl.String, "judge_cost_usd": pl.Float64}

DEFAULT_RUBRIC = (
    "A good trajectory solves the user's task correctly, uses its tools correctly and only when "
    "they help, and ends with a clear final answer. Penalise wrong answers, invented facts and "
    "failed or useless tool calls."
)

_ABSOLUTE_INSTRUCTIONS = (
    "You grade one attempt of an AI agent at a task.\nRubric: {rubric}\n"
    'Reply with JSON only: {{"score": s}} where s is a number from 0 (worst) to 1 (best).'
)
_RELATIVE_INSTRUCTIONS = (
    "You compare {n} attempts of an AI agent at the same task.\nRubric: {rubric}\n"
    "Score every attempt from 0 (worst) to 1 (best), relative to the others: better attempts get "
    'higher scores. Reply with JSON only: {{"scores": [{{"id": 1, "score": s}}, ...]}} with one '
    "entry for each id from 1 to {n}."
)


class JudgeError(RuntimeError):
    """The judge could not score a group: the message says why (HTTP failure, timeout, a reply
    that is not the JSON asked for, a score outside [0, 1])."""


@dataclass(frozen=True)
class JudgeSettings:
    """How the judge is asked.

    Attributes:
        model: the endpoint's model name.
        mode: ``"absolute"`` or ``"relative"`` (module docstring).
        rubric: what a good trajectory is, in the user's words.
        temperature / max_tokens: sampling of the judge's reply (0 = greedy; tokens).
        max_chars_per_trajectory: a trajectory's rendering is cut to this many characters (the
            middle goes, the task and the final answer stay).
        concurrency: most requests in flight at once.
        timeout_s: per request, seconds.
        max_retries: retries of a failed request (the client's exponential backoff).
        input_usd_per_mtok / output_usd_per_mtok: prices, USD per million prompt / completion
            tokens (0: a self-hosted judge).
    """

    model: str
    mode: str = "relative"
    rubric: str = DEFAULT_RUBRIC
    temperature: float = 0.0
    max_tokens: int = 256
    max_chars_per_trajectory: int = 4000
    concurrency: int = 8
    timeout_s: float = 60.0
    max_retries: int = 2
    input_usd_per_mtok: float = 0.0
    output_usd_per_mtok: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"judge mode must be one of {MODES}, got {self.mode!r}")
        if self.concurrency < 1 or self.max_tokens < 1 or self.timeout_s <= 0 or self.max_retries < 0:
            raise ValueError("judge concurrency and max_tokens must be >= 1, timeout_s > 0, max_retries >= 0")


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def render_trajectory(trajectory: Trajectory, max_chars: int = 4000) -> str:
    """A trajectory as the judge reads it: the task, each step (kind, tool, input, output,
    status), the final answer. Token ids, log-probs and the logged outcome are left out: the judge
    scores what the agent did, not what was already measured. Cut to ``max_chars`` characters by
    dropping the middle of the steps."""
    head = f"Task: {trajectory.query}"
    tail = f"Final answer: {trajectory.final_answer if trajectory.final_answer is not None else '(none)'}"
    lines = []
    for step in trajectory.steps:
        if step.kind == "tool":
            line = f"[{step.index}] tool {step.tool or '?'}({_text(step.input)}) -> {_text(step.output)}"
        else:
            line = f"[{step.index}] {step.kind}: {_text(step.output)}"
        lines.append(line + (" (error)" if step.status == "error" else ""))
    body = "\n".join(lines)
    room = max_chars - len(head) - len(tail) - 2
    if len(body) > room:
        keep = max(room - 20, 0)
        body = body[: keep // 2] + "\n[... cut ...]\n" + body[len(body) - keep // 2 :] if keep else ""
    return f"{head}\n{body}\n{tail}" if body else f"{head}\n{tail}"


def absolute_messages(rendered: str, rubric: str) -> list[dict[str, str]]:
    """The chat messages of an absolute judgement of one rendered trajectory."""
    return [
        {"role": "system", "content": _ABSOLUTE_INSTRUCTIONS.format(rubric=rubric)},
        {"role": "user", "content": rendered},
    ]


def relative_messages(rendered: Sequence[str], rubric: str) -> list[dict[str, str]]:
    """The chat messages of a relative (RULER-style) judgement of a group's rendered trajectories,
    numbered 1..n in the given order."""
    body = "\n\n".join(f"Attempt {i}:\n{text}" for i, text in enumerate(rendered, start=1))
    return [
        {"role": "system", "content": _RELATIVE_INSTRUCTIONS.format(rubric=rubric, n=len(rendered))},
        {"role": "user", "content": body},
    ]


def _json_objects(reply: str) -> list[Any]:
    """Every JSON object embedded in ``reply`` (a judge may wrap its JSON in prose or a fence)."""
    decoder, found, i = json.JSONDecoder(), [], 0
    while (i := reply.find("{", i)) >= 0:
        try:
            obj, end = decoder.raw_decode(reply, i)
        except json.JSONDecodeError:
            i += 1
            continue
        found.append(obj)
        i = end
    return found


def _score(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= float(value) <= 1.0):
        raise JudgeError(f"{where} is {value!r}, not a number in [0, 1]")
    return float(value)


def _excerpt(reply: str) -> str:
    return repr(reply[:80] + ("..." if len(reply) > 80 else ""))


def parse_absolute(reply: str) -> float:
    """The score in an absolute judgement's reply (the last JSON object with a ``score``).

    Raises:
        JudgeError: no such object, or the score is not a number in [0, 1].
    """
    objects = [o for o in _json_objects(reply) if isinstance(o, dict) and "score" in o]
    if not objects:
        raise JudgeError(f'no JSON object with a "score" in the judge\'s reply {_excerpt(reply)}')
    return _score(objects[-1]["score"], "score")


def parse_relative(reply: str, n: int) -> list[float]:
    """The ``n`` scores in a relative judgement's reply, in attempt order (ids 1..n).

    Raises:
        JudgeError: no ``{"scores": [...]}`` object, an id missing, repeated or out of range, or a
            score that is not a number in [0, 1].
    """
    objects = [o for o in _json_objects(reply) if isinstance(o, dict) and isinstance(o.get("scores"), list)]
    if not objects:
        raise JudgeError(f'no JSON object with a "scores" list in the judge\'s reply {_excerpt(reply)}')
    scores: dict[int, float] = {}
    for entry in objects[-1]["scores"]:
        ident = entry.get("id") if isinstance(entry, dict) else None
        if isinstance(ident, str) and ident.strip().isdigit():
            ident = int(ident)
        if isinstance(ident, bool) or not isinstance(ident, int) or not 1 <= ident <= n:
            raise JudgeError(f"scores entry {entry!r}: id must be an integer from 1 to {n}")
        if ident in scores:
            raise JudgeError(f"scores: id {ident} appears twice")
        scores[ident] = _score(entry.get("score"), f"scores[id={ident}].score")
    missing = sorted(set(range(1, n + 1)) - set(scores))
    if missing:
        raise JudgeError(f"scores: no score for attempt(s) {missing} of {n}")
    return [scores[i] for i in range(1, n + 1)]


def request_key(settings: JudgeSettings, messages: Sequence[dict[str, str]]) -> str:
    """The cache key of one request: SHA-256 (hex) of the model, the messages and the sampling
    settings, so any change to what is asked is a new key."""
    payload = json.dumps(
        {"model": settings.model, "messages": list(messages), "temperature": settings.temperature, "max_tokens": settings.max_tokens},
        sort_keys=True,
        ensure_ascii=False,
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


class JudgeCache:
    """Judge replies on disk, one JSON file per request key (``<dir>/<key[:2]>/<key>.json``),
    written atomically (temporary file, then rename), so concurrent runs share it safely.
    ``directory=None`` caches nothing."""

    def __init__(self, directory: str | Path | None):
        self.directory = Path(directory) if directory else None

    def _path(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        """The cached ``{"reply", "prompt_tokens", "completion_tokens"}`` of ``key``, or None (also
        for an unreadable entry, which is then simply asked again)."""
        if self.directory is None:
            return None
        try:
            return json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None

    def put(self, key: str, value: dict[str, Any]) -> None:
        """Store ``value`` under ``key``."""
        if self.directory is None:
            return
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)


@dataclass
class GroupJudgement:
    """The judge's verdict on one group.

    Attributes:
        task_id: the group.
        scores: ``trajectory_id -> score`` in [0, 1]; empty when the group was dropped.
        error: why the group was dropped (None when scored).
        calls: requests made for it (cache hits excluded); ``cached``: replies taken from the cache.
        prompt_tokens / completion_tokens: tokens the endpoint reported for those requests.
        cost_usd: their cost at the configured prices, USD.
    """

    task_id: str
    scores: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    calls: int = 0
    cached: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0


async def _ask(client, semaphore: asyncio.Semaphore, settings: JudgeSettings, messages, cache: JudgeCache, verdict: GroupJudgement, parse):
    """One request through the cache: the parsed reply; counts go to ``verdict``."""
    key = request_key(settings, messages)
    hit = cache.get(key)
    if hit is not None:
        verdict.cached += 1
        return parse(hit["reply"])
    async with semaphore:
        try:
            response = await client.chat.completions.create(
                model=settings.model, messages=messages, temperature=settings.temperature, max_tokens=settings.max_tokens
            )
        except Exception as exc:  # the client already retried; say what failed, in one line
            raise JudgeError(f"judge request failed after {settings.max_retries} retries: {type(exc).__name__}: {exc}") from None
    verdict.calls += 1
    usage = response.usage
    prompt, completion = (usage.prompt_tokens, usage.completion_tokens) if usage is not None else (0, 0)
    verdict.prompt_tokens += prompt
    verdict.completion_tokens += completion
    verdict.cost_usd += (prompt * settings.input_usd_per_mtok + completion * settings.output_usd_per_mtok) / 1e6
    reply = (response.choices[0].message.content or "") if response.choices else ""
    parsed = parse(reply)  # raises before caching: only replies that parse are kept
    cache.put(key, {"reply": reply, "prompt_tokens": prompt, "completion_tokens": completion})
    return parsed


async def _judge_group(client, semaphore, settings: JudgeSettings, task_id: str, group: Sequence[Trajectory], cache: JudgeCache) -> GroupJudgement:
    verdict = GroupJudgement(task_id)
    rendered = [render_trajectory(t, settings.max_chars_per_trajectory) for t in group]
    try:
        if settings.mode == "relative" and len(group) > 1:
            scores = await _ask(client, semaphore, settings, relative_messages(rendered, settings.rubric), cache, verdict, lambda r: parse_relative(r, len(group)))
        else:
            scores = await asyncio.gather(
                *(_ask(client, semaphore, settings, absolute_messages(text, settings.rubric), cache, verdict, parse_absolute) for text in rendered)
            )
    except JudgeError as exc:
        verdict.error = str(exc)
        return verdict
    verdict.scores = {t.trajectory_id: s for t, s in zip(group, scores)}
    return verdict


async def judge_groups(
    groups: dict[str, Sequence[Trajectory]], settings: JudgeSettings, base_url: str, api_key: str, cache: JudgeCache | None = None
) -> list[GroupJudgement]:
    """Judge every group concurrently (at most ``settings.concurrency`` requests in flight).

    Args:
        groups: ``task_id -> the group's trajectories``.
        base_url: the OpenAI-compatible endpoint, e.g. ``http://127.0.0.1:8000/v1``.
        api_key: its key (any string for an endpoint without authentication).
        cache: replies already paid for (default: none).

    Returns:
        One :class:`GroupJudgement` per group, in the order of ``groups``. Never raises for a
        judge failure: the group's ``error`` says what happened.
    """
    from openai import AsyncOpenAI

    cache = cache or JudgeCache(None)
    semaphore = asyncio.Semaphore(settings.concurrency)
    async with AsyncOpenAI(base_url=base_url, api_key=api_key or "unused", timeout=settings.timeout_s, max_retries=settings.max_retries) as client:
        return list(await asyncio.gather(*(_judge_group(client, semaphore, settings, task_id, group, cache) for task_id, group in groups.items())))


def judge_groups_sync(*args, **kwargs) -> list[GroupJudgement]:
    """:func:`judge_groups` from synchronous code (its own event loop)."""
    return asyncio.run(judge_groups(*args, **kwargs))


def judgement_table(judgements: Sequence[GroupJudgement], groups: dict[str, Sequence[Trajectory]]) -> pl.DataFrame:
    """One row per trajectory: ``trajectory_id, judge_score`` (Float64, null when its group was
    dropped), ``judge_error`` (String, the reason, null when scored) and ``judge_cost_usd`` (its
    group's request cost shared equally by the group's trajectories, USD; paid even when the
    reply was refused)."""
    ids, scores, errors, costs = [], [], [], []
    for verdict in judgements:
        group = groups[verdict.task_id]
        for trajectory in group:
            ids.append(trajectory.trajectory_id)
            scores.append(verdict.scores.get(trajectory.trajectory_id))
            errors.append(verdict.error)
            costs.append(verdict.cost_usd / len(group))
    return pl.DataFrame(
        {"trajectory_id": ids, "judge_score": scores, "judge_error": errors, "judge_cost_usd": costs},
        schema=JUDGEMENT_SCHEMA,
    )


def judge_totals(judgements: Sequence[GroupJudgement]) -> dict[str, Any]:
    """Totals over a batch: groups scored and dropped, requests, cache hits, tokens, USD."""
    return {
        "groups_scored": sum(1 for j in judgements if j.error is None),
        "groups_dropped": sum(1 for j in judgements if j.error is not None),
        "calls": sum(j.calls for j in judgements),
        "cached": sum(j.cached for j in judgements),
        "prompt_tokens": sum(j.prompt_tokens for j in judgements),
        "completion_tokens": sum(j.completion_tokens for j in judgements),
        "cost_usd": sum(j.cost_usd for j in judgements),
    }
