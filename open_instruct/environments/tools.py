"""Tools and environments the model talks to between its decode turns (multi-turn rollouts).

Two shapes, both found by name in a registry (as the verifiers are):

- a `Tool` is stateless: a name, the `start` and `end` strings that delimit a call in the model's text, and
  `__call__(text) -> text`. It signals a failed call by raising (`ToolError` for a message meant for the model);
  the model then reads the error as the tool's output.
- an `Environment` is one sample's stateful task: `reset(row)` when the sample starts, then `step(model_text)` each
  time the model's text reaches one of its `end_strings`, which answers `(observation, reward, done)`. The
  observation's tokens are appended to the sample (they are never trained on), `reward` is the turn's (PPO places it
  on the turn's last sampled token, GRPO adds it to the sample's score), and `done` ends the sample. `row` is the
  sample's dataset row, its extra columns included; with --environment_column each row names its own environment
  (environments/routing.py). With a native tool-call format (--tool_call_parser hermes, ...) an environment that
  defines `step_calls(calls, model_text)` gets each turn's parsed calls instead, and its results are the chat
  template's tool turns (environments/native_tools.py `NativeEnvironment`).

`ToolEnvironment` is the environment `--tools NAME ...` builds: each turn, the last call of the tool whose end string
ended the turn runs, and its output (cut to --tool_output_max_tokens, wrapped by --tool_output_wrapper) is the
observation. The engine runs each turn while it decodes the other samples (environments/tool_pool.py: a tool's calls
in worker processes, `ToolEnvironment.calls` then `observation`; an environment's step with `run_steps`, in a thread
under the time limit). `start_environments` builds and resets a batch's environments under the same limit: user code
that raises or hangs is answered with text under --tool_timeout_s, never a stalled or dead generation thread.

Nothing here knows about tokens or engines: the engine (generation/engine_batches.py) finds the end strings, asks for
the steps and appends the tokens.
"""

import ast
import functools
import inspect
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from open_instruct.data.org_chart_task import manager_answer
from open_instruct.rewards.reward_function import import_file
from open_instruct.sandbox import (
    ISOLATED,
    OUTPUT_LIMIT,
    TIMEOUT,
    Limits,
    Sandbox,
    SandboxUnavailable,
    isolation_problem,
)

DEFAULT_OUTPUT_WRAPPER = "<output>{output}</output>\n"


class ToolError(Exception):
    """A tool's failure meant for the model: its message is what the model reads as the output."""


class Tool:
    """A stateless tool: `tool(call_text) -> output_text`. Subclasses set `name`, `start` and `end`."""

    name: str = ""
    start: str = ""  # opens a call in the model's text, e.g. "<calculator>"
    end: str = ""  # closes it: the engine parks the sample when its text reaches this string
    # For native tool calls (--tool_call_parser): an OpenAI-style function schema, or None to derive it from a typed
    # `call(self, name: type, ...) -> str` method and its docstring (environments/tool_schemas.py). A native call runs
    # `call(**arguments)`.
    schema: dict | None = None

    def __call__(self, text: str) -> str:
        raise NotImplementedError


class Environment:
    """One sample's multi-turn task. `end_strings`: the strings that end a model turn. `errors` counts the turns it
    answered with an error (the tools/errors metric); an environment that has none leaves it at 0."""

    end_strings: tuple[str, ...] = ()
    errors: int = 0

    def reset(self, row: dict) -> None:
        """A new sample starts. `row`: its dataset row (environments.routing.environment_rows): the prompt's
        `messages`, `ground_truth`, `dataset` (verifier name), `source`, and every other column of the row as JSON
        values (a task's files, a table, its tests); with `prompt_token_ids` and `prompt_index` (into its batch)
        besides. A sample generated without a dataset row (an engine driven directly, a checkpoint older than rows)
        gets these two alone."""

    def step(self, model_text: str) -> tuple[str, float, bool]:
        """The model's turn since the last observation, ending with one of `end_strings`: the observation to append,
        the reward this turn earned, and whether the sample ends here.

        The reward is recorded at the turn's last sampled token (the one before the observation,
        Completion.turn_rewards): PPO adds it to that token's reward, so GAE credits the tokens before it and not the
        later turns; GRPO adds the sum of a sample's turn rewards to its score. The argument is the turn's text, as
        the model wrote it (call markup included). In a run with a native tool-call format an environment that has
        `step_calls` gets the parsed calls there instead."""
        raise NotImplementedError

    # The native format (--tool_call_parser hermes, ...): an environment that defines
    #
    #     def step_calls(self, calls: list[ToolCall], model_text: str) -> tuple[list[str] | str, float, bool]
    #
    # is handed each turn's calls as the run's parser read them (environments/tool_parsers.py `ToolCall`: `name`,
    # `arguments` checked against `schemas`, or `error`, why the call could not be read), with the turn's text, and
    # answers (results, reward, done): one result text per call, in the calls' order (each rendered as a `tool` turn of
    # the chat template), or one text for the whole turn (one `tool` turn). `schemas`: the functions it offers the
    # model, OpenAI-style function schemas (environments/tool_schemas.py), shown in every prompt. It is tried before
    # `step`: an environment with both serves a tags run and a native one. See docs/tools.md "Writing an environment".
    schemas: tuple[dict, ...] = ()


def takes_calls(environment: "Environment | type") -> bool:
    """Whether an environment (or its class) takes a native turn's parsed calls: it defines `step_calls`."""
    return callable(getattr(environment, "step_calls", None))


# ---------------------------------------------------------------- the calculator


class Calculator(Tool):
    """Integer arithmetic: `+ - * //` and parentheses, e.g. `<calculator>(12 + 7) * 3</calculator>` -> `57`.

    The expression is parsed with `ast` and only integer literals, these four operators and unary minus are
    evaluated: nothing is ever passed to `eval`, so a model's text cannot run code here.
    """

    name, start, end = "calculator", "<calculator>", "</calculator>"
    MAX_CHARS = 200  # longer "expressions" are not arithmetic: refused before parsing
    MAX_DIGITS = 100  # a result past this is refused (repeated multiplication could grow it without bound)
    OPERATORS = {
        ast.Add: lambda a, b: a + b,
        ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b,
        ast.FloorDiv: lambda a, b: a // b,
    }

    def __call__(self, text: str) -> str:
        expression = text.strip()
        if len(expression) > self.MAX_CHARS:
            raise ToolError(f"expression longer than {self.MAX_CHARS} characters")
        try:
            tree = ast.parse(expression, mode="eval")
        except SyntaxError:
            raise ToolError(f"cannot parse {expression!r}; use integers, + - * // and parentheses") from None
        return str(self.evaluate(tree.body))

    def call(self, expression: str) -> str:
        """Evaluate integer arithmetic: integers, + - * // and parentheses.

        Args:
            expression: the arithmetic to evaluate, e.g. (12 + 7) * 3
        """
        return self(expression)

    def evaluate(self, node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            value = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            value = -self.evaluate(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in self.OPERATORS:
            left, right = self.evaluate(node.left), self.evaluate(node.right)
            if isinstance(node.op, ast.FloorDiv) and right == 0:
                raise ToolError("division by zero")
            value = self.OPERATORS[type(node.op)](left, right)
        else:
            raise ToolError(f"{ast.unparse(node)!r} is not allowed; use integers, + - * // and parentheses")
        if len(str(abs(value))) > self.MAX_DIGITS:
            raise ToolError(f"result longer than {self.MAX_DIGITS} digits")
        return value


# ---------------------------------------------------------------- tools as an environment


def last_call(text: str, tool: Tool) -> str | None:
    """The text of the last call of `tool` in `text` (which ends with its end string); None when no start precedes it."""
    body = text[: text.rfind(tool.end)]
    opened = body.rfind(tool.start)
    return None if opened < 0 else body[opened + len(tool.start) :]


class ToolEnvironment(Environment):
    """The environment of `--tools NAME ...`: stateless tools, no reward, never done (the model ends the sample).

    `cut_output(text) -> (text, was_cut)` cuts a tool's output to its token budget (the engine's tokenizer does it);
    `wrapper` holds `{output}`, e.g. "<output>{output}</output>\\n"."""

    def __init__(self, tools: list[Tool], wrapper: str = DEFAULT_OUTPUT_WRAPPER,
                 cut_output: Callable[[str], tuple[str, bool]] | None = None):  # fmt: skip
        self.tools, self.wrapper = tools, wrapper
        self.cut_output = cut_output or (lambda text: (text, False))
        self.end_strings = tuple(tool.end for tool in tools)
        self.errors = 0
        self.outputs_cut = 0

    def step(self, model_text: str) -> tuple[str, float, bool]:
        outputs = [call_output(self.tools[place], call) for place, call in self.calls(model_text)]
        return self.observation(outputs), 0.0, False

    # The engine runs a turn in these three parts (environments/tool_pool.py): `calls` and `observation` in its own
    # thread, each call in a worker process that rebuilds the tool from its --tools name (the place in `tools`).

    def calls(self, model_text: str) -> list[tuple[int, str | None]]:
        """The calls the turn makes, in order: (the tool's place in `tools`, the call's text; None where its end string
        has no start before it). With tags, one: the last call of the tool whose end string ends the turn."""
        tool = self.tool_ending(model_text)
        return [(self.tools.index(tool), last_call(model_text, tool))]

    def observation(self, outputs: list[tuple[str, bool]]) -> str:
        """The turn's observation from each call's (output, failed), in order (`call_output`): each output cut to its
        budget and wrapped, joined; the failed ones counted in `errors`, the cut ones in `outputs_cut`."""
        observation = ""
        for output, failed in outputs:
            self.errors += failed
            output, was_cut = self.cut_output(output)
            self.outputs_cut += was_cut
            observation += self.wrapper.format(output=output)
        return observation

    def tool_ending(self, text: str) -> Tool:
        """The tool whose end string ends `text` (the longest, when one end string ends with another)."""
        ending = [tool for tool in self.tools if text.endswith(tool.end)]
        if not ending:
            raise ValueError(f"a turn must end with one of {self.end_strings}; got ...{text[-40:]!r}")
        return max(ending, key=lambda tool: len(tool.end))


def call_output(tool: Tool, call: str | dict | None) -> tuple[str, bool]:
    """What the model reads of one call, and whether it failed: the tool's output, or `Error: ...` (it raised, or its end
    string has no start before it: `call` None). `call`: the call's text, or a native call's arguments (`native_call`)."""
    if call is None:
        return f"Error: {tool.end} without {tool.start} before it", True
    try:
        return (native_call(tool, call) if isinstance(call, dict) else str(tool(call))), False
    except ToolError as error:
        return f"Error: {error}", True
    except Exception as error:  # any failure of a tool is the model's to read, never the run's end
        return f"Error: {failure_text(error)}", True


def native_call(tool: Tool, arguments: dict) -> str:
    """A native call's output: the tool's `call(**arguments)`; a tool with a declared schema and no `call` takes its one
    parameter's value as its text (`tool(text)`)."""
    call = getattr(tool, "call", None)
    if call is not None:
        return str(call(**arguments))
    if len(arguments) != 1:
        raise ToolError(f"{tool.name} takes one argument")
    return str(tool(str(next(iter(arguments.values())))))


# ---------------------------------------------------------------- finding turns, running steps


def turn_end(text: str, end_strings: tuple[str, ...], searched_up_to: int, turn_start: int = 0) -> int | None:
    """Where the model's turn ends in `text`: the index just past the first end string that ends after
    `searched_up_to` (the length of the text already searched, so a string split across two decode steps or a
    resubmission is found once, when its last character arrives) and starts at or after `turn_start` (never inside
    the observation before the turn). None while no end string is complete."""
    found = None
    for end in end_strings:
        at = text.find(end, max(turn_start, searched_up_to - len(end) + 1))
        if at >= 0 and (found is None or at + len(end) < found):
            found = at + len(end)
    return found


@dataclass
class Attempt:
    """What one guarded call gave (`run_guarded`): its value, or `error`, the text saying why not (it raised, or it
    ran past its time: `timed_out`)."""

    value: object = None
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0


def failure_text(error: BaseException) -> str:
    """`Type: message`; an exception whose own message cannot be formatted is named by its type alone."""
    try:
        return f"{type(error).__name__}: {error}"
    except Exception:
        return type(error).__name__


def run_guarded(functions: list[Callable[[], object]], timeout_s: float) -> list[Attempt]:
    """Each of `functions` on its own (daemon) thread, all at once, each given `timeout_s` seconds; the attempts in the
    functions' order. One that raises (anything, `SystemExit` included) is answered with its error; one past its time
    is left running on its own and answered with a timeout (its later result is dropped), so user code that hangs
    cannot stop generation."""
    results: list[Attempt | None] = [None] * len(functions)
    started = time.monotonic()

    def run(index: int, function: Callable[[], object]) -> None:
        begin = time.monotonic()
        try:
            results[index] = Attempt(function(), seconds=time.monotonic() - begin)
        except BaseException as error:  # user code: whatever it raises is the model's to read, never the run's end
            results[index] = Attempt(error=failure_text(error), seconds=time.monotonic() - begin)

    threads = [threading.Thread(target=run, args=(i, function), daemon=True) for i, function in enumerate(functions)]
    for thread in threads:
        thread.start()
    attempts = []
    for index, thread in enumerate(threads):
        thread.join(max(0.0, started + timeout_s - time.monotonic()))
        attempt = results[index]  # read once: a call past its time may still write its late answer here
        if thread.is_alive() or attempt is None:
            attempt = Attempt(error=f"took longer than {timeout_s:g} s and was stopped", timed_out=True, seconds=timeout_s)
        attempts.append(attempt)
    return attempts


@dataclass
class TokenObservation:
    """An observation already rendered as tokens (a chat template's tool turn, environments/chat_turns.py): the engine
    appends `token_ids` as they are, and `text` is what they decode to."""

    text: str
    token_ids: list[int]


@dataclass
class StepOutcome:
    """What one environment step gave: the observation, reward, done, and how it went."""

    observation: str | list[str] | TokenObservation  # a list: a native environment's results, one per call
    reward: float
    done: bool
    seconds: float
    error: bool = False  # the environment raised (its turn then reads the error)
    timed_out: bool = False  # it ran past the time limit (the call is cut: its later answer is dropped)


def run_steps(calls: list[tuple[Environment, str]], timeout_s: float) -> list[StepOutcome]:
    """`env.step(text)` for each (env, text), all at once, each given `timeout_s` seconds (`run_guarded`); outcomes in
    the calls' order. A step that raises is answered with its error, one past its time with a timeout message."""
    return guarded_steps([functools.partial(environment.step, text) for environment, text in calls], timeout_s)


def guarded_steps(steps: list[Callable[[], tuple]], timeout_s: float, per_call: bool = False) -> list[StepOutcome]:
    """Each of `steps` (a call answering (observation, reward, done)) at once, under `timeout_s` (`run_guarded`). The
    observation is made text, unless it is a TokenObservation or, with `per_call` (a native environment's step_calls),
    a list of results, one per call (each made text)."""

    def step(run_step: Callable[[], tuple]) -> tuple[str | list[str] | TokenObservation, float, bool]:
        observation, reward, done = run_step()
        if per_call and isinstance(observation, (list, tuple)):
            observation = [str(result) for result in observation]
        elif not isinstance(observation, TokenObservation):
            observation = str(observation)
        return observation, float(reward), bool(done)

    outcomes = []
    for attempt in run_guarded([functools.partial(step, run_step) for run_step in steps], timeout_s):
        if attempt.timed_out:
            outcomes.append(StepOutcome(f"Error: the call {attempt.error}", 0.0, False, attempt.seconds, timed_out=True))
        elif attempt.error is not None:
            outcomes.append(StepOutcome(f"Error: {attempt.error}", 0.0, False, attempt.seconds, error=True))
        else:
            outcomes.append(StepOutcome(*attempt.value, attempt.seconds))
    return outcomes


def start_environments(build: Callable[[], Environment] | list[Callable[[], Environment]], rows: list[dict],
                       timeout_s: float) -> list[Attempt]:  # fmt: skip
    """A fresh environment for each of `rows`: `build()` (one builder for all, or one per row: a run routing rows to
    environments) then `reset(row)`, all at once, each given `timeout_s` seconds (`run_guarded`). Each attempt's value
    is the started environment; where the constructor or `reset` raised or ran past its time, its `error` is the
    observation the sample's model reads instead (`Error: the environment could not start: ...`)."""
    builds = build if isinstance(build, list) else [build] * len(rows)

    def start(build_one: Callable[[], Environment], row: dict) -> Environment:
        environment = build_one()
        environment.reset(row)
        return environment

    attempts = run_guarded([functools.partial(start, one, row) for one, row in zip(builds, rows)], timeout_s)
    for attempt in attempts:
        if attempt.error is not None:
            reason = f"it {attempt.error}" if attempt.timed_out else attempt.error
            attempt.error = f"Error: the environment could not start: {reason}"
    return attempts


# ---------------------------------------------------------------- Python, in the code sandbox


class PythonTool(Tool):
    """`<python>print(12345 * 6789)</python>` -> what the program prints. The program is the model's: it runs in the
    code sandbox (open_instruct/sandbox: no network, a read-only root, an unprivileged user, limits, the whole process
    tree killed at its wall time), never in the trainer's processes. A program that fails answers with its last error
    line, as a Python user would read it."""

    name, start, end = "python", "<python>", "</python>"
    LIMITS = Limits(wall_time_s=4.0, max_output_bytes=1 << 14)

    def __init__(self):
        # Always isolated: --code_sandbox is the code rows' choice and does not apply here, so the sandbox's own
        # advice (--code_sandbox unsafe_no_isolation) would not change the answer; say what does.
        problem = isolation_problem()
        if problem is not None:
            raise SandboxUnavailable(f"the python tool runs the model's programs in the code sandbox, always isolated "
                                     f"(--code_sandbox does not apply to it), and {problem}; or drop python from --tools")
        self.sandbox = Sandbox(ISOLATED, self.LIMITS)

    def __call__(self, text: str) -> str:
        result = self.sandbox.run_python(text)
        if result.verdict == TIMEOUT:
            raise ToolError(f"the program ran past its {self.LIMITS.wall_time_s:g} s limit")
        if result.verdict == OUTPUT_LIMIT:
            raise ToolError(f"the program printed more than {self.LIMITS.max_output_bytes} bytes")
        if not result.ok:
            raise ToolError((result.stderr.strip().splitlines() or [result.verdict])[-1])
        return result.stdout

    def call(self, code: str) -> str:
        """Run a Python program in a sandbox (no network, no files kept) and answer what it prints.

        Args:
            code: the program, e.g. print(12345 * 6789)
        """
        return self(code)


# ---------------------------------------------------------------- the org chart (a native-format environment)


class OrgChart(Environment):
    """The embedded native tool-use task's environment (data/org_chart_task.py, `--tools org_chart` with a native
    `--tool_call_parser`): `manager_of(person)` answers from the row's own org chart, its `managers` column (JSON,
    person -> manager). It gives no reward of its own (the verifier grades the final answer) and never ends a sample:
    a turn without a call does."""

    schemas = ({"type": "function", "function": {
        "name": "manager_of", "description": "The name of a person's manager in the org chart.",
        "parameters": {"type": "object", "properties": {"person": {"type": "string", "description": "a first name"}},
                       "required": ["person"]}}},)  # fmt: skip

    def reset(self, row: dict) -> None:
        managers = row.get("managers")
        self.managers = json.loads(managers) if isinstance(managers, str) else dict(managers or {})

    def step_calls(self, calls: list, model_text: str) -> tuple[list[str], float, bool]:
        results = []
        for call in calls:
            if call.error is not None:
                self.errors += 1
                results.append(f"Error: {call.error}")
            else:
                results.append(manager_answer(self.managers, call.arguments["person"]))
        return results, 0.0, False


# ---------------------------------------------------------------- the registries

TOOLS: dict[str, Callable[[], Tool]] = {"calculator": Calculator, "python": PythonTool}
# Environments by name: the built-in ones, and those registered in code (ENVIRONMENTS["name"] = MyEnvironment, a class
# taking no arguments).
ENVIRONMENTS: dict[str, Callable[[], Environment]] = {"org_chart": OrgChart}
FILE_USAGE = ("give a built-in name, or path/to/file.py:name for a Tool or Environment subclass, or a typed function, "
              "of your own")


def tool_class(name: str) -> type:
    """The class a --tools name stands for: a registered tool's or environment's, or `path/to/file.py:name` imported
    from the user's own file (trusted code, like --reward_function's): a class, or a typed function made a Tool class
    by `function_tool`. A ValueError in one line otherwise."""
    if name in TOOLS:
        return TOOLS[name]
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    path, separator, class_name = name.rpartition(":")
    if not separator or not path.endswith(".py"):
        known = ", ".join(sorted(TOOLS) + sorted(ENVIRONMENTS))
        raise ValueError(f"--tools {name}: unknown; expected names from {known}, or path/to/file.py:name")
    if not os.path.isfile(path):
        raise ValueError(f"--tools {name}: {path} is not a file; {FILE_USAGE}")
    module_name = "open_instruct_tools_" + re.sub(r"\W", "_", os.path.abspath(path))
    module = sys.modules.get(module_name) or import_file(name, path, module_name, "--tools", FILE_USAGE)
    found = getattr(module, class_name, None)
    if inspect.isfunction(found):
        return function_tool(found)
    if not (isinstance(found, type) and issubclass(found, (Tool, Environment))):
        raise ValueError(f"--tools {name}: {path} defines no Tool or Environment subclass or function {class_name!r}; "
                         f"{FILE_USAGE}")
    return found


@functools.cache  # one class per function: the name stands for the same class each time it is looked up
def function_tool(function: Callable) -> type[Tool]:
    """A plain function as a Tool class: named as the function, its schema its typed signature and docstring; called
    natively with its keyword arguments, or with tags (<name>text</name>) with the text as its one argument."""
    name = function.__name__

    def tagged(self, text: str) -> str:
        return str(function(text))

    def call(self, **arguments) -> str:
        return str(function(**arguments))

    return type(name, (Tool,), {"name": name, "start": f"<{name}>", "end": f"</{name}>", "__call__": tagged,
                                "call": call, "function": staticmethod(function), "__doc__": function.__doc__})  # fmt: skip


def tool_names_problem(names: list[str]) -> str | None:
    """What is wrong with `--tools names`, or None: unknown names or files, repeats, an environment beside anything
    else, and tools whose end strings clash."""
    unknown = [name for name in names if name not in TOOLS and name not in ENVIRONMENTS and ":" not in name]
    if unknown:
        known = ", ".join(sorted(TOOLS) + sorted(ENVIRONMENTS))
        return f"--tools {' '.join(unknown)}: unknown; expected names from {known}, or path/to/file.py:name"
    try:
        classes = [tool_class(name) for name in names]
    except ValueError as error:
        return str(error)
    if len(set(names)) != len(names):
        return f"--tools {' '.join(names)} names a tool twice; name each once"
    environments = [name for name, found in zip(names, classes) if issubclass(found, Environment)]
    if environments and len(names) > 1:
        return f"--tools {' '.join(names)}: the environment {environments[0]} runs alone; pass it without other names"
    built = []
    for name, found in zip(names, classes):
        instance, problem = build_at_start(name, found)
        if problem is not None:
            return problem
        built.append(instance)
    ends = [instance.end for instance in built if isinstance(instance, Tool)]
    end_strings = [found.end_strings if issubclass(found, Environment) else (found.end,) for found in classes]
    # An environment that takes native calls (`step_calls`) needs none: its turns end on the stop token.
    empty = [name for name, found, strings in zip(names, classes, end_strings)
             if not (strings and all(strings)) and not (not strings and takes_calls(found))]  # fmt: skip
    if empty:
        return f"--tools {' '.join(empty)}: a tool or environment needs non-empty end strings to be called"
    if len(set(ends)) != len(ends):
        return f"--tools {' '.join(names)}: two tools end their calls with the same string; the engine cannot tell them apart"
    return None


def build_at_start(name: str, found: type) -> tuple[object, str | None]:
    """One instance of the class `--tools name` stands for, built before any model loads, so that a constructor that
    cannot work (a missing key, the python tool without its sandbox) is one line naming the flag, file, class and fix
    instead of a failure in the engine's generation thread. (instance, None), or (None, the line)."""
    try:
        return found(), None
    except SandboxUnavailable as error:  # the python tool where the sandbox cannot isolate: the message says why
        return None, f"--tools {name}: {error}"
    except Exception as error:  # noqa: BLE001 - the user's own code: whatever it raises is the answer
        try:
            where = inspect.getsourcefile(found) or found.__module__
        except TypeError:  # a class with no source file (made at run time)
            where = found.__module__
        cause = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        return None, (
            f"--tools {name}: {found.__name__}() in {where} raised {cause} when built (the engine builds one per "
            f"sample, with no arguments); fix its __init__, or drop {name} from --tools"
        )


def absolute_names(names: list[str]) -> list[str]:
    """The names with each file's path made absolute (engine actors may run in another working directory)."""
    return [f"{os.path.abspath(name.rpartition(':')[0])}:{name.rpartition(':')[2]}" if ":" in name else name
            for name in names]  # fmt: skip


def environment_builder(names: list[str], wrapper: str = DEFAULT_OUTPUT_WRAPPER,
                        cut_output: Callable[[str], tuple[str, bool]] | None = None) -> Callable[[], Environment]:  # fmt: skip
    """What builds a fresh environment for one sample of a run with `--tools names` (checked by `tool_names_problem`):
    the classes are found once, here, so that building runs no import."""
    classes = [tool_class(name) for name in names]
    if len(classes) == 1 and issubclass(classes[0], Environment):
        return classes[0]
    return lambda: ToolEnvironment([found() for found in classes], wrapper, cut_output)


def build_environment(names: list[str], wrapper: str = DEFAULT_OUTPUT_WRAPPER,
                      cut_output: Callable[[str], tuple[str, bool]] | None = None) -> Environment:  # fmt: skip
    """A fresh environment for one sample of a run with `--tools names`."""
    return environment_builder(names, wrapper, cut_output)()
