"""The rollout helper (``flow_assets.serving.client.rollout``) against a real gateway over HTTP on
the tiny model: the reward a verifier returns, an exception as an error trajectory, a rollout
left open landing unlabelled, and the same with gateway tokens and ``async with``."""

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest

from flow_assets.logs.schema import Trajectory
from flow_assets.policy.store import PolicyStore
from flow_assets.serving.client import RolloutClientError, rollout
from flow_assets.serving.gateway.app import GatewayConfig
from flow_assets.serving.gateway.serve import make_gateway
from flow_assets.serving.gateway.server import GatewayServer

BODY = {"model": "policy", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 3}


def _landed(root: Path) -> dict[str, Trajectory]:
    return {t.trajectory_id: t for p in root.rglob("*.jsonl") for t in map(Trajectory.model_validate_json, p.read_text().splitlines())}


def test_the_block_lands_the_reward_an_error_or_an_unlabelled_flow(fresh_policy_dir, tmp_path):
    config = GatewayConfig(rollout_timeout_s=0.5, reap_every_s=0.1, default_max_tokens=3)
    with GatewayServer(make_gateway(PolicyStore(str(fresh_policy_dir)), tmp_path, config=config)) as server:
        with rollout(server.url, task_id="t1", agent_id="helper", batch="b") as r:
            # a framework only gets a base URL and a key: every call it makes lands in the rollout
            client = openai.OpenAI(base_url=r.base_url, api_key=r.api_key)
            answer = client.chat.completions.create(**BODY).choices[0].message.content
            client.chat.completions.create(**BODY)
            r.reward(score=0.75, final_answer=answer)
        assert r.landed["llm_calls"] == 2 and r.landed["batch"] == "b"

        with pytest.raises(ZeroDivisionError):
            with rollout(server.url + "/v1", task_id="t2", batch="b") as failed:
                openai.OpenAI(base_url=failed.base_url, api_key=failed.api_key).chat.completions.create(**BODY)
                1 / 0
        assert failed.landed["error"]["kind"] == "agent_error"

        with rollout(server.url, task_id="t3", batch="b") as left:
            openai.OpenAI(base_url=left.base_url, api_key=left.api_key).chat.completions.create(**BODY)
        assert left.landed is None  # no reward, no exception: left to the gateway's idle timeout
        deadline = time.monotonic() + 20
        while httpx.get(f"{server.url}/health").json()["open_rollouts"] and time.monotonic() < deadline:
            time.sleep(0.05)  # reaped (landed in its batch, written when the gateway stops)
        with pytest.raises(ValueError, match="score or success"):
            r.reward()
        with pytest.raises(RolloutClientError, match="HTTP 400.*already exists"):
            with rollout(server.url, rollout_id=r.rollout_id):  # taken: the gateway's message names it
                pass
    landed = _landed(tmp_path)
    rewarded, errored, unlabelled = landed[r.rollout_id], landed[failed.rollout_id], landed[left.rollout_id]
    assert rewarded.outcome.score == 0.75 and rewarded.final_answer == answer and rewarded.agent_id == "helper"
    assert len(rewarded.steps) == 2 and all(len(s.token_ids) == 3 for s in rewarded.steps)
    assert errored.outcome.score == 0.0 and errored.metadata["error"]["message"] == "ZeroDivisionError: division by zero"
    assert unlabelled.outcome is None and unlabelled.metadata["unfinished"]["reason"] == "not_finished"
    assert len(unlabelled.steps) == 1


def test_async_with_and_gateway_tokens(fresh_policy_dir, tmp_path):
    async def episode(url: str) -> dict:
        async with rollout(url, token="team-a", task_id="t", batch="b") as r:
            assert r.api_key == f"team-a:{r.rollout_id}"
            client = openai.AsyncOpenAI(base_url=r.base_url, api_key=r.api_key)
            await client.chat.completions.create(**BODY)
            r.reward(success=True)
        return r.landed

    with GatewayServer(make_gateway(PolicyStore(str(fresh_policy_dir)), tmp_path), tokens=["team-a"]) as server:
        landed = asyncio.run(episode(server.url))
        with pytest.raises(RolloutClientError, match="HTTP 401"):
            with rollout(server.url, token="wrong", task_id="t"):
                pass
    assert landed["llm_calls"] == 1
    (trajectory,) = _landed(tmp_path).values()
    assert trajectory.outcome.success is True and len(trajectory.steps[0].token_ids) == 3


def test_opening_and_finishing_rollouts_builds_no_tls_context_per_rollout(fresh_policy_dir, tmp_path, monkeypatch):
    """Each client the helper makes shares one TLS context: building one costs ~21 ms of CPU,
    which two clients a rollout (open, finish) paid before, sync and ``async with`` alike."""
    import ssl

    built = []
    create = ssl.create_default_context

    def counted(*args, **kwargs):
        built.append(args or kwargs)
        return create(*args, **kwargs)

    with GatewayServer(make_gateway(PolicyStore(str(fresh_policy_dir)), tmp_path)) as server:
        with rollout(server.url, task_id="warm", batch="b") as r:  # the process's one context, if not built yet
            r.reward(score=1.0)
        monkeypatch.setattr(ssl, "create_default_context", counted)

        async def three_async() -> list:
            out = []
            for k in range(3):
                async with rollout(server.url, task_id=f"a{k}", batch="b") as a:
                    a.reward(score=0.0)
                out.append(a.landed)
            return out

        landed = asyncio.run(three_async())
        for k in range(3):
            with rollout(server.url, task_id=f"s{k}", batch="b") as s:
                s.reward(score=1.0)
            landed.append(s.landed)
    assert len(landed) == 6 and all(x is not None for x in landed)
    assert built == []
