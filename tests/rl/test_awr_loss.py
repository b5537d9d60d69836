"""The advantage-weighted likelihood against hand computations on small tensors."""

import math

import pytest
import torch

from flow_assets.rl.awr_loss import AWRLossConfig, awr_loss, awr_weights

# two rows of three token slots; row 0 has 2 real tokens, row 1 has 3
LOGP = [[-0.5, -1.0, -9.0], [-2.0, -0.25, -1.5]]
MASK = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]


def _logp():
    return torch.tensor(LOGP, requires_grad=True)


def test_fr3_positive_weighting_is_minus_logp_times_advantage_on_positive_rows_only():
    logp = _logp()
    out = awr_loss(logp, torch.tensor(MASK), torch.tensor([0.8, -0.4]))
    # row 1 (A < 0) leaves the loss; dapo: sum over kept tokens / kept tokens = 0.8 * (0.5 + 1.0) / 2
    assert out.loss.item() == pytest.approx(0.8 * (0.5 + 1.0) / 2)
    assert (out.kept_fraction, out.mean_weight, out.num_tokens) == (0.5, pytest.approx(0.8), 2)
    out.loss.backward()
    # gradient descent raises the likelihood of the kept row's real tokens, and touches nothing else
    assert torch.allclose(logp.grad, torch.tensor([[-0.4, -0.4, 0.0], [0.0, 0.0, 0.0]]))


def test_filtered_bc_with_weight_one_is_the_mean_nll_of_positive_rows():
    config = AWRLossConfig(positive_weight="one")
    out = awr_loss(_logp(), torch.tensor(MASK), torch.tensor([0.3, 2.0]), config=config)
    nll = (0.5 + 1.0 + 2.0 + 0.25 + 1.5) / 5
    assert out.loss.item() == pytest.approx(nll) and out.mean_weight == 1.0 and out.kept_fraction == 1.0


def test_exp_weights_are_awr_weights_clipped_at_weight_clip():
    config = AWRLossConfig(weighting="exp", awr_beta=0.5, weight_clip=3.0)
    advantages = torch.tensor([1.0, -0.5])  # exp(2) = 7.39 -> clipped to 3; exp(-1) = 0.368
    weights, clipped = awr_weights(advantages, config)
    assert torch.allclose(weights, torch.tensor([3.0, math.exp(-1.0)])) and clipped.tolist() == [True, False]
    logp = _logp()
    out = awr_loss(logp, torch.tensor(MASK), advantages, config=config)
    by_hand = (3.0 * (0.5 + 1.0) + math.exp(-1.0) * (2.0 + 0.25 + 1.5)) / 5
    assert out.loss.item() == pytest.approx(by_hand)
    assert out.kept_fraction == 1.0 and out.clipped_fraction == 0.5
    assert out.mean_weight == pytest.approx((3.0 + math.exp(-1.0)) / 2)
    out.loss.backward()
    # a negative advantage still pulls the likelihood up under exp weights, just less (never down)
    assert (logp.grad[torch.tensor(MASK) > 0] < 0).all()
    assert logp.grad[0, 0].item() == pytest.approx(-3.0 / 5) and logp.grad[1, 0].item() == pytest.approx(-math.exp(-1.0) / 5)


def test_the_advantage_weight_is_clipped_too():
    out = awr_loss(_logp(), torch.tensor(MASK), torch.tensor([50.0, 0.0]), config=AWRLossConfig(weight_clip=5.0))
    assert out.loss.item() == pytest.approx(5.0 * 1.5 / 2) and out.clipped_fraction == 1.0 and out.kept_fraction == 0.5


def test_k3_kl_to_the_reference_on_the_kept_tokens():
    ref = torch.tensor([[-0.7, -0.9, 0.0], [-1.0, -1.0, -1.0]])
    config = AWRLossConfig(beta_kl=0.1)
    out = awr_loss(_logp(), torch.tensor(MASK), torch.tensor([1.0, -1.0]), ref_logp=ref, config=config)
    # k3 = exp(d) - d - 1, d = ref - logp, on row 0's two tokens
    kl = [math.exp(d) - d - 1 for d in (-0.7 + 0.5, -0.9 + 1.0)]
    assert out.mean_kl == pytest.approx(sum(kl) / 2, rel=1e-5)  # float32
    assert out.loss.item() == pytest.approx((1.0 * (0.5 + 1.0) + 0.1 * sum(kl)) / 2)
    with pytest.raises(ValueError, match="beta_kl > 0 needs ref_logp"):
        awr_loss(_logp(), torch.tensor(MASK), torch.tensor([1.0, -1.0]), config=config)


def test_aggregation_follows_the_grpo_loss_types():
    advantages = torch.tensor([1.0, 2.0])
    per_row = [1.0 * (0.5 + 1.0), 2.0 * (2.0 + 0.25 + 1.5)]
    grpo = awr_loss(_logp(), torch.tensor(MASK), advantages, config=AWRLossConfig(loss_type="grpo"))
    assert grpo.loss.item() == pytest.approx((per_row[0] / 2 + per_row[1] / 3) / 2)
    dr = awr_loss(_logp(), torch.tensor(MASK), advantages, config=AWRLossConfig(loss_type="dr_grpo", max_completion_length=4))
    assert dr.loss.item() == pytest.approx(sum(per_row) / (2 * 4))


def test_nothing_kept_gives_a_differentiable_zero():
    logp = _logp()
    out = awr_loss(logp, torch.tensor(MASK), torch.tensor([-1.0, 0.0]))
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.kept_fraction == 0.0 and out.num_tokens == 0 and (logp.grad == 0).all()


def test_bad_input_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="advantages has shape"):
        awr_loss(_logp(), torch.tensor(MASK), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="mask has shape"):
        awr_loss(_logp(), torch.ones(2, 2), torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="finite"):
        awr_loss(_logp(), torch.tensor(MASK), torch.tensor([float("nan"), 1.0]))
    with pytest.raises(ValueError, match="awr_beta"):
        AWRLossConfig(weighting="exp", awr_beta=0.0)
    with pytest.raises(ValueError, match="weighting"):
        AWRLossConfig(weighting="softmax")
