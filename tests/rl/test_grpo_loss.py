"""The clipped GRPO surrogate against a hand-computed 2x3 example.

The example (epsilon = epsilon_high = 0.2), with d = logp_new - logp_old::

    row 0, A = +1:  d = [ 0.0,  0.5, -0.3]            mask = [1, 1, 1]
    row 1, A = -2:  d = [-0.5,  0.0, -1.0]            mask = [1, 1, 0]

    ratio      row 0: [1, e^0.5 = 1.6487213, e^-0.3 = 0.7408182]
               row 1: [e^-0.5 = 0.6065307, 1, e^-1 = 0.3678794]
    clip(ratio, 0.8, 1.2)
               row 0: [1, 1.2, 0.8]            row 1: [0.8, 1, 0.8]
    min(ratio*A, clip*A)
               row 0 (A=+1): [min(1, 1) = 1, min(1.6487, 1.2) = 1.2 (clipped high), min(0.7408, 0.8) = 0.7408]
               row 1 (A=-2): [min(-1.2131, -1.6) = -1.6 (clipped low), min(-2, -2) = -2, (masked)]
    per-token loss L = -min
               row 0: [-1, -1.2, -0.7408182]   sum = -2.9408182, 3 tokens
               row 1: [ 1.6, 2.0,  (1.6)]      sum (masked) = 3.6, 2 tokens

    "grpo":    mean(-2.9408182 / 3, 3.6 / 2) = mean(-0.9802727, 1.8) = 0.4098636
    "dapo":    (-2.9408182 + 3.6) / 5 = 0.6591818 / 5 = 0.1318364     (= "bnpo")
    "dr_grpo": 0.6591818 / (2 * 3) = 0.1098636

    clip: low (A < 0, ratio < 0.8) = 1 token (row 1 col 0; row 1 col 2 is masked),
          high (A > 0, ratio > 1.2) = 1 token (row 0 col 1); fractions over 5 tokens: 0.2, 0.2, 0.4
    mean ratio = (1 + 1.6487213 + 0.7408182 + 0.6065307 + 1) / 5 = 0.9992140

    d loss_dapo / d logp_new = -ratio * A / 5 where unclipped, 0 where clipped or masked:
               row 0: [-0.2, 0, -0.1481636]     row 1: [0, 0.4, 0]
"""

import math

import pytest
import torch

from flow_assets.rl.grpo_loss import GRPOLossConfig, grpo_loss, k3_kl

LOGP_OLD = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.5, -2.0]])
D = torch.tensor([[0.0, 0.5, -0.3], [-0.5, 0.0, -1.0]])
ADV = torch.tensor([1.0, -2.0])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def _logp_new() -> torch.Tensor:
    return (LOGP_OLD + D).clone().requires_grad_(True)


@pytest.mark.parametrize(
    "loss_type, expected",
    [("grpo", 0.4098636), ("dapo", 0.1318364), ("bnpo", 0.1318364), ("dr_grpo", 0.1098636)],
)
def test_loss_types_match_hand_computation(loss_type, expected):
    out = grpo_loss(_logp_new(), LOGP_OLD, ADV, MASK, config=GRPOLossConfig(loss_type=loss_type))
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)


def test_metrics_match_hand_computation():
    out = grpo_loss(_logp_new(), LOGP_OLD, ADV, MASK)
    assert out.clip_low_fraction == pytest.approx(0.2)
    assert out.clip_high_fraction == pytest.approx(0.2)
    assert out.clip_fraction == pytest.approx(0.4)
    assert out.mean_ratio == pytest.approx(0.9992140, abs=1e-6)
    assert out.mean_kl == 0.0
    assert out.num_tokens == 5


def test_clipped_tokens_get_zero_gradient_and_clipping_side_follows_advantage_sign():
    logp_new = _logp_new()
    grpo_loss(logp_new, LOGP_OLD, ADV, MASK).loss.backward()
    expected = torch.tensor([[-0.2, 0.0, -math.exp(-0.3) / 5], [0.0, 0.4, 0.0]])
    assert torch.allclose(logp_new.grad, expected, atol=1e-6)
    # A > 0 clips only above (row 0 col 1, ratio 1.65 -> no grad; ratio 0.74 keeps its gradient);
    # A < 0 clips only below (row 1 col 0, ratio 0.61 -> no grad)
    assert logp_new.grad[0, 1] == 0 and logp_new.grad[0, 2] != 0 and logp_new.grad[1, 0] == 0


def test_positive_advantage_below_range_and_negative_above_range_are_not_clipped():
    # A > 0 with ratio 0.5 and A < 0 with ratio 1.5: outside [0.8, 1.2] but on the side PPO keeps
    logp_old = torch.zeros(2, 1)
    logp_new = torch.tensor([[math.log(0.5)], [math.log(1.5)]], requires_grad=True)
    out = grpo_loss(logp_new, logp_old, torch.tensor([1.0, -1.0]), torch.ones(2, 1))
    out.loss.backward()
    # loss = (-(0.5 * 1) - (1.5 * -1)) / 2 = 0.5; grads = -ratio * A / 2 = [-0.25, 0.75]
    assert out.loss.item() == pytest.approx(0.5)
    assert torch.allclose(logp_new.grad, torch.tensor([[-0.25], [0.75]]))
    assert out.clip_fraction == 0.0


def test_missing_behaviour_logprobs_mean_ratio_one_and_plain_policy_gradient():
    logp_new = _logp_new()
    out = grpo_loss(logp_new, None, ADV, MASK)
    out.loss.backward()
    # ratio = 1 everywhere: loss = -(3 * 1 + 2 * -2) / 5 = 0.2; grad = -A / 5 on real tokens
    assert out.loss.item() == pytest.approx(0.2)
    assert out.mean_ratio == pytest.approx(1.0)
    assert torch.allclose(logp_new.grad, torch.tensor([[-0.2, -0.2, -0.2], [0.4, 0.4, 0.0]]))


def test_zero_advantage_gives_no_gradient():
    logp_new = _logp_new()
    grpo_loss(logp_new, LOGP_OLD, torch.zeros(2), MASK).loss.backward()
    assert torch.count_nonzero(logp_new.grad) == 0


def test_k3_kl_value_and_beta_weighting():
    # d = ref - new: row 0 [0, 0.5, -1], row 1 [0, 0, 0]
    # k3 = e^d - d - 1: [0, 1.6487213 - 1.5 = 0.1487213, 0.3678794 + 1 - 1 = 0.3678794], zeros
    logp_new = _logp_new()
    ref = logp_new.detach() + torch.tensor([[0.0, 0.5, -1.0], [0.0, 0.0, 0.0]])
    kl = k3_kl(logp_new.detach(), ref)
    assert torch.allclose(kl[0], torch.tensor([0.0, 0.1487213, 0.3678794]), atol=1e-6)
    assert torch.all(kl[1] == 0)
    out = grpo_loss(logp_new, LOGP_OLD, ADV, MASK, ref_logp=ref, config=GRPOLossConfig(beta=0.1))
    # mean KL over the 5 real tokens = 0.5166007 / 5 = 0.1033201; loss = 0.1318364 + 0.1 * 0.1033201
    assert out.mean_kl == pytest.approx(0.1033201, abs=1e-6)
    assert out.loss.item() == pytest.approx(0.1421684, abs=1e-6)


def test_dr_grpo_uses_configured_max_completion_length():
    out = grpo_loss(_logp_new(), LOGP_OLD, ADV, MASK, config=GRPOLossConfig(loss_type="dr_grpo", max_completion_length=10))
    assert out.loss.item() == pytest.approx(0.6591818 / 20, abs=1e-6)


def test_bad_inputs_raise():
    with pytest.raises(ValueError):
        grpo_loss(_logp_new(), LOGP_OLD[:, :2], ADV, MASK)
    with pytest.raises(ValueError):
        grpo_loss(_logp_new(), LOGP_OLD, ADV[:1], MASK)
    with pytest.raises(ValueError):
        grpo_loss(_logp_new(), LOGP_OLD, ADV, MASK, config=GRPOLossConfig(beta=0.1))
    with pytest.raises(ValueError):
        grpo_loss(_logp_new(), LOGP_OLD, ADV, MASK, config=GRPOLossConfig(loss_type="nope"))
