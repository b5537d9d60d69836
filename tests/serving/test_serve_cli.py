"""`flowopt serve` on a model a user brings: a base model directory with no registry is registered
as champion v0 by the CLI itself (once), and a preset name that does not exist is refused."""

import shutil

from flow_assets.cli import ensure_champion
from flow_assets.policy.store import PolicyStore
from resources.registry import AdapterRegistry
from tests.conftest import run_cli


def test_a_base_model_without_a_registry_is_registered_as_champion_v0_once(fresh_policy_dir, tmp_path):
    base = tmp_path / "my-model"
    shutil.copytree(fresh_policy_dir / "base", base)
    store = PolicyStore(models_root=str(tmp_path / "models"), base_model_path=str(base))
    adapter = ensure_champion(store)
    champion = AdapterRegistry(root=str(tmp_path / "models")).champion()
    assert champion["version"] == "v0" and champion["adapter_path"] == adapter
    assert ensure_champion(store) is None  # a registry exists now: nothing is registered twice
    assert len(AdapterRegistry(root=str(tmp_path / "models")).load()["history"]) == 1
    model, tokenizer = store.load(adapter)  # what the gateway serves as the champion
    assert model.peft_config and tokenizer.eos_token_id is not None


def test_an_unknown_preset_is_refused_before_anything_loads(tmp_path):
    code, _, err = run_cli(["serve", "--preset", "no-such-model", "--models", str(tmp_path / "models")])
    assert code == 2 and "--preset" in err and "no-such-model" in err
    assert not (tmp_path / "models").exists()


def test_a_cache_budget_below_one_slot_is_refused_before_anything_loads(tmp_path):
    code, _, err = run_cli(["serve", "--max-batch-total-tokens", "0", "--models", str(tmp_path / "models")])
    assert code == 2 and "--max-batch-total-tokens must be at least 1, got 0" in err
    assert not (tmp_path / "models").exists()
