"""A supervised warm-up before RL: teach a model a tool-call format it does not use yet, from demonstrations.

    python -m open_instruct.sft_warmup --split warmup --output_dir output/org_chart_warmup     # the org-chart task
    python -m open_instruct.sft_warmup --model_name_or_path MODEL --dataset data/train.jsonl \
        --demonstration_column demonstration --tools my_env.py:MyEnvironment --output_dir output/warmup

RL learns only from what a model already does now and then: SmolLM2-135M-Instruct makes no native tool call at all
(0 of 64 samples with the schemas, with a worked example, or with few-shot turns; docs/tools.md), so GRPO on a native
format gets no signal from it. The field's answer is a short supervised "cold start" on a few right conversations
(verl's and SkyRL's multi-turn recipes do the same), then RL. This module is that step, kept small and exact:

- Each row's `--demonstration_column` holds a whole right conversation as JSON chat messages: the prompt, assistant
  turns with `tool_calls`, `tool` results, the final answer.
- The training tokens are built the way the engine builds a rollout, not by tokenising the rendered conversation:
  the prompt rendered with the tools' schemas and tokenised as the trainer tokenises prompts, each assistant turn's
  text tokenised and ended with the stop token (what the model will sample), and each tool turn's ids exactly as the
  engine appends them (environments/chat_turns.ToolTurns.after). The loss is the cross-entropy on the assistant's
  tokens only; prompt and tool tokens are read, never trained on (as in RL, docs/tools.md "What is masked").
- The model trains in fp32 with AdamW and is saved in fp32 (what trained is what is saved) with its tokenizer, whose
  chat template becomes `--chat_template_name`'s, so the saved folder renders tools and turns as it was taught. The
  folder is written under a temporary name and renamed: a killed warm-up leaves no half-written model.

The RL run then starts from the folder (`--model_name_or_path output/org_chart_warmup`); scripts/train/debug/
grpo_native_tools.sh runs both. Bad input (no such column, a demonstration that is not a conversation, a template
without tools) is one line, exit 2, before the model loads.
"""

import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field

from open_instruct.data.chat_templates import render_prompt, resolve_chat_template
from open_instruct.data.embedded import resolve_dataset_name, resolve_model_path
from open_instruct.data.sources import read_raw_rows
from open_instruct.data.tokenizer import load_tokenizer
from open_instruct.environments.chat_turns import ToolTurns
from open_instruct.environments.native_tools import tool_schemas
from open_instruct.run import console
from open_instruct.run.args import ConfigError, FlagParser
from open_instruct.run.command_line import debug_requested, exit_for_config_error
from open_instruct.run.validation import as_config_errors


@dataclass
class WarmupArgs:
    model_name_or_path: str = field(default="embedded", metadata={"help": "the model to warm up ('embedded': SmolLM2)"})
    dataset: str = field(default="embedded_org_chart",
                         metadata={"help": "an embedded task's name, a folder with train.parquet, a .jsonl/.parquet "
                                           "file or a hub dataset"})  # fmt: skip
    split: str = field(default="train", metadata={"help": "the split whose rows hold the demonstrations"})
    demonstration_column: str = field(default="demonstration", metadata={"help": "the column of JSON conversations"})
    tools: list[str] = field(default_factory=lambda: ["org_chart"],
                             metadata={"help": "the tools or environments whose schemas the prompts show (as the RL "
                                               "run's --tools)"})  # fmt: skip
    chat_template_name: str = field(default="chatml_tools", metadata={"help": "the template the RL run will use"})
    examples: int = field(default=128, metadata={"help": "demonstrations to train on (the dataset's first ones)"})
    epochs: int = 1
    batch_size: int = 8
    learning_rate: float = 1.0e-4
    seed: int = 1
    output_dir: str = field(default="output/sft_warmup", metadata={"help": "the saved model folder"})


@dataclass
class Example:
    """One demonstration as token ids, and which of them the model is trained to produce."""

    token_ids: list[int]
    trained: list[bool]


def assistant_text(message: dict, history: list[dict], turns: ToolTurns) -> str:
    """What the model writes for an assistant message: the template's rendering of it after `history`, without the
    turn end that follows any assistant content (ChatML's "<|im_end|>\\n")."""
    before = turns.render(history, add_generation_prompt=True)
    through = turns.render([*history, message], add_generation_prompt=False)
    if not through.startswith(before) or not through.endswith(turns.turn_end):
        raise ValueError("the chat template does not render the demonstration turn by turn (each turn must extend the "
                         "conversation before it); give --chat_template_name chatml_tools or a template that does")  # fmt: skip
    return through[len(before) : len(through) - len(turns.turn_end)]


def demonstration_example(messages: list[dict], tokenizer, turns: ToolTurns, stop_id: int) -> Example:
    """The token ids of a conversation as the engine would hold them after sampling its assistant turns: the
    prompt (the messages before the first assistant turn), then per assistant turn its text and the stop token
    (trained), then the tool turns that answer it (ToolTurns.after, not trained)."""
    first = next((i for i, message in enumerate(messages) if message.get("role") == "assistant"), None)
    if first is None or first == 0:
        raise ValueError("a demonstration must start with the prompt's messages and hold at least one assistant turn")
    prompt = render_prompt(messages[:first], tokenizer, turns.chat_template, turns.schemas)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    trained = [False] * len(ids)
    i, stop_text = first, tokenizer.decode([stop_id])
    while i < len(messages):
        message = messages[i]
        if message.get("role") != "assistant":
            raise ValueError(f"message {i} of a demonstration is a {message.get('role')!r} turn where an assistant "
                             f"turn was expected (tool turns follow an assistant turn with tool_calls)")  # fmt: skip
        text = assistant_text(message, messages[:i], turns)
        sampled = tokenizer.encode(text, add_special_tokens=False) + [stop_id]
        ids, trained = ids + sampled, trained + [True] * len(sampled)
        results = []
        i += 1
        while i < len(messages) and messages[i].get("role") == "tool":
            results.append((messages[i].get("name", ""), str(messages[i]["content"])))
            i += 1
        if results:
            observation = turns.after(text + stop_text, results)
            ids, trained = ids + observation, trained + [False] * len(observation)
        elif i < len(messages):
            raise ValueError(f"message {i} of a demonstration follows an assistant turn without tool results")
    return Example(ids, trained)


def load_demonstrations(args: WarmupArgs) -> list[list[dict]]:
    """The first `--examples` demonstrations of the dataset's `--split` (one line for each problem)."""
    try:
        rows = read_raw_rows(resolve_dataset_name(args.dataset), args.split)
    except (OSError, ValueError) as error:
        raise ValueError(f"--dataset {args.dataset} --split {args.split}: {error}") from error
    columns = list(rows[0]) if rows else []
    if args.demonstration_column not in columns:
        raise ValueError(f"--demonstration_column {args.demonstration_column}: {args.dataset} has no such column "
                         f"(it has {', '.join(columns)})")  # fmt: skip
    if args.examples < 1 or args.examples > len(rows):
        raise ValueError(f"--examples {args.examples}: give 1 to {len(rows)} (the rows of {args.dataset})")
    conversations = []
    for index, value in enumerate(row[args.demonstration_column] for row in rows[: args.examples]):
        conversation = json.loads(value) if isinstance(value, str) else value
        if not isinstance(conversation, list) or not all(isinstance(m, dict) and "role" in m for m in conversation):
            raise ValueError(f"--demonstration_column {args.demonstration_column}: row {index} is not a list of chat "
                             f"messages (JSON objects with a role)")  # fmt: skip
        conversations.append(conversation)
    return conversations


def check_calls(conversations: list[list[dict]], schemas: list[dict], tool_names: list[str]) -> None:
    """Every call in the demonstrations names a function the tools offer: the prompts show only those."""
    offered = {schema["function"]["name"] for schema in schemas}
    for index, conversation in enumerate(conversations):
        for message in conversation:
            for call in message.get("tool_calls") or []:
                name = (call.get("function") or call).get("name")
                if name not in offered:
                    raise ValueError(f"demonstration {index} calls {name!r}, which --tools {' '.join(tool_names)} does "
                                     f"not offer (it offers {', '.join(sorted(offered)) or 'none'}); give the tools "
                                     f"the RL run will use")  # fmt: skip


def check_args(args: WarmupArgs) -> None:
    for name in ("examples", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} {getattr(args, name)}: give a positive number")
    if not (0 < args.learning_rate < 1):
        raise ValueError(f"--learning_rate {args.learning_rate}: give a rate between 0 and 1, e.g. 1e-4")
    parent = os.path.dirname(os.path.abspath(args.output_dir))
    if os.path.exists(parent) and not os.access(parent, os.W_OK):
        raise ValueError(f"--output_dir {args.output_dir}: {parent} is not writable; choose another folder")


def batches(examples: list[Example], batch_size: int, epochs: int, seed: int) -> list[list[Example]]:
    """The examples in `batch_size` groups, reshuffled each epoch (the last group of an epoch may be smaller)."""
    rng, out = random.Random(seed), []
    for _ in range(epochs):
        order = list(examples)
        rng.shuffle(order)
        out += [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    return out


def batch_loss(model, batch: list[Example], pad_id: int):
    """Mean cross-entropy over the batch's trained tokens (each token counts once, however long its example). The
    vocabulary head runs only where a trained token is predicted, not over every position."""
    import torch

    width = max(len(example.token_ids) for example in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    targets = torch.zeros((len(batch), width), dtype=torch.bool)
    for row, example in enumerate(batch):
        ids[row, : len(example.token_ids)] = torch.tensor(example.token_ids)
        mask[row, : len(example.token_ids)] = 1
        targets[row, : len(example.trained)] = torch.tensor(example.trained)
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    predicting = targets[:, 1:]  # position t predicts token t + 1
    logits = model.lm_head(hidden[:, :-1][predicting]).float()
    return torch.nn.functional.cross_entropy(logits, ids[:, 1:][predicting])


def save_atomically(model, tokenizer, chat_template: str, output_dir: str, record: dict) -> None:
    staging = f"{output_dir.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(staging)
    with open(os.path.join(staging, "sft_warmup.json"), "w") as f:
        json.dump(record, f, indent=2)
    if os.path.exists(output_dir):
        shutil.rmtree(output_dir)
    os.replace(staging, output_dir)


def warm_up(args: WarmupArgs) -> dict:
    with as_config_errors():
        check_args(args)
        conversations = load_demonstrations(args)
        model_path = resolve_model_path(args.model_name_or_path)
        tokenizer = load_tokenizer(model_path)
        template_name, chat_template = resolve_chat_template(tokenizer, args.chat_template_name)
        turns = ToolTurns(tokenizer, chat_template, tool_schemas(args.tools))
        check_calls(conversations, turns.schemas, args.tools)
        examples = [demonstration_example(c, tokenizer, turns, tokenizer.eos_token_id) for c in conversations]
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    schedule = batches(examples, args.batch_size, args.epochs, args.seed)
    trained_tokens = sum(sum(e.trained) for e in examples)
    console.say(f"[sft_warmup] {len(examples)} demonstrations ({trained_tokens} trained tokens of "
                f"{sum(len(e.token_ids) for e in examples)}), {len(schedule)} steps, template {template_name}")  # fmt: skip
    start, losses = time.time(), []
    for step, batch in enumerate(schedule, start=1):
        loss = batch_loss(model, batch, tokenizer.pad_token_id)
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"the warm-up loss is {loss.item()} at step {step}; lower --learning_rate")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(round(loss.item(), 4))
        console.say(f"[sft_warmup] step {step}/{len(schedule)} loss {loss.item():.4f} ({time.time() - start:.0f} s)")
    model.eval()
    record = {"args": vars(args), "losses": losses, "seconds": round(time.time() - start, 1),
              "chat_template_name": template_name, "trained_tokens": trained_tokens}  # fmt: skip
    save_atomically(model, tokenizer, chat_template, args.output_dir, record)
    console.say(f"[sft_warmup] saved {args.output_dir} (loss {losses[0]} -> {losses[-1]}, {record['seconds']} s)")
    return record


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = [word for word in argv if word != "--debug"]
    try:
        with as_config_errors():
            args = WarmupArgs(**vars(FlagParser((WarmupArgs,)).parse_args(argv)))  # a stray flag: argparse's error
        library_log = f"{os.path.abspath(args.output_dir).rstrip('/')}-libraries.log"  # the libraries' own output
        with console.library_output_to(library_log, verbose=debug, discard_on=ConfigError):
            return warm_up(args)
    except ConfigError as error:
        exit_for_config_error(error, debug)


if __name__ == "__main__":
    main()
