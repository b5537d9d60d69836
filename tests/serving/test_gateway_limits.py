"""Request limits and authentication of the gateway over real HTTP on 127.0.0.1 (issue #25):
size cap (413, decided from Content-Length before reading, or while a chunked body streams),
body read timeout (408), JSON nesting (400), 64-bit seeds (400), bearer tokens (401 before the
body is read, /metrics included), no filesystem path in an error, and `flowopt serve` refusing to
listen beyond loopback without tokens."""

import json
import socket

import httpx
import openai
import pytest

from flow_assets.serving.gateway.app import GatewayConfig, scrub_paths
from flow_assets.serving.gateway.guard import RequestLimits, json_depth
from flow_assets.serving.gateway.serve import make_gateway, serve_policy
from flow_assets.serving.gateway.server import GatewayServer, check_bind, gateway_tokens, is_loopback
from flow_assets.policy.store import PolicyStore
from flow_assets.settings import Settings
from tests.conftest import run_cli

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}


def _raw(url: str, head: bytes, body: bytes = b"", timeout: float = 30.0) -> tuple[int, dict]:
    """Send ``head`` (request line + headers) and ``body`` on one socket; the status and JSON of the
    answer (read until the server closes)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1] or b"{}")


def test_size_cap_413_before_reading_and_while_streaming_and_a_trickling_body_408(fresh_policy_dir, tmp_path):
    config = GatewayConfig(limits=RequestLimits(max_body_bytes=64 * 1024, body_timeout_s=0.5))
    with serve_policy(PolicyStore(str(fresh_policy_dir)), tmp_path, config=config) as server:
        # 50 MB declared: refused from the headers alone, with nothing of the body sent
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 50000000\r\n\r\n"
        status, answer = _raw(server.url, head)
        assert status == 413 and answer["error"]["code"] == "body_too_large"
        # chunked (no length declared): refused once what arrived passes the cap, not read to its end
        chunked = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        piece = b"a" * 32768
        status, answer = _raw(server.url, chunked, (b"%x\r\n" % len(piece) + piece + b"\r\n") * 3)
        assert status == 413
        # a body that stops arriving is answered 408, the connection closed; others are served meanwhile
        slow = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        status, answer = _raw(server.url, slow, b'{"model": ')
        assert status == 408 and answer["error"]["code"] == "body_timeout"
        ok = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
        assert ok.status_code == 200, ok.text


def test_deep_nesting_and_huge_seeds_are_400_never_500(fresh_policy_dir, tmp_path):
    with serve_policy(PolicyStore(str(fresh_policy_dir)), tmp_path) as server, httpx.Client(base_url=server.url) as client:
        deep = b'{"model": "policy", "messages": [{"role": "user", "content": "a"}], "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        reply = client.post("/v1/chat/completions", content=deep, headers={"content-type": "application/json"})
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "json_too_deep"
        # 900 levels: under the JSON decoder's own limit, over what a trajectory can be written with
        client.post("/rollouts", json={"rollout_id": "r", "task_id": "t"})
        finish = b'{"success": true, "metadata": {"a": ' + b"[" * 900 + b"]" * 900 + b"}}"
        reply = client.post("/rollouts/r/finish", content=finish, headers={"content-type": "application/json"})
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "json_too_deep"
        assert client.post("/rollouts/r/finish", json={"success": True}).status_code == 200  # the rollout is still there
        for seed in (2**64, 2**200, -(2**63) - 1):
            reply = client.post("/v1/chat/completions", json={**CHAT, "seed": seed})
            error = reply.json()["error"]
            assert reply.status_code == 400 and error["param"] == "seed" and "922337203685477580" in error["message"], reply.text
        assert client.post("/v1/chat/completions", json={**CHAT, "seed": 2**63 - 1}).status_code == 200
        # a prompt far beyond the context is refused before it is tokenised
        huge = {**CHAT, "messages": [{"role": "user", "content": "ab " * 1_000_000}]}
        reply = client.post("/v1/chat/completions", json=huge)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
        # a rollout whose only call is refused names the version that refused it (a live A/B counts it)
        long = {**CHAT, "messages": [{"role": "user", "content": "1+1 " * 100}]}
        reply = client.post("/rollouts/long-1/v1/chat/completions", json=long)
        assert reply.status_code == 400 and reply.headers["X-Flowopt-Adapter-Version"] == "v0", reply.text
        batch = client.post("/rollouts/long-1/finish", json={"task_id": "t", "error": "BadRequestError 400"}).json()["batch"]
        landed = client.post(f"/batches/{batch}/close").json()["path"]
        (record,) = [r for r in map(json.loads, open(landed)) if r["trajectory_id"] == "long-1"]
        assert record["adapter_version"] == "v0" and record["metadata"]["failed_calls"][0]["status"] == 400
        assert "maximum context length" in record["metadata"]["failed_calls"][0]["message"]
        # an image is refused, naming where it is, not dropped; text parts are read
        parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]
        reply = client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": parts}]})
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == "messages.0.content" and "'image_url'" in error["message"], reply.text
        assert client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": parts[:1]}]}).status_code == 200
    assert json_depth({"a": [1, {"b": []}]}) == 4 and json_depth(5) == 0


def test_tokens_are_asked_before_the_body_and_cover_metrics(fresh_policy_dir, tmp_path):
    gateway = make_gateway(PolicyStore(str(fresh_policy_dir)), tmp_path)
    with GatewayServer(gateway, tokens=["s3cret", "other"]) as server:
        url = server.url
        assert httpx.get(url + "/health").status_code == 200  # liveness probes need none
        for path in ("/metrics", "/v1/models", "/openapi.json", "/docs"):
            reply = httpx.get(url + path)
            assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer", path
        assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        # a 50 MB body without a token: 401 from the headers, the body never read
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 50000000\r\n\r\n"
        status, answer = _raw(url, head)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(**CHAT)
        reply = openai.OpenAI(base_url=url + "/v1", api_key="other", max_retries=0).chat.completions.create(**CHAT)
        assert reply.choices[0].message is not None
        assert "flowopt_gateway_requests_total" in httpx.get(url + "/metrics", headers={"Authorization": "Bearer s3cret"}).text


def test_no_listening_beyond_loopback_without_tokens_and_no_paths_in_errors(fresh_policy_dir, tmp_path):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("")
    check_bind("0.0.0.0", ["t"])
    with pytest.raises(ValueError, match="FLOWOPT_GATEWAY_TOKENS"):
        check_bind("0.0.0.0", [])
    with pytest.raises(ValueError):
        GatewayServer(make_gateway(PolicyStore(str(fresh_policy_dir)), tmp_path), host="0.0.0.0")
    rc, _, err = run_cli(["serve", "--models", fresh_policy_dir, "--landing", tmp_path, "--host", "0.0.0.0"])
    assert rc == 2 and "refusing to listen on '0.0.0.0' without bearer tokens" in err
    tokens = tmp_path / "tokens"
    tokens.write_text("# ops\nalpha\n\n  beta  \n")
    assert gateway_tokens(tokens, Settings.from_environ({"FLOWOPT_GATEWAY_TOKENS": "x, y,"})) == ["x", "y", "alpha", "beta"]
    rc, _, err = run_cli(["serve", "--models", fresh_policy_dir, "--host", "0.0.0.0", "--tokens-file", tmp_path / "missing"])
    assert rc == 2 and "--tokens-file" in err
    # an error text that would name a file of the server's names none
    assert scrub_paths(f"cannot open {tmp_path}/models/adapters/v3 (errno 2)") == "cannot open <path> (errno 2)"
    assert scrub_paths("The model 'v9' does not exist; this gateway serves: policy, v0") == "The model 'v9' does not exist; this gateway serves: policy, v0"
    with serve_policy(PolicyStore(str(fresh_policy_dir)), tmp_path / "landing") as server:
        # an unexpected failure deep inside (here: the landing directory became a file) is an id, not a path
        httpx.post(server.url + "/rollouts", json={"rollout_id": "r", "task_id": "t", "source": "blocked"})
        (tmp_path / "landing").mkdir(exist_ok=True)
        (tmp_path / "landing" / "blocked").write_text("not a directory")
        reply = httpx.post(server.url + "/rollouts/r/finish", json={"success": True})
        assert reply.status_code == 500 and str(tmp_path) not in reply.text and "internal error" in reply.json()["error"]["message"]
        assert str(tmp_path) not in httpx.get(server.url + "/health").text
