"""The prompt-data flags (`DatasetArgs`), apart from `prompt_dataset`: `run.args` parses them in every process that
reads the run's flags, and a learner rank or an engine actor that never builds a dataset would import `datasets`,
`pyarrow` and `pandas` with them (~0.6 s of each process's start on a 2-core EPYC)."""

from dataclasses import dataclass

from open_instruct import AT_LEAST_1, NON_NEGATIVE_INT, MayChangeOnResume, arg


@dataclass
class DatasetArgs:
    dataset_mixer_list: list[str] = arg(
        [], "Sources and amounts, alternating: `name_or_path frac_or_count ...` (e.g. `a.parquet 1.0`); "
        "`embedded_arithmetic`, `embedded_word_problems`, `embedded_tool_arithmetic` and `embedded_org_chart` name the "
        "built-in tasks."
    )
    dataset_mixer_list_splits: list[str] = arg(["train"], "One split for every training source, or one split per source.")
    dataset_mixer_eval_list: list[str] = arg(
        [], "Eval sources and amounts, same syntax as dataset_mixer_list; empty means no eval set."
    )
    dataset_mixer_eval_list_splits: list[str] = arg(
        ["test"], "One split for every eval source, or one split per eval source."
    )
    max_prompt_token_length: int = arg(
        256, "Prompts with more tokens than this (after the chat template) are dropped and counted.", check=AT_LEAST_1
    )
    chat_template_name: str | None = arg(
        None, "A named chat template (tulu, simple_concat, plain, chatml); unset: the tokenizer's own."
    )
    dataset_cache_dir: MayChangeOnResume[str | None] = arg(
        None, "Folder for the tokenised-prompt cache; unset: tokenise every run, cache nothing."
    )
    dataset_seed: int = arg(42, "Seed for drawing and shuffling the mixed rows.", check=NON_NEGATIVE_INT)
