"""Both at once, in order (#30, item 4): a hosted policy (the tiny calculator policy's LoRA adapter)
under ``FLOWOPT_ROUND_SCHEDULE = prompt,adapter`` gets a prompt round, then a LoRA round under the
prompt it found, each gated on one change, all through the real sensors, a real Dagster instance
and the hosting gateway on the real tiny model."""

import json
import math
import shutil

import pytest
from dagster import AssetCheckKey, AssetKey, instance_for_test

from flow_assets.definitions import build_definitions
from flow_assets.policy.prompt import PROMPT_POLICY_FILE, PromptPolicy, hosted_version, policy_kind
from flow_assets.runtime.local import execute_requests, run_job, tick_sensor
from flow_assets.training.prompt_rounds import landed_flows
from flow_assets.training.rounds import read_round_summary
from flow_assets.training.run_config import RoundSettings
from resources.loop import TrainingLoop
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource
from tests.training.test_assets import OPEN_GATE, failure

pytestmark = pytest.mark.slow
ROUND = {"k": 2, "num_candidates": 2, "search_tasks": 12, "heldout_tasks": 40, "temperature": 0.7, "concurrency": 32}
COLLECT = {"ops": {"rollouts": {"config": {"tasks_per_batch": 12, "group_size": 4}}}}


def _gate_passed(instance) -> bool:
    found = instance.event_log_storage.get_latest_asset_check_execution_by_key([AssetCheckKey(AssetKey("prompt_evaluation"), "prompt_gate")])
    return next(iter(found.values())).evaluation.passed


def test_a_hosted_policy_gets_a_prompt_round_then_a_lora_round_under_the_prompt(calculator_policy_dir, tmp_path):
    models = tmp_path / "models"
    shutil.copytree(calculator_policy_dir, models)
    (models / "registry.json").write_text((models / "registry.json").read_text().replace(str(calculator_policy_dir), str(models)))
    registry = AdapterRegistry(root=str(models))
    v0 = registry.champion()
    assert policy_kind(v0["adapter_path"]) == "adapter"
    weights = (models / "adapters" / "v0" / "adapter_model.safetensors").read_bytes()
    defs = build_definitions(str(tmp_path / "lake"), str(tmp_path / "landing"), models_root=str(models), tasks=TaskSourceResource(kind="calculator"),
                             settle_seconds=0, loop=TrainingLoop(round_schedule=["prompt", "adapter"]))  # fmt: skip
    (tmp_path / "home").mkdir()
    with instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
        assert run_job(defs, instance, "collect_rollouts_job", run_config=COLLECT).success
        (first,) = execute_requests(defs, instance, "log_batch_job", tick_sensor(defs, instance, "new_logs_sensor")).succeeded
        # round 0 of the schedule: the prompt, although the champion is a LoRA adapter and no
        # upstream model is configured (the hosting gateway serves the candidates)
        (request,) = tick_sensor(defs, instance, "training_round_sensor").run_requests
        assert (request.job_name, request.partition_key) == ("prompt_round_job", first)
        searched = run_job(defs, instance, "prompt_round_job", first, {"ops": {n: {"config": ROUND} for n in ("prompt_candidate", "prompt_evaluation")}})
        work = models / "prompt_rounds" / first
        search = json.loads((work / "search.json").read_text())
        # the champion's prompt, then one candidate per distinct draw of k demonstrations: how many
        # distinct draws there are depends on how many of the 12 sampled tasks the policy solved
        pool = search["demonstrations"]
        assert search["champion"] == "v0" and pool >= 1
        names = [f"c{i}" for i in range(1 + min(ROUND["num_candidates"], math.comb(pool, min(ROUND["k"], pool))))]
        assert len(search["mean_rewards"]) == len(names)
        # every candidate was v0's own adapter under its prompt, served by the hosting gateway:
        # the search's flows carry token ids, one version per candidate
        flows = landed_flows(work / "search")
        assert len(flows) == len(names) * 12 and {f.adapter_version for f in flows} == set(names)
        assert all(s.prompt_token_ids for f in flows for s in f.steps if s.kind in ("tool", "answer"))
        for name in names:
            assert (work / "search" / "prompts" / name / "adapter_model.safetensors").read_bytes() == weights
        candidate = work / "candidate"
        assert policy_kind(candidate) == "adapter+prompt" and (candidate / "adapter_model.safetensors").read_bytes() == weights
        if search["best_is_champion"]:  # the tiny 128-token context may hold no demonstration: no gate then
            assert not searched.success and registry.champion()["version"] == "v0"

        # the gate and the promotion on a search outcome made by hand: v1 = v0's adapter under a
        # prompt gone wrong (a demonstration that answers without the calculator) against the bare
        # adapter; the winner is the adapter under the new prompt, its weights untouched
        refusal = ({"role": "user", "content": "12*7"}, {"role": "assistant", "content": "I cannot compute that."})
        v1 = hosted_version(v0["adapter_path"], PromptPolicy(demonstrations=(refusal,)), models / "adapters" / "v1")
        registry.promote("v1", str(v1), {}, by="test", reason="a bad prompt")
        shutil.rmtree(candidate)
        bare = PromptPolicy()
        (work / "search.json").write_text(json.dumps(search | {"champion": "v1", "best": 1, "best_is_champion": False,
                                                             "candidate_path": str(hosted_version(v1, bare, candidate)),
                                                             "content_hash": bare.content_hash}))  # fmt: skip
        gated = defs.get_job_def("prompt_round_job").execute_in_process(
            run_config={"ops": {"prompt_evaluation": {"config": ROUND}}}, instance=instance, partition_key=first, raise_on_error=False,
            asset_selection=[AssetKey("prompt_evaluation"), AssetKey("promoted_prompt")],
        )  # fmt: skip
        report = json.loads((work / "gate.json").read_text())
        assert gated.success and _gate_passed(instance), failure(gated)
        assert report["gain"] > 0.2 and report["mcnemar_p"] < 0.05 and report["n_tasks"] == 40
        v2 = registry.champion()
        assert v2["version"] == "v2" and v2["adapter_path"] == str(models / "adapters" / "v2")
        assert policy_kind(v2["adapter_path"]) == "adapter+prompt" and PromptPolicy.load(v2["adapter_path"]).content_hash == bare.content_hash
        assert (models / "adapters" / "v2" / "adapter_model.safetensors").read_bytes() == weights

        # round 1 of the schedule: the adapter, trained under v2's prompt, which its candidate keeps
        assert run_job(defs, instance, "collect_rollouts_job", run_config=COLLECT).success
        (second,) = execute_requests(defs, instance, "log_batch_job", tick_sensor(defs, instance, "new_logs_sensor")).succeeded
        (request,) = tick_sensor(defs, instance, "training_round_sensor").run_requests
        assert (request.job_name, request.partition_key) == ("training_round_job", second)
        trained = run_job(defs, instance, "training_round_job", second, RoundSettings(evaluation={"max_tasks": 24, **OPEN_GATE}).run_config())
        assert trained.success, failure(trained)
        summary = read_round_summary(models / "runs" / second)
        assert summary.parent_version == "v2"
        assert PromptPolicy.load(summary.candidate_adapter).content_hash == bare.content_hash
        assert (models / "runs" / second / "adapter" / "adapter_model.safetensors").read_bytes() != weights
        v3 = registry.champion()
        assert v3["version"] == "v3" and policy_kind(v3["adapter_path"]) == "adapter+prompt"
        assert (models / "adapters" / "v3" / PROMPT_POLICY_FILE).read_text() == (models / "adapters" / "v2" / PROMPT_POLICY_FILE).read_text()
        # and round 2 is the prompt's again
        assert run_job(defs, instance, "collect_rollouts_job", run_config=COLLECT).success
        (third,) = execute_requests(defs, instance, "log_batch_job", tick_sensor(defs, instance, "new_logs_sensor")).succeeded
        assert [(r.job_name, r.partition_key) for r in tick_sensor(defs, instance, "training_round_sensor").run_requests] == [("prompt_round_job", third)]
