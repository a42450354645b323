"""rl: the math of PPO and GRPO (masked statistics, KL, GAE, group advantages, losses, logprobs) and the rewards
(verifiers that grade a response's text, and the manager that turns them into one score per response).
May import: torch, math_verify and langdetect, and open_instruct.sandbox (the code verifiers run programs in it); nothing else of open_instruct. Every function is tensors or text in, numbers out.

The pure math is re-exported here, so that the learner reads `rl.compute_gae(...)`, `rl.policy_loss(...)`.
"""

from open_instruct.rl.advantages import KL_ESTIMATORS, compute_gae, compute_kl, group_advantages, per_token_rewards  # noqa: F401, I001
from open_instruct.rl.logprobs import (  # noqa: F401
    entropy_from_logits,
    logprob_agreement,
    logprobs_and_entropy,
    logprobs_from_logits,
    projected_logprobs,
)
from open_instruct.rl.losses import kl_penalty_loss, policy_loss, truncated_importance_weight, value_loss  # noqa: F401
from open_instruct.rl.masked import (  # noqa: F401
    LOSS_AGGREGATIONS,
    WholeBatch,
    first_true_indices,
    masked_aggregate,
    masked_mean,
    masked_var,
    masked_whiten,
    response_mask_from_lengths,
    truncate_response,
)
