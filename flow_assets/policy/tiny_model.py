"""A tiny Llama-style causal language model for CPU tests and the demo.

It is a real ``transformers`` ``LlamaForCausalLM`` (RMSNorm, rotary positions, SwiGLU MLP, the
``q/k/v/o_proj`` and ``gate/up/down_proj`` module names LoRA targets), only small. It is saved with
``save_pretrained`` next to the character tokenizer, so the rest of flowopt loads it through the
same ``AutoModelForCausalLM.from_pretrained(path)`` / ``AutoTokenizer.from_pretrained(path)`` path
as a real base model.

Default size (~0.34 M parameters: 2 layers, hidden 128, 8 heads of 16, MLP 256, tied embeddings)
was chosen because it learns ``spell_backward`` (reverse a 3-5 letter word) from 1000
demonstrations in a few seconds on 2 CPU cores (one SFT step of 64 takes ~15 ms) while leaving
headroom for GRPO; with 4 heads the warm start stalled far more often (seed-dependent). See
``benchmarks/spell_backward_curve.py`` for the measured numbers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from flow_assets.policy.attention import attention_implementation
from flow_assets.policy.configs import TinyModelConfig
from flow_assets.policy.tokenizer import CharTokenizerConfig, build_char_tokenizer


def llama_config(config: TinyModelConfig, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    """The ``LlamaConfig`` for ``config`` with vocabulary size and special ids from ``tokenizer``.

    Raises:
        ValueError: if ``hidden_size`` is not a multiple of ``num_attention_heads``.
    """
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"hidden_size {config.hidden_size} is not divisible by "
            f"num_attention_heads {config.num_attention_heads}"
        )
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,
        initializer_range=config.initializer_range,
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def build_tiny_model(
    config: TinyModelConfig | None = None, tokenizer: PreTrainedTokenizerBase | None = None
) -> LlamaForCausalLM:
    """A freshly initialised tiny ``LlamaForCausalLM`` (float32, eval mode).

    Deterministic: the weights depend only on ``config`` (``seed`` included). The caller's global
    torch RNG state is left untouched (initialisation runs inside ``torch.random.fork_rng``).

    Args:
        config: sizes and seed; defaults to ``TinyModelConfig()``.
        tokenizer: supplies vocabulary size and pad/bos/eos ids; defaults to the character tokenizer.
    """
    config = config or TinyModelConfig()
    tokenizer = tokenizer or build_char_tokenizer(
        CharTokenizerConfig(model_max_length=config.max_position_embeddings)
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = LlamaForCausalLM(llama_config(config, tokenizer))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval()


def save_tiny_policy(directory: str | Path, config: TinyModelConfig | None = None) -> Path:
    """Build the character tokenizer and a tiny model and ``save_pretrained`` both into ``directory``.

    Returns:
        ``directory`` (created if missing), holding ``config.json``, ``model.safetensors``,
        ``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json``.
    """
    config = config or TinyModelConfig()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(
        CharTokenizerConfig(model_max_length=config.max_position_embeddings)
    )
    build_tiny_model(config, tokenizer).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def load_policy(directory: str | Path, dtype: str | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a saved policy (tiny or real) the standard way; the model is returned in eval mode.

    ``dtype`` (``"float32"``, ``"bfloat16"``, ...; a ``torch`` dtype name) loads the weights in that
    precision (``from_pretrained(dtype=...)``); ``None`` keeps transformers' default (float32 for the
    models here, which save float32 weights).

    A grouped-query model (fewer key/value heads than query heads, e.g. SmolLM2) is loaded with
    :data:`flow_assets.policy.attention.SDPA_GQA`, which hands the grouped heads to PyTorch
    without copying them; any other model gets transformers' default attention.

    Raises:
        OSError: if ``directory`` holds no model or tokenizer (raised by ``from_pretrained``).
        ValueError: ``dtype`` is not a floating-point ``torch`` dtype.
    """
    config = AutoConfig.from_pretrained(str(directory))
    kwargs = {}
    if dtype is not None:
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
            raise ValueError(f"dtype must name a floating-point torch dtype (e.g. 'float32', 'bfloat16'), got {dtype!r}")
        kwargs["dtype"] = torch_dtype
    model = AutoModelForCausalLM.from_pretrained(str(directory), attn_implementation=attention_implementation(config), **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    return model.eval(), tokenizer
