"""Rollout batches in a real in-process vLLM engine (engine_batches.py), on the tiny model whose answers stop at varied
lengths:

- one batch alone gives exactly what vLLM's own `LLM.generate` gives (the sync and one-batch-at-a-time modes);
- an in-flight weight update: the tokens generated before it carry version k and those after it k+1, and the engine's
  logprob of every token after it equals a fresh look of the new weights at the whole sequence (prompt logprobs of
  the same engine, now holding only the new weights): the behaviour logprobs are exact token by token;
- a snapshot of the batches in flight, restored into a fresh engine, continues bit for bit as the engine it was taken
  from does (exact resume with --inflight_updates);
- with tools (environments/tools.py): a call whose end string arrives over two decode steps is answered token in, token out;
  bad tools, a model calling forever, an in-flight update across a call, and a snapshot holding tool outputs;
- a stop string split across an in-flight update (found in Python, on the accumulated text) ends the response there.
"""

import copy
import gc
import itertools
import random
import string
import time
from contextlib import contextmanager

import pytest
import torch

from open_instruct.environments import tools
from tests.support.engine_prompt_logprobs import prompt_logprobs

pytestmark = [pytest.mark.e2e]

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [20, 21, 22, 23], [30, 31]]
EOS = 2  # SmolLM2's <|im_end|>, the tiny model's stop token


def params(n: int = 2, temperature: float = 1.0, max_tokens: int = 24) -> dict:
    return dict(n=n, temperature=temperature, max_tokens=max_tokens, stop_token_ids=[EOS], stop_strings=None,
                with_logprobs=True)  # fmt: skip


def new_engine(model_dir: str):
    from open_instruct.generation import vllm_engine

    return vllm_engine.create_engine(vllm_engine.EngineConfig(model_path=model_dir, max_model_len=256, seed=0))


@pytest.fixture(scope="module")
def llm(varied_length_model_dir):
    engine = new_engine(varied_length_model_dir)
    yield engine
    del engine
    gc.collect()


@pytest.fixture(scope="module")
def second_llm(varied_length_model_dir, llm):
    """A second engine of the tiny model, which a snapshot is restored into (shared by the restore tests: the engine
    it was taken from has served other batches too, and what it generates does not depend on them). Created after
    `llm` and dropped after the module's last test: dropping an engine takes down vLLM's process-wide parallel groups,
    which `llm` still needs until then."""
    engine = new_engine(varied_length_model_dir)
    yield engine
    del engine
    gc.collect()


@pytest.fixture(scope="module")
def perturbed_weights(varied_length_model_dir) -> list[tuple[str, torch.Tensor]]:
    """The tiny model's weights moved by noise: "the next policy"."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(varied_length_model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return [(name, param.detach().clone()) for name, param in model.named_parameters()]


@pytest.fixture(scope="module")
def initial_weights(varied_length_model_dir) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(varied_length_model_dir, dtype=torch.float32)
    return [(name, param.detach().clone()) for name, param in model.named_parameters()]


def load(llm, batches, weights, version: int) -> None:
    from open_instruct.generation import vllm_engine

    with batches.new_weights(version):
        vllm_engine.load_weights(llm, weights)


def test_one_batch_alone_is_what_vllm_generate_gives(llm):
    from open_instruct.generation import vllm_engine
    from open_instruct.generation.engine_batches import EngineBatches, request_seed

    # vLLM's own generate of each sample as its own request, with the seed EngineBatches gives it.
    each = [(prompt_index, ids) for prompt_index, ids in enumerate(PROMPTS) for _ in range(params()["n"])]
    seeded = [vllm_engine.sampling_params(**{**params(), "n": 1, "seed": request_seed(5, index, 0, 0)})
              for index in range(len(each))]  # fmt: skip
    expected = vllm_engine.generate(llm, [ids for _, ids in each], seeded)
    for completion in expected:
        completion.prompt_index = each[completion.prompt_index][0]
    batches = EngineBatches(llm)
    batches.admit(0, PROMPTS, params(), sampling_seed=5)
    got = batches.run_until_complete(0)
    assert len({len(c.token_ids) for c in got}) > 2, "the responses should stop at varied lengths"
    assert [(c.prompt_index, c.token_ids, c.text, c.finish_reason, c.logprobs) for c in got] == [
        (c.prompt_index, c.token_ids, c.text, c.finish_reason, c.logprobs) for c in expected
    ]
    assert all(c.versions == [0] * len(c.token_ids) for c in got)
    assert batches.batches == {} and batches.running == {}


def test_tokens_carry_their_version_across_an_in_flight_update_and_their_logprobs_are_the_new_policys(
    llm, perturbed_weights, initial_weights
):
    from open_instruct.generation.engine_batches import EngineBatches

    batches = EngineBatches(llm)
    try:
        batches.admit(0, PROMPTS, params(max_tokens=24), sampling_seed=11)
        steps_before = 6
        for _ in range(steps_before):
            batches.step()
        load(llm, batches, perturbed_weights, version=1)  # in flight: the batch is half generated
        completions = batches.run_until_complete(0)
    finally:
        load(llm, batches, initial_weights, version=0)

    load(llm, EngineBatches(llm), perturbed_weights, version=1)  # the engine now holds only the new weights
    try:
        split = 0
        for completion in completions:
            versions = completion.versions
            # The first `steps_before` tokens (one per step, the first from the prefill) came from version 0.
            before = min(steps_before, len(versions))
            assert versions == [0] * before + [1] * (len(versions) - before)
            if len(versions) <= steps_before or completion.logprobs is None:
                continue
            split += 1
            prompt = PROMPTS[completion.prompt_index]
            fresh = prompt_logprobs(llm, [prompt + completion.token_ids])[0][len(prompt) - 1 :]
            after = [(got, want) for got, want, v in zip(completion.logprobs, fresh, versions) if v == 1 and got is not None]
            assert after
            for got, want in after:
                assert got == pytest.approx(want, abs=1e-4)
            # ... while the tokens before the update were sampled by the old policy, which the new one rates otherwise.
            before_gap = [abs(got - want) for got, want, v in zip(completion.logprobs, fresh, versions) if v == 0]
            assert sum(before_gap) / len(before_gap) > 0.05
        assert split >= 2, "too few responses ran past the update"
    finally:
        load(llm, EngineBatches(llm), initial_weights, version=0)


# ---------------------------------------------------------------- tools (environments/tools.py): token in, token out


def tool_params(names: list[str], temperature: float = 0.0, n: int = 1, max_tokens: int = 24, **tool_flags) -> dict:
    settings = {"names": names, "max_calls": 5, "timeout_s": 5.0, "output_max_tokens": 64, "wrapper": "{output}"}
    return {**params(n=n, temperature=temperature, max_tokens=max_tokens), "tools": {**settings, **tool_flags}}


@contextmanager
def registered(name: str, factory, registry: str = "TOOLS"):
    getattr(tools, registry)[name] = factory
    try:
        yield
    finally:
        del getattr(tools, registry)[name]


def generate_alone(llm, prompts, settings: dict, seed: int | None = None) -> list:
    from open_instruct.generation.engine_batches import generate_batch

    return generate_batch(llm, prompts, settings, seed)


def observations(completion) -> list[list[int]]:
    """The runs of tokens the model did not sample (the tools' outputs), in order."""
    runs, current = [], []
    for token, sampled in zip(completion.token_ids, completion.sampled or [True] * len(completion.token_ids)):
        if not sampled:
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    return runs + ([current] if current else [])


@pytest.fixture(scope="module")
def split_end(llm):
    """A piece of a sampled answer to PROMPTS[0] (seeded) that spans two tokens (the last character of one and the text
    of the next): an end string the engine can only see by joining two decode steps. (string, k, seed): the k-th
    token completes it, and with that seed the sample goes on after a call there (seeds are tried in order)."""
    tokenizer = llm.get_tokenizer()
    for seed in range(40):
        sampled = generate_alone(llm, PROMPTS[:1], params(n=1, max_tokens=24), seed=seed)[0]
        for k in range(2, len(sampled.token_ids) - 2):
            before, upto = tokenizer.decode(sampled.token_ids[: k - 1]), tokenizer.decode(sampled.token_ids[:k])
            # Whole characters only: the detokenizer holds back the text of a token that ends inside a character.
            if sampled.text.startswith(upto) and len(upto) > len(before) >= 1 and "\ufffd" not in upto:
                end = sampled.text[len(before) - 1 : len(upto)]
                if sampled.text.find(end) + len(end) == len(upto):
                    with registered("marker", marker_tool(end, lambda: " [42] ")):
                        got = generate_alone(llm, PROMPTS[:1], tool_params(["marker"], temperature=1.0), seed=seed)[0]
                    if got.sampled is not None and got.sampled.count(True) >= k + 2:  # it wrote more after the output
                        return end, k, seed, sampled
                    break
    pytest.fail("no seed gives an answer with an end string spanning two tokens and more after it")


def marker_tool(end: str, answer):
    class Marker(tools.Tool):
        name, start = "marker", ""

        def __call__(self, text):
            return answer()

    Marker.end = end
    return Marker


def assert_logprobs_are_the_engines_on_these_tokens(llm, prompt: list[int], completion, versions=(0,)) -> int:
    """Every sampled token's engine logprob (of the versions given) equals a fresh look of the engine's weights at the
    whole sequence, tool outputs included: what the model read is exactly these tokens. Returns how many it checked."""
    fresh = prompt_logprobs(llm, [prompt + completion.token_ids])[0][len(prompt) - 1 :]
    checked = [(have, want) for have, want, sampled, version in
               zip(completion.logprobs, fresh, completion.sampled, completion.versions)
               if sampled and have is not None and version in versions]  # fmt: skip
    for have, want in checked:
        assert have == pytest.approx(want, abs=1e-4)
    return len(checked)


def test_a_tool_call_split_over_two_decode_steps_is_answered_token_in_token_out(llm, split_end):
    """The call is found when the second piece of its end string arrives; the output's tokens follow the model's
    tokens as they are (never re-rendered) and carry no logprob and no version; the logprobs of what the model writes
    next are the engine's given exactly these tokens."""
    end, k, seed, sampled = split_end
    tokenizer = llm.get_tokenizer()
    with registered("marker", marker_tool(end, lambda: " [42] ")):
        got = generate_alone(llm, PROMPTS[:1], tool_params(["marker"], temperature=1.0), seed=seed)[0]
    output = tokenizer.encode(" [42] ", add_special_tokens=False)
    assert got.token_ids[:k] == sampled.token_ids[:k]
    assert got.token_ids[k : k + len(output)] == output
    assert got.sampled[: k + len(output)] == [True] * k + [False] * len(output)
    tool = [i for i, is_sampled in enumerate(got.sampled) if not is_sampled]
    assert all(got.logprobs[i] is None and got.versions[i] is None for i in tool)
    assert all(got.versions[i] == 0 for i in range(len(got.token_ids)) if got.sampled[i])
    assert got.tool_stats["calls"] == len(observations(got)) >= 1
    assert len(got.token_ids) <= 24  # the budget counts the tool's tokens
    assert assert_logprobs_are_the_engines_on_these_tokens(llm, PROMPTS[0], got) > k


def test_bad_tools_are_answered_with_text_and_counted(llm, split_end):
    """A tool that raises, one that hangs past --tool_timeout_s, one that returns too much: the model reads an error
    or a cut output, each counted, and the response goes on; nothing stops generation."""
    end, k, seed, _ = split_end
    tokenizer = llm.get_tokenizer()

    def raising():
        raise KeyError("boom")

    with registered("marker", marker_tool(end, raising)):
        got = generate_alone(llm, PROMPTS[:1], tool_params(["marker"], temperature=1.0), seed=seed)[0]
    assert "Error: KeyError: 'boom'" in got.text
    assert got.tool_stats["errors"] == got.tool_stats["calls"] >= 1

    with registered("marker", marker_tool(end, lambda: time.sleep(3) or "late")):
        start = time.monotonic()
        got = generate_alone(llm, PROMPTS[:1], tool_params(["marker"], temperature=1.0, timeout_s=0.3), seed=seed)[0]
        took = time.monotonic() - start
    assert got.tool_stats["timeouts"] == got.tool_stats["calls"] >= 1
    assert "longer than 0.3 s" in got.text and "late" not in got.text
    assert took < 3 * got.tool_stats["calls"]

    with registered("marker", marker_tool(end, lambda: "word " * 200)):
        settings = tool_params(["marker"], temperature=1.0, output_max_tokens=4, max_tokens=40)
        got = generate_alone(llm, PROMPTS[:1], settings, seed=seed)[0]
    assert got.tool_stats["outputs_cut"] == got.tool_stats["calls"] >= 1
    assert all(len(run) <= 4 for run in observations(got))
    assert len(got.token_ids) <= 40
    assert tokenizer.decode(observations(got)[0]).strip().startswith("word")


class EveryLetter(tools.Environment):
    """An environment whose turn ends at any letter or digit: a model that calls it forever."""

    end_strings = tuple(string.ascii_letters + string.digits)

    def reset(self, row):
        self.row, self.turns = row, 0

    def step(self, text):
        time.sleep(random.uniform(0.0, 0.02))  # answers arrive in another order each time: the run must not care
        self.turns += 1
        return f"<{self.turns}>", 0.25, False


def test_a_model_calling_forever_ends_at_max_tool_calls_and_timing_never_changes_a_run(llm):
    """Every token ends a turn: a response ends at its second call with --max_tool_calls 1, and two runs whose
    environments answer in different orders (random delays) generate the same tokens."""
    with registered("every_letter", EveryLetter, "ENVIRONMENTS"):
        settings = tool_params(["every_letter"], temperature=1.0, n=2, max_calls=1)
        first = generate_alone(llm, PROMPTS, settings, seed=3)
        again = generate_alone(llm, PROMPTS, settings, seed=3)
    assert [(c.token_ids, c.sampled, c.finish_reason) for c in first] == [
        (c.token_ids, c.sampled, c.finish_reason) for c in again
    ]
    ended = [c for c in first if c.finish_reason == "max_tool_calls"]
    assert len(ended) >= 2, [c.text for c in first]
    for c in first:  # a response without a call has no tool stats (and no sampled mask: all its tokens are)
        stats = c.tool_stats or {"calls": 0, "reward": 0.0}
        assert stats["calls"] <= 1 and stats["reward"] == 0.25 * stats["calls"]
    assert all(c.tool_stats["calls"] == 1 for c in ended)


def test_environments_that_cannot_start_end_their_own_samples_and_the_batch_goes_on(llm):
    """User environments that fail to start: a reset that raises, one that hangs far past --tool_timeout_s, a
    constructor that raises. Each such sample ends at its first token reading why (finish reason
    "environment_error", tools/start_errors), the hang cut at the timeout; the batch's other samples call their
    environment as usual, and its megabyte observations are cut to --tool_output_max_tokens."""
    from tests.support.tool_environments import BuiltBadly, StartsBadly

    settings = tool_params(["bad"], temperature=1.0, n=2, max_tokens=64, timeout_s=1.0, output_max_tokens=24, max_calls=2)
    with registered("bad", StartsBadly, "ENVIRONMENTS"):
        start = time.monotonic()
        got = generate_alone(llm, PROMPTS, settings, seed=0)
        took = time.monotonic() - start
    assert took < 60, f"{took:.0f} s: the hanging reset (120 s) held the batch"
    why = {1: "Error: the environment could not start: RuntimeError: no environment for this prompt",
           2: "Error: the environment could not start: it took longer than 1 s and was stopped"}  # fmt: skip
    for completion in got:
        runs = observations(completion)
        assert all(len(run) <= 24 for run in runs), completion.text
        if completion.prompt_index in why:
            assert completion.finish_reason == "environment_error"
            assert completion.tool_stats["start_errors"] == 1 and completion.tool_stats["calls"] == 0
            assert completion.sampled.index(False) >= 1 and len(runs) == 1  # its first token (the learner's), then why
            assert llm.get_tokenizer().decode(runs[0]) == why[completion.prompt_index]
        else:  # a response that stops before its first letter calls nothing
            stats = completion.tool_stats or {"start_errors": 0, "calls": 0, "outputs_cut": 0}
            assert stats["start_errors"] == 0 and stats["outputs_cut"] == stats["calls"] == len(runs)
            assert completion.finish_reason != "environment_error"
    assert sum(len(observations(c)) for c in got if c.prompt_index not in why) >= 2

    BuiltBadly.built = itertools.count()
    with registered("bad", BuiltBadly, "ENVIRONMENTS"):
        got = generate_alone(llm, PROMPTS, settings, seed=0)
    failed = [c for c in got if c.finish_reason == "environment_error"]
    assert len(failed) == len(got) // 2
    assert all("could not start: ValueError: cannot build this environment" in c.text for c in failed)
    assert all(c.finish_reason != "environment_error" for c in got if c not in failed)


def test_an_in_flight_update_across_a_tool_call(llm, split_end, perturbed_weights, initial_weights):
    """Weights change right after the call: the model's tokens before it carry version 0, the tool's none, the
    model's after it version 1, and their logprobs are the new policy's given exactly these tokens."""
    from open_instruct.generation.engine_batches import EngineBatches

    end, k, seed, _ = split_end
    with registered("marker", marker_tool(end, lambda: " [42] ")):
        batches = EngineBatches(llm)
        try:
            batches.admit(0, PROMPTS[:1], tool_params(["marker"], temperature=1.0), sampling_seed=seed)
            sample = batches.batches[0][0]
            while id(sample) not in batches.parked:  # its call runs while the weights change (pause waits for it)
                batches.step()
            load(llm, batches, perturbed_weights, version=1)
            got = batches.run_until_complete(0)[0]
            after_call = got.sampled.index(True, k)
            assert got.versions[:after_call] == [0] * k + [None] * (after_call - k)
            assert all(v == 1 if sampled else v is None
                       for v, sampled in zip(got.versions[after_call:], got.sampled[after_call:]))  # fmt: skip
            assert assert_logprobs_are_the_engines_on_these_tokens(llm, PROMPTS[0], got, versions=(1,)) >= 1
        finally:
            load(llm, batches, initial_weights, version=0)


def test_a_stop_string_split_across_an_in_flight_update_ends_the_response_there(llm, split_end, initial_weights):
    """--stop_strings with --inflight_updates: a stop string whose first character was generated before a weight update
    and whose last arrives after the resubmission (prompt + tokens so far: a new vLLM request, whose own output holds
    only the second piece) ends the response there, as a stop string ends a response that never left the engine: text
    cut just after it, tokens as sampled, finish reason stop."""
    from open_instruct.generation.engine_batches import EngineBatches

    end, k, seed, sampled = split_end
    tokenizer = llm.get_tokenizer()
    settings = params(n=1) | {"stop_strings": [end]}
    expected = (sampled.token_ids[:k], tokenizer.decode(sampled.token_ids[:k]), "stop")
    alone = generate_alone(llm, PROMPTS[:1], settings, seed=seed)[0]
    assert (alone.token_ids, alone.text, alone.finish_reason) == expected

    def updated_after(tokens: int, stop_strings) -> object:
        """The sample, its request resubmitted (the same weights, as version 1) once it has `tokens` tokens."""
        batches = EngineBatches(llm)
        batches.admit(0, PROMPTS[:1], params(n=1) | {"stop_strings": stop_strings}, sampling_seed=seed)
        while len(batches.batches[0][0].token_ids) < tokens:
            batches.step()
        load(llm, batches, initial_weights, version=1)
        return batches.run_until_complete(0)[0]

    # The resubmitted request draws its own noise (engine_batches.request_seed): find, among the places of the update,
    # one where the text of the tokens on either side of it makes an end string, as `split_end` does.
    for k in range(2, 20):
        full = updated_after(k - 1, None)
        before, upto = tokenizer.decode(full.token_ids[: k - 1]), tokenizer.decode(full.token_ids[:k])
        if full.text.startswith(upto) and len(upto) > len(before) >= 1 and "\ufffd" not in upto:
            end = full.text[len(before) - 1 : len(upto)]
            if full.text.find(end) + len(end) == len(upto) and len(full.token_ids) > k:
                break
    else:
        pytest.fail("no place of the update splits an end string over the tokens on either side of it")
    got = updated_after(k - 1, [end])
    assert (got.token_ids, got.text, got.finish_reason) == (full.token_ids[:k], upto, "stop")
    assert got.versions == [0] * (k - 1) + [1]


@pytest.mark.parametrize("reentry_steps", [1, 6, 0])
def test_calls_that_take_random_times_never_change_the_tokens(llm, reentry_steps):
    """Each call takes 0-0.5 s, another time on each run. With --tool_reentry_steps N > 0 a parked sample comes back
    N steps after its call whatever the call's time: the two runs decode the same samples together at every step and
    are equal bit for bit, logprobs included. With 0 a sample comes back as soon as its call is: beside other samples
    each time, and the two runs still generate the same tokens (each request is seeded by its sample and its tokens
    so far, never by when it was submitted), their logprobs within float rounding."""
    from open_instruct.generation.engine_batches import EngineBatches
    from tests.support.tool_environments import SleepsRandomly

    def run() -> tuple[list, list]:
        """The completions, and which samples were in the engine after each step (the others parked or done)."""
        batches = EngineBatches(llm)
        batches.admit(0, PROMPTS, settings, sampling_seed=11)
        in_engine = []
        while not all(sample.done for sample in batches.batches[0]):
            batches.step()
            in_engine.append(sorted(sample.index for sample in batches.running.values()))
        return batches.run_until_complete(0), in_engine

    with registered("sleeps_randomly", SleepsRandomly, "ENVIRONMENTS"):
        settings = tool_params(["sleeps_randomly"], temperature=1.0, n=2, max_calls=2, max_tokens=32,
                               reentry_steps=reentry_steps)  # fmt: skip
        (first, first_in_engine), (again, again_in_engine) = run(), run()
    fields = lambda c: (c.token_ids, c.sampled, c.versions, c.finish_reason)  # noqa: E731
    assert sum(c.tool_stats["calls"] for c in first if c.tool_stats) >= 8
    assert [fields(c) for c in first] == [fields(c) for c in again]
    if reentry_steps > 0:
        assert first_in_engine == again_in_engine, "which samples share a step must not depend on the calls' times"
        assert [c.logprobs for c in first] == [c.logprobs for c in again]
        return
    assert first_in_engine != again_in_engine, "the calls' times should change which samples are decoded together"
    # The batch a token is decoded in moves its logprob by up to one float32 ulp on this CPU (measured: 24 of 134
    # sampled tokens' logprobs, near -10.5, moved by 9.5e-7 between calls answered at once and calls taking random
    # times), far below what changes a draw here; the tokens are the same.
    for completion, other in zip(first, again):
        assert completion.logprobs == pytest.approx(other.logprobs, abs=1e-5)


@pytest.mark.parametrize("reentry_steps", [1000, 0])
def test_a_parked_sample_does_not_hold_the_others(llm, reentry_steps):
    """The samples of one prompt call a tool that takes 5 s; the others never call. The engine goes on stepping the
    others while the slow calls run: they finish before the slow calls return (answered before the next step, as
    they once were, the calls would hold every sample for 5 s). With --tool_reentry_steps 1000 the slow samples are due
    long after the others end: once nothing else runs, they come back as soon as their calls do."""
    from open_instruct.generation.engine_batches import EngineBatches
    from tests.support.tool_environments import SlowForSomePrompts

    class SlowForPromptZero(SlowForSomePrompts):
        slow_prompts, seconds = 1, 5.0

    with registered("slow", SlowForPromptZero, "ENVIRONMENTS"):
        batches = EngineBatches(llm)
        settings = tool_params(["slow"], temperature=1.0, n=2, max_calls=1, max_tokens=24, timeout_s=30.0,
                               reentry_steps=reentry_steps)  # fmt: skip
        batches.admit(0, PROMPTS, settings, sampling_seed=3)
        samples = batches.batches[0]
        slow, others = samples[:2], samples[2:]
        steps_while_parked = 0
        while not all(s.done for s in others):
            parked = bool(batches.parked)
            batches.step()
            steps_while_parked += parked
        calls_when_others_done = [s.tool_stats["calls"] for s in slow]
        got = batches.run_until_complete(0)
    assert calls_when_others_done == [0, 0], "the slow calls returned before the other samples finished"
    assert all(s.tool_stats["calls"] == 1 and " [slow]" in s.text for s in slow), [s.text for s in slow]
    assert steps_while_parked >= 5
    assert all(c.tool_stats is None or c.tool_stats["calls"] == 0 for c in got[2:])


class TurnLength(EveryLetter):
    """EveryLetter without state: its answer depends on the turn's text alone (what survives a resume)."""

    def step(self, text):
        return f"<{len(text)}>", 0.0, False


def test_a_snapshot_taken_after_tool_calls_restores_into_a_fresh_engine_bit_for_bit(llm, second_llm):
    """Resume with tools: the batch's samples hold tool outputs when the snapshot is taken (it waits for the parked
    samples' calls, so none is mid-call); a fresh engine that restores it calls the same tools and ends with the same
    tokens, logprobs, versions, masks and counts as the engine it was taken from."""
    from open_instruct.generation.engine_batches import EngineBatches

    with registered("turn_length", TurnLength, "ENVIRONMENTS"):
        settings = tool_params(["turn_length"], temperature=1.0, n=2, max_calls=4)
        batches = EngineBatches(llm)
        batches.admit(0, PROMPTS, settings, sampling_seed=5)
        batches.step()  # each sample's first token: a letter ends a turn, so most now hold an output
        snapshot = copy.deepcopy(batches.partial_batches())
        torch.manual_seed(7)  # the process's global generator: each request has its own, so it matters not
        expected = batches.run_until_complete(0)
        assert any(s["tool_stats"]["calls"] and not s["finish_reason"] for s in snapshot[0]["samples"])
        restored = EngineBatches(second_llm)
        restored.restore(snapshot)
        torch.manual_seed(8)
        got = restored.run_until_complete(0)
    fields = lambda c: (c.token_ids, c.logprobs, c.versions, c.sampled, c.text, c.finish_reason,  # noqa: E731
                        {k: v for k, v in (c.tool_stats or {}).items() if k != "seconds"})  # fmt: skip
    assert [fields(c) for c in got] == [fields(c) for c in expected]


def test_a_snapshot_restored_into_a_fresh_engine_continues_bit_for_bit(llm, second_llm, perturbed_weights,
                                                                        initial_weights):  # fmt: skip
    """Two batches in flight (the second admitted later), a snapshot, then an in-flight update, a greedy eval (the
    batches advance during its steps) and a third batch: the engine it was taken from and a fresh engine that
    restored it generate the same tokens, logprobs and versions, whatever the process's global generator holds
    (each request is seeded: engine_batches.request_seed)."""
    from open_instruct.generation.engine_batches import EngineBatches

    def after_snapshot(batches, engine, global_seed: int) -> list:
        load(engine, batches, perturbed_weights, version=1)
        torch.manual_seed(global_seed)  # the process's own generator, as vLLM's warm-up or the learner leave it
        batches.admit(("eval", 1), PROMPTS, params(n=1, temperature=0.0), sampling_seed=None)
        batches.run_until_complete(("eval", 1))
        batches.admit(2, PROMPTS, params(), sampling_seed=9)
        return [batches.run_until_complete(batch_id) for batch_id in (0, 1, 2)]

    batches = EngineBatches(llm)
    batches.admit(0, PROMPTS, params(), sampling_seed=5)
    for _ in range(3):
        batches.step()
    batches.admit(1, PROMPTS[:2], params(), sampling_seed=6)
    for _ in range(4):
        batches.step()
    snapshot = copy.deepcopy(batches.partial_batches())
    try:
        expected = after_snapshot(batches, llm, global_seed=1)
    finally:
        load(llm, batches, initial_weights, version=0)
    assert any(s["token_ids"] and not s["finish_reason"] for batch in snapshot for s in batch["samples"])

    restored = EngineBatches(second_llm)
    restored.restore(snapshot)
    got = after_snapshot(restored, second_llm, global_seed=2)
    for want_batch, got_batch in zip(expected, got):
        assert [(c.token_ids, c.logprobs, c.versions, c.text, c.finish_reason) for c in got_batch] == [
            (c.token_ids, c.logprobs, c.versions, c.text, c.finish_reason) for c in want_batch
        ]
