"""Greedy completions of a saved model folder by a fresh vLLM engine, printed as JSON on the last stdout line.

    python tests/support/vllm_greedy.py MODEL_DIR PROMPTS_JSON MAX_TOKENS DTYPE [ADAPTER_DIR]

PROMPTS_JSON is a file holding a list of prompt token-id lists; the output is one list of completion token ids
per prompt, in order. With ADAPTER_DIR (a LoRA adapter in peft's format, e.g. a LoRA run's `model/adapter`) the engine
runs MODEL_DIR, the base, with vLLM's own LoRA (`enable_lora`) and generates through `LoRARequest(ADAPTER_DIR)`, as a
user serving the adapter does. tests/test_ppo_trainer.py runs it as a subprocess, because one process cannot reliably
create a second in-process vLLM engine. The engine settings are the trainer's (DTYPE, the model's tokenizer, the
EOS token as the stop token), so the same weights must give the same greedy tokens as the trainer's eval.
"""

import json
import os
import sys

from open_instruct.data.tokenizer import load_tokenizer
from open_instruct.generation.vllm_engine import EngineConfig, create_engine, generate, sampling_params
from open_instruct.run import console


def greedy_completions(model_dir: str, prompts: list[list[int]], max_tokens: int, dtype: str,
                       adapter_dir: str | None = None) -> list[list[int]]:  # fmt: skip
    tokenizer = load_tokenizer(model_dir)
    config, adapter = EngineConfig(model_dir, max_model_len=512, dtype=dtype), None
    if adapter_dir is not None:
        from vllm.lora.request import LoRARequest

        with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
            saved = json.load(f)
        config.lora_rank, config.lora_alpha = saved["r"], saved["lora_alpha"]
        adapter = LoRARequest("saved", 1, adapter_dir)
    llm = create_engine(config)
    params = sampling_params(n=1, temperature=0.0, max_tokens=max_tokens, stop_token_ids=[tokenizer.eos_token_id])
    return [completion.token_ids for completion in generate(llm, prompts, params, adapter)]


if __name__ == "__main__":
    model_dir, prompts_path, max_tokens, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    with open(prompts_path) as f:
        prompts = json.load(f)
    completions = greedy_completions(model_dir, prompts, max_tokens, dtype, *sys.argv[5:6])
    # The result is printed; the engine's teardown at exit would take seconds (console.exit_without_teardown).
    console.exit_without_teardown(lambda: print(json.dumps(completions)))
