"""Candidate vs champion on the same held-out tasks: the numbers the promotion gate reads.

Input: one row per (policy, mode, task) of :data:`EVAL_SCHEMA`: ``success`` (bool), ``reward``
(verifier score in [0, 1]), ``completion_tokens`` (all turns), ``llm_calls`` and ``tool_calls``
of the agent's rollout; ``policy`` is ``"candidate"`` or ``"champion"``, ``mode`` is ``"greedy"``
(temperature 0) or ``"sampled"`` (temperature 1, one sample per task).
"""

from __future__ import annotations

from dataclasses import asdict

import polars as pl

from flow_assets.rl.eval_stats import mcnemar_exact, mean_interval, paired_bootstrap, success_rate

EVAL_SCHEMA = {
    "policy": pl.String,
    "mode": pl.String,
    "task_id": pl.String,
    "completion": pl.String,
    "reward": pl.Float64,
    "success": pl.Boolean,
    "completion_tokens": pl.Int64,
    "llm_calls": pl.Int64,
    "tool_calls": pl.Int64,
}

POLICIES = ("candidate", "champion")
MODES = ("greedy", "sampled")


def policy_summary(rows: pl.DataFrame) -> dict:
    """One policy's rollouts (rows of :data:`EVAL_SCHEMA`, one mode): success rate with its 95%
    Wilson interval, and per rollout the mean reward, completion tokens, LLM calls and tool calls
    with 95% t intervals (each a dict of :class:`~flow_assets.rl.eval_stats.SuccessRate` /
    :class:`~flow_assets.rl.eval_stats.MeanInterval` fields)."""
    return {
        "success_rate": asdict(success_rate(rows["success"].to_list())),
        "avg_reward": asdict(mean_interval(rows["reward"].to_list())),
        "avg_completion_tokens": asdict(mean_interval(rows["completion_tokens"].cast(pl.Float64).to_list())),
        "avg_llm_calls": asdict(mean_interval(rows["llm_calls"].cast(pl.Float64).to_list())),
        "avg_tool_calls": asdict(mean_interval(rows["tool_calls"].cast(pl.Float64).to_list())),
    }


def compare_policies(rows: pl.DataFrame, bootstrap_seed: int = 0) -> dict:
    """Per mode: each policy's success rate (95% Wilson interval), mean reward, completion length,
    LLM calls and tool calls per rollout (95% t intervals), and the paired comparison of candidate vs champion: success-rate
    ``gain`` (absolute, candidate - champion), McNemar's exact test and a paired bootstrap of the
    reward difference.

    Raises:
        ValueError: a mode lacks one of the policies, or the two policies were evaluated on
            different task sets (a paired test needs the same tasks).
    """
    report: dict = {}
    for mode in MODES:
        by_policy = {p: rows.filter((pl.col("mode") == mode) & (pl.col("policy") == p)).sort("task_id") for p in POLICIES}
        if any(f.height == 0 for f in by_policy.values()):
            continue
        cand, champ = by_policy["candidate"], by_policy["champion"]
        if cand["task_id"].to_list() != champ["task_id"].to_list():
            raise ValueError(f"{mode}: candidate and champion were evaluated on different tasks")
        summaries = {p: policy_summary(f) for p, f in by_policy.items()}
        report[mode] = {
            **summaries,
            "n_tasks": cand.height,
            "gain": summaries["candidate"]["success_rate"]["rate"] - summaries["champion"]["success_rate"]["rate"],
            "mcnemar": asdict(mcnemar_exact(cand["success"].to_list(), champ["success"].to_list())),
            "reward_bootstrap": asdict(
                paired_bootstrap(cand["reward"].to_list(), champ["reward"].to_list(), seed=bootstrap_seed)
            ),
        }
    if not report:
        raise ValueError("no mode has both a candidate and a champion evaluation")
    return report


def summarise_policy(rows: pl.DataFrame) -> dict:
    """One policy's held-out evaluation on its own (``training.evaluate``): per mode present in
    ``rows`` (rows of :data:`EVAL_SCHEMA` of a single policy), :func:`policy_summary` and
    ``n_tasks``.

    Raises:
        ValueError: ``rows`` is empty or holds more than one policy.
    """
    policies = rows["policy"].unique().to_list()
    if len(policies) != 1:
        raise ValueError(f"expected the rows of one policy, got {sorted(map(str, policies)) or 'none'}")
    report = {}
    for mode in MODES:
        mine = rows.filter(pl.col("mode") == mode)
        if mine.height:
            report[mode] = {**policy_summary(mine), "n_tasks": mine.height}
    return report
