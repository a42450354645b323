"""The learner's models: loading the policy, the value and reward models (a backbone with a scalar score head) and the
reference; forward passes over query + response (logprobs, values, reward scores). The batch layout is in `experience`.
"""

import logging
import math

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from open_instruct.data.tokenizer import explain_load_error
from open_instruct.rl.logprobs import logprobs_from_logits
from open_instruct.run.devices import autocast, inference_dtype

log = logging.getLogger(__name__)

DROPOUT_CONFIG_KEYS = ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")


def config_without_dropout(path: str, revision: str | None = None):
    """The model's config with every dropout probability at 0.

    PPO detail: dropout off, so that logprobs of the same tokens agree between passes. It must be zeroed in
    the config *before* the model is built: attention modules copy `config.attention_dropout` when they are
    constructed and apply it as a functional dropout, which no later config edit or `nn.Dropout` sweep reaches.
    """
    config = AutoConfig.from_pretrained(path, revision=revision)
    for key in DROPOUT_CONFIG_KEYS:
        if hasattr(config, key):
            setattr(config, key, 0.0)
    return config


def disable_dropout(model: nn.Module) -> None:
    """Zero any `nn.Dropout` module a model builds from a config key not in DROPOUT_CONFIG_KEYS."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def load_policy(path: str, device: torch.device, revision: str | None = None, trainable: bool = True) -> nn.Module:
    """A causal LM: the trainable policy in fp32 (autocast does bf16 compute on GPUs), or a frozen copy."""
    dtype = torch.float32 if trainable else inference_dtype(device)
    try:
        config = config_without_dropout(path, revision)
        model, loading = AutoModelForCausalLM.from_pretrained(
            path, revision=revision, config=config, dtype=dtype, output_loading_info=True
        )
    except (OSError, ValueError) as error:
        raise explain_load_error("policy" if trainable else "reference policy", path, error) from error
    restate_missing_weights("policy" if trainable else "reference policy", path, sorted(loading["missing_keys"]))
    disable_dropout(model)
    if model.generation_config.pad_token_id is None:  # 0 is a valid pad id: test for None, not falsiness
        model.generation_config.pad_token_id = model.config.eos_token_id
    model.to(device)
    if not trainable:
        model.eval().requires_grad_(False)
    return model


def restate_missing_weights(role: str, path: str, missing: list[str]) -> None:
    """One warning line of ours for weights the checkpoint lacked (transformers' own report goes to the library log):
    they start from random values, which for a policy or a reward model's head means a broken run."""
    if missing:
        log.warning(f"[learner] warning: the {role} checkpoint {path} lacks {len(missing)} weight(s) "
                    f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): they start from random values")  # fmt: skip


def init_score_head(model: nn.Module) -> None:
    """PPO detail: a fresh scalar head with std 1/sqrt(hidden+1), bias 0 (Ziegler et al. 2019)."""
    head = model.score
    # Its own generator, seeded by the run's seed: the vLLM engine starting in another thread may draw from or reseed
    # torch's global one meanwhile, and a resumed run must be comparable with an uninterrupted one.
    generator = torch.Generator().manual_seed(torch.initial_seed())
    nn.init.normal_(head.weight, std=1.0 / math.sqrt(model.config.hidden_size + 1), generator=generator)
    if head.bias is not None:
        nn.init.zeros_(head.bias)


def load_scalar_model(
    path: str, device: torch.device, *, trainable: bool, pad_token_id: int, revision: str | None = None
) -> nn.Module:
    """A backbone with a 1-output `score` head: the value model (trainable) or a reward model (frozen).

    A causal-LM checkpoint has no score head, so transformers creates one; its init is then reset
    to the PPO value-head init. A reward-model checkpoint keeps its trained head.
    """
    try:
        config = config_without_dropout(path, revision)
        head_is_new = not any("ForSequenceClassification" in a for a in (config.architectures or []))
        config.num_labels = 1
        config.pad_token_id = pad_token_id
        model, loading = AutoModelForSequenceClassification.from_pretrained(
            path, config=config, revision=revision, dtype=torch.float32 if trainable else inference_dtype(device),
            output_loading_info=True,
        )
    except (OSError, ValueError) as error:
        raise explain_load_error("value model" if trainable else "reward model", path, error) from error
    # transformers reports a new score head as MISSING in its log (logs/libraries.log): expected for a causal-LM
    # checkpoint, so only other missing weights are restated.
    missing = sorted(key for key in loading["missing_keys"] if not (head_is_new and key.startswith("score.")))
    restate_missing_weights("value model" if trainable else "reward model", path, missing)
    if head_is_new:
        init_score_head(model)
    disable_dropout(model)
    model.to(device)
    if not trainable:
        model.eval().requires_grad_(False)
    return model


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions count real tokens only, so a left-padded prompt starts at position 0."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)


def forward_backbone(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs):
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        **kwargs,
    )


def response_logits(
    model: nn.Module, query_response: torch.Tensor, attention_mask: torch.Tensor, context_length: int
) -> torch.Tensor:
    """Logits predicting each response token.  # [batch, response_len, vocab]

    `logits_to_keep` skips the vocabulary projection for prompt positions nobody needs.
    """
    response_len = query_response.shape[1] - context_length
    logits = forward_backbone(model, query_response, attention_mask, logits_to_keep=response_len + 1).logits
    return logits[:, :-1]


def response_logprobs(
    model: nn.Module,
    query_response: torch.Tensor,
    attention_mask: torch.Tensor,
    context_length: int,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each response token, its logits), both from logits / temperature like vLLM samples."""
    logits = response_logits(model, query_response, attention_mask, context_length)
    response = query_response[:, context_length:]
    return logprobs_from_logits(logits, response, temperature), logits


def token_scores(model: nn.Module, query_response: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The score head applied at every position.  # [batch, seq_len]"""
    backbone = getattr(model, model.base_model_prefix)
    hidden = forward_backbone(backbone, query_response, attention_mask).last_hidden_state
    return model.score(hidden).squeeze(-1)


def response_values(
    value_model: nn.Module, query_response: torch.Tensor, attention_mask: torch.Tensor, context_length: int
) -> torch.Tensor:
    """V(s) for the state before each response token.  # [batch, response_len]"""
    return token_scores(value_model, query_response, attention_mask)[:, context_length - 1 : -1]


def reward_model_scores(
    reward_model: nn.Module,
    query_response: torch.Tensor,
    attention_mask: torch.Tensor,
    context_length: int,
    response_length: torch.Tensor,
) -> torch.Tensor:
    """The reward model's score read at the last real response token.  # [batch]"""
    scores = token_scores(reward_model, query_response, attention_mask)
    last_index = context_length + response_length - 1
    return scores.gather(1, last_index.unsqueeze(1)).squeeze(1)


def no_grad_in_chunks(
    fn, chunk_size: int, *tensors: torch.Tensor, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Run `fn` over row chunks without gradients (autocast to `dtype`) and concatenate the float32 results."""
    outputs = []
    with torch.no_grad(), autocast(device, dtype):
        for start in range(0, tensors[0].shape[0], chunk_size):
            outputs.append(fn(*(t[start : start + chunk_size] for t in tensors)).float())
    return torch.cat(outputs)
