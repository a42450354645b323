"""The policy's tokenizer: loading it, the stop tokens, and the one-vocabulary rule for every model that reads the
policy's token ids (reward and value models).
"""

from transformers import AutoTokenizer


def explain_load_error(role: str, path: str, error: Exception) -> RuntimeError:
    return RuntimeError(
        f"Could not load the {role} from {path!r} ({type(error).__name__}: {str(error).splitlines()[0]}); "
        f"give an existing local HF folder, or a hub id with network access, or 'embedded' for the built-in model."
    )


def load_tokenizer(path: str, revision: str | None = None):
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    except (OSError, ValueError) as error:
        raise explain_load_error("tokenizer", path, error) from error
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_same_vocab(policy_tokenizer, reward_tokenizer, policy_path: str, reward_path: str) -> None:
    """The reward model reads the policy's token ids, so both must share one vocabulary."""
    if policy_tokenizer.get_vocab() != reward_tokenizer.get_vocab():
        raise ValueError(
            f"The reward model {reward_path!r} has a different vocabulary ({len(reward_tokenizer)} tokens) from the "
            f"policy {policy_path!r} ({len(policy_tokenizer)} tokens); train the reward model from the same base "
            f"model or tokenizer as the policy."
        )


def stop_token_ids_for(tokenizer, stop_token: str | None) -> list[int]:
    if stop_token is None:
        return []
    if stop_token == "eos":
        return [tokenizer.eos_token_id]
    period_ids = tokenizer.encode(".", add_special_tokens=False)
    return period_ids[-1:]  # "period": stop after the first sentence (the seed 001 TL;DR setting)
