"""Log-probabilities and entropy from logits, and the agreement between the engine's and the learner's logprobs.

`projected_logprobs` computes both from hidden states in chunks of positions, so that no [batch, response_len, vocab]
float32 tensor ever exists: with a 128k vocabulary and 2k-token responses one micro-batch row of fp32 logits is 1 GiB.
"""

from collections.abc import Callable

import torch
import torch.utils.checkpoint

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


def logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`logprobs_from_logits` and, with `with_entropy`, the entropy of each position (no gradient: a metric), from
    logits already computed for every position: [batch, seq, vocab] -> float32 [batch, seq] each."""
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.float() / temperature)
    return logprobs_from_logits(logits, labels, temperature), entropy


def projected_logprobs(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    project: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    chunk_size: int,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logprob of each label, and the entropy of each position's distribution, from hidden states, projected to
    the vocabulary `chunk_size` positions at a time.

    hidden [batch, seq, hidden_size], labels [batch, seq]; `project` maps [n, hidden_size] to logits [n, vocab] (the
    LM head). Returns float32 [batch, seq] logprobs (with gradients) and, with `with_entropy`, float32 [batch, seq]
    entropies (no gradient: a metric), both of softmax(logits / temperature) as vLLM samples from it.

    The positions are flattened and projected a chunk at a time; each chunk's logits exist only while its logprobs are
    computed, and the backward pass projects the chunk again (activation checkpointing), so the largest tensor is
    [chunk_size, vocab] instead of [batch, seq, vocab]. When all positions fit in one chunk nothing is recomputed. The numbers are `logprobs_and_entropy`'s on the whole logits
    (the same operations on the same positions; tests/test_rl_math.py checks 1e-6 in fp32).
    """
    if chunk_size < 1:
        raise ValueError(f"projected_logprobs needs chunk_size >= 1, got {chunk_size}; use logprobs_and_entropy for 0.")
    batch, seq = labels.shape
    flat_hidden, flat_labels = hidden.reshape(batch * seq, -1), labels.reshape(-1)

    def chunk_logprobs(chunk_hidden: torch.Tensor, chunk_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scaled = project(chunk_hidden).float() / temperature  # [chunk, vocab]: the largest tensor there is
        logprob = scaled.gather(-1, chunk_labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
        with torch.no_grad():  # from the same logits: a metric, no second projection and no gradient
            entropy = entropy_from_logits(scaled) if with_entropy else torch.empty(0)
        return logprob, entropy

    logprob_chunks, entropy_chunks = [], []
    # One chunk holds no more than the bound: keep its logits for backward instead of projecting it again.
    recompute = torch.is_grad_enabled() and flat_hidden.requires_grad and batch * seq > chunk_size
    for start in range(0, batch * seq, chunk_size):
        chunk = (flat_hidden[start : start + chunk_size], flat_labels[start : start + chunk_size])
        if recompute:  # the backward pass projects the chunk again
            logprob, entropy = torch.utils.checkpoint.checkpoint(chunk_logprobs, *chunk, use_reentrant=False)
        else:
            logprob, entropy = chunk_logprobs(*chunk)
        logprob_chunks.append(logprob)
        entropy_chunks.append(entropy)
    logprob = torch.cat(logprob_chunks).reshape(batch, seq)
    entropy = torch.cat(entropy_chunks).reshape(batch, seq) if with_entropy else None
    return logprob, entropy


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
