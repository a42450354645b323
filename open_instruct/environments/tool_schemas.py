"""A tool's OpenAI-style function schema: what the chat template shows the model and what its calls are checked against.

    {"type": "function", "function": {"name": "calculator", "description": "...", "parameters": {JSON Schema}}}

A schema is declared on a Tool (`schema = {...}`), or derived from a typed signature and its docstring: a Tool's
`call(self, expression: str) -> str` method, or a plain function named by `--tools file.py:name`. Parameter types map
to JSON Schema (int -> integer, float -> number, str -> string, bool -> boolean, list[T] -> array of T, Literal[...]
-> enum); a parameter with a default is optional; the docstring's summary is the description and its `Args:` lines
describe the parameters. `check_schema` says what is wrong with a schema in one line; `validate_arguments` checks a
call's arguments against it (the model's mistakes become tool errors it reads, never exceptions).
"""

import inspect
import types
import typing
from collections.abc import Callable

import docstring_parser
import jsonschema

from open_instruct.environments.tools import Tool

JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", dict: "object"}


def type_schema(annotation, where: str) -> dict:
    """The JSON Schema of one parameter's type annotation; a ValueError naming `where` for a type it cannot say."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in JSON_TYPES:
        return {"type": JSON_TYPES[annotation]}
    if origin is list:
        return {"type": "array", "items": type_schema(arguments[0], where)} if arguments else {"type": "array"}
    if origin is typing.Literal:
        return {"enum": list(arguments)}
    if origin in (typing.Union, types.UnionType):
        options = [argument for argument in arguments if argument is not type(None)]
        if len(options) == 1:  # Optional[T]: the default (None) makes it optional
            return type_schema(options[0], where)
        return {"anyOf": [type_schema(option, where) for option in options]}
    raise ValueError(f"{where} has the type {annotation!r}; a tool's parameters take int, float, str, bool, dict, "
                     f"list[...], Literal[...] or Optional of these")  # fmt: skip


def function_schema(function: Callable, name: str | None = None, method: bool = False) -> dict:
    """The schema of a typed function (or bound method; `method`: an unbound one, whose `self` is left out): its name,
    its docstring's summary as the description, one property per parameter (described by the docstring's `Args:`),
    required unless it has a default."""
    name = name or function.__name__
    doc = docstring_parser.parse(inspect.getdoc(function) or "")
    described = {param.arg_name: param.description for param in doc.params}
    hints = typing.get_type_hints(function)
    properties, required = {}, []
    for parameter in list(inspect.signature(function).parameters.values())[int(method) :]:
        where = f"the tool {name!r}'s parameter {parameter.name!r}"
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ValueError(f"{where} is *args or **kwargs; a tool's parameters must each be named and typed")
        if parameter.name not in hints:
            raise ValueError(f"{where} has no type annotation; annotate it (e.g. {parameter.name}: str)")
        properties[parameter.name] = type_schema(hints[parameter.name], where)
        if described.get(parameter.name):
            properties[parameter.name]["description"] = described[parameter.name]
        if parameter.default is inspect.Parameter.empty:
            required.append(parameter.name)
    description = " ".join(part for part in (doc.short_description, doc.long_description) if part)
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def tool_schema(tool: Tool | type[Tool]) -> dict | None:
    """A tool's schema (of the class or an instance: a class's is read without building it): its declared `schema`,
    else derived from its plain function (a `--tools file.py:name` tool) or its typed `call` method; None when it has
    none of these (it can only be called with its tags)."""
    if tool.schema is not None:
        return tool.schema
    if getattr(tool, "function", None) is not None:
        return function_schema(tool.function, tool.name)
    call = getattr(tool, "call", None)
    return None if call is None else function_schema(call, tool.name, method=isinstance(tool, type))


def check_schema(schema) -> str | None:
    """What is wrong with a function schema, in one line, or None: its shape, and `parameters` must be valid JSON
    Schema (checked against jsonschema's meta-schema) describing an object."""
    function = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(function, dict):
        return 'a tool schema is {"type": "function", "function": {"name", "description", "parameters"}}'
    name = function.get("name")
    if not isinstance(name, str) or not name:
        return "a tool schema's function needs a non-empty string name"
    if not isinstance(function.get("description", ""), str):
        return f"the tool {name!r}'s description must be a string"
    parameters = function.get("parameters", {"type": "object"})
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as error:
        where = "/".join(str(part) for part in error.absolute_path) or "parameters"
        return f"the tool {name!r}'s parameters are not valid JSON Schema at {where}: {error.message}"
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        return f'the tool {name!r}\'s parameters must be a JSON Schema with "type": "object"'
    return None


def validate_arguments(schema: dict, arguments) -> str | None:
    """None when `arguments` (a call's parsed JSON) fit the schema's parameters, else a short message for the model."""
    parameters = schema["function"].get("parameters", {"type": "object"})
    validator = jsonschema.validators.validator_for(parameters)(parameters)
    error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path)
    return f"{schema['function']['name']}: {('argument ' + where + ': ') if where else ''}{error.message}"
