"""Reflective rewriting of a prompt policy's instructions with GEPA (Agrawal et al. 2025, "GEPA:
Reflective Prompt Evolution Can Outperform Reinforcement Learning", arXiv:2507.19457), through the
``gepa`` package (the ``gepa`` extra): flowopt supplies the two things GEPA cannot know.

- **The system under optimisation** (:class:`ProxyPromptAdapter`, GEPA's ``GEPAAdapter``): one
  text component, ``instructions``, put into the prompt policy under search (its demonstrations
  and tool descriptions kept); a candidate is evaluated by running the agent on train tasks
  through the proxy to the upstream model (:func:`~flow_assets.training.prompt_rounds.proxy_scores`),
  scored by the task source's verifier.
- **The feedback the reflection model reads** (:func:`reflective_record`): per task, the question,
  the agent's whole flow as text (its tool calls, the tools' results, its answer, or the error that
  ended it) and the verifier's reward with the expected answer.

GEPA does the rest as published: minibatches of the train tasks, the reflection model's new
instruction from the failures (its default proposal prompt), acceptance when the new text does
better on the same minibatch, a Pareto frontier of candidates over the validation tasks, and a
budget of ``max_metric_calls`` task evaluations. The reflection model is any OpenAI-compatible
chat endpoint (:class:`ReflectionModel`), configured like the judge (``FLOWOPT_REFLECTION_*``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import polars as pl

from flow_assets.logs.schema import Trajectory
from flow_assets.policy.prompt import PromptPolicy
from flow_assets.tasks.sources import Task
from flow_assets.training.prompt_rounds import PromptRoundError, Usage

#: the one text component GEPA evolves
COMPONENT = "instructions"

#: runs a prompt on tasks: (policy, tasks, scratch) -> (EVAL_SCHEMA rows in task order, usage, landed flows)
RunPrompt = Callable[[PromptPolicy, Sequence[Task], Path], tuple[pl.DataFrame, Usage, list[Trajectory]]]


class ReflectionModel:
    """An OpenAI-compatible chat endpoint that writes new instructions (GEPA's ``LanguageModel``:
    called with a prompt, or with chat messages, it returns the reply's text). Thread-safe.

    Args:
        base_url: up to ``/v1``.
        model: the model name sent.
        api_key: bearer key (``None``: no header); never in ``repr``, logs or errors.
        max_tokens / temperature: of each reflection call.
        timeout_s: seconds per call.

    Attributes:
        calls / prompt_tokens / completion_tokens: what it has been asked and has answered (the
            usage the endpoint reported; 0 where it reported none).
        replies: every reply's text, in order.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None, max_tokens: int = 512, temperature: float = 1.0, timeout_s: float = 600.0):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"the reflection model's URL must be http(s), got {base_url!r}")
        self.base_url, self.model, self._key = base_url.rstrip("/"), model, api_key
        self.max_tokens, self.temperature, self.timeout_s = max_tokens, temperature, timeout_s
        self.calls = self.prompt_tokens = self.completion_tokens = 0
        self.replies: list[str] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ReflectionModel({self.base_url!r}, {self.model!r})"

    def __call__(self, prompt: str | list[dict[str, Any]]) -> str:
        """The reply's text to ``prompt``.

        Raises:
            PromptRoundError: the endpoint answered an error status, could not be reached, or sent
                no message (the message says which, never the key).
        """
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens, "temperature": self.temperature}
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        try:
            response = httpx.post(f"{self.base_url}/chat/completions", json=body, headers=headers, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise PromptRoundError(f"the reflection model at {self.base_url} could not be reached: {type(exc).__name__}") from None
        if response.status_code != 200:
            text = response.text[:300].replace(self._key, "[redacted]") if self._key else response.text[:300]
            raise PromptRoundError(f"the reflection model at {self.base_url} answered {response.status_code}: {text}")
        data = response.json()
        try:
            reply = data["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise PromptRoundError(f"the reflection model at {self.base_url} sent no message: {json.dumps(data)[:300]}") from None
        usage = data.get("usage") or {}
        with self._lock:
            self.calls += 1
            self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            self.completion_tokens += int(usage.get("completion_tokens") or 0)
            self.replies.append(reply)
        return reply


def flow_transcript(flow: Trajectory | None) -> str:
    """The agent's flow as the reflection model reads it: one line per step (a tool call with its
    arguments, the tool's result, the answer), and the error that ended it, if any."""
    if flow is None:
        return "(no flow was recorded)"
    lines = []
    for step in flow.steps:
        if step.kind == "tool" and isinstance(step.input, dict) and step.input.get("tool_calls"):
            for call in step.input["tool_calls"]:
                lines.append(f"called {call.get('name')}({json.dumps(call.get('arguments'))})")
        elif step.kind == "observation":
            lines.append(f"tool result: {step.output}")
        elif step.output not in (None, ""):
            lines.append(f"{step.kind}: {step.output}")
    if error := (flow.metadata or {}).get("error"):
        lines.append(f"error: {error.get('message', error) if isinstance(error, dict) else error}")
    return "\n".join(lines) or "(the agent produced nothing)"


def reflective_record(task: Task, flow: Trajectory | None, reward: float, success: bool) -> dict[str, str]:
    """One example of GEPA's reflective dataset: ``Inputs`` (the task), ``Generated Outputs``
    (:func:`flow_transcript`), ``Feedback`` (the reward and, when wrong, the expected answer)."""
    verdict = "The answer is correct." if success else f"The answer is wrong; the expected answer is {task.reference}."
    return {"Inputs": task.query, "Generated Outputs": flow_transcript(flow), "Feedback": f"Reward {reward:.2f}. {verdict}"}


@dataclass
class ProxyPromptAdapter:
    """GEPA's ``GEPAAdapter`` for a prompt policy's instructions (module docstring).

    Attributes:
        base: the policy whose ``instructions`` GEPA rewrites (the rest is kept).
        run: runs a policy on tasks (:data:`RunPrompt`).
        scratch: each evaluation lands its flows in a new sub-directory of it.
        usage: upstream tokens of every evaluation so far.
        evaluated: every instruction text evaluated, in order, with its tasks' count.
    """

    base: PromptPolicy
    run: RunPrompt
    scratch: Path
    usage: Usage = field(default_factory=Usage)
    evaluated: list[tuple[str, int]] = field(default_factory=list)
    _counter: itertools.count = field(default_factory=itertools.count, repr=False)

    # GEPA finds no propose_new_texts here and uses its own reflective proposer (reflection_lm)
    propose_new_texts = None

    def policy(self, candidate: dict[str, str]) -> PromptPolicy:
        """The prompt policy of a GEPA candidate."""
        return dataclasses.replace(self.base, instructions=candidate[COMPONENT])

    def evaluate(self, batch: list[Task], candidate: dict[str, str], capture_traces: bool = False):
        """GEPA's ``evaluate``: the candidate's agents on ``batch``, one rollout per task; a failed
        rollout scores 0 (it never raises for one task)."""
        from gepa import EvaluationBatch

        rows, usage, flows = self.run(self.policy(candidate), batch, self.scratch / f"eval-{next(self._counter):04d}")
        self.usage = self.usage + usage
        self.evaluated.append((candidate[COMPONENT], len(batch)))
        by_task = {f.task_id: f for f in flows}
        rewards, answers, successes = rows["reward"].to_list(), rows["completion"].to_list(), rows["success"].to_list()
        traces = [{"task": t, "flow": by_task.get(t.task_id), "reward": r, "success": s} for t, r, s in zip(batch, rewards, successes)]
        return EvaluationBatch(outputs=[a or "" for a in answers], scores=[float(r) for r in rewards], trajectories=traces if capture_traces else None)

    def make_reflective_dataset(self, candidate: dict[str, str], eval_batch, components_to_update: list[str]) -> dict[str, list[dict[str, str]]]:
        """GEPA's ``make_reflective_dataset``: :func:`reflective_record` per evaluated task."""
        records = [reflective_record(t["task"], t["flow"], t["reward"], t["success"]) for t in eval_batch.trajectories or []]
        return {name: records for name in components_to_update}


@dataclass(frozen=True)
class ReflectionResult:
    """What GEPA found.

    Attributes:
        policy: the best candidate's prompt policy (the seed's when nothing beat it).
        improved: whether the best candidate is not the seed.
        val_scores: every candidate's mean reward on the validation tasks (seed first).
        instructions: every candidate's instructions (seed first).
        metric_calls: task evaluations spent.
        usage: upstream tokens of the evaluations.
        reflection_calls / reflection_tokens: the reflection model's calls and (prompt, completion) tokens.
    """

    policy: PromptPolicy
    improved: bool
    val_scores: list[float]
    instructions: list[str]
    metric_calls: int
    usage: Usage
    reflection_calls: int
    reflection_tokens: tuple[int, int]


def reflect_instructions(seed: PromptPolicy, train: Sequence[Task], val: Sequence[Task], run: RunPrompt, reflection: ReflectionModel,
                         max_metric_calls: int, minibatch_size: int, scratch: Path, rng_seed: int = 0) -> ReflectionResult:  # fmt: skip
    """GEPA on ``seed``'s instructions (module docstring): minibatches of ``minibatch_size`` from
    ``train``, the Pareto frontier over ``val``, at most ``max_metric_calls`` task evaluations
    (GEPA may overshoot by one minibatch); the best candidate by mean reward on ``val`` wins
    (ties: the seed).

    Raises:
        PromptRoundError: the ``gepa`` package is not installed (``pip install 'flowopt[gepa]'``).
    """
    try:
        import gepa
    except ImportError:
        raise PromptRoundError("reflective rewriting needs the gepa package: pip install -e '.[gepa]'") from None
    adapter = ProxyPromptAdapter(seed, run, scratch)
    result = gepa.optimize(
        seed_candidate={COMPONENT: seed.instructions}, trainset=list(train), valset=list(val), adapter=adapter, reflection_lm=reflection,
        max_metric_calls=max_metric_calls, reflection_minibatch_size=minibatch_size, seed=rng_seed, display_progress_bar=False,
        raise_on_exception=False, skip_perfect_score=True,
    )  # fmt: skip
    scores = [float(s) for s in result.val_aggregate_scores]
    best = max(range(len(scores)), key=lambda i: (scores[i], -i))
    best = best if scores[best] > scores[0] else 0
    return ReflectionResult(
        policy=adapter.policy(result.candidates[best]), improved=best != 0, val_scores=scores,
        instructions=[c[COMPONENT] for c in result.candidates], metric_calls=int(result.total_metric_calls or 0), usage=adapter.usage,
        reflection_calls=reflection.calls, reflection_tokens=(reflection.prompt_tokens, reflection.completion_tokens),
    )  # fmt: skip
