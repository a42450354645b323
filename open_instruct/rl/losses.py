"""The losses of a PPO epoch: the clipped policy loss (with optional truncated importance weights), the clipped
value loss, and the KL as a loss term (GRPO's k3 term).

Sources: "Proximal Policy Optimization Algorithms" (Schulman et al., 2017), "The N Implementation Details of RLHF
with PPO" (value clipping), "DAPO" (Yu et al., 2025: token-level aggregation) and "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training" (Yao et al., 2025: truncated importance sampling).
"""

import torch

from open_instruct.rl.advantages import compute_kl
from open_instruct.rl.masked import WholeBatch, masked_aggregate, zero_padding


def policy_loss(
    new_logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantage: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
    token_weight: torch.Tensor | None = None,
    aggregation: str = "token",
    whole: WholeBatch | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate loss over real tokens. All inputs [batch, response_len].

    `token_weight` (optional, no gradient) multiplies each token's clipped surrogate, e.g. the truncated
    importance weight of `truncated_importance_weight`; the clipping itself is unchanged (a positive weight
    scales both branches, so the same branch wins). `aggregation` reduces the per-token losses to the loss
    (`masked_aggregate`: token or sequence mean); the diagnostics are always means over tokens. With `whole`, every
    output is this batch's part of the whole minibatch's mean (packed micro-batches, see `WholeBatch`).
    Returns (loss, clipfrac, approxkl, ratio_mean): scalars; only `loss` carries a gradient.
    clipfrac is the fraction of tokens where the clipped term wins (its gradient is then zero);
    approxkl = 0.5 * mean(log_ratio**2), the k2 estimate of KL(old || new).
    """
    log_ratio = zero_padding(new_logprob - old_logprob, response_mask)
    advantage = zero_padding(advantage, response_mask)
    ratio = torch.exp(log_ratio)
    unclipped_loss = -advantage * ratio
    clipped_loss = -advantage * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    token_loss = torch.max(unclipped_loss, clipped_loss)
    if token_weight is not None:
        token_loss = token_loss * zero_padding(token_weight.detach(), response_mask)
    loss = masked_aggregate(token_loss, response_mask, aggregation, whole)
    with torch.no_grad():
        clipfrac = masked_aggregate((clipped_loss > unclipped_loss).float(), response_mask, "token", whole)
        approxkl = 0.5 * masked_aggregate(log_ratio.pow(2), response_mask, "token", whole)
        ratio_mean = masked_aggregate(ratio, response_mask, "token", whole)
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
    log_ratio = zero_padding(old_logprob - engine_logprob, valid)  # 0 where not valid: weight 1
    return torch.clamp(torch.exp(log_ratio), max=cap)


def value_loss(
    new_value: torch.Tensor,
    old_value: torch.Tensor,
    return_: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    vf_coef: float = 1.0,
    whole: WholeBatch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (N implementation details, "value function loss clipping"). Inputs [batch, response_len].

    The new value may move at most cliprange_value from the rollout's value; the loss is the larger of the
    clipped and unclipped squared errors (a mean over tokens; with `whole`, this batch's part of the minibatch's).
    Returns (loss, clipfrac); clipfrac carries no gradient.
    """
    new_value = zero_padding(new_value, response_mask)
    old_value = zero_padding(old_value, response_mask)
    return_ = zero_padding(return_, response_mask)
    clipped_value = old_value + torch.clamp(new_value - old_value, -cliprange_value, cliprange_value)
    unclipped_loss = (new_value - return_).pow(2)
    clipped_loss = (clipped_value - return_).pow(2)
    loss = vf_coef * 0.5 * masked_aggregate(torch.max(unclipped_loss, clipped_loss), response_mask, "token", whole)
    with torch.no_grad():
        clipfrac = masked_aggregate((clipped_loss > unclipped_loss).float(), response_mask, "token", whole)
    return loss, clipfrac


def kl_penalty_loss(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str = "k3",
    aggregation: str = "token",
    whole: WholeBatch | None = None,
) -> torch.Tensor:
    """Mean per-token KL estimate over real tokens (token or sequence mean, see `masked_aggregate`), for putting
    the KL in the loss (GRPO style) instead of the reward. Inputs [batch, response_len]; returns a scalar the
    trainer multiplies by beta."""
    kl = compute_kl(zero_padding(logprob, response_mask), zero_padding(ref_logprob, response_mask), estimator)
    return masked_aggregate(kl, response_mask, aggregation, whole)
