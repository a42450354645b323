"""Tools called the way real models call them: function schemas in the chat template, calls parsed by vLLM's tool
parser, results as the template's own tool turns (`--tool_call_parser`, docs/tools.md "Native tool calls").

A native turn ends where the model ends its turn (its stop token, ChatML's `<|im_end|>`), not at a tool's end string:
the engine asks `makes_calls(turn_text)` of a sample that finished on its stop token, and when the turn holds a call
(well-formed or not) the sample goes on. The engine runs the turn in three parts, as a ToolEnvironment's
(environments/tool_pool.py): `calls` reads the turn's calls in the engine's thread, each call runs in a worker process
(cut at --tool_timeout_s, its process replaced), and `observation`, again in the engine's thread, renders the token ids
of the tool turns and the next generation prompt (chat_turns.ToolTurns), which the engine appends as they are. The
tokenizer (the parser's, the template's, the output cut's) is used in those two parts only: never in a pool thread,
since a fast tokenizer shared between threads is not safe. A turn with no call ends the sample as before.

A user's environment that defines `step_calls(calls, model_text)` (environments/tools.py `Environment`) takes part the same way
(`NativeEnvironment`): the calls are read in the engine's thread, its `step_calls` runs in a pool thread under the
time limit, and its results are rendered as tool turns back in the engine's thread. `native_router` builds each
sample's environment, by its row's --environment_column value where there is one (routing.py).

`tool_call_format` resolves the flags once (the checks before any model loads use it too): the parser that
`--tool_call_parser` stands for with this template, the template, and the tools' schemas.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

from open_instruct.data.chat_templates import resolve_chat_template
from open_instruct.environments import routing, tools
from open_instruct.environments.chat_turns import ToolTurns
from open_instruct.environments.tool_parsers import (
    AUTO,
    TAGS,
    ToolCall,
    VllmToolCalls,
    renders_tools,
    resolve_parser_name,
)
from open_instruct.environments.tool_schemas import check_schema, tool_schema

log = logging.getLogger(__name__)
UNREADABLE = "no tool call could be read in the turn"
PROBE_SCHEMA = {"type": "function", "function": {"name": "probe", "description": "",
                                               "parameters": {"type": "object", "properties": {}}}}  # fmt: skip


@dataclass
class ToolCallFormat:
    """What `--tools`, `--tool_call_parser` and the chat template make of a run: the parser (`tags` or a vLLM
    parser's name), the chat template's text (empty with tags) and the tools' schemas (for the prompts' `tools=`;
    empty with tags)."""

    parser: str
    chat_template: str
    schemas: list[dict]


def tool_schemas(names: list[str]) -> list[dict]:
    """The schemas of the tools and environments `--tools names` builds (each checked; the same schema declared twice
    is shown once); a ValueError in one line for a tool with none or an invalid one, an environment that cannot take
    native calls (no `step_calls`) or offers no function, and two different functions of one name."""
    schemas = []
    for name in names:
        for schema in name_schemas(name):
            problem = check_schema(schema)
            if problem is not None:
                raise ValueError(f"--tools {name}: {problem}")
            same_name = [known for known in schemas if known["function"]["name"] == schema["function"]["name"]]
            if same_name and same_name[0] != schema:
                raise ValueError(f"--tools {' '.join(names)}: two different functions are named "
                                 f"{schema['function']['name']!r} (every prompt shows them all); rename one")  # fmt: skip
            if not same_name:
                schemas.append(schema)
    return schemas


def name_schemas(name: str) -> list:
    """The schemas one --tools name offers the model: a tool's one, or an environment's `schemas` (unchecked)."""
    found = tools.tool_class(name)
    if issubclass(found, tools.Environment):
        if not tools.takes_calls(found):
            raise ValueError(f"--tools {name} is an environment called by its end strings (it has no "
                             f"step_calls(calls, model_text)); give it step_calls and `schemas`, or pass "
                             f"--tool_call_parser tags")  # fmt: skip
        if not found.schemas:
            raise ValueError(f"--tools {name}: the environment offers no function; list its functions' schemas in "
                             f"`schemas = [{{\"type\": \"function\", ...}}]`, or pass --tool_call_parser tags")  # fmt: skip
        return list(found.schemas)
    try:
        schema = tool_schema(found)
    except ValueError as error:
        raise ValueError(f"--tools {name}: {error}") from None
    if schema is None:
        raise ValueError(f"--tools {name}: the tool has no schema; declare `schema = {{...}}` on it or give it a "
                         f"typed `call(self, ...)` method, or pass --tool_call_parser tags")  # fmt: skip
    return [schema]


def tool_call_format(names: list[str], parser: str, tokenizer, chat_template_name: str | None) -> ToolCallFormat:
    """Resolve `--tool_call_parser parser` for `--tools names` with the tokenizer's template (or the named one); a
    ValueError in one line when they do not fit together (checked before any model loads)."""
    # `auto` keeps the tags for an environment that only reads text (no `step_calls`): it is called by its end strings.
    reads_text = any(issubclass(found, tools.Environment) and not tools.takes_calls(found)
                     for found in map(tools.tool_class, names))  # fmt: skip
    if parser == TAGS or (reads_text and parser == AUTO):
        return tags_format(names)
    if parser == AUTO and chat_template_name is None and not getattr(tokenizer, "chat_template", None):
        return tags_format(names)  # a base model's tokenizer: no template to read a format from
    _, chat_template = resolve_chat_template(tokenizer, chat_template_name)

    def render(with_tools):
        messages = [{"role": "user", "content": "Hi"}]
        return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=True, tools=with_tools)  # fmt: skip

    # Whether the template shows tools is asked with a probe schema: under `auto`, a template that shows none keeps
    # the tags, and tools written for the tags need no schema.
    resolved = resolve_parser_name(parser, chat_template, renders_tools(render, [PROBE_SCHEMA]))
    if resolved == TAGS:
        return tags_format(names)
    schemas = tool_schemas(names)
    try:
        VllmToolCalls(resolved, tokenizer, schemas)
    except KeyError:
        raise ValueError(f"--tool_call_parser {parser}: vLLM knows no tool parser {resolved!r}; pass hermes, "
                         f"llama3_json, mistral, ... (vLLM's ToolParserManager), tags or auto") from None  # fmt: skip
    except Exception as error:  # noqa: BLE001 - the parser refuses this tokenizer: say so in one line
        raise ValueError(f"--tool_call_parser {resolved}: {' '.join(str(error).split())}; pick the parser of this "
                         f"model's format, or --tool_call_parser tags") from None  # fmt: skip
    return ToolCallFormat(resolved, chat_template, schemas)


def tags_format(names: list[str]) -> ToolCallFormat:
    """Today's tag protocol; a ValueError in one line when an environment of `names` has no end string (it takes
    native calls only, `step_calls`: a tags run could never call it)."""
    for name in names:
        found = tools.tool_class(name)
        if issubclass(found, tools.Environment) and tools.takes_calls(found) and not found.end_strings:
            raise ValueError(f"--tools {name} takes native tool calls only (step_calls, no end_strings) and this run "
                             f"uses the tags protocol; pass --tool_call_parser hermes (or the model's format) with "
                             f"a template that renders tools (--chat_template_name chatml_tools)")  # fmt: skip
    return ToolCallFormat(TAGS, "", [])


class NativeToolEnvironment(tools.Environment):
    """One sample's tools in the native format: each turn that makes calls is answered with the template's tool turns.
    No string ends a turn (`end_strings` is empty): the engine asks `makes_calls` when the model stops.

    `calls` and `observation` are one turn's two halves (the engine runs the calls between them, tool_pool.py): the
    turn's text and its calls' names are kept from the one to the other (a sample has one turn running at a time)."""

    def __init__(self, tool_list: list[tools.Tool], parser: VllmToolCalls, turns: ToolTurns, timeout_s: float,
                 cut_output: Callable[[str], tuple[str, bool]] | None = None):  # fmt: skip
        self.tools = {tool.name: tool for tool in tool_list}
        self.parser, self.turns, self.timeout_s = parser, turns, timeout_s
        self.cut_output = cut_output or (lambda text: (text, False))
        self.end_strings = ()
        self.errors = 0
        self.outputs_cut = 0
        self.turn_text, self.call_names = "", []

    def makes_calls(self, turn_text: str) -> bool:
        return self.parser.attempted(turn_text)

    def step(self, model_text: str) -> tuple[tools.TokenObservation, float, bool]:
        """The whole turn in the calling thread, no time limit (as ToolEnvironment.step): the engine runs it in parts."""
        outputs = [(call, True) if place is None else tools.call_output(self.tools[place], call)
                   for place, call in self.calls(model_text)]  # fmt: skip
        return self.observation(outputs), 0.0, False

    def calls(self, model_text: str) -> list[tuple[str | None, dict | str]]:
        """The turn's calls, in order: (the tool's name, its arguments, checked against its schema), or, for a call
        that cannot be run (malformed JSON, an unknown function, arguments that do not fit), (None, the error the model
        reads), answered at once without a worker."""
        self.turn_text, self.call_names = model_text, ["error"]  # kept should the parser raise: the model reads why
        read = self.parser.calls(model_text)
        self.call_names = [call.name or "error" for call in read] or ["error"]
        if not read:
            return [(None, f"Error: {UNREADABLE}")]
        return [(call.name, call.arguments) if call.error is None else (None, f"Error: {call.error}") for call in read]

    def observation(self, outputs: list[tuple[str, bool]]) -> tools.TokenObservation:
        """The tool turns answering the turn `calls` read, from each call's (output, failed) in order: each output cut
        to its budget (counted in `outputs_cut`), the failed ones counted in `errors`, rendered token-exactly after the
        turn's text (ToolTurns.after) with the next generation prompt."""
        results = []
        for name, (output, failed) in zip(self.call_names, outputs, strict=True):
            self.errors += failed
            output, was_cut = self.cut_output(output)
            self.outputs_cut += was_cut
            results.append((name, output))
        ids = self.turns.after(self.turn_text, results)
        return tools.TokenObservation(self.turns.tokenizer.decode(ids), ids)


class NativeEnvironment(tools.Environment):
    """A user's environment in the native format: each turn's calls, read by the run's parser, go to its
    `step_calls(calls, model_text)` (environments/tools.py `Environment`), and its answer becomes the template's tool turns.
    No string ends a turn: the engine asks `makes_calls` when the model stops, as of a NativeToolEnvironment.

    The engine runs a turn in three parts (tool_pool.py): `read_turn` parses the calls in its own thread, `answer_turn`
    runs the user's `step_calls` in a pool thread under --tool_timeout_s (user code that may hang), and `render`, back
    in the engine's thread, cuts each result to --tool_output_max_tokens and renders the tool turns token-exactly
    (ToolTurns.after). The parser's and the template's tokenizer is used in the first and last parts only."""

    def __init__(self, environment: tools.Environment, parser: VllmToolCalls, turns: ToolTurns,
                 cut_output: Callable[[str], tuple[str, bool]] | None = None):  # fmt: skip
        self.environment, self.parser, self.turns = environment, parser, turns
        self.cut_output = cut_output or (lambda text: (text, False))
        self.end_strings = ()
        self.bad_call_turns = 0  # turns holding a call that could not be read or checked (counted in `errors`)
        self.outputs_cut = 0
        self.turn_text, self.turn_calls = "", []

    @property
    def errors(self) -> int:
        return self.environment.errors + self.bad_call_turns

    def reset(self, row: dict) -> None:
        self.environment.reset(row)

    def makes_calls(self, turn_text: str) -> bool:
        return self.parser.attempted(turn_text)

    def step(self, model_text: str) -> tuple[tools.TokenObservation, float, bool]:
        """The whole turn in the calling thread, no time limit (the engine runs it in parts)."""
        self.read_turn(model_text)
        observation, reward, done = self.answer_turn()
        return self.render(observation), reward, done

    def read_turn(self, model_text: str) -> None:
        """The turn's calls, as the parser reads them (a call that cannot be read: its `error` set; a turn whose calls
        cannot be read at all: one such call), kept for `answer_turn` and `render`."""
        try:
            calls = self.parser.calls(model_text) or [ToolCall(None, None, UNREADABLE)]
        except Exception as error:  # noqa: BLE001 - a parser's failure on model text is the model's error to read
            calls = [ToolCall(None, None, tools.failure_text(error))]
        self.turn_text, self.turn_calls = model_text, calls
        self.bad_call_turns += any(call.error is not None for call in calls)

    def answer_turn(self) -> tuple[list[str] | str, float, bool]:
        """The user's `step_calls` on the turn `read_turn` read: (a result per call, or one text; reward; done). A list
        of another length than the calls raises (the model reads why)."""
        observation, reward, done = self.environment.step_calls(list(self.turn_calls), self.turn_text)
        if isinstance(observation, (list, tuple)) and len(observation) != len(self.turn_calls):
            raise ValueError(f"step_calls answered {len(observation)} results for {len(self.turn_calls)} calls; answer "
                             f"one per call, or one text for the turn")  # fmt: skip
        return observation, reward, done

    def render(self, observation: list[str] | str | tools.TokenObservation) -> tools.TokenObservation:
        """The tool turns of `observation` after the turn's text: a result per call (each a `tool` turn named by its
        call's function), or one text (one `tool` turn; also the error text of a step that raised or ran past its
        time), each cut to its budget (counted in `outputs_cut`); a TokenObservation as it is."""
        if isinstance(observation, tools.TokenObservation):
            return observation
        names = [call.name or "error" for call in self.turn_calls]
        if isinstance(observation, str):
            observation, names = [observation], names[:1]
        results = []
        for name, result in zip(names, observation, strict=True):
            result, was_cut = self.cut_output(str(result))
            self.outputs_cut += was_cut
            results.append((name, result))
        ids = self.turns.after(self.turn_text, results)
        return tools.TokenObservation(self.turns.tokenizer.decode(ids), ids)


NATIVE_ENVIRONMENTS = (NativeToolEnvironment, NativeEnvironment)  # the engine ends their turns on the stop token


def native_router(settings: dict, tokenizer, cut_output: Callable[[str], tuple[str, bool]] | None = None
                  ) -> Callable[[dict], Callable[[], tools.Environment]] | None:  # fmt: skip
    """What builds each sample's environment for the engine's tool settings (a batch's params["tools"]) in the native
    format: `route(row)` is the builder of the row's environment (routing.environment_router: with
    --environment_column the row's own, else --tools as a whole); None when the run uses today's tags. A group of
    tools is a NativeToolEnvironment, an environment with `step_calls` a NativeEnvironment. Every prompt shows every
    schema of --tools; a sample's calls are checked against its own environment's (another's is an unknown function).
    The parsers and the turns are built once, here, and shared by the samples (all stateless)."""
    names = settings["names"]
    if settings.get("parser", TAGS) == TAGS:
        return None  # today's tags (a checkpoint older than the flag too)
    found = tool_call_format(names, settings.get("parser", TAGS), tokenizer, settings.get("chat_template_name"))
    if found.parser == TAGS:
        return None
    turns = ToolTurns(tokenizer, found.chat_template, found.schemas)
    if not turns.exact:
        log.warning("the chat template's render of a conversation with tool turns does not extend its render without "
                    "them: tool turns are appended after the sampled tokens, not token-exact")  # fmt: skip

    def group_builder(group: list[str]) -> Callable[[], tools.Environment]:
        parser = VllmToolCalls(found.parser, tokenizer, tool_schemas(group))
        classes = [tools.tool_class(name) for name in group]
        if len(classes) == 1 and issubclass(classes[0], tools.Environment):
            return lambda: NativeEnvironment(classes[0](), parser, turns, cut_output)
        return lambda: NativeToolEnvironment([found_class() for found_class in classes], parser, turns,
                                             settings["timeout_s"], cut_output)  # fmt: skip

    written = settings.get("environment_names") or dict(zip(names, names))
    return routing.environment_router(written, settings.get("environment_column"), group_builder=group_builder)
