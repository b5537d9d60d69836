"""The warm-start adapter of a user's model (``base_policy`` with ``adapter_warm_start``) on a real
Dagster instance and a real tiny model, and the spread samples of tasks that the BFCL demo's
gate and trials use."""

import hashlib

import pytest
import torch
from dagster import AssetKey, instance_for_test

from flow_assets.definitions import build_definitions
from flow_assets.policy.chat import conversation_rows
from flow_assets.policy.configs import TinyModelConfig
from flow_assets.policy.sampling import completion_logprobs
from flow_assets.policy.store import PolicyStore
from flow_assets.policy.tiny_model import save_tiny_policy
from flow_assets.runtime.local import run_job
from flow_assets.tasks.sources import task_tools
from flow_assets.training.rounds import EvaluationConfig, spread_sample
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource


def test_spread_sample_is_a_seeded_ordered_subset():
    items = list(range(1000))
    sample = spread_sample(items, 100, seed=0)
    assert len(sample) == len(set(sample)) == 100
    assert sample == sorted(sample) and set(sample) <= set(items)
    assert sample == spread_sample(items, 100, seed=0)
    assert sample != spread_sample(items, 100, seed=1)
    # a list made of ten blocks (categories) in order: every block gets some, unlike the first 100
    assert len({i // 100 for i in sample}) == 10
    assert spread_sample(items[:50], 100, seed=0) == items[:50]


def test_evaluation_task_sample_first_or_spread():
    source = TaskSourceResource(kind="calculator").source()
    held_out = source.tasks("held_out")
    first = EvaluationConfig(max_tasks=40).held_out_tasks(source)
    spread = EvaluationConfig(max_tasks=40, task_sample="spread").held_out_tasks(source)
    assert [t.task_id for t in first] == [t.task_id for t in held_out[:40]]
    assert [t.task_id for t in spread] == [t.task_id for t in spread_sample(held_out, 40, seed=0)]
    assert [t.task_id for t in spread] != [t.task_id for t in first]


def _files_digest(path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def _demonstration_nll(store: PolicyStore, adapter: str, rows) -> float:
    model, tokenizer = store.load(adapter)
    with torch.no_grad():
        logp, mask = completion_logprobs(model, [r[0] for r in rows], [r[1] for r in rows], tokenizer.pad_token_id)
    return float(-(logp * mask).sum() / mask.sum())


def test_warm_start_adapter_on_a_users_model(tmp_path):
    """v0 is the user's model as it is; v1, an SFT-trained LoRA adapter, becomes champion; the
    base weights are not touched, and v1 fits the train demonstrations better than v0."""
    user_model = tmp_path / "user-model"
    save_tiny_policy(user_model, TinyModelConfig())
    before = _files_digest(user_model)
    tasks = TaskSourceResource()
    models = tmp_path / "models"
    defs = build_definitions(str(tmp_path / "lake"), str(tmp_path / "landing"), models_root=str(models), tasks=tasks,
                             base_model_path=str(user_model))  # fmt: skip
    config = {"adapter_warm_start": True, "sft_demonstrations": 128, "sft": {"steps": 40, "learning_rate": 3e-3, "batch_size": 32}}
    (tmp_path / "home").mkdir()
    with instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
        result = run_job(defs, instance, "base_policy_job", run_config={"ops": {"base_policy": {"config": config}}})
        assert result.success
        (event,) = [e for e in result.get_asset_materialization_events() if e.asset_key == AssetKey("base_policy")]
        meta = {k: v.value for k, v in event.materialization.metadata.items()}
    assert meta["champion"] == "v1" and meta["sft_demonstrations"] == 128 and meta["sft_steps"] == 40
    registry = AdapterRegistry(root=str(models))
    history = [(e["version"], e["action"]) for e in registry.load()["history"]]
    assert history == [("v0", "register"), ("v1", "promote")]
    assert registry.champion()["version"] == "v1"
    assert _files_digest(user_model) == before  # the user's weights stay as they were

    store = defs.resources["policy"].store()
    source = tasks.source()
    _, tokenizer = store.load()
    rows = [r for t in spread_sample(source.tasks("train"), 128, seed=0) for r in conversation_rows(tokenizer, source.demonstration(t), task_tools(source, t))]
    v0, v1 = (_demonstration_nll(store, str(store.adapter_dir(v)), rows) for v in ("v0", "v1"))
    assert v1 < 0.8 * v0, (v0, v1)

    # a second warm start on a registry whose champion moved on is refused
    from flow_assets.training.rounds import RoundError, warm_start_adapter
    from flow_assets.policy.configs import SFTConfig

    with pytest.raises(RoundError, match="v0 only"):
        warm_start_adapter(store, registry, source, SFTConfig(steps=1), 4, "test")
