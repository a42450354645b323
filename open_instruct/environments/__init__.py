"""environments: what a model talks to between its decode turns, in the formats real models use. Tools as
OpenAI-style function schemas (tool_schemas), the tool calls in a model's text read by vLLM's own parsers or today's
tags (tool_parsers), tool results rendered as the chat template's own turns, token-exact (chat_turns), the
environment that ties them together for the engine (native_tools), the pool that runs a parked sample's calls while
the engine decodes the others (tool_pool), and which environment a dataset row gets (routing).
May import: open_instruct.sandbox, open_instruct.rl (its Tool and Environment classes), open_instruct.data (chat
templates, tokenizers); third-party libraries (jsonschema, docstring_parser, transformers; vllm inside functions only,
so that the flag checks that import this package start without it). Never the generation, learner or run layers.
"""
