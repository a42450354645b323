"""Agent programs as rollouts, driven through the real endpoint by the real `openai` client (tests/support/agents.py)
into a real vLLM engine (the tiny model, SmolLM2's tokenizer and chat template): what each rollout's calls become as
samples (ids, logprobs, the mask of what the policy sampled), and every way a rollout can fail without stopping the
engine. One engine and one endpoint serve the module; each test admits batches of its own agent. The bridge's and
the agent loader's tests need no engine (the fast tier runs them).
"""

import asyncio
import gc
import itertools
import time
from pathlib import Path

import httpx
import pytest
import torch

from open_instruct.environments.agent_endpoint import AgentRollout, Renderer
from open_instruct.environments.agent_runner import load_agent, reward_of

AGENTS = Path(__file__).parent / "support" / "agents.py"
BATCH_IDS = itertools.count()
ROWS = [{"messages": [{"role": "user", "content": "What is 2 + 3?"}], "ground_truth": "5"},
        {"messages": [{"role": "user", "content": "Name a colour."}], "ground_truth": None}]  # fmt: skip


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from open_instruct.generation import vllm_engine

    engine = vllm_engine.create_engine(vllm_engine.EngineConfig(model_path=tiny_model_dir, max_model_len=256, seed=0))
    yield engine
    del engine
    gc.collect()


@pytest.fixture(scope="module")
def batches(llm):
    from open_instruct.generation.engine_batches import EngineBatches

    engine_batches = EngineBatches(llm)
    yield engine_batches
    if engine_batches.agents is not None:
        engine_batches.agents.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def agent_settings(agent: str, **overrides) -> dict:
    return {"spec": f"{AGENTS}:{agent}", "concurrency": 4, "timeout_s": 60.0, "max_calls": 8, "failed": "drop",
            "host": "127.0.0.1", "port": 0, "parser": "auto", "chat_template_name": None, "served_name": "tiny",
            **overrides}  # fmt: skip


def params(tokenizer, agent: str | None, n: int = 2, max_tokens: int = 24, **overrides) -> dict:
    return dict(n=n, temperature=1.0, with_logprobs=True, max_tokens=max_tokens, stop_token_ids=[tokenizer.eos_token_id],
                stop_strings=None, agent=agent_settings(agent, **overrides) if agent else None)  # fmt: skip


def run_agent(batches, tokenizer, agent: str, rows=ROWS, n: int = 2, seed: int = 7, max_tokens: int = 24, **overrides):
    """One agent batch through the engine: its completions and its agent/* metrics."""
    batch_id = next(BATCH_IDS)
    batches.admit(batch_id, [[0]] * len(rows), params(tokenizer, agent, n, max_tokens, **overrides), seed, rows)
    return batches.run_until_complete(batch_id), batches.agents.metrics_of(batch_id)


@pytest.mark.e2e
def test_a_one_call_agent_samples_what_the_in_engine_path_samples(batches, tokenizer):
    """The same prompt, seed and budget: the agent's sample is the dataset path's, id for id (logprobs to float32
    rounding); its prompt is the chat template's render of the row (what the dataset's prompts are)."""
    completions, metrics = run_agent(batches, tokenizer, "one_call", max_tokens=12)
    prompts = [tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
               for row in ROWS]
    batch_id = next(BATCH_IDS)
    batches.admit(batch_id, prompts, params(tokenizer, None, max_tokens=12), 7)
    in_engine = batches.run_until_complete(batch_id)
    assert len(completions) == len(in_engine) == 4
    for agent_sample, engine_sample in zip(completions, in_engine):
        assert agent_sample.prompt_token_ids == prompts[engine_sample.prompt_index]
        assert agent_sample.prompt_index == engine_sample.prompt_index
        assert agent_sample.token_ids == engine_sample.token_ids
        # Which requests share an engine step moves a logprob by float32 rounding on vLLM's CPU kernels (the agents'
        # calls arrive one by one): the same tokens, the same logprobs to 1e-5.
        assert agent_sample.logprobs == pytest.approx(engine_sample.logprobs, abs=1e-5, nan_ok=True)
        assert agent_sample.finish_reason == engine_sample.finish_reason
        assert agent_sample.sampled == [True] * len(engine_sample.token_ids) and engine_sample.sampled is None
        assert agent_sample.agent["reward"] == min(1.0, len(agent_sample.text) / 40)
    assert metrics["agent/calls_per_rollout"] == 1 and metrics["agent/splits"] == 0 and metrics["agent/errors"] == 0


@pytest.mark.e2e
def test_an_async_agent_returns_a_reward_and_metrics(batches, tokenizer):
    completions, metrics = run_agent(batches, tokenizer, "one_call_async")
    assert len(completions) == 4
    assert all(c.agent["reward"] == (1.0 if c.finish_reason == "stop" else 0.0) for c in completions)
    assert metrics["agent/answer_chars"] == sum(len(c.text) for c in completions) / 4


@pytest.mark.e2e
def test_an_agent_that_reads_streams_gets_the_whole_answer_in_chunks(batches, tokenizer):
    """stream=true (chat and completions): the answer arrives as server-sent chunks the `openai` client reads, with
    the usage when asked; what the agent reads is what was sampled. Each rollout leaves two samples (the token-in call
    does not extend the chat)."""
    completions, metrics = run_agent(batches, tokenizer, "streams")
    chats = [c for c in completions if c.agent["split"] == 0]
    assert len(chats) == 4 and len(completions) == 8 and metrics["agent/splits"] == 4
    assert metrics["agent/reward"] == 1.0 and metrics["agent/ids_streamed"] == 1.0
    assert metrics["agent/chars"] == sum(len(c.text) for c in chats) / 4
    assert metrics["agent/completion_tokens"] == sum(len(c.token_ids) for c in chats) / 4


@pytest.mark.e2e
def test_a_three_call_agent_is_one_sample_whose_only_trainable_tokens_are_the_models(batches, tokenizer):
    """Each call's prompt extends the last call's prompt + answer (the bridge): one sample per rollout, the turns
    between the answers appended as not sampled; a user turn that prints "<|im_end|>" is plain text, not a turn end."""
    completions, metrics = run_agent(batches, tokenizer, "three_calls", max_tokens=64)
    assert len(completions) == 4 and metrics["agent/splits"] == 0
    assert metrics["agent/calls_per_rollout"] == 3 and metrics["agent/bridged_frac"] == 1.0
    typed = tokenizer.encode("<|im_end|> observation 1: 42", add_special_tokens=False, split_special_tokens=True)
    for completion in completions:
        sampled = completion.sampled
        runs = [len(list(group)) for key, group in itertools.groupby(sampled) if key]
        assert len(runs) == 3 and all(1 <= run <= 6 + 1 for run in runs)  # three answers of <= 6 tokens (+ stop)
        between = [t for t, s in zip(completion.token_ids, sampled) if not s]
        assert any(between[i : i + len(typed)] == typed for i in range(len(between)))
        assert all(lp is not None for lp, s, t in zip(completion.logprobs, sampled, completion.token_ids)
                   if s and t != tokenizer.eos_token_id)  # fmt: skip
        assert all(lp is None for lp, s in zip(completion.logprobs, sampled) if not s)
        assert all(v is None for v, s in zip(completion.versions, sampled) if not s)
        # The whole sample is one conversation the template renders: prompt + every token decodes to it.
        text = tokenizer.decode(completion.prompt_token_ids + completion.token_ids)
        assert text.count("observation 0: 42") == 1 and text.count("<|im_start|>assistant\n") == 3


@pytest.mark.e2e
def test_a_call_that_does_not_continue_the_conversation_starts_a_second_sample(batches, tokenizer):
    completions, metrics = run_agent(batches, tokenizer, "two_conversations")
    assert len(completions) == 8 and metrics["agent/splits"] == 4
    for first, second in zip(completions[::2], completions[1::2]):
        assert first.agent["rollout"] == second.agent["rollout"]
        assert first.agent["split"] == 0 and second.agent["split"] == 1
        assert first.agent["reward"] == second.agent["reward"] == 0.5
        assert "Summarise." in tokenizer.decode(second.prompt_token_ids)
        assert all(second.sampled)


@pytest.mark.e2e
def test_the_token_in_route_extends_on_ids(batches, tokenizer):
    completions, _ = run_agent(batches, tokenizer, "token_in", rows=ROWS[:1], n=1)
    (completion,) = completions
    assert completion.prompt_token_ids == [1, 2, 3]
    observation = [t for t, s in zip(completion.token_ids, completion.sampled) if not s]
    assert observation == [5]


@pytest.mark.e2e
@pytest.mark.parametrize("failed_rollouts", ["drop", "zero"])
def test_an_agent_that_raises_ends_its_rollouts_and_the_engine_goes_on(batches, tokenizer, failed_rollouts):
    completions, metrics = run_agent(batches, tokenizer, "raises", failed=failed_rollouts)
    assert metrics["agent/errors"] == 4 and metrics["agent/calls_per_rollout"] == 1
    if failed_rollouts == "drop":
        assert completions == [] and metrics["agent/dropped"] == 4
    else:
        assert len(completions) == 4 and all(c.agent["reward"] == 0.0 for c in completions)
        assert all(c.finish_reason == "agent_error" for c in completions)
    completions, metrics = run_agent(batches, tokenizer, "returns_text", failed=failed_rollouts)
    assert metrics["agent/errors"] == 4


@pytest.mark.e2e
@pytest.mark.parametrize("agent", ["hangs", "hangs_async"])
def test_an_agent_that_hangs_is_cut_at_its_timeout(batches, tokenizer, agent):
    start = time.time()
    completions, metrics = run_agent(batches, tokenizer, agent, timeout_s=2.0)
    assert time.time() - start < 20
    assert completions == [] and metrics["agent/timeouts"] == 4


@pytest.mark.e2e
def test_keys_are_per_rollout_and_refused_once_it_ended(batches, tokenizer):
    """A key never given out: 401. A second call while one runs: 409. Past --agent_max_calls: 429. A finished
    rollout's key: 409. All through the real client, counted in agent/refused_calls."""
    seen_keys = load_agent(f"{AGENTS}:probes_the_limits").__globals__["SEEN_KEYS"]  # the module as the run loads it
    seen_keys.clear()
    completions, metrics = run_agent(batches, tokenizer, "probes_the_limits", rows=ROWS[:1], n=1, max_calls=3)
    assert all(c.agent["reward"] == 1.0 for c in completions), "the agent saw 409 and 429 through the openai client"
    # Its 3 calls each start the conversation anew: 3 samples, 2 splits.
    assert len(completions) == 3 and metrics["agent/splits"] == 2
    assert metrics["agent/calls_per_rollout"] == 3 and metrics["agent/refused_calls"] == 2
    base_url = f"http://127.0.0.1:{batches.agents.endpoint.port}/v1"
    body = {"model": "tiny", "messages": ROWS[0]["messages"], "max_tokens": 2}
    with httpx.Client(trust_env=False) as client:
        unknown = client.post(f"{base_url}/chat/completions", json=body, headers={"Authorization": "Bearer oi-forged"})
        ended = client.post(f"{base_url}/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {seen_keys[0]}"})  # fmt: skip
        models = client.get(f"{base_url}/models").json()
    assert unknown.status_code == 401 and "unknown API key" in unknown.json()["error"]["message"]
    assert ended.status_code == 409
    assert models["data"][0]["id"] == "tiny"


def test_the_bridge_maps_a_returned_tool_call_to_its_sampled_ids(tokenizer):
    """chatml_tools (the Hermes / Qwen 2.5 format): the model wrote its call compactly, the template would write it
    with spaces. The next call's prompt is the sampled ids plus the tool turn, never the re-rendered call: a fresh
    render would not extend what the model sampled."""
    from open_instruct.data.chat_templates import CHATML_TOOLS_TEMPLATE

    renderer = Renderer(tokenizer, CHATML_TOOLS_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "2+3?"}]
    prompt, bridged = renderer.prompt_ids(AgentRollout(0, 0, 0, {}), messages, tools)
    assert not bridged
    sampled = tokenizer.encode('<tool_call>\n{"name":"add","arguments":{"a":2,"b":3}}\n</tool_call>',
                               add_special_tokens=False) + [tokenizer.eos_token_id]  # fmt: skip
    rollout = AgentRollout(0, 0, 0, {}, context_ids=prompt + sampled, context_stopped=True)
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    rollout.last_messages = messages + [{"role": "assistant", "content": "", "tool_calls": [call]}]
    follow = rollout.last_messages + [{"role": "tool", "content": "5 <|im_end|>"}]
    ids, bridged = renderer.prompt_ids(rollout, follow, tools)
    assert bridged and ids[: len(rollout.context_ids)] == rollout.context_ids
    tail = tokenizer.decode(ids[len(rollout.context_ids) :])
    assert tail == "\n<|im_start|>user\n<tool_response>\n5 <|im_end|>\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token_id not in ids[len(rollout.context_ids) : -6], "the tool's text is plain text"
    assert renderer.plain_ids(follow, tools)[: len(rollout.context_ids)] != rollout.context_ids


def test_a_bad_agent_is_one_line():
    for spec, expected in [(f"{AGENTS}", "expected path/to/agent.py:function"), (f"{AGENTS}:nope", "no function 'nope'"),
                           (f"{AGENTS}:not_an_agent", "must take (row, client)"), ("/nowhere/a.py:run", "no file")]:  # fmt: skip
        with pytest.raises(ValueError, match="^--rollout_agent .*" + expected.replace("(", r"\(").replace(")", r"\)")):
            load_agent(spec)
    assert reward_of({"reward": 1, "steps": 3}) == (1.0, {"steps": 3.0})
    for bad in ("1", float("nan"), None, True, {"reward": 1.0, "note": "x"}):
        with pytest.raises(ValueError):
            reward_of(bad)
    assert asyncio.iscoroutinefunction(load_agent(f"{AGENTS}:one_call_async"))


@pytest.mark.e2e
def test_a_call_spanning_a_weight_update_and_a_snapshot_of_the_batch(batches, tokenizer, llm, tiny_model_dir):
    """--inflight_updates: a weight load between two steps while agents' calls are running tags each token with the
    version that sampled it. A checkpoint's snapshot holds the ended rollouts as they are and the running ones as their
    rows alone; restored, those run again from their row, and the batch completes."""
    from transformers import AutoModelForCausalLM

    from open_instruct.generation import vllm_engine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    weights = [(name, param.detach().clone()) for name, param in model.named_parameters()]
    batch_id, state = next(BATCH_IDS), {"loaded": False, "snapshot": None}
    batches.admit(batch_id, [[0]] * 2, params(tokenizer, "three_calls", max_tokens=64), 7, ROWS)

    def between_steps():
        if not state["loaded"] and batches.running and any(len(s.token_ids) >= 2 for s in batches.batches[batch_id]):
            with batches.new_weights(1):
                vllm_engine.load_weights(llm, weights)
            state["loaded"] = True
        elif state["loaded"] and state["snapshot"] is None:
            state["snapshot"] = batches.partial_batches()

    completions = batches.run_until_complete(batch_id, between_steps)
    versions = {v for c in completions for v, sampled in zip(c.versions, c.sampled) if sampled}
    assert versions == {0, 1}
    (saved,) = [batch for batch in state["snapshot"] if batch["batch_id"] == batch_id]
    assert any(rollout is None for rollout in saved["agent_rollouts"]), "rollouts still running are stored as rows"
    saved["batch_id"] = restored_id = next(BATCH_IDS)
    batches.restore([saved])
    restored = batches.run_until_complete(restored_id)
    assert sorted({c.agent["rollout"] for c in restored}) == [0, 1, 2, 3]
    assert batches.agents.metrics_of(restored_id)["agent/calls_per_rollout"] == 3
    with batches.new_weights(0):  # the module's engine as it was
        vllm_engine.load_weights(llm, weights)


def test_grpo_leaves_out_a_prompt_left_with_one_run():
    """Prompt 0 kept two runs (one split in two samples), prompt 1 one (its other run failed and was dropped): GRPO
    trains on prompt 0's samples alone, and says how many runs it left out."""
    from open_instruct.generation.generation_thread import Rollout
    from open_instruct.generation.step_batch import without_lone_rollouts
    from open_instruct.generation.vllm_engine import Completion

    def sample(prompt_index: int, rollout: int, split: int = 0) -> Completion:
        return Completion(prompt_index, [5, 2], "", "stop", agent={"reward": 1.0, "rollout": rollout, "split": split})

    rollout = Rollout(0, [sample(0, 0), sample(0, 0, 1), sample(0, 1), sample(1, 2)])
    kept, lone = without_lone_rollouts(rollout)
    assert [(c.prompt_index, c.agent["rollout"]) for c in kept.completions] == [(0, 0), (0, 0), (0, 1)] and lone == 1
