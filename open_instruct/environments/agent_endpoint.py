"""The OpenAI-compatible endpoint an agent program talks to during training (`--rollout_agent`, docs/agents.md).

The trainer serves `/v1/models`, `/v1/chat/completions` and `/v1/completions` on 127.0.0.1 (a port it picks;
`--agent_host` lets remote agents in). Requests and responses are vLLM's own OpenAI protocol models (pydantic), the
prompts are rendered by the run's chat template (the tokenizer's `apply_chat_template`, the template the dataset's
prompts are rendered with) and the tool calls in an answer are read by the run's vLLM tool parser. Each call goes to
the generation thread's engine through a queue and comes back as a future (`EngineCall`): the same engine, weights,
policy versions and sampling seeds as the dataset's rollouts.

Every request carries its rollout's key as the API key (`Authorization: Bearer ...`): a key the trainer never gave
out is refused (401), a finished rollout's key or a second call while one is running is refused (409), all counted.

Token-exact trajectories: each rollout's calls are recorded as samples by the engine (generation/agent_batches.py). A
call whose prompt ids extend the previous call's prompt + completion continues the same sample; the bridge here makes
that hold whenever the agent sends back the conversation it got: the assistant message this endpoint returned maps to
the ids the engine sampled for it (never decoded and tokenised again: one text has many tokenisations), and only the
messages after it are rendered and tokenised (`Bridge.prompt_ids`): the template's scaffolding with its special tokens
as single ids, every message's content as plain text (a tool output printing "<|im_end|>" cannot end a turn).
"""

import asyncio
import json
import logging
import secrets
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from open_instruct.environments.chat_turns import ASSISTANT_SENTINEL

log = logging.getLogger(__name__)

CONTENT_SENTINEL = "AGENT_CONTENT_SENTINEL_{}_5f0c"


@dataclass
class CallResult:
    """What the engine sampled for one call (set on `EngineCall.future` by the engine thread)."""

    token_ids: list[int]  # the sampled ids, with the stop token when the call ended on one
    logprobs: list[float | None]
    text: str  # the decoded answer, without the stop token
    finish_reason: str  # "stop" or "length"
    stop_reason: int | str | None = None


@dataclass
class EngineCall:
    """One call on its way to the engine thread: its rollout, its prompt ids and limits, and the future it answers."""

    rollout: "AgentRollout"
    prompt_token_ids: list[int]
    max_tokens: int | None
    stop: list[str]
    future: Future = field(default_factory=Future)


@dataclass
class AgentRollout:
    """One run of the agent on one dataset row: what the endpoint and the engine thread know of it."""

    batch_id: object
    index: int  # its place in the batch (sample index: the sampling seed of its calls)
    prompt_index: int
    row: dict
    key: str = field(default_factory=lambda: "oi-" + secrets.token_urlsafe(24))
    state: str = "running"  # "done", "failed" (raised, bad reward), "timeout"
    calls: int = 0
    busy: bool = False  # a call is in the engine
    ended_in_engine: bool = False  # the engine thread has taken its end in (its samples are finished)
    reward: float | None = None
    metrics: dict = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0  # from its start to its end
    # The bridge: the normalised messages of its last chat call plus the assistant message returned, and that call's
    # prompt + completion ids.
    last_messages: list[dict] | None = None
    context_ids: list[int] | None = None
    context_stopped: bool = False  # the last call ended on a stop token (the template's turn end begins with it)
    stats: dict = field(default_factory=lambda: dict.fromkeys(
        ("refused", "bridged", "retokenized_extends", "chat_calls"), 0))  # fmt: skip


class Refused(Exception):
    """A call the endpoint answers with an HTTP error (status, one-line message)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def normalised(message: dict) -> dict:
    """A message as the chat templates read it and as the bridge compares it: content "" for none, tool calls' arguments
    as JSON objects (HF templates write them with `tojson`; the OpenAI wire format sends them as strings)."""
    out = {key: value for key, value in message.items() if value is not None and key not in ("refusal", "annotations",
                                                                                               "audio", "reasoning")}
    if isinstance(out.get("content"), list):  # content parts: the text parts joined
        out["content"] = "".join(part.get("text", "") for part in out["content"] if isinstance(part, dict))
    out["content"] = out.get("content") or ""
    calls = []
    for call in out.get("tool_calls") or []:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments) if arguments else {}
            except ValueError:
                pass  # the template writes it as it came
        calls.append({"type": "function", "function": {"name": function.get("name"), "arguments":
                                                       function.get("arguments")}})  # fmt: skip
    if calls:
        out["tool_calls"] = calls
    else:
        out.pop("tool_calls", None)
    return out


def same_message(sent: dict, returned: dict) -> bool:
    """Whether the agent sent back the assistant message the endpoint returned (the ids of a tool call are its own)."""
    keys = ("role", "content", "tool_calls")
    return all(sent.get(key) == returned.get(key) for key in keys)


class Renderer:
    """The run's chat template and tokenizer, and the ids of a conversation: bridged when it continues the last one."""

    def __init__(self, tokenizer, chat_template: str):
        self.tokenizer, self.chat_template = tokenizer, chat_template

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, tools=tools or None)  # fmt: skip

    def plain_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The conversation rendered and tokenised as a fresh prompt (what an inference server would do)."""
        return self.encode_with_contents(self.render_with_sentinels(messages, tools, 0, len(messages)))

    def render_with_sentinels(self, messages: list[dict], tools, first: int, assistant: int | None) -> tuple[str, list[str]]:
        """The conversation rendered with messages[first:]'s contents as sentinels (and messages[assistant]'s as the
        assistant sentinel, its tool calls dropped: the model's own sampled text stands for them); the contents in
        order."""
        shown, contents = [], []
        for index, message in enumerate(messages):
            message = dict(message)
            if index == assistant:
                message = {"role": "assistant", "content": ASSISTANT_SENTINEL}
            elif index >= first:
                contents.append(message["content"])
                message["content"] = CONTENT_SENTINEL.format(len(contents) - 1)
            shown.append(message)
        return self.render(shown, tools, add_generation_prompt=True), contents

    def encode_with_contents(self, rendered: tuple[str, list[str]]) -> list[int]:
        """The template's scaffolding with its special tokens as single ids; each content as plain text."""
        text, contents = rendered
        ids = []
        for index, content in enumerate(contents):
            scaffold, found, text = text.partition(CONTENT_SENTINEL.format(index))
            if not found:  # a template that does not show every content as it is: the plain render, tokenised whole
                plain = rendered[0]
                for shown_index, shown in enumerate(contents):
                    plain = plain.replace(CONTENT_SENTINEL.format(shown_index), shown)
                return self.tokenizer.encode(plain, add_special_tokens=False)
            ids += self.tokenizer.encode(scaffold, add_special_tokens=False)
            ids += self.tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
        return ids + self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, rollout: AgentRollout, messages: list[dict], tools) -> tuple[list[int], bool]:
        """The call's prompt ids and whether they were bridged: when the messages begin with the rollout's last call's
        messages and the assistant message returned for it, that prefix is the ids the engine saw and sampled, and only
        the text after the assistant's content is tokenised (the template's turn end, less what the model sampled of it:
        its stop token, then the new messages and the generation prompt)."""
        last = rollout.last_messages
        bridged = (last is not None and len(messages) > len(last)
                   and all(same_message(a, b) for a, b in zip(messages[: len(last)], last)))  # fmt: skip
        if not bridged:
            return self.plain_ids(messages, tools), False
        assistant = len(last) - 1
        text, contents = self.render_with_sentinels(messages, tools, assistant + 1, assistant)
        if ASSISTANT_SENTINEL not in text:
            return self.plain_ids(messages, tools), False
        after = text[text.index(ASSISTANT_SENTINEL) + len(ASSISTANT_SENTINEL) :]
        # What the model already sampled of the turn end: its stop token (ChatML's "<|im_end|>" of "<|im_end|>\n").
        stop_text = self.tokenizer.decode(rollout.context_ids[-1:]) if rollout.context_stopped else None
        if stop_text and after.startswith(stop_text):
            after = after[len(stop_text) :]
        return rollout.context_ids + self.encode_with_contents((after, contents)), True


class Endpoint:
    """The FastAPI app and its uvicorn server, on an asyncio loop of its own thread. `submit(call)` hands an
    EngineCall to the engine thread; `rollouts` maps each key given out to its rollout."""

    def __init__(self, renderer: Renderer, parser_name: str | None, served_name: str, max_model_len: int,
                 submit, host: str = "127.0.0.1", port: int = 0):  # fmt: skip
        self.renderer, self.parser_name, self.served_name = renderer, parser_name, served_name
        self.max_model_len, self.submit, self.host, self.port = max_model_len, submit, host, port
        self.rollouts: dict[str, AgentRollout] = {}
        self.ended_keys: set[str] = set()  # the keys of rollouts whose batch has left the engine
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server = None
        self.parsers: dict[str, object] = {}

    # ---- serving ----
    def start(self) -> str:
        """Serve on a thread of its own; the base URL (http://host:port/v1) once the socket listens."""
        import uvicorn

        started = threading.Event()
        config = uvicorn.Config(self.app(), host=self.host, port=self.port, log_level="warning", access_log=False,
                                lifespan="off", loop="asyncio")  # fmt: skip
        self.server = uvicorn.Server(config)

        def serve() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            self.loop.create_task(self._watch_started(started))
            self.loop.run_until_complete(self.server.serve())

        self.thread = threading.Thread(target=serve, name="agent-endpoint", daemon=True)
        self.thread.start()
        if not started.wait(60) or not self.server.started:
            raise RuntimeError(f"the agent endpoint could not listen on {self.host}:{self.port}")
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://{'127.0.0.1' if self.host in ('0.0.0.0', '::') else self.host}:{self.port}/v1"

    async def _watch_started(self, started: threading.Event) -> None:
        while not self.server.started and not self.server.should_exit:
            await asyncio.sleep(0.01)
        started.set()

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(timeout=10)

    def app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI(title="open_instruct agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        def error(status: int, message: str) -> JSONResponse:
            from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

            body = ErrorResponse(error=ErrorInfo(message=message, type="invalid_request_error", code=status))
            return JSONResponse(body.model_dump(), status_code=status)

        @app.get("/v1/models")
        async def models() -> dict:
            from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

            return ModelList(data=[ModelCard(id=self.served_name, owned_by="open_instruct",
                                             max_model_len=self.max_model_len)]).model_dump()  # fmt: skip

        async def answer(request: Request, handler):
            rollout = None
            try:
                rollout = self.rollout_of(request.headers.get("authorization", ""))
                body = await request.json()
                response = await handler(rollout, body)
                if body.get("stream"):
                    chunks = stream_chunks(response, bool((body.get("stream_options") or {}).get("include_usage")))
                    events = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]
                    return StreamingResponse(iter(events), media_type="text/event-stream")
                return JSONResponse(response)
            except (Refused, ValueError) as refused:  # pydantic's ValidationError is a ValueError: the request's own
                if rollout is not None:  # counted in its rollout's agent/refused_calls (the engine's 429 comes here too)
                    rollout.stats["refused"] += 1
                if isinstance(refused, Refused):
                    return error(refused.status, str(refused))
                return error(400, " ".join(str(refused).split())[:500])

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await answer(request, self.chat_completion)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await answer(request, self.completion)

        return app

    def forget(self, key: str) -> None:
        """A rollout whose batch left the engine: its key is refused from now on (409), its row no longer held."""
        self.rollouts.pop(key, None)
        self.ended_keys.add(key)

    def rollout_of(self, authorization: str) -> AgentRollout:
        key = authorization.removeprefix("Bearer ").strip()
        rollout = self.rollouts.get(key)
        if key in self.ended_keys:
            raise Refused(409, "this rollout has ended; its key takes no more calls")
        if rollout is None:
            raise Refused(401, "unknown API key: each rollout's client carries its own key")
        if rollout.state != "running":
            raise Refused(409, f"this rollout has ended ({rollout.state}); its key takes no more calls")
        return rollout

    # ---- the two routes ----
    async def chat_completion(self, rollout: AgentRollout, body: dict) -> dict:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionLogProbs,
            ChatCompletionLogProbsContent,
            ChatCompletionRequest,
            ChatCompletionResponse,
            ChatCompletionResponseChoice,
            ChatMessage,
        )  # fmt: skip
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        request = ChatCompletionRequest.model_validate(body)
        self.check_request(request)
        messages = [normalised(dict(message)) for message in request.messages]
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
        if request.tool_choice == "none":
            tools = None
        prompt_ids, bridged = self.renderer.prompt_ids(rollout, messages, tools)
        rollout.stats["chat_calls"] += 1
        rollout.stats["bridged"] += bridged
        if bridged:  # would a fresh render have extended the context too (docs/agents.md measures how often)?
            plain = self.renderer.plain_ids(messages, tools)
            rollout.stats["retokenized_extends"] += plain[: len(rollout.context_ids)] == rollout.context_ids
        result = await self.run_call(rollout, prompt_ids, request.max_completion_tokens or body.get("max_tokens"),
                                     self.stops(request.stop))  # fmt: skip
        message = ChatMessage(role="assistant", content=result.text)
        finish_reason = result.finish_reason
        extracted = self.parse_calls(result.text, tools) if tools else None
        if extracted is not None and extracted.tools_called:
            message = ChatMessage(role="assistant", content=extracted.content or None, tool_calls=extracted.tool_calls)
            finish_reason = "tool_calls"
        returned = normalised(message.model_dump(exclude_none=True))
        rollout.last_messages, rollout.context_ids = messages + [returned], prompt_ids + result.token_ids
        rollout.context_stopped = isinstance(result.stop_reason, int) or (result.finish_reason == "stop" and
                                                                          result.stop_reason is None)  # fmt: skip
        logprobs = None
        if request.logprobs:
            tokens = [self.renderer.tokenizer.decode([token]) for token in result.token_ids]
            logprobs = ChatCompletionLogProbs(content=[
                ChatCompletionLogProbsContent(token=token, logprob=-9999.0 if lp is None else lp)
                for token, lp in zip(tokens, result.logprobs)])  # fmt: skip
        choice = ChatCompletionResponseChoice(index=0, message=message, logprobs=logprobs, finish_reason=finish_reason,
                                              stop_reason=result.stop_reason, token_ids=result.token_ids)  # fmt: skip
        response = ChatCompletionResponse(
            model=self.served_name, choices=[choice], prompt_token_ids=prompt_ids,
            usage=UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=len(result.token_ids),
                            total_tokens=len(prompt_ids) + len(result.token_ids)),
        )  # fmt: skip
        return response.model_dump(exclude_none=True)

    async def completion(self, rollout: AgentRollout, body: dict) -> dict:
        from vllm.entrypoints.openai.completion.protocol import (
            CompletionLogProbs,
            CompletionRequest,
            CompletionResponse,
            CompletionResponseChoice,
        )  # fmt: skip
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        request = CompletionRequest.model_validate(body)
        self.check_request(request)
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            if len(prompt) != 1:
                raise Refused(400, "one prompt per call: a rollout's calls are one conversation")
            prompt = prompt[0]
        if isinstance(prompt, str):  # token-in is the exact route; a text prompt is tokenised as it is
            prompt_ids = self.renderer.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            prompt_ids = list(prompt or [])
        rollout.last_messages = None  # a completion call leaves no chat history to bridge
        result = await self.run_call(rollout, prompt_ids, request.max_tokens, self.stops(request.stop))
        rollout.context_ids = prompt_ids + result.token_ids
        logprobs = None
        if request.logprobs is not None:
            logprobs = CompletionLogProbs(token_logprobs=list(result.logprobs),
                                          tokens=[self.renderer.tokenizer.decode([t]) for t in result.token_ids])  # fmt: skip
        choice = CompletionResponseChoice(index=0, text=result.text, logprobs=logprobs, finish_reason=result.finish_reason,
                                          stop_reason=result.stop_reason, token_ids=result.token_ids,
                                          prompt_token_ids=prompt_ids)  # fmt: skip
        response = CompletionResponse(model=self.served_name, choices=[choice], usage=UsageInfo(
            prompt_tokens=len(prompt_ids), completion_tokens=len(result.token_ids),
            total_tokens=len(prompt_ids) + len(result.token_ids)))  # fmt: skip
        return response.model_dump(exclude_none=True)

    # ---- shared by both ----
    @staticmethod
    def stops(stop) -> list[str]:
        return [stop] if isinstance(stop, str) else list(stop or [])

    def check_request(self, request) -> None:
        if (request.n or 1) != 1:
            raise Refused(400, "n must be 1: each sample of a prompt is its own agent run (--num_samples_per_prompt_rollout)")

    async def run_call(self, rollout: AgentRollout, prompt_ids: list[int], max_tokens: int | None,
                       stop: list[str]) -> CallResult:  # fmt: skip
        """The call through the engine thread; its answer when the engine sampled it."""
        if rollout.busy:
            raise Refused(409, "this rollout already has a call running: a rollout's calls are one conversation, "
                               "made one after another")  # fmt: skip
        if not prompt_ids:
            raise Refused(400, "the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise Refused(400, f"the prompt has {len(prompt_ids)} tokens; the engine holds {self.max_model_len} "
                               "(--max_token_length)")  # fmt: skip
        rollout.busy = True
        try:
            call = EngineCall(rollout, prompt_ids, max_tokens, stop)
            self.submit(call)
            return await asyncio.wrap_future(call.future)
        finally:
            rollout.busy = False

    def parse_calls(self, text: str, tools: list[dict]):
        """vLLM's tool parser's reading of the answer (ExtractedToolCallInformation), or None without a parser."""
        if self.parser_name is None:
            return None
        from open_instruct.environments.tool_parsers import VllmToolCalls

        key = json.dumps(tools, sort_keys=True)
        if key not in self.parsers:
            self.parsers[key] = VllmToolCalls(self.parser_name, self.renderer.tokenizer, tools)
        extracted = self.parsers[key].extract(text)
        return None if isinstance(extracted, Exception) else extracted


def stream_chunks(response: dict, include_usage: bool) -> list[dict]:
    """A whole answer (`Endpoint.chat_completion`'s or `completion`'s) as the chunks of a stream (`stream=true`), in
    vLLM's stream models: the answer in one delta (content, tool calls, token ids, logprobs), then its finish reason,
    then the usage when `stream_options.include_usage` asks. The call is answered when the engine has sampled it, so
    nothing is gained by sending it token by token; the stream is for agents written to read one."""
    choice, head = response["choices"][0], {"id": response["id"], "created": response["created"],
                                            "model": response["model"]}  # fmt: skip
    if response["object"] == "chat.completion":
        from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponseStreamChoice as Choice,
        )
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse as Chunk

        message = choice["message"]
        calls = [DeltaToolCall(index=i, id=call["id"], type="function",
                               function=DeltaFunctionCall(name=call["function"]["name"],
                                                          arguments=call["function"]["arguments"]))
                 for i, call in enumerate(message.get("tool_calls") or [])]  # fmt: skip
        delta = DeltaMessage(role="assistant", content=message.get("content"), tool_calls=calls)
        chunks = [Chunk(**head, choices=[Choice(index=0, delta=delta, logprobs=choice.get("logprobs"),
                                                token_ids=choice.get("token_ids"))],
                        prompt_token_ids=response.get("prompt_token_ids")),
                  Chunk(**head, choices=[Choice(index=0, delta=DeltaMessage(), finish_reason=choice["finish_reason"],
                                                stop_reason=choice.get("stop_reason"))])]  # fmt: skip
    else:
        from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice as Choice
        from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse as Chunk

        chunks = [Chunk(**head, choices=[Choice(index=0, text=choice["text"], logprobs=choice.get("logprobs"),
                                                token_ids=choice.get("token_ids"),
                                                prompt_token_ids=choice.get("prompt_token_ids"))]),
                  Chunk(**head, choices=[Choice(index=0, text="", finish_reason=choice["finish_reason"],
                                                stop_reason=choice.get("stop_reason"))])]  # fmt: skip
    if include_usage:
        chunks.append(Chunk(**head, choices=[], usage=response["usage"]))
    return [chunk.model_dump(exclude_none=True) for chunk in chunks]
