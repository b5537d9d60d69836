"""A policy's greedy next action in a logged turn's context (flow_assets.policy.next_action), on
the real tiny model: the context is the one a training row gives the same turn, and a policy
warm-started on the demonstrations takes their actions where an untrained one does not."""

import json

import pytest

from flow_assets.logs.schema import Outcome, Step, Trajectory
from flow_assets.policy.chat import assistant_turn_ids, chat_format, render_prompt
from flow_assets.policy.logged_rows import trajectory_conversation
from flow_assets.policy.next_action import logged_turns, predicted_actions
from flow_assets.policy.store import PolicyStore
from flow_assets.rl.next_action import ANSWER, Action, next_action_report
from flow_assets.tasks.calculator import CALCULATOR_TOOL, CalculatorSource
from resources.registry import AdapterRegistry

pytestmark = pytest.mark.slow


def _logged(tasks, success=True):
    """The calculator flows the demonstrations describe, as a log would hold them (text only)."""
    source = CalculatorSource()
    out = []
    for task in tasks:
        demo = source.demonstration(task)
        call, result, answer = demo[1]["tool_calls"][0]["function"], demo[2]["content"], demo[3]["content"]
        steps = [
            Step(index=0, kind="tool", tool=call["name"], input=json.loads(call["arguments"]), output=result),
            Step(index=1, kind="answer", output=answer),
        ]
        out.append(Trajectory(trajectory_id=f"log/{task.task_id}", task_id=task.task_id, agent_id="calc", query=task.prompt,
                              steps=steps, final_answer=answer, outcome=Outcome(success=success, score=float(success))))  # fmt: skip
    return out


def _policy(root):
    champion = AdapterRegistry(root=str(root)).champion()
    return PolicyStore(str(root)).load(champion["adapter_path"])


def test_the_evaluated_context_is_the_training_rows_and_failed_flows_are_no_reference(calculator_policy_dir):
    _, tokenizer = _policy(calculator_policy_dir)
    fmt = chat_format(tokenizer)
    tasks = CalculatorSource().tasks("train")[:3]
    logged = _logged(tasks)
    turns = logged_turns(logged + _logged(tasks[:1], success=False), fmt, tools=[CALCULATOR_TOOL])
    assert len(turns) == 2 * len(tasks)  # the failed copy is not a reference
    first = turns[0]
    assert first.action == Action("calculator", {"expression": tasks[0].prompt})
    assert turns[1].action == Action(ANSWER)
    conversation = trajectory_conversation(logged[0], fmt.tool_calls, (), [CALCULATOR_TOOL])
    for k in (0, 1):
        prompt_ids, _ = assistant_turn_ids(tokenizer, conversation.messages, conversation.turns[k].message_index, conversation.tools, fmt)
        assert render_prompt(tokenizer, turns[k].messages, turns[k].tools, add_generation_prompt=True, fmt=fmt)[1] == prompt_ids


def test_a_policy_warm_started_on_the_flows_takes_their_next_actions(calculator_policy_dir, fresh_policy_dir):
    trained, tokenizer = _policy(calculator_policy_dir)
    untrained, _ = _policy(fresh_policy_dir)
    turns = logged_turns(_logged(CalculatorSource().tasks("train")[:16]), chat_format(tokenizer), tools=[CALCULATOR_TOOL])
    report = next_action_report(
        [t.trajectory_id for t in turns], [t.action for t in turns],
        predicted_actions(trained, tokenizer, turns), predicted_actions(untrained, tokenizer, turns), n_resamples=2000,
    )  # fmt: skip
    assert report["n_turns"] == 32 and report["n_trajectories"] == 16
    cand, champ = report["candidate"], report["champion"]
    assert cand["name"]["rate"] > champ["name"]["rate"]
    assert cand["name_and_arguments"]["rate"] > champ["name_and_arguments"]["rate"]
    assert report["difference"]["name"]["ci_low"] > 0


def test_one_prefill_per_conversation_decodes_what_each_prompt_alone_decodes(calculator_policy_dir, fresh_policy_dir):
    """The batched per-conversation decoder gives every turn the completion that greedy decoding
    of its own prompt gives: a turn never sees the rest of the conversation."""
    from flow_assets.policy.configs import SamplingConfig
    from flow_assets.policy.next_action import conversation_greedy_actions, conversation_greedy_completions
    from flow_assets.policy.sampling import sample_token_ids

    trained, tokenizer = _policy(calculator_policy_dir)
    untrained, _ = _policy(fresh_policy_dir)
    fmt = chat_format(tokenizer)
    turns = logged_turns(_logged(CalculatorSource().tasks("train")[:6]), fmt, tools=[CALCULATOR_TOOL])
    turns = turns[1::2] + turns[0::2]  # any order: answers first
    prompts = [render_prompt(tokenizer, t.messages, t.tools, add_generation_prompt=True, fmt=fmt)[1] for t in turns]
    for model in (trained, untrained):  # the untrained one runs to the cap: every decoding step is compared
        alone = sample_token_ids(model, tokenizer, prompts, SamplingConfig(num_samples=1, temperature=0.0, max_new_tokens=24, max_batch_size=1))
        together = conversation_greedy_completions(model, tokenizer, turns, max_new_tokens=24)
        assert together == [r.completion_ids for r in alone]
        assert conversation_greedy_actions(model, tokenizer, turns, 24) == predicted_actions(model, tokenizer, turns, 24)
    # a turn whose prompt and completion cap exceed the context gets no completion
    longest = max(len(p) for p in prompts)
    capped = conversation_greedy_completions(trained, tokenizer, turns, max_new_tokens=24, max_length=longest + 23)
    assert [c is None for c in capped] == [len(p) == longest for p in prompts]
