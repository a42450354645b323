"""How often the base model writes a well-formed calculator call at step 0, for several prompt designs: the probe behind
the tool-use demo's prompt (open_instruct/data/arithmetic_task.py, docs/tools.md "A CPU demo").

    python scripts/benchmark/tool_call_probe.py                         # every design, 16 test questions x 8 samples
    python scripts/benchmark/tool_call_probe.py --designs fewshot --questions 64 --json probe.json

Each design renders the same held-out questions of the tool-arithmetic task through the model's chat template; the real
engine (EngineBatches, as training runs it) samples at --temperature with `--tools calculator`. Per design: the share
of responses with at least one call, with a well-formed first call (answered without an error), and correct (the
arithmetic verifier on the whole text). `plain` is the arithmetic task's own prompt, also run without tools: the base
model without tools.
"""

import argparse
import json
import time

from open_instruct.data import arithmetic_task
from open_instruct.data.embedded import resolve_model_path
from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
from open_instruct.generation.engine_batches import generate_batch
from open_instruct.generation.vllm_engine import EngineConfig, create_engine
from open_instruct.rewards.verifiers import arithmetic

PROTOCOL = arithmetic_task.TOOL_SYSTEM_PROMPT
EXAMPLE = f"For example: {arithmetic_task.TOOL_EXAMPLE_QUESTION}\n{arithmetic_task.TOOL_EXAMPLE_ANSWER}"


def design_messages(design: str, question: str, a: str, op: str, b: str) -> list[dict]:
    """The prompt turns of each design (the assistant prefix of `*_prefix` designs is added after rendering)."""
    example_turn = [{"role": "user", "content": arithmetic_task.TOOL_EXAMPLE_QUESTION},
                    {"role": "assistant", "content": arithmetic_task.TOOL_EXAMPLE_ANSWER}]  # fmt: skip
    if design == "plain":
        return [{"role": "user", "content": arithmetic_task.PROMPT_TEMPLATE.format(a=a, op=op, b=b)}]
    if design == "stated":  # the protocol in words, in the user turn, no example
        return [{"role": "user", "content": f"{PROTOCOL}\n\n{question}"}]
    if design == "stated_example":  # protocol and worked example inline in the user turn
        return [{"role": "user", "content": f"{PROTOCOL}\n{EXAMPLE}\n\n{question}"}]
    if design == "fewshot_no_system":  # the worked example as a previous turn, no protocol in words
        return [*example_turn, {"role": "user", "content": question}]
    if design in ("fewshot", "fewshot_prefix"):  # the task's design: system protocol + example turn (+ prefix)
        return arithmetic_task.tool_prompt_messages(question)
    raise ValueError(f"unknown design {design!r}")


DESIGNS = ("plain", "stated", "stated_example", "fewshot_no_system", "fewshot", "fewshot_prefix")
ASSISTANT_PREFIX = "<calculator>"  # fewshot_prefix: the assistant turn opens with the call's start tag


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--designs", nargs="+", default=list(DESIGNS), choices=DESIGNS)
    parser.add_argument("--questions", type=int, default=16, help="held-out questions (the test split's first ones)")
    parser.add_argument("--samples", type=int, default=8, help="samples per question")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--response_length", type=int, default=64)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--json")
    options = parser.parse_args()
    path = resolve_model_path(options.model)
    tokenizer = load_tokenizer(path)
    rows = arithmetic_task.make_tool_arithmetic_rows()["test"][: options.questions]
    llm = create_engine(EngineConfig(path, max_model_len=512, seed=0))
    tool_settings = {"names": ["calculator"], "max_calls": 3, "timeout_s": 5.0, "output_max_tokens": 64,
                     "wrapper": "<output>{output}</output>\n"}  # fmt: skip
    results = []
    for design in options.designs:
        for with_tools in (True, False) if design == "plain" else (True,):
            prompts = []
            for row in rows:
                question = row["messages"][-1]["content"]
                a, op, b = question.removeprefix("What is ").removesuffix("?").split()
                text = tokenizer.apply_chat_template(design_messages(design, question, a, op, b), tokenize=False,
                                                     add_generation_prompt=True)  # fmt: skip
                text += ASSISTANT_PREFIX if design.endswith("_prefix") else ""
                prompts.append(tokenizer.encode(text, add_special_tokens=False))
            params = dict(n=options.samples, temperature=options.temperature, max_tokens=options.response_length,
                          stop_token_ids=stop_token_ids_for(tokenizer, "eos"),
                          tools=tool_settings if with_tools else None)  # fmt: skip
            start = time.time()
            completions = generate_batch(llm, prompts, params, sampling_seed=0)
            prefix = ASSISTANT_PREFIX if design.endswith("_prefix") else ""
            stats = [c.tool_stats or {"calls": 0, "errors": 0} for c in completions]
            result = {
                "design": design,
                "tools": with_tools,
                "responses": len(completions),
                "call_rate": sum(s["calls"] > 0 for s in stats) / len(completions),
                "well_formed_call_rate": sum(s["calls"] > 0 and s["errors"] == 0 for s in stats) / len(completions),
                "correct_rate": sum(arithmetic(prefix + c.text, rows[c.prompt_index]["ground_truth"])
                                    for c in completions) / len(completions),  # fmt: skip
                "seconds": round(time.time() - start, 1),
                "example": prefix + completions[0].text,
            }
            print(json.dumps(result), flush=True)
            results.append(result)
    print("| design | tools | call rate | well-formed | correct |\n| --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['design']} | {r['tools']} | {r['call_rate']:.3f} | {r['well_formed_call_rate']:.3f} | "
              f"{r['correct_rate']:.3f} |")  # fmt: skip
    if options.json:
        with open(options.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
