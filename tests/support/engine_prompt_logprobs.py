"""Prompt logprobs of fixed token sequences from vLLM engines, one engine after another, printed as JSON.

    python tests/support/engine_prompt_logprobs.py CASES_JSON SEQUENCES_JSON

CASES_JSON holds a list of {"name", "start", "load", "dtype", "layout"}: an engine is created from the folder `start`
in `dtype` with that CPU weight layout (plain or packed); when `load` is a folder, its weights are then sent to the engine the way the trainer sends the learner's
(`vllm_engine.load_weights` with HF-named tensors in the engine's dtype). The last stdout line is
{name: {"loads_in_place": bool, "before": logprobs, "after": logprobs}}, each [[logprob of token i given tokens < i, for i >= 1] per
sequence], before and after the weights were loaded ("after" only when something was loaded). Prompt logprobs go
through the LM head, so a head left on old weights shows up in every number. tests/test_weight_broadcast.py runs this
as a subprocess.
"""

import gc
import json
import sys

import torch
from transformers import AutoModelForCausalLM

from open_instruct.generation.vllm_engine import EngineConfig, create_engine, load_weights
from open_instruct.run import console


def prompt_logprobs(llm, sequences: list[list[int]]) -> list[list[float]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in sequences], params, use_tqdm=False)
    return [
        [step[token].logprob for step, token in zip(output.prompt_logprobs[1:], ids[1:])]
        for output, ids in zip(outputs, sequences)
    ]


def run_case(case: dict, sequences: list[list[int]]) -> dict[str, list[list[float]]]:
    config = EngineConfig(case["start"], max_model_len=256, dtype=case["dtype"], cpu_weight_layout=case["layout"])
    llm = create_engine(config)
    result = {"loads_in_place": llm.open_instruct_loads_in_place}
    result["before"] = prompt_logprobs(llm, sequences)
    if case["load"]:
        learner = AutoModelForCausalLM.from_pretrained(case["load"], dtype=getattr(torch, case["dtype"]))
        load_weights(llm, [(name, p.detach()) for name, p in learner.named_parameters()])
        result["after"] = prompt_logprobs(llm, sequences)
    del llm
    gc.collect()
    return result


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    with open(sys.argv[2]) as f:
        sequences = json.load(f)
    results = {case["name"]: run_case(case, sequences) for case in cases}
    # The result is printed; the engines' teardown at exit would take seconds (console.exit_without_teardown).
    console.exit_without_teardown(lambda: print(json.dumps(results)))
