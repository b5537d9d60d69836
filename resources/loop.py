"""The training loop's settings: self-play rounds and the run config sensors launch runs with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dagster import ConfigurableResource
from pydantic import Field

from flow_assets.settings import UPDATE_RULES
from flow_assets.training.run_config import TRAINING_JOB, round_settings

#: the jobs whose runs the sensors launch, i.e. the keys a run-config file may have
LOOP_JOBS = ("base_policy_job", "collect_rollouts_job", "log_batch_job", "training_round_job", "training_history_job", "prompt_round_job")


class TrainingLoop(ConfigurableResource):
    """How the deployment's sensors drive training.

    Attributes:
        self_play_rounds: rounds ``self_play_sensor`` runs on its own: it builds the base policy
            if there is no champion, then collects a batch of the champion's rollouts on the task
            source whenever the previous batch's round has finished, until this many rounds are
            done. 0 (the default): off; batches then come only from logs that land.
        sources: agents other than the task source's own whose logged flows train the policy,
            with their update rule (``"awr"``: advantage-weighted likelihood, for another model's
            flows; ``"grpo"``: the policy's own text logged under another agent id); the task
            source's own agent always trains with ``"grpo"``. Empty by default.
        run_config_path: a JSON file ``{job name: run config}`` (keys from :data:`LOOP_JOBS`)
            that the sensors attach to the runs they request, e.g. the gate's ``max_tasks`` or
            the trainer's learning rate; ``None``: every job's defaults. Its
            ``training_round_job`` entry is read back through
            :func:`flow_assets.training.run_config.round_settings` and rebuilt by
            :func:`~flow_assets.training.run_config.round_run_config`, so a wrong or renamed field is
            refused when the file is read, naming the file.
        training_workers: 0 (default): a LoRA round's update runs in the run's own process; N:
            data-parallel on N Ray Train workers (:mod:`flow_assets.cluster.ray_training`).
        rollout_workers: 0 (default): a LoRA round's rollout collection and held-out evaluation
            run in the run's own process; N: over N Ray rollout workers
            (:mod:`flow_assets.cluster.ray_rollouts`).
        ray_address: the Ray cluster they run on; empty: a local one started by the run.
        round_schedule: the kinds of round a hosted policy cycles through
            (:func:`flow_assets.policy.prompt.next_round_kind`); ``["adapter"]`` by default.
    """

    self_play_rounds: int = Field(0, description="rounds self_play_sensor runs on its own (0: off)")
    sources: dict[str, str] = Field(
        default_factory=dict,
        description="agent_id -> update rule (awr: another model's flows; grpo: the policy's own text under another id) "
        "for agents besides the task source's own, whose batches then train the policy too",
    )
    run_config_path: str | None = Field(None, description="JSON file {job name: run config} the sensors launch runs with")
    training_workers: int = Field(0, ge=0, description="data-parallel Ray Train workers of a LoRA round's update (0: in the run's process)")
    rollout_workers: int = Field(0, ge=0, description="Ray rollout workers (gateway replicas) of a LoRA round's collection and held-out evaluation (0: in the run's process)")
    ray_address: str = Field("", description="the Ray cluster of those workers (empty: a local one the run starts)")
    round_schedule: list[str] = Field(
        default_factory=lambda: ["adapter"],
        description="the kinds of round (adapter / prompt) a hosted policy cycles through, one change per round; "
        "['prompt', 'adapter']: optimise the prompt, then train the adapter under it",
    )

    def update_rules(self, own_agent: str) -> dict[str, str]:
        """``agent_id -> update rule`` of every agent whose flows train the policy: :attr:`sources`
        and ``own_agent`` (always ``"grpo"``).

        Raises:
            ValueError: a rule other than ``"grpo"`` / ``"awr"``, or ``own_agent`` mapped to ``"awr"``.
        """
        for agent, rule in self.sources.items():
            if rule not in UPDATE_RULES:
                raise ValueError(f"training source {agent!r}: unknown update rule {rule!r} (one of {', '.join(UPDATE_RULES)})")
        if self.sources.get(own_agent, "grpo") != "grpo":
            raise ValueError(f"the policy's own agent {own_agent!r} trains with grpo (its token ids or its own text), not awr")
        return {**self.sources, own_agent: "grpo"}

    def run_config(self, job_name: str) -> dict[str, Any]:
        """The run config for ``job_name`` from :attr:`run_config_path` (``{}`` when none).

        Raises:
            ValueError: the file is not a JSON object of known job names to objects, or its
                ``training_round_job`` entry holds settings the round refuses (names the file and
                the key).
            OSError: the file cannot be read.
        """
        if not self.run_config_path:
            return {}
        path = Path(self.run_config_path)
        try:
            content = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from exc
        if not isinstance(content, dict):
            raise ValueError(f"{path}: expected an object {{job name: run config}}, got {type(content).__name__}")
        for key, value in content.items():
            if key not in LOOP_JOBS:
                raise ValueError(f"{path}: unknown job {key!r} (known: {', '.join(LOOP_JOBS)})")
            if not isinstance(value, dict):
                raise ValueError(f"{path}: the run config of {key!r} must be an object")
        if job_name == TRAINING_JOB and job_name in content:
            try:
                return round_settings(content[job_name]).run_config()
            except ValueError as exc:
                raise ValueError(f"{path}: {job_name}: {exc}") from None
        return content.get(job_name, {})
