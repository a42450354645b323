"""Which environment serves a dataset row: one run may mix environments, each row naming its own in a column
(`--environment_column`, as verl's `data_source` names a row's reward).

With a routing column, the `--tools` names are the choices: a row whose column holds an environment's name (a
registered one, or `path/to/file.py:Class` as written in --tools) gets that environment, a row naming a tool gets that
tool alone, and a row without a value (no such column, or null) gets the default: every tool of --tools together
(today's `ToolEnvironment`), or, where --tools names no tool, its first name. Without a routing column --tools is what
it always was: its tools together, or one environment alone, for every row.

The rows' values are checked when the data loads (run/validation.py row checks: a value naming no --tools entry is a
one-line refusal before any model loads); the engine builds each sample's environment through `environment_router`.
"""

import json
from collections.abc import Callable

from open_instruct.environments.tools import (
    DEFAULT_OUTPUT_WRAPPER,
    Environment,
    environment_builder,
    tool_class,
    tool_names_problem,
)


def environment_rows(dataset, indices: list[int]) -> list[dict]:
    """The dataset rows `indices` (of data.prompt_dataset's datasets) as their environments' `reset(row)` gets them:
    every extra column of the row (a task's files, a table, tests: data.sources.extra_columns_text), then its prompt
    `messages`, `ground_truth`, `dataset` (verifier name) and `source` (mixer entry), which win over an extra column of
    the same name. JSON values only: they travel to engine actors and are stored in checkpoints with the samples. For
    the engines alone: the learner never holds them."""
    columns = dataset[indices]
    return [environment_row({name: values[i] for name, values in columns.items()}) for i in range(len(indices))]


def environment_row(row: dict) -> dict:
    """One normalised dataset row (data.sources.normalise_row) as its environment gets it (`environment_rows`)."""
    extra = row.get("extra_columns")
    return {**(json.loads(extra) if extra else {}), "messages": row["messages"], "ground_truth": row["ground_truth"],
            "dataset": row["dataset"], "source": row["source"]}  # fmt: skip


def environment_names(names: list[str]) -> list[str]:
    """The --tools names that stand for an Environment (the others are tools). Raises ValueError for an unknown one."""
    return [name for name in names if issubclass(tool_class(name), Environment)]


def routing_problem(names: list[str], column: str | None) -> str | None:
    """What is wrong with `--tools names` routed by `--environment_column column`, or None. Without a column, the
    rules of `tool_names_problem`; with one, environments may stand beside each other and beside tools: each
    environment must pass those rules alone, and the tools together."""
    if column is None:
        return tool_names_problem(names)
    if not column.strip():
        return "--environment_column is empty; give the name of the dataset column that names each row's environment"
    if len(set(names)) != len(names):
        return f"--tools {' '.join(names)} names a tool twice; name each once"
    try:
        environments = environment_names(names)
    except ValueError as error:
        return str(error)
    tools = [name for name in names if name not in environments]
    for group in [[name] for name in environments] + ([tools] if tools else []):
        problem = tool_names_problem(group)
        if problem is not None:
            return problem
    return None


def default_environment(names: list[str]) -> list[str]:
    """The --tools names a row without a routing value gets: every tool together, or the first name if none is a tool."""
    tools = [name for name in names if name not in environment_names(names)]
    return tools or names[:1]


def row_environment_problem(row: dict, column: str, names: list[str]) -> str | None:
    """Why `row[column]` names no --tools entry (the sentence after the row's place), or None. A missing or null
    value is fine: the row gets the default environment."""
    value = row.get(column)
    if value is None:
        return None
    if not isinstance(value, str):
        return (f"column `{column}` (--environment_column) holds a {type(value).__name__} ({value!r}), expected the "
                f"name of one of --tools {' '.join(names)}; store the name as text")  # fmt: skip
    if value not in names:
        return (f"column `{column}` (--environment_column) names {value!r}, which is not one of --tools "
                f"{' '.join(names)}; add it to --tools, or fix the row")  # fmt: skip
    return None


def environment_router(names: dict[str, str], column: str | None, wrapper: str = DEFAULT_OUTPUT_WRAPPER,
                       cut_output: Callable[[str], tuple[str, bool]] | None = None,
                       group_builder: Callable[[list[str]], Callable[[], Environment]] | None = None,
                       ) -> Callable[[dict], Callable[[], Environment]]:  # fmt: skip
    """What builds a row's environment: `route(row)` is the builder (a callable taking no arguments) of the environment
    `row[column]` names. `names`: each --tools name as the rows write it -> the name the engine imports (absolute
    file paths, tools.absolute_names). A value no --tools entry holds (the data check refuses it first) gets a builder
    that raises, so only that sample's environment fails to start. `group_builder(import_names)`: the builder of one
    group of names (one environment, or tools together); default: today's tags (`environment_builder`), a native
    tool-call format passes its own (native_tools.native_router)."""
    group_builder = group_builder or (lambda group: environment_builder(group, wrapper, cut_output))
    written = list(names)
    if column is None:
        everything = group_builder(list(names.values()))
        return lambda row: everything
    builders = {name: group_builder([names[name]]) for name in written}
    default = group_builder(default_environment(list(names.values())))

    def route(row: dict) -> Callable[[], Environment]:
        value = row.get(column)
        if value is None:
            return default
        if value in builders:
            return builders[value]
        problem = row_environment_problem(row, column, written)

        def refuse() -> Environment:
            raise ValueError(problem)

        return refuse

    return route
