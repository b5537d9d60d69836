"""The round's typed hand-offs: written and read back unchanged; the gate re-checked from them."""

from flow_assets.rl.gate import GateConfig, GateResult
from flow_assets.training.rounds import (
    EvaluationResult,
    RoundSummary,
    gate_results,
    read_evaluation,
    read_round_summary,
    write_evaluation,
    write_round_summary,
)

REPORT = {
    "sampled": {
        "gain": 0.1, "n_tasks": 10, "mcnemar": {"p_value": 0.2},
        "candidate": {"success_rate": {"rate": 0.6}}, "champion": {"success_rate": {"rate": 0.5}},
    }
}  # fmt: skip


def _summary(**changes) -> RoundSummary:
    fields = dict(
        batch="b", parent_version="v1", parent_adapter="/a/v1", candidate_adapter="/r/b/adapter", losses=[0.5, 0.25],
        grad_norms=[1.0, 0.5], kl_to_behaviour=0.01, num_samples=8, dropped_zero_advantage=2, resumed_from=None,
        final_step=2, training_seconds=1.5, reward_mean=0.4, reward_std=0.2, zero_variance_share=0.25,
        negate_advantages=False, config={"learning_rate": 0.001},
    )  # fmt: skip
    return RoundSummary(**{**fields, **changes})


def test_round_files_round_trip(tmp_path):
    summary = _summary()
    write_round_summary(summary, tmp_path)
    assert read_round_summary(tmp_path) == summary
    gate = GateConfig(min_gain=0.05)
    result = EvaluationResult(REPORT, gate, gate_results(summary, REPORT, gate), 3.0)
    write_evaluation(result, tmp_path)
    assert read_evaluation(tmp_path) == result and result.passed


def test_gate_results_name_what_failed():
    results = gate_results(_summary(losses=[float("nan")], kl_to_behaviour=2.0), REPORT, GateConfig(min_gain=0.2))
    assert [(r.name, r.passed) for r in results] == [("gain", False), ("finite_loss", False), ("kl_bound", False)]
    assert all(isinstance(r, GateResult) and r.reason for r in results)
