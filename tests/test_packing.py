"""Packed, token-budget micro-batches (--max_tokens_per_micro_batch, rl/packing.py):

- the plan: every row in exactly one micro-batch, none over the budget unless a row alone is, the same number of
  micro-batches on every rank, ranks balanced by tokens;
- the packed forward of the tiny model gives the padded forward's logprobs, entropies, values and scores (no
  attention crosses from one packed sequence to another);
- a PPO and a GRPO step (token and sequence aggregation), fp32, on a mixed-length rollout: packed micro-batches give
  the padded step's metrics within 1e-6, its gradients and its weights, with fewer token slots;
- two DeepSpeed ranks, packed or in padded micro-batches, take the single process's step: the gradients each optimizer
  step receives (read after the minibatch's last backward, before the optimizer), then the weights. Weights after
  AdamW alone would hide a loss-scale error: AdamW's update is the same for gradients scaled by any factor (but for its
  epsilon), so a rank that summed its gradients twice takes the same step. (The gradients of every split of a
  minibatch, one process: test_micro_batches.py.)
"""

import pytest
import torch

from open_instruct.learner import models
from open_instruct.learner.experience import micro_batches
from open_instruct.rewards.manager import RewardManager
from open_instruct.rl.packing import first_fit_decreasing, pack_rows, plan_micro_batches
from tests.support.learner_steps import (
    assert_same_gradients,
    learner_with_experience,
    mixed_length_rollout,
    recorded_gradients,
)
from tests.support.ray_runs import needs_loopback_namespace


def test_first_fit_decreasing_keeps_every_group_within_the_budget():
    lengths = [5, 90, 30, 30, 60, 10, 120, 45, 1]
    groups = first_fit_decreasing(lengths, 100)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= 100 or len(g) == 1 for g in groups)
    assert len(groups) == 4  # 120 alone; the other 271 tokens in 3 groups ([90, 10], [60, 30, 5, 1], [45, 30])
    assert [6] in groups


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_rank_gets_the_same_number_of_micro_batches_and_about_the_same_tokens(world_size):
    generator = torch.Generator().manual_seed(0)
    lengths = (20 + torch.randint(0, 400, (24,), generator=generator) ** 2 // 400).tolist()  # a long tail
    plan = plan_micro_batches(lengths, 300, world_size)
    assert len(plan) == world_size and len({len(rank) for rank in plan}) == 1
    assert sorted(i for rank in plan for g in rank for i in g) == list(range(len(lengths)))
    tokens = [sum(lengths[i] for g in rank for i in g) for rank in plan]
    assert max(tokens) - min(tokens) <= max(lengths)  # dealt by tokens: within one sequence of each other
    assert all(sum(lengths[i] for i in g) <= 300 or len(g) == 1 for rank in plan for g in rank)


def test_pack_rows_lays_the_real_tokens_end_to_end_with_positions_restarting():
    # context 3; rows: query [7, 8] response [9]; query [4, 5, 6] response [1, 2]
    query_response = torch.tensor([[0, 7, 8, 9, 0], [4, 5, 6, 1, 2]])
    attention_mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    packed = pack_rows(query_response, attention_mask, 3)
    assert packed.input_ids.tolist() == [[7, 8, 9, 4, 5, 6, 1, 2]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert packed.predict_index.tolist() == [1, 5, 6] and packed.response_labels.tolist() == [9, 1, 2]
    assert packed.last_index.tolist() == [2, 7]
    assert packed.unpack(torch.tensor([1.0, 2.0, 3.0])).tolist() == [[1.0, 0.0], [2.0, 3.0]]


def mixed_length_rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Left-padded queries of 1..7 tokens, responses of 0..9 tokens: [4, 16] each, context 7."""
    context, width = 7, 9
    query_response = torch.randint(5, vocab, (4, context + width), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.zeros_like(query_response)
    for row, (query, response) in enumerate([(7, 9), (3, 2), (5, 0), (1, 5)]):
        attention_mask[row, context - query : context + response] = 1
    return query_response, attention_mask, context


@pytest.mark.parametrize("chunk_size", [0, 4])
def test_a_packed_forward_gives_the_padded_logprobs_values_and_scores(tiny_model_dir, chunk_size):
    policy = models.TokenLogprobs(models.load_policy(tiny_model_dir, torch.device("cpu")), chunk_size)
    scorer = models.TokenScores(models.load_model(
        models.ModelSpec("value model", tiny_model_dir, scalar_head=True, pad_token_id=0), torch.device("cpu")
    ))  # fmt: skip
    query_response, attention_mask, context = mixed_length_rows(policy.hf_model.config.vocab_size)
    response_mask = attention_mask[:, context:].bool()
    packed = pack_rows(query_response, attention_mask, context)
    with torch.no_grad():
        logprob, entropy = models.response_logprobs(policy, query_response, attention_mask, context, 0.7, True)
        packed_logprob, packed_entropy = models.packed_response_logprobs(policy, packed, 0.7, True)
        value = models.response_values(scorer, query_response, attention_mask, context)
        packed_value = models.packed_response_values(scorer, packed)
        score = models.reward_model_scores(scorer, query_response, attention_mask, context, response_mask.sum(1))
        packed_score = models.packed_reward_model_scores(scorer, packed)
    for padded, from_packed in [(logprob, packed_logprob), (entropy, packed_entropy), (value, packed_value)]:
        torch.testing.assert_close(from_packed[response_mask], padded[response_mask], rtol=0, atol=1e-5)
        assert (from_packed[~response_mask] == 0).all()
    torch.testing.assert_close(packed_score, score, rtol=0, atol=1e-5)


def learner_step(model_dir: str, algorithm: str, *flags: str):
    """One make_experience + train of a fresh learner on the fixed mixed-length rollout; (metrics, experience, weights,
    micro-batch plans, the gradients each optimizer step received)."""
    learner, exp, experience_metrics = learner_with_experience(model_dir, algorithm, *flags)
    max_tokens = learner.args.ppo.max_tokens_per_micro_batch
    plans = [micro_batches(exp, m, 2, max_tokens, 0, 1) for m in torch.arange(8).split(4)]
    gradients = recorded_gradients(learner)
    metrics = {**experience_metrics, **learner.train(exp)}
    weights = {name: p.detach().clone() for name, p in learner.backend.hf_model(learner.policy).named_parameters()}
    return metrics, exp, weights, plans, gradients


def assert_same_steps(got: list[dict], expected: list[dict], what: str) -> None:
    """The gradients of every optimizer step (2 epochs x 2 minibatches, each model), within 1e-5: packed, the attention
    sums each sequence alone and the tied embedding's gradient adds its rows' parts in another order (1.2e-6 to 2.3e-6
    measured, test_micro_batches.py). A loss scaled by 2 is 2x off."""
    assert len(got) == len(expected) >= 4, what
    for number, (mine, theirs) in enumerate(zip(got, expected)):
        assert_same_gradients(mine, theirs, f"{what}, step {number}", atol=1e-5)


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_packed_micro_batches_take_the_padded_step(tiny_model_dir, algorithm, aggregation):
    """The padded reference holds each minibatch (4 rows) in one micro-batch: its losses are the minibatch's means.
    Packed at 100 tokens the same minibatches run as several micro-batches of 1-3 sequences each, and so do
    make_experience's forward passes (old and reference logprobs, values)."""
    common = ["--loss_aggregation", aggregation, "--per_device_train_batch_size"]
    padded, exp, padded_weights, _, padded_gradients = learner_step(tiny_model_dir, algorithm, *common, "4")
    packed, packed_exp, packed_weights, plans, packed_gradients = learner_step(
        tiny_model_dir, algorithm, *common, "2", "--max_tokens_per_micro_batch", "100")  # fmt: skip
    lengths = exp.attention_mask.sum(1)
    assert lengths.min() < 0.6 * lengths.max()  # a mixed-length rollout
    assert all(1 < len(plan) < 4 for plan in plans)  # packed: more than one micro-batch, fewer than one per row
    assert all(micro.real_tokens <= 100 for plan in plans for micro in plan)
    mask = exp.response_mask
    for field in ["logprob", "ref_logprob", "value", "advantage", "return_"]:
        if getattr(exp, field) is not None:
            # Within 1e-6, relative for the values and returns of ~10 (an fp32 ulp there is ~1e-6): the packed
            # attention sums in another order (each sequence alone, varlen_attention.py).
            torch.testing.assert_close(getattr(packed_exp, field)[mask], getattr(exp, field)[mask], rtol=1e-6, atol=1e-6)
    assert (packed_exp.value is None) == (algorithm == "grpo")
    assert set(packed) == set(padded)
    assert packed["perf/padding_fraction"] == 0.0 < padded["perf/padding_fraction"]  # every pass on real tokens only
    for key in padded:
        if not key.startswith(("perf/", "time/")):
            assert packed[key] == pytest.approx(padded[key], rel=1e-6, abs=1e-6), key
    assert_same_steps(packed_gradients, padded_gradients, "packed against padded")
    for name, weight in padded_weights.items():
        torch.testing.assert_close(packed_weights[name], weight, rtol=0, atol=1e-5, msg=name)
    # The same real tokens, with no padding slot left.
    assert packed["perf/real_tokens"] == padded["perf/real_tokens"] == packed["perf/token_slots"]
    assert padded["perf/token_slots"] > padded["perf/real_tokens"]


# ---- two DeepSpeed ranks (spawned here, gloo on 127.0.0.1: only inside the loopback-only namespace) ----------------


def step_on_rank(rank: int, port: int, results, model_dir: str, stage: int, *flags: str) -> None:
    import deepspeed

    from tests.support.deepspeed_ranks import learner_on_rank, recorded_rank_gradients

    learner, tokenizer = learner_on_rank(rank, port, model_dir, stage, "--response_length", "48", *flags)
    gradients = recorded_rank_gradients(learner)
    prompts, completions = mixed_length_rollout(tokenizer)
    exp, metrics, _ = learner.make_experience(prompts, completions, RewardManager(learner.args.reward))
    ppo = learner.args.ppo
    minibatches = torch.arange(8).split(4)
    plans = [micro_batches(exp, m, ppo.per_device_train_batch_size, ppo.max_tokens_per_micro_batch, rank, 2)
             for m in minibatches]  # fmt: skip
    metrics.update(learner.train(exp))
    weights = {}
    for name, param in learner.backend.hf_model(learner.policy).named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=stage == 3):  # a collective: every rank gathers
            weights[name] = param.detach().cpu().clone()
    tokens = [sum(micro.real_tokens for micro in plan) for plan in plans]
    results[rank] = (metrics, weights if rank == 0 else None, [len(plan) for plan in plans], tokens,
                     gradients if rank == 0 else None)  # fmt: skip


@pytest.fixture(scope="module")
def whole_minibatch_step(tiny_model_dir):
    """The reference of every two-rank test below: one process holding each minibatch in one padded micro-batch."""
    return learner_step(tiny_model_dir, "ppo", "--per_device_train_batch_size", "4")


def two_ranks_against_one_whole_minibatch(whole_minibatch_step, model_dir: str, stage: int, *flags: str):
    """One PPO step on two ZeRO ranks with `flags`, checked against one process that holds each minibatch in one
    padded micro-batch: the same gradients at every optimizer step (1e-5), weights (1e-5) and metrics (1e-6). Returns
    the ranks' results and the reference."""
    from tests.support.deepspeed_ranks import run_two_ranks

    padded, _, padded_weights, _, padded_gradients = whole_minibatch_step
    results = run_two_ranks(step_on_rank, model_dir, stage, *flags)
    metrics, weights, counts, _, gradients = results[0]
    assert counts == results[1][2]  # every rank runs as many micro-batches (ZeRO's collectives)
    assert_same_steps(gradients, padded_gradients, f"two ranks at ZeRO-{stage} against one process")
    for name, weight in padded_weights.items():
        torch.testing.assert_close(weights[name], weight, rtol=0, atol=1e-5, msg=name)
    # Under ZeRO-3 policy/weight_norm_vs_start came out 6e-5 off the single process's although the weights agree
    # (above): it is a function of the weights alone (learner.models.weight_norm over ZeRO-3 partitions), so not a
    # packing matter; tests/test_ray_learners.py compares it to 1e-4.
    unequal = {"policy/weight_norm_vs_start"} if stage == 3 else set()
    for key in padded:
        if not key.startswith(("perf/", "time/")) and key not in unequal:
            assert metrics[key] == pytest.approx(padded[key], rel=1e-6, abs=1e-6), key
    assert metrics["perf/real_tokens"] == padded["perf/real_tokens"]
    return results, padded


@pytest.mark.e2e
@needs_loopback_namespace
@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_packed_by_tokens_take_the_single_process_padded_step(stage, tiny_model_dir, whole_minibatch_step):
    """Two ZeRO ranks, each with its share of every minibatch by tokens (as many micro-batches each), packed at 100
    tokens, take the step of one process that holds each minibatch in one padded micro-batch."""
    packing = ["--max_tokens_per_micro_batch", "100"]
    results, padded = two_ranks_against_one_whole_minibatch(whole_minibatch_step, tiny_model_dir, stage, *packing)
    for mine, other in zip(results[0][3], results[1][3]):
        assert abs(mine - other) < 60  # within about one sequence of each other
    assert results[0][0]["perf/token_slots"] == padded["perf/real_tokens"]


@pytest.mark.e2e
@needs_loopback_namespace
@pytest.mark.parametrize("stage,rows_per_micro_batch", [(2, 2), (2, 1), (3, 1)])
def test_two_ranks_of_padded_micro_batches_take_the_single_process_whole_minibatch_step(
    stage, rows_per_micro_batch, tiny_model_dir, whole_minibatch_step
):
    """Two ZeRO ranks, each with 2 rows of every 4-row minibatch in padded micro-batches of 2 rows or 1 (one or two
    micro-batches a rank), take the step of one process that holds each minibatch in one micro-batch (before the
    fix, each micro-batch took its own mean and DeepSpeed averaged them, so a short response's tokens weighed more)."""
    results, _ = two_ranks_against_one_whole_minibatch(
        whole_minibatch_step, tiny_model_dir, stage, "--per_device_train_batch_size", str(rows_per_micro_batch)
    )
    assert results[0][2] == [2 // rows_per_micro_batch] * 2  # micro-batches per minibatch on each rank


def test_packed_attention_takes_each_sequence_alone_and_costs_its_own_length_only(tiny_model_dir):
    """The attention of a packed row (learner/varlen_attention.py): each sequence's logits equal those of the sequence
    run alone, and the attention ran sequence by sequence (its calls' lengths), not over the whole row."""
    from transformers import AutoModelForCausalLM

    from open_instruct.learner import models, varlen_attention
    from open_instruct.rl.packing import pack_rows

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    models.finish_loading(model, models.ModelSpec("policy", tiny_model_dir))
    assert model.config._attn_implementation == varlen_attention.NAME
    lengths = [7, 3, 12]
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 1000, (length,), generator=generator) for length in lengths]
    query_response = torch.zeros(3, 12, dtype=torch.long)
    attention_mask = torch.zeros(3, 12, dtype=torch.long)
    for row, sequence in enumerate(sequences):  # left-padded prompts of 2 tokens, responses after
        query_response[row, 2 - min(2, len(sequence)) : 2 - min(2, len(sequence)) + len(sequence)] = sequence
        attention_mask[row, 2 - min(2, len(sequence)) : 2 - min(2, len(sequence)) + len(sequence)] = 1
    packed = pack_rows(query_response, attention_mask, context_length=2)
    assert packed.cu_seq_lens.tolist() == [0, 7, 10, 22] and packed.max_length == 12

    seen = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def watched_sdpa(query, *args, **kwargs):
        seen.append(query.shape[2])
        return real_sdpa(query, *args, **kwargs)

    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", watched_sdpa)
        logits = models.forward_packed(model, packed).logits[0]
    assert set(seen) == set(lengths), "the attention did not run sequence by sequence"
    with torch.no_grad():
        for sequence, start in zip(sequences, packed.cu_seq_lens.tolist()):
            alone = model(input_ids=sequence.unsqueeze(0), use_cache=False).logits[0]
            torch.testing.assert_close(logits[start : start + len(sequence)], alone, rtol=1e-5, atol=1e-5)
