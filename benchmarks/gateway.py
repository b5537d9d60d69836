"""The gateway: agents over HTTP against the in-process gateway, on the tiny model.

1. ``8 vs 1``: the built-in calculator agent (two LLM calls and a tool call per rollout) on one
   task, 8 rollouts at once against 1, through the gateway over real HTTP with the ``openai``
   client, timed alternately. Goal (the issue): 8 cost at most 1.3x one, i.e. the gateway batches
   concurrent agents' calls into shared forward passes.
2. ``overhead``: 8 concurrent chat completions through the gateway (one per agent, 32 tokens at
   T = 1, fresh model so nearly every completion runs to its cap) against sampling the same 8
   rendered prompts in process with :func:`~flow_assets.policy.sampling.sample_token_ids` at
   batch 8. Goal: at most 10% more time through the gateway.
   The same comparison is repeated with a model of SmolLM2-135M's shape (30 layers, width 576,
   built from a config with random weights and the character tokenizer): what the per-call cost
   is worth when sampling costs what a real small model's does on this CPU.
3. ``throughput``: chat completions per second through the gateway with 8, 64 and 256 agents
   calling at once (8 tokens each), and in process at the same batch sizes.
4. ``streaming``: the same 8 concurrent calls as ``overhead`` (32 tokens each, fresh model),
   streamed (``stream: true``) and not, alternately: per call, the time to its first content
   token (streamed: the first chunk with content; not streamed: the whole response) and to its
   last token (the response's end). Streaming should move the first token to about one
   decoding step after the prefill while costing little at the last.
5. ``smollm2``: sampling tokens/s of the real pretrained model (SmolLM2-135M-Instruct, the
   ``smollm2`` extra; skipped without it and in quick runs): the real-model demo's word-problem
   agents (two worked examples, the calculator tool, up to 3 LLM calls each) on 64 train tasks at
   once through the gateway at T = 0.5, completion tokens per second of wall time; and the same
   64 first-turn prompts sampled in process in one batch (48 new tokens at most).
6. ``constrained``: the per-token cost of constrained decoding (``response_format`` /
   ``tool_choice``, :mod:`flow_assets.policy.constrained`) on the tiny model: 8 rows decoded by
   the continuous decoder to at most 48 tokens, each constrained to a small JSON schema (an
   llguidance mask before every draw, the token fed to the matcher after it, and the row's
   closing budget as the gateway gives it: the schema's shortest object is 45 characters, so the
   budget works at every step of these rows, its worst case) against the same
   rows unconstrained, decoded to their cap (no end token: a random model's rows would otherwise
   end at random, and rows that ended still ride along until they are dropped, which would charge
   the unconstrained run for tokens it never samples); milliseconds per sampled token (wall time
   over tokens: row-steps) and per step.

Everything runs in this process with the harness's clients (real sockets on 127.0.0.1): the
client side (``openai``, ``httpx2``) shares the interpreter with the server, as in the
collection job.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import tempfile
import time
from pathlib import Path

import httpx2
import openai
import torch

from benchmarks.common import REPO_ROOT, ratio, real_model_threads, summarize
from flow_assets.serving.gateway.serve import serve_policy

FULL = {"pairs": 15, "overhead_repeats": 20, "overhead_repeats_135m": 5, "throughput_calls": 512, "sft_steps": 200, "streaming_repeats": 10, "constrained_repeats": 10}
QUICK = {"pairs": 1, "overhead_repeats": 1, "overhead_repeats_135m": 0, "throughput_calls": 16, "sft_steps": 10, "streaming_repeats": 1, "constrained_repeats": 1}
#: SmolLM2-135M-Instruct's shape (its config: 30 layers, hidden 576, MLP 1536, 9 heads), with the
#: character vocabulary; no grouped-query attention (the tiny model's builder has none), so a
#: little more attention compute than the real one
SIZE_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9}
CONCURRENCY = (8, 64, 256)
CONSTRAINED_ROWS, CONSTRAINED_TOKENS = 8, 48
#: a flat JSON object of bounded length (about 45 characters: the tiny model writes one per token)
TRIP_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
                   "direct": {"type": "boolean"}},
    "required": ["city", "days", "direct"],
    "additionalProperties": False,
}  # fmt: skip
OVERHEAD_TOKENS = 32
THROUGHPUT_TOKENS = 8


def _policy(root: Path, sft_steps: int, size: dict | None = None):
    from flow_assets.policy.sft import SFTConfig
    from flow_assets.policy.store import PolicyStore
    from flow_assets.policy.tiny_model import TinyModelConfig
    from flow_assets.training.rounds import build_base_policy
    from flow_assets.tasks.calculator import CalculatorSource
    from resources.registry import AdapterRegistry

    store = PolicyStore(str(root))
    build_base_policy(store, AdapterRegistry(root=str(root)), CalculatorSource(), TinyModelConfig(**(size or {})), SFTConfig(steps=sft_steps),
                      500 if sft_steps else 1, by="benchmark")  # fmt: skip
    return store


def agents_8_vs_1(store, pairs: int) -> dict:
    """Seconds for 8 calculator agents and for 1 on the same task, alternating (after a warm-up)."""
    from flow_assets.serving.agents.builtin import calculator_agent
    from flow_assets.serving.agents.harness import HarnessConfig, run_rollouts
    from flow_assets.tasks.calculator import CalculatorSource

    source = CalculatorSource()
    task = source.tasks("train")[:1]
    config = HarnessConfig(land=False)
    calls = {1: [], 8: []}
    with serve_policy(store, store.models_root) as server:

        def once(group: int) -> float:
            started = time.perf_counter()
            results = asyncio.run(run_rollouts(server.url, calculator_agent, task, source.score, group, agent_id="bench", config=config))
            calls[group].append(sum(r.llm_calls for r in results) / group)
            return time.perf_counter() - started

        once(8), once(1)
        eight, one = [], []
        for _ in range(pairs):
            eight.append(once(8))
            one.append(once(1))
    r = ratio(summarize(eight)["median"], summarize(one)["median"])
    return {"seconds_8": summarize(eight), "seconds_1": summarize(one), "ratio_8_over_1": r, "goal": "<= 1.3",
            "meets_goal": r <= 1.3, "llm_calls_per_rollout": {str(k): sum(v) / len(v) for k, v in calls.items()}}  # fmt: skip


async def _clients(stack: contextlib.AsyncExitStack, url: str, count: int) -> list[openai.AsyncOpenAI]:
    """``count`` agents' own clients (one HTTP connection pool each, one TLS context shared),
    closed with ``stack``."""
    tls = ssl.create_default_context()
    clients = []
    for _ in range(count):
        http = await stack.enter_async_context(httpx2.AsyncClient(verify=tls))
        clients.append(openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", http_client=http, max_retries=0))
    return clients


async def _concurrent_calls(url: str, prompts: list[str], calls_each: int, max_tokens: int) -> float:
    """``len(prompts)`` clients calling at once, each ``calls_each`` times in sequence; wall
    seconds of the calls. The clock starts once every client exists: building them (a TLS context,
    ~20 ms on 2 cores, and ~1 ms per client) is the clients' cost, not the gateway's, as loading
    the model is not timed in process."""
    async with contextlib.AsyncExitStack() as stack:
        clients = await _clients(stack, url, len(prompts))

        async def agent(client: openai.AsyncOpenAI, prompt: str) -> None:
            for _ in range(calls_each):
                await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens)

        started = time.perf_counter()
        await asyncio.gather(*(agent(c, p) for c, p in zip(clients, prompts)))
        return time.perf_counter() - started


def _in_process(store, prompts: list[str], max_tokens: int, repeats: int) -> list[float]:
    from flow_assets.policy.chat import render_prompt
    from flow_assets.policy.sampling import SamplingConfig, sample_token_ids

    model, tokenizer = store.load(str(store.adapter_dir("v0")))
    ids = [render_prompt(tokenizer, [{"role": "user", "content": p}])[1] for p in prompts]
    seconds = []
    for k in range(repeats + 1):
        started = time.perf_counter()
        sample_token_ids(model, tokenizer, ids, SamplingConfig(num_samples=1, max_new_tokens=max_tokens, seed=k))
        seconds.append(time.perf_counter() - started)
    return seconds[1:]  # the first call warms up


def overhead(store, repeats: int) -> dict:
    """8 concurrent calls through the gateway vs one in-process batch of the same 8 prompts."""
    prompts = [f"{100 + k}*{10 + k}" for k in range(8)]
    with serve_policy(store, store.models_root) as server:
        asyncio.run(_concurrent_calls(server.url, prompts, 1, OVERHEAD_TOKENS))
        gateway = [asyncio.run(_concurrent_calls(server.url, prompts, 1, OVERHEAD_TOKENS)) for _ in range(repeats)]
    direct = _in_process(store, prompts, OVERHEAD_TOKENS, repeats)
    g, d = summarize(gateway), summarize(direct)
    extra = ratio(g["median"], d["median"]) - 1
    return {"gateway_seconds": g, "in_process_seconds": d, "overhead": extra, "overhead_ms_per_call": (g["median"] - d["median"]) * 1000 / 8,
            "goal": "<= 0.10", "meets_goal": extra <= 0.10}  # fmt: skip


async def _timed_calls(url: str, prompts: list[str], max_tokens: int, stream: bool) -> list[tuple[float, float]]:
    """One call per prompt, all at once: ``(seconds to the first content token, seconds to the
    last)`` per call, from when the calls start."""
    async with contextlib.AsyncExitStack() as stack:
        clients = await _clients(stack, url, len(prompts))

        async def call(client: openai.AsyncOpenAI, prompt: str) -> tuple[float, float]:
            kwargs = dict(model="policy", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens)
            if not stream:
                await client.chat.completions.create(**kwargs)
                done = time.perf_counter() - started
                return done, done
            first = None
            async for chunk in await client.chat.completions.create(**kwargs, stream=True):
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - started
            done = time.perf_counter() - started
            return (first if first is not None else done), done

        started = time.perf_counter()
        return list(await asyncio.gather(*(call(c, p) for c, p in zip(clients, prompts))))


def streaming(store, repeats: int) -> dict:
    """Time to first and last token per call, streamed and not (module docstring, 4)."""
    prompts = [f"{100 + k}*{10 + k}" for k in range(8)]
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    with serve_policy(store, store.models_root) as server:
        for stream in (False, True):
            asyncio.run(_timed_calls(server.url, prompts, OVERHEAD_TOKENS, stream))  # warm-up
        for _ in range(repeats):
            for stream in (False, True):
                times[stream] += asyncio.run(_timed_calls(server.url, prompts, OVERHEAD_TOKENS, stream))
    out = {}
    for stream, name in ((False, "plain"), (True, "streamed")):
        out[name] = {"first_token_seconds": summarize([a for a, _ in times[stream]]), "last_token_seconds": summarize([b for _, b in times[stream]])}
    out["last_token_ratio"] = ratio(out["streamed"]["last_token_seconds"]["median"], out["plain"]["last_token_seconds"]["median"])
    return out


def throughput(store, calls: int) -> dict:
    """Completions/s through the gateway with c agents calling at once, and in process at batch c."""
    out = {}
    for c in CONCURRENCY:
        prompts = [f"{100 + k % 900}*{10 + k % 90}" for k in range(c)]
        each = max(1, calls // c)
        with serve_policy(store, store.models_root) as server:
            asyncio.run(_concurrent_calls(server.url, prompts[: min(c, 8)], 1, THROUGHPUT_TOKENS))
            seconds = asyncio.run(_concurrent_calls(server.url, prompts, each, THROUGHPUT_TOKENS))
            batches, rows = server.gateway.batcher.batches, server.gateway.batcher.rows
        direct = summarize(_in_process(store, prompts, THROUGHPUT_TOKENS, max(1, min(5, each))))["median"]
        out[str(c)] = {"completions": c * each, "seconds": seconds, "completions_per_second": c * each / seconds,
                       "in_process_completions_per_second": c / direct, "mean_rows_per_generation": rows / batches}  # fmt: skip
    return out


def constrained_cost(store, repeats: int) -> dict:
    """Milliseconds per token and per step of the continuous decoder with every row constrained to
    :data:`TRIP_SCHEMA` and with none (same prompts, seeds and caps, alternating, after a warm-up)."""
    from flow_assets.policy.chat import chat_format, render_prompt
    from flow_assets.policy.constrained import ConstraintCompiler
    from flow_assets.policy.decode import DecodeRow, RowDecoder, row_streams

    model, tokenizer = store.load(str(store.adapter_dir("v0")))
    compiler = ConstraintCompiler(tokenizer, model.config.vocab_size, chat_format(tokenizer).tool_calls)
    constraint = compiler.response_format({"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP_SCHEMA}})
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": f"trip {k}"}])[1] for k in range(CONSTRAINED_ROWS)]

    def once(constrained: bool, seed: int) -> tuple[float, int, int]:
        # unconstrained: no token ends a row (eos -1), so every row runs to the cap (module docstring)
        decoder = RowDecoder(model, tokenizer.eos_token_id if constrained else -1, tokenizer.pad_token_id)
        rows = [DecodeRow(list(p), 1.0, 1.0, CONSTRAINED_TOKENS, s, matcher=constraint.matcher() if constrained else None,
                          budget=constraint.budget() if constrained else None)
                for p, s in zip(prompts, row_streams(seed, len(prompts)))]  # fmt: skip
        started, steps = time.perf_counter(), 0
        decoder.add(rows)
        while decoder.size:
            decoder.step()
            steps += 1
        return time.perf_counter() - started, sum(len(r.tokens) for r in rows), steps

    once(True, 0), once(False, 0)
    per_token: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    per_step: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    for k in range(repeats):
        for name in per_token:
            seconds, tokens, steps = once(name == "constrained", k)
            per_token[name].append(1000 * seconds / tokens)
            per_step[name].append(1000 * seconds / max(steps + 1, 1))  # the prefill draws the first token
    c, u = summarize(per_token["constrained"])["median"], summarize(per_token["unconstrained"])["median"]
    return {"ms_per_token": {k: summarize(v) for k, v in per_token.items()}, "ms_per_step": {k: summarize(v) for k, v in per_step.items()},
            "rows": CONSTRAINED_ROWS, "max_tokens": CONSTRAINED_TOKENS, "extra_ms_per_token": c - u, "ratio": ratio(c, u)}  # fmt: skip


def smollm2_sampling(work: Path, agents: int = 64) -> dict:
    """Completion tokens/s of SmolLM2-135M-Instruct through the gateway (``agents`` word-problem
    agents at once) and in process (their first-turn prompts in one batch); ``skipped`` without
    the ``smollm2`` extra."""
    from flow_assets.serving.agents.builtin import word_problem_agent
    from flow_assets.serving.agents.harness import HarnessConfig, run_rollouts
    from flow_assets.policy.chat import render_prompt
    from flow_assets.policy.presets import PresetUnavailable, prepare_model
    from flow_assets.policy.sampling import SamplingConfig, sample_token_ids
    from flow_assets.policy.store import PolicyStore
    from flow_assets.training.rounds import register_identity_adapter
    from flow_assets.tasks.calculator import CALCULATOR_TOOL
    from flow_assets.tasks.word_problems import WORKED_EXAMPLES, WordProblemSource
    from resources.registry import AdapterRegistry

    try:
        base = prepare_model("smollm2-135m-instruct", REPO_ROOT / ".models" / "presets" / "smollm2-135m-instruct").path
    except PresetUnavailable as exc:
        return {"skipped": str(exc)}
    store = PolicyStore(str(work / "smollm2"), base_model_path=base)
    register_identity_adapter(store, AdapterRegistry(root=store.models_root), "benchmark", "SmolLM2 as it is")
    source = WordProblemSource()
    tasks = source.tasks("train")[:agents]
    config = HarnessConfig(concurrency=agents, timeout_s=1800.0, temperature=0.5, land=False)
    with serve_policy(store, work / "smollm2-landing") as server:
        started = time.perf_counter()
        results = asyncio.run(run_rollouts(server.url, word_problem_agent, tasks, source.score, 1, agent_id="bench", config=config))
        seconds = time.perf_counter() - started
    tokens = sum(r.completion_tokens for r in results)
    model, tokenizer = store.load(str(store.adapter_dir("v0")))
    prompts = [render_prompt(tokenizer, [*WORKED_EXAMPLES, {"role": "user", "content": t.prompt}], [CALCULATOR_TOOL])[1] for t in tasks]
    started = time.perf_counter()
    rollouts = sample_token_ids(model, tokenizer, prompts, SamplingConfig(num_samples=1, temperature=0.5, max_new_tokens=48, seed=0))
    direct = time.perf_counter() - started
    direct_tokens = sum(len(r.completion_ids) for r in rollouts)
    return {
        "agents": agents, "seconds": seconds, "completion_tokens": tokens, "tokens_per_second": tokens / seconds,
        "llm_calls": sum(r.llm_calls for r in results), "success_rate": sum(r.success for r in results) / len(results),
        "prompt_tokens_first_turn": len(prompts[0]),
        "in_process_seconds": direct, "in_process_tokens": direct_tokens, "in_process_tokens_per_second": direct_tokens / direct,
    }  # fmt: skip


def run(quick: bool = False) -> dict:
    """The gateway benchmark (module docstring).

    Returns:
        ``agents_8_vs_1``, ``overhead``, ``throughput`` (per concurrency), ``streaming``, ``constrained``
        and ``headline``.
    """
    settings = QUICK if quick else FULL
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="flowopt-bench-gateway-"))
    try:
        agent_store = _policy(work / "calculator", settings["sft_steps"])
        fresh_store = _policy(work / "fresh", 0)
        pair = agents_8_vs_1(agent_store, settings["pairs"])
        extra = overhead(fresh_store, settings["overhead_repeats"])
        rates = throughput(fresh_store, settings["throughput_calls"])
        streams = streaming(fresh_store, settings["streaming_repeats"])
        constrained = constrained_cost(fresh_store, settings["constrained_repeats"])
        extra_135m = None
        if settings["overhead_repeats_135m"]:
            extra_135m = overhead(_policy(work / "size-135m", 0, SIZE_135M), settings["overhead_repeats_135m"])
        with real_model_threads():
            smollm2 = {"skipped": "a quick run leaves out the real model"} if quick else smollm2_sampling(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    headline = [
        {"figure": "8 calculator agents / 1 over HTTP (goal <= 1.3)", "value": pair["ratio_8_over_1"], "unit": "x",
         "note": f"median {pair['seconds_8']['median']:.3f} s for 8, {pair['seconds_1']['median']:.3f} s for 1; "
                 f"{pair['llm_calls_per_rollout']['8']:.2f} LLM calls per rollout"},
        {"figure": "gateway overhead, 8 concurrent calls vs in process at batch 8 (goal <= 10%)", "value": 100 * extra["overhead"],
         "unit": "%", "note": f"{extra['overhead_ms_per_call']:.1f} ms per call; {OVERHEAD_TOKENS} tokens per completion"},
        *([{"figure": "gateway overhead at SmolLM2-135M's size, 8 concurrent calls vs in process at batch 8 (goal <= 10%)",
            "value": 100 * extra_135m["overhead"], "unit": "%",
            "note": f"{extra_135m['overhead_ms_per_call']:.1f} ms per call; in process {extra_135m['in_process_seconds']['median']:.2f} s per batch"}]
          if extra_135m else []),
        {"figure": "time to first token, 8 concurrent calls, streamed", "value": 1000 * streams["streamed"]["first_token_seconds"]["median"],
         "unit": "ms", "note": f"not streamed (the whole response): {1000 * streams['plain']['first_token_seconds']['median']:.0f} ms; "
                               f"{OVERHEAD_TOKENS} tokens per completion"},
        {"figure": "time to last token, streamed / not streamed, 8 concurrent calls", "value": streams["last_token_ratio"], "unit": "x",
         "note": f"medians {1000 * streams['streamed']['last_token_seconds']['median']:.0f} ms / "
                 f"{1000 * streams['plain']['last_token_seconds']['median']:.0f} ms"},
        {"figure": "constrained decoding (JSON schema), ms per token vs unconstrained", "value": constrained["ms_per_token"]["constrained"]["median"],
         "unit": "ms/token", "note": f"unconstrained {constrained['ms_per_token']['unconstrained']['median']:.2f} ms/token "
                                     f"({constrained['ratio']:.2f}x); {CONSTRAINED_ROWS} rows, tiny model"},
        *({"figure": f"completions/s through the gateway, {c} agents", "value": r["completions_per_second"], "unit": "compl/s",
           "note": f"in process at batch {c}: {r['in_process_completions_per_second']:.0f}/s; "
                   f"{r['mean_rows_per_generation']:.1f} sequences per admission (calls prefilled together; a generate call with continuous=False)"} for c, r in rates.items()),
        *([{"figure": "SmolLM2-135M sampling through the gateway, 64 word-problem agents", "value": smollm2["tokens_per_second"],
            "unit": "tokens/s", "note": f"{smollm2['completion_tokens']} tokens in {smollm2['seconds']:.0f} s ({smollm2['llm_calls']} calls); "
                                        f"in process, their first turns in one batch: {smollm2['in_process_tokens_per_second']:.0f} tokens/s"}]
          if "tokens_per_second" in smollm2 else
          [] if quick else [{"figure": "SmolLM2-135M sampling through the gateway", "value": None, "unit": "", "note": f"skipped: {smollm2['skipped']}"}]),
    ]  # fmt: skip
    return {
        "what": "the calculator agent and chat completions through the in-process gateway over HTTP (openai client), tiny model",
        "settings": {**settings, "overhead_tokens": OVERHEAD_TOKENS, "throughput_tokens": THROUGHPUT_TOKENS,
                     "torch_threads": torch.get_num_threads()},  # fmt: skip
        "agents_8_vs_1": pair,
        "overhead": extra,
        "overhead_135m_shape": extra_135m,
        "throughput": rates,
        "streaming": streams,
        "constrained": constrained,
        "smollm2": smollm2,
        "seconds": time.perf_counter() - started,
        "headline": headline,
    }
