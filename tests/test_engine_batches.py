"""Rollout batches in a real in-process vLLM engine (engine_batches.py), on the tiny model whose answers stop at varied
lengths:

- one batch alone gives exactly what vLLM's own `LLM.generate` gives (the sync and one-batch-at-a-time modes);
- an in-flight weight update: the tokens generated before it carry version k and those after it k+1, and the engine's
  logprob of every token after it equals a fresh look of the new weights at the whole sequence (prompt logprobs of
  the same engine, now holding only the new weights): the behaviour logprobs are exact token by token;
- a snapshot of the batches in flight, restored into a fresh engine, continues bit for bit as the engine it was taken
  from does (exact resume with --inflight_updates).
"""

import copy
import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_prompt_logprobs import prompt_logprobs  # noqa: E402

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
    from open_instruct.generation.engine_batches import EngineBatches, seed_sampling

    seed_sampling(5)
    expected = vllm_engine.generate(llm, PROMPTS, vllm_engine.sampling_params(**params()))
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


def test_a_snapshot_restored_into_a_fresh_engine_continues_bit_for_bit(llm, varied_length_model_dir, perturbed_weights,
                                                                        initial_weights):  # fmt: skip
    """Two batches in flight (the second admitted later), a snapshot, then an in-flight update and a third batch: the
    engine it was taken from and a fresh engine that restored it generate the same tokens, logprobs and versions."""
    from open_instruct.generation.engine_batches import EngineBatches

    def after_snapshot(batches, engine) -> list:
        load(engine, batches, perturbed_weights, version=1)
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
        expected = after_snapshot(batches, llm)
    finally:
        load(llm, batches, initial_weights, version=0)
    assert any(s["token_ids"] and not s["finish_reason"] for batch in snapshot for s in batch["samples"])

    fresh = new_engine(varied_length_model_dir)
    try:
        restored = EngineBatches(fresh)
        restored.restore(snapshot)
        got = after_snapshot(restored, fresh)
    finally:
        del fresh
        gc.collect()
    for want_batch, got_batch in zip(expected, got):
        assert [(c.token_ids, c.logprobs, c.versions, c.text, c.finish_reason) for c in got_batch] == [
            (c.token_ids, c.logprobs, c.versions, c.text, c.finish_reason) for c in want_batch
        ]
