"""Tests for open_instruct.rl (masked, advantages, losses, logprobs): hand-worked numbers, slow reference loops, and padding that must not leak."""

import math

import pytest
import torch

from open_instruct import rl
from tests.support.vocab_watch import LargestVocabTensor

GARBAGE = (1e9, float("nan"), float("inf"))


def fill_padding(values: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(mask.bool(), values, torch.full_like(values, fill))


def random_prefix_mask(batch: int, response_len: int, generator: torch.Generator) -> torch.Tensor:
    # Lengths from 1 to response_len, like truncate_response produces.
    response_length = torch.randint(1, response_len + 1, (batch,), generator=generator)
    return rl.response_mask_from_lengths(response_length, response_len)


# ---------------------------------------------------------------- masked statistics


def test_masked_mean_scalar_and_per_row():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # all valid: (1 + 2 + 4) / 3 = 7/3; rows: (1 + 2) / 2 = 1.5 and 4 / 1 = 4
    assert rl.masked_mean(values, mask).item() == pytest.approx(7 / 3)
    torch.testing.assert_close(rl.masked_mean(values, mask, axis=1), torch.tensor([1.5, 4.0]))
    # per column: (1 + 4) / 2, 2 / 1, and an empty column -> 0
    torch.testing.assert_close(rl.masked_mean(values, mask.bool(), axis=0), torch.tensor([2.5, 2.0, 0.0]))


def test_masked_mean_empty_row_is_zero_not_nan():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    torch.testing.assert_close(rl.masked_mean(values, mask, axis=1), torch.tensor([1.5, 0.0]))
    assert rl.masked_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_masked_var_hand_numbers():
    values = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([True, True, True, False])
    # mean 2, squared deviations 1 + 0 + 1 = 2: unbiased 2 / (3 - 1) = 1, biased 2 / 3
    assert rl.masked_var(values, mask).item() == pytest.approx(1.0)
    assert rl.masked_var(values, mask, unbiased=False).item() == pytest.approx(2 / 3)


def test_masked_var_rejects_too_few_elements():
    values = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="0 valid element"):
        rl.masked_var(values, torch.tensor([False, False]))
    with pytest.raises(ValueError, match="1 valid element.*unbiased=False"):
        rl.masked_var(values, torch.tensor([True, False]))
    assert rl.masked_var(values, torch.tensor([True, False]), unbiased=False).item() == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_whiten_zero_mean_unit_variance_and_padding_zero(seed):
    generator = torch.Generator().manual_seed(seed)
    mask = random_prefix_mask(6, 9, generator)
    values = 3.0 + 5.0 * torch.randn(6, 9, generator=generator)
    whitened = rl.masked_whiten(values, mask)
    assert rl.masked_mean(whitened, mask).item() == pytest.approx(0.0, abs=1e-5)
    assert rl.masked_var(whitened, mask).item() == pytest.approx(1.0, abs=1e-4)
    assert (whitened[~mask] == 0).all()
    # shift_mean=False only rescales: the mean stays, the variance becomes 1.
    rescaled = rl.masked_whiten(values, mask, shift_mean=False)
    assert rl.masked_mean(rescaled, mask).item() == pytest.approx(
        rl.masked_mean(values, mask).item(), abs=1e-4
    )
    assert rl.masked_var(rescaled, mask).item() == pytest.approx(1.0, abs=1e-4)
    assert (rescaled[~mask] == 0).all()


def test_masked_whiten_hand_numbers():
    values = torch.tensor([[1.0, 3.0, 7.0]])
    mask = torch.tensor([[True, True, False]])
    # mean 2, unbiased var ((1-2)^2 + (3-2)^2) / 1 = 2 -> (x - 2) / sqrt(2)
    expected = torch.tensor([[-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0]])
    torch.testing.assert_close(rl.masked_whiten(values, mask), expected)


# ---------------------------------------------------------------- truncation and masks


def test_first_true_indices():
    bools = torch.tensor([[False, True, True], [False, False, False], [True, False, False]])
    torch.testing.assert_close(rl.first_true_indices(bools), torch.tensor([1, 3, 0]))
    assert rl.first_true_indices(bools, dtype=torch.int32).dtype == torch.int32


def test_truncate_response_keeps_first_stop_token_and_pads_after():
    stop_ids, pad = [2, 9], 0
    response = torch.tensor([[5, 2, 7, 8], [5, 6, 7, 8], [9, 1, 2, 3], [5, 6, 7, 2]])
    truncated, response_length = rl.truncate_response(response, stop_ids, pad)
    expected = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [9, 0, 0, 0], [5, 6, 7, 2]])
    torch.testing.assert_close(truncated, expected)
    torch.testing.assert_close(response_length, torch.tensor([2, 4, 1, 4]))


def test_turn_ends_are_sampled_tokens_followed_by_unsampled_ones():
    sampled = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    expected = torch.tensor([[0, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(rl.turn_ends(sampled), expected)


def test_truncate_response_when_pad_equals_stop_token():
    # SmolLM2: <|im_end|> is both the stop token and the pad token.
    im_end = 2
    response = torch.tensor([[5, im_end, im_end, im_end], [5, 6, 7, 8], [im_end, im_end, im_end, im_end]])
    truncated, response_length = rl.truncate_response(response, [im_end], pad_token_id=im_end)
    torch.testing.assert_close(truncated, response)
    torch.testing.assert_close(response_length, torch.tensor([2, 4, 1]))
    mask = rl.response_mask_from_lengths(response_length, 4)
    expected_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    torch.testing.assert_close(mask, expected_mask)


def test_truncate_response_without_stop_ids_keeps_everything():
    response = torch.tensor([[5, 6, 7]])
    truncated, response_length = rl.truncate_response(response, [], pad_token_id=0)
    torch.testing.assert_close(truncated, response)
    torch.testing.assert_close(response_length, torch.tensor([3]))


def test_response_mask_from_lengths():
    mask = rl.response_mask_from_lengths(torch.tensor([0, 1, 3]), 3)
    expected = torch.tensor([[0, 0, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    torch.testing.assert_close(mask, expected)


# ---------------------------------------------------------------- KL estimators


def test_compute_kl_hand_numbers():
    logprob = torch.tensor([math.log(0.5)])
    ref_logprob = torch.tensor([math.log(0.25)])
    # log_ratio = log 2; k1 = log 2; k2 = (log 2)^2 / 2; k3 = exp(-log 2) - 1 + log 2 = 0.5 - 1 + log 2
    log2 = math.log(2)
    assert rl.compute_kl(logprob, ref_logprob, "k1").item() == pytest.approx(log2)
    assert rl.compute_kl(logprob, ref_logprob, "k2").item() == pytest.approx(log2**2 / 2)
    assert rl.compute_kl(logprob, ref_logprob, "k3").item() == pytest.approx(-0.5 + log2)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_unbiased_kl_estimators_average_to_true_kl(estimator):
    # Exact expectation under the policy p of the per-sample estimate must equal KL(p || q).
    generator = torch.Generator().manual_seed(0)
    log_p = torch.log_softmax(torch.randn(7, generator=generator), dim=0)
    log_q = torch.log_softmax(torch.randn(7, generator=generator), dim=0)
    true_kl = (log_p.exp() * (log_p - log_q)).sum()
    expected_estimate = (log_p.exp() * rl.compute_kl(log_p, log_q, estimator)).sum()
    torch.testing.assert_close(expected_estimate, true_kl)


def test_compute_kl_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError, match="'k4'.*k1, k2, k3"):
        rl.compute_kl(torch.zeros(1), torch.zeros(1), "k4")


def test_kl_penalty_loss_is_masked_mean_of_estimator():
    logprob = torch.tensor([[math.log(0.5), math.log(0.5), 0.0]])
    ref_logprob = torch.tensor([[math.log(0.25), math.log(0.5), 0.0]])
    mask = torch.tensor([[True, True, False]])
    # k3 per token: (log 2 - 0.5) and 0; mean over 2 real tokens
    expected = (math.log(2) - 0.5) / 2
    assert rl.kl_penalty_loss(logprob, ref_logprob, mask).item() == pytest.approx(expected)
    assert rl.kl_penalty_loss(logprob, ref_logprob, mask, "k1").item() == pytest.approx(math.log(2) / 2)


# ---------------------------------------------------------------- rewards


def test_per_token_rewards_score_on_last_real_token():
    score = torch.tensor([1.0, 2.0, 3.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.1, 0.2, 0.3], [0.5, 0.6, 0.7]])
    # row 0 stopped at index 1; row 1 never stopped (score on the final position); row 2 has length 1
    mask = rl.response_mask_from_lengths(torch.tensor([2, 3, 1]), 3)
    reward, non_score_reward = rl.per_token_rewards(score, kl, mask, beta=0.5)
    # non_score = -0.5 * kl on real tokens: row0 [-0.05, -0.1, 0], row1 [-0.05, -0.1, -0.15], row2 [-0.25, 0, 0]
    expected_non_score = torch.tensor([[-0.05, -0.1, 0.0], [-0.05, -0.1, -0.15], [-0.25, 0.0, 0.0]])
    # reward adds the score at index length - 1: -0.1 + 1 = 0.9; -0.15 + 2 = 1.85; -0.25 + 3 = 2.75
    expected_reward = torch.tensor([[-0.05, 0.9, 0.0], [-0.05, -0.1, 1.85], [2.75, 0.0, 0.0]])
    torch.testing.assert_close(non_score_reward, expected_non_score)
    torch.testing.assert_close(reward, expected_reward)


def test_per_token_rewards_rejects_empty_response():
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        rl.per_token_rewards(
            torch.ones(2), torch.zeros(2, 3), torch.tensor([[True, False, False], [False, False, False]]), 0.1
        )


# ---------------------------------------------------------------- GAE


def reference_gae(reward, value, response_length, gamma, lam):
    """Slow per-sequence loop over Python floats: the textbook recursion with V = 0 after the last token."""
    batch, response_len = reward.shape
    advantage = torch.zeros(batch, response_len, dtype=torch.float64)
    return_ = torch.zeros(batch, response_len, dtype=torch.float64)
    for i in range(batch):
        length = int(response_length[i])
        running = 0.0
        for t in reversed(range(length)):
            next_value = float(value[i, t + 1]) if t + 1 < length else 0.0
            delta = float(reward[i, t]) + gamma * next_value - float(value[i, t])
            running = delta + gamma * lam * running
            advantage[i, t] = running
            return_[i, t] = running + float(value[i, t])
    return advantage, return_


def test_compute_gae_hand_numbers():
    reward = torch.tensor([[1.0, 2.0, 5.0]])
    value = torch.tensor([[0.5, 1.0, 9.0]])
    mask = torch.tensor([[True, True, False]])
    # gamma 0.9, lam 0.8. t=1: delta = 2 + 0.9*0 - 1 = 1.0, A1 = 1.0
    # t=0: delta = 1 + 0.9*1.0 - 0.5 = 1.4, A0 = 1.4 + 0.9*0.8*1.0 = 2.12. returns: A + V = 2.62, 2.0
    advantage, return_ = rl.compute_gae(reward, value, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantage, torch.tensor([[2.12, 1.0, 0.0]]))
    torch.testing.assert_close(return_, torch.tensor([[2.62, 2.0, 0.0]]))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("gamma, lam", [(0.99, 0.95), (0.9, 0.5), (1.0, 1.0)])
def test_compute_gae_matches_reference_loop(seed, gamma, lam):
    generator = torch.Generator().manual_seed(seed)
    batch, response_len = 5, 11
    response_length = torch.randint(1, response_len + 1, (batch,), generator=generator)
    mask = rl.response_mask_from_lengths(response_length, response_len)
    reward = torch.randn(batch, response_len, generator=generator, dtype=torch.float64)
    value = torch.randn(batch, response_len, generator=generator, dtype=torch.float64)
    advantage, return_ = rl.compute_gae(reward, value, mask, gamma, lam)
    expected_advantage, expected_return = reference_gae(reward, value, response_length, gamma, lam)
    torch.testing.assert_close(advantage, expected_advantage)
    torch.testing.assert_close(return_, expected_return)


def test_whitened_gae_advantage():
    generator = torch.Generator().manual_seed(4)
    mask = random_prefix_mask(4, 8, generator)
    advantage, _ = rl.compute_gae(torch.randn(4, 8, generator=generator), torch.randn(4, 8), mask, 1.0, 0.95)
    whitened = rl.masked_whiten(advantage, mask)
    assert rl.masked_mean(whitened, mask).item() == pytest.approx(0.0, abs=1e-5)
    assert (whitened[~mask] == 0).all()


# ---------------------------------------------------------------- losses


def clipping_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(new_logprob requiring grad, old_logprob, advantage, mask): ratios 1.5, 0.5, 1.5, 0.5 and a padded token."""
    ratio = torch.tensor([[1.5, 0.5, 1.5, 0.5, 3.0]])
    old_logprob = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.0]])
    new_logprob = (old_logprob + ratio.log()).requires_grad_(True)
    advantage = torch.tensor([[1.0, 1.0, -1.0, -1.0, 7.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    return new_logprob, old_logprob, advantage, mask


def test_policy_loss_clipping_branches_and_gradients():
    # cliprange 0.2. Token by token (pg = max(-A*r, -A*clip(r, 0.8, 1.2))):
    #   A=+1, r=1.5: max(-1.5, -1.2) = -1.2 clipped (no gradient)
    #   A=+1, r=0.5: max(-0.5, -0.8) = -0.5 unclipped, d/dlogp = -A*r = -0.5
    #   A=-1, r=1.5: max( 1.5,  1.2) =  1.5 unclipped, d/dlogp = -A*r = 1.5
    #   A=-1, r=0.5: max( 0.5,  0.8) =  0.8 clipped (no gradient)
    #   a fifth, padded token must not count.
    # loss = (-1.2 - 0.5 + 1.5 + 0.8) / 4 = 0.15; clipfrac = 2/4; ratio_mean = (1.5 + 0.5 + 1.5 + 0.5) / 4 = 1
    new_logprob, old_logprob, advantage, mask = clipping_case()
    loss, clipfrac, approxkl, ratio_mean = rl.policy_loss(new_logprob, old_logprob, advantage, mask, 0.2)
    assert loss.item() == pytest.approx(0.15, abs=1e-6)
    assert clipfrac.item() == pytest.approx(0.5)
    # approxkl = 0.5 * mean(log_ratio^2) = 0.5 * (2 (log 1.5)^2 + 2 (log 0.5)^2) / 4
    assert approxkl.item() == pytest.approx(0.25 * (math.log(1.5) ** 2 + math.log(0.5) ** 2), abs=1e-6)
    assert ratio_mean.item() == pytest.approx(1.0, abs=1e-6)
    loss.backward()
    # gradients divided by the 4 real tokens
    torch.testing.assert_close(new_logprob.grad, torch.tensor([[0.0, -0.5 / 4, 1.5 / 4, 0.0, 0.0]]))
    assert not clipfrac.requires_grad and not approxkl.requires_grad and not ratio_mean.requires_grad


def test_policy_loss_token_weight_scales_each_tokens_surrogate():
    # The tokens of the clipping test above, weighted by w = [2, 0.5, 1, 3] (a padded fifth token holds NaN):
    #   -1.2 * 2 = -2.4 (clipped), -0.5 * 0.5 = -0.25, 1.5 * 1 = 1.5, 0.8 * 3 = 2.4 (clipped)
    # loss = (-2.4 - 0.25 + 1.5 + 2.4) / 4 = 0.3125; gradients -A*r*w/4 on the unclipped tokens:
    #   token 1: -1 * 0.5 * 0.5 / 4 = -0.0625, token 2: 1 * 1.5 * 1 / 4 = 0.375. clipfrac stays 2/4.
    new_logprob, old_logprob, advantage, mask = clipping_case()
    weight = torch.tensor([[2.0, 0.5, 1.0, 3.0, float("nan")]])
    loss, clipfrac, _, _ = rl.policy_loss(new_logprob, old_logprob, advantage, mask, 0.2, weight)
    assert loss.item() == pytest.approx(0.3125, abs=1e-6)
    assert clipfrac.item() == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(new_logprob.grad, torch.tensor([[0.0, -0.0625, 0.375, 0.0, 0.0]]))
    # No weight and a weight of ones are the same loss.
    unweighted, *_ = rl.policy_loss(new_logprob, old_logprob, advantage, mask, 0.2)
    ones, *_ = rl.policy_loss(new_logprob, old_logprob, advantage, mask, 0.2, torch.ones_like(weight))
    assert unweighted.item() == pytest.approx(0.15, abs=1e-6) and ones.item() == pytest.approx(0.15, abs=1e-6)


def test_truncated_importance_weight_hand_numbers():
    # cap 2. weight = min(exp(old - engine), 2):
    #   old - engine = ln 3 -> 3 -> capped at 2;  -ln 2 -> 0.5;  ln 1.5 -> 1.5;
    #   the engine gave no logprob (NaN) -> 1;  padding (engine value anything) -> 1.
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.0]])
    engine = old - torch.tensor([[math.log(3), -math.log(2), math.log(1.5), 0.0, 0.0]])
    engine[0, 3] = float("nan")
    engine[0, 4] = -1e9
    mask = torch.tensor([[True, True, True, True, False]])
    weight = rl.truncated_importance_weight(old, engine, mask, cap=2.0)
    torch.testing.assert_close(weight, torch.tensor([[2.0, 0.5, 1.5, 1.0, 1.0]]))
    # A large cap leaves the ratio itself; identical distributions give 1 everywhere.
    torch.testing.assert_close(rl.truncated_importance_weight(old, engine, mask, cap=100.0)[0, 0], torch.tensor(3.0))
    torch.testing.assert_close(rl.truncated_importance_weight(old, old, mask, cap=2.0), torch.ones(1, 5))


def test_policy_loss_on_policy_is_minus_mean_advantage():
    # ratio 1 everywhere: loss = -mean(A), nothing clipped
    advantage = torch.tensor([[2.0, -1.0, 0.5]])
    logprob = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.tensor([[True, True, True]])
    loss, clipfrac, approxkl, ratio_mean = rl.policy_loss(logprob, logprob, advantage, mask, 0.2)
    assert loss.item() == pytest.approx(-0.5)
    assert clipfrac.item() == 0.0 and approxkl.item() == 0.0 and ratio_mean.item() == 1.0


# ---------------------------------------------------------------- GRPO: group advantages and loss aggregation

# Three prompts with ids 7, 3, 5, their responses interleaved (a rollout need not keep a prompt's samples together).
GROUP = torch.tensor([7, 3, 7, 3, 7, 7, 3, 5, 5])
SCORE = torch.tensor([1.0, 0.9, 0.0, 0.9, 0.0, 1.0, 0.9, 2.0, 0.0])


def test_group_advantages_hand_numbers_with_std():
    advantage, group_std = rl.group_advantages(SCORE, GROUP, std_normalize=True)
    # id 7: scores 1, 0, 0, 1: mean 0.5, unbiased var (4 x 0.25) / 3 = 1/3, std 0.57735; A = +-0.5 / 0.57735 = +-0.86603
    # id 3: 0.9 three times: all equal, so A = 0 exactly and std 0 (in float32 their mean is 0.9 - 6e-8, whose
    # centred scores over a std of 7e-8 would give A = 0.055 without the all-equal check)
    # id 5: scores 2, 0: mean 1, var (1 + 1) / 1 = 2, std 1.41421; A = +-1 / 1.41421 = +-0.70711
    a7, a5 = 0.5 / math.sqrt(1 / 3), 1 / math.sqrt(2)
    expected = torch.tensor([a7, 0.0, -a7, 0.0, -a7, a7, 0.0, a5, -a5])
    torch.testing.assert_close(advantage, expected, atol=1e-5, rtol=0)
    assert advantage[[1, 3, 6]].tolist() == [0.0, 0.0, 0.0]  # exactly: no 1e-9 / (1e-9 + eps) noise
    # Sorted ids 3, 5, 7.
    torch.testing.assert_close(group_std, torch.tensor([0.0, math.sqrt(2), math.sqrt(1 / 3)]))


def test_group_advantages_without_std_only_subtract_the_group_mean():
    advantage, group_std = rl.group_advantages(SCORE, GROUP, std_normalize=False)
    # Dr. GRPO: id 7: 1 - 0.5 = 0.5 and 0 - 0.5 = -0.5; id 3: 0; id 5: 2 - 1 = 1 and 0 - 1 = -1.
    expected = torch.tensor([0.5, 0.0, -0.5, 0.0, -0.5, 0.5, 0.0, 1.0, -1.0])
    torch.testing.assert_close(advantage, expected)
    assert advantage[[1, 3, 6]].tolist() == [0.0, 0.0, 0.0]
    assert group_std[0].item() == 0.0  # reported the same way with the std off


def test_group_advantages_each_group_sums_to_zero_and_is_invariant_to_a_shift():
    generator = torch.Generator().manual_seed(0)
    score = torch.randint(0, 3, (32,), generator=generator).float()
    group = torch.arange(32) % 8
    for std_normalize in (True, False):
        advantage, _ = rl.group_advantages(score, group, std_normalize)
        sums = torch.zeros(8).index_add(0, group, advantage)
        torch.testing.assert_close(sums, torch.zeros(8), atol=1e-5, rtol=0)
        shifted, _ = rl.group_advantages(score + 5.0, group, std_normalize)
        torch.testing.assert_close(shifted, advantage, atol=1e-5, rtol=0)


def test_group_advantages_count_an_agent_rollout_that_split_once_in_its_groups_mean_and_std():
    """Runs scoring 1, 0, 0 where the first run split into three samples (one reward): its samples share one run, so
    the group is the three runs (mean 1/3), not five samples (mean 3/5), and each split sample gets the run's
    advantage."""
    score, group = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 0, 0, 0])
    share = torch.tensor([1 / 3, 1 / 3, 1 / 3, 1.0, 1.0])
    for std_normalize in (True, False):
        runs, runs_std = rl.group_advantages(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0, 0, 0]), std_normalize)
        split, split_std = rl.group_advantages(score, group, std_normalize, run_share=share)
        torch.testing.assert_close(split, runs[[0, 0, 0, 1, 2]])
        torch.testing.assert_close(split_std, runs_std)
    unweighted, _ = rl.group_advantages(score, group, std_normalize=False)
    assert unweighted[0].item() == pytest.approx(0.4), "without shares a split run outweighs the others (mean 3/5)"
    with pytest.raises(ValueError, match="single response"):  # two samples of one run: nothing to compare with
        rl.group_advantages(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), run_share=torch.tensor([0.5, 0.5]))


def test_group_advantages_reject_a_group_of_one():
    with pytest.raises(ValueError, match=r"group\(s\) \[4\] with a single response.*--number_samples_per_prompt >= 2"):
        rl.group_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([2, 2, 4]))


def test_masked_aggregate_token_and_sequence_means():
    values = torch.tensor([[1.0, 2.0, 3.0], [10.0, float("nan"), 1e9]])
    mask = rl.response_mask_from_lengths(torch.tensor([3, 1]), 3)
    # token: (1 + 2 + 3 + 10) / 4 = 4; sequence: mean of the row means 2 and 10 = 6 (padding never read)
    assert rl.masked_aggregate(values, mask, "token").item() == pytest.approx(4.0)
    assert rl.masked_aggregate(values, mask, "sequence").item() == pytest.approx(6.0)
    with pytest.raises(ValueError, match="'sample'.*token, sequence"):
        rl.masked_aggregate(values, mask, "sample")


def test_policy_loss_and_kl_loss_aggregate_by_token_or_by_sequence():
    # On policy (ratio 1) the token loss is -A: row 0 has 3 tokens at A = 1, row 1 one token at A = -2.
    advantage = torch.tensor([[1.0, 1.0, 1.0], [-2.0, 0.0, 0.0]])
    logprob = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    mask = rl.response_mask_from_lengths(torch.tensor([3, 1]), 3)
    token, *_ = rl.policy_loss(logprob, logprob, advantage, mask, 0.2)
    sequence, *_ = rl.policy_loss(logprob, logprob, advantage, mask, 0.2, aggregation="sequence")
    assert token.item() == pytest.approx((-1 - 1 - 1 + 2) / 4)  # -0.25: the long response dominates
    assert sequence.item() == pytest.approx((-1 + 2) / 2)  # 0.5: each response weighs the same
    # k1 KL = logprob - ref: row 0 [1, 1, 1], row 1 [4]: token (3 + 4) / 4 = 1.75, sequence (1 + 4) / 2 = 2.5
    ref = logprob - torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    assert rl.kl_penalty_loss(logprob, ref, mask, "k1").item() == pytest.approx(1.75)
    assert rl.kl_penalty_loss(logprob, ref, mask, "k1", "sequence").item() == pytest.approx(2.5)



def test_micro_batches_of_one_response_each_give_every_token_the_whole_minibatchs_weight():
    """The worked example: responses of 8 and 2 tokens, advantage 1, ratio 1, one micro-batch each. Each micro-batch's
    loss divided by the minibatch's 10 tokens: every token's gradient weight is 1/10, as in one pass over both
    (a mean of the two micro-batches' own means gave 1/16 and 1/4). Sequence aggregation divides by the minibatch's 2
    responses: 1/(2*8) and 1/(2*2), each response weighing the same."""
    lengths = torch.tensor([8, 2])
    mask = rl.response_mask_from_lengths(lengths, 8)
    whole = rl.WholeBatch(tokens=10, sequences=2)
    for aggregation, expected in [("token", [0.1, 0.1]), ("sequence", [1 / 16, 1 / 4])]:
        old_logprob = torch.full((2, 8), -1.0)
        new_logprob = old_logprob.clone().requires_grad_()
        for row in range(2):  # the micro-batches: their parts' gradients add up
            part = slice(row, row + 1)
            loss, *_ = rl.policy_loss(new_logprob[part], old_logprob[part], torch.ones(1, 8), mask[part], 0.2,
                                      aggregation=aggregation, whole=whole)  # fmt: skip
            loss.backward()
        one_pass = old_logprob.clone().requires_grad_()
        rl.policy_loss(one_pass, old_logprob, torch.ones(2, 8), mask, 0.2, aggregation=aggregation)[0].backward()
        # d(-A * ratio)/d logprob = -A * ratio = -1 on each token, times its weight
        weight = -new_logprob.grad
        for row, length in enumerate(lengths.tolist()):
            assert weight[row, :length].tolist() == pytest.approx([expected[row]] * length, abs=1e-7), aggregation
            assert (weight[row, length:] == 0).all()
        torch.testing.assert_close(new_logprob.grad, one_pass.grad, rtol=0, atol=1e-7)

def test_value_loss_clipping_branches_and_gradients():
    # cliprange_value 0.2, vf_coef 0.5; v_clipped = old + clamp(new - old, -0.2, 0.2)
    #   old 1, new 1.5, R 2: v_clipped 1.2; max((1.5-2)^2, (1.2-2)^2) = max(0.25, 0.64) = 0.64 clipped
    #   old 1, new 1.5, R 1: v_clipped 1.2; max(0.25, 0.04) = 0.25 unclipped, d/dnew = 2 * 0.5 = 1
    #   old 1, new 0.5, R 0: v_clipped 0.8; max(0.25, 0.64) = 0.64 clipped
    #   a fourth, padded token must not count.
    # loss = 0.5 * 0.5 * (0.64 + 0.25 + 0.64) / 3 = 0.1275; clipfrac = 2/3
    new_value = torch.tensor([[1.5, 1.5, 0.5, 4.0]], requires_grad=True)
    old_value = torch.tensor([[1.0, 1.0, 1.0, -4.0]])
    return_ = torch.tensor([[2.0, 1.0, 0.0, 10.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, clipfrac = rl.value_loss(new_value, old_value, return_, mask, 0.2, vf_coef=0.5)
    assert loss.item() == pytest.approx(0.1275)
    assert clipfrac.item() == pytest.approx(2 / 3)
    loss.backward()
    # only the unclipped token has a gradient: 0.5 * 0.5 * (1/3) * 2 * (1.5 - 1) = 1/12
    torch.testing.assert_close(new_value.grad, torch.tensor([[0.0, 1 / 12, 0.0, 0.0]]))


# ---------------------------------------------------------------- padding never leaks


@pytest.mark.parametrize("fill", GARBAGE)
def test_padding_garbage_changes_no_output_or_gradient(fill):
    generator = torch.Generator().manual_seed(7)
    batch, response_len = 4, 6
    mask = random_prefix_mask(batch, response_len, generator)
    tensors = {
        name: torch.randn(batch, response_len, generator=generator)
        for name in ["new_logprob", "old_logprob", "ref_logprob", "advantage", "value", "new_value", "return_", "kl"]
    }
    score = torch.randn(batch, generator=generator)

    def run_all(tensors):
        leaf = {name: t.clone().requires_grad_(True) for name, t in tensors.items()}
        t = leaf
        outputs = {
            "mean": rl.masked_mean(t["value"], mask),
            "row_mean": rl.masked_mean(t["value"], mask, axis=1),
            "var": rl.masked_var(t["value"], mask),
            "whiten": rl.masked_whiten(t["advantage"], mask),
            "reward": rl.per_token_rewards(score, t["kl"], mask, 0.05)[0],
            "gae": torch.stack(rl.compute_gae(t["kl"], t["value"], mask, 0.99, 0.95)),
            "policy": torch.stack(rl.policy_loss(t["new_logprob"], t["old_logprob"], t["advantage"], mask, 0.2)),
            "value_loss": torch.stack(rl.value_loss(t["new_value"], t["value"], t["return_"], mask, 0.2)),
            "kl_loss": rl.kl_penalty_loss(t["new_logprob"], t["ref_logprob"], mask),
        }
        total = sum(out.sum() for out in outputs.values())
        total.backward()
        gradients = {name: tensor.grad for name, tensor in leaf.items() if tensor.grad is not None}
        return {name: out.detach() for name, out in outputs.items()}, gradients

    clean_outputs, clean_gradients = run_all(tensors)
    dirty_outputs, dirty_gradients = run_all({name: fill_padding(t, mask, fill) for name, t in tensors.items()})
    for name in clean_outputs:
        torch.testing.assert_close(dirty_outputs[name], clean_outputs[name], msg=f"{name} changed")
    for name in clean_gradients:
        torch.testing.assert_close(dirty_gradients[name], clean_gradients[name], msg=f"grad of {name} changed")


# ---------------------------------------------------------------- logits


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_logprobs_from_logits_matches_log_softmax(temperature):
    generator = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(3, 5, 17, generator=generator)).requires_grad_(True)
    labels = torch.randint(0, 17, (3, 5), generator=generator)
    logprob = rl.logprobs_from_logits(logits, labels, temperature)
    expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logprob, expected)
    (grad,) = torch.autograd.grad(logprob.sum(), logits)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    torch.testing.assert_close(grad, expected_grad)


def test_logprobs_from_logits_bfloat16_is_computed_in_float32():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 4, 50, generator=generator).to(torch.bfloat16)
    labels = torch.randint(0, 50, (2, 4), generator=generator)
    logprob = rl.logprobs_from_logits(logits, labels, 0.7)
    expected = torch.log_softmax(logits.float() / 0.7, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert logprob.dtype == torch.float32
    torch.testing.assert_close(logprob, expected)


def test_entropy_from_logits():
    # uniform over 4 -> log 4; a near one-hot distribution -> ~0
    assert rl.entropy_from_logits(torch.zeros(4)).item() == pytest.approx(math.log(4))
    assert rl.entropy_from_logits(torch.tensor([100.0, 0.0, 0.0])).item() == pytest.approx(0.0, abs=1e-6)
    generator = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(2, 3, 11, generator=generator)
    log_probs = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(rl.entropy_from_logits(logits), -(log_probs.exp() * log_probs).sum(-1))
    # large logits must not overflow
    assert torch.isfinite(rl.entropy_from_logits(1e4 * torch.randn(2, 11, generator=generator))).all()


# ---- engine vs learner logprobs ---------------------------------------------------------------------------------


def test_logprob_agreement_compares_real_tokens_the_engine_scored():
    nan = float("nan")
    learner = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 9.0]])
    # Row 0: the stop token added back after generation has no engine logprob. Row 1: the last column is padding.
    engine = torch.tensor([[-1.5, -2.0, nan], [-0.1, -2.0, nan]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    result = rl.logprob_agreement(learner, engine, mask)
    # Compared tokens: differences 0.5, 0.0, 0.0, -1.0 (learner - engine).
    assert result["diff_mean"].item() == pytest.approx(1.5 / 4)
    assert result["diff_max"].item() == pytest.approx(1.0)
    ratios = torch.exp(torch.tensor([0.5, 0.0, 0.0, -1.0]))
    assert result["ratio_mean"].item() == pytest.approx(ratios.mean().item())
    assert result["ratio_min"].item() == pytest.approx(ratios.min().item())
    assert result["ratio_max"].item() == pytest.approx(ratios.max().item())


def test_logprob_agreement_with_nothing_to_compare_is_neutral():
    result = rl.logprob_agreement(torch.zeros(2, 2), torch.full((2, 2), float("nan")), torch.ones(2, 2, dtype=torch.bool))
    assert {key: value.item() for key, value in result.items()} == {
        "diff_mean": 0.0, "diff_max": 0.0, "ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0,
    }  # fmt: skip


# ---- logprobs from hidden states, projected in chunks ----------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 5, 7, 12, 1000])
def test_projected_logprobs_in_chunks_equal_the_whole_logits_with_their_gradients(chunk_size):
    """Chunks of positions (with recompute in backward) give the numbers of the whole logits, in fp32 to 1e-6: the
    logprobs, the entropies, and the gradients they send to the hidden states and the head's weight."""
    torch.manual_seed(0)
    batch, seq, hidden_size, vocab, temperature = 3, 4, 8, 50, 0.7
    head = torch.nn.Linear(hidden_size, vocab, bias=True)
    hidden = torch.randn(batch, seq, hidden_size, requires_grad=True)
    labels = torch.randint(vocab, (batch, seq))
    advantage = torch.randn(batch, seq)

    whole, whole_entropy = rl.logprobs_and_entropy(head(hidden), labels, temperature, with_entropy=True)
    (whole * advantage).sum().backward()
    expected_grads = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = head.weight.grad = head.bias.grad = None

    chunked, chunked_entropy = rl.projected_logprobs(hidden, labels, head, temperature, chunk_size, with_entropy=True)
    (chunked * advantage).sum().backward()
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(chunked_entropy, whole_entropy, atol=1e-6, rtol=0)
    assert not chunked_entropy.requires_grad  # a metric: no gradient flows through it
    for got, expected in zip([hidden.grad, head.weight.grad, head.bias.grad], expected_grads):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    # The reference itself: log_softmax of logits / temperature at each label.
    reference = torch.log_softmax(head(hidden).detach() / temperature, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(whole.detach(), reference, atol=1e-6, rtol=0)


def test_projected_logprobs_never_hold_more_than_a_chunk_of_vocabulary_logits():
    torch.manual_seed(0)
    batch, seq, hidden_size, vocab = 4, 16, 8, 301
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(batch, seq, hidden_size, requires_grad=True)
    labels = torch.randint(vocab, (batch, seq))
    with LargestVocabTensor(vocab) as watch:
        logprob, _ = rl.projected_logprobs(hidden, labels, head, 1.0, chunk_size=8, with_entropy=True)
        logprob.sum().backward()
    assert 0 < watch.most_positions <= 8
    with LargestVocabTensor(vocab) as watch:  # the watch sees the whole logits when they exist
        rl.logprobs_and_entropy(head(hidden), labels, 1.0, with_entropy=True)[0].sum().backward()
    assert watch.most_positions == batch * seq
