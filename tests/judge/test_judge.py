"""The scoring agent: prompts and reply parsing, the reward it feeds, and the judge served by the
flowopt gateway over real HTTP (a tiny model fine-tuned to answer in the judge's JSON)."""

import json
import random
import socket

import polars as pl
import pytest

from flow_assets.serving.gateway.serve import serve_policy
from flow_assets.logs.schema import Outcome, Step, Trajectory
from flow_assets.judge.client import (
    JudgeCache,
    JudgeError,
    JudgeSettings,
    absolute_messages,
    judge_groups_sync,
    judge_totals,
    judgement_table,
    parse_absolute,
    parse_relative,
    relative_messages,
    render_trajectory,
    request_key,
)
from flow_assets.rl.rewards import RewardConfig, reward_table

RUBRIC = "The final answer is the sum."


def _trajectory(i: int, a: int, b: int, answer: int, success: bool | None = None) -> Trajectory:
    return Trajectory(
        trajectory_id=f"{a}+{b}:{i}", task_id=f"{a}+{b}", agent_id="adder", query=f"{a}+{b}",
        steps=[Step(index=0, kind="answer", output=str(answer))], final_answer=str(answer),
        outcome=None if success is None else Outcome(success=success),
    )  # fmt: skip


# -- replies ---------------------------------------------------------------------------------------
def test_an_absolute_reply_is_read_from_json_inside_prose_and_refused_when_out_of_range():
    assert parse_absolute('Looks right.\n```json\n{"score": 0.75}\n```') == 0.75
    assert parse_absolute('{"score": 0} then {"score": 1}') == 1.0  # the last verdict counts
    for reply, why in [("8/10", 'no JSON object with a "score"'), ('{"score": 7}', r"not a number in \[0, 1\]"),
                       ('{"score": "high"}', r"not a number in \[0, 1\]"), ('{"score": true}', "not a number")]:  # fmt: skip
        with pytest.raises(JudgeError, match=why):
            parse_absolute(reply)


def test_a_relative_reply_needs_every_attempt_once():
    reply = 'Ranking: {"scores": [{"id": "2", "score": 0.1}, {"id": 1, "score": 0.9}, {"id": 3, "score": 0.5}]}'
    assert parse_relative(reply, 3) == [0.9, 0.1, 0.5]
    for reply, why in [
        ('{"scores": [{"id": 1, "score": 0.2}]}', r"no score for attempt\(s\) \[2\] of 2"),
        ('{"scores": [{"id": 1, "score": 0.2}, {"id": 1, "score": 0.3}]}', "id 1 appears twice"),
        ('{"scores": [{"id": 1, "score": 0.2}, {"id": 3, "score": 0.3}]}', "id must be an integer from 1 to 2"),
        ('{"scores": [{"id": 1, "score": 0.2}, {"id": 2, "score": -1}]}', r"scores\[id=2\].score is -1"),
        ('{"score": 0.5}', 'no JSON object with a "scores" list'),
    ]:
        with pytest.raises(JudgeError, match=why):
            parse_relative(reply, 2)


def test_the_rendering_keeps_task_and_answer_when_cut_and_the_cache_key_follows_the_request():
    long = Trajectory(
        trajectory_id="t", task_id="q", agent_id="a", query="find the flight",
        steps=[Step(index=i, kind="tool", tool="search", input={"q": i}, output="x" * 200) for i in range(50)],
        final_answer="UA 12",
    )  # fmt: skip
    text = render_trajectory(long, max_chars=1000)
    assert len(text) <= 1000 and text.startswith("Task: find the flight") and text.endswith("Final answer: UA 12")
    assert "[... cut ...]" in text and "[0] tool search" in text
    messages = relative_messages([text, text], RUBRIC)
    assert "2 attempts" in messages[0]["content"] and "Attempt 2:" in messages[1]["content"]
    settings = JudgeSettings(model="m")
    assert request_key(settings, messages) == request_key(JudgeSettings(model="m"), messages)
    assert request_key(settings, messages) != request_key(JudgeSettings(model="m", temperature=0.5), messages)
    assert request_key(settings, messages) != request_key(settings, absolute_messages(text, RUBRIC))
    with pytest.raises(ValueError, match="judge mode"):
        JudgeSettings(model="m", mode="pairwise")


def test_a_dropped_group_gets_no_reward_and_a_judged_unlabelled_one_does():
    groups = {"1+1": [_trajectory(0, 1, 1, 2, True), _trajectory(1, 1, 1, 3, False)], "2+2": [_trajectory(0, 2, 2, 4), _trajectory(1, 2, 2, 5)],
              "3+3": [_trajectory(0, 3, 3, 6, True), _trajectory(1, 3, 3, 7, False)]}  # fmt: skip
    from flow_assets.judge.client import GroupJudgement

    verdicts = [
        GroupJudgement("1+1", {"1+1:0": 0.8, "1+1:1": 0.2}),
        GroupJudgement("2+2", {"2+2:0": 1.0, "2+2:1": 0.0}),
        GroupJudgement("3+3", error="judge request failed after 2 retries: APITimeoutError"),
    ]
    trajectories = pl.DataFrame(
        [{"trajectory_id": t.trajectory_id, "task_id": t.task_id, "agent_id": t.agent_id,
          "outcome_success": t.outcome.success if t.outcome else None, "outcome_score": None} for g in groups.values() for t in g],
        schema_overrides={"outcome_score": pl.Float64, "outcome_success": pl.Boolean},
    )  # fmt: skip
    steps = pl.DataFrame({"trajectory_id": trajectories["trajectory_id"], "kind": ["answer"] * 6, "status": ["ok"] * 6})
    table = reward_table(trajectories, steps, RewardConfig.outcome_only(), judge=judgement_table(verdicts, groups))
    rows = {r["trajectory_id"]: r for r in table.to_dicts()}
    assert rows["1+1:0"]["reward"] == pytest.approx(1.8) and rows["1+1:1"]["reward"] == pytest.approx(0.2)
    assert rows["2+2:0"]["reward"] == 1.0 and rows["2+2:1"]["reward"] == 0.0  # unlabelled, judged: rewarded
    assert rows["3+3:0"]["reward"] is None and rows["3+3:1"]["reward"] is None  # dropped: no reward, not zero
    assert rows["3+3:0"]["judge_error"].startswith("judge request failed")
    weighted = reward_table(trajectories, steps, RewardConfig(tool_success=0, verify=0, step_penalty=0, judge=0.5), judge=judgement_table(verdicts, groups))
    assert weighted.filter(pl.col("trajectory_id") == "1+1:0")["r_judge"].item() == 0.4
    plain = reward_table(trajectories, steps, RewardConfig.outcome_only())
    assert plain["judge_error"].null_count() == 6 and plain["r_judge"].null_count() == 6
    assert plain.filter(pl.col("task_id") == "2+2")["reward"].null_count() == 2  # unlabelled, no judge
    assert judge_totals(verdicts)["groups_dropped"] == 1


# -- a judge served by the flowopt gateway, over real HTTP --------------------------------------------
class _JudgeDemonstrations:
    """Judge conversations to fine-tune a tiny model on: adder trajectories graded in absolute
    mode, with the verdict the prompt asks for (1 when the answer is the sum). Relative replies
    are longer than a tiny model learns in seconds, so the relative path is tested over HTTP as
    the refusal it then is (and its parsing on its own, above)."""

    tools = None

    def __init__(self, n: int, seed: int = 0):
        rng, self.items = random.Random(seed), []
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            good = rng.random() < 0.5
            t = _trajectory(0, a, b, a + b if good else a + b + rng.randint(1, 5))
            reply = {"score": int(good)}
            self.items.append([*absolute_messages(render_trajectory(t), RUBRIC), {"role": "assistant", "content": json.dumps(reply)}])

    def tasks(self, split=None):
        return list(range(len(self.items)))

    def demonstration(self, task):
        return self.items[task]


@pytest.fixture(scope="module")
def judge_policy_dir(tmp_path_factory):
    from flow_assets.policy.sft import SFTConfig
    from flow_assets.policy.store import PolicyStore
    from flow_assets.policy.tiny_model import TinyModelConfig
    from flow_assets.training.rounds import build_base_policy
    from resources.registry import AdapterRegistry

    root = tmp_path_factory.mktemp("judge_policy")
    result = build_base_policy(
        PolicyStore(str(root)), AdapterRegistry(root=str(root)), _JudgeDemonstrations(200), TinyModelConfig(max_position_embeddings=512),
        SFTConfig(steps=40, batch_size=8), 200, by="test",
    )  # fmt: skip
    assert result.final_loss < 0.5, result  # it answers in the judge's JSON
    return root


def _groups(n: int, seed: int) -> dict[str, list[Trajectory]]:
    rng, groups = random.Random(seed), {}
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        groups[f"{a}+{b}"] = [_trajectory(0, a, b, a + b, True), _trajectory(1, a, b, a + b + 2, False)]
    return groups


@pytest.mark.slow
def test_the_gateway_as_judge_scores_groups_counts_tokens_and_cost_and_caches(judge_policy_dir, tmp_path):
    from flow_assets.policy.store import PolicyStore

    groups = _groups(6, seed=1)
    settings = JudgeSettings(model="policy", mode="absolute", rubric=RUBRIC, max_tokens=24, concurrency=4, input_usd_per_mtok=2.0, output_usd_per_mtok=8.0)
    relative = JudgeSettings(model="policy", mode="relative", rubric=RUBRIC, max_tokens=24)
    cache = JudgeCache(tmp_path / "cache")
    with serve_policy(PolicyStore(str(judge_policy_dir)), tmp_path / "landing") as server:
        first = judge_groups_sync(groups, settings, server.url + "/v1", "unused", cache)
        again = judge_groups_sync(groups, settings, server.url + "/v1", "unused", cache)
        ranked = judge_groups_sync(groups, relative, server.url + "/v1", "unused", cache)
    totals = judge_totals(first)
    assert totals["calls"] == 2 * len(groups) and totals["cached"] == 0  # one request per trajectory
    assert totals["groups_scored"] >= len(groups) // 2, [v.error for v in first]  # the fine-tuned judge mostly answers in JSON
    for verdict in first:
        if verdict.error is None:
            assert set(verdict.scores) == {t.trajectory_id for t in groups[verdict.task_id]}
            assert all(0.0 <= s <= 1.0 for s in verdict.scores.values())
        else:
            assert verdict.scores == {} and "reply" in verdict.error
    assert totals["prompt_tokens"] > 100 * totals["calls"] and totals["completion_tokens"] > 0
    assert totals["cost_usd"] == pytest.approx((2.0 * totals["prompt_tokens"] + 8.0 * totals["completion_tokens"]) / 1e6)
    # the second pass: every reply that parsed comes from the cache, only failures are asked again
    repeat = judge_totals(again)
    assert repeat["cached"] >= 2 * totals["groups_scored"] and repeat["calls"] + repeat["cached"] == 2 * len(groups)
    assert [v.scores for v in again if v.error is None] == [v.scores for v in first if v.error is None]
    # relative mode: one request per group, whose reply this judge cannot give: every group dropped
    assert judge_totals(ranked)["calls"] == len(groups)
    assert all(v.scores == {} and 'no JSON object with a "scores" list' in v.error for v in ranked)


def test_an_unreachable_judge_drops_every_group_with_the_reason(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    groups = _groups(3, seed=2)
    verdicts = judge_groups_sync(groups, JudgeSettings(model="m", max_retries=0, timeout_s=5), f"http://127.0.0.1:{port}/v1", "k", JudgeCache(tmp_path))
    assert [v.error is not None for v in verdicts] == [True] * 3
    assert all("judge request failed after 0 retries: APIConnectionError" in v.error for v in verdicts)
    table = judgement_table(verdicts, groups)
    assert table["judge_score"].null_count() == 6 and table["judge_error"].null_count() == 0
    assert not list(tmp_path.rglob("*.json"))  # failures are never cached


@pytest.mark.slow
def test_the_rewards_asset_asks_the_judge_and_drops_what_it_cannot_score(judge_policy_dir, shared_data, tmp_path):
    """Through Dagster: a landed batch of adder answers is judged by the gateway; the real tau-bench
    log, far longer than the tiny judge's context, is refused by it (HTTP 400), so all its groups
    are dropped with the reason and get no reward and no advantage, never a zero."""
    import shutil

    from dagster import AssetKey, instance_for_test

    from flow_assets.definitions import build_definitions
    from flow_assets.runtime.local import execute_requests, tick_sensor
    from flow_assets.policy.store import PolicyStore
    from resources.judge import JudgeEndpoint

    landing = tmp_path / "landing"
    landing.mkdir()
    lines = [t.model_dump_json() for g in _groups(5, seed=3).values() for t in g]
    (landing / "adder.jsonl").write_text("\n".join(lines) + "\n")
    shutil.copy(shared_data / "tau-bench" / "gpt-4o-airline.json", landing / "tau-bench.json")
    (tmp_path / "home").mkdir()
    with serve_policy(PolicyStore(str(judge_policy_dir)), tmp_path / "judge-landing") as server:
        judge = JudgeEndpoint(base_url=server.url + "/v1", model="policy", mode="absolute", rubric=RUBRIC, max_tokens=24, max_retries=0,
                              cache_dir=str(tmp_path / "cache"))  # fmt: skip
        defs = build_definitions(str(tmp_path / "lake"), str(landing), models_root=str(tmp_path / "models"), settle_seconds=0, judge=judge)
        with instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
            done = execute_requests(defs, instance, "log_batch_job", tick_sensor(defs, instance, "new_logs_sensor"))
            assert len(done.succeeded) == 2 and not done.failed
            meta = {}
            for key in done.succeeded:
                record = instance.fetch_materializations(AssetKey("rewards"), limit=10).records
                meta[key] = next(r.asset_materialization.metadata for r in record if r.partition_key == key)
    from resources.lake import TrajectoryLake

    lake = TrajectoryLake(root=str(tmp_path / "lake"))
    adder_key = next(k for k in done.succeeded if k.startswith("adder"))
    tau_key = next(k for k in done.succeeded if k.startswith("tau-bench"))
    adder, tau = lake.read_partition("rewards", adder_key), lake.read_partition("rewards", tau_key)
    assert meta[adder_key]["judge_requests"].value == 10 and meta[adder_key]["judge_model"].value == "policy"
    assert meta[adder_key]["judge_groups_scored"].value + meta[adder_key]["judge_groups_dropped"].value == 5
    scored = adder.filter(pl.col("judge_error").is_null())
    assert scored.height >= 4 and scored["r_judge"].is_between(0, 1).all()
    assert (scored["reward"] - scored["r_outcome"] - scored["r_judge"] - scored["r_tool_success"] - scored["r_verify"]
            - scored["r_step_penalty"] - scored["r_custom"]).abs().max() < 1e-9  # fmt: skip
    # tau-bench: 50 tasks x 4 trials, each trajectory's prompt longer than the judge's 512 tokens
    assert meta[tau_key]["judge_groups_dropped"].value == 50 and meta[tau_key]["judge_groups_scored"].value == 0
    assert "context_length_exceeded" in meta[tau_key]["judge_dropped"].value or "maximum context length" in meta[tau_key]["judge_dropped"].value
    assert tau["reward"].null_count() == tau.height == 200 and tau["judge_error"].null_count() == 0
    advantages = lake.read_partition("advantages", tau_key)
    assert advantages["advantage"].null_count() == advantages.height  # no gradient from a dropped group
