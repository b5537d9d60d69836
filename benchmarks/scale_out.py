"""``scale_out`` (#31): one round's collection and update in process against the same on 1 and 2
Ray workers (:mod:`flow_assets.cluster.ray_rollouts`, :mod:`flow_assets.cluster.ray_training`), on
this machine, and the update's figures projected for a GPU cluster on paper.

Measured, on the tiny policy (the model ``make demo`` trains; random weights, since an update's
cost does not depend on them): 64 completions (8 prompts x 8) of 32 tokens after 24-token
prompts, minibatches of 32 in micro-batches of 8, 2 passes: 4 optimizer steps.

- ``in_process``: :func:`~flow_assets.policy.trainer.train_grpo_round` in this process (the
  default backend), wall seconds.
- ``ray_1`` / ``ray_2``: :func:`~flow_assets.cluster.ray_training.run_driver` with no address, as a
  run without ``FLOWOPT_RAY_ADDRESS`` does: a driver process that starts a local Ray cluster, Ray
  Train's worker group, the update, the result. ``wall_s`` is all of it; ``training_s`` is rank
  0's own training time (:attr:`RoundResult.seconds`); ``overhead_s`` the difference.

- ``collection``: :func:`~flow_assets.training.rounds.collect_batch` of the same policy's
  calculator agents (8 train tasks x G = 8; quick: 4 x 4; at most the store's new-token limit per
  call) in process (``in_process``) and with ``workers`` = 1 / 2 and no address (``ray_1`` /
  ``ray_2``: a driver process, a local cluster, a gateway replica per worker, the merge; not in a
  quick run), wall seconds to the landed batch.

On 2 cores the workers share
the CPUs the one process had: no speed-up is expected, and the update of a tiny model is far
shorter than starting a cluster, so the overhead dominates; the projection says where that turns.

The projection (``projection``, assumptions in ``GPU_ASSUMPTIONS``): per optimizer step, the
compute of the forward and backward passes divides by the number of GPUs M, and the LoRA
gradients are summed by a ring all-reduce, ``2 (M - 1) / M x bytes / bandwidth`` (Patarasuk and
Yuan 2009); the fixed costs (driver, cluster, worker start) are paid once per round.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import summarize

#: what the projection assumes (a 7B model with LoRA on H100s; every figure is an assumption, not a measurement)
GPU_ASSUMPTIONS = {
    "model_params": 7.0e9,  # a Llama-2-7B-shaped policy
    "lora_params": 16.8e6,  # rank 16 on q, k, v, o: 4 x 2 x 4096 x 16 x 32 layers
    "grad_bytes_per_param": 4,  # fp32 adapter gradients
    "tokens_per_step": 64 * 1024,  # 64 completions with their prompts, 1,024 tokens each
    "flops_per_token": 6,  # x params: forward + backward (an upper bound for LoRA, whose frozen weights need no weight gradient)
    "gpu_flops": 989e12,  # H100 SXM, bf16 dense
    "mfu": 0.4,  # model FLOPs utilisation
    "nvlink_bytes_per_s": 300e9,  # within one node
    "ethernet_bytes_per_s": 3.1e9,  # 25 Gb/s between nodes
    "round_fixed_s": 30.0,  # driver, cluster connection and worker start per round (this machine measures its own)
    "steps_per_round": 16,
}


def _samples(n_prompts: int, per_prompt: int, prompt_len: int, completion_len: int, vocab: int, seed: int = 0):
    from flow_assets.policy.configs import TrainingSample

    rng = np.random.default_rng(seed)
    samples = []
    for p in range(n_prompts):
        prompt = [1] + rng.integers(4, vocab, size=prompt_len - 1).tolist()
        for _ in range(per_prompt):
            completion = rng.integers(4, vocab, size=completion_len).tolist()
            samples.append(TrainingSample(prompt, completion, float(rng.choice([-1.0, 1.0])), [-4.0] * completion_len, f"t{p}"))
    return samples


def projection(assumptions: dict = GPU_ASSUMPTIONS, gpus: tuple[int, ...] = (1, 2, 8, 16)) -> dict:
    """Seconds per optimizer step and per round on M GPUs (module docstring), from ``assumptions``.

    Returns:
        ``{M: {"compute_s", "allreduce_s", "step_s", "round_s", "speedup"}}``, the all-reduce over
        NVLink up to 8 GPUs (one node) and over Ethernet beyond.
    """
    a = assumptions
    compute_one = a["flops_per_token"] * a["model_params"] * a["tokens_per_step"] / (a["gpu_flops"] * a["mfu"])
    grad_bytes = a["lora_params"] * a["grad_bytes_per_param"]
    out = {}
    for m in gpus:
        bandwidth = a["nvlink_bytes_per_s"] if m <= 8 else a["ethernet_bytes_per_s"]
        allreduce = 0.0 if m == 1 else 2 * (m - 1) / m * grad_bytes / bandwidth
        step = compute_one / m + allreduce
        out[m] = {"compute_s": compute_one / m, "allreduce_s": allreduce, "step_s": step,
                  "round_s": a["round_fixed_s"] * (m > 1) + a["steps_per_round"] * step}  # fmt: skip
    for m in gpus:
        out[m]["speedup"] = out[1]["round_s"] / out[m]["round_s"]
    return out


def run(quick: bool = False) -> dict:
    """The scale-out benchmark (module docstring).

    Returns:
        ``in_process``, ``ray_1`` (not in a quick run), ``ray_2`` (seconds, with the spread over repeats),
        ``collection`` (the same three keys, wall seconds), the settings, ``projection`` and ``headline``.
    """
    from flow_assets.cluster.ray_training import run_driver
    from flow_assets.policy.configs import GRPOTrainerConfig
    from flow_assets.policy.store import PolicyStore
    from flow_assets.policy.trainer import train_grpo_round
    from flow_assets.serving.agents.builtin import calculator_agent
    from flow_assets.training.rounds import CollectConfig, build_base_policy, collect_batch
    from flow_assets.policy.sft import SFTConfig
    from flow_assets.policy.tiny_model import TinyModelConfig
    from flow_assets.tasks.calculator import CalculatorSource
    from resources.registry import AdapterRegistry

    repeats = 1 if quick else 3
    n_prompts, per_prompt = (4, 4) if quick else (8, 8)
    with tempfile.TemporaryDirectory(prefix="flowopt-scale-out-") as tmp:
        root = Path(tmp)
        store, registry = PolicyStore(str(root / "models")), AdapterRegistry(root=str(root / "models"))
        build_base_policy(store, registry, CalculatorSource(), TinyModelConfig(), SFTConfig(steps=0), 1, by="benchmark")
        adapter = registry.champion()["adapter_path"]
        vocab = store.load()[1].vocab_size
        samples = _samples(n_prompts, per_prompt, 24, 32, vocab)
        minibatch = len(samples) // 2

        def config(out: Path) -> GRPOTrainerConfig:
            return GRPOTrainerConfig(output_dir=str(out), minibatch_size=minibatch, micro_batch_size=8, num_iterations=2, save_steps=4, seed=0)

        local, rays = [], ({2: []} if quick else {1: [], 2: []})  # a quick run (the test suite's) starts one driver
        for r in range(repeats):
            model, _ = store.load(adapter, trainable=True)
            started = time.perf_counter()
            train_grpo_round(model, samples, config(root / f"local-{r}"))
            local.append(time.perf_counter() - started)
            for workers in rays:
                started = time.perf_counter()
                result, _ = run_driver(store, adapter, samples, config(root / f"ray{workers}-{r}"), workers, root / f"out{workers}-{r}")
                rays[workers].append((time.perf_counter() - started, result.seconds))
        # a quick run collects in process only: a second local cluster costs it ~20 s of both
        # cores, and collection on Ray workers is tested in tests/cluster/test_ray_rollouts.py
        collection: dict[str, list[float]] = {"in_process": [], **({} if quick else {f"ray_{w}": [] for w in rays})}
        tasks, group = (4, 4) if quick else (8, 8)
        for r in range(repeats):
            for name in collection:
                workers = 0 if name == "in_process" else int(name.split("_")[1])
                landed = collect_batch(store, CalculatorSource(), calculator_agent, "flowopt:calculator", registry, root / f"landing-{name}-{r}",
                                       CollectConfig(tasks_per_batch=tasks, group_size=group, concurrency=16), workers=workers)  # fmt: skip
                assert landed.rollouts == tasks * group, landed
                collection[name].append(landed.seconds)
    ray_stats = {
        f"ray_{w}": {"wall_s": summarize([t for t, _ in runs]), "training_s": summarize([s for _, s in runs]),
                     "overhead_s": summarize([t - s for t, s in runs])}
        for w, runs in rays.items()
    }  # fmt: skip
    in_process = summarize(local)
    collected = {name: summarize(times) for name, times in collection.items()}
    plan = projection()
    headline = [
        {"figure": "update, in process (4 steps, 64 completions)" if not quick else "update, in process (quick)", "value": in_process["median"], "unit": "s",
         "spread": [in_process["q1"], in_process["q3"]]},
        *({"figure": f"update on {w} Ray worker{'s' if w > 1 else ''}: wall / training / overhead",
           "value": [s["wall_s"]["median"], s["training_s"]["median"], s["overhead_s"]["median"]], "unit": "s",
           "note": "wall: driver + local cluster + worker group + update"} for w, s in ((w, ray_stats[f"ray_{w}"]) for w in rays)),
        {"figure": "Ray 2 workers / in process, wall", "value": ray_stats["ray_2"]["wall_s"]["median"] / in_process["median"], "unit": "x"},
        {"figure": f"collection of {tasks * group} rollouts: " + " / ".join(
            "in process" if name == "in_process" else f"{name[4:]} Ray worker{'s' if name != 'ray_1' else ''}" for name in collected),
         "value": [collected[name]["median"] for name in collected], "unit": "s",
         "note": "wall to the landed batch; Ray: driver + local cluster + a gateway replica per worker + merge"},
        {"figure": "projected round speed-up on 2 / 8 / 16 H100s (7B, LoRA r16)", "value": [plan[2]["speedup"], plan[8]["speedup"], plan[16]["speedup"]],
         "unit": "x", "note": "on paper: GPU_ASSUMPTIONS in benchmarks/scale_out.py"},
    ]  # fmt: skip
    return {
        "what": "one round's collection and update in process vs on 1 and 2 Ray workers (local cluster), and a GPU projection",
        "settings": {"completions": n_prompts * per_prompt, "prompt_tokens": 24, "completion_tokens": 32, "minibatch": minibatch,
                     "micro_batch": 8, "steps": 4, "repeats": repeats, "cpus": "the machine's; Ray gives each worker one"},  # fmt: skip
        "in_process": in_process,
        **ray_stats,
        "collection": {"rollouts": tasks * group, **collected},
        "projection": {"assumptions": GPU_ASSUMPTIONS, "gpus": plan},
        "headline": headline,
    }
