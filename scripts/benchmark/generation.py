"""Generation throughput: the vLLM engine the trainer uses vs Hugging Face `generate`, in one invocation.

    python scripts/benchmark/generation.py                          # embedded SmolLM2-135M, 16 prompts x 4 samples
    python scripts/benchmark/generation.py --model PATH --prompts 64 --samples 8 --max_tokens 128 --json gen.json

Both sample `--samples` responses to each of the first `--prompts` prompts of the embedded arithmetic task at
temperature 1.0, in the engine's dtype (fp32 on CPUs, bf16 on GPUs), and every response is exactly
`--max_tokens` long (vLLM: ignore_eos; HF: min_new_tokens), so both produce the same number of tokens and the
ratio is one of speed only. HF generates the whole batch at once (left-padded, KV cache on). Each side is
warmed up once, then timed (median of --repeats). Prints a table and the vLLM/HF ratio, and writes JSON.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (kernel selection, allocations)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local HF folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default="generation_benchmark.json")
    options = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from open_instruct.data.embedded import arithmetic_data_path, resolve_model_path
    from open_instruct.data.prompt_dataset import DatasetArgs, build_prompt_datasets
    from open_instruct.data.tokenizer import load_tokenizer
    from open_instruct.generation import vllm_engine

    path = resolve_model_path(options.model)
    tokenizer = load_tokenizer(path)
    dataset, _ = build_prompt_datasets(DatasetArgs(dataset_mixer_list=[arithmetic_data_path(), "1.0"]), tokenizer)
    prompts = dataset["input_ids_prompt"][: options.prompts]
    dtype = vllm_engine.engine_dtype("auto")
    tokens = len(prompts) * options.samples * options.max_tokens
    results = {"model": path, "dtype": dtype, "prompts": len(prompts), "samples": options.samples,
               "max_tokens": options.max_tokens, "tokens": tokens}  # fmt: skip
    print(f"[bench] {path} in {dtype}: {len(prompts)} prompts x {options.samples} samples x {options.max_tokens} "
          f"tokens = {tokens} tokens per generation", flush=True)  # fmt: skip

    llm = vllm_engine.create_engine(vllm_engine.EngineConfig(path, max_model_len=512, seed=0))
    params = vllm_engine.sampling_params(n=options.samples, temperature=1.0, max_tokens=options.max_tokens,
                                        stop_token_ids=[], seed=0)  # fmt: skip
    params.ignore_eos = True

    def vllm_generate() -> None:
        completions = vllm_engine.generate(llm, prompts, params)
        assert sum(len(c.token_ids) for c in completions) == tokens

    results["vllm_seconds"] = median_seconds(vllm_generate, options.repeats)
    llm = None  # frees the engine before the transformers model loads

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    width = max(len(ids) for ids in prompts)
    rows = [ids for ids in prompts for _ in range(options.samples)]
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(ids)) + ids for ids in rows], device=device)
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows], device=device)

    def hf_generate() -> None:
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0, top_p=1.0,
                top_k=0, max_new_tokens=options.max_tokens, min_new_tokens=options.max_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
        assert out.shape == (len(rows), width + options.max_tokens)

    results["hf_seconds"] = median_seconds(hf_generate, options.repeats)

    print(f"\n{'generation':<28}{'seconds':>10}{'tokens/s':>12}")
    for name, key in (("vLLM (the trainer's engine)", "vllm_seconds"), ("HF transformers generate", "hf_seconds")):
        print(f"{name:<28}{results[key]:10.2f}{tokens / results[key]:12.1f}")
    results["vllm_over_hf_tokens_per_second"] = results["hf_seconds"] / results["vllm_seconds"]
    print(f"vLLM / HF tokens per second: {results['vllm_over_hf_tokens_per_second']:.2f}x "
          f"(torch threads: {torch.get_num_threads()})")  # fmt: skip
    with open(options.json, "w") as f:
        json.dump(results, f, indent=2)
    print(f"[bench] wrote {options.json}")


if __name__ == "__main__":
    main()
