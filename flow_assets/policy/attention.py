"""Grouped-query attention without copies, chosen per model at load time.

Hugging Face's ``sdpa`` attention repeats the key/value heads of a grouped-query model (SmolLM2:
3 key/value heads for 9 query heads) once per query head before calling PyTorch's
``scaled_dot_product_attention`` whenever an attention mask is given, which flowopt's batched,
left-padded sampling and scoring always give. PyTorch can take the grouped heads as they are
(``enable_gqa=True``); the result is the same to float precision, and on 2 CPU cores the copies it
saves were a third of a prefill and a fifth of a decode step of 192 SmolLM2 rows.

Transformers offers that only through the process-wide environment variable
``TRANSFORMERS_SDPA_FORCE_GQA``, read at every attention call. Setting and removing it around each
call raced with every other thread that reads ``os.environ`` (a demo crashed with ``KeyError``
inside httpx's proxy lookup). So flowopt registers its own attention function under
:data:`SDPA_GQA` through transformers' documented extension point (``AttentionInterface.register``,
a new name that nothing else reads) and a model opts in when it is loaded
(``from_pretrained(..., attn_implementation=SDPA_GQA)``): nothing process-wide changes at run time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

#: the ``attn_implementation`` name of :func:`sdpa_attention_with_gqa`
SDPA_GQA = "flowopt_sdpa_gqa"


def sdpa_attention_with_gqa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Transformers' SDPA attention, with grouped key/value heads handed to PyTorch as they are.

    Args:
        module: the attention layer (its ``num_key_value_groups`` and ``is_causal`` are read).
        query: ``[batch, heads, q_len, head_dim]``.
        key, value: ``[batch, kv_heads, kv_len, head_dim]`` with ``heads % kv_heads == 0``.
        attention_mask: ``[batch, 1, q_len, kv_len]`` boolean (``True`` attends) or additive float,
            as transformers' ``sdpa_mask`` builds it; ``None`` for plain causal attention.
        dropout: attention dropout probability.
        scaling: the softmax scale (``None``: ``1 / sqrt(head_dim)``).
        is_causal: overrides ``module.is_causal`` when given.

    Returns:
        ``(attn_output: [batch, q_len, heads, head_dim], None)``, the signature transformers expects
        of an attention function.

    Layers without grouped heads, and position biases, go to transformers' own ``sdpa`` unchanged.
    """
    if getattr(module, "num_key_value_groups", 1) <= 1 or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    q_len = query.shape[2]
    if q_len == 1 and query.dtype == torch.bfloat16 and query.device.type == "cpu" and not (module.training and dropout):
        return _decode_step_attention(query, key, value, attention_mask, scaling), None
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(q_len > 1 and attention_mask is None and is_causal)
    if is_causal and key.shape[2] > q_len:
        # prefill into an empty static cache: the unfilled tail is masked anyway (as transformers does)
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def _decode_step_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None
) -> torch.Tensor:
    """One decode step's grouped-query attention as two batched matmuls, for bfloat16 on a CPU.

    Why: PyTorch's CPU flash-attention kernel runs a one-token query in bfloat16 about 8x slower
    than in float32 (16.6 ms against 3.9 ms for 64 rows over 600 keys here, 2026-11-27); two
    matmuls over the grouped heads take 2.1 ms. The scores' softmax runs in float32. Same formula
    as ``scaled_dot_product_attention`` (Vaswani et al. 2017, eq. 1), each group of
    ``heads / kv_heads`` query heads sharing its key/value head (Ainslie et al. 2023, GQA).

    Args:
        query: ``[batch, heads, 1, head_dim]``.
        key, value: ``[batch, kv_heads, kv_len, head_dim]``, ``heads % kv_heads == 0``.
        attention_mask: ``[batch or 1, 1, 1, >= kv_len]`` boolean (``True`` attends) or additive
            float; ``None`` attends to every key.
        scaling: the softmax scale (``None``: ``1 / sqrt(head_dim)``).

    Returns:
        ``[batch, 1, heads, head_dim]`` in ``query``'s dtype (the layout transformers expects).
    """
    batch, heads, _, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)  # [batch, kv_heads, group, head_dim]
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float()  # [batch, kv_heads, group, kv_len]
    scores *= scaling if scaling is not None else head_dim**-0.5
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :kv_len]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    weights = scores.softmax(dim=-1).to(value.dtype)
    return torch.matmul(weights, value).reshape(batch, 1, heads, head_dim)


def attention_implementation(config: PretrainedConfig) -> str | None:
    """The ``attn_implementation`` to load a model of ``config`` with: :data:`SDPA_GQA` for a
    grouped-query model (fewer key/value heads than query heads), else ``None`` (transformers'
    default)."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return SDPA_GQA if heads and kv_heads and kv_heads < heads else None


# Registration adds a name nobody else uses, once, at import (before any thread of flowopt runs a
# model); it changes nothing any other model or library reads.
AttentionInterface.register(SDPA_GQA, sdpa_attention_with_gqa)
AttentionMaskInterface.register(SDPA_GQA, sdpa_mask)
