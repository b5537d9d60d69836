"""Proposed workflow changes: JSON Patch documents (RFC 6902) with the evidence behind them.

Rules, each applied to every step of an agent's current definition (:func:`propose`):

``remove_step``
    The step's presence goes with lower success: the difference in success rate between the
    trajectories that take it and those that skip it has an interval entirely below 0.
``remove_broken_step``
    Nearly every call of the step's tool fails (the Wilson lower bound of its failure rate is at
    least ``broken_error_rate``), e.g. a tool the environment does not have.
``change_parameter``
    Trajectories whose calls pass another value for one of the step's fixed parameters succeed
    more often: the difference has an interval entirely above 0. The patch sets the better value.

A comparison is made **within tasks** by default: only tasks with trajectories on both sides
count, each task's difference of success rates is one observation, and the interval is Student's
t over tasks (``mean +- t * s / sqrt(K)``, :func:`flow_assets.rl.eval_stats.student_t_quantile`).
Comparing across all tasks instead (``comparison="pooled"``, Newcombe's hybrid score interval,
Newcombe 1998 method 10) mixes the step's effect with the difficulty of the tasks that need it: on
the tau-bench log it would propose removing ``book_reservation`` from an airline agent, because
booking tasks are hard. Intervals are Bonferroni-corrected over the steps a rule tests for one
agent (``familywise``), so that an agent with 14 tools does not get a proposal by chance.

Every patch starts with a ``test`` operation on what it changes (the step's id, the parameter's
value), so applying it to a definition that has moved on fails instead of changing the wrong step.
Nothing here writes anything: :mod:`.review` applies a proposal after a person approves it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, Literal

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from flow_assets.rl.eval_stats import newcombe_interval, student_t_quantile, wilson_interval
from flow_assets.workflows.definition import WorkflowDefinition, utc_now
from flow_assets.workflows.stats import StepStatsConfig, outcomes, tool_calls

Rule = Literal["remove_step", "remove_broken_step", "change_parameter"]
Status = Literal["open", "applied", "rejected", "stale", "superseded"]

_CAVEAT = {
    "within_task": "an association within tasks, not a randomised test: the agent's choice to take the step may follow "
    "from something that had already gone wrong; try the change on live traffic before trusting the estimate",
    "pooled": "an association across tasks: the tasks on which the agent takes the step may be harder or easier than "
    "the rest, so the estimate mixes the step's effect with the tasks'; prefer the within-task comparison",
}


@dataclass(frozen=True)
class ProposalConfig:
    """The minimum of evidence behind a proposal, and how comparisons are made.

    Each field's description is its ``metadata["description"]`` (:mod:`flow_assets.core.config`).
    """

    comparison: Literal["within_task", "pooled"] = field(default="within_task", metadata={"description": (
        "``\"within_task\"`` (default: trajectories of the same task compared, one difference per task, Student-t "
        "interval over tasks) or ``\"pooled\"`` (all trajectories, Newcombe's hybrid score interval). See the module "
        "docstring for why within-task is the default.")})
    alpha: float = field(default=0.05, metadata={"description": (
        "1 - confidence level of every interval (default 0.05: 95%).")})
    familywise: bool = field(default=True, metadata={"description": (
        "Bonferroni-correct ``alpha`` over the steps one rule tests for one agent (default on).")})
    min_trajectories: int = field(default=30, metadata={"description": (
        "trajectories behind a comparison, both sides together (default 30).")})
    min_per_side: int = field(default=10, metadata={"description": (
        "trajectories on each side of a comparison (default 10).")})
    min_tasks: int = field(default=8, metadata={"description": (
        "tasks with trajectories on both sides, for a within-task comparison (default 8).")})
    min_effect: float = field(default=0.05, metadata={"description": (
        "smallest estimated change in success rate worth a proposal (default 0.05).")})
    broken_error_rate: float = field(default=0.8, metadata={"description": (
        "``remove_broken_step`` needs the Wilson lower bound of the step's call failure rate to reach this (default "
        "0.8).")})
    min_calls: int = field(default=20, metadata={"description": "calls behind ``remove_broken_step`` (default 20)."})
    max_trajectory_ids: int = field(default=50, metadata={"description": (
        "trajectory ids listed per side in the evidence (default 50; the counts are always complete).")})


class Evidence(BaseModel):
    """What a proposal rests on.

    ``effect`` is the estimated change in the agent's success rate (absolute, e.g. +0.15 = 15
    points) if the patch is applied, read off the logs as an association; ``effect_low`` /
    ``effect_high`` its interval at ``level`` (Bonferroni-corrected over ``family_size`` tests).
    ``trajectories`` lists ids on each side of the comparison (the first ``max_trajectory_ids``;
    ``n_trajectories`` counts them all); ``statistics`` is the step's row of ``workflow_step_stats``.
    """

    model_config = ConfigDict(extra="forbid")

    comparison: Literal["within_task", "pooled"]
    effect: float
    effect_low: float
    effect_high: float
    level: float
    family_size: int
    n_trajectories: int
    n_tasks: int | None = None
    sides: dict[str, int]
    trajectories: dict[str, list[str]]
    statistics: dict[str, Any]
    facts: dict[str, Any] = Field(default_factory=dict, description="rule-specific numbers, e.g. calls and failures")
    caveat: str


class Review(BaseModel):
    """A person's decision on a proposal: ``action`` by ``by`` at ``at`` (ISO 8601 UTC) because
    of ``reason``; ``new_version`` is the workflow version an approval created; ``audit_sha256``
    the sha256 of the audit log line that records it (absent in reviews written before it was kept)."""

    model_config = ConfigDict(extra="forbid")

    action: Literal["approve", "reject", "refuse", "supersede"]
    by: str
    at: str
    reason: str | None = None
    new_version: int | None = None
    #: sha256 (hex) of the audit log line that records this decision: an anchor kept outside
    #: the log, so a log whose chain was recomputed after an edit still shows (``verify_audit``)
    audit_sha256: str | None = None


class Proposal(BaseModel):
    """A candidate change to one agent's workflow.

    ``patch`` is a JSON Patch (RFC 6902) against the definition at ``base_version``; ``id`` is a
    hash of agent, base version, rule and patch, so the same evidence proposes the same id again.
    ``status`` moves from ``open`` to ``applied`` (approved and applied), ``rejected``, ``stale``
    (an approval found that it no longer applies) or ``superseded`` (a later run of the rules on
    newer logs or a newer version no longer proposes it); only :mod:`.review` changes it.
    """

    model_config = ConfigDict(extra="forbid")

    id: str
    agent_id: str
    base_version: int
    rule: Rule
    step_id: str
    summary: str
    patch: list[dict[str, Any]]
    evidence: Evidence
    created_at: str
    status: Status = "open"
    review: Review | None = None


def proposal_id(agent_id: str, base_version: int, rule: str, patch: list[dict[str, Any]]) -> str:
    """``wp-`` and 12 hex of the sha256 of what makes a proposal the same one."""
    key = json.dumps([agent_id, base_version, rule, patch], sort_keys=True, separators=(",", ":"))
    return "wp-" + hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class AgentLogs:
    """One agent's logs as the rules read them.

    Attributes:
        outcomes: ``batch, trajectory_id, task_id, success`` for each trajectory with a known outcome.
        calls: the agent's tool calls (:func:`flow_assets.workflows.stats.tool_calls` columns),
            labelled trajectories only.
        stats: the agent's rows of :func:`flow_assets.workflows.stats.step_statistics`.
    """

    outcomes: pl.DataFrame
    calls: pl.DataFrame
    stats: pl.DataFrame


def agent_logs(steps: pl.LazyFrame, trajectories: pl.LazyFrame, stats: pl.DataFrame, config: StepStatsConfig = StepStatsConfig()) -> dict[str, AgentLogs]:
    """:class:`AgentLogs` per agent id from the lake's ``steps`` and ``trajectories`` (with
    ``batch``) and their ``stats`` (:func:`~flow_assets.workflows.stats.step_statistics`)."""
    labelled = outcomes(trajectories, config).filter(pl.col("success").is_not_null()).collect(engine="streaming")
    calls = (
        tool_calls(steps, trajectories, config)
        .filter(pl.col("success").is_not_null())
        .select("batch", "trajectory_id", "agent_id", "task_id", "success", "ordinal", "tool", "status", "input")
        .collect(engine="streaming")
    )
    split_calls = {k[0]: v for k, v in calls.partition_by("agent_id", as_dict=True).items()}
    split_stats = {k[0]: v for k, v in stats.partition_by("agent_id", as_dict=True).items()} if stats.height else {}
    return {
        agent[0]: AgentLogs(rows.drop("agent_id"), split_calls.get(agent[0], calls.clear()), split_stats.get(agent[0], stats.clear()))
        for agent, rows in labelled.partition_by("agent_id", as_dict=True).items()
    }


@dataclass(frozen=True)
class _Sides:
    """Trajectories split into a treated and a control side: ``frame`` has ``trajectory_id,
    task_id, success, treated`` (one row per trajectory)."""

    frame: pl.DataFrame

    def ready(self, method: str, config: ProposalConfig) -> bool:
        frame = self._compared(method)
        treated = int(frame["treated"].sum())
        if frame.height < config.min_trajectories or min(treated, frame.height - treated) < config.min_per_side:
            return False
        # a spread over tasks needs at least two of them, whatever min_tasks says
        return method == "pooled" or frame["task_id"].n_unique() >= max(config.min_tasks, 2)

    def _compared(self, method: str) -> pl.DataFrame:
        if method == "pooled":
            return self.frame
        both = self.frame.group_by("task_id").agg(pl.col("treated").n_unique() == 2).filter(pl.col("treated"))["task_id"]
        return self.frame.filter(pl.col("task_id").is_in(both.implode()))

    def estimate(self, method: str, alpha: float, family_size: int) -> _Estimate:
        """success(treated) - success(control) and its interval at level ``1 - alpha / family_size``."""
        frame = self._compared(method)
        level_alpha = alpha / family_size
        treated, control = frame.filter(pl.col("treated")), frame.filter(~pl.col("treated"))
        n_tasks = None
        if method == "pooled":
            z = NormalDist().inv_cdf(1 - level_alpha / 2)
            s_1, n_1, s_0, n_0 = int(treated["success"].sum()), treated.height, int(control["success"].sum()), control.height
            low, high = newcombe_interval(s_1, n_1, s_0, n_0, z)
            effect = s_1 / n_1 - s_0 / n_0
        else:
            per_task = frame.group_by("task_id").agg(
                d=pl.col("success").filter(pl.col("treated")).mean() - pl.col("success").filter(~pl.col("treated")).mean()
            )["d"]
            n_tasks = per_task.len()
            effect = float(per_task.mean())
            half = student_t_quantile(1 - level_alpha / 2, n_tasks - 1) * float(per_task.std()) / math.sqrt(n_tasks)
            low, high = effect - half, effect + half
        return _Estimate(method, effect, low, high, 1 - level_alpha, family_size, n_tasks, treated["trajectory_id"], control["trajectory_id"])


@dataclass(frozen=True)
class _Estimate:
    """success(treated) - success(control) = ``effect`` in ``[low, high]`` at ``level``."""

    method: Literal["within_task", "pooled"]
    effect: float
    low: float
    high: float
    level: float
    family_size: int
    n_tasks: int | None
    treated: pl.Series
    control: pl.Series

    def evidence(self, sign: int, names: tuple[str, str], row: dict[str, Any], facts: dict[str, Any], max_ids: int) -> Evidence:
        """The evidence of a patch whose effect on success is ``sign * effect`` (-1: a removal,
        whose effect is the skipped side's advantage); ``names`` label the treated and control sides."""
        low, high = sorted((sign * self.low, sign * self.high))
        return Evidence(
            comparison=self.method, effect=sign * self.effect, effect_low=low, effect_high=high, level=self.level,
            family_size=self.family_size, n_trajectories=self.treated.len() + self.control.len(), n_tasks=self.n_tasks,
            sides={names[0]: self.treated.len(), names[1]: self.control.len()},
            trajectories={names[0]: self.treated.head(max_ids).to_list(), names[1]: self.control.head(max_ids).to_list()},
            statistics=row, facts=facts, caveat=_CAVEAT[self.method],
        )  # fmt: skip


def _taken_sides(logs: AgentLogs, tool: str) -> _Sides:
    taken = logs.calls.filter(pl.col("tool") == tool).select("batch", "trajectory_id").unique().with_columns(treated=pl.lit(True))
    frame = logs.outcomes.join(taken, on=["batch", "trajectory_id"], how="left").with_columns(pl.col("treated").fill_null(False))
    return _Sides(frame.sort("batch", "trajectory_id"))


def _parameter_sides(logs: AgentLogs, tool: str, name: str, value: Any) -> tuple[_Sides, Any] | None:
    """Trajectories whose first call of ``tool`` passing ``name`` passed the commonest other
    value (treated) or ``value`` (control); ``None`` when no call passed another value."""
    first: dict[tuple[str, str], Any] = {}
    rows = logs.calls.filter(pl.col("tool") == tool).sort("batch", "trajectory_id", "ordinal")
    for batch, trajectory_id, text in rows.select("batch", "trajectory_id", "input").iter_rows():
        if (batch, trajectory_id) in first:
            continue
        try:
            arguments = json.loads(text) if text else None
        except ValueError:
            continue
        if isinstance(arguments, dict) and name in arguments:
            first[(batch, trajectory_id)] = json.dumps(arguments[name], sort_keys=True)
    own = json.dumps(value, sort_keys=True)
    others = [v for v in first.values() if v != own]
    if not others:
        return None
    other = max(sorted(set(others)), key=others.count)
    chosen = [(b, t, v == other) for (b, t), v in first.items() if v in (own, other)]
    used = pl.DataFrame(chosen, schema={"batch": pl.String, "trajectory_id": pl.String, "treated": pl.Boolean}, orient="row")
    frame = logs.outcomes.join(used, on=["batch", "trajectory_id"], how="inner").sort("batch", "trajectory_id")
    return _Sides(frame), json.loads(other)


def _method(sides: _Sides, config: ProposalConfig, fallback: bool = False) -> str | None:
    if sides.ready(config.comparison, config):
        return config.comparison
    if fallback and sides.ready("pooled", config):
        return "pooled"
    return None


def _row(stats: pl.DataFrame, tool: str) -> dict[str, Any]:
    row = stats.filter(pl.col("tool") == tool).row(0, named=True)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def _removal_patch(position: int, step_id: str) -> list[dict[str, Any]]:
    return [{"op": "test", "path": f"/steps/{position}/id", "value": step_id}, {"op": "remove", "path": f"/steps/{position}"}]


def _points(x: float) -> str:
    return f"{abs(x) * 100:.1f} points"


def propose(definition: WorkflowDefinition, logs: AgentLogs, config: ProposalConfig = ProposalConfig()) -> list[Proposal]:
    """The proposals the rules make for ``definition`` on ``logs`` (module docstring): removals in
    step order, then parameter changes.

    Steps whose tool the logs never show, and tools that more than one step calls (their
    statistics cannot be told apart), are not judged.
    """
    tools = [s.tool for s in definition.steps]
    seen = set(logs.stats["tool"].to_list())
    judged = [(i, s) for i, s in enumerate(definition.steps) if tools.count(s.tool) == 1 and s.tool in seen]
    family = (lambda n: n) if config.familywise else (lambda n: 1)
    proposals: list[Proposal] = []

    def add(rule: Rule, step_id: str, summary: str, patch: list[dict[str, Any]], evidence: Evidence) -> None:
        proposals.append(Proposal(
            id=proposal_id(definition.agent_id, definition.version, rule, patch), agent_id=definition.agent_id,
            base_version=definition.version, rule=rule, step_id=step_id, summary=summary, patch=patch, evidence=evidence,
            created_at=utc_now(),
        ))  # fmt: skip

    # remove_step: the trajectories that take the step against those that skip it
    removal = {s.id: _taken_sides(logs, s.tool) for _, s in judged}
    ready = {k: m for k, sides in removal.items() if (m := _method(sides, config))}
    for position, step in judged:
        if step.id not in ready:
            continue
        est = removal[step.id].estimate(ready[step.id], config.alpha, family(len(ready)))
        if est.high < 0 and -est.effect >= config.min_effect:
            evidence = est.evidence(-1, ("taken", "skipped"), _row(logs.stats, step.tool), {}, config.max_trajectory_ids)
            summary = (f"remove step {step.id!r}: trajectories that take it succeed {_points(-est.effect)} less often "
                       f"({est.method}, {evidence.n_trajectories} trajectories)")  # fmt: skip
            add("remove_step", step.id, summary, _removal_patch(position, step.id), evidence)

    # remove_broken_step: nearly every call of the step's tool fails
    removed = {p.step_id for p in proposals}
    for position, step in judged:
        row = _row(logs.stats, step.tool)
        if step.id in removed or row["calls"] < config.min_calls:
            continue
        failure_low, _ = wilson_interval(row["errors"], row["calls"])
        method = _method(removal[step.id], config, fallback=True)
        if failure_low < config.broken_error_rate or method is None:
            continue
        facts = {"calls": row["calls"], "errors": row["errors"], "failure_rate_low": round(failure_low, 4), "failure_reasons": row["failure_reasons"]}
        evidence = removal[step.id].estimate(method, config.alpha, 1).evidence(-1, ("taken", "skipped"), row, facts, config.max_trajectory_ids)
        if evidence.effect_high < 0:  # the logs say removing it would hurt, broken or not
            continue
        summary = f"remove step {step.id!r}: {row['errors']} of {row['calls']} calls of {step.tool!r} failed: {row['failure_reasons']}"
        add("remove_broken_step", step.id, summary, _removal_patch(position, step.id), evidence)

    # change_parameter: trajectories that passed another value of a fixed parameter succeed more often
    candidates = []
    for position, step in judged:
        for name, value in step.parameters.items():
            found = _parameter_sides(logs, step.tool, name, value)
            if found and (method := _method(found[0], config)):
                candidates.append((position, step, name, value, *found, method))
    for position, step, name, value, sides, other, method in candidates:
        est = sides.estimate(method, config.alpha, family(len(candidates)))
        if est.low > 0 and est.effect >= config.min_effect:
            path = f"/steps/{position}/parameters/{_escape(name)}"
            patch = [{"op": "test", "path": f"/steps/{position}/id", "value": step.id},
                     {"op": "test", "path": path, "value": value}, {"op": "replace", "path": path, "value": other}]  # fmt: skip
            facts = {"parameter": name, "from": value, "to": other}
            evidence = est.evidence(1, ("to", "from"), _row(logs.stats, step.tool), facts, config.max_trajectory_ids)
            summary = (f"set {step.id}.{name} = {json.dumps(other)} (now {json.dumps(value)}): trajectories that passed it "
                       f"succeed {_points(est.effect)} more often ({est.method}, {evidence.n_trajectories} trajectories)")  # fmt: skip
            add("change_parameter", step.id, summary, patch, evidence)
    return proposals


def _escape(token: str) -> str:
    """A JSON Pointer reference token (RFC 6901, section 3): ``~`` as ``~0``, ``/`` as ``~1``."""
    return token.replace("~", "~0").replace("/", "~1")
