"""environments: what a model talks to between its decode turns, in the formats real models use. The Tool and
Environment classes, the built-in tools (calculator, python in the sandbox, org_chart) and their registries (tools);
tools as OpenAI-style function schemas (tool_schemas); the tool calls in a model's text read by vLLM's own parsers or
today's tags (tool_parsers); tool results rendered as the chat template's own turns, token-exact (chat_turns); the
environment that ties them together for the engine (native_tools); the pool that runs a parked sample's calls while
the engine decodes the others (tool_pool); which environment a dataset row gets (routing); and the OpenAI-compatible
endpoint an agent program is trained through, with the runner that calls the agent (agent_endpoint, agent_runner).
May import: open_instruct.sandbox (through its exports), open_instruct.rewards (the user-file loader, the worker
process), open_instruct.data (chat templates, tokenizers, the org chart task); third-party libraries (jsonschema,
docstring_parser, transformers; vllm inside functions only, so that the flag checks that import this package start
without it). Never the generation, learner or run layers.
"""
