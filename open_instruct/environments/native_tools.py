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

`tool_call_format` resolves the flags once (the checks before any model loads use it too): the parser that
`--tool_call_parser` stands for with this template, the template, and the tools' schemas.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

from open_instruct.data.chat_templates import resolve_chat_template
from open_instruct.environments.chat_turns import ToolTurns
from open_instruct.environments.tool_parsers import (
    AUTO,
    TAGS,
    VllmToolCalls,
    renders_tools,
    resolve_parser_name,
)
from open_instruct.environments.tool_schemas import check_schema, tool_schema
from open_instruct.rl import tools

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
    """The schemas of the tools `--tools names` builds (each checked); a ValueError in one line for a tool with none or
    an invalid one. An environment has none: it is called with its end strings."""
    schemas = []
    for name in names:
        found = tools.tool_class(name)
        if not issubclass(found, tools.Tool):
            raise ValueError(f"--tools {name} is an environment, called by its end strings; pass --tool_call_parser tags")
        try:
            schema = tool_schema(found)
        except ValueError as error:
            raise ValueError(f"--tools {name}: {error}") from None
        if schema is None:
            raise ValueError(f"--tools {name}: the tool has no schema; declare `schema = {{...}}` on it or give it a "
                             f"typed `call(self, ...)` method, or pass --tool_call_parser tags")  # fmt: skip
        problem = check_schema(schema)
        if problem is not None:
            raise ValueError(f"--tools {name}: {problem}")
        schemas.append(schema)
    return schemas


def tool_call_format(names: list[str], parser: str, tokenizer, chat_template_name: str | None) -> ToolCallFormat:
    """Resolve `--tool_call_parser parser` for `--tools names` with the tokenizer's template (or the named one); a
    ValueError in one line when they do not fit together (checked before any model loads)."""
    is_environment = any(issubclass(tools.tool_class(name), tools.Environment) for name in names)
    if parser == TAGS or (is_environment and parser == AUTO):
        return ToolCallFormat(TAGS, "", [])
    if parser == AUTO and chat_template_name is None and not getattr(tokenizer, "chat_template", None):
        return ToolCallFormat(TAGS, "", [])  # a base model's tokenizer: no template to read a format from
    _, chat_template = resolve_chat_template(tokenizer, chat_template_name)

    def render(with_tools):
        messages = [{"role": "user", "content": "Hi"}]
        return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=True, tools=with_tools)  # fmt: skip

    # Whether the template shows tools is asked with a probe schema: under `auto`, a template that shows none keeps
    # the tags, and tools written for the tags need no schema.
    resolved = resolve_parser_name(parser, chat_template, renders_tools(render, [PROBE_SCHEMA]))
    if resolved == TAGS:
        return ToolCallFormat(TAGS, "", [])
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


def native_builder(settings: dict, tokenizer, cut_output: Callable[[str], tuple[str, bool]] | None = None
                   ) -> Callable[[], NativeToolEnvironment] | None:  # fmt: skip
    """What builds one sample's environment for the engine's tool settings (a batch's params["tools"]) in the native
    format; None when the run uses today's tags (rl/tools.py, environments/routing.py). The parser and the turns are
    built once, here, and shared by the samples (both stateless)."""
    names = settings["names"]
    if settings.get("parser", TAGS) == TAGS or settings.get("environment_column") is not None:
        return None  # today's tags (a checkpoint older than the flag too), or rows routed to environments
    found = tool_call_format(names, settings.get("parser", TAGS), tokenizer, settings.get("chat_template_name"))
    if found.parser == TAGS:
        return None
    parser = VllmToolCalls(found.parser, tokenizer, found.schemas)
    turns = ToolTurns(tokenizer, found.chat_template, found.schemas)
    if not turns.exact:
        log.warning("the chat template's render of a conversation with tool turns does not extend its render without "
                    "them: tool turns are appended after the sampled tokens, not token-exact")  # fmt: skip
    classes = [tools.tool_class(name) for name in names]
    return lambda: NativeToolEnvironment([found_class() for found_class in classes], parser, turns,
                                         settings["timeout_s"], cut_output)  # fmt: skip
