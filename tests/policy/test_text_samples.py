"""Text logs to training samples (flow_assets.policy.rollouts.text_training_samples) on the tiny
model's tokenizer: one sample per rendered turn with its step's advantage, captured trajectories
left to the captured path, and a held-out task never reaching training."""

import polars as pl

from flow_assets.logs.schema import Outcome, Step, Trajectory
from flow_assets.policy.chat import assistant_turn_ids, chat_format
from flow_assets.policy.rollouts import text_training_samples
from flow_assets.policy.tokenizer import build_char_tokenizer
from flow_assets.tasks.sources import is_held_out


def _flat(task_id: str, answer: str, captured: bool = False) -> Trajectory:
    step = Step(index=0, kind="answer", output=answer, **({"token_ids": [5, 6], "logprobs": [-0.1, -0.2]} if captured else {}))
    return Trajectory(trajectory_id=f"t/{task_id}/{answer}", task_id=task_id, agent_id="me", adapter_version="v0",
                      query=f"spell {task_id}", steps=[step], final_answer=answer, outcome=Outcome(success=True, score=1.0))  # fmt: skip


def test_text_turns_become_samples_and_held_out_tasks_never_train():
    tokenizer = build_char_tokenizer()
    held = next(f"w{i}" for i in range(1000) if is_held_out(f"w{i}"))
    train = next(f"w{i}" for i in range(1000) if not is_held_out(f"w{i}"))
    trajectories = [_flat(train, "olleh"), _flat(held, "dlrow"), _flat(train, "xyz", captured=True), _flat(train, "abc")]
    trajectories.append(Trajectory(**{**_flat(train, "zzz").model_dump(), "agent_id": "someone-else"}))
    logs = pl.DataFrame({"agent_id": [t.agent_id for t in trajectories], "record_json": [t.model_dump_json() for t in trajectories]})
    advantages = pl.DataFrame({"trajectory_id": [t.trajectory_id for t in trajectories], "index": [0] * 5, "advantage": [0.5, 0.7, 0.9, -0.25, 1.0]})
    text = text_training_samples(logs, advantages, ["me"], tokenizer, held_out=is_held_out)
    assert (text.trajectories, text.turns, text.held_out_trajectories) == (2, 2, 1)  # the captured one is not text
    assert [s.advantage for s in text.samples] == [0.5, -0.25] and text.adapter_versions == ["v0", "v0"]
    assert text.assumed_temperature == 2 and all(s.temperature == 1.0 for s in text.samples)
    # each sample is the turn as the gateway would have given it to the policy, and as it wrote it
    messages = [{"role": "user", "content": f"spell {train}"}, {"role": "assistant", "content": "olleh"}]
    prompt, completion = assistant_turn_ids(tokenizer, messages, 1, None, chat_format(tokenizer))
    assert (text.samples[0].prompt_ids, text.samples[0].completion_ids) == (prompt, completion)
    assert completion[-1] == tokenizer.eos_token_id
    # a turn longer than the model's context is skipped with the reason, not cut
    short = text_training_samples(logs, advantages, ["me"], tokenizer, max_length=len(prompt) + 2)
    assert short.turns == 0 and all("over the model's context" in why for _, _, why in short.skipped)


def test_a_bare_agent_id_is_refused_not_read_as_its_characters():
    import pytest

    logs = pl.DataFrame({"agent_id": ["m"], "record_json": [_flat("w1", "x").model_dump_json()]})
    with pytest.raises(TypeError, match="collection of agent ids"):
        text_training_samples(logs, pl.DataFrame({"trajectory_id": [], "index": [], "advantage": []}), "me", build_char_tokenizer())
