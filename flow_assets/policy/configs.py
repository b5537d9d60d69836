"""The policy's settings and the records it hands on, as plain dataclasses (no torch, no transformers).

They live apart from the code that uses them (:mod:`~flow_assets.policy.sampling`,
:mod:`~flow_assets.policy.tiny_model`, :mod:`~flow_assets.policy.sft`,
:mod:`~flow_assets.policy.trainer`) because the code location needs them without that code:
Dagster's run configs are generated from the configs when the definitions load, and the gateway's
batcher and :mod:`~flow_assets.policy.rollouts` (lake rows to training samples) build the records.
Importing torch and transformers costs seconds, and every run, sensor and code server process
loads the code location first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from flow_assets.rl.awr_loss import AWRLossConfig
from flow_assets.rl.grpo_config import GRPOLossConfig

ROUND_MAX_NEW_TOKENS = 8
"""Completion cap in tokens where a caller of flowopt's own rounds sets none: the in-process
sampler's default and the self-play gateway's (``PolicyStore.max_new_tokens``). The tiny
character model's spell_backward answers fit in it; agents that need more ask per call (the
calculator agents ask for 32 and 48 tokens). ``flowopt serve``, in front of a team's own agent,
uses :data:`SERVE_MAX_TOKENS` instead."""

SERVE_MAX_TOKENS = 256
"""Completion cap in tokens for a call that sets none, when the gateway serves a team's agent
(``flowopt serve``'s ``--max-tokens`` default, ``GatewayConfig.default_max_tokens``)."""


@dataclass(frozen=True)
class SamplingConfig:
    """How rollouts are drawn.

    Attributes:
        num_samples: completions per prompt (the GRPO group size ``G``); 8 as in the flowopt demo.
        temperature: softmax temperature ``T``; ``0`` means greedy decoding (one argmax completion
            repeated ``num_samples`` times, so use ``num_samples=1`` with it).
        top_p: nucleus sampling threshold; ``1.0`` disables it (and keeps the returned log-probs the
            exact sampling log-probs).
        max_new_tokens: cap on completion length in tokens, ``<eos>`` included.
        seed: seeds the sampling RNG; same model + prompts + config gives the same rollouts. The
            caller's global torch RNG state is left as it was.
        max_batch_size: most sequences per ``generate`` call (memory bound); prompts x samples
            beyond it are split into several calls.
    """

    num_samples: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = ROUND_MAX_NEW_TOKENS
    seed: int = 0
    max_batch_size: int = 1024


@dataclass(frozen=True)
class Rollout:
    """One sampled completion of one prompt.

    Attributes:
        prompt_index: index of the prompt in the input list.
        sample_index: ``0 .. num_samples-1`` within that prompt's group.
        prompt: the prompt text.
        prompt_ids: the prompt's token ids as fed to the model (``<bos>`` first), unpadded.
        completion_ids: sampled token ids, up to and including the first ``<eos>`` if any.
        completion_text: ``completion_ids`` decoded without special tokens.
        logprobs: ``[len(completion_ids)]`` behaviour log-probs (natural log), see
            :mod:`~flow_assets.policy.sampling`.
        finished: the completion ended with ``<eos>`` (else it hit ``max_new_tokens``).
        error: ``None``, or why this sample has no usable completion (then ``completion_ids`` and
            ``logprobs`` are empty); the other samples of the batch are unaffected.
    """

    prompt_index: int
    sample_index: int
    prompt: str
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_text: str
    logprobs: list[float]
    finished: bool
    error: str | None = None


@dataclass(frozen=True)
class TinyModelConfig:
    """Size and initialisation of the tiny policy.

    Each field's description is its ``metadata["description"]`` (:mod:`flow_assets.core.config`).
    """

    hidden_size: int = field(default=128, metadata={"description": "width of the residual stream (model dimension)."})
    intermediate_size: int = field(default=256, metadata={"description": "width of the SwiGLU MLP."})
    num_hidden_layers: int = field(default=2, metadata={"description": "number of decoder blocks."})
    num_attention_heads: int = field(default=8, metadata={"description": (
        "attention heads per block (``hidden_size`` must divide by it); key/value heads are the same number (no "
        "grouped-query attention at this size).")})
    max_position_embeddings: int = field(default=128, metadata={"description": (
        "longest sequence in tokens (prompt + completion); also written into the tokenizer as ``model_max_length``. "
        "128 holds a two-turn tool conversation of the built-in calculator agent (~60 characters) with room to spare; "
        "rotary positions have no parameters, so the size costs nothing until it is used.")})
    rope_theta: float = field(default=10000.0, metadata={"description": "rotary embedding base."})
    initializer_range: float = field(default=0.02, metadata={"description": (
        "std of the normal initialisation of the weights.")})
    tie_word_embeddings: bool = field(default=True, metadata={"description": (
        "share the input embedding and the output head (fewer parameters).")})
    seed: int = field(default=0, metadata={"description": (
        "seed of the weight initialisation; same config + seed gives bit-identical weights.")})


@dataclass(frozen=True)
class SFTConfig:
    """Settings of the supervised warm start.

    Each field's description is its ``metadata["description"]`` (:mod:`flow_assets.core.config`).
    """

    steps: int = field(default=150, metadata={"description": (
        "optimizer steps. With raw prompts (``\"neon=\"``), 150 steps of 64 on 1000 spell_backward demonstrations gave "
        "held-out success 30-53% at temperature 1 over six seeds (greedy 42-64%). Rendered with the compact chat "
        "template (``U:neon=\\nA:``, as the gateway serves it) the same 150 steps solve far more (measured, seeds 0 / "
        "1: sampled 0.95 / 0.92, greedy 0.99 / 0.97; 60 steps: 0.67 / 0.34 sampled), so the demo warm-starts "
        "spell_backward with 50 steps to leave GRPO room.")})
    learning_rate: float = field(default=3e-3, metadata={"description": (
        "AdamW learning rate (constant); 3e-3 suits a freshly initialised tiny model.")})
    batch_size: int = field(default=64, metadata={"description": (
        "demonstrations per step; the data are reshuffled every pass (epoch). 64 rather than 32 made the warm start "
        "much less seed-dependent on the tiny model.")})
    weight_decay: float = field(default=0.0, metadata={"description": "AdamW decoupled weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"description": "gradients are clipped to this global L2 norm."})
    micro_batch_size: int = field(default=0, metadata={"description": (
        "rows per forward/backward pass; gradients of a step's micro-batches are accumulated with the loss normalised "
        "by the whole step's answer tokens, so the step's gradient is the same as one pass over ``batch_size`` rows "
        "(up to float rounding). 0: one pass per step. Bounds activation memory on long prompts (a 600-token BFCL row "
        "on SmolLM2-135M holds about 0.6 GB of activations).")})
    bf16: bool = field(default=False, metadata={"description": (
        "mixed precision, as transformers' ``TrainingArguments.bf16``: forward and backward under ``torch.autocast`` "
        "in bfloat16, weights, gradients, optimizer state and the log-softmax in float32. On a CPU with AMX "
        "(Sapphire Rapids) a SmolLM2-135M LoRA step on BFCL rows ran at 381 tokens/s against 217 in float32 (measured).")})
    seed: int = field(default=0, metadata={"description": (
        "seeds the minibatch order (numpy ``Generator``); same inputs + config give the same model.")})


@dataclass(frozen=True)
class TrainingSample:
    """One scored completion, token in / token out.

    Attributes:
        prompt_ids: prompt token ids exactly as fed to the sampler (``<bos>`` first).
        completion_ids: sampled completion token ids (``<eos>`` included when produced).
        advantage: the completion's (group-relative) advantage; broadcast over its tokens.
        behaviour_logprobs: ``[len(completion_ids)]`` log-probs at sampling time, or ``None`` (then the
            importance ratio is 1 at the current parameters).
        task_id: the group it came from (informational).
        temperature: the temperature the completion was sampled at (``0`` = greedy, scored at
            1). The behaviour log-probs are ``log_softmax(logits / T)``; the trainer divides the
            new policy's logits by the same ``T``, so the importance ratio compares like with
            like (TRL does the same with its one ``GRPOConfig.temperature``). A log without the
            temperature is read as ``T = 1``.
        loss_mask: ``[len(completion_ids)]`` 1 on the tokens in the loss, 0 on the others, or
            ``None`` (all of them). A packed conversation (several assistant turns of one logged
            conversation in one sample, :func:`~flow_assets.policy.rollouts.text_training_samples`)
            masks out the tool results and user messages between its turns.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    behaviour_logprobs: list[float] | None = None
    task_id: str | None = None
    temperature: float = 1.0
    loss_mask: list[int] | None = None

    def __post_init__(self):
        if self.loss_mask is not None and len(self.loss_mask) != len(self.completion_ids):
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {len(self.completion_ids)} completion tokens")

    @property
    def num_loss_tokens(self) -> int:
        """Completion tokens in the loss."""
        return len(self.completion_ids) if self.loss_mask is None else int(sum(self.loss_mask))


@dataclass(frozen=True)
class GRPOTrainerConfig:
    """Settings of one training round (stored verbatim as ``config.json`` in every checkpoint).

    Each field's description is its ``metadata["description"]`` (:mod:`flow_assets.core.config`).
    Names are TRL's ``GRPOConfig`` (and its ``TrainingArguments``) names where TRL has the same
    setting: ``output_dir``, ``learning_rate``, ``weight_decay``, ``num_iterations``,
    ``max_steps``, ``max_grad_norm``, ``seed``, ``save_steps``, and in ``loss`` ``epsilon``,
    ``epsilon_high``, ``beta``, ``loss_type``, ``max_completion_length``. The others have no TRL
    field of the same meaning: ``minibatch_size`` is TRL's ``per_device_train_batch_size *
    gradient_accumulation_steps`` (one process), ``micro_batch_size`` its
    ``per_device_train_batch_size``; ``keep_best`` / ``best_metric`` / ``best_mode`` decide
    retention (TRL's ``save_total_limit`` keeps the newest, ``metric_for_best_model`` picks the
    model loaded at the end).
    """

    #: old field name -> new one; a saved run config with an old name is refused, naming the new one
    RENAMED: ClassVar[dict[str, str]] = {"num_epochs": "num_iterations", "checkpoint_every": "save_steps"}

    output_dir: str = field(default="checkpoints", metadata={"description": (
        "where ``checkpoint-<step>/`` directories go.")})
    learning_rate: float = field(default=1e-3, metadata={"description": (
        "AdamW learning rate (constant). 1e-3 for LoRA on the tiny model: 2e-3 oscillated and ended lower, 3e-3 and "
        "above degraded or collapsed the policy within ~10 rounds (measured on spell_backward); real models want "
        "~1e-5 to 1e-4.")})
    weight_decay: float = field(default=0.0, metadata={"description": (
        "AdamW decoupled weight decay (0: the adapter starts at zero anyway).")})
    num_iterations: int = field(default=1, metadata={"description": (
        "passes over the round's samples (TRL's ``num_iterations``, mu in DeepSeekMath; PPO-style reuse; with "
        "behaviour log-probs the importance ratio and clipping keep later passes close to the sampling policy).")})
    minibatch_size: int = field(default=256, metadata={"description": (
        "completions per optimizer step. 256 (32 groups of 8) on the tiny model gave steady curves; smaller "
        "minibatches are noisier, and were where higher learning rates collapsed first.")})
    micro_batch_size: int | None = field(default=None, metadata={"description": (
        "completions per forward/backward pass, their gradients accumulated into the step (TRL's "
        "``per_device_train_batch_size`` with ``gradient_accumulation_steps``); ``None`` = the whole minibatch at "
        "once. Memory, not the result, decides it: SmolLM2-135M with LoRA on 64 rows of 128 tokens needed 10 GB in "
        "micro-batches of 16 and more than 24 GB at once.")})
    max_steps: int | None = field(default=None, metadata={"description": (
        "cap on the round's optimizer steps; ``None`` for ``num_iterations`` full passes.")})
    max_grad_norm: float = field(default=1.0, metadata={"description": (
        "global L2 norm the gradients are clipped to (``clip_grad_norm_``).")})
    gradient_checkpointing: bool = field(default=False, metadata={"description": (
        "recompute each layer's activations in the backward pass instead of keeping them (TRL's and "
        "transformers' name): memory grows with one layer instead of all, for about a third more compute; "
        "for long rows (a packed tau-bench conversation of ~5,500 SmolLM2 tokens took over 20 GB without it).")})
    bf16: bool = field(default=False, metadata={"description": (
        "mixed precision for the ``\"awr\"`` update rule only, as transformers' ``TrainingArguments.bf16``: the "
        "policy's (and the KL reference's) forward and backward under ``torch.autocast`` in bfloat16; weights, "
        "gradients, optimizer state and the log-softmax stay float32. Refused by the trainer under ``\"grpo\"``: its "
        "importance ratio divides by behaviour log-probs computed in float32 at sampling, and both sides of a ratio "
        "must come from the same numerics.")})
    loss: GRPOLossConfig = field(default_factory=GRPOLossConfig, metadata={"description": (
        "the GRPO surrogate's settings (clip ranges, KL weight ``beta``, ``loss_type``).")})
    update_rule: Literal["grpo", "awr"] = field(default="grpo", metadata={"description": (
        "``\"grpo\"``: the clipped GRPO surrogate (``loss``), for the policy's own turns (captured, or text it "
        "logged, re-rendered); ``\"awr\"``: advantage-weighted likelihood (``awr``), for flows another model "
        "wrote. A training round sets it from the batch's agents (the training loop's ``sources``).")})
    awr: AWRLossConfig = field(default_factory=AWRLossConfig, metadata={"description": (
        "the advantage-weighted likelihood's settings (weighting, clip, KL weight), used when ``update_rule`` is "
        "``\"awr\"``.")})
    seed: int = field(default=0, metadata={"description": (
        "seeds minibatch order and the torch/numpy/python RNGs at the start of the round.")})
    save_steps: int = field(default=50, metadata={"description": (
        "save a checkpoint every this many steps, and always at the last step (TRL's ``save_steps``).")})
    keep_best: int = field(default=5, metadata={"description": (
        "number of best checkpoints kept by ``best_metric`` (the latest is kept besides).")})
    best_metric: str = field(default="loss", metadata={"description": (
        ":class:`~flow_assets.policy.trainer.StepMetrics` field averaged over the steps since the previous "
        "checkpoint; the retention score of a checkpoint. Default ``\"loss\"``: note that the GRPO surrogate's value is "
        "a weak quality signal (held-out evaluation picks the candidate); retention only bounds disk use.")})
    best_mode: Literal["min", "max"] = field(default="min", metadata={"description": (
        "``\"min\"`` keeps the lowest scores, ``\"max\"`` the highest.")})

    def __post_init__(self) -> None:
        if self.update_rule not in ("grpo", "awr"):
            raise ValueError(f"update_rule must be 'grpo' or 'awr', got {self.update_rule!r}")

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON-ready data (the nested loss config a nested object): what a
        checkpoint's ``config.json``, a round's ``round.json`` and the tracker record."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GRPOTrainerConfig:
        """The config :meth:`to_dict` wrote (``GRPOTrainerConfig.from_dict(c.to_dict()) == c``).

        Raises:
            TypeError: an unknown field, e.g. one renamed since the data were written.
        """
        values = dict(data)
        loss = GRPOLossConfig(**values.pop("loss", {}))
        awr = AWRLossConfig(**values.pop("awr", {}))
        return cls(**values, loss=loss, awr=awr)

