"""Rollout collection speed: 8 rollouts of one task vs 1, and completions/s by batch size.

Everything goes through :func:`flow_assets.policy.sampling.sample_rollouts` (batched ``generate``
with left padding, behaviour log-probs of every sampled token) on the tiny Llama of
:mod:`flow_assets.policy.tiny_model`, freshly initialised: it rarely emits ``<eos>``, so most
completions run to ``max_new_tokens`` (8), the worst case; generated tokens are reported with the
rates.

1. ``8 vs 1``: one ``spell_backward`` prompt, ``num_samples=8`` against ``num_samples=1``, timed
   alternately so that drift in the machine's load hits both alike. The original plan asks for 8
   rollouts in under 2x the time of 1 (a GRPO group should cost about one rollout, not eight).
2. ``completions/s`` at 8, 64 and 256 completions per call (1, 8 and 32 prompts x 8 samples).
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import ratio, summarize, time_call

BATCH_SIZES = (8, 64, 256)
GROUP = 8
MAX_NEW_TOKENS = 8
FULL_REPEATS = {"pair": 50, 8: 30, 64: 20, 256: 10}
QUICK_REPEATS = {"pair": 2, 8: 1, 64: 1, 256: 1}


def policy_and_prompts(n: int):
    """The fresh tiny model, its tokenizer and ``n`` spell_backward train prompts (cycled if fewer)."""
    from flow_assets.policy.tiny_model import TinyModelConfig, build_tiny_model
    from flow_assets.policy.tokenizer import CharTokenizerConfig, build_char_tokenizer
    from flow_assets.tasks.sources import ReasoningGymSource, ReasoningGymSourceConfig

    config = TinyModelConfig()
    tokenizer = build_char_tokenizer(CharTokenizerConfig(model_max_length=config.max_position_embeddings))
    tasks = ReasoningGymSource(ReasoningGymSourceConfig(size=400, seed=0)).tasks("train")
    prompts = [tasks[i % len(tasks)].prompt for i in range(n)]
    return build_tiny_model(config, tokenizer), tokenizer, prompts


def sample(model, tokenizer, prompts: list[str], num_samples: int, seed: int) -> tuple[float, int]:
    """``(seconds, completion tokens)`` of one :func:`sample_rollouts` call at temperature 1."""
    from flow_assets.policy.sampling import SamplingConfig, sample_rollouts

    config = SamplingConfig(num_samples=num_samples, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=seed)
    seconds, rollouts = time_call(sample_rollouts, model, tokenizer, prompts, config)
    return seconds, sum(len(r.completion_ids) for r in rollouts)


def group_vs_single(model, tokenizer, prompt: str, repeats: int) -> dict:
    """Seconds for 8 rollouts and for 1 rollout of ``prompt`` (alternating, after one warm-up
    each), and their ratio of medians (the plan's goal: below 2)."""
    sample(model, tokenizer, [prompt], GROUP, seed=0)
    sample(model, tokenizer, [prompt], 1, seed=0)
    eight, one = [], []
    for i in range(repeats):
        eight.append(sample(model, tokenizer, [prompt], GROUP, seed=i + 1)[0])
        one.append(sample(model, tokenizer, [prompt], 1, seed=i + 1)[0])
    eight_s, one_s = summarize(eight), summarize(one)
    r = ratio(eight_s["median"], one_s["median"])
    return {"seconds_8": eight_s, "seconds_1": one_s, "ratio_8_over_1": r, "goal": "< 2", "meets_goal": r < 2}


def throughput(model, tokenizer, prompts: list[str], batch: int, repeats: int) -> dict:
    """Completions/s and tokens/s of one call producing ``batch`` completions (``batch / 8``
    prompts x 8 samples), after one warm-up call."""
    chosen = prompts[: batch // GROUP]
    sample(model, tokenizer, chosen, GROUP, seed=0)
    runs = [sample(model, tokenizer, chosen, GROUP, seed=i + 1) for i in range(repeats)]
    seconds = summarize([s for s, _ in runs])
    tokens = sum(t for _, t in runs) / len(runs)
    return {
        "completions": batch,
        "seconds": seconds,
        "completions_per_second": batch / seconds["median"],
        "completion_tokens_per_call": tokens,
        "tokens_per_second": tokens / seconds["median"],
    }


def run(quick: bool = False) -> dict:
    """The collection benchmark (module docstring).

    Returns:
        ``group_vs_single`` (seconds for 8 and for 1 rollout, their ratio, whether it meets the
        plan's < 2), ``by_batch_size`` (8 / 64 / 256: seconds, completions/s, tokens/s) and
        ``headline``.
    """
    repeats = QUICK_REPEATS if quick else FULL_REPEATS
    started = time.perf_counter()
    model, tokenizer, prompts = policy_and_prompts(max(BATCH_SIZES) // GROUP)
    pair = group_vs_single(model, tokenizer, prompts[0], repeats["pair"])
    by_batch = {str(b): throughput(model, tokenizer, prompts, b, repeats[b]) for b in BATCH_SIZES}
    headline = [
        {"figure": "8 rollouts / 1 rollout of one task (goal < 2)", "value": pair["ratio_8_over_1"], "unit": "x",
         "note": f"median {pair['seconds_8']['median']:.4f} s for 8, {pair['seconds_1']['median']:.4f} s for 1"},
        *({"figure": f"completions/s at batch {b}", "value": r["completions_per_second"], "unit": "compl/s",
           "spread": [int(b) / r["seconds"]["max"], int(b) / r["seconds"]["min"]]} for b, r in by_batch.items()),
    ]
    return {
        "what": "sample_rollouts on the fresh tiny model, temperature 1, max_new_tokens 8",
        "settings": {"max_new_tokens": MAX_NEW_TOKENS, "group": GROUP, "repeats": {str(k): v for k, v in repeats.items()},
                     "torch_threads": torch.get_num_threads()},
        "group_vs_single": pair,
        "by_batch_size": by_batch,
        "seconds": time.perf_counter() - started,
        "headline": headline,
    }
