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
