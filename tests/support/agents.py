"""Agent programs for the tests of `--rollout_agent` (tests/test_agent_endpoint.py, tests/test_agent_trainer.py), each
written only against the `openai` package, as a user's agent is."""

import asyncio
import os
import time


def one_call(row, client):
    """One chat call on the row's messages; reward: the answer's length in characters, capped (a learnable signal)."""
    answer = client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=12)
    return min(1.0, len(answer.choices[0].message.content or "") / 40)


async def one_call_async(row, client):
    answer = await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=12)
    return {"reward": 1.0 if answer.choices[0].finish_reason == "stop" else 0.0, "answer_chars":
            len(answer.choices[0].message.content or "")}  # fmt: skip


def three_calls(row, client):
    """Three chat calls in one conversation, each answered with a tool-like user turn: one extending sample. Reward:
    the answers' characters over 60 (a signal that differs between samples, for GRPO to learn from)."""
    messages, used, chars = list(row["messages"]), 0, 0
    for turn in range(3):
        answer = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        used += answer.usage.completion_tokens
        chars += len(answer.choices[0].message.content or "")
        messages += [answer.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": f"<|im_end|> observation {turn}: 42"}]  # fmt: skip
    return {"reward": chars / 60, "answer_tokens": used}


def two_conversations(row, client):
    """A second call that does not continue the first (a new system prompt): two samples, one reward."""
    first = client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=6)
    restart = [{"role": "system", "content": "Summarise."}, {"role": "user", "content": first.choices[0].message.content}]
    client.chat.completions.create(model="policy", messages=restart, max_tokens=6)
    return 0.5


def raises(row, client):
    client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=4)
    raise RuntimeError("the agent's own bug")


def hangs(row, client):
    client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=4)
    time.sleep(3600)


async def hangs_async(row, client):
    await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=4)
    await asyncio.sleep(3600)


def returns_text(row, client):
    client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=4)
    return "great"


def token_in(row, client):
    """The token-in route: /v1/completions with prompt ids, twice, the second extending the first."""
    first = client.completions.create(model="policy", prompt=[1, 2, 3], max_tokens=4, extra_body={"return_token_ids": True})
    ids = [1, 2, 3] + first.choices[0].token_ids + [5]
    client.completions.create(model="policy", prompt=ids, max_tokens=4)
    return 1.0


SEEN_KEYS: list[str] = []


def probes_the_limits(row, client):
    """Keeps its key (the test calls with it after the rollout ended); makes two calls at once (the second is refused:
    409), then calls until the call budget refuses one (429). Reward 1.0 when it met both refusals."""
    import threading

    import openai

    SEEN_KEYS.append(client.api_key)
    outcomes = []

    def call(max_tokens):
        try:
            client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=max_tokens)
            outcomes.append("ok")
        except openai.ConflictError:
            outcomes.append(409)

    long_call = threading.Thread(target=call, args=(24,))
    long_call.start()
    time.sleep(0.02)
    call(1)
    long_call.join()
    try:
        for _ in range(5):
            client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=1)
    except openai.RateLimitError:
        outcomes.append(429)
    return 1.0 if sorted(map(str, outcomes)) == ["409", "429", "ok"] else 0.0


def reports_its_process(row, client):
    """Two calls of one conversation; reward: the id of the process the agent ran in (tests/test_engine_actors.py:
    each rollout runs beside the engine actor that admitted it, and its calls are that engine's)."""
    messages = list(row["messages"])
    for _ in range(2):
        answer = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        messages += [answer.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    return {"reward": float(os.getpid()), "endpoint_port": float(client.base_url.port)}


def streams(row, client):
    """A chat call and a token-in completion call read as streams (as agents written for streaming read them).
    Metrics: the streamed chat answer's characters and usage, and whether the completion's stream carried its ids."""
    chat = client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=8, stream=True,
                                          stream_options={"include_usage": True})  # fmt: skip
    content, finish, usage = [], None, None
    for chunk in chat:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    text = client.completions.create(model="policy", prompt=[1, 2, 3], max_tokens=4, stream=True)
    pieces = [choice for chunk in text for choice in chunk.choices]
    ids = [token for piece in pieces for token in (getattr(piece, "token_ids", None) or [])]
    return {"reward": 1.0 if finish in ("stop", "length") else 0.0, "chars": float(len("".join(content))),
            "completion_tokens": float(usage.completion_tokens), "ids_streamed": float(len(ids) >= 1)}


def not_an_agent(row):
    return 0.0
