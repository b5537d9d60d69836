"""Workflow self-optimisation without Dagster: statistics, derivation, the proposal rules and the
review, on the real tau-bench and FireAct logs (parsed by the same readers as the data plane)."""

import hashlib
import json

import jsonpatch
import polars as pl
import pytest

from flow_assets.logs.chunks import read_chunks
from flow_assets.logs.tables import trajectory_tables
from flow_assets.rl.eval_stats import newcombe_interval, wilson_interval
from flow_assets.workflows.definition import StaleVersion, WorkflowDefinition, WorkflowStep, WorkflowStore, agent_file_stem
from flow_assets.workflows.derive import derive_workflows
from flow_assets.workflows.proposals import ProposalConfig, agent_logs, propose
from flow_assets.workflows.review import ProposalBoard, ReviewRefused
from flow_assets.workflows.stats import step_statistics
from tests.conftest import SHARED_DATA, TAU_BENCH

FIREACT_7B = next((SHARED_DATA / "fireact").glob("*llama-2-7b*.json"))
SYNTHETIC_AGENT = "synthetic-airline"


def canonical_records(path) -> list[str]:
    """The canonical JSON of every valid trajectory of a real log file."""
    with read_chunks(path) as stream:
        return [r for chunk in stream for r in chunk.valid["record_json"].to_list()]


def lake_frames(records: list[str], batch: str = "b1") -> tuple[pl.LazyFrame, pl.LazyFrame]:
    """``steps`` and ``trajectories`` as the lake holds them (with the ``batch`` column)."""
    traj, steps = trajectory_tables(records, "test")
    return steps.with_columns(batch=pl.lit(batch)).lazy(), traj.with_columns(batch=pl.lit(batch)).lazy()


def _tool_step(tool: str, arguments: dict | None = None) -> dict:
    return {"index": 0, "kind": "tool", "tool": tool, "input": arguments or {}, "output": "done", "status": "ok"}


def with_synthetic_steps(records: list[str]) -> list[str]:
    """The real tau-bench trajectories under agent ``synthetic-airline``, each with two tool steps
    added after its first step: ``hurting_tool`` in every failed trajectory and in one of every
    four successful ones (its presence goes with failure), ``neutral_tool`` where a hash of the
    trajectory id is odd (its presence is independent of the outcome)."""
    trajectories = [json.loads(r) for r in records]
    successes = sorted(t["trajectory_id"] for t in trajectories if t["outcome"]["success"])
    some_successes = set(successes[::4])
    out = []
    for t in trajectories:
        added = []
        if not t["outcome"]["success"] or t["trajectory_id"] in some_successes:
            added.append(_tool_step("hurting_tool"))
        if int(hashlib.sha256(t["trajectory_id"].encode()).hexdigest()[:8], 16) % 2:
            added.append(_tool_step("neutral_tool"))
        t["steps"][1:1] = added
        for index, step in enumerate(t["steps"]):
            step["index"] = index
        t["agent_id"] = SYNTHETIC_AGENT
        out.append(json.dumps(t))
    return out


def synthetic_workflow() -> WorkflowDefinition:
    """A hand-written workflow of the synthetic agent: two real tools and the two added ones."""
    return WorkflowDefinition(
        agent_id=SYNTHETIC_AGENT,
        steps=[
            WorkflowStep(id="lookup_user", tool="get_user_details"),
            WorkflowStep(id="hurting_step", tool="hurting_tool", optional=True),
            WorkflowStep(id="neutral_step", tool="neutral_tool", optional=True),
            WorkflowStep(id="lookup_reservation", tool="get_reservation_details", optional=True),
        ],
    )


@pytest.fixture(scope="module")
def tau_records() -> list[str]:
    return canonical_records(TAU_BENCH)


@pytest.fixture(scope="module")
def synthetic(tau_records):
    steps, traj = lake_frames(with_synthetic_steps(tau_records))
    stats = step_statistics(steps, traj)
    return steps, traj, stats, agent_logs(steps, traj, stats)[SYNTHETIC_AGENT]


@pytest.fixture
def board(tmp_path, synthetic) -> ProposalBoard:
    """A workflow directory holding the synthetic workflow (version 1) and its proposals."""
    store = WorkflowStore(tmp_path / "workflows")
    store.register(synthetic_workflow(), by="test", reason="hand-written")
    board = ProposalBoard(store)
    board.record(propose(store.current(SYNTHETIC_AGENT), synthetic[3]), [SYNTHETIC_AGENT])
    return board


# -- statistics -------------------------------------------------------------------------------
def test_step_statistics_of_tau_bench_count_calls_failures_and_outcomes(tau_records):
    stats = step_statistics(*lake_frames(tau_records))
    book = stats.filter(pl.col("tool") == "book_reservation").row(0, named=True)
    # gpt-4o-airline: 53 calls of book_reservation in 24 trajectories, 30 failed calls in 15 of them
    assert (book["agent_id"], book["calls"], book["errors"], book["taken_n"], book["failed_n"]) == ("gpt-4o-airline", 53, 30, 24, 15)
    assert (book["agent_trajectories"], book["skipped_n"]) == (200, 176)
    assert book["failure_reasons"].startswith("Error: payment amount does not add up, total price is #, but paid # (")
    assert book["call_success_rate"] == pytest.approx(23 / 53)
    assert (book["call_success_low"], book["call_success_high"]) == pytest.approx(wilson_interval(23, 53))
    # 1 of 24 trajectories that book succeed, 83 of the 176 that do not (84 successes in all)
    assert book["taken_success"] == pytest.approx(1 / 24) and book["skipped_success"] == pytest.approx(83 / 176)
    assert (book["taken_minus_skipped_low"], book["taken_minus_skipped_high"]) == pytest.approx(newcombe_interval(1, 24, 83, 176))
    assert book["latency_n"] == 0 and book["latency_p50_ms"] is None  # tau-bench logs no durations
    assert set(stats["tool"]) >= {"get_user_details", "get_reservation_details", "transfer_to_human_agents"}


def test_step_statistics_in_buckets_of_trajectories_equal_one_pass(tau_records, monkeypatch):
    """A large batch's per-trajectory view is computed in buckets of trajectories (bounded
    memory); the statistics are those of one pass, over two batches holding the same ids."""
    from flow_assets.workflows import stats as stats_module

    (s1, t1), (s2, t2) = lake_frames(tau_records, "b1"), lake_frames(tau_records[:120], "b2")
    steps, traj = pl.concat([s1, s2]), pl.concat([t1, t2])
    one_pass = step_statistics(steps, traj)
    monkeypatch.setattr(stats_module, "STEPS_PER_BUCKET", 300)
    assert steps.select(pl.len()).collect().item() > 5 * 300  # several buckets
    assert step_statistics(steps, traj).equals(one_pass)


def test_step_statistics_of_a_logged_latency_have_p50_below_p95(shared_data):
    files = sorted((shared_data / "tau2-bench").glob("*/*.json"))
    stats = step_statistics(*lake_frames(canonical_records(files[0])))
    timed = stats.filter(pl.col("latency_n") > 5)
    assert timed.height and (timed["latency_p50_ms"] <= timed["latency_p95_ms"]).all()


# -- derivation ---------------------------------------------------------------------------------
def test_a_derived_workflow_has_the_agents_tools_in_their_typical_order(tau_records):
    (definition,) = derive_workflows(*lake_frames(tau_records))
    ids = [s.id for s in definition.steps]
    assert definition.agent_id == "gpt-4o-airline" and definition.version == 1
    assert ids[0] == "get_user_details" and ids.index("get_reservation_details") < ids.index("book_reservation")
    assert len(ids) == 13  # the 13 tools called in at least 2 of the 200 trajectories
    book = definition.steps[ids.index("book_reservation")]
    assert book.optional and book.parameters == {"insurance": "no"}  # "no" in at least 95% of its 53 calls
    assert definition.metadata["derived"]["trajectories"] == 200


# -- rules ----------------------------------------------------------------------------------------
def test_a_step_whose_presence_goes_with_failure_is_proposed_for_removal_and_a_neutral_one_is_not(synthetic):
    definition = synthetic_workflow()
    (proposal,) = propose(definition, synthetic[3])
    assert (proposal.rule, proposal.step_id, proposal.base_version) == ("remove_step", "hurting_step", 1)
    assert proposal.patch == [{"op": "test", "path": "/steps/1/id", "value": "hurting_step"}, {"op": "remove", "path": "/steps/1"}]
    e = proposal.evidence
    assert e.comparison == "within_task" and e.family_size == 4 and e.level == pytest.approx(1 - 0.05 / 4)
    assert 0 < e.effect_low <= e.effect <= e.effect_high  # removing it raises success
    assert e.n_tasks >= 26 and e.n_trajectories == e.sides["taken"] + e.sides["skipped"]
    assert e.statistics["tool"] == "hurting_tool" and len(e.trajectories["taken"]) == min(50, e.sides["taken"])
    # the neutral step: not proposed even without the correction, and its interval straddles 0
    (alone,) = propose(definition, synthetic[3], ProposalConfig(familywise=False, min_effect=0.0))
    assert alone.step_id == "hurting_step"
    neutral = synthetic[2].filter(pl.col("tool") == "neutral_tool").row(0, named=True)
    assert neutral["taken_minus_skipped_low"] < 0 < neutral["taken_minus_skipped_high"]


def test_the_pooled_comparison_finds_the_hurting_step_and_one_the_tasks_confound(synthetic):
    user, hurting = propose(synthetic_workflow(), synthetic[3], ProposalConfig(comparison="pooled"))
    assert hurting.step_id == "hurting_step" and hurting.evidence.comparison == "pooled" and hurting.evidence.n_tasks is None
    assert hurting.evidence.n_trajectories == 200 and hurting.evidence.effect_low > 0
    # get_user_details is called on the harder tasks; within a task it makes no difference, so
    # only the pooled comparison (not the default) proposes removing it
    assert user.step_id == "lookup_user" and user.evidence.effect_low > 0


def test_below_the_minimum_of_evidence_nothing_is_proposed(synthetic):
    assert propose(synthetic_workflow(), synthetic[3], ProposalConfig(min_tasks=60)) == []
    assert propose(synthetic_workflow(), synthetic[3], ProposalConfig(comparison="pooled", min_trajectories=201)) == []
    assert propose(synthetic_workflow(), synthetic[3], ProposalConfig(min_effect=0.9)) == []


def test_a_tool_that_always_fails_is_proposed_for_removal(tmp_path):
    steps, traj = lake_frames(canonical_records(FIREACT_7B))
    stats = step_statistics(steps, traj)
    (definition,) = derive_workflows(steps, traj)
    assert [s.id for s in definition.steps] == ["search", "reflect"]
    (proposal,) = propose(definition, agent_logs(steps, traj, stats)[definition.agent_id])
    assert (proposal.rule, proposal.step_id) == ("remove_broken_step", "reflect")
    assert proposal.evidence.facts["errors"] == proposal.evidence.facts["calls"] == 26
    assert "Unknown tool name" in proposal.evidence.facts["failure_reasons"]
    # FireAct has one trajectory per question: no within-task comparison, the pooled one is shown
    assert proposal.evidence.comparison == "pooled" and proposal.evidence.sides == {"taken": 26, "skipped": 474}


def test_a_parameter_value_that_goes_with_success_is_proposed(tau_records):
    # the real trajectories, with get_user_details called with lookup="cache" where they failed
    # and lookup="live" where they succeeded
    records = []
    for text in tau_records:
        t = json.loads(text)
        for step in t["steps"]:
            if step.get("tool") == "get_user_details":
                step["input"] = {**step["input"], "lookup": "live" if t["outcome"]["success"] else "cache"}
        records.append(json.dumps(t))
    steps, traj = lake_frames(records)
    stats = step_statistics(steps, traj)
    definition = WorkflowDefinition(agent_id="gpt-4o-airline", steps=[WorkflowStep(id="user", tool="get_user_details", parameters={"lookup": "cache"})])
    (proposal,) = propose(definition, agent_logs(steps, traj, stats)["gpt-4o-airline"])
    assert proposal.rule == "change_parameter" and proposal.evidence.facts == {"parameter": "lookup", "from": "cache", "to": "live"}
    assert proposal.patch[-1] == {"op": "replace", "path": "/steps/0/parameters/lookup", "value": "live"}
    assert proposal.evidence.effect_low > 0
    patched = WorkflowDefinition.model_validate(jsonpatch.apply_patch(definition.document(), proposal.patch))
    assert patched.steps[0].parameters == {"lookup": "live"}


def test_patches_are_rfc6902_documents_that_apply_once(synthetic):
    definition = synthetic_workflow()
    for proposal in propose(definition, synthetic[3], ProposalConfig(comparison="pooled")):
        patch = jsonpatch.JsonPatch(proposal.patch)  # parses every operation and JSON Pointer
        for op in proposal.patch:  # RFC 6902, section 4: the members each operation needs
            assert op["op"] in ("add", "remove", "replace", "move", "copy", "test") and op["path"].startswith("/")
            assert ("value" in op) == (op["op"] in ("add", "replace", "test"))
        after = WorkflowDefinition.model_validate(patch.apply(definition.document()))
        assert proposal.step_id not in [s.id for s in after.steps] and len(after.steps) == 3
        with pytest.raises(jsonpatch.JsonPatchTestFailed):  # its test operation guards the second time
            patch.apply(after.document())


# -- store and review ----------------------------------------------------------------------------
def test_the_store_keeps_every_version_and_refuses_a_stale_base(tmp_path):
    store = WorkflowStore(tmp_path)
    first, created = store.register(synthetic_workflow(), by="test", reason="first")
    assert created and first.version == 1 and store.register(synthetic_workflow(), by="test", reason="again") == (first, False)
    second = store.save(first.model_copy(update={"steps": first.steps[:2]}), by="test", reason="shorter", base_version=1)
    assert (second.version, second.change.previous_version, store.versions(SYNTHETIC_AGENT)) == (2, 1, [1, 2])
    assert len(store.get(SYNTHETIC_AGENT, 1).steps) == 4 and store.current(SYNTHETIC_AGENT) == second
    with pytest.raises(StaleVersion, match="against version 1.*current version is 2"):
        store.save(first, by="test", reason="late", base_version=1)
    assert store.agents() == [SYNTHETIC_AGENT] and not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))
    assert agent_file_stem("gpt-4o-airline") == "gpt-4o-airline"
    assert agent_file_stem("a:b") != agent_file_stem("a/b") and "/" not in agent_file_stem("a/b")


def test_approval_applies_the_patch_as_a_new_version_and_keeps_the_previous(board):
    (proposal,) = board.find(status="open")
    before = board.store.path(SYNTHETIC_AGENT).read_bytes()
    applied, saved = board.approve(proposal.id, by="alice", reason="it hurts")
    assert applied.status == "applied" and applied.review.by == "alice" and applied.review.new_version == 2
    assert [s.id for s in saved.steps] == ["lookup_user", "neutral_step", "lookup_reservation"]
    assert saved.change.proposal_id == proposal.id and saved.change.by == "alice"
    assert board.store.get(SYNTHETIC_AGENT, 1).document() == WorkflowDefinition.model_validate_json(before).document()
    assert board.get(proposal.id).status == "applied"
    with pytest.raises(ReviewRefused, match="is applied, not open"):
        board.approve(proposal.id, by="bob")
    assert board.store.versions(SYNTHETIC_AGENT) == [1, 2]


def test_rejection_needs_a_reason_and_changes_no_workflow(board):
    (proposal,) = board.find(status="open")
    before = board.store.path(SYNTHETIC_AGENT).read_bytes()
    with pytest.raises(ReviewRefused, match="needs a reason"):
        board.reject(proposal.id, by="bob", reason=" ")
    rejected = board.reject(proposal.id, by="bob", reason="we need that step for compliance")
    assert (rejected.status, rejected.review.reason) == ("rejected", "we need that step for compliance")
    assert board.store.path(SYNTHETIC_AGENT).read_bytes() == before and board.store.versions(SYNTHETIC_AGENT) == [1]
    with pytest.raises(ReviewRefused, match="is rejected"):
        board.approve(proposal.id, by="bob")


def test_a_proposal_made_against_an_older_version_is_refused_as_stale(board):
    (proposal,) = board.find(status="open")
    current = board.store.current(SYNTHETIC_AGENT)
    board.store.save(current.model_copy(update={"steps": list(reversed(current.steps))}), by="carol", reason="reordered by hand", base_version=1)
    with pytest.raises(ReviewRefused, match="made against version 1 .* now at version 2"):
        board.approve(proposal.id, by="alice")
    assert board.get(proposal.id).status == "stale" and board.store.versions(SYNTHETIC_AGENT) == [1, 2]
    assert "stale" in board.audit()[-1]["reason"] and board.audit()[-1]["action"] == "refuse"


def test_a_patch_that_conflicts_with_the_current_version_is_refused_with_the_reason(board):
    (proposal,) = board.find(status="open")
    # the same base version, but the patch removes a step that is not at that position
    conflicting = proposal.model_copy(update={"id": "wp-conflict000", "patch": [{"op": "test", "path": "/steps/2/id", "value": "hurting_step"},
                                                                                {"op": "remove", "path": "/steps/2"}]})  # fmt: skip
    missing = proposal.model_copy(update={"id": "wp-missing0000", "patch": [{"op": "remove", "path": "/steps/9"}]})
    outside = proposal.model_copy(update={"id": "wp-outside0000", "patch": [{"op": "replace", "path": "/version", "value": 7}]})
    board.record([conflicting, missing, outside, proposal], [SYNTHETIC_AGENT])
    for bad, reason in [(conflicting, "does not apply to version 1"), (missing, "does not apply to version 1"), (outside, "may change only /steps")]:
        assert reason in board.check(bad.id)
        with pytest.raises(ReviewRefused, match=reason):
            board.approve(bad.id, by="alice")
        assert board.get(bad.id).status == "stale"
    assert board.store.versions(SYNTHETIC_AGENT) == [1] and board.check(proposal.id) is None


def test_the_audit_log_only_grows_and_its_chain_shows_an_edit(board):
    (proposal,) = board.find(status="open")
    seen = board.audit_path.read_bytes()
    for action in (lambda: board.reject(proposal.id, by="bob", reason="not now"), lambda: board.approve(proposal.id, by="alice")):
        try:
            action()
        except ReviewRefused:
            pass
        now = board.audit_path.read_bytes()
        assert now.startswith(seen) and len(now) > len(seen)
        seen = now
    entries = board.audit()
    assert [e["action"] for e in entries] == ["proposed", "reject", "refuse"]
    assert entries[1]["by"] == "bob" and entries[1]["reason"] == "not now" and entries[1]["at"].endswith("Z")
    assert board.verify_audit() == []
    lines = board.audit_path.read_bytes().splitlines(keepends=True)
    board.audit_path.write_bytes(lines[0] + lines[1].replace(b"not now", b"never") + lines[2])
    problems = board.verify_audit()
    assert problems and problems[0].startswith(f"{board.audit_path}, line 2:")  # the edited line comes first
    assert any("line 3: prev does not match" in p for p in problems)


def _decided_board(board) -> list[bytes]:
    """``board`` with one rejected proposal and a later one applied; its log's lines."""
    (proposal,) = board.find(status="open")
    board.record([proposal, proposal.model_copy(update={"id": "wp-second00000"})], [SYNTHETIC_AGENT])
    board.approve("wp-second00000", by="alice", reason="fine")
    board.reject(proposal.id, by="bob", reason="not now")
    assert board.verify_audit() == []
    return board.audit_path.read_bytes().splitlines(keepends=True)


def _rechain(lines: list[bytes]) -> list[bytes]:
    """The lines with every ``prev`` recomputed, as someone covering an edit would."""
    out, prev = [], ""
    for line in lines:
        entry = json.loads(line)
        entry["prev"] = prev
        text = json.dumps(entry, ensure_ascii=False, sort_keys=True).encode()
        prev = hashlib.sha256(text).hexdigest()
        out.append(text + b"\n")
    return out


def test_verify_audit_shows_an_edit_of_the_last_line(board):
    lines = _decided_board(board)
    board.audit_path.write_bytes(b"".join(lines[:-1]) + lines[-1].replace(b'"by": "bob"', b'"by": "eve"'))
    problems = board.verify_audit()  # the old check passed this: no line follows the last one
    assert problems and problems[0].startswith(f"{board.audit_path}, line {len(lines)}:"), problems


def test_verify_audit_shows_a_deleted_tail(board):
    lines = _decided_board(board)
    board.audit_path.write_bytes(b"".join(lines[:-2]))
    problems = board.verify_audit()
    assert problems and f"line {len(lines) - 1}: missing" in problems[0] and f"records {len(lines)} lines" in problems[0], problems


def test_verify_audit_shows_a_chain_recomputed_after_an_edit_head_included(board):
    lines = _decided_board(board)
    # alice's approval rewritten as bob's, every prev recomputed, the head file forged to match
    forged = _rechain([line.replace(b'"by": "alice"', b'"by": "bob"') for line in lines])
    board.audit_path.write_bytes(b"".join(forged))
    board.head_path.write_text(json.dumps({"lines": len(forged), "sha256": hashlib.sha256(forged[-1].rstrip(b"\n")).hexdigest()}))
    problems = board.verify_audit()
    approve_line = next(n for n, line in enumerate(lines, start=1) if b'"action": "approve"' in line)
    assert problems and problems[0].startswith(f"{board.audit_path}, line {approve_line}:"), problems
    assert "wp-second00000.json keeps sha256" in problems[0]


def test_verify_audit_reports_a_line_that_is_not_json_and_the_cli_exits_1_naming_it(board):
    from tests.conftest import run_cli

    lines = _decided_board(board)
    board.audit_path.write_bytes(lines[0] + b"{not json\n" + b"".join(lines[1:]))
    problems = board.verify_audit()  # the old check raised JSONDecodeError here
    assert problems[0].startswith(f"{board.audit_path}, line 2: not a JSON object"), problems
    assert [e["action"] for e in board.audit()][:2] == ["proposed", "proposed"]  # the rest is still read
    rc, out, err = run_cli(["proposals", "verify", "--workflows", board.store.root])
    assert rc == 1 and "Traceback" not in err and err.splitlines()[0].endswith(problems[0]) and not json.loads(out)["intact"]
    board.audit_path.write_bytes(b"".join(lines))
    rc, out, err = run_cli(["proposals", "verify", "--workflows", board.store.root])
    assert rc == 0 and json.loads(out)["intact"] and err == ""


def test_a_decided_proposal_edited_back_to_open_cannot_be_decided_again(board):
    (proposal,) = board.find(status="open")
    board.approve(proposal.id, by="alice")
    path = board.proposals_dir / f"{proposal.id}.json"
    reopened = json.loads(path.read_text()) | {"status": "open", "review": None}
    path.write_text(json.dumps(reopened))
    # the old code took this for a crash after the save and recorded bob's approval too
    with pytest.raises(ReviewRefused, match="is applied, not open: the audit log records its approval by alice"):
        board.approve(proposal.id, by="bob")
    assert board.get(proposal.id).status == "applied" and board.get(proposal.id).review.by == "alice"
    path.write_text(json.dumps(reopened))
    with pytest.raises(ReviewRefused, match="is applied"):
        board.reject(proposal.id, by="bob", reason="changed my mind")
    assert [e["action"] for e in board.audit()] == ["proposed", "approve", "refuse", "refuse"]
    assert board.store.versions(SYNTHETIC_AGENT) == [1, 2] and board.verify_audit() == []


def test_recording_proposals_again_changes_no_workflow_and_keeps_reviews(board, synthetic):
    files = {p: p.read_bytes() for p in board.store.root.rglob("*.json") if "proposals" not in p.parts}
    (proposal,) = board.find(status="open")
    board.reject(proposal.id, by="bob", reason="later")
    again = propose(board.store.current(SYNTHETIC_AGENT), synthetic[3])
    summary = board.record(again, [SYNTHETIC_AGENT])
    assert (summary.new, summary.kept) == ([], [proposal.id]) and board.get(proposal.id).status == "rejected"
    assert {p: p.read_bytes() for p in board.store.root.rglob("*.json") if "proposals" not in p.parts} == files
    # a run that no longer makes an open proposal marks it superseded, and says so in the log
    board.record([proposal.model_copy(update={"id": "wp-other000000", "status": "open", "review": None})], [SYNTHETIC_AGENT])
    assert board.record([], [SYNTHETIC_AGENT]).superseded == ["wp-other000000"]
    assert board.get("wp-other000000").status == "superseded" and board.audit()[-1]["action"] == "superseded"
