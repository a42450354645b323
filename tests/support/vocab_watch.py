"""A torch dispatch mode that watches how many positions of full-vocabulary logits exist at once: the chunked
logprobs' memory bound, asserted without a memory profiler (tests/test_rl_math.py, test_ppo_learner.py)."""

import torch


class LargestVocabTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Watches every tensor an op creates; records the most positions of a [..., vocab] float32 one."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.most_positions = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # a view allocates nothing (e.g. the head's weight transposed)
            return out
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and tensor.dim() >= 2:
                if tensor.shape[-1] == self.vocab:
                    self.most_positions = max(self.most_positions, tensor.numel() // self.vocab)
        return out
