"""A snapshot of what the Dagster UI shows of the code location: the lineage (every asset's
upstream), the checks and whether they block, and plain-text descriptions. A change to any of it
is a change users see, so it must be made here on purpose."""

import pytest

from flow_assets.definitions import build_definitions

LINEAGE = {
    "base_policy": [],
    "champion": ["base_policy"],
    "rollouts": ["champion"],
    "landed_logs": ["rollouts"],
    "interaction_logs": ["landed_logs"],
    "trajectories": ["interaction_logs"],
    "rewards": ["trajectories"],
    "advantages": ["rewards"],
    "policy_checkpoint": ["advantages", "champion"],
    "evaluation_report": ["policy_checkpoint"],
    "promoted_adapter": ["evaluation_report"],
    "training_history": ["promoted_adapter"],
    "prompt_candidate": ["advantages", "champion"],
    "prompt_evaluation": ["prompt_candidate"],
    "promoted_prompt": ["prompt_evaluation"],
    "ab_test_report": ["rewards"],
    "adapter_evaluation": ["champion"],
    "workflow_step_stats": ["trajectories"],
    "workflow_proposals": ["trajectories", "workflow_step_stats"],
}
CHECKS = {
    ("interaction_logs", "records_conserved"),
    ("advantages", "advantages_finite"),
    ("evaluation_report", "gain"),
    ("evaluation_report", "finite_loss"),
    ("evaluation_report", "kl_bound"),
    ("prompt_evaluation", "prompt_gate"),
    ("ab_test_report", "challenger_not_worse"),
    ("ab_test_report", "challenger_better"),
}
NOT_BLOCKING = {("ab_test_report", "challenger_better")}  # a warning while the live A/B keeps collecting
EXTERNAL = {"champion", "landed_logs"}  # Dagster records them, it does not compute them


@pytest.fixture(scope="module")
def defs(tmp_path_factory):
    root = tmp_path_factory.mktemp("specs")
    return build_definitions(str(root / "lake"), str(root / "landing"), models_root=str(root / "models"))


def test_lineage_is_the_loop_champion_rollouts_logs_round(defs):
    specs = {s.key.to_user_string(): s for s in defs.resolve_all_asset_specs()}
    assert {k: sorted(d.asset_key.to_user_string() for d in s.deps) for k, s in specs.items()} == LINEAGE
    graph = defs.resolve_asset_graph()
    assert {k.to_user_string() for k in graph.external_asset_keys} == EXTERNAL
    assert {s.group_name for k, s in specs.items() if k in ("interaction_logs", "advantages", "landed_logs")} == {"data_plane"}
    assert {s.group_name for k, s in specs.items() if k in ("base_policy", "champion", "rollouts", "promoted_adapter", "adapter_evaluation")} == {"training"}
    assert {s.group_name for k, s in specs.items() if k.startswith("workflow_")} == {"workflows"}
    assert {s.group_name for k, s in specs.items() if "prompt" in k} == {"prompt_policy"}


def test_every_gate_check_blocks_and_says_what_it_checks(defs):
    graph = defs.resolve_asset_graph()
    found = {(k.asset_key.to_user_string(), k.name) for k in graph.asset_check_keys}
    assert found == CHECKS
    for key in graph.asset_check_keys:
        spec = graph.get_check_spec(key)
        assert spec.blocking == ((key.asset_key.to_user_string(), key.name) not in NOT_BLOCKING), key
        assert spec.description and len(spec.description) > 40, key


def test_descriptions_are_plain_text_where_the_ui_shows_them(defs):
    repo = defs.get_repository_def()
    described = {s.key.to_user_string(): s.description for s in defs.resolve_all_asset_specs()}
    described |= {f"job {j.name}": j.description for j in repo.get_all_jobs() if not j.name.startswith("__")}
    described |= {f"sensor {s.name}": s.description for s in repo.sensor_defs}
    for name, text in described.items():
        assert text and text.strip(), f"{name} has no description"
        assert "``" not in text, f"{name}: reStructuredText markup shows literally in the UI: {text!r}"


def test_every_asset_has_an_owner_and_computed_assets_a_code_version_that_follows_their_source(defs, tmp_path):
    from flow_assets.core.versions import code_version

    graph = defs.resolve_asset_graph()
    for spec in defs.resolve_all_asset_specs():
        assert spec.owners and all(o.startswith("team:") for o in spec.owners), spec.key
        computed = spec.key not in graph.external_asset_keys
        assert (spec.code_version is not None) == computed, spec.key
        if computed:
            assert len(spec.code_version) == 12 and int(spec.code_version, 16) >= 0, spec.key
    versions = {s.key.to_user_string(): s.code_version for s in defs.resolve_all_asset_specs()}
    assert versions["advantages"] == code_version("flow_assets.rl.credit", "flow_assets.rl.advantages")  # order-free
    assert versions["advantages"] != versions["rewards"]
    # a changed source gives a changed version
    module = tmp_path / "flowopt_version_probe.py"
    module.write_text("x = 1\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        before = code_version("flowopt_version_probe")
        from flow_assets.core import versions as v

        v._module_files.cache_clear()
        module.write_text("x = 2\n")
        assert code_version("flowopt_version_probe") != before
    finally:
        sys.path.remove(str(tmp_path))


def test_the_jobs_that_load_a_model_are_tagged_for_the_run_launcher(defs):
    """Their runs wait for the warm launcher's fork server instead of importing torch beside it;
    the data plane's runs do not wait (flow_assets/runtime/run_launcher.py)."""
    from flow_assets.runtime.run_launcher import LOADS_MODELS_TAG

    tagged = {job.name for job in defs.resolve_all_job_defs() if job.run_tags.get(LOADS_MODELS_TAG) == "true"}
    assert tagged == {"base_policy_job", "collect_rollouts_job", "training_round_job", "prompt_round_job", "adapter_evaluation_job"}
