"""docs/gateway.md's support table, row by row, against a real gateway over HTTP: every field the
table says is honoured or ignored is accepted, every field it says is refused gets a 400 naming
it in its API's error shape. The table is the documentation users read; this keeps it true."""

import json
import re
from pathlib import Path

import httpx

from flow_assets.policy.store import PolicyStore
from flow_assets.serving.gateway.serve import serve_policy

DOC = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"
ROW = re.compile(r"^\| (chat|responses|messages) \| `(.+)` \| (honoured|ignored|refused: `([^`]+)`) \|$")
BASE = {
    "chat": ("/v1/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 2}),
    "responses": ("/v1/responses", {"model": "policy", "input": "ab", "max_output_tokens": 2}),
    "messages": ("/v1/messages", {"model": "policy", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 2}),
}


def support_rows() -> list[tuple[str, dict, str, str | None]]:
    """``(api, fields, treatment, refused field)`` per row of the support table."""
    rows = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if match := ROW.match(line):
            api, fields, treatment, field = match.groups()
            rows.append((api, json.loads(fields), treatment.split(":")[0], field))
    return rows


def _named(api: str, body: dict) -> str | None:
    """The field an error names: ``param`` (OpenAI's shape) or the message's leading field (Anthropic's)."""
    if api == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return body["error"]["message"].split(":")[0]
    return body["error"]["param"]


def test_every_row_of_the_support_table_holds(fresh_policy_dir, tmp_path):
    rows = support_rows()
    # the table covers every API, each with fields honoured and refused
    assert {(api, t) for api, _, t, _ in rows} >= {(a, t) for a in BASE for t in ("honoured", "refused")}, rows
    failures = []
    with serve_policy(PolicyStore(str(fresh_policy_dir)), tmp_path) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        for api, fields, treatment, field in rows:
            path, base = BASE[api]
            reply = client.post(path, json={**base, **fields})
            if treatment == "refused":
                named = _named(api, reply.json()) if reply.status_code == 400 else None
                if reply.status_code != 400 or named != field:
                    failures.append(f"{api} {fields}: expected 400 naming {field!r}, got {reply.status_code} naming {named!r}: {reply.text[:200]}")
            elif reply.status_code != 200:
                failures.append(f"{api} {fields}: expected 200 ({treatment}), got {reply.status_code}: {reply.text[:200]}")
    assert not failures, "\n".join(failures)
