"""Secret redaction: the rules on single lines, then a real tau-bench log with secrets planted in
tool arguments, a tool output and a user message, through the data plane: none of them survives
anywhere under the lake or in the instance's event log."""

import json
import shutil

import polars as pl
import pytest
import pyarrow.parquet as pq

from flow_assets.definitions import build_definitions
from flow_assets.runtime.local import execute_requests, tick_sensor
from flow_assets.logs.reader import parse_file
from flow_assets.logs.redact import RedactionConfig, redact_line
from resources.lake import TrajectoryLake
from tests.conftest import TAU_BENCH

OPENAI_KEY = "sk-proj-Xq3vT9sLmP2kR7wZ8yB4nC6dF1gH5jK0"
GITHUB_TOKEN = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
AWS_KEY = "AKIAIOSFODNN7EXAMPLE"
BEARER = "eyJhbGciOiJIUzI1NiJ9.c2VjcmV0.dGVzdA"
PASSWORD = "correct horse battery staple"
SECRETS = (OPENAI_KEY, GITHUB_TOKEN, AWS_KEY, BEARER, PASSWORD)
# what real logs leak besides (issue #25): each value is unique, so finding it anywhere is a leak
PEM_BODY = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7VJTUt9Us8cKj"
PEM = f"-----BEGIN PRIVATE KEY-----\n{PEM_BODY}\nMGv8p3mQ2xZ7kLw9Rt4Yb1Nc6Hs0Fd5Ue2Ia8Oj3\n-----END PRIVATE KEY-----"
JWT = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiJtaWFfbGlfMzY2OCJ9.Sfl9KxwRJSMeKKF2QT4fwpMeJf36POk6yJV"
DB_PASSWORD = "Pg-s3cr3t-9f8e"
DB_URL = f"postgres://flowopt:{DB_PASSWORD}@db.internal:5432/prod"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
GITHUB_PAT = "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEF"
SLACK = "xoxb-1234567890-0987654321-AbCdEfGhIjKlMnOp"
GITLAB = "glpat-Zx9Yw8Vu7Ts6Rq5Po4Nm"
NEW_PASSWORD, USER_PASSWORD, PASSPHRASE, PASS = "n3w-Pa55!", "us3r-Pa55!", "open sesame 42", "hunter2-pass"
LEAKS = (PEM_BODY, JWT, DB_PASSWORD, AWS_SECRET, GITHUB_PAT, SLACK, GITLAB, NEW_PASSWORD, USER_PASSWORD, PASSPHRASE, PASS)


def test_values_that_look_like_keys_are_replaced_by_kind():
    line = json.dumps({"content": f"use {OPENAI_KEY} or {GITHUB_TOKEN}; aws {AWS_KEY}; Authorization: Bearer {BEARER}"}).encode()
    out, counts = redact_line(line)
    assert not any(s.encode() in out for s in SECRETS)
    assert counts == {"openai_key": 1, "github_token": 1, "aws_access_key": 1, "bearer": 1}
    assert b"[REDACTED:openai_key]" in out and b"Authorization: [REDACTED:bearer]" in out
    assert json.loads(out)  # still valid JSON


def test_fields_named_like_secrets_are_replaced_also_inside_encoded_arguments():
    arguments = json.dumps({"user_id": "mia_li_3668", "password": PASSWORD, "Api_Key": "k-123"})
    line = json.dumps({"tool_calls": [{"function": {"arguments": arguments}}], "token": "t0k3n", "secret": ""}).encode()
    out, counts = redact_line(line)
    decoded = json.loads(out)
    args = json.loads(decoded["tool_calls"][0]["function"]["arguments"])
    assert args == {"user_id": "mia_li_3668", "password": "[REDACTED:password]", "Api_Key": "[REDACTED:api_key]"}
    assert decoded["token"] == "[REDACTED:token]" and decoded["secret"] == ""  # an empty value hides nothing
    assert counts == {"password": 1, "api_key": 1, "token": 1}


def test_numbers_and_token_id_arrays_are_never_touched_and_redaction_can_be_off():
    line = json.dumps({"token_ids": [1, 2, 3], "token": 17, "max_tokens": 256, "logprobs": [-0.5]}).encode()
    assert redact_line(line) == (line, {})
    secret = json.dumps({"password": PASSWORD}).encode()
    assert redact_line(secret, RedactionConfig(enabled=False)) == (secret, {})


def test_what_real_logs_leak_is_replaced_in_plain_and_encoded_json():
    args = json.dumps({"new_password": NEW_PASSWORD, "user_password": USER_PASSWORD, "pass": PASS, "dsn": DB_URL})
    content = (f"cat ~/.aws/credentials:\naws_secret_access_key = {AWS_SECRET}\n{PEM}\n"
               f"token {JWT}, {GITHUB_PAT}, {SLACK}, {GITLAB}")
    record = {"content": content, "passphrase": PASSPHRASE, "tool_calls": [{"function": {"arguments": args}}],
              "passenger": "Mia Li", "token_ids": [1, 2], "max_tokens": 64, "pem_in_args": json.dumps({"key": PEM})}
    out, counts = redact_line(json.dumps(record).encode())
    assert [leak for leak in LEAKS if leak.encode() in out] == []
    decoded = json.loads(out)  # still valid JSON, encoded arguments too
    assert json.loads(decoded["tool_calls"][0]["function"]["arguments"]) == {
        "new_password": "[REDACTED:new_password]", "user_password": "[REDACTED:user_password]",
        "pass": "[REDACTED:pass]", "dsn": "postgres://[REDACTED:url_credentials]@db.internal:5432/prod"}
    assert json.loads(decoded["pem_in_args"]) == {"key": "[REDACTED:pem_private_key]"}
    assert decoded["passenger"] == "Mia Li" and decoded["token_ids"] == [1, 2] and decoded["max_tokens"] == 64
    assert "aws_secret_access_key = [REDACTED:aws_secret_key]\n[REDACTED:pem_private_key]\ntoken [REDACTED:jwt]" in decoded["content"]
    assert counts == {"new_password": 1, "user_password": 1, "pass": 1, "url_credentials": 1, "pem_private_key": 2,
                      "aws_secret_key": 1, "jwt": 1, "github_token": 1, "slack_token": 1, "gitlab_token": 1, "passphrase": 1}


def test_a_truncated_pem_block_is_redacted_to_the_end_of_its_string():
    line = json.dumps({"output": PEM[:120], "next": "kept"}).encode()
    out, counts = redact_line(line)
    assert json.loads(out) == {"output": "[REDACTED:pem_private_key]", "next": "kept"} and counts == {"pem_private_key": 1}


def test_a_pattern_that_is_not_re2_is_refused_naming_its_kind():
    from flow_assets.logs.redact import Redactor

    with pytest.raises(ValueError, match="'mine'.*not valid RE2"):
        Redactor(RedactionConfig(patterns={"mine": "a(?!b)"}))


def _planted_tau_bench(path):
    runs = json.loads(TAU_BENCH.read_bytes())
    traj = runs[0]["traj"]
    call = next(m for m in traj if m.get("tool_calls"))
    args = json.loads(call["tool_calls"][0]["function"]["arguments"])
    call["tool_calls"][0]["function"]["arguments"] = json.dumps({**args, "password": PASSWORD, "api_key": OPENAI_KEY})
    output = next(m for m in traj if m["role"] == "tool")
    output["content"] += f"\nAuthorization: Bearer {BEARER}"
    user = next(m for m in traj if m["role"] == "user")
    user["content"] += f" (my aws key is {AWS_KEY}, github {GITHUB_TOKEN})"
    # and what the issue found surviving: in tool arguments (encoded JSON), a tool output, a user turn
    other = next(r["traj"] for r in runs[1:] if any(m.get("tool_calls") for m in r["traj"]))
    call = next(m for m in other if m.get("tool_calls"))
    args = json.loads(call["tool_calls"][0]["function"]["arguments"])
    extra = {"new_password": NEW_PASSWORD, "user_password": USER_PASSWORD, "passphrase": PASSPHRASE, "pass": PASS}
    call["tool_calls"][0]["function"]["arguments"] = json.dumps({**args, **extra, "dsn": DB_URL})
    output = next(m for m in other if m["role"] == "tool")
    output["content"] += f"\naws_secret_access_key={AWS_SECRET}\n{PEM}\n"
    user = next(m for m in other if m["role"] == "user")
    user["content"] += f" session {JWT}, tokens {GITHUB_PAT} {SLACK} {GITLAB}"
    path.write_text(json.dumps(runs, indent=2))


def test_no_planted_secret_survives_anywhere_under_the_lake(tmp_path, dagster_instance):
    landing, lake_root = tmp_path / "landing", tmp_path / "lake"
    (landing / "tau-bench").mkdir(parents=True)
    _planted_tau_bench(landing / "tau-bench" / TAU_BENCH.name)
    # and a canonical JSONL whose broken line (quarantined, raw bytes kept) carries a key too
    (landing / "mine").mkdir()
    valid = parse_file(TAU_BENCH).valid[0].trajectory.model_dump_json()
    (landing / "mine" / "broken.jsonl").write_text(valid + '\n{"trajectory_id": "x", "note": "' + OPENAI_KEY + '", \n')
    defs = build_definitions(str(lake_root), str(landing))
    tick = execute_requests(defs, dagster_instance, "log_batch_job", tick_sensor(defs, dagster_instance, "new_logs_sensor"))
    assert not tick.failed and len(tick.succeeded) == 2
    lake = TrajectoryLake(root=str(lake_root))
    tau = next(k for k in tick.succeeded if k.startswith("tau-bench"))
    assert lake.read_partition("trajectories", tau).height == 200  # nothing lost to redaction
    steps = lake.read_partition("steps", tau)
    assert steps.filter(pl.col("input").str.contains("REDACTED:password", literal=True)).height == 1
    assert lake.read_partition("quarantine", next(k for k in tick.succeeded if k.startswith("mine"))).height == 1
    # every byte under the lake: raw files, and the decoded contents of every Parquet table
    found = []
    for path in lake_root.rglob("*"):
        if not path.is_file():
            continue
        blobs = [path.read_bytes()]
        if path.suffix == ".parquet":
            table = pq.read_table(path)
            blobs += [json.dumps(table.to_pylist(), default=lambda b: b.decode("utf-8", "replace")).encode()]
        found += [(str(path), s) for s in SECRETS + LEAKS for blob in blobs if s.encode() in blob]
    assert found == []
    for table in ("interaction_logs", "trajectories", "steps"):  # the tables the issue found them in
        assert lake.read_partition(table, tau).height > 0
    # nor in the metadata previews Dagster keeps
    for db in (tmp_path / "dagster_home").rglob("*.db"):
        assert not any(s.encode() in db.read_bytes() for s in SECRETS + LEAKS), db
    counts = lake.read_batch_note(tau, "redaction")["redacted"]
    assert counts == {"password": 1, "api_key": 1, "bearer": 1, "aws_access_key": 1, "github_token": 2,
                      "new_password": 1, "user_password": 1, "passphrase": 1, "pass": 1, "url_credentials": 1,
                      "aws_secret_key": 1, "pem_private_key": 1, "jwt": 1, "slack_token": 1, "gitlab_token": 1}


def test_a_gzip_log_is_redacted_and_stays_gzip(tmp_path, dagster_instance):
    import gzip

    landing, lake_root = tmp_path / "landing", tmp_path / "lake"
    (landing / "tau-bench").mkdir(parents=True)
    plain = tmp_path / TAU_BENCH.name
    _planted_tau_bench(plain)
    (landing / "tau-bench" / (TAU_BENCH.name + ".gz")).write_bytes(gzip.compress(plain.read_bytes()))
    defs = build_definitions(str(lake_root), str(landing))
    tick = execute_requests(defs, dagster_instance, "log_batch_job", tick_sensor(defs, dagster_instance, "new_logs_sensor"))
    (key,) = tick.succeeded
    lake = TrajectoryLake(root=str(lake_root))
    snapshot = lake.batch_snapshot(key).read_bytes()
    assert snapshot[:2] == b"\x1f\x8b"
    text = gzip.decompress(snapshot)
    assert not any(s.encode() in text for s in SECRETS) and b"[REDACTED:password]" in text
    assert lake.read_partition("trajectories", key).height == 200
    shutil.rmtree(landing)  # the batch re-materialises from its redacted copy alone
    from flow_assets.runtime.local import run_job

    assert run_job(defs, dagster_instance, "log_batch_job", key).success


def test_a_block_of_lines_is_redacted_as_its_lines_one_by_one_and_in_parallel_the_same(tmp_path):
    import io

    from flow_assets.logs.redact import Redactor
    from resources.lake import _line_blocks

    planted = tmp_path / "planted.json"
    _planted_tau_bench(planted)
    # pretty-printed real lines with secrets, a line whose quote never closes before one with a
    # password (a member must not span the line end), and a shell `pwd` that is no field
    lines = planted.read_bytes().splitlines(keepends=True)
    lines[-1] = lines[-1].rstrip(b"\n") + b"\n"
    lines[5:5] = [b'  "note": "unclosed \\" quote,\n', b'  "password": "' + PASSWORD.encode() + b'",\n', b'"cmd": "pwd"\n']
    one_by_one = Redactor()
    expected = b"".join(one_by_one.line(line) for line in lines)
    assert PASSWORD.encode() not in expected and one_by_one.counts["password"] == 2
    whole = Redactor()
    assert whole.block(b"".join(lines)) == expected and whole.counts == one_by_one.counts
    # the snapshot's blocks through two worker processes: same bytes, same counts
    data = b"".join(lines) * 2  # several blocks of about a megabyte
    blocks = list(_line_blocks(io.BytesIO(data)))
    assert len(blocks) > 2 and all(b.endswith(b"\n") for b in blocks) and b"".join(blocks) == data
    serial, parallel = Redactor(), Redactor()
    assert b"".join(parallel.stream(blocks, workers=2)) == b"".join(serial.stream(blocks)) == expected * 2
    assert parallel.counts == serial.counts == {k: 2 * v for k, v in one_by_one.counts.items()}
