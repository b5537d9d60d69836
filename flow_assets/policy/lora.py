"""LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") with PEFT.

A LoRA adapter replaces each targeted linear map ``W x`` by ``W x + (alpha / r) * B A x`` with
``A: [r, in]``, ``B: [out, r]`` trainable and ``W`` frozen (paper eq. 3, ``Delta W = B A`` scaled
by ``alpha / r``). ``B`` starts at zero, so a new adapter leaves the base model's outputs unchanged.

The adapter directory is PEFT's own format (``adapter_config.json`` + ``adapter_model.safetensors``),
the one vLLM serves as a LoRA module and the adapter registry points at.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel

#: the Llama attention and MLP projections
LLAMA_PROJECTIONS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


@dataclass(frozen=True)
class LoraAdapterConfig:
    """Shape of a new LoRA adapter.

    Attributes:
        rank: ``r``, the inner dimension of ``B A``. 16 on the tiny model (hidden 128) gives the
            adapter enough capacity to change the policy within a few GRPO rounds.
        alpha: ``lora_alpha``; the update is scaled by ``alpha / rank`` (here 2.0: PEFT users' usual
            ``alpha = 2 r``).
        dropout: dropout on the adapter input; 0 keeps training deterministic and the importance
            ratio exactly 1 at the behaviour parameters.
        target_modules: names of the linear layers that get an adapter (all Llama projections).
        seed: seeds the random initialisation of ``A`` (``B`` is zero), so the same base + config
            gives the same adapter; the caller's global torch RNG state is left untouched.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = field(default=LLAMA_PROJECTIONS)
    seed: int = 0


def add_lora_adapter(model: PreTrainedModel, config: LoraAdapterConfig | None = None) -> PeftModel:
    """Wrap ``model`` with a new, trainable LoRA adapter named ``"default"``.

    Only the adapter's ``A``/``B`` matrices require grad. PEFT injects the adapter layers into
    ``model`` in place, so do not keep using ``model`` as the unadapted base afterwards (use
    ``peft_model.disable_adapter()`` for that).
    """
    config = config or LoraAdapterConfig()
    peft_config = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return get_peft_model(model, peft_config)


def load_lora_adapter(
    model: PreTrainedModel, adapter_dir: str | Path, trainable: bool = True
) -> PeftModel:
    """Load the adapter saved in ``adapter_dir`` onto the base ``model``.

    Args:
        model: the base model the adapter was trained on (same architecture and sizes).
        adapter_dir: a directory written by :func:`save_lora_adapter` (or any PEFT LoRA dir).
        trainable: ``True`` to continue training the adapter (its weights require grad), ``False``
            for inference only.

    Raises:
        ValueError / OSError: (from PEFT) when the directory holds no adapter or shapes mismatch.
    """
    return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)


def save_lora_adapter(model: PeftModel, adapter_dir: str | Path) -> Path:
    """Save only the adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

    Returns:
        ``adapter_dir`` (created if missing).
    """
    adapter_dir = Path(adapter_dir)
    adapter_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(adapter_dir), safe_serialization=True)
    return adapter_dir
