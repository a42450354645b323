"""Where prompt rows come from, and the one row layout they all become (`normalise_row`).

Sources. Each mixer entry names a local `.parquet` / `.jsonl` / `.json` file, a local folder of them, or (when
no such path exists) a hub dataset loaded with `datasets.load_dataset(name, split=...)`. Split rule for local data:
- a single file holds its own data for any split name (a file is one split);
- a folder is "split" when some data file in it names a split: its stem is the split or starts with
  `<split>-` / `<split>_` (`train.parquet`, `train-00000-of-00001.parquet`), or a sub-folder is named
  after it (`train/0000.parquet`). A split folder serves the files of the requested split (other files
  are ignored); asking for a split it does not hold is an error naming the splits it has;
- a folder where no file names a split is, like a single file, its own data for any split.

Rows. Three row schemas are detected row by row and normalised to the columns in `PROMPT_COLUMNS`:
`messages` (the prompt turns), `ground_truth`, `dataset` (verifier name), `source`.
- RLVR: `messages`, `ground_truth`, `dataset`; a final assistant turn is dropped (it is the answer).
- verl: `prompt` (chat list), `data_source`, `reward_model: {ground_truth, style}`; `extra_info` is not read.
- plain: `prompt` as a string (becomes one user turn); `ground_truth` / `dataset` optional.
Precedence when a row mixes them: `messages` over `prompt`, `reward_model.ground_truth` over
`ground_truth`, `data_source` over `dataset`. A ground truth number becomes its text (72.0 -> "72"),
a list its first element, a JSON object (an IFEval constraint set) its JSON text. A code row's list of assert
statements is its tests: it becomes its JSON text, all of it.

Extra columns. With --tools every other column of a row (verl's `extra_info` included) is kept, as the JSON text of
one object in `extra_columns`, for the row's environment (`reset(row)`, docs/tools.md).
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from open_instruct.rewards.verifiers import VERIFIER_ALIASES

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
# With --tools, a row's other columns (a task's files, a table, tests...) are kept for its environment's `reset(row)`:
# as one JSON object's text, since sources disagree on which columns they have and of what types.
EXTRA_COLUMNS = "extra_columns"
PROMPT_FEATURES_WITH_EXTRA_COLUMNS = datasets.Features({**PROMPT_FEATURES, EXTRA_COLUMNS: datasets.Value("string")})


@dataclass(frozen=True)
class SourcePart:
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


def open_source(name: str, split: str) -> list[SourcePart]:
    """Open a mixer source: local file/folder by path, else a hub dataset name."""
    path = Path(name).expanduser()
    if path.exists():
        return [
            SourcePart(str(file), pq.read_table(file) if file.suffix == ".parquet" else _read_json_rows(file))
            for file in resolve_data_files(path, split)
        ]
    if path.suffix in DATA_FILE_SUFFIXES or name.startswith(("/", "./", "../", "~")):
        raise FileNotFoundError(f"Dataset path {name} does not exist; check the path (relative to {Path.cwd()}).")
    try:
        hub_dataset = datasets.load_dataset(name, split=split)
    except Exception as error:  # noqa: BLE001 - datasets' and the Hub's own error types: one line with the fix
        raise ValueError(hub_dataset_problem(name, split, error)) from error
    return [SourcePart(f"{name} (split {split})", hub_dataset)]


def hub_dataset_problem(name: str, split: str, error: Exception) -> str:
    """Why hub dataset `name` could not be loaded, and the fix, in one line: offline, a local copy is the way."""
    cause = " ".join(f"{type(error).__name__}: {error}".split())[:200]
    local_copy = (f"`hf download {name} --repo-type dataset --local-dir DIR` where the Hub is reachable, then give the "
                  f"folder holding its {split} files (DIR or a config's folder in it)")  # fmt: skip
    if datasets.config.HF_HUB_OFFLINE:
        return (f"Dataset {name} is not a local file or folder, so it was read as a hub dataset, and HF_HUB_OFFLINE is "
                f"set and the datasets cache has no copy of it ({cause}); run {local_copy}, or unset HF_HUB_OFFLINE.")  # fmt: skip
    return (f"Dataset {name} is not a local file or folder, and loading it as a hub dataset (split {split}) failed "
            f"({cause}); check the name or path, or run {local_copy}.")  # fmt: skip


def count_rows(part: SourcePart) -> int:
    return len(part.rows) if not isinstance(part.rows, pa.Table) else part.rows.num_rows


def take_rows(part: SourcePart, indices: list[int]) -> list[dict]:
    if isinstance(part.rows, pa.Table):
        return part.rows.take(pa.array(indices, type=pa.int64())).to_pylist()  # typed: [] is valid too
    if isinstance(part.rows, datasets.Dataset):
        return part.rows.select(indices).to_list()
    return [part.rows[index] for index in indices]


def read_raw_rows(name: str, split: str, max_rows: int | None = None) -> list[dict]:
    """The first `max_rows` rows (all when None) of a source, unnormalised; for converters and debugging."""
    rows = []
    for part in open_source(name, split):
        wanted = count_rows(part) if max_rows is None else min(count_rows(part), max_rows - len(rows))
        rows.extend(take_rows(part, list(range(wanted))))
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


def _ground_truth_text(value: object, where: str, verifier: str | None = None) -> str | None:
    """Ground truth as text: numbers become their text (72.0 -> "72"), a list its first element, an object (an IFEval
    constraint set, code tests, as parquet files store them) its JSON text; a code row's list of assert statements
    its JSON text."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, list) and _is_code_row(verifier):  # its tests: all of them
        return json.dumps(value)
    if isinstance(value, list):
        return _ground_truth_text(value[0], where) if value else None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, int | float):
        return str(value)
    raise ValueError(
        f"{where}: the ground truth is a {type(value).__name__} ({value!r}), expected a string, number, list or object; "
        f"store the answer as one of those."
    )


def _is_code_row(verifier: str | None) -> bool:
    return verifier is not None and VERIFIER_ALIASES.get(verifier.strip().lower()) == "code"


def normalise_row(row: dict, where: str, source: str, keep_extra_columns: bool = False) -> dict:
    """One raw row in any of the three schemas -> {messages, ground_truth, dataset, source}; with `keep_extra_columns`
    also `extra_columns`, the JSON text of its other columns (`extra_columns_text`)."""
    reward_model = row.get("reward_model")
    if reward_model is not None and not isinstance(reward_model, dict):
        raise ValueError(
            f"{where}: `reward_model` is a {type(reward_model).__name__}, expected a dict with `ground_truth`."
        )
    ground_truth = reward_model.get("ground_truth") if reward_model is not None else row.get("ground_truth")
    verifier = row["data_source"] if row.get("data_source") is not None else row.get("dataset")
    if verifier is not None and not isinstance(verifier, str):
        raise ValueError(f"{where}: the verifier name `dataset`/`data_source` is {verifier!r}, expected a string.")
    normalised = {
        "messages": _prompt_messages(row, where),
        "ground_truth": _ground_truth_text(ground_truth, where, verifier),
        "dataset": verifier,
        "source": source,
    }
    if keep_extra_columns:
        normalised[EXTRA_COLUMNS] = extra_columns_text(row, where)
    return normalised


def extra_columns_text(row: dict, where: str) -> str:
    """The JSON text of a raw row's columns other than the prompt (`messages`/`prompt`) and the normalised ones
    (`ground_truth`, `dataset`, `source`); a verl row's `data_source`, `reward_model` and `extra_info` stay in it. A
    value JSON cannot hold (bytes, a date) is refused with the column's name."""
    extra = {key: value for key, value in row.items() if key not in ("messages", "prompt", *PROMPT_COLUMNS)}
    for key, value in extra.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"{where}: column `{key}` holds a {type(value).__name__} that JSON cannot hold ({error}); with --tools "
                f"every column of a row is kept for its environment: store it as text, numbers, lists or objects, or "
                f"drop the column."
            ) from None
    return json.dumps(extra, sort_keys=True)
