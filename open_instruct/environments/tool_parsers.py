"""Reading the tool calls in a model's turn (`--tool_call_parser`).

`tags` is this project's own protocol (`<calculator>...</calculator>`, answered with `<output>...</output>`; environments/tools.py).
Every other name is one of vLLM's tool parsers (`hermes` for Qwen / ChatML `<tool_call>{json}</tool_call>`,
`llama3_json`, `mistral`, ...), used through its `extract_tool_calls(text, request)`, as vLLM's own server uses it.
`auto` picks from the chat template's text: `<tool_call>` -> hermes, Llama 3's `<|python_tag|>`/ipython ->
llama3_json, `[TOOL_CALLS]` -> mistral; a template that renders no tools -> tags (the model is shown no schema).

Every way a call can fail becomes a `ToolCall` with an `error` the model reads as the tool's result (counted in
tools/errors), never an exception: malformed JSON (vLLM's hermes parser then answers "no calls" and logs a traceback;
its start tag in the text says it was an attempt), an unknown function, arguments that do not fit the schema.
"""

import json
import logging
from dataclasses import dataclass

from open_instruct.environments.tool_schemas import validate_arguments

TAGS, AUTO = "tags", "auto"
# What a chat template's text holds -> the vLLM parser of its format (`auto`), looked for in this order.
TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"), ("ipython", "llama3_json"),
                    ("[TOOL_CALLS]", "mistral"))  # fmt: skip
FIX = ("pass --tool_call_parser NAME (hermes, llama3_json, mistral, ... or tags) and a template that renders tools "
       "(--chat_template_name chatml_tools)")


def vllm_parser_names() -> list[str]:
    """The names vLLM's ToolParserManager knows (importing vLLM: a few seconds)."""
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.list_registered()


def renders_tools(render, schemas: list[dict]) -> bool:
    """Whether a template shows the model its tools: `render(tools)` (a short conversation rendered with `tools=`)
    differs with the schemas from without them."""
    return bool(schemas) and render(schemas) != render(None)


def resolve_parser_name(name: str, chat_template: str, template_renders_tools: bool) -> str:
    """The parser `--tool_call_parser name` stands for with this chat template; a ValueError in one line when `auto`
    cannot tell, or a native parser is asked for and the template renders no tools."""
    if name == TAGS:
        return TAGS
    if name == AUTO:
        detected = next((parser for marker, parser in TEMPLATE_MARKERS if marker in chat_template), None)
        if detected is None and not template_renders_tools:
            return TAGS  # a template with no tool support: today's tag protocol, as before native calls existed
        if detected is None:
            raise ValueError(f"--tool_call_parser auto: the chat template renders tools in a format it cannot detect; {FIX}")
    else:
        detected = name
    if not template_renders_tools:
        raise ValueError(f"--tool_call_parser {detected}: the chat template renders no tools (the model would never see "
                         f"their schemas); pass --chat_template_name chatml_tools (or a template that renders tools=), "
                         f"or --tool_call_parser tags")  # fmt: skip
    return detected


@dataclass
class ToolCall:
    """One call in a model's turn: the function's name and its arguments, or `error`, the text the model reads instead
    of a result (why the call could not run)."""

    name: str | None
    arguments: dict | None
    error: str | None = None


class VllmToolCalls:
    """The calls in a turn's text, read by vLLM's tool parser `name` and checked against the tools' `schemas`."""

    def __init__(self, name: str, tokenizer, schemas: list[dict]):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        parser_class = ToolParserManager.get_tool_parser(name)
        self.parser = parser_class(tokenizer, None)
        # A malformed call is answered here as a counted tool error; the parser's own traceback for it would say it
        # again, once per sample, in the run's log.
        logging.getLogger(parser_class.__module__).setLevel(logging.CRITICAL + 1)
        self.request = self.parser.adjust_request(ChatCompletionRequest(model="policy", messages=[], tools=schemas))
        self.schemas = {schema["function"]["name"]: schema for schema in schemas}
        # The text that opens a call in this format (hermes: "<tool_call>"): present with no call parsed = malformed.
        self.start = getattr(self.parser, "tool_call_start_token", None) or getattr(self.parser, "bot_token", None)

    def attempted(self, text: str) -> bool:
        """Whether the turn tries to call a tool (well-formed or not)."""
        return bool((self.start and self.start in text) or self.extract(text).tools_called)

    def extract(self, text: str):
        """vLLM's ExtractedToolCallInformation for `text`, or the exception the parser raised on it."""
        try:
            return self.parser.extract_tool_calls(text, self.request)
        except Exception as error:  # noqa: BLE001 - a parser's failure on model text is the model's error to read
            return error

    def calls(self, text: str) -> list[ToolCall]:
        """The turn's calls, each with its parsed arguments or the error the model reads; [] when it makes none."""
        extracted = self.extract(text)
        if not isinstance(extracted, Exception) and extracted.tools_called:
            return [self.checked(call.function.name, call.function.arguments) for call in extracted.tool_calls]
        if isinstance(extracted, Exception) or (self.start and self.start in text):  # an attempt that did not parse
            return [ToolCall(None, None, f"the tool call is not valid JSON of the form {self.example()}")]
        return []

    def example(self) -> str:
        """What a call looks like, for the error text (hermes: <tool_call>{"name": "calculator", "arguments": {...}})."""
        name = next(iter(self.schemas), "name")
        return f'{self.start or ""}{{"name": "{name}", "arguments": {{...}}}}'

    def checked(self, name: str, arguments_json: str) -> ToolCall:
        """A parsed call, checked: a known function, arguments that are a JSON object fitting its schema."""
        if name not in self.schemas:
            return ToolCall(name, None, f"unknown function {name!r}; the tools are {', '.join(self.schemas)}")
        try:
            arguments = json.loads(arguments_json) if arguments_json else {}
        except (TypeError, ValueError):
            return ToolCall(name, None, f"{name}: the arguments are not valid JSON")
        if not isinstance(arguments, dict):
            return ToolCall(name, None, f"{name}: the arguments must be a JSON object of the parameters, got {arguments_json[:80]}")
        problem = validate_arguments(self.schemas[name], arguments)
        return ToolCall(name, arguments, problem)
