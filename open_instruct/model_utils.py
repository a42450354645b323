"""Models for PPO: loading, the value/reward heads, forward passes over query+response, saving.

Layout of every learner batch (the PPO detail "left-pad the prompts"):

    query_response = [pad pad q q q q | r r r r pad pad]    # [batch, context_length + response_len]
                      ^ left-padded    ^ response, right-padded after its stop token

so the response always starts at column `context_length`, and the logits that predict response
token j sit at column `context_length - 1 + j`.
"""

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from contextlib import nullcontext
from typing import Callable

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from open_instruct.rl_utils import logprobs_from_logits


def learner_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
BF16_MIN_SPEEDUP = 1.2  # below this the probe keeps fp32: bf16 loses precision for nothing


def native_bf16_cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> list[str]:
    """The CPU flags among NATIVE_BF16_CPU_FLAGS this machine has (empty where /proc/cpuinfo is missing)."""
    try:
        with open(cpuinfo_path) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in NATIVE_BF16_CPU_FLAGS if flag in flags]


def bf16_matmul_speedup(size: int = 1024, repeats: int = 5) -> float:
    """fp32 time / bf16 time of a size x size matmul on the CPU, best of `repeats` each (0.1 s on a 2-core EPYC).

    The two dtypes are timed in turns, so a load that starts or stops during the probe (another process, the
    engine loading) slows both alike instead of only the one measured second: on 2 busy cores the old
    all-fp32-then-all-bf16 probe gave anything from 2.2x to 9.7x on a machine that measures 4.3x when quiet."""
    matrices = {dtype: (torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype))
                for dtype in (torch.float32, torch.bfloat16)}  # fmt: skip
    for a, b in matrices.values():
        a @ b  # warm-up: oneDNN builds its kernel on the first call
    best = {dtype: math.inf for dtype in matrices}
    for _ in range(repeats):
        for dtype, (a, b) in matrices.items():
            start = time.perf_counter()
            a @ b
            best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.float32] / best[torch.bfloat16]


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: as configs, flags and checkpoints spell it (`getattr(torch, name)` inverts it)."""
    return str(dtype).removeprefix("torch.")


def learner_compute_dtype(requested: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype the learner computes in under autocast (its weights stay fp32), and why.

    GPUs: bf16 unless float32 is asked for. CPUs: `auto` takes bf16 only where the CPU has native bf16
    (avx512_bf16 or AMX) *and* a short matmul probe finds it at least BF16_MIN_SPEEDUP x faster than fp32.
    The probe decides because the flags alone do not: on a 2-core avx512_bf16 machine without AMX, bf16
    matmuls measured 2x *slower* than fp32 (9.2 vs 4.8 ms for 800x576x1536) and SmolLM2-135M's
    forward+backward 1.7x slower; on an AVX2-only machine bf16 backward was 40x slower (emulated).
    """
    if requested == "float32":
        return torch.float32, "float32 asked for (--learner_compute_dtype)"
    if requested == "bfloat16" or device.type == "cuda":
        return torch.bfloat16, f"bfloat16 {'on a GPU' if requested == 'auto' else 'asked for'}"
    flags = native_bf16_cpu_flags()
    if not flags:
        return torch.float32, "float32: this CPU has no native bf16 (avx512_bf16 / amx_bf16)"
    speedup = bf16_matmul_speedup()
    if speedup < BF16_MIN_SPEEDUP:
        return torch.float32, f"float32: bf16 matmul only {speedup:.2f}x fp32 here despite {'/'.join(flags)}"
    return torch.bfloat16, f"bfloat16: {'/'.join(flags)}, bf16 matmul {speedup:.2f}x fp32"


def compute_dtype_of_all_ranks(
    dtype: torch.dtype, why: str, all_sum: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.dtype, str]:
    """The compute dtype every learner rank uses: fp32 if any rank chose it (its CPU lacks fast bf16), else this
    rank's choice. Every rank must call it (`all_sum` sums a tensor over the ranks)."""
    ranks_on_fp32 = int(all_sum(torch.tensor([int(dtype == torch.float32)], dtype=torch.int64)).item())
    if ranks_on_fp32 and dtype != torch.float32:
        return torch.float32, f"float32: {ranks_on_fp32} other learner rank(s) chose it (this rank alone: {why})"
    return dtype, why


def autocast(device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """Compute in `dtype` (bf16) with fp32 master weights; plain fp32 when `dtype` is float32.
    `learner_compute_dtype` picks the dtype."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def inference_dtype(device: torch.device) -> torch.dtype:
    """The dtype of everything that only runs forward: the reference and reward models, and the vLLM engine.

    bf16 on GPUs. fp32 on CPUs: the 2-core CI machines have AVX2 but no native bf16, so plain bf16
    forwards in torch ran 6x slower, and vLLM generated 3x slower in bf16 (16 responses of up to
    48 tokens: 17 s vs 5.5 s). fp32 also lets the engine hold exactly the learner's weights.
    """
    return torch.bfloat16 if device.type == "cuda" else torch.float32


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


def load_policy(path: str, device: torch.device, revision: str | None = None, trainable: bool = True) -> nn.Module:
    """A causal LM: the trainable policy in fp32 (autocast does bf16 compute on GPUs), or a frozen copy."""
    dtype = torch.float32 if trainable else inference_dtype(device)
    try:
        config = config_without_dropout(path, revision)
        model = AutoModelForCausalLM.from_pretrained(path, revision=revision, config=config, dtype=dtype)
    except (OSError, ValueError) as error:
        raise explain_load_error("policy" if trainable else "reference policy", path, error) from error
    disable_dropout(model)
    if model.generation_config.pad_token_id is None:  # 0 is a valid pad id: test for None, not falsiness
        model.generation_config.pad_token_id = model.config.eos_token_id
    model.to(device)
    if not trainable:
        model.eval().requires_grad_(False)
    return model


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
        model = AutoModelForSequenceClassification.from_pretrained(
            path, config=config, revision=revision, dtype=torch.float32 if trainable else inference_dtype(device)
        )
    except (OSError, ValueError) as error:
        raise explain_load_error("value model" if trainable else "reward model", path, error) from error
    if head_is_new:
        init_score_head(model)
    disable_dropout(model)
    model.to(device)
    if not trainable:
        model.eval().requires_grad_(False)
    return model


def check_same_vocab(policy_tokenizer, reward_tokenizer, policy_path: str, reward_path: str) -> None:
    """The reward model reads the policy's token ids, so both must share one vocabulary."""
    if policy_tokenizer.get_vocab() != reward_tokenizer.get_vocab():
        raise ValueError(
            f"The reward model {reward_path!r} has a different vocabulary ({len(reward_tokenizer)} tokens) from the "
            f"policy {policy_path!r} ({len(policy_tokenizer)} tokens); train the reward model from the same base "
            f"model or tokenizer as the policy."
        )


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


def named_weights_for_engine(model: nn.Module, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """A snapshot of the policy's weights with HF names, detached and copied, for the vLLM engine.

    A copy, because the learner keeps updating its parameters in place while the generation
    thread loads (and generates with) this version.
    """
    return [(name, param.detach().to(dtype=dtype, copy=True)) for name, param in model.named_parameters()]


class WeightSnapshots:
    """Copies of a model's weights for the engine, written into `slots` flat buffers that are reused.

    An async run copies the policy at every step, because the learner trains on while the engine has yet to load
    the copy. Fresh memory for each copy costs page faults: for SmolLM2-135M in fp32 (540 MB) the copy measured
    0.19 s into new memory against 0.046 s into memory already touched. The caller says which slot to write
    (`take(model, dtype, slot)`) and must not reuse a slot whose copy the engine has not loaded yet
    (rollout_requests.RolloutRequests picks a slot no request in flight holds). Views into the slot come back
    with HF names, as `named_weights_for_engine` returns them.
    """

    def __init__(self, slots: int):
        self.buffers: list[torch.Tensor | None] = [None] * slots

    def take(self, model: nn.Module, dtype: torch.dtype, slot: int) -> list[tuple[str, torch.Tensor]]:
        params = list(model.named_parameters())
        numel = sum(param.numel() for _, param in params)
        buffer = self.buffers[slot]
        if buffer is None or buffer.numel() != numel or buffer.dtype != dtype or buffer.device != params[0][1].device:
            buffer = self.buffers[slot] = torch.empty(numel, dtype=dtype, device=params[0][1].device)
        named, offset = [], 0
        with torch.no_grad():
            for name, param in params:
                view = buffer[offset : offset + param.numel()].view(param.shape)
                view.copy_(param.detach())
                named.append((name, view))
                offset += param.numel()
        return named


def state_dict_for_saving(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state dict on the CPU in `dtype`, each shared tensor once (a tied lm_head is not stored twice)."""
    state_dict, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state_dict[name] = tensor.detach().to("cpu", dtype)
    return state_dict


def weights_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """A digest of names, dtypes, shapes and bytes: equal for the learner's weights and the saved file's."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def rounding_report(
    trained: dict[str, torch.Tensor], initial: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, float]:
    """How much of the training update survives storing the trained weights in `dtype`.

    An element counts as changed where the trained weight differs from the initial one, and as rounded away
    where it changed but both round to the same value in `dtype`. fp32 updates of about lr x steps (1e-5 to
    1e-4) are below half a bf16 step for most weights of magnitude 1e-2, so a bf16 save can silently return
    the initial model (measured on the CPU debug run: 97% of the weights bit-identical to the base model's).
    Names missing from `initial` are skipped.
    """
    changed = rounded_away = 0
    for name, weight in trained.items():
        if name not in initial:
            continue
        weight = weight.detach().float().cpu()
        start = initial[name].detach().float().cpu()
        moved = weight != start
        same_after_rounding = weight.to(dtype) == start.to(dtype)
        changed += int(moved.sum())
        rounded_away += int((moved & same_after_rounding).sum())
    return {
        "changed": float(changed),
        "rounded_away": float(rounded_away),
        "fraction_rounded_away": rounded_away / changed if changed else 0.0,
    }


def mark_config_dtype(config_path: str, dtype: str) -> None:
    """save_pretrained records the in-memory dtype; record the dtype the files hold instead."""
    with open(config_path) as f:
        config = json.load(f)
    config["dtype"] = dtype
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def save_hf_folder(
    model: nn.Module,
    tokenizer,
    output_dir: str,
    state_dict: dict[str, torch.Tensor],
    extra_files: dict[str, dict] | None = None,
) -> str:
    """Save `state_dict` as the model's weights, with its config, tokenizer, chat template and generation config.

    Written to a temporary folder beside `output_dir`, then swapped in with renames, so a crash
    mid-save leaves the previous checkpoint intact. The config's `dtype` is the weights' dtype.
    """
    output_dir = os.path.abspath(output_dir)
    parent = os.path.dirname(output_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}-saving-", dir=parent)
    try:
        model.save_pretrained(tmp_dir, state_dict=state_dict)
        saved_dtype = next(iter(state_dict.values())).dtype
        mark_config_dtype(os.path.join(tmp_dir, "config.json"), dtype_name(saved_dtype))
        tokenizer.save_pretrained(tmp_dir)
        for name, content in (extra_files or {}).items():
            with open(os.path.join(tmp_dir, name), "w") as f:
                json.dump(content, f, indent=2)
        old_dir = None
        if os.path.exists(output_dir):
            old_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}-old-", dir=parent)
            os.rename(output_dir, os.path.join(old_dir, "previous"))
        os.rename(tmp_dir, output_dir)
        if old_dir:
            shutil.rmtree(old_dir, ignore_errors=True)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return output_dir
