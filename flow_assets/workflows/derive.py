"""A workflow definition derived from what the logs show, for agents nobody wrote one for.

Each tool an agent calls in at least ``min_trajectories`` of its trajectories becomes one step,
ordered by where the tool's first call typically falls in a trajectory (the median over
trajectories of its rank among the distinct tools called, scaled to [0, 1]). A step the agent
skips in more than ``1 - required_share`` of its trajectories is ``optional``. An argument that
has one and the same value in at least ``constant_share`` of a tool's calls becomes a fixed
parameter of its step: it is what the agent always passes, so it is something a workflow fixes.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field

import polars as pl

from flow_assets.workflows.definition import WorkflowDefinition, WorkflowStep
from flow_assets.workflows.stats import StepStatsConfig, outcomes, tool_calls, trajectory_tools


@dataclass(frozen=True)
class DeriveConfig:
    """How a definition is read off the logs.

    Each field's description is its ``metadata["description"]`` (:mod:`flow_assets.core.config`).
    """

    min_trajectories: int = field(default=2, metadata={"description": (
        "a tool becomes a step when at least this many of the agent's trajectories call it (default 2: a tool called "
        "once is noise, not a step).")})
    required_share: float = field(default=0.9, metadata={"description": (
        "a step called in fewer than this share of the agent's trajectories is marked ``optional`` (default 0.9).")})
    constant_share: float = field(default=0.95, metadata={"description": (
        "an argument with one value in at least this share of a tool's calls is a fixed parameter (default 0.95).")})
    min_parameter_calls: int = field(default=20, metadata={"description": (
        "arguments are read only from tools with at least this many calls (default 20).")})
    max_parameter_calls: int = field(default=2000, metadata={"description": (
        "arguments are read from at most this many calls of a tool (default 2000).")})


def constant_arguments(inputs: list[str | None], share: float) -> dict[str, object]:
    """The arguments that have one value in at least ``share`` of ``inputs`` (each a call's input
    as JSON text; calls whose input is not a JSON object count as lacking every argument)."""
    values: dict[str, Counter] = {}
    for text in inputs:
        try:
            arguments = json.loads(text) if text else None
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            continue
        for key, value in arguments.items():
            values.setdefault(key, Counter())[json.dumps(value, sort_keys=True)] += 1
    fixed = {}
    for key, counts in sorted(values.items()):
        value, n = counts.most_common(1)[0]
        if n >= share * len(inputs):
            fixed[key] = json.loads(value)
    return fixed


def derive_workflows(
    steps: pl.LazyFrame, trajectories: pl.LazyFrame, config: DeriveConfig = DeriveConfig()
) -> list[WorkflowDefinition]:
    """One version-1 definition per agent that called at least one tool often enough, sorted by
    agent id; ``metadata.derived`` records what it was derived from.

    Args:
        steps: the lake's ``steps`` rows with their ``batch`` column.
        trajectories: the lake's ``trajectories`` rows of the same batches, with ``batch``.
        config: thresholds (:class:`DeriveConfig`).
    """
    calls = tool_calls(steps, trajectories, StepStatsConfig())
    per_tool = (
        trajectory_tools(calls)
        .group_by("agent_id", "tool")
        .agg(n=pl.len(), calls=pl.col("n_calls").sum(), order=pl.col("first_share").median())
        .collect(engine="streaming")
    )
    totals = dict(outcomes(trajectories).group_by("agent_id").len().collect(engine="streaming").iter_rows())
    sample = (
        calls.filter(pl.int_range(pl.len()).over("agent_id", "tool") < config.max_parameter_calls)
        .group_by("agent_id", "tool")
        .agg(pl.col("input"))
        .collect(engine="streaming")
    )
    inputs = {(a, t): i for a, t, i in sample.iter_rows()}
    definitions = []
    for agent_id, rows in sorted(per_tool.group_by("agent_id"), key=lambda g: g[0][0]):
        agent_id = agent_id[0]
        n_agent = totals[agent_id]
        kept = rows.filter(pl.col("n") >= config.min_trajectories).sort(["order", "n", "tool"], descending=[False, True, False])
        workflow_steps = []
        for tool, n, n_calls, order in kept.select("tool", "n", "calls", "order").iter_rows():
            share = n / n_agent
            parameters = (
                constant_arguments(inputs[(agent_id, tool)], config.constant_share) if n_calls >= config.min_parameter_calls else {}
            )
            workflow_steps.append(
                WorkflowStep(
                    id=tool,
                    tool=tool,
                    parameters=parameters,
                    optional=share < config.required_share,
                    description=f"derived: called in {n} of {n_agent} trajectories ({share:.0%}), {n_calls} calls; "
                    f"first call at relative position {order:.2f} (median, 0 = first tool, 1 = last)",
                )
            )
        if workflow_steps:
            definitions.append(
                WorkflowDefinition(
                    agent_id=agent_id,
                    steps=workflow_steps,
                    metadata={"derived": {"trajectories": n_agent, "tools_seen": rows.height, "config": asdict(config)}},
                )
            )
    return definitions
