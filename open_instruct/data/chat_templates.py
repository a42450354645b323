"""Chat templates: which template renders a prompt, and the named templates written here.

A prompt is rendered by the tokenizer's own chat template unless a template is named
(`--chat_template_name`); a named template also serves tokenizers that ship without one (base
models). Every prompt is rendered with `add_generation_prompt=True`, so the text ends where the
assistant's answer starts and generation continues right after it.

The named templates add no BOS token: the rendered text is tokenised with
`add_special_tokens=False`, so the template alone decides the special tokens (the tokenizers'
own templates, e.g. Llama 3's, write their BOS themselves).
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: converters need no transformers import
    from transformers import PreTrainedTokenizerBase


# Tulu style: a role header line, the content, a newline; assistant turns end with EOS.
TULU_TEMPLATE = (
    "{% for message in messages %}"
    r"{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    r"{{ '\n' }}"
    "{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# One "role: content" line per message; for base models and debugging. No trailing space after
# "assistant:" because BPE vocabularies put the space in front of the next word's token.
SIMPLE_CONCAT_TEMPLATE = (
    "{% for message in messages %}"
    r"{{ message['role'] + ': ' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)

# ChatML (Qwen, SmolLM2, ...) for tokenizers that know the <|im_start|>/<|im_end|> tokens.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    r"{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# ChatML with tools, in the Hermes / Qwen 2.5 format that vLLM's `hermes` tool parser reads. Given `tools=` (OpenAI-style
# function schemas), the system turn lists them as JSON inside <tools></tools> and asks for calls as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>; an assistant message may carry `tool_calls` (rendered the same
# way after its content); consecutive `tool` messages are one user turn of <tool_response> blocks. Without tools it
# renders as `chatml`.
CHATML_TOOLS_TEMPLATE = (
    "{%- set has_system = messages and messages[0]['role'] == 'system' %}"
    "{%- if tools %}"
    r"{{ '<|im_start|>system\n' }}"
    r"{{ messages[0]['content'] + '\n\n' if has_system else 'You are a helpful assistant.\n\n' }}"
    r"{{ '# Tools\n\nYou can call these functions, whose JSON schemas are listed inside <tools></tools>:\n<tools>' }}"
    r"{%- for tool in tools %}{{ '\n' + (tool | tojson) }}{%- endfor %}"
    r"{{ '\n</tools>\n\nTo call one, answer with its name and a JSON object of its arguments inside "
    r"<tool_call></tool_call>, one block per call:\n<tool_call>\n{\"name\": <function name>, \"arguments\": "
    r"<arguments object>}\n</tool_call>\nEach result comes back inside <tool_response></tool_response>.<|im_end|>\n' }}"
    "{%- elif has_system %}"
    r"{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    r"{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    r"{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    r"{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{%- endif %}"
    "{%- elif not (loop.first and message['role'] == 'system') %}"
    r"{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set function = call['function'] if call['function'] is defined else call %}"
    r"{{ '\n<tool_call>\n{\"name\": \"' + function['name'] + '\", \"arguments\": ' }}"
    r"{{ function['arguments'] if function['arguments'] is string else function['arguments'] | tojson }}"
    r"{{ '}\n</tool_call>' }}"
    "{%- endfor %}"
    r"{{ '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    r"{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)

NAMED_CHAT_TEMPLATES = {
    "tulu": TULU_TEMPLATE,
    "simple_concat": SIMPLE_CONCAT_TEMPLATE,
    "plain": SIMPLE_CONCAT_TEMPLATE,  # an alias: the name people reach for first
    "chatml": CHATML_TEMPLATE,
    "chatml_tools": CHATML_TOOLS_TEMPLATE,
}

TOKENIZER_TEMPLATE_LABEL = "tokenizer"


def resolve_chat_template(tokenizer: "PreTrainedTokenizerBase", chat_template_name: str | None) -> tuple[str, str]:
    """Return (label, Jinja template): the named template, else the tokenizer's own one.

    The label is the template name, or "tokenizer" for the tokenizer's own template.
    """
    if chat_template_name is not None:
        if chat_template_name not in NAMED_CHAT_TEMPLATES:
            raise ValueError(
                f"chat_template_name={chat_template_name!r} is not a known template; "
                f"use one of {sorted(NAMED_CHAT_TEMPLATES)} or leave it unset to use the tokenizer's own template."
            )
        return chat_template_name, NAMED_CHAT_TEMPLATES[chat_template_name]
    own_template = getattr(tokenizer, "chat_template", None)
    if not own_template:
        raise ValueError(
            f"The tokenizer {tokenizer.name_or_path!r} has no chat template and no chat_template_name was given; "
            f"pass --chat_template_name tulu (or one of {sorted(NAMED_CHAT_TEMPLATES)})."
        )
    return TOKENIZER_TEMPLATE_LABEL, own_template


def render_prompt(messages: list[dict], tokenizer: "PreTrainedTokenizerBase", chat_template: str,
                  tools: list[dict] | None = None) -> str:  # fmt: skip
    """Render prompt messages as text ending with the generation prompt (the assistant header). `tools`: the function
    schemas of --tools, shown to the model by templates that render them (chatml_tools)."""
    return tokenizer.apply_chat_template(
        messages, chat_template=chat_template, tokenize=False, add_generation_prompt=True, tools=tools or None
    )
