"""Jobs: what a sensor or a person launches."""

from dagster import AssetSelection, define_asset_job

from flow_assets.data_plane.assets import data_plane_assets
from flow_assets.core.partitions import adapter_versions, log_batches
from flow_assets.runtime.run_launcher import LOADS_MODELS_TAG
from flow_assets.workflows.assets import workflow_proposals, workflow_step_stats

#: on the runs of the jobs whose steps train or sample a model: the warm run launcher gives them a
#: worker forked from its fork server, waiting for the server if it is still importing
MODEL_RUN_TAGS = {LOADS_MODELS_TAG: "true"}

#: One log batch through the data plane: interaction_logs -> trajectories -> rewards -> advantages,
#: and the batch's workflow step statistics (a polars aggregation: tens of milliseconds).
log_batch_job = define_asset_job(
    "log_batch_job",
    selection=AssetSelection.assets(*data_plane_assets, workflow_step_stats),
    partitions_def=log_batches,
    description="Parse, score and normalise one log batch, and compute its workflow step statistics.",
)

#: The base policy (tiny model + SFT warm start, or the user's model) and champion v0.
base_policy_job = define_asset_job(
    "base_policy_job",
    selection=AssetSelection.assets("base_policy"),
    description="Build the base model (the tiny demo model with its SFT warm start, or the user's model) and register champion v0.",
    run_tags=MODEL_RUN_TAGS,
)

#: One batch of the champion's rollouts, landed for new_logs_sensor.
collect_rollouts_job = define_asset_job(
    "collect_rollouts_job",
    selection=AssetSelection.assets("rollouts"),
    description="The champion's agents work on a batch of train tasks; the batch lands for new_logs_sensor.",
    run_tags=MODEL_RUN_TAGS,
)

#: One training round on one batch: train a candidate, evaluate it, promote it if the gate passes.
training_round_job = define_asset_job(
    "training_round_job",
    selection=AssetSelection.assets("policy_checkpoint", "evaluation_report", "promoted_adapter"),
    partitions_def=log_batches,
    description="GRPO round on one batch: checkpoint -> held-out evaluation -> gated promotion.",
    run_tags=MODEL_RUN_TAGS,
)

#: One prompt-policy round on one batch: search a few-shot prompt, gate it on the held-out split, promote it if it passes.
prompt_round_job = define_asset_job(
    "prompt_round_job",
    selection=AssetSelection.assets("prompt_candidate", "prompt_evaluation", "promoted_prompt"),
    partitions_def=log_batches,
    description="Prompt-policy round on one batch (the champion is a prompt policy): candidate prompt -> held-out gate -> promotion.",
    run_tags=MODEL_RUN_TAGS,
)

#: The training history (one row per round), refreshed after every finished round.
training_history_job = define_asset_job(
    "training_history_job",
    selection=AssetSelection.assets("training_history"),
    description="Rebuild the training history: one row per round, with the success chart.",
)

#: The live A/B's report on one batch of live traffic (it reads every batch since the challenger started).
ab_test_job = define_asset_job(
    "ab_test_job",
    selection=AssetSelection.assets("ab_test_report"),
    partitions_def=log_batches,
    description="Test the challenger against the champion on live traffic, as of this batch.",
)

#: One registry version on the held-out split (``training.evaluate``).
adapter_evaluation_job = define_asset_job(
    "adapter_evaluation_job",
    selection=AssetSelection.assets("adapter_evaluation"),
    partitions_def=adapter_versions,
    description="Evaluate one registry version of the policy on the held-out tasks (success, reward, calls, with intervals).",
    run_tags=MODEL_RUN_TAGS,
)

#: Workflow proposals from every batch's steps, for a person to review (flowopt proposals).
workflow_proposals_job = define_asset_job(
    "workflow_proposals_job",
    selection=AssetSelection.assets(workflow_proposals),
    description="Propose workflow changes (JSON Patch with evidence) from the steps of every log batch; nothing is applied.",
)
