"""Whether bfloat16 is worth using on the machine a run lands on.

bfloat16 autocast speeds up a SmolLM2-135M LoRA step on a CPU with bfloat16 matrix units (AMX on
Sapphire Rapids: 381 tokens/s against 217 in float32) and on a GPU. A CPU without native bfloat16
support emulates it: on an AMD EPYC with AVX2 only (2026-11-28) one forward and backward of 1,024
tokens took 20 s + 196 s in bfloat16 against 4 s + 9 s in float32, 85% of it in ``aten::mm``. So
the demos that default to bfloat16 ask here first, and fall back to float32 where it is emulated.
"""

from __future__ import annotations


def bfloat16_is_fast(device: str = "cpu") -> bool:
    """Whether matrix products in bfloat16 run natively on ``device``.

    On a CPU this is the test PyTorch's oneDNN backend makes for its bfloat16 kernels
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported``: AVX-512 BW/VL/DQ on x86, which AMX and
    ``avx512_bf16`` CPUs have, or Arm's bfloat16 extension); on CUDA,
    ``torch.cuda.is_bf16_supported``. Any other device: ``False``.

    Args:
        device: a torch device type, ``"cpu"`` or ``"cuda"``.

    Returns:
        ``True`` when bfloat16 is computed natively, ``False`` when it would be emulated or is
        unknown. Raises nothing: a torch build without the check answers ``False``.
    """
    import torch

    if device == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device != "cpu":
        return False
    check = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False
