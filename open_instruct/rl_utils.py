"""PPO and GRPO math: masked statistics, stop-token truncation, KL estimators, per-token rewards, GAE, group
advantages and losses.

Everything here is pure torch: tensors in, tensors out, no models, no I/O, no globals.

Conventions (shapes in comments use these names):
- `batch`: number of responses; `response_len`: padded response length; `vocab`: vocabulary size.
- A response mask is True on real tokens and is always a prefix of the row (tokens 0 .. response_length-1).
  Masks come from lengths, never from comparing with the pad id, because the pad id may equal a stop id.
- Padded positions may hold anything (even NaN or inf): every function selects valid positions with
  `torch.where` before doing arithmetic, so padding never reaches an output or a gradient.

Sources: "The N Implementation Details of RLHF with PPO" (Huang et al., 2023), Schulman's note
"Approximating KL Divergence" (2020), "High-Dimensional Continuous Control Using Generalized Advantage
Estimation" (Schulman et al., 2016), "DeepSeekMath" (Shao et al., 2024: GRPO), "Understanding R1-Zero-Like
Training: A Critical Perspective" (Liu et al., 2025: Dr. GRPO) and "DAPO" (Yu et al., 2025: token-level loss).
"""

from collections.abc import Sequence

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGREGATIONS = ("token", "sequence")


def _select(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Zero out padded positions; `torch.where` (not multiplication) so NaN/inf padding cannot leak."""
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` over positions where `mask` is true (bool or 0/1).

    axis=None gives a scalar over all valid elements; axis=int gives the mean along that axis.
    A row (or whole mask) with no valid element has mean 0, not NaN, so an empty row adds nothing to a loss.
    """
    mask = mask.bool()
    total = _select(values, mask).sum() if axis is None else _select(values, mask).sum(axis)
    count = mask.sum() if axis is None else mask.sum(axis)
    return total / count.clamp(min=1).to(values.dtype)


def masked_aggregate(values: torch.Tensor, mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """A per-token loss [batch, response_len] reduced to a scalar over the real tokens.

    token: the mean over every real token of the batch, so each token weighs the same and a long response
    weighs more than a short one (DAPO; PPO here always did this). sequence: the mean of each response's own
    token mean, so each response weighs the same and a token of a long response weighs less (GRPO's
    1/G sum_i 1/|o_i| sum_t; Dr. GRPO points out that this favours long wrong answers over short ones).
    """
    if aggregation == "token":
        return masked_mean(values, mask)
    if aggregation == "sequence":
        return masked_mean(values, mask, axis=1).mean()
    raise ValueError(f"Unknown loss aggregation {aggregation!r}; expected one of {', '.join(LOSS_AGGREGATIONS)}.")


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance (scalar) of `values` over valid positions; Bessel-corrected by the number of valid elements."""
    mask = mask.bool()
    count = int(mask.sum().item())
    needed = 2 if unbiased else 1
    if count < needed:
        raise ValueError(
            f"masked_var got a mask with {count} valid element(s) but needs at least {needed}"
            f"{' for the unbiased estimate' if unbiased else ''}; pass a mask that selects more elements"
            f"{' or unbiased=False' if unbiased and count == 1 else ''}."
        )
    centered = _select(values - masked_mean(values, mask), mask)
    return centered.pow(2).sum() / (count - 1 if unbiased else count)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise valid positions to zero mean and unit variance; padded positions come back as 0.

    shift_mean=False only rescales (the mean is added back), as used for reward whitening, where
    shifting the mean would change the sign of the reward signal (N implementation details, "reward whitening").
    """
    # Select first: a NaN on padding times a zero upstream gradient would still be NaN in backward.
    values = _select(values, mask)
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return _select(whitened, mask)


def first_true_indices(bools: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Index of the first True in each row of `bools` [batch, n]; n when a row has none. Returns [batch]."""
    row_len = bools.size(-1)
    position = torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.where(bools.bool(), position, torch.full_like(position, row_len)).min(dim=-1).values


def response_mask_from_lengths(response_length: torch.Tensor, response_len: int) -> torch.Tensor:
    """Bool mask [batch, response_len], True on the first response_length[i] positions of row i."""
    position = torch.arange(response_len, device=response_length.device)
    return position.unsqueeze(0) < response_length.unsqueeze(1)


def truncate_response(
    response: torch.Tensor, stop_token_ids: Sequence[int], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut each response after its first stop token (N implementation details, "truncate at stop token").

    response: [batch, response_len] token ids. The stop token itself is kept (the policy chose it, so it is an
    action with a logprob). Returns (truncated_response [batch, response_len] with pad_token_id after the stop
    token, response_length [batch] counting real tokens including the stop token; response_len when a row
    has no stop token).
    """
    response_len = response.size(1)
    stop_ids = torch.as_tensor(list(stop_token_ids), dtype=response.dtype, device=response.device)
    is_stop = torch.isin(response, stop_ids)  # [batch, response_len]
    response_length = (first_true_indices(is_stop) + 1).clamp(max=response_len)  # [batch]
    mask = response_mask_from_lengths(response_length, response_len)
    truncated_response = torch.where(mask, response, torch.full_like(response, pad_token_id))
    return truncated_response, response_length


def compute_kl(logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman, 2020).

    With log_ratio = logprob - ref_logprob:
    k1 = log_ratio (unbiased, high variance, can be negative);
    k2 = log_ratio**2 / 2 (biased, low variance, >= 0);
    k3 = exp(-log_ratio) - 1 + log_ratio (unbiased, low variance, >= 0).
    """
    log_ratio = logprob - ref_logprob
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.pow(2)
    if estimator == "k3":
        # expm1 keeps precision when the policy is close to the reference (log_ratio near 0).
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"Unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}.")


def per_token_rewards(
    score: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense per-token reward: a KL penalty on every real token plus the sequence score on the last one.

    score: [batch]; kl, response_mask: [batch, response_len]. Returns (reward, non_score_reward), both
    [batch, response_len] and 0 on padding.

    The score goes on the LAST REAL token (index response_length - 1): that is the last action the policy
    took, the one that completed the text the score judges. open-instruct places it one position later when
    there is room, but that position is padding: its value and logprob carry no meaning and it is masked out
    of GAE and the losses, so a score placed there would be lost or would depend on garbage.
    """
    response_length = response_mask.bool().sum(dim=1)  # [batch]
    if bool((response_length == 0).any()):
        empty_rows = torch.nonzero(response_length == 0).flatten().tolist()
        raise ValueError(
            f"per_token_rewards got response rows {empty_rows} with no valid token; every response needs at "
            f"least one token to carry its score (build the mask with truncate_response/response_mask_from_lengths)."
        )
    non_score_reward = _select(-beta * kl, response_mask)
    last_index = (response_length - 1).unsqueeze(1)  # [batch, 1]
    reward = non_score_reward.scatter_add(1, last_index, score.to(non_score_reward.dtype).unsqueeze(1))
    return reward, non_score_reward


def compute_gae(
    reward: torch.Tensor, value: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016) over each response, run backwards in time.

    reward, value, response_mask: [batch, response_len]. The value after the last real token is 0 (the
    episode ends there), so delta_t = r_t + gamma * V_{t+1} - V_t with V = 0 beyond the response, and
    A_t = delta_t + gamma * lam * A_{t+1}. Returns (advantage, return_), both [batch, response_len],
    with return_ = advantage + value on real tokens and 0 on padding.
    """
    mask = response_mask.bool()
    reward = _select(reward, mask)
    value = _select(value, mask)  # a zero value on padding is the bootstrap 0 at the end of each response
    response_len = reward.size(1)
    next_advantage = torch.zeros_like(reward[:, 0])  # [batch]
    advantage_reversed = []
    for t in reversed(range(response_len)):
        next_value = value[:, t + 1] if t + 1 < response_len else torch.zeros_like(value[:, t])
        delta = reward[:, t] + gamma * next_value - value[:, t]
        next_advantage = _select(delta + gamma * lam * next_advantage, mask[:, t])
        advantage_reversed.append(next_advantage)
    advantage = torch.stack(advantage_reversed[::-1], dim=1)  # [batch, response_len]
    return_ = advantage + value  # both are already 0 on padding
    return advantage, return_


def group_advantages(
    score: torch.Tensor, group: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's advantage of each response: its score against the other responses to the same prompt.

    score: [batch] sequence scores; group: [batch] integer ids, equal for responses to the same prompt (they
    need not be adjacent). A_i = (score_i - mean of its group) / (std of its group + eps) (DeepSeekMath,
    section 4.1.2, outcome supervision; the std is the unbiased one, as in TRL and verl). With
    std_normalize=False only the mean is subtracted (Dr. GRPO: dividing by the std weighs up prompts whose
    answers are nearly all right or all wrong). A group whose scores are all equal gets advantage exactly 0
    (found by comparing its scores, not from a std that rounding may leave at 1e-9): it carries no signal.
    Returns (advantage [batch], group_std [num_groups], 0 for an all-equal group, in the order of the sorted ids).
    """
    ids, inverse, counts = torch.unique(group, return_inverse=True, return_counts=True)
    if bool((counts < 2).any()):
        lone = ids[counts < 2].tolist()
        raise ValueError(
            f"group_advantages got group(s) {lone} with a single response; GRPO compares each response with the "
            "others to its prompt, so every group needs at least 2 (--number_samples_per_prompt >= 2)."
        )
    score = score.float()
    zeros = torch.zeros(len(ids), dtype=score.dtype, device=score.device)
    mean = zeros.index_add(0, inverse, score) / counts
    centered = score - mean[inverse]  # [batch]
    std = (zeros.index_add(0, inverse, centered.pow(2)) / (counts - 1)).sqrt()  # [num_groups]
    highest = zeros.scatter_reduce(0, inverse, score, "amax", include_self=False)
    lowest = zeros.scatter_reduce(0, inverse, score, "amin", include_self=False)
    all_equal = highest == lowest  # [num_groups]
    std = torch.where(all_equal, 0.0, std)
    advantage = centered / (std[inverse] + eps) if std_normalize else centered
    return torch.where(all_equal[inverse], 0.0, advantage), std


def policy_loss(
    new_logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantage: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
    token_weight: torch.Tensor | None = None,
    aggregation: str = "token",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate loss over real tokens. All inputs [batch, response_len].

    `token_weight` (optional, no gradient) multiplies each token's clipped surrogate, e.g. the truncated
    importance weight of `truncated_importance_weight`; the clipping itself is unchanged (a positive weight
    scales both branches, so the same branch wins). `aggregation` reduces the per-token losses to the loss
    (`masked_aggregate`: token or sequence mean); the diagnostics are always means over tokens.
    Returns (loss, clipfrac, approxkl, ratio_mean): scalars; only `loss` carries a gradient.
    clipfrac is the fraction of tokens where the clipped term wins (its gradient is then zero);
    approxkl = 0.5 * mean(log_ratio**2), the k2 estimate of KL(old || new).
    """
    log_ratio = _select(new_logprob - old_logprob, response_mask)
    advantage = _select(advantage, response_mask)
    ratio = torch.exp(log_ratio)
    unclipped_loss = -advantage * ratio
    clipped_loss = -advantage * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    token_loss = torch.max(unclipped_loss, clipped_loss)
    if token_weight is not None:
        token_loss = token_loss * _select(token_weight.detach(), response_mask)
    loss = masked_aggregate(token_loss, response_mask, aggregation)
    with torch.no_grad():
        clipfrac = masked_mean((clipped_loss > unclipped_loss).float(), response_mask)
        approxkl = 0.5 * masked_mean(log_ratio.pow(2), response_mask)
        ratio_mean = masked_mean(ratio, response_mask)
    return loss, clipfrac, approxkl, ratio_mean


def truncated_importance_weight(
    old_logprob: torch.Tensor, engine_logprob: torch.Tensor, response_mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance sampling (TIS) weight of each sampled token: min(pi_old / pi_engine, cap).

    old_logprob: the learner's logprob of the token under the policy it trains from ("old"); engine_logprob: the
    logprob the generation engine sampled it with (NaN where the engine gave none). Both [batch, response_len].
    The engine's distribution differs from the learner's by its numerics (a bf16 engine) and, in async mode, by
    one policy version; weighting the policy gradient by pi_old / pi_engine corrects for sampling from the engine's
    distribution, and truncating the weight at `cap` bounds its variance (Yao et al., "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training", 2025; Ionides, "Truncated Importance Sampling", 2008).
    Returns [batch, response_len]; 1 on padding and where the engine gave no logprob (no correction known).
    """
    valid = response_mask.bool() & torch.isfinite(engine_logprob)
    log_ratio = _select(old_logprob - engine_logprob, valid)  # 0 where not valid: weight 1
    return torch.clamp(torch.exp(log_ratio), max=cap)


def value_loss(
    new_value: torch.Tensor,
    old_value: torch.Tensor,
    return_: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    vf_coef: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (N implementation details, "value function loss clipping"). Inputs [batch, response_len].

    The new value may move at most cliprange_value from the rollout's value; the loss is the larger of the
    clipped and unclipped squared errors. Returns (loss, clipfrac); clipfrac carries no gradient.
    """
    new_value = _select(new_value, response_mask)
    old_value = _select(old_value, response_mask)
    return_ = _select(return_, response_mask)
    clipped_value = old_value + torch.clamp(new_value - old_value, -cliprange_value, cliprange_value)
    unclipped_loss = (new_value - return_).pow(2)
    clipped_loss = (clipped_value - return_).pow(2)
    loss = vf_coef * 0.5 * masked_mean(torch.max(unclipped_loss, clipped_loss), response_mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped_loss > unclipped_loss).float(), response_mask)
    return loss, clipfrac


def kl_penalty_loss(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str = "k3",
    aggregation: str = "token",
) -> torch.Tensor:
    """Mean per-token KL estimate over real tokens (token or sequence mean, see `masked_aggregate`), for putting
    the KL in the loss (GRPO style) instead of the reward. Inputs [batch, response_len]; returns a scalar the
    trainer multiplies by beta."""
    kl = compute_kl(_select(logprob, response_mask), _select(ref_logprob, response_mask), estimator)
    return masked_aggregate(kl, response_mask, aggregation)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last axis: logsumexp(z) - sum(softmax(z) * z). [..., vocab] -> [...]."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each label under softmax(logits / temperature). logits [batch, seq, vocab],
    labels [batch, seq] -> float32 [batch, seq].

    vLLM samples from logits / temperature, so the logprobs PPO compares against must use the same
    temperature. log_softmax(z)[y] = z[y] - logsumexp(z); going row by row keeps only one [seq, vocab]
    float32 copy alive at a time instead of a [batch, seq, vocab] one.
    """
    logprob_rows = []
    for row_logits, row_labels in zip(logits, labels):
        scaled = row_logits.float() / temperature  # [seq, vocab]
        label_logit = scaled.gather(-1, row_labels.unsqueeze(-1)).squeeze(-1)  # [seq]
        logprob_rows.append(label_logit - torch.logsumexp(scaled, dim=-1))
    return torch.stack(logprob_rows)


def logprob_agreement(
    learner_logprob: torch.Tensor, engine_logprob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the engine's logprobs of the sampled tokens are from the learner's. Inputs [batch, response_len].

    Compared where the response mask is true and the engine gave a logprob (NaN marks one it did not give,
    e.g. a stop token added back after generation). In sync mode the learner's logprob is of the very weights
    the engine sampled with, so the difference is numerical only (fp32: ~1e-5); a failed or partial weight
    sync makes it grow. In async mode it also holds one policy update (the engine is one version behind).
    Returns scalars: the mean and max absolute difference, and the mean, min and max of the importance ratio
    exp(learner - engine), the weight an off-policy correction would give each token. With no comparable
    token every value is 0 (ratios 1).
    """
    valid = response_mask.bool() & torch.isfinite(engine_logprob)
    log_ratio = _select(learner_logprob - engine_logprob, valid)  # 0 where not valid: ratio 1
    ratio = torch.exp(log_ratio)
    difference = log_ratio.abs()
    if not valid.any():
        zero, one = torch.zeros(()), torch.ones(())
        return {"diff_mean": zero, "diff_max": zero, "ratio_mean": one, "ratio_min": one, "ratio_max": one}
    return {
        "diff_mean": masked_mean(difference, valid),
        "diff_max": difference[valid].max(),
        "ratio_mean": masked_mean(ratio, valid),
        "ratio_min": ratio[valid].min(),
        "ratio_max": ratio[valid].max(),
    }
