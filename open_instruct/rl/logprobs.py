"""Log-probabilities and entropy from logits, and the agreement between the engine's and the learner's logprobs.
"""

import torch

from open_instruct.rl.masked import masked_mean, zero_padding


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
    log_ratio = zero_padding(learner_logprob - engine_logprob, valid)  # 0 where not valid: ratio 1
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
