"""Shared fixtures: the real agent logs beside the repo, and a real Dagster instance."""

from pathlib import Path

import pytest
from dagster import instance_for_test

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
TAU_BENCH = SHARED_DATA / "tau-bench" / "gpt-4o-airline.json"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data``: real agent logs nobody here wrote, used as they are."""
    assert SHARED_DATA.is_dir(), f"real logs expected at {SHARED_DATA}"
    return SHARED_DATA


@pytest.fixture
def dagster_instance(tmp_path):
    """A real (SQLite, on disk) Dagster instance in a temporary DAGSTER_HOME."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    with instance_for_test(temp_dir=str(home)) as instance:
        yield instance


def make_policy_dir(root: Path, sft_steps: int = 0, seed: int = 0) -> Path:
    """A policy directory as ``base_policy`` leaves it: the tiny model (SFT'd on ``sft_steps`` of
    calculator demonstrations when > 0), champion ``v0`` registered. Returns the directory."""
    from flow_assets.policy.chat import conversation_rows
    from flow_assets.policy.lora import add_lora_adapter, save_lora_adapter
    from flow_assets.policy.sft import SFTConfig, sft_on_rows
    from flow_assets.policy.tiny_model import load_policy, save_tiny_policy
    from flow_assets.tasks.calculator import CalculatorSource
    from resources.registry import AdapterRegistry

    save_tiny_policy(root / "base")
    model, tokenizer = load_policy(root / "base")
    if sft_steps:
        source = CalculatorSource()
        rows = [r for t in source.tasks("train")[:500] for r in conversation_rows(tokenizer, source.demonstration(t), source.tools)]
        sft_on_rows(model, rows, tokenizer.pad_token_id, SFTConfig(steps=sft_steps, seed=seed))
        model.save_pretrained(str(root / "base"))
    save_lora_adapter(add_lora_adapter(model), root / "adapters" / "v0")
    AdapterRegistry(root=str(root)).promote("v0", str(root / "adapters" / "v0"), {}, by="test", reason="test", action="register")
    return root


@pytest.fixture(scope="session")
def fresh_policy_dir(tmp_path_factory) -> Path:
    """A freshly initialised tiny policy (random answers), champion v0."""
    return make_policy_dir(tmp_path_factory.mktemp("fresh_policy"))


@pytest.fixture(scope="session")
def calculator_policy_dir(tmp_path_factory) -> Path:
    """A tiny policy warm-started on calculator conversations: it calls its tool, then answers."""
    return make_policy_dir(tmp_path_factory.mktemp("calculator_policy"), sft_steps=200)
