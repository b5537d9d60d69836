"""An agent's own text log (``openai-chat``, no token ids) of the episodes a real gateway also
captured: the log parses with its agent, version, temperature and reward, and the text path
renders every turn, with the context the log kept, to the ids the gateway captured (a turn cut
at its token cap too: the log keeps its ``finish_reason``)."""

from __future__ import annotations

import polars as pl

from flow_assets.logs.reader import parse_file
from flow_assets.logs.schema import Trajectory
from flow_assets.policy.rollouts import text_training_samples
from flow_assets.policy.store import PolicyStore
from flow_assets.serving.agents.builtin import calculator_loop
from flow_assets.serving.agents.harness import HarnessConfig, run_rollouts_sync
from flow_assets.serving.agents.text_log import text_logging_agent
from flow_assets.serving.gateway.serve import serve_policy
from flow_assets.tasks.calculator import CalculatorSource

#: the agent's fixed prompt before each query (short: the tiny model's context is 128 tokens)
CONTEXT = [{"role": "system", "content": "Be exact."}]


def agent_with_context(capped: set[str]):
    """The calculator agent with a fixed system message before the query, its replies capped at
    one token on the ``capped`` task ids, so that some replies are cut whatever is sampled (a cap
    of 3 tokens on some tasks once let every reply of a run end first)."""

    async def agent(client, task):
        max_tokens = 1 if task.task_id in capped else 32
        return await calculator_loop(client, [*CONTEXT, {"role": "user", "content": task.prompt}], 2, max_tokens=max_tokens)

    return agent


def _lake_frames(trajectories: list[Trajectory]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``interaction_logs`` and ``step_advantages`` as the lake holds them (advantage 1 on every step)."""
    logs = pl.DataFrame({"record_json": [t.model_dump_json() for t in trajectories], "agent_id": [t.agent_id for t in trajectories]})
    advantages = pl.DataFrame(
        [{"trajectory_id": t.trajectory_id, "index": s.index, "advantage": 1.0} for t in trajectories for s in t.steps]
    )
    return logs, advantages


def test_the_agents_text_log_renders_to_the_ids_the_gateway_captured(calculator_policy_dir, tmp_path):
    store = PolicyStore(str(calculator_policy_dir))
    source = CalculatorSource()
    tasks = source.tasks("train")[:6]
    log = tmp_path / "agent" / "calc.jsonl"
    agent = text_logging_agent(agent_with_context({t.task_id for t in tasks[:3]}), log, "calc", source.score, context_messages=len(CONTEXT), temperature=1.0)
    landing = tmp_path / "landing"
    with serve_policy(store, landing) as server:
        results = run_rollouts_sync(server.url, agent, tasks, source.score, 2, agent_id="calc", batch="b", config=HarnessConfig(temperature=1.0))
    captured = [Trajectory.model_validate_json(line) for p in sorted(landing.rglob("*.jsonl")) for line in p.read_text().splitlines()]
    parsed = parse_file(log)
    assert parsed.format == "openai-chat" and not parsed.quarantined
    text = [v.trajectory for v in parsed.valid]
    assert len(text) == len(captured) == len(results) == 12
    for t in text:  # what the agent knew: the server's version, its temperature, the verifier's reward
        assert (t.agent_id, t.adapter_version, t.metadata["temperature"]) == ("calc", "v0", 1.0)
        assert t.metadata["context"] == CONTEXT and t.query in {task.prompt for task in tasks}
        assert all(s.token_ids is None for s in t.steps)
    assert sorted((t.task_id, t.outcome.score) for t in text) == sorted((r.task_id, r.score) for r in results)

    _, tokenizer = store.load()
    rendered = text_training_samples(*_lake_frames(text), ["calc"], tokenizer)
    turns = [s for t in captured for s in t.steps if s.token_ids is not None]
    assert (rendered.turns, rendered.skipped, rendered.assumed_temperature) == (len(turns), [], 0)
    ids = {(tuple(s.prompt_ids), tuple(s.completion_ids)) for s in rendered.samples}
    finished = [s for s in turns if s.token_ids[-1] == tokenizer.eos_token_id]
    # a turn cut at max_tokens has no eos: the log says so (finish_reason "length"), and its
    # re-rendered ids leave out the end-of-turn token the template would close it with
    assert len(finished) < len(turns)
    assert sum(len(t.metadata.get("cut_steps", [])) for t in text) == len(turns) - len(finished)
    for step in turns:
        assert (tuple(step.prompt_token_ids), tuple(step.token_ids)) in ids
    assert all(s.temperature == 1.0 for s in rendered.samples)

    # without the context the record kept, no turn has the prompt the policy saw
    bare = [t.model_copy(update={"metadata": {k: v for k, v in t.metadata.items() if k != "context"}}) for t in text]
    again = text_training_samples(*_lake_frames(bare), ["calc"], tokenizer)
    assert not {(tuple(s.prompt_token_ids), tuple(s.token_ids)) for s in finished} & {
        (tuple(s.prompt_ids), tuple(s.completion_ids)) for s in again.samples
    }
