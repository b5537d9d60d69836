"""The demos' bfloat16 defaults follow what the CPU computes natively."""

from __future__ import annotations

from pathlib import Path

import pytest

from flow_assets.demo.bfcl import EVAL_DTYPE, GATE_EVAL, WARM_START, precision_defaults
from flow_assets.demo.logs import FAMILIES, family_train
from flow_assets.policy.precision import bfloat16_is_fast


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads Linux's /proc/cpuinfo")
def test_bfloat16_counts_as_fast_only_on_a_cpu_with_bfloat16_or_avx512_units():
    flags = _cpu_flags()
    if flags & {"amx_bf16", "avx512_bf16"}:
        assert bfloat16_is_fast()
    if not any(f.startswith("avx512") for f in flags) and not any(f.startswith("amx") for f in flags):
        assert not bfloat16_is_fast()
    assert not bfloat16_is_fast("mps")


def test_the_tau_bench_demo_trains_in_float32_where_bfloat16_is_emulated():
    spec = FAMILIES["tau-bench"]
    assert spec.train.bf16
    assert family_train(spec, True) == spec.train
    emulated = family_train(spec, False)
    assert not emulated.bf16 and emulated.to_dict() | {"bf16": True} == spec.train.to_dict()
    assert family_train(FAMILIES["fireact"], False) == FAMILIES["fireact"].train


def test_the_bfcl_demo_trains_and_serves_in_float32_where_bfloat16_is_emulated():
    assert precision_defaults(True) == (WARM_START, GATE_EVAL, EVAL_DTYPE)
    warm, gate, dtype = precision_defaults(False)
    assert (warm["sft"]["bf16"], gate["dtype"], dtype) == (False, "float32", "float32")
    assert WARM_START["sft"]["bf16"] and GATE_EVAL["dtype"] == "bfloat16"  # the defaults themselves unchanged
    assert {k: v for k, v in warm.items() if k != "sft"} == {k: v for k, v in WARM_START.items() if k != "sft"}
