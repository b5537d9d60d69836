"""JSON-RPC 2.0 framing of the training API: every error code, batches, notifications, and no
stack trace ever reaching the caller."""

import json

from pydantic import BaseModel, Field

from flow_assets.api.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR, UNKNOWN_JOB, Dispatcher, RpcError


class StatusParams(BaseModel):
    job_id: str = Field(min_length=1)
    verbose: bool = False


def _dispatcher() -> tuple[Dispatcher, list]:
    rpc, seen = Dispatcher(), []

    @rpc.method("training.get_status", StatusParams)
    def get_status(p: StatusParams):
        seen.append(p.job_id)
        if p.job_id == "boom":
            raise RuntimeError("secret internals /etc/passwd")
        if p.job_id != "j1":
            raise RpcError(UNKNOWN_JOB, f"unknown job {p.job_id!r}")
        return {"job_id": p.job_id, "state": "running", "verbose": p.verbose}

    return rpc, seen


def _call(rpc: Dispatcher, payload) -> object:
    body = rpc.handle(payload if isinstance(payload, bytes) else json.dumps(payload).encode())
    return None if body is None else json.loads(body)


def test_a_call_by_name_or_by_position_returns_its_result_with_the_same_id():
    rpc, _ = _dispatcher()
    assert _call(rpc, {"jsonrpc": "2.0", "method": "training.get_status", "params": {"job_id": "j1"}, "id": 7}) == {
        "jsonrpc": "2.0", "result": {"job_id": "j1", "state": "running", "verbose": False}, "id": 7}  # fmt: skip
    by_position = _call(rpc, {"jsonrpc": "2.0", "method": "training.get_status", "params": ["j1", True], "id": "a"})
    assert by_position["result"]["verbose"] is True and by_position["id"] == "a"


def test_each_error_code_and_a_named_field():
    rpc, _ = _dispatcher()
    assert _call(rpc, b"{not json")["error"]["code"] == PARSE_ERROR
    assert _call(rpc, b"\xff\xfe")["error"]["code"] == PARSE_ERROR
    for bad in [{"method": "training.get_status", "id": 1}, {"jsonrpc": "2.0", "method": 5, "id": 1}, "text",
                {"jsonrpc": "2.0", "method": "m", "params": 3, "id": 1}, {"jsonrpc": "2.0", "method": "m", "id": [1]}]:  # fmt: skip
        assert _call(rpc, bad)["error"]["code"] == INVALID_REQUEST, bad
    assert _call(rpc, [])["error"]["code"] == INVALID_REQUEST
    missing = _call(rpc, {"jsonrpc": "2.0", "method": "training.nope", "id": 1})["error"]
    assert missing["code"] == METHOD_NOT_FOUND and "training.get_status" in missing["data"]["methods"]
    invalid = _call(rpc, {"jsonrpc": "2.0", "method": "training.get_status", "params": {"job_id": "", "verbose": "maybe"}, "id": 1})["error"]
    assert invalid["code"] == INVALID_PARAMS and {e["field"] for e in invalid["data"]["errors"]} == {"job_id", "verbose"}
    assert "job_id" in invalid["message"]
    too_many = _call(rpc, {"jsonrpc": "2.0", "method": "training.get_status", "params": ["j1", True, 3], "id": 1})["error"]
    assert too_many["code"] == INVALID_PARAMS
    unknown = _call(rpc, {"jsonrpc": "2.0", "method": "training.get_status", "params": {"job_id": "j9"}, "id": 1})["error"]
    assert unknown == {"code": UNKNOWN_JOB, "message": "unknown job 'j9'"}


def test_an_unexpected_failure_is_an_internal_error_with_an_id_and_no_trace(caplog):
    rpc, _ = _dispatcher()
    response = _call(rpc, {"jsonrpc": "2.0", "method": "training.get_status", "params": {"job_id": "boom"}, "id": 1})
    error = response["error"]
    assert error["code"] == INTERNAL_ERROR and error["message"] == "internal error"
    assert "passwd" not in json.dumps(response) and "Traceback" not in json.dumps(response)
    assert error["data"]["error_id"] in caplog.text and "passwd" in caplog.text  # the server log has it


def test_a_batch_answers_each_call_and_notifications_get_no_answer():
    rpc, seen = _dispatcher()
    batch = [
        {"jsonrpc": "2.0", "method": "training.get_status", "params": {"job_id": "j1"}, "id": 1},
        {"jsonrpc": "2.0", "method": "training.get_status", "params": {"job_id": "j1"}},  # a notification
        {"jsonrpc": "2.0", "method": "training.nope", "id": 2},
        1,
    ]
    responses = _call(rpc, batch)
    assert [r.get("id") for r in responses] == [1, 2, None]
    assert [r["error"]["code"] for r in responses[1:]] == [METHOD_NOT_FOUND, INVALID_REQUEST]
    assert seen == ["j1", "j1"]  # the notification ran
    assert _call(rpc, [{"jsonrpc": "2.0", "method": "training.get_status", "params": {"job_id": "j1"}}]) is None
    assert _call(rpc, {"jsonrpc": "2.0", "method": "training.get_status", "params": {"job_id": "boom"}}) is None


def test_a_batch_over_the_limit_is_refused_whole_and_nothing_runs():
    rpc, seen = Dispatcher(max_batch=3), []
    rpc.method("training.get_status", StatusParams)(lambda p: seen.append(p.job_id))
    call = {"jsonrpc": "2.0", "method": "training.get_status", "params": {"job_id": "j1"}, "id": 1}
    refused = _call(rpc, [call] * 4)
    assert refused["error"]["code"] == INVALID_REQUEST and refused["id"] is None and "limit of 3" in refused["error"]["message"]
    assert seen == []
    assert len(_call(rpc, [call] * 3)) == 3 and seen == ["j1"] * 3


def test_deep_nesting_is_a_parse_error_and_no_message_names_a_server_file():
    rpc, _ = _dispatcher()
    assert _call(rpc, b"[" * 200_000 + b"]" * 200_000)["error"]["code"] == PARSE_ERROR  # RecursionError in json.loads before

    @rpc.method("training.cancel", StatusParams)
    def cancel(p: StatusParams):
        raise RpcError(UNKNOWN_JOB, "no job in '/srv/flowopt/lake/trajectories/batch=k/data.parquet' (see http://host:3000/runs)")

    error = _call(rpc, {"jsonrpc": "2.0", "method": "training.cancel", "params": {"job_id": "j"}, "id": 1})["error"]
    assert error["message"] == "no job in '<path>' (see http://host:3000/runs)"
