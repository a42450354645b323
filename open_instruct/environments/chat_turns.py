"""Token-exact tool turns: the token ids that follow an assistant turn's sampled tokens when its tool calls are answered.

What the model reads after its calls must be what the chat template would give for the whole conversation:

    tokens(render(history + assistant turn + tool turns, generation prompt))
        = prompt tokens + sampled tokens + `ToolTurns.after(...)`

so the appended ids are the template's text after the assistant's content (its turn end, ChatML's `<|im_end|>\n`),
minus what the model already sampled of it (its stop token), then the tool turn(s) and the generation prompt. They are
found by rendering a conversation whose assistant content is a sentinel: the text after the sentinel is what follows
any assistant content. The sampled tokens are never decoded and encoded again (that can change them: a text has many
tokenisations). The template's scaffolding is tokenised with its special tokens as single ids; each tool result is
tokenised as plain text (`split_special_tokens`), so a tool printing "<|im_end|>" cannot end a turn.

A template whose render of history + tool turns does not extend its render of the history (one that rewrites earlier
turns, e.g. drops reasoning) cannot be token-exact: the sampled tokens stay as they are, the same text is appended
after them, and `exact` is False (the environment logs it once).
"""

import logging

log = logging.getLogger(__name__)

USER_SENTINEL = "USER_CONTENT_SENTINEL_5f0c"
ASSISTANT_SENTINEL = "ASSISTANT_CONTENT_SENTINEL_5f0c"


def result_sentinel(index: int) -> str:
    return f"TOOL_RESULT_SENTINEL_{index}_5f0c"


class ToolTurns:
    """Renders the tool turns of one template and tokenizer. `schemas`: the tools' function schemas (rendered into
    the system turn by templates that show tools; they must be the ones the prompts were rendered with)."""

    def __init__(self, tokenizer, chat_template: str, schemas: list[dict]):
        self.tokenizer, self.chat_template, self.schemas = tokenizer, chat_template, schemas
        self.history = [{"role": "user", "content": USER_SENTINEL}, {"role": "assistant", "content": ASSISTANT_SENTINEL}]
        self.history_text = self.render(self.history, add_generation_prompt=False)
        if ASSISTANT_SENTINEL not in self.history_text:
            raise ValueError("the chat template does not render an assistant message's content; it cannot hold tool calls")
        # The template's text after any assistant content when no tool turn follows (ChatML: "<|im_end|>\n").
        self.turn_end = self.history_text[self.history_text.rindex(ASSISTANT_SENTINEL) + len(ASSISTANT_SENTINEL) :]
        self.exact = self.text_after([("tool", "")]).startswith(self.turn_end) and self.extends_history([("tool", "")])

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  tools=self.schemas or None)  # fmt: skip

    def conversation(self, results: list[tuple[str, str]]) -> str:
        """The rendered conversation of the sentinel history, one tool message per result (with sentinel contents),
        and the generation prompt."""
        tool_messages = [{"role": "tool", "name": name, "content": result_sentinel(index)}
                         for index, (name, _) in enumerate(results)]  # fmt: skip
        return self.render(self.history + tool_messages, add_generation_prompt=True)

    def extends_history(self, results: list[tuple[str, str]]) -> bool:
        return self.conversation(results).startswith(self.history_text)

    def text_after(self, results: list[tuple[str, str]]) -> str:
        """The template's text after the assistant content, through the next generation prompt (sentinel results)."""
        full = self.conversation(results)
        return full[full.rindex(ASSISTANT_SENTINEL) + len(ASSISTANT_SENTINEL) :]

    def after(self, turn_text: str, results: list[tuple[str, str]]) -> list[int]:
        """The ids to append after an assistant turn whose sampled text is `turn_text` (ending with its stop token's
        text, e.g. "<|im_end|>"), answered by `results`: (tool name, result text) in the calls' order."""
        text = self.text_after(results)
        # What the model already sampled of the turn end: the longest head of it that the turn's text ends with.
        sampled = next((size for size in range(len(self.turn_end), 0, -1) if turn_text.endswith(self.turn_end[:size])), 0)
        if text.startswith(self.turn_end[:sampled]):
            text = text[sampled:]
        ids = []
        for index, (_, result) in enumerate(results):
            scaffold, _, text = text.partition(result_sentinel(index))
            ids += self.tokenizer.encode(scaffold, add_special_tokens=False)  # the template's own special tokens
            ids += self.tokenizer.encode(result, add_special_tokens=False, split_special_tokens=True)  # plain text only
        return ids + self.tokenizer.encode(text, add_special_tokens=False)
