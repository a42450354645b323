"""Prompt data for RL: read sources, mix them, normalise rows, render chat templates, tokenise.

The pipeline, in order (`build_prompt_datasets` runs it for the train and the eval mix):
1. Sources. Each mixer entry names a local `.parquet` / `.jsonl` / `.json` file, a local folder of
   them, or (when no such path exists) a hub dataset loaded with `datasets.load_dataset(name, split=...)`.
   Split rule for local data:
   - a single file holds its own data for any split name (a file is one split);
   - a folder is "split" when some data file in it names a split: its stem is the split or starts with
     `<split>-` / `<split>_` (`train.parquet`, `train-00000-of-00001.parquet`), or a sub-folder is named
     after it (`train/0000.parquet`). A split folder serves the files of the requested split (other files
     are ignored); asking for a split it does not hold is an error naming the splits it has;
   - a folder where no file names a split is, like a single file, its own data for any split.
2. Mixer. `["a.parquet", "0.5", "b/", "100"]`: a value with "." is a fraction of the source's rows
   (floor of fraction x rows, computed exactly), otherwise a row count; rows are drawn without
   repetition, so a count larger than the source is an error. The mix is shuffled with the seed.
3. Rows. Three row schemas are detected row by row and normalised to the columns in
   `PROMPT_COLUMNS`: `messages` (the prompt turns), `ground_truth`, `dataset` (verifier name), `source`.
   - RLVR: `messages`, `ground_truth`, `dataset`; a final assistant turn is dropped (it is the answer).
   - verl: `prompt` (chat list), `data_source`, `reward_model: {ground_truth, style}`; `extra_info` ignored.
   - plain: `prompt` as a string (becomes one user turn); `ground_truth` / `dataset` optional.
   Precedence when a row mixes them: `messages` over `prompt`, `reward_model.ground_truth` over
   `ground_truth`, `data_source` over `dataset`. A ground truth number becomes its text (72.0 -> "72"),
   a list its first element.
4. Tokens. Prompts are rendered with a chat template (see `chat_templates`), tokenised once (cached on
   disk when a cache folder is given), and prompts longer than `max_prompt_token_length` are dropped
   and counted, never truncated: a truncated question has a different answer.
"""

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from open_instruct.chat_templates import render_prompt, resolve_chat_template

if TYPE_CHECKING:  # only for annotations: the converters need no transformers import
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DATA_FILE_SUFFIXES = (".parquet", ".jsonl", ".json")
KNOWN_SPLIT_NAMES = ("train", "test", "validation", "valid", "dev", "eval")
ALLOWED_ROLES = ("system", "user", "assistant", "tool")
PROMPT_COLUMNS = ("messages", "ground_truth", "dataset", "source")
PROMPT_FEATURES = datasets.Features(
    {
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "ground_truth": datasets.Value("string"),
        "dataset": datasets.Value("string"),
        "source": datasets.Value("string"),
    }
)
INPUT_IDS_PROMPT_KEY = "input_ids_prompt"
# Bump when the cached layout or the tokenisation rules change, so old caches are not reused.
TOKENIZATION_CACHE_VERSION = 1
CACHE_REPORT_FILE = "tokenization_report.json"


@dataclass
class DatasetArgs:
    dataset_mixer_list: list[str] = field(
        default_factory=list,
        metadata={"help": "Sources and amounts, alternating: `name_or_path frac_or_count ...` (e.g. `a.parquet 1.0`)."},
    )
    dataset_mixer_list_splits: list[str] = field(
        default_factory=lambda: ["train"],
        metadata={"help": "One split for every training source, or one split per source."},
    )
    dataset_mixer_eval_list: list[str] = field(
        default_factory=list,
        metadata={"help": "Eval sources and amounts, same syntax as dataset_mixer_list; empty means no eval set."},
    )
    dataset_mixer_eval_list_splits: list[str] = field(
        default_factory=lambda: ["test"],
        metadata={"help": "One split for every eval source, or one split per eval source."},
    )
    max_prompt_token_length: int = field(
        default=256,
        metadata={"help": "Prompts with more tokens than this (after the chat template) are dropped and counted."},
    )
    chat_template_name: str | None = field(
        default=None,
        metadata={"help": "A named chat template (tulu, simple_concat, plain, chatml); unset: the tokenizer's own."},
    )
    dataset_cache_dir: str | None = field(
        default=None,
        metadata={"help": "Folder for the tokenised-prompt cache; unset: tokenise every run, cache nothing."},
    )
    dataset_seed: int = field(
        default=42,
        metadata={"help": "Seed for drawing and shuffling the mixed rows."},
    )


# ---- Sources: files, folders, hub names ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _SourcePart:
    """One file (or one hub split) of a source; `rows` is whatever reads rows by index cheaply."""

    where: str  # the file path or "hub name (split S)", for messages
    rows: pa.Table | datasets.Dataset | list[dict]


def _split_named_by(relative_path: Path, split_names: tuple[str, ...]) -> str | None:
    """The split a data file belongs to by its stem or a parent folder's name, or None."""
    for name in split_names:
        if relative_path.stem == name or relative_path.stem.startswith((f"{name}-", f"{name}_")):
            return name
        if name in relative_path.parent.parts:
            return name
    return None


def resolve_data_files(path: str | os.PathLike, split: str) -> list[Path]:
    """The local data files that hold `split` of the file or folder `path` (the split rule is in the module doc)."""
    path = Path(path)
    if path.is_file():
        if path.suffix not in DATA_FILE_SUFFIXES:
            raise ValueError(f"Dataset file {path} has suffix {path.suffix!r}; expected one of {DATA_FILE_SUFFIXES}.")
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"Dataset path {path} does not exist; check the path (relative to {Path.cwd()}).")
    files = sorted(
        file
        for file in path.rglob("*")
        if file.is_file()
        and file.suffix in DATA_FILE_SUFFIXES
        and not any(part.startswith(".") for part in file.relative_to(path).parts)
    )
    if not files:
        raise FileNotFoundError(f"Dataset folder {path} holds no {'/'.join(DATA_FILE_SUFFIXES)} files.")
    split_names = tuple(dict.fromkeys((split, *KNOWN_SPLIT_NAMES)))
    split_of_file = {file: _split_named_by(file.relative_to(path), split_names) for file in files}
    if all(file_split is None for file_split in split_of_file.values()):
        return files
    chosen = [file for file, file_split in split_of_file.items() if file_split == split]
    if not chosen:
        held = sorted({file_split for file_split in split_of_file.values() if file_split is not None})
        raise ValueError(
            f"Dataset folder {path} holds the splits {held} but not {split!r}; "
            f"ask for one of them in the dataset_mixer_*_splits argument."
        )
    return chosen


def _read_json_rows(path: Path) -> list[dict]:
    """Rows of a JSON Lines file, or of a .json file holding one array of objects."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line_number = data[: error.start].count(b"\n") + 1
        raise ValueError(
            f"Dataset file {path} line {line_number} is not valid UTF-8 ({error.reason} at byte {error.start}); "
            f"re-save the file as UTF-8."
        ) from None
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"Dataset file {path} is not valid JSON ({error}); fix the file.") from None
    else:
        rows = []
        for line_number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"Dataset file {path} line {line_number} is not valid JSON ({error}); "
                    f"each line must hold one JSON object."
                ) from None
    for row_index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(
                f"Dataset file {path} row {row_index} is a {type(row).__name__}, expected a JSON object "
                f"with a `messages` or `prompt` field."
            )
    return rows


def _open_source(name: str, split: str) -> list[_SourcePart]:
    """Open a mixer source: local file/folder by path, else a hub dataset name."""
    path = Path(name).expanduser()
    if path.exists():
        return [
            _SourcePart(str(file), pq.read_table(file) if file.suffix == ".parquet" else _read_json_rows(file))
            for file in resolve_data_files(path, split)
        ]
    if path.suffix in DATA_FILE_SUFFIXES or name.startswith(("/", "./", "../", "~")):
        raise FileNotFoundError(f"Dataset path {name} does not exist; check the path (relative to {Path.cwd()}).")
    try:
        hub_dataset = datasets.load_dataset(name, split=split)
    except Exception as error:
        error.add_note(f"{name!r} is not a local file or folder, so it was loaded as a hub dataset name.")
        raise
    return [_SourcePart(f"{name} (split {split})", hub_dataset)]


def _num_rows(part: _SourcePart) -> int:
    return len(part.rows) if not isinstance(part.rows, pa.Table) else part.rows.num_rows


def _take_rows(part: _SourcePart, indices: list[int]) -> list[dict]:
    if isinstance(part.rows, pa.Table):
        return part.rows.take(pa.array(indices, type=pa.int64())).to_pylist()  # typed: [] is valid too
    if isinstance(part.rows, datasets.Dataset):
        return part.rows.select(indices).to_list()
    return [part.rows[index] for index in indices]


def read_raw_rows(name: str, split: str, max_rows: int | None = None) -> list[dict]:
    """The first `max_rows` rows (all when None) of a source, unnormalised; for converters and debugging."""
    rows = []
    for part in _open_source(name, split):
        wanted = _num_rows(part) if max_rows is None else min(_num_rows(part), max_rows - len(rows))
        rows.extend(_take_rows(part, list(range(wanted))))
    return rows


# ---- Rows: three schemas -> one normalised prompt row ----------------------------------------------------------------


def _validated_messages(messages: object, where: str, field_name: str) -> list[dict]:
    """Check a chat list and keep only role and content of each turn."""
    if not isinstance(messages, list):
        raise ValueError(
            f"{where}: `{field_name}` is a {type(messages).__name__}, expected a list of "
            f'{{"role", "content"}} messages; fix the row.'
        )
    if not messages:
        raise ValueError(f"{where}: `{field_name}` is an empty list; a prompt needs at least one message.")
    checked = []
    for turn_index, message in enumerate(messages):
        turn = f"{where}: `{field_name}[{turn_index}]`"
        if not isinstance(message, dict):
            raise ValueError(f'{turn} is a {type(message).__name__}, expected a {{"role", "content"}} dict.')
        role, content = message.get("role"), message.get("content")
        if role not in ALLOWED_ROLES:
            raise ValueError(
                f"{turn} has role {role!r}, expected one of {list(ALLOWED_ROLES)}; "
                f"rename the role (e.g. 'human' -> 'user', 'gpt' -> 'assistant')."
            )
        if not isinstance(content, str):
            raise ValueError(f"{turn} has content of type {type(content).__name__}, expected a string.")
        checked.append({"role": role, "content": content})
    return checked


def _prompt_messages(row: dict, where: str) -> list[dict]:
    """The prompt turns of a row: `messages` minus a final assistant answer, or `prompt` (str or chat list)."""
    if row.get("messages") is not None:
        messages = _validated_messages(row["messages"], where, "messages")
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]  # the reference answer, not part of the prompt
        if not messages:
            raise ValueError(
                f"{where}: `messages` holds only an assistant turn; a prompt needs a user (or system) message."
            )
        return messages
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list):
        return _validated_messages(prompt, where, "prompt")
    if "prompt" in row:
        raise ValueError(
            f"{where}: `prompt` is a {type(prompt).__name__}, expected a string or a list of "
            f'{{"role", "content"}} messages.'
        )
    raise ValueError(
        f"{where} has no prompt field: expected `messages` (a chat list) or `prompt` (a string or chat list), "
        f"found fields {sorted(row)}; convert the data with a script in scripts/data_preprocess/."
    )


def _ground_truth_text(value: object, where: str) -> str | None:
    """Ground truth as text: numbers become their text (72.0 -> "72"), a list its first element."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        return _ground_truth_text(value[0], where) if value else None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, int | float):
        return str(value)
    raise ValueError(
        f"{where}: the ground truth is a {type(value).__name__} ({value!r}), expected a string, number or list; "
        f"store it as a string (JSON-encode structured answers)."
    )


def normalise_row(row: dict, where: str, source: str) -> dict:
    """One raw row in any of the three schemas -> {messages, ground_truth, dataset, source}."""
    reward_model = row.get("reward_model")
    if reward_model is not None and not isinstance(reward_model, dict):
        raise ValueError(
            f"{where}: `reward_model` is a {type(reward_model).__name__}, expected a dict with `ground_truth`."
        )
    ground_truth = reward_model.get("ground_truth") if reward_model is not None else row.get("ground_truth")
    verifier = row["data_source"] if row.get("data_source") is not None else row.get("dataset")
    if verifier is not None and not isinstance(verifier, str):
        raise ValueError(f"{where}: the verifier name `dataset`/`data_source` is {verifier!r}, expected a string.")
    return {
        "messages": _prompt_messages(row, where),
        "ground_truth": _ground_truth_text(ground_truth, where),
        "dataset": verifier,
        "source": source,
    }


# ---- Mixer -----------------------------------------------------------------------------------------------------------


def parse_mixer_list(mixer_list: list[str], argument: str = "dataset_mixer_list") -> list[tuple[str, str]]:
    """`["a", "0.5", "b", "10"]` -> `[("a", "0.5"), ("b", "10")]`."""
    values = [str(value) for value in mixer_list]
    if not values:
        raise ValueError(f"{argument} is empty; give at least one source and amount, e.g. `data/train.parquet 1.0`.")
    if len(values) % 2:
        raise ValueError(
            f"{argument} has an odd number of values ({len(values)}: {values}); it must alternate source and "
            f"amount, e.g. `a.parquet 1.0 b.jsonl 500`; add the missing amount."
        )
    return list(zip(values[0::2], values[1::2]))


def splits_per_source(splits: list[str], num_sources: int, argument: str = "dataset_mixer_list_splits") -> list[str]:
    """One split for all sources, or one per source."""
    if len(splits) == 1:
        return list(splits) * num_sources
    if len(splits) != num_sources:
        raise ValueError(
            f"{argument} has {len(splits)} splits ({list(splits)}) for {num_sources} sources; "
            f"give one split for all sources or exactly one per source."
        )
    return list(splits)


def rows_to_take(amount: str, num_rows: int, source: str) -> int:
    """How many rows an amount asks for: "0.5" is a fraction of `num_rows` (floored), "100" a count."""
    if "." in amount:
        try:
            fraction = Fraction(amount)
        except ValueError:
            message = f"Mixer amount {amount!r} for {source} is not a number; use a fraction like 0.5."
            raise ValueError(message) from None
        if not 0 <= fraction <= 1:
            raise ValueError(
                f"Mixer fraction {amount} for {source} is outside [0, 1]; use at most 1.0 (all {num_rows} rows) "
                f"or an integer row count."
            )
        return int(fraction * num_rows)  # exact: Fraction avoids 0.29 * 100 == 28.999...
    try:
        count = int(amount)
    except ValueError:
        raise ValueError(
            f"Mixer amount {amount!r} for {source} is neither a fraction (with a '.', e.g. 0.5) nor an integer count."
        ) from None
    if count < 0 or count > num_rows:
        raise ValueError(
            f"Mixer count {count} for {source} is outside [0, {num_rows}] (the source has {num_rows} rows); "
            f"ask for at most {num_rows} rows or use a fraction such as 1.0."
        )
    return count


def load_prompt_dataset(
    mixer_list: list[str], splits: list[str], seed: int, check_row: Callable[[dict, str], None] | None = None
) -> datasets.Dataset:
    """Read, draw, normalise and shuffle the mixed sources into one dataset with `PROMPT_COLUMNS`.

    `check_row(row, where)` sees every normalised row that was drawn, with its file and row number, and may raise.
    """
    entries = parse_mixer_list(mixer_list)
    rng = np.random.default_rng(seed)
    rows = []
    for (name, amount), split in zip(entries, splits_per_source(splits, len(entries))):
        source = f"{name}:{split}"
        parts = _open_source(name, split)
        part_sizes = [_num_rows(part) for part in parts]
        num_rows = sum(part_sizes)
        if num_rows == 0:
            raise ValueError(f"Dataset source {source} has no rows ({', '.join(p.where for p in parts)}).")
        chosen = np.sort(rng.choice(num_rows, size=rows_to_take(amount, num_rows, source), replace=False))
        part_starts = np.cumsum([0, *part_sizes])
        for part, start, end in zip(parts, part_starts[:-1], part_starts[1:]):
            local_indices = (chosen[(chosen >= start) & (chosen < end)] - start).tolist()
            for raw, index in zip(_take_rows(part, local_indices), local_indices):
                where = f"{part.where} row {index}"
                rows.append(normalise_row(raw, where, source))
                if check_row is not None:
                    check_row(rows[-1], where)
    if not rows:
        raise ValueError(f"The mixer {mixer_list} selected no rows; raise the amounts.")
    shuffled_rows = [rows[index] for index in rng.permutation(len(rows))]
    return datasets.Dataset.from_list(shuffled_rows, features=PROMPT_FEATURES)


# ---- Tokenisation, length filter, cache ------------------------------------------------------------------------------


def _tokenization_cache_key(
    dataset: datasets.Dataset, tokenizer: "PreTrainedTokenizerBase", chat_template: str, max_prompt_token_length: int
) -> str:
    """Hash of everything the tokenised output depends on: the rows, the vocabulary, the template, the limit."""
    hasher = hashlib.sha256()
    table = dataset.with_format("arrow")[:]  # respects any select/shuffle done on `dataset`
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    hasher.update(sink.getvalue().to_pybytes())
    vocabulary = sorted(tokenizer.get_vocab().items())
    settings = [TOKENIZATION_CACHE_VERSION, type(tokenizer).__name__, vocabulary, chat_template]
    hasher.update(json.dumps([*settings, max_prompt_token_length]).encode())
    return hasher.hexdigest()[:20]


def _log_report(report: dict) -> None:
    logger.info(
        f"Prompts: kept {report['num_rows_kept']} of {report['num_rows_in']}, dropped {report['num_dropped_too_long']} "
        f"longer than max_prompt_token_length={report['max_prompt_token_length']} tokens "
        f"(longest kept {report['max_prompt_len']}, longest seen {report['longest_prompt_len']}; "
        f"template {report['chat_template']}; {'from cache' if report['loaded_from_cache'] else 'tokenised'})."
    )


def tokenize_prompt_dataset(
    dataset: datasets.Dataset,
    tokenizer: "PreTrainedTokenizerBase",
    max_prompt_token_length: int,
    chat_template_name: str | None = None,
    cache_dir: str | None = None,
) -> tuple[datasets.Dataset, dict]:
    """Add `input_ids_prompt` (chat template + generation prompt) and drop prompts over the limit.

    Returns the kept rows and a report: num_rows_in, num_rows_kept, num_dropped_too_long, max_prompt_len
    (longest kept), longest_prompt_len (longest seen), max_prompt_token_length, chat_template,
    cache_path (None without a cache_dir) and loaded_from_cache.
    """
    if len(dataset) == 0:
        raise ValueError("The prompt dataset is empty; check the mixer sources and amounts.")
    template_label, chat_template = resolve_chat_template(tokenizer, chat_template_name)
    cache_path = None
    if cache_dir is not None:
        key = _tokenization_cache_key(dataset, tokenizer, chat_template, max_prompt_token_length)
        cache_path = Path(cache_dir) / f"prompts_{key}"
        if (cache_path / CACHE_REPORT_FILE).exists():
            report = json.loads((cache_path / CACHE_REPORT_FILE).read_text()) | {"loaded_from_cache": True}
            _log_report(report)
            return datasets.load_from_disk(str(cache_path)), report

    texts = [render_prompt(messages, tokenizer, chat_template) for messages in dataset["messages"]]
    input_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    lengths = [len(ids) for ids in input_ids]
    kept_indices = [index for index, length in enumerate(lengths) if length <= max_prompt_token_length]
    if not kept_indices:
        raise ValueError(
            f"All {len(lengths)} prompts are longer than max_prompt_token_length={max_prompt_token_length} tokens "
            f"(shortest {min(lengths)}, longest {max(lengths)}); raise --max_prompt_token_length to at least "
            f"{min(lengths)}."
        )
    tokenized = dataset.add_column(
        INPUT_IDS_PROMPT_KEY, input_ids, feature=datasets.List(datasets.Value("int32"))
    ).select(kept_indices)
    report = {
        "num_rows_in": len(lengths),
        "num_rows_kept": len(kept_indices),
        "num_dropped_too_long": len(lengths) - len(kept_indices),
        "max_prompt_len": max(lengths[index] for index in kept_indices),
        "longest_prompt_len": max(lengths),
        "max_prompt_token_length": max_prompt_token_length,
        "chat_template": template_label,
        "cache_path": None if cache_path is None else str(cache_path),
        "loaded_from_cache": False,
    }
    if cache_path is not None:
        tokenized = _save_to_cache(tokenized.flatten_indices(), report, cache_path)
    _log_report(report)
    return tokenized, report


def _save_to_cache(tokenized: datasets.Dataset, report: dict, cache_path: Path) -> datasets.Dataset:
    """Write to a temporary folder, then rename: a crash or a parallel run never leaves half a cache."""
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{cache_path.name}.", dir=cache_path.parent))
    tokenized.save_to_disk(str(staging))
    (staging / CACHE_REPORT_FILE).write_text(json.dumps(report, indent=2))
    try:
        staging.rename(cache_path)
    except OSError:  # another process wrote the same key first; its copy is identical
        shutil.rmtree(staging, ignore_errors=True)
    return datasets.load_from_disk(str(cache_path))


def build_prompt_datasets(
    args: DatasetArgs,
    tokenizer: "PreTrainedTokenizerBase",
    check_train_row: Callable[[dict, str], None] | None = None,
    check_eval_row: Callable[[dict, str], None] | None = None,
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """The tokenised train prompts and, when an eval mix is given, the tokenised eval prompts.

    The `check_*_row` functions see every row drawn (see `load_prompt_dataset`).
    """

    def load_and_tokenize(
        mixer_list: list[str], splits: list[str], split_argument: str, check_row=None
    ) -> datasets.Dataset:
        splits_per_source(splits, len(parse_mixer_list(mixer_list)), split_argument)  # fail early with the name
        dataset = load_prompt_dataset(mixer_list, splits, args.dataset_seed, check_row)
        tokenized, _ = tokenize_prompt_dataset(
            dataset, tokenizer, args.max_prompt_token_length, args.chat_template_name, args.dataset_cache_dir
        )
        return tokenized

    train = load_and_tokenize(
        args.dataset_mixer_list, args.dataset_mixer_list_splits, "dataset_mixer_list_splits", check_train_row
    )
    if not args.dataset_mixer_eval_list:
        return train, None
    evaluation = load_and_tokenize(
        args.dataset_mixer_eval_list, args.dataset_mixer_eval_list_splits, "dataset_mixer_eval_list_splits",
        check_eval_row,
    )
    return train, evaluation


# ---- Batching: left padding and the shuffling prompt iterator --------------------------------------------------------


def left_pad(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Left-pad token lists to (input_ids, attention_mask), both [batch, longest].

    Left, not right: generation appends after the last column, so every prompt must end there
    ("The N Implementation Details of RLHF with PPO", detail on padding).
    """
    if not sequences:
        raise ValueError("left_pad got no sequences; pass at least one token list.")
    if pad_token_id is None:
        raise ValueError("left_pad got pad_token_id=None; set tokenizer.pad_token (e.g. to the EOS token).")
    longest = max(len(sequence) for sequence in sequences)
    input_ids = torch.full((len(sequences), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        if sequence:
            input_ids[row, longest - len(sequence) :] = torch.tensor(sequence, dtype=torch.long)
            attention_mask[row, longest - len(sequence) :] = 1
    return input_ids, attention_mask


class ShufflingIterator:
    """Endless batches of indices into `num_items` prompts, reshuffled every pass over the data.

    The passes form one stream: a batch that reaches the end of a pass is completed from the start of
    the next pass, so no prompt is skipped and each pass yields every index exactly once. (At a
    boundary a batch can hold an index twice, once from each pass.) The order of pass `epoch` is a
    pure function of (seed, epoch), so the state is five integers and a restored iterator yields
    exactly the batches the saved one would have.
    """

    def __init__(self, num_items: int, batch_size: int, seed: int):
        if num_items < 1 or batch_size < 1 or seed < 0:
            raise ValueError(
                f"ShufflingIterator needs num_items >= 1, batch_size >= 1 and seed >= 0, got num_items={num_items}, "
                f"batch_size={batch_size}, seed={seed}; check the dataset size and the batch arguments."
            )
        self.num_items = num_items
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0  # passes over the data completed
        self.position = 0  # how many indices of the current pass were handed out
        self._order = self._pass_order(0)

    def _pass_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

    def __iter__(self) -> "ShufflingIterator":
        return self

    def __next__(self) -> list[int]:
        batch: list[int] = []
        while len(batch) < self.batch_size:
            take = min(self.batch_size - len(batch), self.num_items - self.position)
            batch.extend(self._order[self.position : self.position + take].tolist())
            self.position += take
            if self.position == self.num_items:
                self.epoch += 1
                self.position = 0
                self._order = self._pass_order(self.epoch)
        return batch

    next = __next__

    def state_dict(self) -> dict:
        return {
            "num_items": self.num_items,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`; the batch size stays the constructor's (a resumed run may change it)."""
        if state["num_items"] != self.num_items:
            raise ValueError(
                f"The saved ShufflingIterator state covers {state['num_items']} items but this one covers "
                f"{self.num_items}; resume with the same prompt dataset (same mixer, seed and length limit)."
            )
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order = self._pass_order(self.epoch)
