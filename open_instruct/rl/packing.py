"""Packed, token-budget micro-batches: which rows of a minibatch go together (the plan), and the packed layout of one
micro-batch (several sequences end to end in one row).

A padded micro-batch computes on rows x width token slots however short its sequences are: one long answer makes
every row of the step as long. Here (--max_tokens_per_micro_batch T) a minibatch's rows are grouped by length,
first-fit decreasing, so that each micro-batch holds at most T real tokens (a longer sequence alone), and each group's
sequences are laid end to end in one row of exactly its real tokens. Positions restart at 0 for each sequence;
transformers turns restarting position ids (with no 2D attention mask) into a block-diagonal causal mask for
eager/SDPA attention and into flash-attention's varlen `cu_seqlens` (`find_packed_sequence_indices`,
`prepare_fa_kwargs_from_position_ids`), so no token attends across sequences. Every output is scattered back to
the padded [rows, response_len] layout, so the losses and their aggregation are the padded ones.

DeepSpeed ranks: each rank runs the same number of micro-batches per minibatch (ZeRO-3 gathers parameters in every
forward, ZeRO-2 reduces gradients in every backward: collectives all ranks join), and the groups are dealt to ranks
by tokens, the heaviest first to the rank with the fewest tokens so far (balance by tokens, not rows).
"""

from dataclasses import dataclass

import torch


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` in groups whose lengths add up to at most `budget` (a sequence longer than the budget
    gets a group of its own): the longest first, each into the first group it fits. Groups by decreasing tokens."""
    groups: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for group, free in enumerate(room):
            if lengths[index] <= free:
                groups[group].append(index)
                room[group] -= lengths[index]
                break
        else:
            groups.append([index])
            room.append(budget - lengths[index])
    return groups


def split_heaviest(groups: list[list[int]], lengths: list[int]) -> bool:
    """Split the group of most tokens that has two rows or more in two of about equal tokens; False when none has."""
    splittable = [g for g in groups if len(g) > 1]
    if not splittable:
        return False
    heaviest = max(splittable, key=lambda g: sum(lengths[i] for i in g))
    groups.remove(heaviest)
    halves: list[list[int]] = [[], []]
    for index in sorted(heaviest, key=lambda i: -lengths[i]):  # each row to the lighter half
        min(halves, key=lambda h: sum(lengths[i] for i in h)).append(index)
    groups.extend(halves)
    return True


def plan_micro_batches(lengths: list[int], budget: int, world_size: int = 1) -> list[list[list[int]]]:
    """Each rank's micro-batches (lists of indices into `lengths`, the real tokens of each row of a minibatch).

    Every rank gets the same number of micro-batches: the first-fit-decreasing groups are split (the heaviest first)
    until their count is a multiple of `world_size` (always possible when the row count is one), then dealt to ranks
    heaviest first, each to the rank with the fewest tokens among those still short of their share."""
    groups = first_fit_decreasing(lengths, budget)
    while len(groups) % world_size:
        if not split_heaviest(groups, lengths):
            raise ValueError(f"{len(lengths)} rows cannot make an equal number of micro-batches on {world_size} ranks")
    per_rank = len(groups) // world_size
    ranks: list[list[list[int]]] = [[] for _ in range(world_size)]
    tokens = [0] * world_size
    for group in sorted(groups, key=lambda g: -sum(lengths[i] for i in g)):
        rank = min((r for r in range(world_size) if len(ranks[r]) < per_rank), key=lambda r: tokens[r])
        ranks[rank].append(sorted(group))
        tokens[rank] += sum(lengths[i] for i in group)
    return ranks


@dataclass
class PackedRows:
    """Rows of the padded layout (left-padded queries, responses from column `context_length`) as one packed row.

    `input_ids` and `position_ids` are [1, total real tokens]. `predict_index` [real response tokens] is the packed
    position whose output predicts each real response token (for values: the state before it); `response_rows` and
    `response_cols` say where that token sits in the padded [rows, response_len] layout; `last_index` [rows] is each
    sequence's last real token (the reward model's score position)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    predict_index: torch.Tensor
    response_labels: torch.Tensor  # [real response tokens]: the token ids that `predict_index` predicts
    response_rows: torch.Tensor
    response_cols: torch.Tensor
    last_index: torch.Tensor
    shape: tuple[int, int]  # (rows, response_len) of the padded layout
    cu_seq_lens: torch.Tensor  # [sequences + 1] int32: where each sequence starts in the row, then its end (varlen)
    max_length: int  # the longest sequence

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """[..., real response tokens] (the leading dims of a packed batch of 1 dropped) -> [rows, response_len],
        0 on padding (which every loss masks out)."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.response_rows, self.response_cols), values.reshape(-1))


def pack_rows(query_response: torch.Tensor, attention_mask: torch.Tensor, context_length: int) -> PackedRows:
    """The real tokens of each row [rows, width] end to end, row by row; the layout is `PackedRows`'s.
    The queries must be non-empty (the last query token predicts the first response token)."""
    real = attention_mask.bool()
    lengths = real.sum(dim=1)
    packed_position = real.flatten().cumsum(0).reshape(real.shape) - 1  # [rows, width]: where each real token goes
    positions = (real.cumsum(dim=1) - 1)[real]  # restart at 0 per sequence, as the padded forward's positions
    response_mask = real[:, context_length:]
    response_rows, response_cols = response_mask.nonzero(as_tuple=True)
    predict_index = packed_position[:, context_length:][response_mask] - 1
    last_index = packed_position.masked_fill(~real, -1).max(dim=1).values
    return PackedRows(
        input_ids=query_response[real].unsqueeze(0),
        position_ids=positions.unsqueeze(0),
        predict_index=predict_index,
        response_labels=query_response[:, context_length:][response_mask],
        response_rows=response_rows,
        response_cols=response_cols,
        last_index=last_index,
        shape=(query_response.shape[0], query_response.shape[1] - context_length),
        cu_seq_lens=torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32),
        max_length=int(lengths.max()),
    )
