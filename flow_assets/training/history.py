"""The training history: one row per training round, read like an experiment tracker's run page.

Built from what the rounds leave behind (pure functions, no Dagster): each round's ``round.json``
and ``evaluation.json`` in ``<models>/runs/<batch>/``, the per-step metrics in the lake's
``training_steps`` table, and the registry's history (which round's candidate became which
version). :func:`history_chart` draws the held-out success of candidate and champion per round,
with their 95% Wilson intervals, as text (the Dagster UI renders Markdown, not charts) and
:func:`vega_lite_spec` gives the same chart as a Vega-Lite specification.
"""

from __future__ import annotations

import math
from pathlib import Path

import polars as pl

from flow_assets.rl.gate import verdict
from flow_assets.training.rounds import read_evaluation, read_round_summary

#: columns of :func:`training_history`, with their meaning (the UI's column schema)
COLUMNS = {
    "round": "1-based, in the order the rounds were trained",
    "batch": "the log batch (partition) the round trained on",
    "champion_before": "the champion the candidate was trained from",
    "champion_after": "the champion after the round (a new version if the candidate was promoted)",
    "promoted": "whether the candidate became the champion",
    "verdict": "the gate's decision in one line",
    "source": "where the trained flows came from: the landing source(s) of the agent's trajectories in the batch",
    "update_rule": "how they trained: grpo (clipped surrogate on captured or re-rendered own-policy turns) or awr (advantage-weighted likelihood on another model's flows)",
    "turns_captured": "turn rows with the gateway's captured token ids",
    "turns_text": "turn rows re-rendered from text logs (behaviour log-probs recomputed by the logged version)",
    "reward_mean": "mean reward of the batch's trajectories",
    "steps": "optimizer steps",
    "loss": "GRPO surrogate at the last step",
    "kl_to_behaviour": "mean KL of the candidate to the behaviour policy, nats per token",
    "clip_fraction": "share of tokens clipped, mean over the round's steps",
    "metric": "the gate's held-out mode (sampled or greedy)",
    "held_out_tasks": "held-out tasks evaluated",
    "candidate_success": "candidate's held-out success rate",
    "candidate_ci_low": "its 95% Wilson interval, low",
    "candidate_ci_high": "its 95% Wilson interval, high",
    "champion_success": "champion's held-out success rate on the same tasks",
    "champion_ci_low": "its 95% Wilson interval, low",
    "champion_ci_high": "its 95% Wilson interval, high",
    "gain": "candidate - champion success",
    "mcnemar_p": "McNemar exact p-value of the paired outcomes",
    "training_seconds": "wall time of the optimisation, seconds",
}


def _finite(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def training_history(models_root: str | Path, registry_content: dict, clip_fractions: dict[str, float] | None = None) -> pl.DataFrame:
    """One row per trained round under ``models_root/runs`` (columns :data:`COLUMNS`), ordered by
    when the round's ``round.json`` was written; a round not yet evaluated has null evaluation
    columns and the verdict ``"not evaluated"``.

    Args:
        registry_content: ``AdapterRegistry.load()``; a ``promote`` event whose ``metrics.batch``
            is the round's batch gives ``champion_after``.
        clip_fractions: batch -> mean clip fraction over the round's steps (from the lake's
            ``training_steps``), where known.

    Returns:
        A ``[rounds, len(COLUMNS)]`` frame (empty, with the columns, when nothing was trained).
    """
    runs = Path(models_root) / "runs"
    promoted_as = {
        e["metrics"].get("batch"): e["version"]
        for e in registry_content.get("history", [])
        if e.get("action") == "promote" and isinstance(e.get("metrics"), dict)
    }
    found = sorted(
        ((p.stat().st_mtime_ns, p.parent) for p in runs.glob("*/round.json")) if runs.is_dir() else (), key=lambda t: t[0]
    )
    rows = []
    for index, (_, run_dir) in enumerate(found, start=1):
        summary = read_round_summary(run_dir)
        row = dict.fromkeys(COLUMNS)
        row.update(
            round=index,
            batch=summary.batch,
            champion_before=summary.parent_version,
            champion_after=promoted_as.get(summary.batch, summary.parent_version),
            promoted=summary.batch in promoted_as,
            source=", ".join(summary.sources) or None,
            update_rule=summary.update_rule,
            turns_captured=summary.turns_captured,
            turns_text=summary.turns_text,
            reward_mean=_finite(summary.reward_mean),
            steps=summary.final_step,
            loss=_finite(summary.losses[-1]) if summary.losses else None,
            kl_to_behaviour=_finite(summary.kl_to_behaviour),
            clip_fraction=_finite((clip_fractions or {}).get(summary.batch)),
            training_seconds=_finite(summary.training_seconds),
            verdict="not evaluated",
        )
        if (run_dir / "evaluation.json").exists():
            evaluation = read_evaluation(run_dir)
            metric = evaluation.gate_config.metric
            row["verdict"] = verdict(summary.parent_version, evaluation.gate)
            if metric in evaluation.report:
                mode = evaluation.report[metric]
                cand, champ = mode["candidate"]["success_rate"], mode["champion"]["success_rate"]
                row.update(
                    metric=metric,
                    held_out_tasks=mode["n_tasks"],
                    candidate_success=cand["rate"],
                    candidate_ci_low=cand["ci_low"],
                    candidate_ci_high=cand["ci_high"],
                    champion_success=champ["rate"],
                    champion_ci_low=champ["ci_low"],
                    champion_ci_high=champ["ci_high"],
                    gain=mode["gain"],
                    mcnemar_p=mode["mcnemar"]["p_value"],
                )
        rows.append(row)
    schema = {
        "round": pl.Int64, "batch": pl.Utf8, "champion_before": pl.Utf8, "champion_after": pl.Utf8, "promoted": pl.Boolean,
        "verdict": pl.Utf8, "source": pl.Utf8, "update_rule": pl.Utf8, "turns_captured": pl.Int64, "turns_text": pl.Int64,
        "reward_mean": pl.Float64, "steps": pl.Int64, "loss": pl.Float64, "kl_to_behaviour": pl.Float64,
        "clip_fraction": pl.Float64, "metric": pl.Utf8, "held_out_tasks": pl.Int64, "candidate_success": pl.Float64,
        "candidate_ci_low": pl.Float64, "candidate_ci_high": pl.Float64, "champion_success": pl.Float64,
        "champion_ci_low": pl.Float64, "champion_ci_high": pl.Float64, "gain": pl.Float64, "mcnemar_p": pl.Float64,
        "training_seconds": pl.Float64,
    }  # fmt: skip
    return pl.DataFrame(rows, schema=schema) if rows else pl.DataFrame(schema=schema)


def history_chart(history: pl.DataFrame, width: int = 40) -> str:
    """Held-out success per round as a Markdown code block: one line per round and policy, a bar
    from 0 to 1 (``width`` characters) with the 95% interval drawn as ``[`` ... ``]`` around the
    rate ``#``, then the numbers and the verdict. Rounds without an evaluation are left out."""
    lines = [f"held-out success (0 .. 1, {width} columns), 95% interval in brackets"]
    for row in history.filter(pl.col("candidate_success").is_not_null()).iter_rows(named=True):
        for who in ("champion", "candidate"):
            rate, low, high = row[f"{who}_success"], row[f"{who}_ci_low"], row[f"{who}_ci_high"]
            bar = [" "] * (width + 1)
            lo_i, hi_i, at = (min(width, max(0, round(x * width))) for x in (low, high, rate))
            for i in range(lo_i, hi_i + 1):
                bar[i] = "-"
            bar[lo_i], bar[hi_i], bar[at] = "[", "]", "#"
            name = row["champion_before"] if who == "champion" else f"cand.{row['round']}"
            tail = f"  gain {row['gain']:+.3f}, p {row['mcnemar_p']:.2g}; {'promoted ' + row['champion_after'] if row['promoted'] else 'kept'}" if who == "candidate" else ""
            lines.append(f"r{row['round']:02d} {name:>8} |{''.join(bar)}| {rate:.3f}{tail}")
    return "```\n" + "\n".join(lines) + "\n```"


def vega_lite_spec(history: pl.DataFrame) -> dict:
    """A Vega-Lite v5 specification of the same chart: success per round for candidate and
    champion (points, with their 95% intervals as error bars), data inline."""
    values = []
    for row in history.filter(pl.col("candidate_success").is_not_null()).iter_rows(named=True):
        for who in ("candidate", "champion"):
            values.append(
                {"round": row["round"], "policy": who, "success": row[f"{who}_success"],
                 "ci_low": row[f"{who}_ci_low"], "ci_high": row[f"{who}_ci_high"], "verdict": row["verdict"]}
            )  # fmt: skip
    encoding = {"x": {"field": "round", "type": "ordinal"}, "color": {"field": "policy", "type": "nominal"}}
    return {
        "$schema": "https://vega.github.io/schema/vega-lite/v5.json",
        "title": "held-out success per training round",
        "data": {"values": values},
        "layer": [
            {"mark": "errorbar", "encoding": {**encoding, "y": {"field": "ci_low", "type": "quantitative", "title": "success"}, "y2": {"field": "ci_high"}}},
            {"mark": {"type": "point", "filled": True}, "encoding": {**encoding, "y": {"field": "success", "type": "quantitative"}, "tooltip": [{"field": "verdict"}]}},
        ],
    }
