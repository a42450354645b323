"""Tests for the prompt data pipeline: sources, schemas, mixer, chat templates, cache, batching."""

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from open_instruct.data import prompt_dataset as prompt_dataset_module
from open_instruct.data import sources as sources_module
from open_instruct.data.batches import ShufflingIterator, left_pad
from open_instruct.data.prompt_dataset import (
    INPUT_IDS_PROMPT_KEY,
    DatasetArgs,
    build_prompt_datasets,
    load_prompt_dataset,
    tokenize_prompt_dataset,
)
from open_instruct.data.sources import PROMPT_COLUMNS, resolve_data_files
from open_instruct.run.args import FlagParser

# The same five prompts, written below in each of the three row schemas.
QUESTIONS = ["What is 2 + 3?", "Name a prime above 10.", "Spell cat backwards.", "What is 7 * 6?", "Say hi."]
ANSWERS = ["5", "11", "tac", "42", None]
VERIFIERS = ["arithmetic", "math", "string_match", "arithmetic", None]


def write_parquet(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def rlvr_rows() -> list[dict]:
    """Schema 1, each with a reference answer turn that must be dropped from the prompt."""
    return [
        {
            "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": f"The answer is {a}."}],
            "ground_truth": a,
            "dataset": v,
        }
        for q, a, v in zip(QUESTIONS, ANSWERS, VERIFIERS)
    ]


def verl_rows() -> list[dict]:
    """Schema 2; numbers and lists in the ground truth must come out as the same text."""
    raw_answers = [5, ["11", "eleven"], "tac", 42.0, None]
    return [
        {
            "prompt": [{"role": "user", "content": q}],
            "data_source": v,
            "reward_model": {"ground_truth": a, "style": "rule"},
            "extra_info": {"index": index},
        }
        for index, (q, a, v) in enumerate(zip(QUESTIONS, raw_answers, VERIFIERS))
    ]


def plain_rows() -> list[dict]:
    """Schema 3: a string prompt; the last row leaves out the optional fields."""
    rows = [{"prompt": q, "ground_truth": a, "dataset": v} for q, a, v in zip(QUESTIONS, ANSWERS, VERIFIERS)]
    rows[-1] = {"prompt": QUESTIONS[-1]}
    return rows


def numbered_rows(count: int, tag: str = "q") -> list[dict]:
    return [{"prompt": f"{tag} {index}", "ground_truth": str(index), "dataset": "arithmetic"} for index in range(count)]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def without_source(dataset: datasets.Dataset) -> list[dict]:
    return dataset.remove_columns("source").to_list()


# ----------------------------------------------------------------------------------------------
# Schemas
# ----------------------------------------------------------------------------------------------


def test_three_schemas_give_identical_rows(tmp_path, tokenizer):
    paths = [
        write_parquet(tmp_path / "rlvr.parquet", rlvr_rows()),
        write_jsonl(tmp_path / "verl.jsonl", verl_rows()),  # jsonl: parquet cannot mix numbers and lists
        write_parquet(tmp_path / "plain.parquet", plain_rows()),
    ]
    loaded = [load_prompt_dataset([path, "1.0"], ["train"], seed=3) for path in paths]
    assert all(tuple(dataset.column_names) == PROMPT_COLUMNS for dataset in loaded)
    assert without_source(loaded[0]) == without_source(loaded[1]) == without_source(loaded[2])
    by_question = {row["messages"][0]["content"]: row for row in loaded[0]}
    assert by_question["What is 2 + 3?"] == {
        "messages": [{"role": "user", "content": "What is 2 + 3?"}],
        "ground_truth": "5",
        "dataset": "arithmetic",
        "source": f"{paths[0]}:train",
    }
    assert by_question["Say hi."]["ground_truth"] is None and by_question["Say hi."]["dataset"] is None

    built = [
        build_prompt_datasets(DatasetArgs(dataset_mixer_list=[path, "1.0"], dataset_seed=3), tokenizer)[0]
        for path in paths
    ]
    assert without_source(built[0]) == without_source(built[1]) == without_source(built[2])


def test_multi_turn_prompt_keeps_earlier_turns_and_drops_only_the_final_answer(tmp_path):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages, "ground_truth": 4, "dataset": "math"}])
    (row,) = load_prompt_dataset([path, "1"], ["train"], seed=0).to_list()
    assert row["messages"] == messages[:-1]
    assert row["ground_truth"] == "4"


# ----------------------------------------------------------------------------------------------
# Sources and splits
# ----------------------------------------------------------------------------------------------


def test_folder_with_split_files_serves_the_requested_split(tmp_path):
    write_parquet(tmp_path / "data" / "train.parquet", numbered_rows(4, "train"))
    write_jsonl(tmp_path / "data" / "test.jsonl", numbered_rows(2, "test"))
    folder = str(tmp_path / "data")
    train = load_prompt_dataset([folder, "1.0"], ["train"], seed=0)
    test = load_prompt_dataset([folder, "1.0"], ["test"], seed=0)
    assert sorted(row["messages"][0]["content"] for row in train) == [f"train {i}" for i in range(4)]
    assert sorted(row["messages"][0]["content"] for row in test) == ["test 0", "test 1"]
    assert set(test["source"]) == {f"{folder}:test"}


def test_hub_style_shards_and_split_subfolders(tmp_path):
    shards = tmp_path / "shards"
    write_parquet(shards / "data" / "train-00000-of-00002.parquet", numbered_rows(2))
    write_parquet(shards / "data" / "train-00001-of-00002.parquet", numbered_rows(3))
    write_parquet(shards / "data" / "test-00000-of-00001.parquet", numbered_rows(1))
    assert [file.name for file in resolve_data_files(shards, "train")] == [
        "train-00000-of-00002.parquet",
        "train-00001-of-00002.parquet",
    ]
    subfolders = tmp_path / "subfolders"
    write_jsonl(subfolders / "validation" / "part.jsonl", numbered_rows(2))
    write_jsonl(subfolders / "train" / "part.jsonl", numbered_rows(3))
    assert resolve_data_files(subfolders, "validation") == [subfolders / "validation" / "part.jsonl"]


def test_single_file_and_unsplit_folder_serve_any_split(tmp_path):
    single = write_parquet(tmp_path / "one.parquet", numbered_rows(3))
    assert len(load_prompt_dataset([single, "1.0"], ["test"], seed=0)) == 3
    write_parquet(tmp_path / "unsplit" / "a.parquet", numbered_rows(3))
    write_jsonl(tmp_path / "unsplit" / "b.jsonl", numbered_rows(2))
    assert len(load_prompt_dataset([str(tmp_path / "unsplit"), "1.0"], ["anything"], seed=0)) == 5


def test_json_array_file(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(numbered_rows(3)))
    assert len(load_prompt_dataset([str(path), "1.0"], ["train"], seed=0)) == 3


def test_hub_name_goes_to_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list(rlvr_rows())

    monkeypatch.setattr(sources_module.datasets, "load_dataset", fake_load_dataset)
    dataset = load_prompt_dataset(["someone/rlvr-data", "3"], ["validation"], seed=0)
    assert calls == [("someone/rlvr-data", "validation")]
    assert len(dataset) == 3 and set(dataset["source"]) == {"someone/rlvr-data:validation"}


# ----------------------------------------------------------------------------------------------
# Mixer
# ----------------------------------------------------------------------------------------------


def test_mixer_counts_fractions_and_provenance(tmp_path):
    first = write_parquet(tmp_path / "a.parquet", numbered_rows(10, "a"))
    second = write_jsonl(tmp_path / "b.jsonl", numbered_rows(100, "b"))
    dataset = load_prompt_dataset([first, "0.5", second, "29"], ["train"], seed=0)
    sources = list(dataset["source"])
    assert sources.count(f"{first}:train") == 5
    assert sources.count(f"{second}:train") == 29
    exact = load_prompt_dataset([second, "0.29"], ["train"], seed=0)  # 0.29 * 100 is 28.999... in floats
    assert len(exact) == 29
    assert len({row["messages"][0]["content"] for row in exact}) == 29  # drawn without repetition


def test_mixer_splits_per_source(tmp_path):
    write_parquet(tmp_path / "x" / "train.parquet", numbered_rows(4, "x-train"))
    write_parquet(tmp_path / "x" / "test.parquet", numbered_rows(2, "x-test"))
    single = write_parquet(tmp_path / "y.parquet", numbered_rows(3, "y"))
    dataset = load_prompt_dataset([str(tmp_path / "x"), "1.0", single, "1.0"], ["test", "train"], seed=0)
    assert sorted(set(dataset["source"])) == [f"{tmp_path / 'x'}:test", f"{single}:train"]
    assert len(dataset) == 5
    with pytest.raises(ValueError, match=r"has 3 splits .* for 2 sources"):
        load_prompt_dataset([single, "1.0", single, "1.0"], ["a", "b", "c"], seed=0)


def test_mixer_is_deterministic_for_a_seed_and_reshuffles_for_another(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", numbered_rows(50))
    first = load_prompt_dataset([path, "1.0"], ["train"], seed=1).to_list()
    again = load_prompt_dataset([path, "1.0"], ["train"], seed=1).to_list()
    other = load_prompt_dataset([path, "1.0"], ["train"], seed=2).to_list()
    assert first == again
    assert first != other
    assert sorted(json.dumps(row) for row in first) == sorted(json.dumps(row) for row in other)


def test_build_prompt_datasets_with_eval_mix(tmp_path, tokenizer):
    write_parquet(tmp_path / "data" / "train.parquet", numbered_rows(12, "train"))
    write_parquet(tmp_path / "data" / "test.parquet", numbered_rows(6, "test"))
    folder = str(tmp_path / "data")
    args = DatasetArgs(dataset_mixer_list=[folder, "10"], dataset_mixer_eval_list=[folder, "0.5"])
    train, evaluation = build_prompt_datasets(args, tokenizer)
    assert len(train) == 10 and set(train["source"]) == {f"{folder}:train"}
    assert len(evaluation) == 3 and set(evaluation["source"]) == {f"{folder}:test"}
    assert INPUT_IDS_PROMPT_KEY in train.column_names
    no_eval = build_prompt_datasets(DatasetArgs(dataset_mixer_list=[folder, "1"]), tokenizer)[1]
    assert no_eval is None


def test_dataset_args_parse_from_the_command_line():
    (args,) = FlagParser((DatasetArgs,)).parse_args_into_dataclasses(
        ["--dataset_mixer_list", "a.parquet", "1.0", "b", "20", "--max_prompt_token_length", "64"]
    )
    assert args.dataset_mixer_list == ["a.parquet", "1.0", "b", "20"]
    assert args.dataset_mixer_list_splits == ["train"] and args.dataset_mixer_eval_list_splits == ["test"]
    assert args.max_prompt_token_length == 64 and args.chat_template_name is None and args.dataset_seed == 42


# ----------------------------------------------------------------------------------------------
# Bad input: one sentence naming the file, row and field
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ({"question": "no prompt here"}, r"bad\.jsonl row 2 has no prompt field: expected `messages`.*\['question'\]"),
        ({"messages": "hello"}, r"bad\.jsonl row 2: `messages` is a str, expected a list"),
        ({"messages": []}, r"bad\.jsonl row 2: `messages` is an empty list"),
        ({"messages": [{"role": "user", "content": 5}]}, r"row 2: `messages\[0\]` has content of type int"),
        ({"messages": [{"role": "human", "content": "hi"}]}, r"row 2: `messages\[0\]` has role 'human', expected one"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, r"row 2: `messages` holds only an assistant turn"),
        ({"prompt": 7}, r"row 2: `prompt` is a int, expected a string or a list"),
        ({"prompt": "q", "reward_model": "5"}, r"row 2: `reward_model` is a str, expected a dict"),
        ({"prompt": "q", "dataset": 3}, r"row 2: the verifier name `dataset`/`data_source` is 3"),
    ],
)
def test_bad_rows_name_file_row_and_field(tmp_path, bad_row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [*numbered_rows(2), bad_row])
    with pytest.raises(ValueError, match=message):
        load_prompt_dataset([path, "1.0"], ["train"], seed=0)


def test_bad_json_line_names_the_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"broken\.jsonl line 2 is not valid JSON"):
        load_prompt_dataset([str(path), "1.0"], ["train"], seed=0)


def test_empty_sources_are_errors(tmp_path):
    empty_parquet = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty_parquet)
    with pytest.raises(ValueError, match=r"empty\.parquet:train has no rows"):
        load_prompt_dataset([str(empty_parquet), "1.0"], ["train"], seed=0)
    empty_jsonl = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(ValueError, match=r"empty\.jsonl:train has no rows"):
        load_prompt_dataset([empty_jsonl, "1.0"], ["train"], seed=0)
    with pytest.raises(FileNotFoundError, match=r"holds no .parquet/.jsonl/.json files"):
        (tmp_path / "nothing").mkdir()
        load_prompt_dataset([str(tmp_path / "nothing"), "1.0"], ["train"], seed=0)


def test_missing_file_and_missing_split(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"Dataset path .*absent\.parquet does not exist"):
        load_prompt_dataset([str(tmp_path / "absent.parquet"), "1.0"], ["train"], seed=0)
    write_parquet(tmp_path / "data" / "train.parquet", numbered_rows(2))
    with pytest.raises(ValueError, match=r"holds the splits \['train'\] but not 'test'"):
        load_prompt_dataset([str(tmp_path / "data"), "1.0"], ["test"], seed=0)
    (tmp_path / "rows.csv").write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match=r"rows\.csv has suffix '\.csv'; expected one of"):
        load_prompt_dataset([str(tmp_path / "rows.csv"), "1.0"], ["train"], seed=0)


@pytest.mark.parametrize(
    ("amount", "message"),
    [
        ("1.5", r"Mixer fraction 1\.5 for .*a\.parquet:train is outside \[0, 1\]"),
        ("11", r"Mixer count 11 for .*a\.parquet:train is outside \[0, 10\] \(the source has 10 rows\)"),
        ("-1", r"Mixer count -1"),
        ("half", r"Mixer amount 'half' .* is neither a fraction"),
        ("0.x", r"Mixer amount '0\.x' .* is not a number"),
    ],
)
def test_bad_mixer_amounts(tmp_path, amount, message):
    path = write_parquet(tmp_path / "a.parquet", numbered_rows(10))
    with pytest.raises(ValueError, match=message):
        load_prompt_dataset([path, amount], ["train"], seed=0)


def test_mixer_with_odd_or_no_values(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", numbered_rows(3))
    with pytest.raises(ValueError, match=r"dataset_mixer_list has an odd number of values \(3:"):
        load_prompt_dataset([path, "1.0", path], ["train"], seed=0)
    with pytest.raises(ValueError, match=r"dataset_mixer_list is empty"):
        load_prompt_dataset([], ["train"], seed=0)
    with pytest.raises(ValueError, match=r"selected no rows"):
        load_prompt_dataset([path, "0"], ["train"], seed=0)


# ----------------------------------------------------------------------------------------------
# Chat templates, tokenisation, the length filter and the cache
# ----------------------------------------------------------------------------------------------


def prompt_dataset(tmp_path: Path, rows: list[dict]) -> datasets.Dataset:
    return load_prompt_dataset([write_jsonl(tmp_path / "prompts.jsonl", rows), "1.0"], ["train"], seed=0)


def decoded_prompts(tokenized: datasets.Dataset, tokenizer) -> list[str]:
    return [tokenizer.decode(ids) for ids in tokenized[INPUT_IDS_PROMPT_KEY]]


def test_tokenizer_own_template_with_generation_prompt(tmp_path, tokenizer):
    dataset = prompt_dataset(tmp_path, [{"prompt": "What is 2 + 3?"}])
    tokenized, report = tokenize_prompt_dataset(dataset, tokenizer, max_prompt_token_length=256)
    expected_text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert tokenized[0][INPUT_IDS_PROMPT_KEY] == tokenizer(expected_text, add_special_tokens=False)["input_ids"]
    assert decoded_prompts(tokenized, tokenizer)[0].endswith("<|im_start|>assistant\n")
    assert report["chat_template"] == "tokenizer"


@pytest.mark.parametrize(
    ("name", "expected_text"),
    [
        ("tulu", "<|system|>\nBe brief.\n<|user|>\nWhat is 2 + 3?\n<|assistant|>\n"),
        ("simple_concat", "system: Be brief.\nuser: What is 2 + 3?\nassistant:"),
        ("plain", "system: Be brief.\nuser: What is 2 + 3?\nassistant:"),
    ],
)
def test_named_templates_work_without_a_tokenizer_template(tmp_path, tokenizer, monkeypatch, name, expected_text):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    dataset = prompt_dataset(tmp_path, [{"messages": messages}])
    tokenized, report = tokenize_prompt_dataset(dataset, tokenizer, 256, chat_template_name=name)
    assert decoded_prompts(tokenized, tokenizer) == [expected_text]
    assert report["chat_template"] == name


def test_tulu_template_ends_earlier_assistant_turns_with_eos(tmp_path, tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    tokenized, _ = tokenize_prompt_dataset(prompt_dataset(tmp_path, [{"messages": messages}]), tokenizer, 256, "tulu")
    expected = f"<|user|>\nHi\n<|assistant|>\nHello{tokenizer.eos_token}\n<|user|>\nBye\n<|assistant|>\n"
    assert decoded_prompts(tokenized, tokenizer) == [expected]


def test_missing_or_unknown_template_is_an_error(tmp_path, tokenizer, monkeypatch):
    dataset = prompt_dataset(tmp_path, [{"prompt": "hi"}])
    monkeypatch.setattr(tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match=r"has no chat template .* pass --chat_template_name tulu"):
        tokenize_prompt_dataset(dataset, tokenizer, 256)
    with pytest.raises(ValueError, match=r"chat_template_name='vicuna' is not a known template"):
        tokenize_prompt_dataset(dataset, tokenizer, 256, chat_template_name="vicuna")


def test_length_filter_report(tmp_path, tokenizer):
    rows = [{"prompt": "hi"}, {"prompt": "hello " * 40}, {"prompt": "two words"}]
    dataset = prompt_dataset(tmp_path, rows)
    lengths = [len(ids) for ids in tokenize_prompt_dataset(dataset, tokenizer, 10_000)[0][INPUT_IDS_PROMPT_KEY]]
    limit = sorted(lengths)[1]  # keeps the two short prompts
    tokenized, report = tokenize_prompt_dataset(dataset, tokenizer, limit)
    assert report["num_rows_in"] == 3 and report["num_rows_kept"] == 2 and report["num_dropped_too_long"] == 1
    assert report["max_prompt_len"] == limit and report["longest_prompt_len"] == max(lengths)
    assert all(len(ids) <= limit for ids in tokenized[INPUT_IDS_PROMPT_KEY])
    assert "hello hello" not in " ".join(decoded_prompts(tokenized, tokenizer))
    with pytest.raises(
        ValueError,
        match=rf"All 3 prompts are longer than max_prompt_token_length=2 tokens \(shortest {min(lengths)}, "
        rf"longest {max(lengths)}\); raise --max_prompt_token_length to at least {min(lengths)}",
    ):
        tokenize_prompt_dataset(dataset, tokenizer, 2)
    with pytest.raises(ValueError, match=r"The prompt dataset is empty"):
        tokenize_prompt_dataset(dataset.select([]), tokenizer, 256)


def test_tokenisation_cache_is_reused(tmp_path, tokenizer, monkeypatch):
    dataset = prompt_dataset(tmp_path, numbered_rows(6))
    cache_dir = str(tmp_path / "cache")
    first, first_report = tokenize_prompt_dataset(dataset, tokenizer, 256, cache_dir=cache_dir)
    assert not first_report["loaded_from_cache"] and Path(first_report["cache_path"]).is_dir()

    def must_not_render(*args, **kwargs):
        raise AssertionError("the second call must read the cache, not tokenise again")

    monkeypatch.setattr(prompt_dataset_module, "render_prompt", must_not_render)
    second, second_report = tokenize_prompt_dataset(dataset, tokenizer, 256, cache_dir=cache_dir)
    assert second_report["loaded_from_cache"] and second_report["cache_path"] == first_report["cache_path"]
    assert second.to_list() == first.to_list()
    monkeypatch.undo()
    _, other_limit = tokenize_prompt_dataset(dataset, tokenizer, 255, cache_dir=cache_dir)
    _, other_rows = tokenize_prompt_dataset(dataset.select([0, 1]), tokenizer, 256, cache_dir=cache_dir)
    assert len({first_report["cache_path"], other_limit["cache_path"], other_rows["cache_path"]}) == 3


# ----------------------------------------------------------------------------------------------
# Batching
# ----------------------------------------------------------------------------------------------


def test_left_pad():
    input_ids, attention_mask = left_pad([[1, 2, 3], [4], []], pad_token_id=0)
    assert input_ids.dtype == torch.long and attention_mask.dtype == torch.long
    assert input_ids.tolist() == [[1, 2, 3], [0, 0, 4], [0, 0, 0]]
    assert attention_mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    with pytest.raises(ValueError, match=r"pad_token_id=None; set tokenizer.pad_token"):
        left_pad([[1]], pad_token_id=None)


def test_shuffling_iterator_covers_every_index_once_per_epoch():
    iterator = ShufflingIterator(num_items=10, batch_size=4, seed=7)
    stream = [index for _ in range(10) for index in next(iterator)]  # 40 indices: exactly four passes
    assert iterator.epoch == 4
    passes = [stream[start : start + 10] for start in range(0, 40, 10)]
    assert all(sorted(one_pass) == list(range(10)) for one_pass in passes)
    assert len({tuple(one_pass) for one_pass in passes}) == 4  # a fresh order every pass
    assert len(iterator.next()) == 4


def test_shuffling_iterator_batch_larger_than_data():
    batch = next(ShufflingIterator(num_items=3, batch_size=7, seed=0))
    assert len(batch) == 7 and set(batch) == {0, 1, 2}


def test_shuffling_iterator_resumes_identically():
    original = ShufflingIterator(num_items=9, batch_size=4, seed=3)
    for _ in range(5):
        next(original)
    state = json.loads(json.dumps(original.state_dict()))  # survives a checkpoint file
    restored = ShufflingIterator(num_items=9, batch_size=4, seed=999)
    restored.load_state_dict(state)
    assert restored.epoch == original.epoch
    assert [next(restored) for _ in range(6)] == [next(original) for _ in range(6)]
    with pytest.raises(ValueError, match=r"covers 9 items but this one covers 8"):
        ShufflingIterator(num_items=8, batch_size=4, seed=3).load_state_dict(state)


def test_shuffling_iterator_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"num_items=0"):
        ShufflingIterator(num_items=0, batch_size=4, seed=0)
