"""Per-step statistics of each agent's tool calls, from the lake's ``steps`` and ``trajectories``.

One row per (agent, tool): how often the tool is called and succeeds, its latency and logged
confidence, the commonest failure reasons, and how the trajectory's outcome differs when the step
is **taken** (the trajectory calls the tool at least once), **skipped** (it never does) or **fails**
(at least one call returns an error). Rates carry 95% Wilson score intervals (Wilson 1927) and the
differences Newcombe's hybrid score interval (Newcombe 1998, method 10); both come from
:mod:`flow_assets.rl.eval_stats`.

These are associations across trajectories, not effects of an intervention: the tasks on which an
agent calls a tool may be harder or easier than the rest. :mod:`.proposals` says so with every
proposal it derives from them.

A step is a canonical step of ``kind == "tool"``; plans, messages and answers are the agent's
turns around the workflow, not steps of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from flow_assets.rl.eval_stats import Z_95, newcombe_interval, wilson_interval

#: the lake's join key of a trajectory: trajectory ids are unique within a batch
TRAJECTORY_KEY = ["batch", "trajectory_id"]

STEP_STATS_SCHEMA: dict[str, pl.DataType] = {
    "agent_id": pl.String,
    "tool": pl.String,
    "position": pl.Float64,
    "agent_trajectories": pl.Int64,
    "calls": pl.Int64,
    "errors": pl.Int64,
    "call_success_rate": pl.Float64,
    "call_success_low": pl.Float64,
    "call_success_high": pl.Float64,
    "latency_n": pl.Int64,
    "latency_p50_ms": pl.Float64,
    "latency_p95_ms": pl.Float64,
    "confidence_n": pl.Int64,
    "confidence_mean": pl.Float64,
    "failure_reasons": pl.String,
    "taken_n": pl.Int64,
    "taken_success": pl.Float64,
    "taken_low": pl.Float64,
    "taken_high": pl.Float64,
    "skipped_n": pl.Int64,
    "skipped_success": pl.Float64,
    "skipped_low": pl.Float64,
    "skipped_high": pl.Float64,
    "failed_n": pl.Int64,
    "failed_success": pl.Float64,
    "failed_low": pl.Float64,
    "failed_high": pl.Float64,
    "taken_minus_skipped": pl.Float64,
    "taken_minus_skipped_low": pl.Float64,
    "taken_minus_skipped_high": pl.Float64,
    "failed_minus_ok": pl.Float64,
    "failed_minus_ok_low": pl.Float64,
    "failed_minus_ok_high": pl.Float64,
}
"""Columns of :func:`step_statistics`, one row per (agent_id, tool):

- ``position``: median 0-based position of the tool's first call among the trajectory's tool calls
- ``agent_trajectories``: the agent's trajectories with a known outcome (the denominator of taken + skipped)
- ``calls`` / ``errors``: tool calls and those with ``status == "error"``; ``call_success_*`` their
  ok share with its Wilson interval (calls of one trajectory are not independent: a guide, not a test)
- ``latency_*``: ``duration_ms`` where logged (``latency_n`` calls), p50 / p95 by linear interpolation
- ``confidence_*``: mean logged ``confidence`` and how many calls logged one
- ``failure_reasons``: the commonest error outputs (quoted text as '…', digits as #) with counts
- ``taken_*`` / ``skipped_*`` / ``failed_*``: trajectories with a known outcome that call the tool /
  never call it / have a failed call, their success share and its Wilson interval
- ``taken_minus_skipped*``: success(taken) - success(skipped), Newcombe interval
- ``failed_minus_ok*``: success(failed) - success(taken without a failure), Newcombe interval
Rates of an empty group are null.
"""


@dataclass(frozen=True)
class StepStatsConfig:
    """How step statistics are computed.

    Each field's description is its ``metadata["description"]`` (:mod:`flow_assets.core.config`).
    """

    z: float = field(default=Z_95, metadata={"description": (
        "normal quantile of the intervals; 1.96 (the default) gives 95% intervals.")})
    success_score: float = field(default=1.0, metadata={"description": (
        "a trajectory that logs a score but no success flag counts as a success when ``outcome_score >= "
        "success_score`` (default 1.0: a full score).")})
    max_reasons: int = field(default=3, metadata={"description": (
        "failure reasons listed per step (the commonest first).")})
    reason_chars: int = field(default=100, metadata={"description": "a failure reason is cut to this many characters."})


def outcomes(trajectories: pl.LazyFrame, config: StepStatsConfig = StepStatsConfig()) -> pl.LazyFrame:
    """``batch, trajectory_id, agent_id, task_id, success``: each trajectory and whether it
    succeeded (``outcome_success``, else ``outcome_score >= success_score``; null if neither)."""
    success = pl.coalesce(pl.col("outcome_success"), pl.col("outcome_score") >= config.success_score)
    return trajectories.select(*TRAJECTORY_KEY, "agent_id", "task_id", success.alias("success"))


def tool_calls(steps: pl.LazyFrame, trajectories: pl.LazyFrame, config: StepStatsConfig = StepStatsConfig()) -> pl.LazyFrame:
    """One row per tool call: the trajectory key, ``agent_id``, ``task_id``, ``success`` (of the
    trajectory), ``index``, ``ordinal`` (0-based position among the trajectory's tool calls),
    ``tool``, ``status``, ``input``, ``output``, ``confidence``, ``duration_ms``.

    Both frames need a ``batch`` column (the lake's hive partition; add a literal for one partition).
    """
    return _tool_calls(steps, trajectories, config, ("input", "output", "confidence", "duration_ms"))


def _tool_calls(steps: pl.LazyFrame, trajectories: pl.LazyFrame, config: StepStatsConfig, extra: tuple[str, ...]) -> pl.LazyFrame:
    # :func:`tool_calls` with only the step columns ``extra`` besides the key, index, tool and
    # status. The ordinal is a window over the trajectory key, which the streaming engine runs in
    # memory: every column that rides along is held whole (a batch's tool outputs at 4M steps
    # raised the asset's peak RSS by ~1.1 GB), so callers ask for what they use.
    calls = steps.filter((pl.col("kind") == "tool") & pl.col("tool").is_not_null()).select(
        *TRAJECTORY_KEY, "index", "tool", "status", *extra
    )
    ordinal = (pl.col("index").rank("ordinal").over(TRAJECTORY_KEY) - 1).cast(pl.Int64)
    return calls.with_columns(ordinal=ordinal).join(outcomes(trajectories, config), on=TRAJECTORY_KEY, how="inner")


def trajectory_tools(calls: pl.LazyFrame) -> pl.LazyFrame:
    """One row per (trajectory, tool called in it): ``n_calls``, ``failed`` (any call errored),
    ``first`` (ordinal of the first call), ``first_share`` (rank of the tool's first call among
    the trajectory's distinct tools, scaled to [0, 1]; 0 when it calls one tool), ``success``."""
    per_tool = calls.group_by(*TRAJECTORY_KEY, "agent_id", "task_id", "tool").agg(
        n_calls=pl.len(),
        failed=(pl.col("status") == "error").any(),
        first=pl.col("ordinal").min(),
        success=pl.col("success").first(),
    )
    rank = pl.col("first").rank("ordinal").over(TRAJECTORY_KEY) - 1
    distinct = pl.len().over(TRAJECTORY_KEY)
    share = pl.when(distinct > 1).then(rank / (distinct - 1)).otherwise(0.0)
    return per_tool.with_columns(first_share=share.cast(pl.Float64))


_QUOTED = r"'[^']*'|\"[^\"]*\""


def _failure_reasons(steps: pl.LazyFrame, trajectories: pl.LazyFrame, config: StepStatsConfig) -> pl.LazyFrame:
    # quoted arguments and numbers differ from call to call; without them, the same failure
    # ("payment amount does not add up, total price is #, but paid #") is counted once
    reason = (
        pl.col("output").fill_null("(no output)").str.split("\n").list.first().str.strip_chars()
        .str.replace_all(_QUOTED, "'…'").str.replace_all(r"\d+", "#").str.slice(0, config.reason_chars)
    )  # fmt: skip
    # the failed tool calls of :func:`tool_calls` (same filter, same inner join on the trajectory),
    # without its ordinal window: only failed calls' outputs are read, and streamed
    failed = steps.filter((pl.col("kind") == "tool") & pl.col("tool").is_not_null() & (pl.col("status") == "error"))
    counted = (
        failed.select(*TRAJECTORY_KEY, "tool", "output")
        .join(outcomes(trajectories, config).select(*TRAJECTORY_KEY, "agent_id"), on=TRAJECTORY_KEY, how="inner")
        .group_by("agent_id", "tool", reason.alias("reason"))
        .len()
        .sort("agent_id", "tool", "len", "reason", descending=[False, False, True, False])
    )
    return counted.group_by("agent_id", "tool", maintain_order=True).agg(
        failure_reasons=(pl.col("reason") + " (" + pl.col("len").cast(pl.String) + ")").head(config.max_reasons).str.join("; ")
    )


def _rate(successes: int | None, n: int | None, z: float) -> tuple[float | None, float | None, float | None]:
    if not n:
        return None, None, None
    low, high = wilson_interval(int(successes), int(n), z)
    return successes / n, low, high


def _difference(s_1: int, n_1: int, s_2: int, n_2: int, z: float) -> tuple[float | None, float | None, float | None]:
    if not n_1 or not n_2:
        return None, None, None
    low, high = newcombe_interval(s_1, n_1, s_2, n_2, z)
    return s_1 / n_1 - s_2 / n_2, low, high


#: :func:`step_statistics` computes the per-trajectory view of the tool calls (two windows over the
#: trajectory key, which run in memory) for about this many steps at a time (memory: ~0.25 GB per million)
STEPS_PER_BUCKET = 1_000_000


def _per_call_and_trajectory(steps: pl.LazyFrame, trajectories: pl.LazyFrame, config: StepStatsConfig) -> tuple[pl.DataFrame, pl.DataFrame]:
    # The per-(agent, tool) figures of the calls (``calls, errors, latency_*, confidence_*``) and
    # of the trajectories that call the tool (``position, taken_*, failed_*``). The ordinal is a
    # window over the trajectory key, which holds its whole input in memory, so the trajectories
    # are split by a hash of their id into buckets of about STEPS_PER_BUCKET steps (all rows of a
    # trajectory fall in one bucket), and of each bucket only what the figures need is kept:
    # counts, and the values whose quantiles, median or mean are taken (8 bytes each). Counts add
    # up and a quantile or median does not depend on the order of its values, so the figures are
    # those of one pass; a mean may differ in its last bit (the order of its sum). At 16M steps
    # the calls with their keys, one pass, held ~1.5 GB; kept whole per bucket, ~0.5 GB.
    n_steps = steps.select(pl.len()).collect().item()
    buckets = max(1, -(-n_steps // STEPS_PER_BUCKET))
    labelled = pl.col("success").is_not_null()
    call_parts, tool_parts = [], []
    for bucket in range(buckets):
        mine = pl.col("trajectory_id").hash(seed=0) % buckets == bucket
        part_steps, part_trajectories = (steps, trajectories) if buckets == 1 else (steps.filter(mine), trajectories.filter(mine))
        calls = _tool_calls(part_steps, part_trajectories, config, ("confidence", "duration_ms")).collect(engine="streaming")
        call_parts.append(
            calls.group_by("agent_id", "tool").agg(
                calls=pl.len(),
                errors=(pl.col("status") == "error").sum(),
                durations=pl.col("duration_ms").drop_nulls(),
                confidences=pl.col("confidence").drop_nulls(),
            )
        )
        tool_parts.append(
            trajectory_tools(calls.lazy()).group_by("agent_id", "tool").agg(
                firsts=pl.col("first"),
                taken_n=labelled.sum(),
                taken_s=(labelled & pl.col("success")).sum(),
                failed_n=(labelled & pl.col("failed")).sum(),
                failed_s=(labelled & pl.col("failed") & pl.col("success")).sum(),
            ).collect()
        )
        del calls
    group = ["agent_id", "tool"]
    calls = pl.concat(call_parts)
    latency = calls.select(*group, "durations").explode("durations").group_by(group).agg(
        latency_n=pl.col("durations").count(),
        latency_p50_ms=pl.col("durations").quantile(0.5, "linear"),
        latency_p95_ms=pl.col("durations").quantile(0.95, "linear"),
    )
    confidence = calls.select(*group, "confidences").explode("confidences").group_by(group).agg(
        confidence_n=pl.col("confidences").count(), confidence_mean=pl.col("confidences").mean()
    )
    per_call = (
        calls.group_by(group).agg(pl.col("calls", "errors").sum())
        .join(latency, on=group, how="left")
        .join(confidence, on=group, how="left")
        .with_columns(pl.col("latency_n", "confidence_n").fill_null(0))  # no value logged: exploded to no row
    )  # fmt: skip
    tools = pl.concat(tool_parts)
    position = tools.select(*group, "firsts").explode("firsts").group_by(group).agg(
        position=pl.col("firsts").median().cast(pl.Float64)
    )
    per_trajectory = tools.group_by(group).agg(pl.col("taken_n", "taken_s", "failed_n", "failed_s").sum()).join(
        position, on=group, how="left"
    )
    return per_call, per_trajectory


def step_statistics(steps: pl.LazyFrame, trajectories: pl.LazyFrame, config: StepStatsConfig = StepStatsConfig()) -> pl.DataFrame:
    """Per-(agent, tool) statistics (:data:`STEP_STATS_SCHEMA`), sorted by agent then position.

    Args:
        steps: the lake's ``steps`` rows (with ``batch``), any number of batches.
        trajectories: the lake's ``trajectories`` rows of the same batches (with ``batch``).
        config: interval level, how a score-only outcome counts, failure reasons shown.

    Returns:
        One row per tool an agent called; an agent without tool calls has no row.
    """
    per_call, per_trajectory = _per_call_and_trajectory(steps, trajectories, config)
    agents = outcomes(trajectories, config).group_by("agent_id").agg(
        agent_trajectories=pl.col("success").count(), agent_s=pl.col("success").sum()
    )
    # each part is collected on its own (each is one row per agent and tool, or per agent): in
    # one query the optimiser shared a single scan of ``steps`` between the calls and the failure
    # reasons, holding every step's output (+0.8 GB at 4M steps)
    reasons = _failure_reasons(steps, trajectories, config).collect(engine="streaming")
    joined = (
        per_call.join(per_trajectory, on=["agent_id", "tool"], how="left")
        .join(agents.collect(engine="streaming"), on="agent_id", how="left")
        .join(reasons, on=["agent_id", "tool"], how="left")
    )
    rows = []
    for row in joined.iter_rows(named=True):
        z = config.z
        taken_n, taken_s, failed_n, failed_s = (int(row[k] or 0) for k in ("taken_n", "taken_s", "failed_n", "failed_s"))
        all_n, all_s = int(row["agent_trajectories"] or 0), int(row["agent_s"] or 0)
        skipped_n, skipped_s = all_n - taken_n, all_s - taken_s
        ok_n, ok_s = taken_n - failed_n, taken_s - failed_s
        values = {k: row[k] for k in ("agent_id", "tool", "position", "calls", "errors", "latency_n", "latency_p50_ms",
                                      "latency_p95_ms", "confidence_n", "confidence_mean", "failure_reasons")}  # fmt: skip
        values["agent_trajectories"] = all_n
        values["call_success_rate"], values["call_success_low"], values["call_success_high"] = _rate(row["calls"] - row["errors"], row["calls"], z)
        for name, (s, n) in {"taken": (taken_s, taken_n), "skipped": (skipped_s, skipped_n), "failed": (failed_s, failed_n)}.items():
            values[f"{name}_n"] = n
            values[f"{name}_success"], values[f"{name}_low"], values[f"{name}_high"] = _rate(s, n, z)
        diff = _difference(taken_s, taken_n, skipped_s, skipped_n, z)
        values["taken_minus_skipped"], values["taken_minus_skipped_low"], values["taken_minus_skipped_high"] = diff
        diff = _difference(failed_s, failed_n, ok_s, ok_n, z)
        values["failed_minus_ok"], values["failed_minus_ok_low"], values["failed_minus_ok_high"] = diff
        rows.append(values)
    table = pl.DataFrame(rows, schema=STEP_STATS_SCHEMA) if rows else pl.DataFrame(schema=STEP_STATS_SCHEMA)
    return table.sort("agent_id", "position", "tool", nulls_last=True)
