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

NAMED_CHAT_TEMPLATES = {
    "tulu": TULU_TEMPLATE,
    "simple_concat": SIMPLE_CONCAT_TEMPLATE,
    "plain": SIMPLE_CONCAT_TEMPLATE,  # an alias: the name people reach for first
    "chatml": CHATML_TEMPLATE,
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


def render_prompt(messages: list[dict], tokenizer: "PreTrainedTokenizerBase", chat_template: str) -> str:
    """Render prompt messages as text ending with the generation prompt (the assistant header)."""
    return tokenizer.apply_chat_template(
        messages, chat_template=chat_template, tokenize=False, add_generation_prompt=True
    )
