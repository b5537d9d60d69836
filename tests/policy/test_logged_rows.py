"""Training rows from logged trajectories: rendered rows equal what the gateway captured, one row
per conversation where the template is prefix-consistent, the assistant mask covers exactly the
assistant's turns, and turns whose context the log lost are skipped, never guessed."""

import json

import pytest
import torch

from flow_assets.logs.reader import parse_file
from flow_assets.logs.schema import Outcome, Step, Trajectory
from flow_assets.policy.chat import COMPACT_CHAT_TEMPLATE, assistant_turn_ids, conversation_rows
from flow_assets.policy.logged_rows import (
    chat_conversation,
    conversation_training_rows,
    infer_tools,
    kept_conversation,
    render_drift,
    trajectory_conversation,
    trajectory_rows,
)
from flow_assets.policy.sampling import completion_logprobs
from flow_assets.policy.store import PolicyStore
from flow_assets.policy.tool_calls import parse_tool_calls
from flow_assets.tasks.calculator import CALCULATOR_TOOL, CalculatorSource

TOOLS = [CALCULATOR_TOOL]


@pytest.fixture(scope="module")
def captured(calculator_policy_dir, tmp_path_factory):
    """``(tokenizer, model, trajectories, prompts)``: 12 rollouts of the calculator agent captured
    by a real gateway at T = 1 (tool call, result, answer; some malformed), as landed."""
    from flow_assets.serving.agents.builtin import calculator_agent
    from flow_assets.serving.agents.harness import HarnessConfig, run_rollouts_sync
    from flow_assets.serving.gateway.serve import serve_policy

    store = PolicyStore(str(calculator_policy_dir))
    source = CalculatorSource()
    tasks = source.tasks("train")[:6]
    landing = tmp_path_factory.mktemp("landing")
    with serve_policy(store, landing) as server:
        run_rollouts_sync(server.url, calculator_agent, tasks, source.score, 2, agent_id="calc", batch="rows", config=HarnessConfig(temperature=1.0))
    trajectories = [Trajectory.model_validate_json(line) for p in sorted(landing.rglob("*.jsonl")) for line in p.read_text().splitlines()]
    assert len(trajectories) == 12
    model, tokenizer = store.load()
    # the harness logs the task's statement as the query; the agent sent the task's prompt
    prompts = {t.task_id: t.prompt for t in tasks}
    return tokenizer, model, trajectories, prompts


def _turn_tokens(row, turn):
    return [i for i, t in zip(row.input_ids, row.turn_index) if t == turn]


def _closed(trajectory, eos):
    return all(s.token_ids[-1:] == [eos] for s in trajectory.steps if s.token_ids is not None)


def test_rows_rendered_from_captured_text_are_the_captured_ids(captured):
    tokenizer, _, trajectories, prompts = captured
    drift = render_drift(tokenizer, trajectories, tools=TOOLS, queries=lambda t: prompts[t.task_id])
    assert drift.compared == drift.captured_turns and drift.compared - drift.differing >= 12
    # the only drift allowed: a turn the sampler cut at max_tokens, which the template closes with eos
    assert drift.differing == drift.cut_at_length and not drift.prompt_differs
    closed = [t for t in trajectories if _closed(t, tokenizer.eos_token_id)]
    assert len(closed) >= 8
    for trajectory in closed:
        own = trajectory_rows(tokenizer, trajectory, tools=TOOLS)
        again = trajectory_rows(tokenizer, trajectory, tools=TOOLS, query=prompts[trajectory.task_id], use_captured_ids=False)
        assert [(r.input_ids, r.assistant_mask, r.turn_index) for r in own.rows] == [
            (r.input_ids, r.assistant_mask, r.turn_index) for r in again.rows
        ]
        assert [r.captured for r in own.rows] == [len(r.turns) for r in own.rows] and all(r.captured == 0 for r in again.rows)


def test_drift_names_a_turn_cut_at_its_token_cap(captured):
    tokenizer, _, trajectories, prompts = captured
    trajectory = next(t for t in trajectories if _closed(t, tokenizer.eos_token_id))
    last = trajectory.steps[-1]
    cut = last.model_copy(update={"token_ids": last.token_ids[:-1], "logprobs": last.logprobs[:-1]})
    trajectory = trajectory.model_copy(update={"steps": [*trajectory.steps[:-1], cut]})
    drift = render_drift(tokenizer, [trajectory], tools=TOOLS, queries=lambda t: prompts[t.task_id])
    assert (drift.differing, drift.completion_differs, drift.cut_at_length, drift.prompt_differs) == (1, 1, 1, 0)
    # the same trajectory logged with its task's statement as the query: every prompt differs
    logged = render_drift(tokenizer, [trajectory], tools=TOOLS)
    assert logged.prompt_differs == logged.compared == logged.captured_turns


def test_captured_ids_win_and_a_whole_conversation_is_one_row(captured):
    tokenizer, _, trajectories, _ = captured
    for trajectory in trajectories:
        result = trajectory_rows(tokenizer, trajectory)  # no tools, no context: the ids need neither
        turns = [s for s in trajectory.steps if s.token_ids is not None]
        (row,) = result.rows
        assert result.prefix_consistent and not result.skipped and row.turns == tuple(range(len(turns)))
        assert row.input_ids == turns[-1].prompt_token_ids + turns[-1].token_ids
        for k, step in enumerate(turns):
            assert _turn_tokens(row, k) == step.token_ids
            assert [lp for lp, t in zip(row.behaviour_logprobs, row.turn_index) if t == k] == step.logprobs
        assert sum(row.assistant_mask) == sum(len(s.token_ids) for s in turns)
        assert all((m == 1) == (t >= 0) for m, t in zip(row.assistant_mask, row.turn_index))


def test_the_assistant_mask_decodes_to_the_logged_turns(captured):
    tokenizer, _, trajectories, prompts = captured
    calls = 0
    for trajectory in trajectories:
        (row,) = trajectory_rows(tokenizer, trajectory, tools=TOOLS, query=prompts[trajectory.task_id], use_captured_ids=False).rows
        for k, step in enumerate(s for s in trajectory.steps if s.kind != "observation"):
            ids = _turn_tokens(row, k)
            assert ids[-1] == tokenizer.eos_token_id  # the end-of-turn token is trained: it is how a turn stops
            text = tokenizer.decode(ids, skip_special_tokens=True)
            assert text == step.output
            if step.kind == "tool":
                parsed = parse_tool_calls(text, "compact", TOOLS)
                logged = [(c["name"], c["arguments"]) for c in step.input["tool_calls"]]
                assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == logged
                calls += 1
    assert calls >= 6


def test_one_forward_pass_gives_every_turn_the_log_probs_of_its_own_row(captured):
    tokenizer, model, trajectories, _ = captured
    trajectory = next(t for t in trajectories if sum(s.token_ids is not None for s in t.steps) >= 2)
    (row,) = trajectory_rows(tokenizer, trajectory).rows
    with torch.no_grad():
        logits = model(torch.tensor([row.input_ids])).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(row.input_ids[1:]).unsqueeze(1))[:, 0]
    turns = [s for s in trajectory.steps if s.token_ids is not None]
    for k, step in enumerate(turns):
        positions = [i - 1 for i, t in enumerate(row.turn_index) if t == k]  # logits at i-1 predict token i
        alone, _ = completion_logprobs(model, [step.prompt_token_ids], [step.token_ids], tokenizer.pad_token_id)
        assert torch.allclose(logp[positions], alone[0], atol=1e-4)


def _chat_trajectory(steps, query="What is 2+3?"):
    return Trajectory(
        trajectory_id="t1", task_id="calc-2+3", agent_id="another-model", query=query,
        steps=[Step(index=i, **s) for i, s in enumerate(steps)], outcome=Outcome(success=True, score=1.0),
    )  # fmt: skip


THINKING = _chat_trajectory([
    {"kind": "plan", "output": "<think>add them</think>I will compute it."},
    {"kind": "tool", "tool": "calculator", "input": {"expression": "2+3"}, "output": "5"},
    {"kind": "answer", "output": "<think>the tool said 5</think>5"},
])  # fmt: skip

#: the compact template, except that an assistant message before the last one loses its
#: <think>...</think> part (as Qwen3's template drops past reasoning): not prefix-consistent
FORGETFUL = COMPACT_CHAT_TEMPLATE.replace(
    "A:{{ m.content or '' }}",
    "{%- set c = m.content or '' -%}{%- if not loop.last and '</think>' in c -%}{%- set c = c.split('</think>')[-1] -%}{%- endif -%}A:{{ c }}",
)


def test_a_chat_log_becomes_one_row_when_the_template_is_prefix_consistent(calculator_policy_dir):
    _, tokenizer = PolicyStore(str(calculator_policy_dir)).load()
    result = trajectory_rows(tokenizer, THINKING, tools=TOOLS)
    (row,) = result.rows
    assert result.links == [True] and [t.steps for t in result.conversation.turns] == [(0, 1), (2,)]
    assert tokenizer.decode(_turn_tokens(row, 0), skip_special_tokens=True) == "<think>add them</think>I will compute it.@calculator(2+3)"
    assert tokenizer.decode(_turn_tokens(row, 1), skip_special_tokens=True) == "<think>the tool said 5</think>5"
    context = tokenizer.decode([i for i, m in zip(row.input_ids, row.assistant_mask) if not m], skip_special_tokens=True)
    assert context == "U:What is 2+3?\nA:T:5\nA:"  # user, tool result and generation prompts: never trained


def test_a_template_that_rewrites_past_turns_falls_back_to_one_row_per_turn(calculator_policy_dir):
    _, tokenizer = PolicyStore(str(calculator_policy_dir)).load()
    tokenizer.chat_template = FORGETFUL
    result = trajectory_rows(tokenizer, THINKING, tools=TOOLS)
    assert result.links == [False] and not result.prefix_consistent and len(result.rows) == 2
    messages = result.conversation.messages
    # each row is the turn as the gateway would have given it to the policy, the cut SFT makes too
    assert [(r.input_ids, r.turns) for r in result.rows] == [
        (p + c, (k,)) for k, (p, c) in enumerate(conversation_rows(tokenizer, messages, TOOLS))
    ]
    for k, row in enumerate(result.rows):
        prompt, completion = assistant_turn_ids(tokenizer, messages, result.conversation.turns[k].message_index, TOOLS)
        assert row.assistant_mask == [0] * len(prompt) + [1] * len(completion)
    # the second turn's context holds the first turn without its reasoning
    assert "add them" not in tokenizer.decode(result.rows[1].input_ids)


def test_turns_after_a_user_message_the_log_lost_are_skipped_not_guessed(calculator_policy_dir):
    _, tokenizer = PolicyStore(str(calculator_policy_dir)).load()
    trajectory = _chat_trajectory([
        {"kind": "message", "output": "Which numbers?"},  # the user's reply is not in the canonical record
        {"kind": "tool", "tool": "calculator", "input": {"expression": "2+3"}, "output": "5"},
        {"kind": "answer", "output": "5"},
    ], query="Add two numbers")  # fmt: skip
    result = trajectory_rows(tokenizer, trajectory, tools=TOOLS)
    assert [t.context_known for t in result.conversation.turns] == [True, False, False]
    assert [r.turns for r in result.rows] == [(0,)] and [k for k, _ in result.skipped] == [1, 2]
    assert all("user message" in reason for _, reason in result.skipped)


def test_real_logs_nobody_here_wrote(calculator_policy_dir, shared_data):
    _, tokenizer = PolicyStore(str(calculator_policy_dir)).load()
    fireact = sorted((shared_data / "fireact").glob("*gpt-3.5*.json"))[0]
    trajectories = [v.trajectory for v in parse_file(fireact).valid[:40]]
    for trajectory in trajectories:
        result = trajectory_rows(tokenizer, trajectory)
        # ReAct has no user turn after the question: every decision step is in a trained turn, in one row
        assert not result.skipped and len(result.rows) == 1 and result.prefix_consistent
        covered = sorted(i for t in result.conversation.turns for i in t.steps)
        assert covered == [s.index for s in trajectory.steps if s.kind != "observation"]
    tau = [v.trajectory for v in parse_file(shared_data / "tau-bench" / "gpt-4o-airline.json").valid[:20]]
    for trajectory in tau:
        # rebuilt from the steps alone, the turns after the agent's first reply to the user lost their context
        steps_only = trajectory.model_copy(update={"metadata": {k: v for k, v in trajectory.metadata.items() if k != "messages"}})
        rebuilt = trajectory_rows(tokenizer, steps_only)
        known = [t.context_known for t in rebuilt.conversation.turns]
        assert {t for r in rebuilt.rows for t in r.turns} == {k for k, ok in enumerate(known) if ok} and len(rebuilt.skipped) == known.count(False)
        # the record keeps the conversation whole: every assistant turn is trained, in one row
        result = trajectory_rows(tokenizer, trajectory)
        (row,) = result.rows
        assert not result.skipped and row.turns == tuple(range(len(result.conversation.turns))) and known.count(False) > 0


def test_a_kept_tau_bench_conversation_maps_each_assistant_message_to_its_steps(shared_data):
    runs = json.loads((shared_data / "tau-bench" / "gpt-4o-airline.json").read_text())
    trajectories = [v.trajectory for v in parse_file(shared_data / "tau-bench" / "gpt-4o-airline.json").valid]
    assert len(trajectories) == len(runs) == 200
    for run, trajectory in zip(runs, trajectories):
        conversation = kept_conversation(trajectory)
        assert [m["role"] for m in conversation.messages] == [m["role"] for m in run["traj"]]
        assert all(t.context_known for t in conversation.turns)
        by_index = {s.index: s for s in trajectory.steps}
        for turn in conversation.turns:
            logged = run["traj"][turn.message_index]
            calls = [c["function"]["name"] for c in logged.get("tool_calls") or []]
            steps = [by_index[i] for i in turn.steps]
            assert [s.tool for s in steps if s.tool] == calls  # each call is its own step, in order
            if (logged.get("content") or "").strip():
                assert steps[0].output == logged["content"]
            else:  # a message with neither text nor calls became no step
                assert bool(turn.steps) == bool(calls)
        # every step came from exactly one assistant message
        assert sorted(i for t in conversation.turns for i in t.steps) == [s.index for s in trajectory.steps]


def test_tools_inferred_from_logged_calls_cover_every_call():
    conversation = chat_conversation([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "type": "function", "function": {"name": "get_user", "arguments": '{"user_id": "u1"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "{}"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "b", "type": "function", "function": {"name": "get_user", "arguments": '{"user_id": "u2", "verbose": true}'}}]},
        {"role": "tool", "tool_call_id": "b", "content": "{}"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "pay", "arguments": {"amount": 5}}}]},
        {"role": "tool", "tool_call_id": "c", "content": "{}"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "d", "type": "function", "function": {"name": "pay", "arguments": {"amount": 2.5}}}]},
    ])  # fmt: skip
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in infer_tools([conversation])}
    assert list(tools) == ["get_user", "pay"]
    assert tools["get_user"] == {"type": "object", "properties": {"user_id": {"type": "string"}, "verbose": {"type": "boolean"}}, "required": ["user_id"]}
    assert tools["pay"] == {"type": "object", "properties": {"amount": {"type": "number"}}, "required": ["amount"]}


def test_captured_ids_of_another_tokenizer_are_refused(captured):
    tokenizer, _, trajectories, _ = captured
    trajectory = trajectories[0]
    step = trajectory.steps[0]
    foreign = trajectory.model_copy(update={"steps": [step.model_copy(update={"prompt_token_ids": [len(tokenizer) + 7]}), *trajectory.steps[1:]]})
    with pytest.raises(ValueError, match="captured with another tokenizer"):
        trajectory_rows(tokenizer, foreign)
    assert trajectory_rows(tokenizer, foreign, tools=TOOLS, use_captured_ids=False).rows


def test_parallel_captured_calls_get_their_results_by_call_id():
    step = Step(index=0, kind="tool", output="@calculator(1+1)@calculator(2+2)", input={"tool_calls": [
        {"id": "a", "name": "calculator", "arguments": {"expression": "1+1"}},
        {"id": "b", "name": "calculator", "arguments": {"expression": "2+2"}},
    ]})  # fmt: skip
    trajectory = Trajectory(
        trajectory_id="p", task_id="p", agent_id="x", query="q",
        steps=[step, Step(index=1, kind="observation", tool="calculator", output="2"), Step(index=2, kind="observation", tool="calculator", output="4"),
               Step(index=3, kind="answer", output="6")],
    )  # fmt: skip
    conversation = trajectory_conversation(trajectory, "compact", tools=TOOLS)
    assistant, first, second = conversation.messages[1:4]
    assert assistant["content"] is None and [c["id"] for c in assistant["tool_calls"]] == ["a", "b"]
    assert (first["tool_call_id"], first["content"], second["tool_call_id"], second["content"]) == ("a", "2", "b", "4")



def test_a_conversation_logged_whole_trains_every_assistant_turn_in_one_row(calculator_policy_dir, shared_data):
    _, tokenizer = PolicyStore(str(calculator_policy_dir)).load()
    runs = json.loads((shared_data / "tau-bench" / "gpt-4o-airline.json").read_text())[:5]
    for run in runs:
        result = conversation_training_rows(tokenizer, chat_conversation(run["traj"]))
        (row,) = result.rows  # the compact template is prefix-consistent: ~12 turns, one pass
        assistant = [m for m in run["traj"] if m["role"] == "assistant"]
        assert not result.skipped and row.turns == tuple(range(len(assistant)))
        for k, message in enumerate(assistant):
            expected = message.get("content") or ""
            for call in message.get("tool_calls") or []:
                args = json.loads(call["function"]["arguments"])
                one = next(iter(args.values())) if len(args) == 1 else None
                body = one if isinstance(one, str) and one.count("(") == one.count(")") else json.dumps(args)
                expected += f"@{call['function']['name']}({body})"
            if expected.isascii():  # the tiny tokenizer is printable ASCII
                assert tokenizer.decode(_turn_tokens(row, k), skip_special_tokens=True) == expected


def _awr_loss_and_grads(model, samples, pad_id):
    from flow_assets.policy.trainer import _with_loss_masks
    from flow_assets.rl.awr_loss import AWRLossConfig, awr_loss

    model.zero_grad(set_to_none=True)
    logp, mask = completion_logprobs(model, [s.prompt_ids for s in samples], [s.completion_ids for s in samples], pad_id)
    out = awr_loss(logp, _with_loss_masks(mask, samples), torch.tensor([s.advantage for s in samples]), None, AWRLossConfig(loss_type="dapo"))
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_packed_conversation_gives_the_per_turn_awr_loss_and_gradient(calculator_policy_dir):
    """Packing a conversation's turns into one sample (loss mask on the assistant tokens) is
    exact under token-level aggregation: same loss, same gradient, one forward pass."""
    import polars as pl

    from flow_assets.policy.rollouts import text_training_samples

    model, tokenizer = PolicyStore(str(calculator_policy_dir)).load()
    trajectory = THINKING.model_copy(update={"agent_id": "me"})
    logs = pl.DataFrame({"agent_id": ["me"], "record_json": [trajectory.model_dump_json()]})
    advantages = pl.DataFrame({"trajectory_id": ["t1"] * 3, "index": [0, 1, 2], "advantage": [0.75, 0.75, 0.75]})
    per_turn = text_training_samples(logs, advantages, ["me"], tokenizer, tools=TOOLS)
    packed = text_training_samples(logs, advantages, ["me"], tokenizer, tools=TOOLS, pack=True)
    assert (len(per_turn.samples), len(packed.samples), per_turn.turns, packed.turns) == (2, 1, 2, 2)
    (sample,) = packed.samples
    assert sample.num_loss_tokens == sum(len(s.completion_ids) for s in per_turn.samples) < len(sample.completion_ids)
    assert sample.prompt_ids == per_turn.samples[0].prompt_ids
    assert sample.prompt_ids + sample.completion_ids == per_turn.samples[1].prompt_ids + per_turn.samples[1].completion_ids
    model.eval()  # no dropout: both passes compute the same function
    out_turns, grads_turns = _awr_loss_and_grads(model, per_turn.samples, tokenizer.pad_token_id)
    out_packed, grads_packed = _awr_loss_and_grads(model, packed.samples, tokenizer.pad_token_id)
    assert out_packed.num_tokens == out_turns.num_tokens
    assert torch.allclose(out_packed.loss, out_turns.loss, rtol=1e-5, atol=1e-6)
    assert grads_turns.keys() == grads_packed.keys() and grads_turns
    for name, grad in grads_turns.items():
        assert torch.allclose(grads_packed[name], grad, rtol=1e-4, atol=1e-6), name
    # a turn with another advantage starts a new sample
    split = text_training_samples(logs, advantages.with_columns(advantage=pl.Series([0.75, 0.75, 0.5])), ["me"], tokenizer, tools=TOOLS, pack=True)
    assert [s.advantage for s in split.samples] == [0.75, 0.5] and all(s.loss_mask is None for s in split.samples)
