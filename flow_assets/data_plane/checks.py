"""The blocking data checks a batch must pass before it is trained on, and the one decision
every path to training reads (``training_round_sensor``, the self-play sensor and the training
API's ``training.start_grpo`` / ``training.resume``): which of them failed for a batch.

Pure reads of the Dagster instance, no asset or job imports, so the API process can use it
without loading the asset graph.
"""

from dagster import AssetKey, AssetRecordsFilter, DagsterEventType, DagsterInstance

#: the asset checks of ``advantages`` that block training (``flow_assets.data_plane.assets``)
DATA_CHECKS = ("advantages_finite", "records_conserved")


def failed_data_checks(instance: DagsterInstance, key: str) -> list[str]:
    """Names of the blocking data checks (:data:`DATA_CHECKS`) that failed in the run that last
    materialised batch ``key``'s ``advantages`` (empty when they passed or it was never
    materialised), sorted."""
    records = instance.fetch_materializations(AssetRecordsFilter(asset_key=AssetKey("advantages"), asset_partitions=[key]), limit=1).records
    if not records:
        return []
    failed = []
    for entry in instance.all_logs(records[0].run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION):
        evaluation = entry.dagster_event.event_specific_data
        if evaluation.check_name in DATA_CHECKS and not evaluation.passed:
            failed.append(evaluation.check_name)
    return sorted(set(failed))
