"""workflow_step_stats and workflow_proposals on a real Dagster instance: the real logs (tau-bench,
tau2, FireAct) ingested through the data plane, proposals stored for review, and the review done
through `flowopt proposals` as a person does it."""

import json

import pytest
from dagster import AssetKey, instance_for_test

from flow_assets.definitions import build_definitions
from flow_assets.logs.ingest import ingest_files, resolve_arguments
from flow_assets.workflows.definition import WorkflowStore
from flow_assets.workflows.review import ProposalBoard
from resources.lake import TrajectoryLake
from tests.conftest import SHARED_DATA, TAU_BENCH, run_cli
from tests.workflows.test_workflows import SYNTHETIC_AGENT, canonical_records, synthetic_workflow, with_synthetic_steps

#: one log of each real source (the unit tests read the others; ingesting all nine costs ~3x the time)
TAU2 = SHARED_DATA / "tau2-bench" / "claude-sonnet-4-5_aide-platform_2025-10-31" / "claude-sonnet-4-5_airline_default_gpt4.1_1trials.json"
REAL_LOGS = [TAU_BENCH, TAU2, next((SHARED_DATA / "fireact").glob("*llama-2-7b*.json"))]
REFLECT = ("fireact:llama-2-7b-lora", "remove_broken_step", "reflect")


class World:
    """A lake, landing, workflow directory and Dagster instance under one temporary root."""

    def __init__(self, root, instance):
        self.root, self.instance = root, instance
        self.lake = TrajectoryLake(root=str(root / "lake"))
        self.workflows = root / "workflows"
        self.defs = build_definitions(str(root / "lake"), str(root / "landing"), models_root=str(root / "models"), workflows_root=str(self.workflows))
        self.board = ProposalBoard(WorkflowStore(self.workflows))

    def ingest(self, paths) -> list[str]:
        results = ingest_files(resolve_arguments(paths), defs=self.defs, instance=self.instance, lake=self.lake, landing=self.root / "landing")
        assert [r.status for r in results] == ["ingested"] * len(results), [r.message for r in results]
        return [r.partition_key for r in results]

    def propose(self) -> dict:
        result = self.defs.resolve_job_def("workflow_proposals_job").execute_in_process(instance=self.instance)
        assert result.success
        return self.instance.get_latest_materialization_event(AssetKey("workflow_proposals")).asset_materialization.metadata

    def cli(self, *args: str) -> tuple[int, str, str]:
        return run_cli(["proposals", *args, "--workflows", str(self.workflows)])


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    root = tmp_path_factory.mktemp("workflows_real")
    (root / "home").mkdir()
    with instance_for_test(temp_dir=str(root / "home")) as instance:
        world = World(root, instance)
        world.keys = world.ingest(REAL_LOGS)
        world.first = world.propose()
        yield world


def test_every_real_batch_gets_step_statistics_through_the_data_plane(real):
    assert len(real.keys) == 3
    assert real.instance.get_materialized_partitions(AssetKey("workflow_step_stats")) == set(real.keys)
    assert sorted(real.lake.batches("workflow_step_stats")) == sorted(real.keys)
    tau = next(k for k in real.keys if k.startswith("tau-bench."))
    stats = real.lake.read_partition("workflow_step_stats", tau)
    assert stats["agent_id"].unique().to_list() == ["gpt-4o-airline"] and stats.height == 13  # the 13 tools it called
    records = real.instance.fetch_materializations(AssetKey("workflow_step_stats"), limit=20).records
    meta = next(r for r in records if r.partition_key == tau).asset_materialization.metadata
    assert meta["dagster/row_count"].value == 13 and meta["calls"].value == 1072 and meta["failed_calls"].value == 73
    assert "taken_minus_skipped_low" in [c.name for c in meta["dagster/column_schema"].schema.columns]


def test_on_the_real_logs_the_one_proposal_is_removing_a_tool_the_environment_lacks(real):
    meta = real.first
    assert meta["derived_definitions"].value == sorted(meta["agents"].value) and len(meta["agents"].value) == 3
    assert set(meta["agents"].value.values()) == {1}
    (proposal,) = real.board.find()
    assert (proposal.agent_id, proposal.rule, proposal.step_id) == REFLECT and proposal.status == "open"
    assert meta["dagster/row_count"].value == 1 and meta["open"].value == 1
    assert proposal.id in meta["proposals"].value and "| remove_broken_step | reflect |" in meta["proposals"].value
    assert '"op": "remove"' in meta["patches"].value and '"path": "/steps/1"' in meta["patches"].value
    pooled = meta["pooled_step_stats"].records  # one row per agent and tool, all batches together
    assert len(pooled) == 13 + 12 + 2 and {r.data["agent_id"] for r in pooled} == set(meta["agents"].value)


def test_nothing_changes_until_a_person_approves_through_the_cli(real):
    files = {p: p.read_bytes() for p in real.workflows.rglob("*.json") if "proposals" not in p.parts}
    again = real.propose()
    assert {p: p.read_bytes() for p in real.workflows.rglob("*.json") if "proposals" not in p.parts} == files
    assert again["new"].value == 0 and [e["action"] for e in real.board.audit()] == ["proposed"]
    (proposal,) = real.board.find()

    rc, out, err = real.cli("list")
    assert rc == 0 and proposal.id in out and "reflect" in out
    rc, out, _ = real.cli("show", proposal.id)
    shown = json.loads(out)
    assert rc == 0 and shown["applies_now"] is True and shown["current_version"] == 1 and shown["patch"] == proposal.patch
    rc, out, err = real.cli("approve", proposal.id, "--by", "alice", "--reason", "reflect is not a FireAct tool")
    assert rc == 0, err
    assert json.loads(out) | {"workflow": None} == {"proposal": proposal.id, "status": "applied", "agent_id": REFLECT[0], "version": 2,
                                                     "previous_version": 1, "workflow": None}  # fmt: skip
    store = real.board.store
    assert [s.id for s in store.current(REFLECT[0]).steps] == ["search"] and store.versions(REFLECT[0]) == [1, 2]
    rc, _, err = real.cli("approve", proposal.id)
    assert rc == 1 and "is applied, not open" in err
    rc, _, err = real.cli("reject", "wp-000000000000", "--reason", "no")
    assert rc == 2 and "no proposal" in err

    after = real.propose()  # version 2 has no reflect step: nothing left to propose
    assert after["agents"].value[REFLECT[0]] == 2 and after["dagster/row_count"].value == 0
    assert [e["action"] for e in real.board.audit()] == ["proposed", "approve", "refuse"] and real.board.verify_audit() == []


def test_a_hurting_step_in_a_synthetic_workflow_is_found_through_the_assets(tmp_path, dagster_instance):
    world = World(tmp_path, dagster_instance)
    WorkflowStore(world.workflows).register(synthetic_workflow(), by="test", reason="hand-written")
    landed = tmp_path / "synthetic" / "synthetic-airline.jsonl"
    landed.parent.mkdir()
    landed.write_text("\n".join(with_synthetic_steps(canonical_records(TAU_BENCH))) + "\n")
    world.ingest([landed])
    meta = world.propose()
    assert meta["derived_definitions"].value == []  # the hand-written definition is used as it is
    (proposal,) = world.board.find()
    assert (proposal.agent_id, proposal.rule, proposal.step_id) == (SYNTHETIC_AGENT, "remove_step", "hurting_step")
    rc, out, err = world.cli("reject", proposal.id, "--by", "bob", "--reason", "keep it for the audit trail")
    assert rc == 0 and json.loads(out)["status"] == "rejected"
    assert WorkflowStore(world.workflows).versions(SYNTHETIC_AGENT) == [1]
