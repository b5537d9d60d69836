"""One GRPO training round on a batch of scored completions, with checkpoints and resume.

Input: samples ``(prompt ids, completion ids, behaviour log-probs or None, advantage)``, a PEFT
LoRA model whose adapter is trainable, and optionally a frozen reference model. The round runs
``num_iterations`` passes over the samples in minibatches, one AdamW step per minibatch, minimising
the clipped GRPO surrogate of :mod:`flow_assets.rl.grpo_loss` (DeepSeekMath 2024 eq. 3)::

    for step in 1..total_steps:
        for each micro-batch mb of the step's minibatch (``micro_batch_size`` rows; all at once by default):
            logp_new: [mb, seq]   = teacher-forced log-probs of the completion tokens, each row at
                                    its sample's own sampling temperature T (as the behaviour ones)
            logp_old: [mb, seq]   = the logged behaviour log-probs (rows without them: logp_new.detach())
            ref_logp: [mb, seq]   = reference log-probs (only when beta > 0)
            (w * grpo_loss(logp_new, logp_old, advantages[mb], mask, ref_logp)).backward()
        clip_grad_norm_(max_grad_norm); AdamW step

The micro-batch weight ``w`` makes the accumulated gradient exactly the gradient of the loss
over the whole minibatch (as TRL's gradient accumulation normalises by the tokens of the whole
batch): ``w = tokens(mb) / tokens(minibatch)`` for the token-level ``dapo`` / ``bnpo``, and
``w = rows(mb) / rows(minibatch)`` for the per-sequence ``grpo`` and for ``dr_grpo`` (whose
length denominator is then the minibatch's longest completion, fixed for all its micro-batches).

**Data parallel** (:class:`DataParallel`, e.g. workers launched by Ray Train,
:mod:`flow_assets.cluster.ray_training`): every worker holds the whole sample list and the same
adapter and optimizer, computes the same minibatch, and takes the micro-batches ``k`` with
``k mod world_size == rank`` (``micro_batch_size`` rows each; unset, ``ceil(minibatch /
world_size)``), each with its weight ``w`` relative to the *whole* minibatch as above. Summing the
workers' accumulated gradients (all-reduce, SUM) therefore gives the one-process gradient exactly
in real arithmetic; in floating point only the order of the additions differs (one worker adds
``g0 + g1 + g2 + g3``, two add ``(g0 + g2) + (g1 + g3)``), a relative difference of about 1e-7
in float32. Gradient clipping and the AdamW step then run on identical gradients on every worker,
so the replicas stay equal without broadcasting weights (as DDP does). Only rank 0 writes
checkpoints; every rank resumes from them.

Samples whose advantage is exactly 0 (zero-variance groups) would contribute no gradient
(every per-token term is ``ratio * 0``); they are dropped up front and counted, and so are samples
with an empty completion (no token to score).

Minibatch order: pass ``e`` uses the permutation ``numpy.random.default_rng([seed, e])``, a pure
function of ``(seed, e)``, so a resumed round sees exactly the minibatches the interrupted one
would have seen.

Checkpoints (every ``save_steps`` steps and at the last step) go to
``<output_dir>/checkpoint-<step>/``::

    adapter/               PEFT adapter (adapter_config.json + adapter_model.safetensors)
    optimizer.pt           AdamW state_dict
    rng_state.pt           torch, numpy and python RNG states
    trainer_state.json     step counter, total steps, per-step metrics so far, the retention metric
    config.json            this round's exact GRPOTrainerConfig

Each is written into a temporary directory ``.tmp-checkpoint-<step>-<pid>`` and renamed into
place, so a kill mid-write leaves no half checkpoint (leftover temporary directories are removed on
resume). Retention keeps the ``keep_best`` checkpoints with the best retention metric (default: the
lowest mean loss over the steps since the previous checkpoint) plus, always, the latest one, which
``resume`` needs. ``resume=True`` restores the latest complete checkpoint (adapter weights,
optimizer state, RNG states, step counter, metrics) and continues from the next step; it refuses to
continue a different round (other config or other samples).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from peft import PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import PreTrainedModel

from flow_assets.policy.configs import GRPOTrainerConfig, TrainingSample
from flow_assets.policy.sampling import completion_logprobs
from flow_assets.rl.awr_loss import awr_loss
from flow_assets.rl.grpo_loss import grpo_loss

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


@dataclass(frozen=True)
class StepMetrics:
    """What one optimizer step did (all python floats/ints, JSON-ready).

    Attributes:
        step: global step number, 1-based.
        loss: GRPO surrogate value.
        grad_norm: global gradient L2 norm before clipping.
        clip_fraction / clip_low_fraction / clip_high_fraction: share of tokens clipped (see
            :class:`~flow_assets.rl.grpo_loss.GRPOLossOutput`).
        mean_ratio: mean importance ratio.
        kl: mean k3 KL to the reference (0 when ``beta == 0``).
        num_tokens: completion tokens in the minibatch.
        num_samples: completions in the minibatch.
        mean_weight: under the ``"awr"`` update rule, the mean row weight (token-weighted; there
            ``mean_ratio`` is 1 and nothing is clipped); 0 under ``"grpo"``.
    """

    step: int
    loss: float
    grad_norm: float
    clip_fraction: float
    clip_low_fraction: float
    clip_high_fraction: float
    mean_ratio: float
    kl: float
    num_tokens: int
    num_samples: int
    mean_weight: float = 0.0


@dataclass
class RoundResult:
    """Outcome of :func:`train_grpo_round`.

    Attributes:
        steps: metrics of every step of the round, including those restored from a checkpoint.
        final_step: last step number reached (0 when nothing was trained).
        resumed_from: step of the checkpoint the round resumed from, else ``None``.
        num_samples: samples trained on (non-zero advantage).
        num_dropped_zero_advantage: samples left out because they cannot move the policy: advantage
            exactly 0, or (update rule ``"awr"`` with ``"positive"`` weighting) not above 0.
        latest_checkpoint: path of the last checkpoint written (``None`` when nothing was trained).
        kept_checkpoints: checkpoint directories left after retention, by step.
        seconds: wall-clock time of this call.
    """

    steps: list[StepMetrics] = field(default_factory=list)
    final_step: int = 0
    resumed_from: int | None = None
    num_samples: int = 0
    num_dropped_zero_advantage: int = 0
    latest_checkpoint: str | None = None
    kept_checkpoints: list[str] = field(default_factory=list)
    seconds: float = 0.0


class GRPORoundTrainer:
    """Stateful form of one round: build it, optionally :meth:`resume_from_latest`, then :meth:`train`.

    Args:
        model: a ``PeftModel`` whose adapter requires grad (only trainable parameters are optimised).
        samples: the round's samples; zero-advantage ones are dropped.
        config: round settings.
        ref_model: frozen reference for the KL term when ``config.loss.beta > 0``; if ``None`` the
            reference is ``model`` with its adapter disabled (the base model).
        data_parallel: this process's rank in a data-parallel round (module docstring); ``None``:
            one process.

    Construction seeds the global torch / numpy / python RNGs with ``config.seed`` (as the
    Hugging Face ``Trainer`` does), so that anything stochastic in the forward pass is reproducible
    and its state can be checkpointed.

    Raises:
        TypeError: if ``model`` is not a ``PeftModel``.
        ValueError: if a sample is malformed (empty prompt, behaviour log-probs of the wrong length),
            the model has no trainable parameters, or the config is invalid (sizes < 1, unknown
            ``best_metric``, ``bf16`` under the ``"grpo"`` update rule).
    """

    def __init__(
        self,
        model: PeftModel,
        samples: list[TrainingSample],
        config: GRPOTrainerConfig | None = None,
        ref_model: PreTrainedModel | None = None,
        data_parallel: DataParallel | None = None,
    ):
        if not isinstance(model, PeftModel):
            raise TypeError("the GRPO trainer trains a PEFT adapter; wrap the model with add_lora_adapter")
        self.model = model
        self.config = config or GRPOTrainerConfig()
        self.data_parallel = data_parallel
        if self.config.gradient_checkpointing:
            # non-reentrant: the frozen base's inputs need no requires_grad for LoRA's grads to flow
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.ref_model = ref_model
        c = self.config
        if c.minibatch_size < 1 or c.num_iterations < 1 or c.save_steps < 1 or c.keep_best < 1:
            raise ValueError("minibatch_size, num_iterations, save_steps and keep_best must be >= 1")
        if c.micro_batch_size is not None and c.micro_batch_size < 1:
            raise ValueError("micro_batch_size must be >= 1 (or None)")
        if c.bf16 and c.update_rule != "awr":
            raise ValueError("bf16 is for the 'awr' update rule only: the GRPO ratio divides by behaviour log-probs computed in "
                             "float32 at sampling, and both sides of a ratio must come from the same numerics")  # fmt: skip
        if c.best_metric not in {f.name for f in dataclasses.fields(StepMetrics)}:
            raise ValueError(f"best_metric {c.best_metric!r} is not a StepMetrics field")
        for i, s in enumerate(samples):
            if not s.prompt_ids:
                raise ValueError(f"sample {i}: empty prompt_ids")
            if s.behaviour_logprobs is not None and len(s.behaviour_logprobs) != len(s.completion_ids):
                raise ValueError(
                    f"sample {i}: {len(s.behaviour_logprobs)} behaviour log-probs for "
                    f"{len(s.completion_ids)} completion tokens"
                )
        # a row that cannot move the policy is left out: zero advantage under GRPO, and under
        # filtered behaviour cloning (AWR "positive") every row without a positive advantage
        keep = (lambda s: s.advantage > 0.0) if (self.config.update_rule == "awr" and self.config.awr.weighting == "positive") else (lambda s: s.advantage != 0.0)
        self.samples = [s for s in samples if keep(s) and s.completion_ids]
        self.num_dropped = len(samples) - len(self.samples)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("model has no trainable parameters")
        self.optimizer = torch.optim.AdamW(
            self.params, lr=self.config.learning_rate, weight_decay=self.config.weight_decay
        )
        self.pad_id = getattr(model.config, "pad_token_id", None) or 0
        self.step = 0
        self.history: list[StepMetrics] = []
        self.resumed_from: int | None = None
        self.latest_checkpoint: Path | None = None
        self.output_dir = Path(self.config.output_dir)
        self._seed_everything(self.config.seed)

    # ----------------------------------------------------------------------------- schedule
    @property
    def steps_per_epoch(self) -> int:
        """Minibatches per pass over the samples."""
        return math.ceil(len(self.samples) / self.config.minibatch_size)

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole round."""
        total = self.config.num_iterations * self.steps_per_epoch
        return total if self.config.max_steps is None else min(total, self.config.max_steps)

    def minibatch(self, step: int) -> list[int]:
        """Sample indices of global step ``step`` (1-based); a pure function of (seed, step)."""
        epoch, k = divmod(step - 1, self.steps_per_epoch)
        order = np.random.default_rng([self.config.seed, epoch]).permutation(len(self.samples))
        size = self.config.minibatch_size
        return order[k * size : (k + 1) * size].tolist()

    def samples_fingerprint(self) -> str:
        """sha256 over the samples' ids, advantages and log-probs (identifies the round's data)."""
        h = hashlib.sha256()
        for s in self.samples:
            fields = [s.prompt_ids, s.completion_ids, s.advantage, s.behaviour_logprobs, s.temperature]
            h.update(json.dumps(fields + ([s.loss_mask] if s.loss_mask is not None else [])).encode())
        return h.hexdigest()

    # ----------------------------------------------------------------------------- training
    def train(self, on_step: Callable[[StepMetrics], None] | None = None) -> RoundResult:
        """Run the remaining steps of the round (all of them unless resumed), checkpointing as configured.

        Args:
            on_step: called with each new step's metrics (after its checkpoint, if any). It may
                raise :class:`TrainingPaused` to stop after this step: the trainer checkpoints the
                step first (if it was not just checkpointed), so :meth:`resume_from_latest`
                continues exactly there.

        Returns:
            :class:`RoundResult`.

        Raises:
            TrainingPaused: from ``on_step``, with ``step`` and ``checkpoint`` set.
        """
        start = time.perf_counter()
        while self.step < self.total_steps:
            metrics = self._train_step(self.step + 1)
            self.step = metrics.step
            self.history.append(metrics)
            saved = self.step % self.config.save_steps == 0 or self.step == self.total_steps
            if saved and self.writes_checkpoints:
                self.save_checkpoint()
            if on_step is not None:
                try:
                    on_step(metrics)
                except TrainingPaused as pause:
                    pause.step = self.step
                    pause.checkpoint = str(self.latest_checkpoint if saved or not self.writes_checkpoints else self.save_checkpoint())
                    raise
        self.model.eval()
        return RoundResult(
            steps=list(self.history),
            final_step=self.step,
            resumed_from=self.resumed_from,
            num_samples=len(self.samples),
            num_dropped_zero_advantage=self.num_dropped,
            latest_checkpoint=str(self.latest_checkpoint) if self.latest_checkpoint else None,
            kept_checkpoints=[str(p) for _, p in self._complete_checkpoints()],
            seconds=time.perf_counter() - start,
        )

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this process writes the round's checkpoints (rank 0, or no data parallelism)."""
        return self.data_parallel is None or self.data_parallel.rank == 0

    def _train_step(self, step: int) -> StepMetrics:
        batch = [self.samples[i] for i in self.minibatch(step)]
        total_tokens = sum(s.num_loss_tokens for s in batch)
        longest = max(len(s.completion_ids) for s in batch)
        loss_config = self.config.loss
        if loss_config.loss_type == "dr_grpo" and loss_config.max_completion_length is None:
            loss_config = dataclasses.replace(loss_config, max_completion_length=longest)
        dp = self.data_parallel
        size = self.config.micro_batch_size or (len(batch) if dp is None else math.ceil(len(batch) / dp.world_size))
        starts = range(0, len(batch), size)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        weighted = {"clip_fraction": 0.0, "clip_low_fraction": 0.0, "clip_high_fraction": 0.0, "mean_ratio": 0.0, "kl": 0.0, "mean_weight": 0.0}
        for start in starts if dp is None else starts[dp.rank :: dp.world_size]:
            micro = batch[start : start + size]
            prompts = [s.prompt_ids for s in micro]
            completions = [s.completion_ids for s in micro]
            temperatures = [s.temperature for s in micro]
            with torch.autocast(device_type=self.model.device.type, dtype=torch.bfloat16, enabled=self.config.bf16):
                logp_new, mask = completion_logprobs(self.model, prompts, completions, self.pad_id, temperatures)  # [mb, seq]
            mask = _with_loss_masks(mask, micro)
            advantages = torch.tensor([s.advantage for s in micro], dtype=logp_new.dtype)  # [mb]
            if self.config.update_rule == "awr":
                awr = self.config.awr
                ref_logp = self._reference_logprobs(prompts, completions, temperatures) if awr.beta_kl > 0 else None
                out = awr_loss(logp_new, mask, advantages, ref_logp, awr)
                loss_type = awr.loss_type
                # no behaviour policy, so no ratio and nothing clipped
                values = {"mean_ratio": 1.0, "kl": out.mean_kl, "mean_weight": out.mean_weight}
            else:
                logp_old = self._behaviour_logprobs(micro, logp_new)  # [mb, seq]
                ref_logp = self._reference_logprobs(prompts, completions, temperatures) if loss_config.beta > 0 else None
                out = grpo_loss(logp_new, logp_old, advantages, mask, ref_logp, loss_config)
                loss_type = loss_config.loss_type
                values = {"clip_fraction": out.clip_fraction, "clip_low_fraction": out.clip_low_fraction,
                          "clip_high_fraction": out.clip_high_fraction, "mean_ratio": out.mean_ratio, "kl": out.mean_kl}  # fmt: skip
            tokens = out.num_tokens
            weight = tokens / total_tokens if loss_type in ("dapo", "bnpo") else len(micro) / len(batch)
            (out.loss * weight).backward()
            loss += float(out.loss.detach()) * weight
            for name, value in values.items():
                weighted[name] += value * tokens / total_tokens
        if dp is not None:  # every worker's share of the minibatch's gradient and metrics, summed
            for p in self.params:
                if p.grad is None:  # a worker without a micro-batch this step adds zeros
                    p.grad = torch.zeros_like(p)
                dp.all_reduce(p.grad)
            totals = torch.tensor([loss, *weighted.values()], dtype=torch.float64)
            dp.all_reduce(totals)
            loss, weighted = float(totals[0]), dict(zip(weighted, totals[1:].tolist()))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        self.optimizer.step()
        return StepMetrics(step=step, loss=loss, grad_norm=float(grad_norm), **weighted, num_tokens=total_tokens, num_samples=len(batch))

    @staticmethod
    def _behaviour_logprobs(batch: list[TrainingSample], logp_new: torch.Tensor) -> torch.Tensor:
        """``[mb, seq]`` logged log-probs; rows without them get ``logp_new.detach()`` (ratio 1)."""
        logp_old = logp_new.detach().clone()
        for i, s in enumerate(batch):
            if s.behaviour_logprobs is not None:
                logp_old[i, : len(s.behaviour_logprobs)] = torch.tensor(s.behaviour_logprobs, dtype=logp_old.dtype)
        return logp_old

    def _reference_logprobs(
        self, prompts: list[list[int]], completions: list[list[int]], temperatures: list[float]
    ) -> torch.Tensor:
        """``[mb, seq]`` log-probs under the reference (the given model, else the adapter-free base),
        each row at its sample's temperature."""
        with torch.no_grad(), torch.autocast(device_type=self.model.device.type, dtype=torch.bfloat16, enabled=self.config.bf16):
            if self.ref_model is not None:
                logp, _ = completion_logprobs(self.ref_model, prompts, completions, self.pad_id, temperatures)
            else:
                with self.model.disable_adapter():
                    logp, _ = completion_logprobs(self.model, prompts, completions, self.pad_id, temperatures)
        return logp

    # ----------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        """Write ``checkpoint-<step>`` atomically (temp dir + rename), then apply retention.

        Returns:
            the checkpoint directory.
        """
        self.output_dir.mkdir(parents=True, exist_ok=True)
        final = self.output_dir / f"checkpoint-{self.step}"
        tmp = self.output_dir / f".tmp-checkpoint-{self.step}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        self.model.save_pretrained(str(tmp / "adapter"), safe_serialization=True)
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(
            {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
            tmp / "rng_state.pt",
        )
        (tmp / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2))
        state = {
            "step": self.step,
            "total_steps": self.total_steps,
            "samples_fingerprint": self.samples_fingerprint(),
            "retention_metric": self._retention_metric(),
            "metrics": [dataclasses.asdict(m) for m in self.history],
        }
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
        if final.exists():  # a re-run of the same step: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        self.latest_checkpoint = final
        self._apply_retention()
        return final

    def _retention_metric(self) -> float:
        """Mean of ``best_metric`` over the steps since the previous checkpoint."""
        previous = (self.step - 1) // self.config.save_steps * self.config.save_steps
        window = [m for m in self.history if m.step > previous] or self.history[-1:]
        return float(np.mean([getattr(m, self.config.best_metric) for m in window]))

    def _complete_checkpoints(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of complete checkpoints in ``output_dir``, by step."""
        if not self.output_dir.is_dir():
            return []
        found = []
        for p in self.output_dir.iterdir():
            m = CHECKPOINT_RE.match(p.name)
            if m and (p / "trainer_state.json").is_file():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def _apply_retention(self) -> None:
        checkpoints = self._complete_checkpoints()
        if not checkpoints:
            return
        latest_step = checkpoints[-1][0]
        scored = []
        for step, path in checkpoints:
            value = json.loads((path / "trainer_state.json").read_text())["retention_metric"]
            scored.append((value if self.config.best_mode == "min" else -value, step, path))
        keep = {step for _, step, _ in sorted(scored)[: self.config.keep_best]} | {latest_step}
        for _, step, path in scored:
            if step not in keep:
                shutil.rmtree(path, ignore_errors=True)

    def resume_from_latest(self) -> int | None:
        """Restore the latest complete checkpoint in ``output_dir``; returns its step, or ``None`` if none.

        Restores adapter weights, AdamW state, torch/numpy/python RNG states, the step counter and the
        metrics history. Removes leftover temporary directories of interrupted writes.

        Raises:
            CheckpointMismatch: the checkpoint belongs to a different round (other config or
                samples); nothing was restored.
        """
        if self.output_dir.is_dir() and self.writes_checkpoints:
            for p in self.output_dir.glob(".tmp-checkpoint-*"):
                shutil.rmtree(p, ignore_errors=True)
        checkpoints = self._complete_checkpoints()
        if not checkpoints:
            return None
        step, path = checkpoints[-1]
        try:
            saved_config = GRPOTrainerConfig.from_dict(json.loads((path / "config.json").read_text()))
        except TypeError:  # written with other field names (before a rename): another round's settings
            saved_config = None
        if saved_config != self.config:
            raise CheckpointMismatch(f"{path}: saved config differs from this round's config; not resuming")
        state = json.loads((path / "trainer_state.json").read_text())
        if state["samples_fingerprint"] != self.samples_fingerprint():
            raise CheckpointMismatch(f"{path}: checkpoint was trained on other samples; not resuming")
        adapter = load_file(str(path / "adapter" / "adapter_model.safetensors"))
        set_peft_model_state_dict(self.model, adapter)
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        rng = torch.load(path / "rng_state.pt", weights_only=False)  # our own file: numpy/python states
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        self.step = state["step"]
        self.history = [StepMetrics(**m) for m in state["metrics"]]
        self.resumed_from = step
        self.latest_checkpoint = path
        return step

    @staticmethod
    def _seed_everything(seed: int) -> None:
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)


def _with_loss_masks(mask: torch.Tensor, batch: list[TrainingSample]) -> torch.Tensor:
    """``[mb, seq]`` completion mask (left-aligned, as :func:`completion_logprobs` returns it)
    times each sample's ``loss_mask``: a packed conversation's tool results and user messages
    leave the loss, its assistant turns stay."""
    if all(s.loss_mask is None for s in batch):
        return mask
    mask = mask.clone()
    for i, s in enumerate(batch):
        if s.loss_mask is not None:
            mask[i, : len(s.loss_mask)] *= torch.tensor(s.loss_mask, dtype=mask.dtype, device=mask.device)
    return mask


@dataclass(frozen=True)
class DataParallel:
    """This process's place in a data-parallel round (module docstring, "Data parallel").

    Attributes:
        rank: this worker, ``0 <= rank < world_size``; rank 0 writes the checkpoints.
        world_size: workers in the round.
        all_reduce: sums a tensor over the workers in place (e.g. ``torch.distributed.all_reduce``
            with ``ReduceOp.SUM`` over a gloo or NCCL process group); every worker calls it on the
            same tensors in the same order.
    """

    rank: int
    world_size: int
    all_reduce: Callable[[torch.Tensor], None]

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in 0..{self.world_size - 1}")


class CheckpointMismatch(ValueError):
    """The latest checkpoint in ``output_dir`` was written by another round (other settings or
    samples), so it cannot be resumed; raised before anything is restored."""


class TrainingPaused(Exception):
    """Raised by a step callback to pause a round after the current optimizer step; the trainer
    sets ``step`` (the last step taken) and ``checkpoint`` (its directory) before it propagates."""

    def __init__(self, reason: str = "paused"):
        super().__init__(reason)
        self.step: int | None = None
        self.checkpoint: str | None = None


def train_grpo_round(
    model: PeftModel,
    samples: list[TrainingSample],
    config: GRPOTrainerConfig | None = None,
    ref_model: PreTrainedModel | None = None,
    resume: bool = False,
    on_step: Callable[[StepMetrics], None] | None = None,
    data_parallel: DataParallel | None = None,
) -> RoundResult:
    """Run one GRPO training round (see module docstring); with ``resume=True`` continue the latest
    complete checkpoint in ``config.output_dir`` if there is one. With ``data_parallel``, this
    process is one worker of a data-parallel round (module docstring).

    Raises:
        TypeError / ValueError: see :class:`GRPORoundTrainer` and
            :meth:`GRPORoundTrainer.resume_from_latest`.
    """
    trainer = GRPORoundTrainer(model, samples, config, ref_model, data_parallel)
    if resume:
        trainer.resume_from_latest()
    return trainer.train(on_step=on_step)
