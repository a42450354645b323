"""What a slow tool call costs a batch: the engine parks the calling samples and decodes the others
(generation/engine_batches.py, environments/tool_pool.py); a parked sample comes back --tool_reentry_steps steps
after its call (the engine waits there for a call not yet back), or with 0 as soon as its call is back.

    OMP_NUM_THREADS=1 python scripts/benchmark/tool_calls_while_decoding.py [--model tiny|embedded] \
        [--samples 32] [--callers 4] [--tool_seconds 2] [--max_tokens 128] [--reentry_steps 1 32 0] [--repeats 2] \
        [--json out.json]

One batch of --samples prompts (one sample each, sampled with a fixed seed, no stop token), decoded by one in-process
vLLM engine, each --repeats times (the median wall time is reported): `no_tools`, the batch alone; then for each
--reentry_steps value N, `reentry_N_*`: the first --callers samples call a tool that takes --tool_seconds
(tests/support/tool_environments.py `SlowForSomePrompts`, at their first letter). N = 1 is the default: the engine
waits for the calls at the next step, as it did before calls were parked.

Two kinds of callers: `*_callers_end` (the answer ends the caller's response, as a sample that calls and then
answers in a few tokens: the call can be off the batch's critical path) and `*_callers_go_on` (the callers then write
up to --max_tokens like the others: the 2 s are on the batch's critical path, and parking can only save the others'
wait). The samples that do not call generate the same tokens in every run (each request is seeded by its sample).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from open_instruct.environments import tools  # noqa: E402
from open_instruct.generation import vllm_engine  # noqa: E402
from open_instruct.generation.engine_batches import EngineBatches  # noqa: E402
from tests.support.tool_environments import SlowForSomePrompts  # noqa: E402


def model_path(name: str) -> str:
    from open_instruct.data import embedded

    return embedded.tiny_model_path() if name == "tiny" else embedded.smollm2_path()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "embedded"], default="tiny")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--callers", type=int, default=4)
    parser.add_argument("--tool_seconds", type=float, default=2.0)
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--reentry_steps", type=int, nargs="+", default=[1, 32, 0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    options = parser.parse_args()

    llm = vllm_engine.create_engine(vllm_engine.EngineConfig(model_path=model_path(options.model), max_model_len=512))
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(f"Question {i}: name a city and say why it is worth a visit.", add_special_tokens=False)
               for i in range(options.samples)]  # fmt: skip
    params = dict(n=1, temperature=1.0, max_tokens=options.max_tokens, stop_token_ids=[], stop_strings=None)
    tool_settings = {"names": ["slow"], "max_calls": 1, "timeout_s": 10 * options.tool_seconds,
                     "output_max_tokens": 16, "wrapper": "{output}", "workers": 8, "max_parallel_calls": 4}  # fmt: skip

    def run(reentry_steps: int | None, callers_end: bool | None) -> dict:
        class Slow(SlowForSomePrompts):
            slow_prompts, seconds, ends_at_answer = options.callers, options.tool_seconds, bool(callers_end)

        tools.ENVIRONMENTS["slow"] = Slow
        batch_params = params if callers_end is None else {**params, "tools": {**tool_settings,
                                                                                "reentry_steps": reentry_steps}}
        batches = EngineBatches(llm)
        started = time.perf_counter()
        batches.admit(0, prompts, batch_params, sampling_seed=1)
        completions = batches.run_until_complete(0)
        seconds = time.perf_counter() - started
        calls = sum((c.tool_stats or {}).get("calls", 0) for c in completions)
        return {"seconds": seconds, "steps": batches.steps, "calls": calls,
                "tokens": [len(c.token_ids) for c in completions]}  # fmt: skip

    cases = {"no_tools": (None, None)}
    for steps in options.reentry_steps:
        for kind, callers_end in (("callers_end", True), ("callers_go_on", False)):
            cases[f"reentry_{steps}_{kind}"] = (steps, callers_end)
    run(None, None)  # warm-up: vLLM's first steps, not measured
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    for _ in range(options.repeats):  # interleaved, so that a change in the machine's load falls on all alike
        for name, (reentry_steps, callers_end) in cases.items():
            runs[name].append(run(reentry_steps, callers_end))
    baseline = statistics.median(r["seconds"] for r in runs["no_tools"])
    result = {"options": vars(options), "cases": {}}
    for name, case_runs in runs.items():
        seconds = statistics.median(r["seconds"] for r in case_runs)
        result["cases"][name] = {"median_s": round(seconds, 3), "vs_no_tools": round(seconds / baseline, 3),
                                 "runs_s": [round(r["seconds"], 3) for r in case_runs],
                                 "steps": [r["steps"] for r in case_runs], "calls": case_runs[0]["calls"],
                                 "caller_tokens": case_runs[0]["tokens"][: options.callers]}  # fmt: skip
    print(json.dumps(result, indent=2))
    if options.json:
        Path(options.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
