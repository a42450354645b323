"""What every converter shares: arguments, reading a split, writing parquet, `\\boxed{}` answers.

A converter supplies one function, `convert_row(raw_row) -> PromptRow | None` (None skips a row that
has no usable answer or prompt; the skips are counted), and calls `run_converter`. The output is
`{output_dir}/{split}.parquet` in the RLVR schema (`messages`, `ground_truth`, `dataset`) or, with `--format verl`, in verl's schema
(`prompt`, `data_source`, `reward_model`, `extra_info`); `open_instruct.data.sources` reads both.

Run the converters as modules from the repository root, e.g. `python -m scripts.data_preprocess.gsm8k`:
run by file path, this folder would come first on sys.path and its `math.py` would shadow Python's `math`.
"""

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from open_instruct.data.sources import read_raw_rows

OUTPUT_FORMATS = ("open_instruct", "verl")
BOXED_COMMANDS = ("\\boxed", "\\fbox")
_MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
OUTPUT_SCHEMAS = {
    "open_instruct": pa.schema([("messages", _MESSAGES_TYPE), ("ground_truth", pa.string()), ("dataset", pa.string())]),
    "verl": pa.schema(
        [
            ("prompt", _MESSAGES_TYPE),
            ("data_source", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
        ]
    ),
}


@dataclass(frozen=True)
class PromptRow:
    """A converted row: the prompt turns, the answer a verifier checks (None: reward model only), the verifier."""

    messages: list[dict]
    ground_truth: str | None
    dataset: str | None


@dataclass(frozen=True)
class HubSource:
    """Where a converter reads from when no --input is given."""

    name: str
    config: str | None
    splits: tuple[str, ...]


def build_arg_parser(description: str, hub_source: HubSource, default_format: str = "open_instruct") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--input",
        default=None,
        help=f"A local copy (parquet/jsonl file, or folder of split files); default: the hub's {hub_source.name}.",
    )
    parser.add_argument("--output_dir", required=True, help="Writes {output_dir}/{split}.parquet.")
    parser.add_argument("--max_rows", type=int, default=None, help="Read at most this many rows per split.")
    parser.add_argument(
        "--splits", nargs="+", default=list(hub_source.splits), help="Splits to convert (default: %(default)s)."
    )
    parser.add_argument("--format", choices=OUTPUT_FORMATS, default=default_format, help="Output row schema.")
    return parser


def read_split(input_path: str | None, hub_source: HubSource, split: str, max_rows: int | None) -> list[dict]:
    """Raw rows of one split: from the local copy when given, else from the hub."""
    if input_path is not None:
        return read_raw_rows(input_path, split, max_rows)
    try:
        hub_split = datasets.load_dataset(hub_source.name, hub_source.config, split=split)
    except Exception as error:  # noqa: BLE001 - datasets' and the Hub's own error types: one line with the fix
        cause = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        offline = datasets.config.HF_HUB_OFFLINE
        raise ValueError(
            f"reading the hub dataset {hub_source.name} (split {split}) failed{', HF_HUB_OFFLINE is set' if offline else ''} "
            f"({cause}); pass --input with a local copy (`hf download {hub_source.name} --repo-type dataset --local-dir "
            f"DIR` where the Hub is reachable), or {'unset HF_HUB_OFFLINE' if offline else 'check the name and network'}."
        ) from error
    if max_rows is not None:
        hub_split = hub_split.select(range(min(max_rows, len(hub_split))))
    return hub_split.to_list()


def format_row(row: PromptRow, output_format: str, split: str, index: int) -> dict:
    """A converted row in the chosen output schema."""
    if output_format == "open_instruct":
        return {"messages": row.messages, "ground_truth": row.ground_truth, "dataset": row.dataset}
    reward_style = "rule" if row.ground_truth is not None else "model"
    return {
        "prompt": row.messages,
        "data_source": row.dataset,
        # verl's convention: "rule" rewards come from a verifier, "model" rewards from a reward model.
        "reward_model": {"ground_truth": row.ground_truth, "style": reward_style},
        "extra_info": {"split": split, "index": index},
    }


def write_split(rows: list[dict], output_dir: str, split: str, output_format: str) -> str:
    """Write rows to {output_dir}/{split}.parquet with the fixed schema of `output_format`; return the path."""
    path = Path(output_dir) / f"{split}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMAS[output_format]), path)
    return str(path)


def run_converter(
    argv: list[str] | None,
    description: str,
    hub_source: HubSource,
    convert_row: Callable[[dict], PromptRow | None],
    default_format: str = "open_instruct",
) -> dict[str, str]:
    """Parse arguments, convert every requested split, write parquet; return {split: path}."""
    args = build_arg_parser(description, hub_source, default_format).parse_args(argv)
    if args.input is not None and Path(args.input).is_file() and len(args.splits) > 1:
        raise ValueError(
            f"--input {args.input} is a single file, so it holds one split, but --splits asks for {args.splits}; "
            f"pass --splits with the one split it holds (e.g. --splits train), or a folder with one file per split."
        )
    written = {}
    for split in args.splits:
        raw_rows = read_split(args.input, hub_source, split, args.max_rows)
        converted = [convert_row(raw_row) for raw_row in raw_rows]
        kept = [row for row in converted if row is not None]
        rows = [format_row(row, args.format, split, index) for index, row in enumerate(kept)]
        written[split] = write_split(rows, args.output_dir, split, args.format)
        num_skipped = len(raw_rows) - len(kept)
        print(f"{split}: wrote {len(rows)} rows to {written[split]} (skipped {num_skipped} unusable rows)")
    return written


def cli(main: Callable[[list[str] | None], object]) -> None:
    """Run a converter's `main` as a command: a bad input (a missing --input, a hub dataset out of reach, rows of
    another layout, an --output_dir that cannot be written) is one line `error: ...` with exit code 2, as the
    trainers answer; the traceback only with OPEN_INSTRUCT_DEBUG=1."""
    try:
        main(None)
    except (ValueError, OSError) as error:
        if os.environ.get("OPEN_INSTRUCT_DEBUG", "") not in ("", "0"):
            raise
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        sys.exit(2)


def require_fields(row: dict, fields: tuple[str, ...], dataset_name: str) -> None:
    """Fail with the missing field and the fields present, instead of a bare KeyError."""
    missing = [name for name in fields if name not in row]
    if missing:
        raise ValueError(
            f"A {dataset_name} row lacks the field(s) {missing} (it has {sorted(row)}); "
            f"--input must have the column layout of the hub dataset."
        )


def last_boxed_content(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` (or `\fbox{...}`) in `text`, nested braces kept; None if absent.

    `\boxed 5` (one token without braces) is read too, as a few MATH solutions write it.
    """
    start, command = max((text.rfind(command), command) for command in BOXED_COMMANDS)
    if start < 0:
        return None
    rest = text[start + len(command) :]
    if rest.startswith(" "):
        words = rest.split("$")[0].split()
        return words[0] if words else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for position, character in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(character, 0)
        if depth == 0:
            return rest[1:position]
    return None  # unbalanced braces: no answer
