"""Evaluate saved models the way a user would use them: a fresh vLLM engine on each folder, verifiable prompts.

    python -m open_instruct.evaluate output/ppo_arithmetic_debug/model embedded      # trained vs base model
    python -m open_instruct.evaluate MODEL --dataset_mixer_list data/test.jsonl 1.0 --temperature 1.0 --samples 16
    python -m open_instruct.evaluate MODEL --dataset_mixer_list data/test.jsonl 1.0 --reward_function my_reward.py:fn
    python -m open_instruct.evaluate MODEL embedded --dataset_mixer_list embedded_tool_arithmetic 16 \
        --dataset_mixer_eval_list embedded_tool_arithmetic 1.0 --tools calculator --response_length 64

For each model: the greedy correct rate (one response per prompt at temperature 0) and the sampled correct rate
(`--samples` responses per prompt at `--temperature`), graded by each row's verifier, or as the trainer's reward
flags say (`--reward_function file.py:fn`, the function a run trained with). By default the prompts are
every question of the embedded arithmetic task (train and test splits together: all 81 one-digit additions), so
the trained policy is measured on the questions it trained on and on the held-out ones. Prints a table and,
with `--output_json`, writes the results.

The engine is built from the saved folder alone, in `--dtype` (auto: the learner's dtype, fp32 on CPUs), so the
numbers are those of what was saved or pushed, not of the weights a training run still holds in memory.

With `--tools` (and the trainer's other tool flags, same names and defaults) the responses are decoded as training
decodes them: each call is answered and its output appended (generation/engine_batches.py), the whole text is graded,
and `{mode}_{split}_tool_calls` reports the share of responses that called a tool at least once,
`{mode}_{split}_calls_per_answer` the calls per response and `{mode}_{split}_correct_used_tool` the share of the
correct responses that called one. `--output_json` also keeps the first few responses of each (`_examples`), to read
what the model did. Each environment
is reset with its dataset row, the row's other columns included, and `--environment_column` routes each row to its
own, as in training.
"""

import functools
import gc
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass, field, fields, make_dataclass

from open_instruct.data.batches import PromptBatch, prompt_batch
from open_instruct.data.embedded import EMBEDDED_ALIASES, resolve_dataset_name, resolve_model_path
from open_instruct.data.prompt_dataset import DatasetArgs, build_prompt_datasets
from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
from open_instruct.environments.native_tools import tool_call_format
from open_instruct.environments.routing import environment_row, environment_rows, row_environment_problem
from open_instruct.environments.tool_parsers import TAGS
from open_instruct.generation.engine_batches import generate_batch
from open_instruct.generation.eval_metrics import tool_call_rate, tool_use, verifiable_correct_rate
from open_instruct.generation.vllm_engine import EngineConfig, create_engine, generate, sampling_params
from open_instruct.rewards.manager import RewardConfig, RewardManager
from open_instruct.run import console
from open_instruct.run.args import ConfigError, FlagParser, GenerationArgs, tool_settings
from open_instruct.run.command_line import debug_requested, exit_for_config_error
from open_instruct.run.flag_combinations import validate_tool_flags
from open_instruct.run.hub import looks_like_hub_id
from open_instruct.run.hub_models import download_snapshot
from open_instruct.run.validation import as_config_errors, check_values


@dataclass
class EvalArgs:
    models: list[str] = field(
        metadata={"help": "Model folders (or 'embedded', or hub ids) to evaluate, one engine each.", "nargs": "+"}
    )
    samples: int = field(default=16, metadata={"help": "Sampled responses per prompt (0: greedy only)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature of the sampled rate."})
    response_length: int = field(default=32, metadata={"help": "Maximum new tokens per response."})
    max_model_len: int = field(default=512, metadata={"help": "vLLM max_model_len (prompt + response tokens)."})
    dtype: str = field(default="auto", metadata={"help": "Engine dtype: auto (the learner's), float32, bfloat16."})
    seed: int = field(default=0, metadata={"help": "Engine seed (the sampled responses)."})
    output_json: str | None = field(default=None, metadata={"help": "Write the results here as JSON."})


TOOL_FLAGS = ("tools", "max_tool_calls", "tool_timeout_s", "tool_output_max_tokens", "tool_output_wrapper",
              "tool_call_parser", "environment_column")
# The trainer's tool flags, taken from its GenerationArgs (one definition: same names, defaults and help).
ToolArgs = make_dataclass("ToolArgs", [
    (f.name, f.type, field(default=f.default, default_factory=f.default_factory, metadata=f.metadata))
    for f in fields(GenerationArgs) if f.name in TOOL_FLAGS
])  # fmt: skip


def eval_tool_settings(tool_args, chat_template_name: str | None = None) -> dict | None:
    """The engine's tool settings for these flags (None without --tools); a mistake is a ConfigError in one line."""
    gen = GenerationArgs(**{name: getattr(tool_args, name) for name in TOOL_FLAGS})
    check_values(gen)
    validate_tool_flags(gen)
    return tool_settings(gen, chat_template_name)


@dataclass
class EvalPrompts:
    """One named prompt set: its prompts and, with --tools, each prompt's dataset row for its environment's `reset`
    (environments/routing.py `environment_rows`: the row's extra columns too)."""

    prompts: PromptBatch
    rows: list[dict] | None


def eval_prompts(data_args: DatasetArgs, tokenizer, tools: dict | None = None) -> dict[str, EvalPrompts]:
    """Named prompt sets: the train mix of `data_args` and, when given, its eval mix as 'test'. With `tools`, each row
    keeps its other columns for its environment, as in training (a row naming no --tools entry in
    --environment_column is a ValueError in one line); with a native tool-call format (`tools["parser"]`), the prompts
    are rendered with the tools' schemas, as the trainer renders them."""
    schemas, check_row = [], None
    if tools is not None:
        schemas = tool_call_format(tools["names"], tools.get("parser", TAGS), tokenizer, data_args.chat_template_name).schemas
        if tools.get("environment_column") is not None:
            check_row = functools.partial(check_environment_value, tools)
    train, evaluation = build_prompt_datasets(data_args, tokenizer, check_row, check_row,
                                              keep_extra_columns=tools is not None, tool_schemas=schemas)  # fmt: skip
    sets = {"train": train} | ({"test": evaluation} if evaluation is not None else {})
    return {name: EvalPrompts(prompt_batch(dataset, list(range(len(dataset))), tokenizer),
                              environment_rows(dataset, list(range(len(dataset)))) if tools is not None else None)
            for name, dataset in sets.items()}  # fmt: skip


def check_environment_value(tools: dict, row: dict, where: str) -> None:
    """The environment a row names in --environment_column is one of --tools (as written)."""
    problem = row_environment_problem(environment_row(row), tools["environment_column"], list(tools["environment_names"]))
    if problem is not None:
        raise ValueError(f"{where}: {problem}")


EXAMPLES_KEPT = 4  # responses per mode and split written to --output_json, to read what the model did


def model_folder(model: str) -> str:
    """The local folder of one MODEL argument, before any engine starts: a saved folder or an embedded alias as it is,
    a hub id's snapshot (downloaded as the trainer does); anything else is a ConfigError in one line."""
    if model in EMBEDDED_ALIASES or model == "tiny" or os.path.isdir(os.path.expanduser(model)):
        return resolve_model_path(model)
    if looks_like_hub_id(model):
        return download_snapshot(model, "main", "MODEL")
    raise ConfigError(
        f"MODEL {model} is not a folder; give a saved model folder (a run's OUTPUT_DIR/model), a hub id like "
        "HuggingFaceTB/SmolLM2-135M-Instruct, or 'embedded' for the built-in SmolLM2-135M."
    )


def evaluate_model(model: str, args: EvalArgs, data_args: DatasetArgs, reward: RewardConfig | None = None,
                   tools: dict | None = None, path: str | None = None) -> dict:  # fmt: skip
    """`reward`: how responses are graded, as the trainer's flags say (`--reward_function`, ...); default: each row's
    verifier. `tools`: the engine's tool settings (eval_tool_settings), None for single-turn answers. `path`: the
    model's folder (model_folder), default: resolved here."""
    path = path or model_folder(model)
    with as_config_errors():  # the tokenizer, the prompts and their verifiers: before this model's engine loads
        tokenizer = load_tokenizer(path)
        prompt_sets = eval_prompts(data_args, tokenizer, tools)
        reward_manager = RewardManager(reward or RewardConfig())
        reward_manager.validate(prompt_sets["train"].prompts.verifier_names)
    llm = create_engine(EngineConfig(path, max_model_len=args.max_model_len, seed=args.seed, dtype=args.dtype))
    stop_token_ids = stop_token_ids_for(tokenizer, "eos")
    modes = {"greedy": (1, 0.0)} | ({"sampled": (args.samples, args.temperature)} if args.samples > 0 else {})
    result = {"model": model, "path": path}
    for mode, (n, temperature) in modes.items():
        settings = dict(n=n, temperature=temperature, max_tokens=args.response_length, stop_token_ids=stop_token_ids)
        for name, prompt_set in prompt_sets.items():
            start, prompts = time.time(), prompt_set.prompts
            if tools is None:
                completions = generate(llm, prompts.token_ids, sampling_params(**settings))
            else:  # decoded step by step, each call answered, each environment reset with its row, as in training
                completions = generate_batch(llm, prompts.token_ids, {**settings, "tools": tools}, args.seed,
                                             rows=prompt_set.rows)  # fmt: skip
            result[f"{mode}_{name}"] = verifiable_correct_rate(completions, prompts, reward_manager)
            if tools is not None:
                result[f"{mode}_{name}_tool_calls"] = tool_call_rate(completions)
                for key, value in tool_use(completions, prompts, reward_manager).items():
                    result[f"{mode}_{name}_{key}"] = value
            result[f"{mode}_{name}_responses"] = len(completions)
            result[f"{mode}_{name}_examples"] = [c.text for c in completions[:EXAMPLES_KEPT]]  # in --output_json only
            print(f"[eval] {model}: {mode} on {name} ({len(completions)} responses) in {time.time() - start:.1f}s")
        if "test" in prompt_sets:  # both splits together, from their responses: no second generation
            counts = [result[f"{mode}_{name}_responses"] for name in ("train", "test")]
            rates = [result[f"{mode}_{name}"] for name in ("train", "test")]
            result[f"{mode}_all"] = sum(c * r for c, r in zip(counts, rates)) / sum(counts)
            result[f"{mode}_all_responses"] = sum(counts)
    del llm
    gc.collect()  # one engine at a time: free this one before the next model's
    return result


def format_table(results: list[dict]) -> str:
    columns = [key for key in results[0]
               if key not in ("model", "path") and not key.endswith(("_responses", "_examples"))]  # fmt: skip
    lines = ["| model | " + " | ".join(columns) + " |", "| --- |" + " --- |" * len(columns)]
    for result in results:
        lines.append(f"| {result['model']} | " + " | ".join(f"{result[c]:.3f}" for c in columns) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    """Evaluate each model; a bad input (flags, a model that is not there, data) ends the process with one line
    `error: ...` and exit code 2 before any engine loads, as the trainers do (the traceback only with --debug)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = [word for word in argv if word != "--debug"]
    try:
        return evaluate_models(argv)
    except ConfigError as error:
        exit_for_config_error(error, debug)


def evaluate_models(argv: list[str]) -> list[dict]:
    models = list(itertools.takewhile(lambda word: not word.startswith("--"), argv))
    if models:  # `evaluate A B --flag ...`: the leading words are the models
        argv = ["--models", *models, *argv[len(models) :]]
    parser = FlagParser((EvalArgs, ToolArgs, DatasetArgs, RewardConfig))
    args, tool_args, data_args, reward = parser.parse_args_into_dataclasses(args=argv)
    tools = eval_tool_settings(tool_args, data_args.chat_template_name)
    with as_config_errors():
        folders = [model_folder(model) for model in args.models]
    if not data_args.dataset_mixer_list:  # the embedded task: both splits, i.e. every question
        from open_instruct.data.embedded import arithmetic_data_path

        data_args.dataset_mixer_list = [arithmetic_data_path(), "1.0"]
        data_args.dataset_mixer_eval_list = data_args.dataset_mixer_eval_list or [arithmetic_data_path(), "1.0"]
    for mixer in (data_args.dataset_mixer_list, data_args.dataset_mixer_eval_list):
        mixer[::2] = [resolve_dataset_name(name) for name in mixer[::2]]  # embedded_* names: the built-in tasks
    results = [evaluate_model(model, args, data_args, reward, tools, folder) for model, folder in zip(args.models, folders)]
    print(format_table(results))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    console.exit_without_teardown(main)  # the results are on disk: no slow teardown of the engines
