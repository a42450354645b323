"""The learner's models: loading the policy, the value and reward models (a backbone with a scalar score head) and the
reference; forward passes over query + response (logprobs, values, reward scores). The batch layout is in `experience`.
"""

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from open_instruct.data.tokenizer import explain_load_error
from open_instruct.learner.varlen_attention import use_varlen_attention
from open_instruct.rl.logprobs import logprobs_and_entropy, projected_logprobs
from open_instruct.rl.packing import PackedRows
from open_instruct.run.devices import MODEL_CONSTRUCTION, autocast, inference_dtype
from open_instruct.run.model_shapes import keep_first_layers

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


@dataclass(frozen=True)
class ModelSpec:
    """One model a learner loads: the policy and the value model train, the reference and the reward model only run
    forward. `scalar_head`: a backbone with a 1-output `score` head (value and reward models), else a causal LM."""

    role: str  # "policy", "reference policy", "value model", "reward model": for messages
    path: str
    revision: str | None = None
    trainable: bool = True
    scalar_head: bool = False
    pad_token_id: int | None = None  # the policy tokenizer's, for a scalar-head model's config
    num_layers: int = 0  # load only the first N decoder layers (--value_model_num_layers); 0: all

    def config(self):
        """The model's config, dropout off (and for a scalar head: 1 label, the policy's pad id)."""
        try:
            config = config_without_dropout(self.path, self.revision)
        except (OSError, ValueError) as error:
            raise explain_load_error(self.role, self.path, error) from error
        if self.scalar_head:
            config.num_labels = 1
            config.pad_token_id = self.pad_token_id
        keep_first_layers(config, self.num_layers)
        return config

    def head_is_new(self, config) -> bool:
        """A scalar head on a causal-LM checkpoint is created fresh (and given PPO's init); a reward model's is kept."""
        return self.scalar_head and not any("ForSequenceClassification" in a for a in (config.architectures or []))

    @property
    def auto_class(self):
        return AutoModelForSequenceClassification if self.scalar_head else AutoModelForCausalLM

    def dtype(self, device: torch.device) -> torch.dtype:
        """fp32 for what trains (the master weights; autocast computes in bf16), the inference dtype otherwise."""
        return torch.float32 if self.trainable else inference_dtype(device)


def load_model(spec: ModelSpec, device: torch.device) -> nn.Module:
    """The whole model on `device` (one process, and ZeRO stages 0 and 2; ZeRO-3 loads partitioned instead:
    deepspeed_backend). A new score head gets PPO's init; dropout is off; a frozen model does not train."""
    config = spec.config()
    try:
        with MODEL_CONSTRUCTION:  # (from_pretrained sets torch's default dtype while it builds; the engine's thread too)
            model, loading = spec.auto_class.from_pretrained(
                spec.path, revision=spec.revision, config=config, dtype=spec.dtype(device), output_loading_info=True
            )
    except (OSError, ValueError) as error:
        raise explain_load_error(spec.role, spec.path, error) from error
    # transformers reports a new score head as MISSING in its log (logs/libraries.log): expected for a causal-LM
    # checkpoint, so only other missing weights are restated.
    head_is_new = spec.head_is_new(config)
    missing = sorted(key for key in loading["missing_keys"] if not (head_is_new and key.startswith("score.")))
    restate_missing_weights(spec.role, spec.path, missing)
    if head_is_new:
        init_score_head(model)
    return finish_loading(model, spec).to(device)


def finish_loading(model: nn.Module, spec: ModelSpec) -> nn.Module:
    """What every loaded model gets: dropout off, a generation pad id, attention that packed rows take sequence by
    sequence (varlen_attention.py), and for a frozen one no gradients."""
    disable_dropout(model)
    use_varlen_attention(model)
    if not spec.scalar_head and model.generation_config.pad_token_id is None:  # 0 is a valid pad id: test for None
        model.generation_config.pad_token_id = model.config.eos_token_id
    if not spec.trainable:
        model.eval().requires_grad_(False)
    return model


def enable_gradient_checkpointing(hf_model: nn.Module) -> None:
    """Recompute activations in backward. With LoRA the embedding is frozen: its output must require grad, or the
    checkpointed layers' recomputation would have nothing to backpropagate into (the adapters would get no gradient)."""
    hf_model.gradient_checkpointing_enable()
    if not all(param.requires_grad for param in hf_model.parameters()):
        hf_model.enable_input_require_grads()


def load_policy(path: str, device: torch.device, revision: str | None = None, trainable: bool = True) -> nn.Module:
    """A causal LM: the trainable policy in fp32 (autocast does bf16 compute on GPUs), or a frozen copy."""
    return load_model(ModelSpec("policy" if trainable else "reference policy", path, revision, trainable), device)


def restate_missing_weights(role: str, path: str, missing: list[str]) -> None:
    """One warning line of ours for weights the checkpoint lacked (transformers' own report goes to the library log):
    they start from random values, which for a policy or a reward model's head means a broken run."""
    if missing:
        log.warning(f"[learner] warning: the {role} checkpoint {path} lacks {len(missing)} weight(s) "
                    f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): they start from random values")  # fmt: skip


def score_head_std(config) -> float:
    """PPO detail: a fresh scalar head's init std is 1/sqrt(hidden+1) (Ziegler et al. 2019)."""
    return 1.0 / math.sqrt(config.hidden_size + 1)


def init_score_head(model: nn.Module) -> None:
    """PPO detail: a fresh scalar head with std 1/sqrt(hidden+1), bias 0 (Ziegler et al. 2019)."""
    head = model.score
    nn.init.normal_(head.weight, std=score_head_std(model.config), generator=score_head_generator())
    if head.bias is not None:
        nn.init.zeros_(head.bias)


def score_head_generator() -> torch.Generator:
    """The score head's own generator, seeded by the run's seed: the vLLM engine starting in another thread may draw
    from or reseed torch's global one meanwhile, and a resumed run must be comparable with an uninterrupted one."""
    return torch.Generator().manual_seed(torch.initial_seed())


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


def forward_packed(model: nn.Module, packed: PackedRows, **kwargs):
    """One packed row (rl/packing.py): no 2D mask, positions restarting per sequence, and the sequences' cumulative
    lengths, with which the attention (flash-attention's varlen kernel, or varlen_attention.py's SDPA) takes each
    sequence alone; an attention that ignores them gets transformers' block-diagonal causal mask from the positions."""
    starts = packed.cu_seq_lens
    return model(input_ids=packed.input_ids, attention_mask=None, position_ids=packed.position_ids, use_cache=False,
                 cu_seq_lens_q=starts, cu_seq_lens_k=starts, max_length_q=packed.max_length,
                 max_length_k=packed.max_length, **kwargs)  # fmt: skip


# Config keys of architectures whose causal-LM forward does more to the hidden states than the LM head (Gemma's logit
# soft-capping, Cohere's logit scale): their logprobs are computed from the model's own logits, never projected here.
LOGIT_TRANSFORM_CONFIG_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def projects_with_its_head_alone(config) -> bool:
    """Whether the causal LM's logits are exactly its output embedding applied to the last hidden states."""
    return all(getattr(config, key, None) in (None, 1, 1.0) for key in LOGIT_TRANSFORM_CONFIG_KEYS)


class TokenLogprobs(nn.Module):
    """The policy (or the reference) as one module whose forward returns the logprob of each response token under
    logits / temperature (and, when asked, each position's entropy): `hf_model` is the causal LM.

    With `chunk_size` > 0 the backbone's hidden states go through the LM head `chunk_size` positions at a time, with
    recompute in backward (`rl.projected_logprobs`): no [batch, response_len, vocab] float32 tensor exists, in
    training or for the entropy metric. With 0 the causal LM computes the logits of every response position at once
    (`logits_to_keep` skips the prompt positions). One module, so that DeepSpeed ZeRO-3 sees a single root forward:
    it traces the order of the submodules from it and prefetches their parameters.
    """

    def __init__(self, causal_lm: nn.Module, chunk_size: int = 0):
        super().__init__()
        self.hf_model = causal_lm
        self.chunk_size = chunk_size if projects_with_its_head_alone(causal_lm.config) else 0
        if chunk_size and not self.chunk_size:
            log.info(f"[learner] {type(causal_lm).__name__} transforms its logits after the LM head: its logprobs are "
                     "computed from whole logits (--logprob_chunk_size applies to plain LM heads)")  # fmt: skip

    def forward(
        self, query_response: torch.Tensor, attention_mask: torch.Tensor, context_length: int, temperature: float,
        with_entropy: bool = False, packed: PackedRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """(logprob, entropy or None), float32 [batch, response_len] each; from `packed` when given (then
        query_response and attention_mask are None), 0 on padding."""
        if packed is not None:
            return self.packed_forward(packed, temperature, with_entropy)
        response = query_response[:, context_length:]
        if self.chunk_size == 0:
            logits = forward_backbone(self.hf_model, query_response, attention_mask,
                                      logits_to_keep=response.shape[1] + 1).logits[:, :-1]  # fmt: skip
            return logprobs_and_entropy(logits, response, temperature, with_entropy)
        backbone = getattr(self.hf_model, self.hf_model.base_model_prefix)
        hidden = forward_backbone(backbone, query_response, attention_mask).last_hidden_state
        # The hidden state at position context_length - 1 + j predicts response token j.
        hidden = hidden[:, context_length - 1 : -1]
        head = self.hf_model.get_output_embeddings()
        return projected_logprobs(hidden, response, head, temperature, self.chunk_size, with_entropy)

    def packed_forward(self, packed: PackedRows, temperature: float, with_entropy: bool):
        """Only the positions that predict a real response token reach the LM head: [1, real response tokens]."""
        labels = packed.response_labels.unsqueeze(0)
        if self.chunk_size == 0:
            logits = forward_packed(self.hf_model, packed).logits[:, packed.predict_index]
            logprob, entropy = logprobs_and_entropy(logits, labels, temperature, with_entropy)
        else:
            backbone = getattr(self.hf_model, self.hf_model.base_model_prefix)
            hidden = forward_packed(backbone, packed).last_hidden_state[:, packed.predict_index]
            head = self.hf_model.get_output_embeddings()
            logprob, entropy = projected_logprobs(hidden, labels, head, temperature, self.chunk_size, with_entropy)
        return packed.unpack(logprob), (packed.unpack(entropy) if entropy is not None else None)


class TokenScores(nn.Module):
    """A value or reward model as one module whose forward returns its score head at every position, [batch, seq]:
    `hf_model` is the *ForSequenceClassification model (whose own forward pools one position). One module, so that
    DeepSpeed ZeRO-3 sees a root forward, traces its submodules and prefetches their parameters (calling the backbone
    and the head one by one through the engine never completes the trace: every gather waits)."""

    def __init__(self, classifier: nn.Module):
        super().__init__()
        self.hf_model = classifier

    def forward(
        self, query_response: torch.Tensor, attention_mask: torch.Tensor, packed: PackedRows | None = None
    ) -> torch.Tensor:
        """[batch, seq]; with `packed` (query_response and attention_mask None): [1, packed tokens]."""
        backbone = getattr(self.hf_model, self.hf_model.base_model_prefix)
        if packed is not None:
            hidden = forward_packed(backbone, packed).last_hidden_state
        else:
            hidden = forward_backbone(backbone, query_response, attention_mask).last_hidden_state
        return self.hf_model.score(hidden).squeeze(-1)


def hf_model_of(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a TokenLogprobs / TokenScores wrapper (or the model itself)."""
    return getattr(model, "hf_model", model)


def weight_norm(model, backend) -> float:
    """The global L2 norm of a model's weights (the divergence guard's yardstick). Under ZeRO-3 each rank holds only
    its partition of a partitioned tensor: each sums the squares of its own share and the ranks add them up (a
    collective: every rank calls it); a tensor every rank holds whole (LoRA's adapters before DeepSpeed partitions
    them) counts once."""
    sharded, whole, partitioned = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64), False
    with torch.no_grad():
        for param in backend.hf_model(model).parameters():
            if hasattr(param, "ds_tensor"):
                partitioned = True
                share = param.ds_tensor.reshape(-1)
                start = backend.rank * share.numel()  # a rank's flat range; the last one ends in padding
                share = share[: max(0, min(share.numel(), param.ds_numel - start))]
                sharded += torch.linalg.vector_norm(share, dtype=torch.float32).double().cpu() ** 2  # no copy of share
            else:
                whole += torch.linalg.vector_norm(param, dtype=torch.float32).double().cpu() ** 2
    if partitioned:
        sharded = backend.all_sum(sharded)
    return float((sharded + whole).sqrt())


def response_logprobs(
    policy: nn.Module,
    query_response: torch.Tensor,
    attention_mask: torch.Tensor,
    context_length: int,
    temperature: float,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprob of each response token, its position's entropy or None) under logits / temperature, as vLLM samples;
    `policy` is a TokenLogprobs (or the DeepSpeed engine around one). Float32 [batch, response_len] each."""
    return policy(query_response, attention_mask, context_length, temperature, with_entropy)


def response_values(
    value_model: nn.Module, query_response: torch.Tensor, attention_mask: torch.Tensor, context_length: int
) -> torch.Tensor:
    """V(s) for the state before each response token; `value_model` is a TokenScores.  # [batch, response_len]"""
    return value_model(query_response, attention_mask)[:, context_length - 1 : -1]


def packed_response_logprobs(
    policy: nn.Module, packed: PackedRows, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_logprobs` of packed rows (rl/packing.py): the same [rows, response_len] outputs, 0 on padding."""
    return policy(None, None, 0, temperature, with_entropy, packed=packed)


def packed_response_values(value_model: nn.Module, packed: PackedRows) -> torch.Tensor:
    """`response_values` of packed rows: [rows, response_len], 0 on padding."""
    return packed.unpack(value_model(None, None, packed=packed)[0, packed.predict_index])


def packed_reward_model_scores(reward_model: nn.Module, packed: PackedRows) -> torch.Tensor:
    """`reward_model_scores` of packed rows: each sequence's score at its last real token.  # [rows]"""
    return reward_model(None, None, packed=packed)[0, packed.last_index]


def reward_model_scores(
    reward_model: nn.Module,
    query_response: torch.Tensor,
    attention_mask: torch.Tensor,
    context_length: int,
    response_length: torch.Tensor,
) -> torch.Tensor:
    """The reward model's score read at the last real response token; `reward_model` is a TokenScores.  # [batch]"""
    scores = reward_model(query_response, attention_mask)
    last_index = context_length + response_length - 1
    return scores.gather(1, last_index.unsqueeze(1)).squeeze(1)


def no_grad_in_chunks(
    fn, chunk_size: int, *tensors: torch.Tensor, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Run `fn` over row chunks without gradients (autocast to `dtype`) and concatenate the float32 results."""
    outputs = []
    with torch.no_grad(), autocast(device, dtype, training=False):
        for start in range(0, tensors[0].shape[0], chunk_size):
            outputs.append(fn(*(t[start : start + chunk_size] for t in tensors)).float())
    return torch.cat(outputs)
