"""rl: the math of PPO and GRPO (masked statistics, KL, GAE, group advantages, losses, logprobs) and the rewards
(verifiers that grade a response's text, and the manager that turns them into one score per response).
May import: torch, math_verify and langdetect, and open_instruct.sandbox (the code verifiers run programs in it); nothing else of open_instruct. Every function is tensors or text in, numbers out.

The pure math is re-exported here, so that the learner reads `rl.compute_gae(...)`, `rl.policy_loss(...)`. The
re-exports load on first use (PEP 562): the flag parser imports `rl.reward_config` and `rl.tools`, which need no
torch, and a mistyped flag is answered before torch loads (run/command_line.py).
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
