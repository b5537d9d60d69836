"""Sample efficiency: held-out success of the tiny policy against the number of trajectories it
was trained on, GRPO rounds after an SFT warm start, on reasoning-gym ``spell_backward``.

The loop (the idea of ``benchmarks/spell_backward_curve.py``, with flowopt's own pipeline pieces):

1. a fresh tiny Llama (seeded), SFT warm start (:func:`~flow_assets.policy.sft.sft_train`) on
   demonstrations of the train split, a new LoRA adapter (:func:`~flow_assets.policy.lora.add_lora_adapter`);
2. each round: the next 64 train tasks, 8 rollouts each at temperature 1 with behaviour log-probs
   (:func:`~flow_assets.policy.sampling.sample_rollouts`), the task's verifier as reward, group
   advantages as the ``advantages`` asset computes them
   (:func:`~flow_assets.rl.advantages.group_advantages`: ``(r - mean) / (std + 1e-4)``), one training
   round (:func:`~flow_assets.policy.trainer.train_grpo_round`: minibatches of 64, one pass);
3. after SFT and after every round: held-out success (exact answer), sampled at temperature 1
   (several samples per task, averaged; the headline) and greedy, on a fixed set of held-out tasks.

``trajectories`` counts every rollout collected for training (512 per round), including those of
zero-variance groups that carry no gradient. A seed learned when its final value (the mean of the
last three evaluations) is at least 2 points above its SFT base; its plateau is then the first
evaluation whose trailing mean over three evaluations is within 2 points of that final value (a
curve that never rose has no plateau). The original plan asks for convergence within 10,000
trajectories. Several seeds give the spread.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np
import polars as pl
import torch

from benchmarks.common import summarize

FULL = {"seeds": (0, 1, 2), "rounds": 40, "eval_tasks": 300, "eval_samples": 4}
QUICK = {"seeds": (0,), "rounds": 1, "eval_tasks": 16, "eval_samples": 1}
TASKS_PER_ROUND = 64
GROUP = 8
SFT_DEMOS, SFT_STEPS = 1000, 200
PLATEAU_POINTS = 0.02
PLAN_TRAJECTORIES = 10_000
TABLE_EVERY = 4  # rounds between rows of the Markdown curve


def eval_seed(seed: int) -> int:
    """The sampling seed of every evaluation of seed ``seed``'s curve (fixed, so that two points of
    the curve differ by the policy only)."""
    return 10_000 + seed


def evaluate(model, tokenizer, source, tasks, samples: int, seed: int) -> dict:
    """Held-out exact-answer success: ``sampled`` (temperature 1, ``samples`` per task, averaged)
    and ``greedy`` (one per task), as fractions in [0, 1]."""
    from flow_assets.policy.sampling import SamplingConfig, sample_rollouts

    prompts = [t.prompt for t in tasks]

    def success(config: SamplingConfig) -> float:
        rollouts = sample_rollouts(model, tokenizer, prompts, config)
        return float(np.mean([r.error is None and source.score(tasks[r.prompt_index], r.completion_text) == 1.0 for r in rollouts]))

    return {
        "sampled": success(SamplingConfig(num_samples=samples, temperature=1.0, seed=seed)),
        "greedy": success(SamplingConfig(num_samples=1, temperature=0.0)),
    }


def collect(model, tokenizer, source, tasks, seed: int):
    """One round's training batch: 8 rollouts per task, verifier rewards, group advantages.

    Returns:
        ``(samples, mean_reward, zero_variance_share)``.
    """
    from flow_assets.policy.sampling import SamplingConfig, sample_rollouts
    from flow_assets.policy.trainer import TrainingSample
    from flow_assets.rl.advantages import AdvantageConfig, group_advantages

    rollouts = sample_rollouts(model, tokenizer, [t.prompt for t in tasks], SamplingConfig(num_samples=GROUP, temperature=1.0, seed=seed))
    rewards = [source.score(tasks[r.prompt_index], r.completion_text) if r.error is None else 0.0 for r in rollouts]
    scored = group_advantages(
        pl.DataFrame({"group_key": [tasks[r.prompt_index].task_id for r in rollouts], "reward": rewards}), AdvantageConfig()
    )
    samples = [
        TrainingSample(r.prompt_ids, r.completion_ids, a, r.logprobs, tasks[r.prompt_index].task_id)
        for r, a in zip(rollouts, scored["advantage"].to_list())
        if r.error is None
    ]
    return samples, float(np.mean(rewards)), float(scored["zero_variance"].mean())


def plateau(points: list[dict], tolerance: float = PLATEAU_POINTS, window: int = 3) -> dict:
    """Whether a learning curve rose, and where it levelled off.

    Args:
        points: ``{"trajectories": int, "sampled": float}`` in training order, the first before
            any training.
        tolerance: how close to the final value counts as arrived, and the least gain that counts
            as learning (0.02 = 2 points).
        window: evaluations averaged, both for the final value and, trailing, for each point (one
            evaluation on a few hundred tasks moves by a point or two by chance alone).

    Returns:
        ``base`` (the first point), ``final`` (mean ``sampled`` of the last ``window`` points),
        ``gain`` (``final - base``), ``learned`` (``gain >= tolerance``), ``trajectories`` (of the
        first point whose trailing mean is within ``tolerance`` of ``final``; ``None`` when the
        curve did not rise: a flat curve has no plateau to reach) and ``within_plan`` (learned, and
        that count is at most 10,000).
    """
    values = [p["sampled"] for p in points]
    final = float(np.mean(values[-window:]))
    gain = final - values[0]
    learned = gain >= tolerance
    first = next(p for i, p in enumerate(points) if np.mean(values[max(0, i - window + 1) : i + 1]) >= final - tolerance)
    trajectories = first["trajectories"] if learned else None
    return {
        "base": values[0],
        "final": final,
        "gain": gain,
        "learned": learned,
        "trajectories": trajectories,
        "within_plan": learned and trajectories <= PLAN_TRAJECTORIES,
    }


def curve(seed: int, rounds: int, eval_tasks: int, eval_samples: int) -> dict:
    """One seed's learning curve (module docstring).

    Returns:
        ``points`` (per evaluation: ``round``, ``trajectories``, ``sampled``, ``greedy``, and for
        rounds ``mean_reward``, ``zero_variance_share``, ``seconds``), ``sft_seconds``, ``plateau``.
    """
    from flow_assets.policy.lora import add_lora_adapter
    from flow_assets.policy.sft import SFTConfig, sft_train
    from flow_assets.policy.tiny_model import TinyModelConfig, build_tiny_model
    from flow_assets.policy.tokenizer import CharTokenizerConfig, build_char_tokenizer
    from flow_assets.tasks.sources import ReasoningGymSource, ReasoningGymSourceConfig

    source = ReasoningGymSource(ReasoningGymSourceConfig(size=4000, seed=0))
    rng = np.random.default_rng(seed)
    train = source.tasks("train")
    train = [train[i] for i in rng.permutation(len(train))]
    held_out = source.tasks("held_out")[:eval_tasks]
    config = TinyModelConfig(seed=seed)
    tokenizer = build_char_tokenizer(CharTokenizerConfig(model_max_length=config.max_position_embeddings))
    model = build_tiny_model(config, tokenizer)
    sft = sft_train(model, tokenizer, [(t.prompt, t.demonstration) for t in train[:SFT_DEMOS]],
                    SFTConfig(steps=SFT_STEPS, learning_rate=3e-3, seed=seed))
    policy = add_lora_adapter(model)
    points = [{"round": 0, "trajectories": 0, **evaluate(policy, tokenizer, source, held_out, eval_samples, eval_seed(seed))}]
    with tempfile.TemporaryDirectory(prefix="flowopt-bench-sample-efficiency-") as work:
        for k in range(1, rounds + 1):
            points.append(grpo_round(policy, tokenizer, source, train, held_out, k, seed, work, eval_samples))
    return {"seed": seed, "points": points, "sft_seconds": sft.seconds, "plateau": plateau(points)}


def grpo_round(policy, tokenizer, source, train, held_out, k: int, seed: int, work: str, eval_samples: int) -> dict:
    """Round ``k`` of one seed's curve: collect on the next 64 train tasks, train, evaluate.

    Returns:
        the curve point: ``round``, ``trajectories`` (cumulative), ``sampled``, ``greedy``,
        ``mean_reward``, ``zero_variance_share`` and ``seconds`` (collection + training).
    """
    from flow_assets.policy.trainer import GRPOTrainerConfig, train_grpo_round

    started = time.perf_counter()
    batch = [train[((k - 1) * TASKS_PER_ROUND + i) % len(train)] for i in range(TASKS_PER_ROUND)]
    samples, mean_reward, zero_share = collect(policy, tokenizer, source, batch, seed=seed * 100_000 + k)
    train_grpo_round(policy, samples, GRPOTrainerConfig(output_dir=f"{work}/round-{k}", minibatch_size=64,
                                                        seed=seed * 1000 + k, save_steps=10**9))
    seconds = time.perf_counter() - started
    return {
        "round": k,
        "trajectories": k * TASKS_PER_ROUND * GROUP,
        **evaluate(policy, tokenizer, source, held_out, eval_samples, eval_seed(seed)),
        "mean_reward": mean_reward,
        "zero_variance_share": zero_share,
        "seconds": seconds,
    }


def curve_table(curves: list[dict]) -> dict:
    """The learning curve as a table (every :data:`TABLE_EVERY` rounds and the last): per round,
    trajectories, median / min / max sampled success over seeds, median greedy success."""
    last = len(curves[0]["points"]) - 1
    rows = []
    for k in sorted({*range(0, last + 1, TABLE_EVERY), last}):
        sampled = summarize([c["points"][k]["sampled"] for c in curves])
        greedy = summarize([c["points"][k]["greedy"] for c in curves])
        rows.append([k, curves[0]["points"][k]["trajectories"], sampled["median"], sampled["min"], sampled["max"], greedy["median"]])
    return {
        "title": "held-out success (sampled, T=1) vs trajectories trained on; median, min, max over seeds",
        "columns": ["round", "trajectories", "sampled success", "min", "max", "greedy success"],
        "rows": rows,
    }


def report(curves: list[dict], settings: dict) -> dict:
    """Summary, headline and table of finished curves (``settings``: :data:`FULL` or :data:`QUICK`).

    Returns:
        ``settings``, ``curves``, ``summary`` (median and spread over seeds of the SFT base's, the
        final and the at-10,000-trajectories sampled success, the median gain in points, the seeds
        that learned, and the trajectories to the plateau of those that did), ``headline`` and
        ``tables`` (the curve).
    """
    base = summarize([c["plateau"]["base"] for c in curves])
    final = summarize([c["plateau"]["final"] for c in curves])
    gain = summarize([100 * c["plateau"]["gain"] for c in curves])
    at_plan = summarize([[p for p in c["points"] if p["trajectories"] <= PLAN_TRAJECTORIES][-1]["sampled"] for c in curves])
    learned = [c for c in curves if c["plateau"]["learned"]]
    to_plateau = summarize([c["plateau"]["trajectories"] for c in learned]) if learned else None
    within = sum(c["plateau"]["within_plan"] for c in curves)
    summary = {
        "base_sampled_success": base,
        "final_sampled_success": final,
        "gain_points": gain,
        "sampled_success_at_10000": at_plan,
        "seeds": len(curves),
        "seeds_learned": len(learned),
        "trajectories_to_plateau": to_plateau,
        "seeds_within_10000": within,
    }
    per_seed = ", ".join(
        f"seed {c['seed']}: {c['plateau']['base']:.2f} -> {c['plateau']['final']:.2f}" for c in curves
    )
    headline = [
        {"figure": "held-out success (sampled) SFT base -> final", "value": [base["median"], final["median"]], "unit": "",
         "spread": [[base["min"], base["max"]], [final["min"], final["max"]]], "note": per_seed},
        {"figure": "gain, final - base", "value": gain["median"], "unit": "points", "spread": [gain["min"], gain["max"]]},
        {"figure": "held-out success (sampled) after at most 10,000 trajectories", "value": at_plan["median"], "unit": "",
         "spread": [at_plan["min"], at_plan["max"]]},
        {"figure": "trajectories to plateau (within 2 points of final), seeds that learned",
         "value": to_plateau["median"] if to_plateau else None, "unit": "traj",
         **({"spread": [to_plateau["min"], to_plateau["max"]]} if to_plateau else {}),
         "note": f"{len(learned)}/{len(curves)} seeds gained >= 2 points; {within} of them plateaued within the plan's 10,000"},
    ]
    return {
        "what": "held-out success vs trajectories trained on: SFT warm start, then GRPO rounds of 64 tasks x 8 rollouts",
        "settings": {**{k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}, "tasks_per_round": TASKS_PER_ROUND,
                     "group": GROUP, "sft_demos": SFT_DEMOS, "sft_steps": SFT_STEPS, "torch_threads": torch.get_num_threads()},
        "curves": curves,
        "summary": summary,
        "headline": headline,
        "tables": [curve_table(curves)],
    }


def run(quick: bool = False) -> dict:
    """The sample-efficiency benchmark (module docstring): the curves of every seed, then
    :func:`report` on them, plus ``seconds``."""
    settings = QUICK if quick else FULL
    started = time.perf_counter()
    curves = [curve(s, settings["rounds"], settings["eval_tasks"], settings["eval_samples"]) for s in settings["seeds"]]
    return {**report(curves, settings), "seconds": time.perf_counter() - started}
