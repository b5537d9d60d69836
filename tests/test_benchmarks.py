"""Every benchmark still runs: once each, at its smallest size (``--quick``), with every figure
present and sane. No timing is asserted: speed goals are reported by ``make bench``, never pass/fail."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import collection, data_plane, gateway, sample_efficiency, scale_out, trainer_vs_trl, training_round
from benchmarks.__main__ import main as bench_main
from benchmarks.common import linear_fit, ratio, scaling_exponent, summarize

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The benchmarks' default (see benchmarks/common.py), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def assert_summary(s: dict, n: int | None = None) -> None:
    assert {"median", "q1", "q3", "iqr", "min", "max", "n", "values"} <= s.keys()
    assert s["min"] <= s["q1"] <= s["median"] <= s["q3"] <= s["max"]
    assert s["n"] == len(s["values"]) and (n is None or s["n"] == n)


def assert_headline(result: dict) -> None:
    assert result["headline"], "every benchmark reports headline figures"
    for row in result["headline"]:
        assert row["figure"] and "value" in row and row["value"] is not None


def test_summarize_gives_median_quartiles_and_range():
    s = summarize([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (s["median"], s["q1"], s["q3"], s["iqr"], s["min"], s["max"], s["n"]) == (3.0, 2.0, 4.0, 2.0, 1.0, 5.0, 5)
    assert summarize([7.0])["iqr"] == 0.0


def test_linear_time_has_exponent_one_and_fit_recovers_the_line():
    xs = [1e3, 4e3, 16e3]
    assert scaling_exponent(xs, [2 * x for x in xs]) == pytest.approx(1.0)
    fit = linear_fit(xs, [5 + 0.5 * x for x in xs])
    assert fit["slope"] == pytest.approx(0.5) and fit["intercept"] == pytest.approx(5) and fit["r2"] == pytest.approx(1.0)
    assert math.isnan(ratio(1.0, 0.0))


def test_replicated_batch_keeps_real_records_with_new_ids(tmp_path):
    records = data_plane.real_records()
    out = data_plane.write_replicated(records, 20_000, tmp_path / "batch.jsonl")
    lines = (tmp_path / "batch.jsonl").read_bytes().splitlines()
    assert out["steps"] >= 20_000 and out["trajectories"] == len(lines) > len(records)
    ids = [json.loads(line)["trajectory_id"] for line in lines]
    assert len(set(ids)) == len(ids)


def test_a_size_the_disk_cannot_hold_is_named_not_attempted(tmp_path):
    records = data_plane.real_records()
    assert data_plane.disk_shortfall(records, 1_000, tmp_path) is None
    reason = data_plane.disk_shortfall(records, 10**12, tmp_path)  # ~600 TB of JSON
    assert reason is not None and "GiB of disk" in reason and str(tmp_path) in reason


def test_floor_decodes_every_record_line(tmp_path):
    out = data_plane.write_replicated(data_plane.real_records(), 5_000, tmp_path / "batch.jsonl")
    with (tmp_path / "batch.jsonl").open("ab") as handle:
        handle.write(b"\n  \n")  # blank lines are not records
    for loads in data_plane.json_readers().values():
        assert data_plane.decode_all(tmp_path / "batch.jsonl", loads) == out["trajectories"]
    size = (tmp_path / "batch.jsonl").stat().st_size
    assert data_plane.read_through(tmp_path / "batch.jsonl", block=4096) == size


def test_data_plane_quick_reports_every_size_and_the_floor_ratio():
    result = data_plane.run(quick=True)
    assert [s["steps"] >= target for s, target in zip(result["sizes"], data_plane.QUICK_SIZES)] == [True, True]
    for size in result["sizes"]:
        assert_summary(size["job_seconds"], n=1)
        assert set(size["asset_seconds"]) == {"interaction_logs", "trajectories", "rewards", "advantages", "workflow_step_stats"}
        for key in ("trajectories_per_second", "steps_per_second", "ratio_to_floor", "seconds_per_million_steps"):
            assert positive(size[key]), key
        assert size["peak_rss_mb"]["median"] > size["baseline_rss_mb"]["median"] > 0
        assert size["floor"]["reader"] in data_plane.json_readers()
    assert math.isfinite(result["scaling"]["loglog_exponent"])
    assert result["skipped"] == [] and math.isfinite(result["scaling"]["peak_rss_exponent"])
    assert_headline(result)


def test_trainer_vs_trl_quick_times_both_sides_in_both_modes():
    result = trainer_vs_trl.run(quick=True)
    assert set(result["modes"]) == {"full", "lora", "smollm2_lora"}
    assert "skipped" in result["modes"].pop("smollm2_lora")  # minutes per step: full runs only
    for mode, res in result["modes"].items():
        for side in ("flowopt", "trl"):
            assert "error" not in res[side], f"{mode}/{side}: {res[side].get('error')}"
            for part in ("step", "train", "generation"):
                assert_summary(res[side][f"{part}_seconds"], n=trainer_vs_trl.QUICK_STEPS)
            assert res[side]["step_seconds"]["min"] > 0
            assert positive(res[side]["completions_per_second"])
        assert all(positive(r) for r in res["ratio_flowopt_over_trl"].values())
    assert_headline(result)


def test_collection_quick_compares_eight_rollouts_with_one_and_all_batch_sizes():
    result = collection.run(quick=True)
    pair = result["group_vs_single"]
    assert positive(pair["ratio_8_over_1"]) and isinstance(pair["meets_goal"], bool)
    assert set(result["by_batch_size"]) == {"8", "64", "256"}
    for b, r in result["by_batch_size"].items():
        assert r["completions"] == int(b) and positive(r["completions_per_second"]) and positive(r["tokens_per_second"])
    assert_headline(result)


def test_gateway_quick_compares_agents_overhead_and_throughput():
    result = gateway.run(quick=True)
    pair = result["agents_8_vs_1"]
    assert positive(pair["ratio_8_over_1"]) and isinstance(pair["meets_goal"], bool)
    assert positive(result["overhead"]["gateway_seconds"]["median"]) and positive(result["overhead"]["in_process_seconds"]["median"])
    assert set(result["throughput"]) == {"8", "64", "256"}
    for c, r in result["throughput"].items():
        assert r["completions"] >= int(c) and positive(r["completions_per_second"])
        assert 1 <= r["mean_rows_per_generation"] <= int(c)  # batched, never more rows than agents
    for mode in ("plain", "streamed"):
        first, last = (result["streaming"][mode][k]["median"] for k in ("first_token_seconds", "last_token_seconds"))
        assert 0 < first <= last
    # not streamed, the first token arrives with the last
    assert result["streaming"]["plain"]["first_token_seconds"] == result["streaming"]["plain"]["last_token_seconds"]
    assert all(positive(result["constrained"]["ms_per_token"][k]["median"]) for k in ("constrained", "unconstrained"))
    assert_headline(result)


def test_training_round_quick_splits_the_wall_time():
    result = training_round.run(quick=True)
    assert len(result["rounds"]) == 1
    round_ = result["rounds"][0]
    for part in ("collection_generation", "training", "evaluation"):
        assert positive(round_[part]), part
    parts = sum(round_[p] for p in training_round.PARTS)
    assert parts == pytest.approx(round_["wall"])
    assert round_["dagster_overhead"] > 0 and round_["other_asset_work"] > 0
    # the same round launched by a real dagster-daemon, split the same way
    (daemon,) = result["daemon"]["rounds"]
    for part in ("collection_generation", "training", "evaluation"):
        assert positive(daemon[part]), part
    assert sum(daemon[p] for p in training_round.PARTS) == pytest.approx(daemon["wall"])
    assert daemon["dagster_overhead"] > 0
    assert {k.split(".")[0] for k in daemon["step_seconds"]} == {"collect_rollouts_job", "log_batch_job", "training_round_job"}
    assert 0 < result["daemon"]["orchestration_share"] < 1 and 0 < result["orchestration_share"] < 1
    assert positive(result["peak_rss_mb"])
    assert_headline(result)


def test_sample_efficiency_quick_gives_a_curve_and_a_plateau():
    result = sample_efficiency.run(quick=True)
    (curve,) = result["curves"]
    assert [p["trajectories"] for p in curve["points"]] == [0, sample_efficiency.TASKS_PER_ROUND * sample_efficiency.GROUP]
    assert all(0.0 <= p["sampled"] <= 1.0 and 0.0 <= p["greedy"] <= 1.0 for p in curve["points"])
    assert curve["plateau"]["trajectories"] in (None, 0, 512)
    assert result["summary"]["seeds"] == 1
    assert result["headline"][0]["value"] is not None


def test_scale_out_quick_times_the_collection_and_update_in_process_and_on_ray_workers():
    result = scale_out.run(quick=True)
    assert positive(result["in_process"]["median"]) and "ray_1" not in result
    ray = result["ray_2"]
    assert positive(ray["wall_s"]["median"]) and positive(ray["training_s"]["median"])
    # the driver, its local cluster and the worker group come on top of rank 0's own training
    assert ray["overhead_s"]["median"] == pytest.approx(ray["wall_s"]["median"] - ray["training_s"]["median"])
    assert ray["overhead_s"]["median"] > 0
    collected = result["collection"]  # 16 rollouts landed in process (a quick run starts no second cluster to collect)
    assert collected["rollouts"] == 16 and set(collected) == {"rollouts", "in_process"}
    assert positive(collected["in_process"]["median"])
    assert_headline(result)


def test_the_gpu_projection_follows_its_formula():
    a = dict(scale_out.GPU_ASSUMPTIONS, round_fixed_s=0.0)
    plan = scale_out.projection(a, gpus=(1, 4, 16))
    compute = a["flops_per_token"] * a["model_params"] * a["tokens_per_step"] / (a["gpu_flops"] * a["mfu"])
    assert plan[1]["step_s"] == pytest.approx(compute) and plan[1]["allreduce_s"] == 0.0
    # ring all-reduce: 2 (M - 1) / M of the gradient bytes over the link, NVLink within a node, Ethernet across
    grad = a["lora_params"] * a["grad_bytes_per_param"]
    assert plan[4]["allreduce_s"] == pytest.approx(2 * 3 / 4 * grad / a["nvlink_bytes_per_s"])
    assert plan[16]["allreduce_s"] == pytest.approx(2 * 15 / 16 * grad / a["ethernet_bytes_per_s"])
    assert plan[4]["speedup"] == pytest.approx(compute / (compute / 4 + plan[4]["allreduce_s"]))
    # a fixed cost per round caps what more GPUs give
    capped = scale_out.projection(dict(scale_out.GPU_ASSUMPTIONS, round_fixed_s=1e6), gpus=(1, 16))
    assert capped[16]["speedup"] < 1.0


def test_plateau_is_the_first_point_near_the_final_value():
    points = [{"trajectories": 512 * k, "sampled": v} for k, v in enumerate([0.3, 0.4, 0.5, 0.6, 0.6, 0.61, 0.6])]
    found = sample_efficiency.plateau(points, window=1)
    assert found["final"] == pytest.approx(0.6) and found["trajectories"] == 512 * 3 and found["within_plan"]


def test_a_curve_that_never_rises_has_no_plateau():
    points = [{"trajectories": 512 * k, "sampled": v} for k, v in enumerate([0.30, 0.31, 0.29, 0.30, 0.31])]
    found = sample_efficiency.plateau(points)
    assert not found["learned"] and found["trajectories"] is None and not found["within_plan"]


def test_bench_command_writes_json_and_markdown(tmp_path):
    assert bench_main(["--quick", "--only", "collection", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "latest.json").read_text())
    assert set(report["benchmarks"]) == {"collection"} and report["quick"] is True
    assert len(report["machine"]["before"]["loadavg_1_5_15"]) == 3
    table = (tmp_path / "latest.md").read_text()
    assert "| collection | 8 rollouts / 1 rollout of one task (goal < 2) |" in table
