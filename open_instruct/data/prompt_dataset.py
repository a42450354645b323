"""Prompt data for RL: mix the sources, render chat templates, tokenise (`build_prompt_datasets` runs it for the
train and the eval mix).

1. Sources and rows: see `sources` (files, folders, hub names; three row schemas normalised to one).
2. Mixer. `["a.parquet", "0.5", "b/", "100"]`: a value with "." is a fraction of the source's rows
   (floor of fraction x rows, computed exactly), otherwise a row count; rows are drawn without
   repetition, so a count larger than the source is an error. The mix is shuffled with the seed.
3. Tokens. Prompts are rendered with a chat template (see `chat_templates`), tokenised once (cached on
   disk when a cache folder is given), and prompts longer than `max_prompt_token_length` are dropped
   and counted, never truncated: a truncated question has a different answer.
"""

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
import numpy as np
import pyarrow as pa

from open_instruct.data.chat_templates import render_prompt, resolve_chat_template
from open_instruct.data.dataset_args import DatasetArgs  # noqa: F401 (its flags, re-exported for the callers)
from open_instruct.data.sources import (
    PROMPT_FEATURES,
    PROMPT_FEATURES_WITH_EXTRA_COLUMNS,
    count_rows,
    normalise_row,
    open_source,
    take_rows,
)

if TYPE_CHECKING:  # only for annotations: the converters need no transformers import
    from transformers import PreTrainedTokenizerBase


logger = logging.getLogger(__name__)


INPUT_IDS_PROMPT_KEY = "input_ids_prompt"
# Bump when the cached layout or the tokenisation rules change, so old caches are not reused.
TOKENIZATION_CACHE_VERSION = 1
CACHE_REPORT_FILE = "tokenization_report.json"


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
    mixer_list: list[str], splits: list[str], seed: int, check_row: Callable[[dict, str], None] | None = None,
    keep_extra_columns: bool = False,
) -> datasets.Dataset:
    """Read, draw, normalise and shuffle the mixed sources into one dataset with `PROMPT_COLUMNS` (and, with
    `keep_extra_columns`, `extra_columns`: the JSON text of each row's other columns, for its environment).

    `check_row(row, where)` sees every normalised row that was drawn, with its file and row number, and may raise.
    """
    entries = parse_mixer_list(mixer_list)
    rng = np.random.default_rng(seed)
    rows = []
    for (name, amount), split in zip(entries, splits_per_source(splits, len(entries))):
        source = f"{name}:{split}"
        parts = open_source(name, split)
        part_sizes = [count_rows(part) for part in parts]
        num_rows = sum(part_sizes)
        if num_rows == 0:
            raise ValueError(f"Dataset source {source} has no rows ({', '.join(p.where for p in parts)}).")
        chosen = np.sort(rng.choice(num_rows, size=rows_to_take(amount, num_rows, source), replace=False))
        part_starts = np.cumsum([0, *part_sizes])
        for part, start, end in zip(parts, part_starts[:-1], part_starts[1:]):
            local_indices = (chosen[(chosen >= start) & (chosen < end)] - start).tolist()
            for raw, index in zip(take_rows(part, local_indices), local_indices):
                where = f"{part.where} row {index}"
                rows.append(normalise_row(raw, where, source, keep_extra_columns))
                if check_row is not None:
                    check_row(rows[-1], where)
    if not rows:
        raise ValueError(f"The mixer {mixer_list} selected no rows; raise the amounts.")
    shuffled_rows = [rows[index] for index in rng.permutation(len(rows))]
    features = PROMPT_FEATURES_WITH_EXTRA_COLUMNS if keep_extra_columns else PROMPT_FEATURES
    return datasets.Dataset.from_list(shuffled_rows, features=features)


# ---- Tokenisation, length filter, cache ------------------------------------------------------------------------------


def _tokenization_cache_key(
    dataset: datasets.Dataset, tokenizer: "PreTrainedTokenizerBase", chat_template: str, max_prompt_token_length: int,
    tool_schemas: list[dict] | None = None,
) -> str:
    """Hash of everything the tokenised output depends on: the rows, the vocabulary, the template, the tools' schemas
    it renders, the limit."""
    hasher = hashlib.sha256()
    table = dataset.with_format("arrow")[:]  # respects any select/shuffle done on `dataset`
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    hasher.update(sink.getvalue().to_pybytes())
    vocabulary = sorted(tokenizer.get_vocab().items())
    settings = [TOKENIZATION_CACHE_VERSION, type(tokenizer).__name__, vocabulary, chat_template]
    if tool_schemas:  # only then: the keys of the caches made before tools were rendered stay the same
        settings.append(tool_schemas)
    hasher.update(json.dumps([*settings, max_prompt_token_length]).encode())
    return hasher.hexdigest()[:20]


def _log_report(report: dict) -> None:
    logger.info(
        f"[data] prompts: kept {report['num_rows_kept']} of {report['num_rows_in']}, dropped {report['num_dropped_too_long']} "
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
    tool_schemas: list[dict] | None = None,
) -> tuple[datasets.Dataset, dict]:
    """Add `input_ids_prompt` (chat template + generation prompt) and drop prompts over the limit. `tool_schemas`: the
    function schemas of --tools with a native tool-call format, passed to the template as `tools=`.

    Returns the kept rows and a report: num_rows_in, num_rows_kept, num_dropped_too_long, max_prompt_len
    (longest kept), longest_prompt_len (longest seen), max_prompt_token_length, chat_template,
    cache_path (None without a cache_dir) and loaded_from_cache.
    """
    if len(dataset) == 0:
        raise ValueError("The prompt dataset is empty; check the mixer sources and amounts.")
    template_label, chat_template = resolve_chat_template(tokenizer, chat_template_name)
    cache_path = None
    if cache_dir is not None:
        key = _tokenization_cache_key(dataset, tokenizer, chat_template, max_prompt_token_length, tool_schemas)
        cache_path = Path(cache_dir) / f"prompts_{key}"
        if (cache_path / CACHE_REPORT_FILE).exists():
            report = json.loads((cache_path / CACHE_REPORT_FILE).read_text()) | {"loaded_from_cache": True}
            _log_report(report)
            return datasets.load_from_disk(str(cache_path)), report

    texts = [render_prompt(messages, tokenizer, chat_template, tool_schemas) for messages in dataset["messages"]]
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
    keep_extra_columns: bool = False,
    tool_schemas: list[dict] | None = None,
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """The tokenised train prompts and, when an eval mix is given, the tokenised eval prompts.

    The `check_*_row` functions see every row drawn (see `load_prompt_dataset`); `keep_extra_columns` (a run with
    --tools) keeps each row's other columns for its environment; `tool_schemas` are rendered into every prompt
    (`tools=`, a native tool-call format).
    """

    def load_and_tokenize(
        mixer_list: list[str], splits: list[str], split_argument: str, check_row=None
    ) -> datasets.Dataset:
        splits_per_source(splits, len(parse_mixer_list(mixer_list)), split_argument)  # fail early with the name
        dataset = load_prompt_dataset(mixer_list, splits, args.dataset_seed, check_row, keep_extra_columns)
        tokenized, _ = tokenize_prompt_dataset(
            dataset, tokenizer, args.max_prompt_token_length, args.chat_template_name, args.dataset_cache_dir,
            tool_schemas,
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
