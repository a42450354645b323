"""rl: the math of PPO and GRPO: masked statistics, KL estimators, GAE, group advantages, the policy and value
losses, logprobs from logits, and packing rows into micro-batches. Tensors in, numbers out; no text, no models.
May import: torch; nothing else of open_instruct.

The math is re-exported here, so that the learner reads `rl.compute_gae(...)`, `rl.policy_loss(...)`. The
re-exports load on first use (PEP 562), so importing the package costs nothing until a function is used.
"""

import importlib

_EXPORTS = {
    "advantages": [
        "KL_ESTIMATORS", "compute_gae", "compute_kl", "group_advantages", "per_token_rewards", "turn_rewards_at_tokens",
    ],
    "logprobs": [
        "entropy_from_logits", "logprob_agreement", "logprobs_and_entropy", "logprobs_from_logits", "projected_logprobs",
    ],
    "losses": ["kl_penalty_loss", "policy_loss", "truncated_importance_weight", "value_loss"],
    "masked": [
        "LOSS_AGGREGATIONS", "WholeBatch", "first_true_indices", "masked_aggregate", "masked_mean", "masked_var",
        "masked_whiten", "response_mask_from_lengths", "truncate_response", "turn_ends",
    ],
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))
