"""Jobs: what a sensor or a person launches."""

from dagster import AssetSelection, define_asset_job

from flow_assets.data_plane import data_plane_assets
from flow_assets.partitions import log_batches

#: One log batch through the data plane: interaction_logs -> trajectories -> rewards -> advantages.
log_batch_job = define_asset_job(
    "log_batch_job",
    selection=AssetSelection.assets(*data_plane_assets),
    partitions_def=log_batches,
    description="Parse, score and normalise one log batch.",
)

#: The base policy (tiny model + SFT warm start, or the user's model) and champion v0.
base_policy_job = define_asset_job("base_policy_job", selection=AssetSelection.assets("base_policy"))

#: One training round on one batch: train a candidate, evaluate it, promote it if the gate passes.
training_round_job = define_asset_job(
    "training_round_job",
    selection=AssetSelection.assets("policy_checkpoint", "evaluation_report", "promoted_adapter"),
    partitions_def=log_batches,
    description="GRPO round on one batch: checkpoint -> held-out evaluation -> gated promotion.",
)
