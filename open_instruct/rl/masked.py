"""Masked statistics over response tokens, and the masks themselves (stop-token truncation).

Conventions of every function in `rl` (shapes in comments use these names):
- `batch`: number of responses; `response_len`: padded response length; `vocab`: vocabulary size.
- A response mask is True on real tokens and is always a prefix of the row (tokens 0 .. response_length-1).
  Masks come from lengths, never from comparing with the pad id, because the pad id may equal a stop id.
- Padded positions may hold anything (even NaN or inf): every function selects valid positions with
  `torch.where` (`zero_padding`) before doing arithmetic, so padding never reaches an output or a gradient.

Source: "The N Implementation Details of RLHF with PPO" (Huang et al., 2023): truncation at the stop token,
reward whitening without shifting the mean.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

LOSS_AGGREGATIONS = ("token", "sequence")


def zero_padding(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Zero out padded positions; `torch.where` (not multiplication) so NaN/inf padding cannot leak."""
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` over positions where `mask` is true (bool or 0/1).

    axis=None gives a scalar over all valid elements; axis=int gives the mean along that axis.
    A row (or whole mask) with no valid element has mean 0, not NaN, so an empty row adds nothing to a loss.
    """
    mask = mask.bool()
    total = zero_padding(values, mask).sum() if axis is None else zero_padding(values, mask).sum(axis)
    count = mask.sum() if axis is None else mask.sum(axis)
    return total / count.clamp(min=1).to(values.dtype)


@dataclass(frozen=True)
class WholeBatch:
    """The real tokens and the responses of a whole minibatch (every micro-batch of every rank). Given to
    `masked_aggregate`, a micro-batch's result is its part of the minibatch's mean, so that the parts add up to the
    mean over the minibatch however its rows were grouped. Each micro-batch's own mean, averaged, would weigh a token
    by 1/(tokens in its micro-batch): a micro-batch of short responses as much as one of long responses."""

    tokens: int
    sequences: int


def masked_aggregate(
    values: torch.Tensor, mask: torch.Tensor, aggregation: str, whole: WholeBatch | None = None
) -> torch.Tensor:
    """A per-token loss [batch, response_len] reduced to a scalar over the real tokens (with `whole`: this batch's
    part of that mean over the whole minibatch, see `WholeBatch`).

    token: the mean over every real token of the batch, so each token weighs the same and a long response
    weighs more than a short one (DAPO; PPO here always did this). sequence: the mean of each response's own
    token mean, so each response weighs the same and a token of a long response weighs less (GRPO's
    1/G sum_i 1/|o_i| sum_t; Dr. GRPO points out that this favours long wrong answers over short ones).
    """
    if aggregation == "token":
        if whole is not None:
            return zero_padding(values, mask).sum() / whole.tokens
        return masked_mean(values, mask)
    if aggregation == "sequence":
        if whole is not None:
            return masked_mean(values, mask, axis=1).sum() / whole.sequences
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
    centered = zero_padding(values - masked_mean(values, mask), mask)
    return centered.pow(2).sum() / (count - 1 if unbiased else count)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise valid positions to zero mean and unit variance; padded positions come back as 0.

    shift_mean=False only rescales (the mean is added back), as used for reward whitening, where
    shifting the mean would change the sign of the reward signal (N implementation details, "reward whitening").
    """
    # Select first: a NaN on padding times a zero upstream gradient would still be NaN in backward.
    values = zero_padding(values, mask)
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return zero_padding(whitened, mask)


def first_true_indices(bools: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Index of the first True in each row of `bools` [batch, n]; n when a row has none. Returns [batch]."""
    row_len = bools.size(-1)
    position = torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.where(bools.bool(), position, torch.full_like(position, row_len)).min(dim=-1).values


def response_mask_from_lengths(response_length: torch.Tensor, response_len: int) -> torch.Tensor:
    """Bool mask [batch, response_len], True on the first response_length[i] positions of row i."""
    position = torch.arange(response_len, device=response_length.device)
    return position.unsqueeze(0) < response_length.unsqueeze(1)


def turn_ends(sampled: torch.Tensor) -> torch.Tensor:
    """[batch, response_len] bool: the tokens that end a turn inside a response, not the response: a token the policy
    sampled followed by one it did not (a tool's output, an agent's next turn). A native tool call's turn ends on the
    stop token the model sampled, and the response goes on after the tool's turn: truncation at the stop token must not
    cut there. `sampled` [batch, response_len], True where the policy sampled the token (and on padding)."""
    following_sampled = torch.ones_like(sampled)
    following_sampled[:, :-1] = sampled[:, 1:]
    return sampled & ~following_sampled


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
