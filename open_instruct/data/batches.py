"""Prompts as the learner and the engine take them: a batch of prompts with their ground truths, left padding, and
the prompt order (reshuffled every pass over the data, resumable).
"""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PromptBatch:
    """The prompts of one rollout request; each is sampled `number_samples_per_prompt` times."""

    token_ids: list[list[int]]
    ground_truths: list[str | None]
    verifier_names: list[str | None]
    texts: list[str]


def prompt_batch(dataset, indices: list[int], tokenizer) -> PromptBatch:
    rows = dataset[indices]
    return PromptBatch(
        token_ids=rows["input_ids_prompt"],
        ground_truths=rows["ground_truth"],
        verifier_names=rows["dataset"],
        texts=[tokenizer.decode(ids) for ids in rows["input_ids_prompt"]],
    )


def left_pad(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Left-pad token lists to (input_ids, attention_mask), both [batch, longest].

    Left, not right: generation appends after the last column, so every prompt must end there
    ("The N Implementation Details of RLHF with PPO", detail on padding).
    """
    if not sequences:
        raise ValueError("left_pad got no sequences; pass at least one token list.")
    if pad_token_id is None:
        raise ValueError("left_pad got pad_token_id=None; set tokenizer.pad_token (e.g. to the EOS token).")
    longest = max(len(sequence) for sequence in sequences)
    input_ids = torch.full((len(sequences), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        if sequence:
            input_ids[row, longest - len(sequence) :] = torch.tensor(sequence, dtype=torch.long)
            attention_mask[row, longest - len(sequence) :] = 1
    return input_ids, attention_mask


class ShufflingIterator:
    """Endless batches of indices into `num_items` prompts, reshuffled every pass over the data.

    The passes form one stream: a batch that reaches the end of a pass is completed from the start of
    the next pass, so no prompt is skipped and each pass yields every index exactly once. (At a
    boundary a batch can hold an index twice, once from each pass.) The order of pass `epoch` is a
    pure function of (seed, epoch), so the state is five integers and a restored iterator yields
    exactly the batches the saved one would have.
    """

    def __init__(self, num_items: int, batch_size: int, seed: int):
        if num_items < 1 or batch_size < 1 or seed < 0:
            raise ValueError(
                f"ShufflingIterator needs num_items >= 1, batch_size >= 1 and seed >= 0, got num_items={num_items}, "
                f"batch_size={batch_size}, seed={seed}; check the dataset size and the batch arguments."
            )
        self.num_items = num_items
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0  # passes over the data completed
        self.position = 0  # how many indices of the current pass were handed out
        self._order = self._pass_order(0)

    @property
    def handed_out(self) -> int:
        """Indices handed out so far, over all passes."""
        return self.epoch * self.num_items + self.position

    def _pass_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

    def __iter__(self) -> "ShufflingIterator":
        return self

    def __next__(self) -> list[int]:
        batch: list[int] = []
        while len(batch) < self.batch_size:
            take = min(self.batch_size - len(batch), self.num_items - self.position)
            batch.extend(self._order[self.position : self.position + take].tolist())
            self.position += take
            if self.position == self.num_items:
                self.epoch += 1
                self.position = 0
                self._order = self._pass_order(self.epoch)
        return batch

    next = __next__

    def state_dict(self) -> dict:
        return {
            "num_items": self.num_items,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`; the batch size stays the constructor's (a resumed run may change it)."""
        if state["num_items"] != self.num_items:
            raise ValueError(
                f"The saved ShufflingIterator state covers {state['num_items']} items but this one covers "
                f"{self.num_items}; resume with the same prompt dataset (same mixer, seed and length limit)."
            )
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order = self._pass_order(self.epoch)
