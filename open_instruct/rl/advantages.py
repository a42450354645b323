"""From scores to advantages: KL estimators, per-token rewards, GAE (PPO) and group advantages (GRPO).

Sources: Schulman's note "Approximating KL Divergence" (2020), "High-Dimensional Continuous Control Using
Generalized Advantage Estimation" (Schulman et al., 2016), "DeepSeekMath" (Shao et al., 2024: GRPO) and
"Understanding R1-Zero-Like Training" (Liu et al., 2025: Dr. GRPO, no std normalisation).
"""

import torch

from open_instruct.rl.masked import zero_padding

KL_ESTIMATORS = ("k1", "k2", "k3")


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
    score: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, beta: float,
    turn_reward: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense per-token reward: a KL penalty on every real token plus the sequence score on the last one, and an
    environment's per-turn rewards on the tokens that earned them (`turn_reward`, from `turn_rewards_at_tokens`).

    score: [batch]; kl, response_mask, turn_reward: [batch, response_len]. Returns (reward, non_score_reward), both
    [batch, response_len] and 0 on padding. `score` is the final score alone: a turn's reward placed here must not
    also be in it.

    The score goes on the LAST REAL token (the mask's last True): that is the last action the policy
    took, the one that completed the text the score judges (a tool's output after it is not the policy's). open-instruct places it one position later when
    there is room, but that position is padding: its value and logprob carry no meaning and it is masked out
    of GAE and the losses, so a score placed there would be lost or would depend on garbage.
    """
    mask = response_mask.bool()
    if bool((~mask.any(dim=1)).any()):
        empty_rows = torch.nonzero(~mask.any(dim=1)).flatten().tolist()
        raise ValueError(
            f"per_token_rewards got response rows {empty_rows} with no valid token; every response needs at "
            f"least one token to carry its score (build the mask with truncate_response/response_mask_from_lengths)."
        )
    non_score_reward = zero_padding(-beta * kl, response_mask)
    # The last True of each row (a mask with holes, tool outputs, included): argmax finds the first of the flipped row.
    last_index = (mask.size(1) - 1 - mask.flip(1).int().argmax(dim=1)).unsqueeze(1)  # [batch, 1]
    reward = non_score_reward
    if turn_reward is not None:
        reward = reward + zero_padding(turn_reward.to(reward.dtype), response_mask)
    reward = reward.scatter_add(1, last_index, score.to(non_score_reward.dtype).unsqueeze(1))
    return reward, non_score_reward


def turn_rewards_at_tokens(turn_rewards: list[list | None], response_mask: torch.Tensor) -> torch.Tensor:
    """An environment's per-turn rewards as a per-token tensor, [batch, response_len] like `response_mask`.

    turn_rewards: per response, None or [token_index, reward] pairs (vllm_engine.Completion.turn_rewards): the index of
    the last token the policy sampled in the turn that earned the reward, the token before the observation. Each
    reward goes on that token, so GAE credits the actions before it, not those of later turns (verl places a
    multi-turn reward the same way). An index past the response's last real token (its text cut at an earlier stop
    token) goes on the last real one: the reward is never lost.
    """
    mask = response_mask.bool()
    placed = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    last_real = (mask.size(1) - 1 - mask.flip(1).int().argmax(dim=1)).tolist()  # [batch]
    for row, turns in enumerate(turn_rewards):
        for token_index, reward in turns or ():
            placed[row, min(int(token_index), last_real[row])] += float(reward)
    return placed


def compute_gae(
    reward: torch.Tensor, value: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016) over each response, run backwards in time.

    reward, value, response_mask: [batch, response_len]. The value after the last real token is 0 (the
    episode ends there), so delta_t = r_t + gamma * V_{t+1} - V_t with V = 0 beyond the response, and
    A_t = delta_t + gamma * lam * A_{t+1}. Returns (advantage, return_), both [batch, response_len],
    with return_ = advantage + value on real tokens and 0 on padding.

    Positions the mask leaves out inside a response (a tool's output, which the policy did not choose) are skipped:
    the next value and advantage are carried back across them unchanged, so the GAE is the one over the policy's
    own tokens laid end to end (as verl does for multi-turn rollouts), and their rewards and values are never read.
    """
    mask = response_mask.bool()
    reward = zero_padding(reward, mask)
    value = zero_padding(value, mask)  # a zero value on padding is the bootstrap 0 at the end of each response
    response_len = reward.size(1)
    next_advantage = torch.zeros_like(reward[:, 0])  # [batch]: of the next policy token
    next_value = torch.zeros_like(value[:, 0])  # [batch]: of the next policy token; 0 after the last
    advantage_reversed = []
    for t in reversed(range(response_len)):
        delta = reward[:, t] + gamma * next_value - value[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_advantage = torch.where(mask[:, t], advantage, next_advantage)
        next_value = torch.where(mask[:, t], value[:, t], next_value)
        advantage_reversed.append(zero_padding(advantage, mask[:, t]))
    advantage = torch.stack(advantage_reversed[::-1], dim=1)  # [batch, response_len]
    return_ = advantage + value  # both are already 0 on padding
    return advantage, return_


def group_advantages(
    score: torch.Tensor, group: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6,
    run_share: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """GRPO's advantage of each response: its score against the other responses to the same prompt.

    score: [batch] sequence scores; group: [batch] integer ids, equal for responses to the same prompt (they
    need not be adjacent). A_i = (score_i - mean of its group) / (std of its group + eps) (DeepSeekMath,
    section 4.1.2, outcome supervision; the std is the unbiased one, as in TRL and verl). With
    std_normalize=False only the mean is subtracted (Dr. GRPO: dividing by the std weighs up prompts whose
    answers are nearly all right or all wrong). A group whose scores are all equal gets advantage exactly 0
    (found by comparing its scores, not from a std that rounding may leave at 1e-9): it carries no signal.
    run_share: [batch], each response's share of one run of its prompt (None: 1 each). An agent rollout that split into
    k samples (one reward) gives each 1/k, so the group's mean and std are over its runs, not its samples: a run
    weighs the same however many samples it left.
    Returns (advantage [batch], group_std [num_groups], 0 for an all-equal group, in the order of the sorted ids).
    """
    ids, inverse = torch.unique(group, return_inverse=True)
    share = torch.ones_like(score, dtype=torch.float32) if run_share is None else run_share.float()
    # Runs per group (a whole number: each run's shares sum to 1).
    counts = torch.zeros(len(ids), dtype=torch.float32, device=score.device).index_add(0, inverse, share).round()
    if bool((counts < 2).any()):
        lone = ids[counts < 2].tolist()
        raise ValueError(
            f"group_advantages got group(s) {lone} with a single response; GRPO compares each response with the "
            "others to its prompt, so every group needs at least 2 (--number_samples_per_prompt >= 2)."
        )
    score = score.float()
    zeros = torch.zeros(len(ids), dtype=score.dtype, device=score.device)
    mean = zeros.index_add(0, inverse, score * share) / counts
    centered = score - mean[inverse]  # [batch]
    std = (zeros.index_add(0, inverse, centered.pow(2) * share) / (counts - 1)).sqrt()  # [num_groups]
    highest = zeros.scatter_reduce(0, inverse, score, "amax", include_self=False)
    lowest = zeros.scatter_reduce(0, inverse, score, "amin", include_self=False)
    all_equal = highest == lowest  # [num_groups]
    std = torch.where(all_equal, 0.0, std)
    advantage = centered / (std[inverse] + eps) if std_normalize else centered
    return torch.where(all_equal[inverse], 0.0, advantage), std
