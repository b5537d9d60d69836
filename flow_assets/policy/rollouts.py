"""Lake rows back into training samples: every LLM turn of a trajectory is one training row.

The gateway logs each turn of a rollout as a step carrying ``prompt_token_ids`` (the chat
template exactly as it rendered it), ``token_ids`` (what was sampled), ``logprobs`` (the
behaviour log-probs) and ``temperature``. Training reads those ids back as they are (token in,
token out): text is never re-tokenised, and tool results, which reach the policy only as part of
a later turn's prompt, are context and never trained.

Trajectories logged as text only (a team's own logs, no token ids) are re-rendered with the
policy's chat template instead (:func:`text_training_samples`); captured ids always win.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import orjson
import polars as pl

from flow_assets.policy.configs import TrainingSample


def batch_id_for(adapter_version: str, task_ids: Sequence[str], seed: int) -> str:
    """A short id naming one collection (same champion, tasks and seed -> same id)."""
    digest = hashlib.sha256(orjson.dumps([adapter_version, list(task_ids), seed])).hexdigest()
    return f"{adapter_version}-{digest[:10]}"


def training_samples(steps: pl.DataFrame, step_advantages: pl.DataFrame, trajectories: pl.DataFrame, agent_id: str) -> list[TrainingSample]:
    """Training rows of one batch: the token-carrying turns of ``agent_id``'s trajectories, each
    with its per-step advantage (the ``advantages`` asset's credit assignment).

    Args:
        steps: the batch's ``steps`` table (``prompt_token_ids``, ``token_ids``, ``logprobs``,
            ``temperature``).
        step_advantages: ``trajectory_id, index, advantage``.
        trajectories: ``trajectory_id, task_id, agent_id``.

    Returns:
        One sample per turn, ordered by trajectory id and step index (not in table order, which
        is the order the rollouts finished in: the update then depends on what the batch holds,
        not on timing); steps without prompt or completion ids, or without an advantage, are
        left out. A turn without a logged temperature is read as T = 1. A turn
        the gateway sampled under a constraint (``tool_choice`` / ``response_format``, listed in
        the trajectory's ``metadata.constrained_turns``) has ``behaviour_logprobs`` ``None``: its
        logged log-probs are of the masked distribution, not of the policy the ratio compares
        with, so the trainer takes it at ratio 1 (the on-policy gradient of the unmasked policy
        at those tokens) rather than with a ratio that starts below 1 (:func:`constrained_steps`).
    """
    rows = (
        steps.filter(pl.col("token_ids").is_not_null() & pl.col("prompt_token_ids").is_not_null())
        .join(trajectories.select("trajectory_id", "task_id", "agent_id"), on="trajectory_id", maintain_order="left")
        .filter(pl.col("agent_id") == agent_id)
        .join(step_advantages.select("trajectory_id", "index", "advantage"), on=["trajectory_id", "index"], maintain_order="left")
        .filter(pl.col("advantage").is_not_null())
        .select("trajectory_id", "index", "prompt_token_ids", "token_ids", "advantage", "logprobs", "task_id", "temperature")
        .sort("trajectory_id", "index")
    )
    masked = constrained_steps(steps, trajectories) if "metadata" in trajectories.columns else set()
    return [
        TrainingSample(
            prompt_ids=list(prompt),
            completion_ids=list(tokens),
            advantage=float(advantage),
            behaviour_logprobs=list(logprobs) if logprobs is not None and (trajectory_id, index) not in masked else None,
            task_id=task_id,
            temperature=1.0 if temperature is None else float(temperature),
        )
        for trajectory_id, index, prompt, tokens, advantage, logprobs, task_id, temperature in rows.iter_rows()
    ]


def constrained_steps(steps: pl.DataFrame, trajectories: pl.DataFrame) -> set[tuple[str, int]]:
    """``(trajectory_id, step index)`` of the turns sampled under a constraint.

    The gateway lists them in ``metadata.constrained_turns`` as ``{"turn": k, ...}``, ``k``
    counting the trajectory's LLM calls from 0; the ``k``-th step carrying ``token_ids`` (in step
    order) is that call.

    Args:
        steps: ``trajectory_id, index, token_ids``.
        trajectories: ``trajectory_id, metadata`` (JSON text).

    Raises:
        orjson.JSONDecodeError: a metadata text that names ``constrained_turns`` but is not JSON.
    """
    listed = trajectories.filter(pl.col("metadata").str.contains("constrained_turns", literal=True))
    turns = {
        trajectory_id: {int(t["turn"]) for t in orjson.loads(meta).get("constrained_turns") or []}
        for trajectory_id, meta in listed.select("trajectory_id", "metadata").iter_rows()
    }
    if not any(turns.values()):
        return set()
    calls = (
        steps.filter(pl.col("trajectory_id").is_in(list(turns)) & pl.col("token_ids").is_not_null())
        .sort("trajectory_id", "index")
        .with_columns(turn=pl.int_range(pl.len()).over("trajectory_id"))
    )
    return {(t, int(i)) for t, i, k in calls.select("trajectory_id", "index", "turn").iter_rows() if k in turns[t]}


@dataclass(frozen=True)
class TextSamples:
    """Training rows re-rendered from a batch's text-only trajectories (no logged token ids).

    Attributes:
        samples: one :class:`TrainingSample` per rendered assistant turn (or per packed run of
            turns, ``pack``), ``behaviour_logprobs``
            ``None`` (the round computes them with the logged version: see
            :func:`flow_assets.training.rounds.train_candidate`).
        adapter_versions: per sample, the ``adapter_version`` the trajectory logged (``None``
            where it logged none).
        trajectories: text-only trajectories of the agent read.
        turns: assistant turns rendered (``len(samples)`` unless packed).
        skipped: ``(trajectory_id, turn, reason)`` for turns not rendered (e.g. a user message
            the canonical record does not keep came before them).
        assumed_temperature: trajectories that logged no sampling temperature (read as T = 1).
        held_out_trajectories: trajectories left out because their task is in the held-out split.
    """

    samples: list[TrainingSample]
    adapter_versions: list[str | None]
    trajectories: int
    turns: int
    skipped: list[tuple[str, int, str]]
    assumed_temperature: int
    held_out_trajectories: int = 0


def text_training_samples(
    interaction_logs: pl.DataFrame,
    step_advantages: pl.DataFrame,
    agent_ids: Collection[str],
    tokenizer,
    context: Sequence[dict] = (),
    max_length: int | None = None,
    held_out: Callable[[str], bool] | None = None,
    tools: Sequence[dict] | None = None,
    pack: bool = False,
) -> TextSamples:
    """Training rows of the trajectories of ``agent_ids`` that carry no token ids: each assistant turn
    re-rendered with the policy's own chat template (:func:`flow_assets.policy.logged_rows.trajectory_rows`,
    the gateway's renderer), one sample per turn, with the advantage of the turn's last step that
    has one (its decision; per-step credit from the ``advantages`` asset).

    Args:
        interaction_logs: the batch's ``interaction_logs`` partition (``record_json``, ``agent_id``).
        step_advantages: ``trajectory_id, index, advantage``.
        agent_ids: the agents whose flows train this policy.
        tokenizer: the policy's tokenizer (its chat template).
        context: messages the agent sent before its query (a system prompt), if any; a
            trajectory whose metadata holds its own ``context`` (and ``tools``), as an
            ``openai-chat`` record with ``metadata.context_messages`` does, is rendered with those.
        max_length: the model's context in tokens; a turn whose prompt and completion exceed it
            is skipped with that reason (not truncated: a cut prompt is a context the policy
            never saw).
        held_out: ``held_out(task_id)`` is true for a task of the held-out split: its
            trajectories never train (offline evaluation scores the policy on them), counted in
            ``held_out_trajectories``.
        tools: the tool specifications the agent offered (OpenAI ``tools``), where the log did not
            keep them.
        pack: consecutive turns of one prefix-consistent row with the same advantage become ONE
            sample (prompt = the first turn's prompt, completion = everything up to the end of
            the last turn, ``loss_mask`` 1 on the turns' tokens only): a conversation costs one
            forward pass instead of one per turn. For a causal LM each masked token has the same
            log-prob as in its own per-turn sample, so under token-level aggregation (``dapo``,
            ``bnpo``) with one weight per turn the loss and its gradient are the per-turn ones;
            under per-sequence aggregation (``grpo``, ``dr_grpo``) the conversation counts as one
            sequence. A GRPO round needs per-turn behaviour log-probs: leave it off there.

    Returns:
        :class:`TextSamples`. A trajectory with any captured token ids is left to
        :func:`training_samples` (captured ids win); one that logged ``metadata.temperature``
        is scored at it, others at T = 1 (counted in ``assumed_temperature``).

    Raises:
        TypeError: ``agent_ids`` is a single string.
    """
    from flow_assets.logs.schema import Trajectory
    from flow_assets.policy.logged_rows import trajectory_rows

    if isinstance(agent_ids, str):  # a bare id would be read as its characters
        raise TypeError(f"agent_ids must be a collection of agent ids, not the string {agent_ids!r}")

    advantage_of = {(t, int(i)): a for t, i, a in step_advantages.select("trajectory_id", "index", "advantage").iter_rows() if a is not None}
    samples: list[TrainingSample] = []
    versions: list[str | None] = []
    skipped: list[tuple[str, int, str]] = []
    read = assumed = held = turns = 0
    for (record,) in interaction_logs.filter(pl.col("agent_id").is_in(list(agent_ids))).select("record_json").iter_rows():
        trajectory = Trajectory.model_validate_json(record)
        if any(step.token_ids is not None for step in trajectory.steps):
            continue
        if held_out is not None and held_out(trajectory.task_id):
            held += 1
            continue
        read += 1
        logged_t = trajectory.metadata.get("temperature")
        temperature = float(logged_t) if isinstance(logged_t, (int, float)) and not isinstance(logged_t, bool) else 1.0
        assumed += logged_t is None
        # what the agent sent besides its episode, where its record kept it (openai-chat's
        # metadata.context_messages), wins over the caller's guess for every trajectory
        own_context, own_tools = trajectory.metadata.get("context"), trajectory.metadata.get("tools")
        rendered = trajectory_rows(
            tokenizer, trajectory, context=own_context if isinstance(own_context, list) else context,
            tools=own_tools if isinstance(own_tools, list) else tools, use_captured_ids=False,
        )  # fmt: skip
        skipped += [(trajectory.trajectory_id, turn, why) for turn, why in rendered.skipped]
        for row in rendered.rows:
            kept: list[tuple[int, list[int], float]] = []  # (turn, its positions in the row, its advantage)
            for turn in row.turns:
                positions = [p for p, k in enumerate(row.turn_index) if k == turn]
                steps = rendered.conversation.turns[turn].steps
                credited = [advantage_of[(trajectory.trajectory_id, s)] for s in steps if (trajectory.trajectory_id, s) in advantage_of]
                if not positions or not credited:
                    skipped.append((trajectory.trajectory_id, turn, "no advantage for its steps"))
                    continue
                if max_length is not None and positions[-1] + 1 > max_length:
                    skipped.append((trajectory.trajectory_id, turn, f"{positions[-1] + 1} tokens, over the model's context of {max_length}"))
                    continue
                kept.append((turn, positions, float(credited[-1])))
            for run in _packed_runs(kept) if pack else [[k] for k in kept]:
                start, end = run[0][1][0], run[-1][1][-1] + 1
                in_loss = {p for _, positions, _ in run for p in positions}
                samples.append(TrainingSample(
                    prompt_ids=row.input_ids[:start], completion_ids=row.input_ids[start:end], advantage=run[0][2],
                    task_id=trajectory.task_id, temperature=temperature,
                    loss_mask=[int(p in in_loss) for p in range(start, end)] if len(run) > 1 else None,
                ))  # fmt: skip
                versions.append(trajectory.adapter_version)
                turns += len(run)
    return TextSamples(samples, versions, read, turns, skipped, assumed, held)


def _packed_runs(kept: list[tuple[int, list[int], float]]) -> list[list[tuple[int, list[int], float]]]:
    """Consecutive turns of one row with the same advantage, grouped (a turn left out, or a
    different advantage, starts a new group)."""
    runs: list[list[tuple[int, list[int], float]]] = []
    for item in kept:
        if runs and runs[-1][-1][0] + 1 == item[0] and runs[-1][-1][2] == item[2]:
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs
