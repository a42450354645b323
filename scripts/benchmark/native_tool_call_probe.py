"""How often a model calls the calculator at step 0 in the native format: the `chatml_tools` template showing the
calculator's JSON schema, calls read by vLLM's hermes parser (docs/tools.md "Native tool calls").

    python scripts/benchmark/native_tool_call_probe.py --json probe.json      # 16 test questions x 4 samples per design

The questions are the embedded tool-arithmetic task's test split (data.embedded.tool_arithmetic_data_path), the last
user turn of each row, without the task's tag protocol. Designs: `schemas` (the template's own system turn with the
schema, then the question) and `schemas_example` (the same, with one worked example of a call and its answer in the
system prompt), and `fewshot` (the example as earlier turns: its call, the tool turn and the answer, rendered by
the template). The real engine (EngineBatches, as training runs it) samples at --temperature with `--tools
calculator --tool_call_parser hermes --chat_template_name chatml_tools`. Per design: the share of responses with a
call attempt, with well-formed calls only (answered without an error), and correct (the arithmetic verifier).
"""

import argparse
import json
import time

import datasets

from open_instruct.data.chat_templates import render_prompt, resolve_chat_template
from open_instruct.data.embedded import resolve_model_path, tool_arithmetic_data_path
from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
from open_instruct.environments.tool_schemas import tool_schema
from open_instruct.environments.tools import Calculator
from open_instruct.generation.engine_batches import generate_batch
from open_instruct.generation.vllm_engine import EngineConfig, create_engine
from open_instruct.rewards.verifiers import arithmetic

EXAMPLE = (
    "You are a helpful assistant. Use the calculator for arithmetic, then finish with: The answer is <number>.\n\n"
    "Example:\nuser: What is 4821 + 3907?\nassistant: <tool_call>\n"
    '{"name": "calculator", "arguments": {"expression": "4821 + 3907"}}\n</tool_call>\n'
    "tool: 8728\nassistant: The answer is 8728."
)
DESIGNS = ("schemas", "schemas_example", "fewshot")
# fewshot: the worked example as earlier turns of the conversation, its call and result rendered by the template.
EXAMPLE_TURNS = [
    {"role": "user", "content": "What is 4821 + 3907?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "calculator", "arguments": {"expression": "4821 + 3907"}}}]},
    {"role": "tool", "name": "calculator", "content": "8728"},
    {"role": "assistant", "content": "The answer is 8728."},
]  # fmt: skip


def design_messages(design: str, question: str) -> list[dict]:
    if design == "schemas":
        return [{"role": "user", "content": question}]
    if design == "fewshot":
        return [*EXAMPLE_TURNS, {"role": "user", "content": question}]
    return [{"role": "system", "content": EXAMPLE}, {"role": "user", "content": question}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--designs", nargs="+", default=list(DESIGNS), choices=DESIGNS)
    parser.add_argument("--questions", type=int, default=16, help="held-out questions (the test split's first ones)")
    parser.add_argument("--samples", type=int, default=4, help="samples per question")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--response_length", type=int, default=128)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--json")
    options = parser.parse_args()
    path = resolve_model_path(options.model)
    tokenizer = load_tokenizer(path)
    _, template = resolve_chat_template(tokenizer, "chatml_tools")
    schemas = [tool_schema(Calculator)]
    rows = datasets.load_dataset("parquet", data_files=f"{tool_arithmetic_data_path()}/test.parquet", split="train")
    rows = rows.select(range(options.questions))
    llm = create_engine(EngineConfig(path, max_model_len=1024, seed=0))
    tool_settings = {"names": ["calculator"], "max_calls": 3, "timeout_s": 5.0, "output_max_tokens": 64,
                     "wrapper": "<output>{output}</output>\n", "parser": "hermes",
                     "chat_template_name": "chatml_tools"}  # fmt: skip
    results = []
    for design in options.designs:
        prompts = [tokenizer.encode(render_prompt(design_messages(design, row["messages"][-1]["content"]), tokenizer,
                                                  template, schemas), add_special_tokens=False)
                   for row in rows]  # fmt: skip
        params = dict(n=options.samples, temperature=options.temperature, max_tokens=options.response_length,
                      stop_token_ids=stop_token_ids_for(tokenizer, "eos"), tools=tool_settings)  # fmt: skip
        start = time.time()
        completions = generate_batch(llm, prompts, params, sampling_seed=0)
        stats = [c.tool_stats or {"calls": 0, "errors": 0} for c in completions]
        result = {
            "design": design,
            "responses": len(completions),
            "prompt_tokens": len(prompts[0]),
            "call_rate": sum(s["calls"] > 0 for s in stats) / len(completions),
            "well_formed_call_rate": sum(s["calls"] > 0 and s["errors"] == 0 for s in stats) / len(completions),
            "correct_rate": sum(arithmetic(c.text, rows[c.prompt_index]["ground_truth"])
                                for c in completions) / len(completions),  # fmt: skip
            "seconds": round(time.time() - start, 1),
            "examples": [c.text for c in completions[:3]],
        }
        print(json.dumps(result), flush=True)
        results.append(result)
    print("| design | responses | call rate | well-formed | correct |\n| --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['design']} | {r['responses']} | {r['call_rate']:.3f} | {r['well_formed_call_rate']:.3f} | "
              f"{r['correct_rate']:.3f} |")  # fmt: skip
    if options.json:
        with open(options.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
