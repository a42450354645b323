"""The learner's work in a step, counted: real tokens, token slots (real plus padding) and useful FLOPs, and the
three `perf/*` metrics made of them. Pure: numbers and masks in, numbers out.

Useful FLOPs of one model's pass over a batch (docs/speed.md has the formula and why):

    forward  = 2 * body_params * real_tokens                       (every linear map of every layer, every real token)
             + 2 * head_params * response_tokens                   (the LM or score head, only where its output is used)
             + 2 * num_layers * attention_width * sum_i L_i (L_i + 1)   (causal QK^T and AV over each row's L_i real
                                                                        tokens: token j attends j keys, 4 FLOPs a key
                                                                        and width, summed: 2 L (L + 1))
    backward = 2 * forward                                         (gradients of the inputs and of the weights)

Padding, recomputation (gradient checkpointing, chunked logprobs) and the optimizer are not useful work: a faster
step at the same useful FLOPs is a better step. `body_params` counts the decoder layers' projections of a gated-MLP
decoder (Llama, Qwen, OLMo, Mistral): per layer q and o (hidden x heads*head_dim each), k and v
(hidden x kv_heads*head_dim each) and the MLP's three (hidden x intermediate); norms and embeddings are lookups or
elementwise, not matmuls.
"""

from dataclasses import dataclass

import torch

# The perf/* metrics that are rates over the step's seconds: like time/*, they differ between two runs of the same
# computation (tests that compare runs leave them out, as they leave out time/*).
TIMED_METRICS = frozenset({
    "perf/tokens_per_second", "perf/learner_flops_utilization", "perf/learner_tflops",
    "perf/engine_idle_fraction", "perf/learner_idle_fraction",
    "tools/time",  # seconds spent in tool calls (--tools)
})  # fmt: skip


def is_timing(key: str) -> bool:
    """A metric measured in seconds or over them (time/*, the perf/* rates)."""
    return key.startswith("time/") or key in TIMED_METRICS


@dataclass(frozen=True)
class ModelFlops:
    """What the FLOP count needs to know of one model."""

    role: str  # "policy", "value model", ...
    body_params: int  # weights of the decoder layers' linear maps: each real token multiplies all of them
    head_params: int  # the LM head (vocab x hidden) or a score head (hidden): applied to response tokens
    num_layers: int
    attention_width: int  # num_heads * head_dim: the query side of attention

    @classmethod
    def of_config(cls, role: str, config, causal_lm: bool) -> "ModelFlops":
        """From a transformers config (a causal LM's head: vocab x hidden; a value or reward model's: hidden x 1)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        hidden, heads = text.hidden_size, text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        intermediate = getattr(text, "intermediate_size", None) or 4 * hidden
        per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate
        return cls(
            role=role,
            body_params=per_layer * text.num_hidden_layers,
            head_params=text.vocab_size * hidden if causal_lm else hidden,
            num_layers=text.num_hidden_layers,
            attention_width=heads * head_dim,
        )

    def forward_flops(self, real_tokens_per_row: torch.Tensor, response_tokens_per_row: torch.Tensor) -> float:
        """Useful FLOPs of one forward pass over rows of these real lengths (prompt + response) and response lengths."""
        real = real_tokens_per_row.double()
        return float(
            2 * self.body_params * real.sum()
            + 2 * self.head_params * response_tokens_per_row.double().sum()
            + 2 * self.num_layers * self.attention_width * (real * (real + 1)).sum()
        )


@dataclass
class LearnerWork:
    """The learner's work in one step, added up pass by pass (`add_pass`), and its seconds."""

    real_tokens: int = 0  # the rollout's real prompt + response tokens (each once, whatever the passes over them)
    passes_real_tokens: int = 0  # real tokens summed over every forward pass (a backward adds none: same slots)
    passes_token_slots: int = 0  # token slots (real + padding) summed over every forward pass
    flops: float = 0.0  # useful FLOPs, forward and backward
    seconds: float = 0.0

    def add_pass(
        self, model: ModelFlops, attention_mask: torch.Tensor, response_mask: torch.Tensor, backward: bool,
        token_slots: int | None = None,
    ) -> None:  # fmt: skip
        """One forward pass of `model` over these rows (and its backward with `backward`). `token_slots`: the slots
        the pass computed; None: the padded layout's, every row as wide as the mask (the packed path passes its
        micro-batches' own count)."""
        real_per_row = attention_mask.sum(1)
        forward = model.forward_flops(real_per_row, response_mask.sum(1))
        self.flops += forward * (3 if backward else 1)
        self.passes_real_tokens += int(real_per_row.sum())
        self.passes_token_slots += attention_mask.numel() if token_slots is None else int(token_slots)

    @property
    def padding_fraction(self) -> float:
        """Padded / total token slots over the step's passes."""
        if self.passes_token_slots == 0:
            return 0.0
        return 1.0 - self.passes_real_tokens / self.passes_token_slots

    def metrics(self, peak_flops_per_second: float, num_devices: int = 1) -> dict[str, float]:
        """`perf/tokens_per_second` (the rollout's real tokens over the learner's seconds), `perf/padding_fraction`
        and `perf/learner_flops_utilization` (useful FLOP/s over the peak of all the learner's devices)."""
        seconds = max(self.seconds, 1e-9)
        return {
            "perf/tokens_per_second": self.real_tokens / seconds,
            "perf/padding_fraction": self.padding_fraction,
            "perf/learner_flops_utilization": self.flops / seconds / (peak_flops_per_second * num_devices),
            "perf/learner_tflops": self.flops / seconds / 1e12,
        }
