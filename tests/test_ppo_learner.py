"""The learner's switches that skip work, on the tiny model and a fixed, fabricated rollout (no engine):

- `--old_logprobs_from vllm`: the experience's old logprobs are exactly the engine's (0 on padding, nothing read
  past the stop token), the policy's old-logprob forward never runs, a token without an engine logprob falls back
  to the learner's value for that token only, and the engine-vs-learner check moves to the first minibatch, before
  any update. With the learner's own logprobs as the engine's, the PPO step equals `--old_logprobs_from learner`'s.
- `--beta 0`: no reference model is loaded or run; no KL metric; checkpoints round-trip and a bf16 save still reports
  its rounding against the initial weights.
- `--truncated_importance_sampling_ratio_cap`: the weights min(pi_old / pi_vllm, C) and the policy loss they give,
  checked against numbers worked out from the experience.

Each test builds one or two learners of the 2-layer tiny model (a few seconds each on 2 cores).
"""

import math

import pytest
import torch

from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
from open_instruct.generation.vllm_engine import Completion
from open_instruct.learner import models
from open_instruct.learner.ppo import PPOLearner
from open_instruct.rewards.manager import RewardManager
from open_instruct.run.args import compute_batch_sizes, parse_args
from open_instruct.run.flops import is_timing
from tests.support.learner_steps import EQUIVALENCE_FLAGS, fixed_rollout, one_ppo_step


def build_learner(model_dir: str, *flags: str) -> tuple[PPOLearner, RewardManager]:
    args = parse_args(["--model_name_or_path", model_dir, *EQUIVALENCE_FLAGS, *flags])
    tokenizer = load_tokenizer(model_dir)
    torch.manual_seed(args.run.seed)  # the value head's init: the same in every learner of a test
    learner = PPOLearner(args, compute_batch_sizes(args), tokenizer, model_dir, stop_token_ids_for(tokenizer, "eos"))
    return learner, RewardManager(args.reward)


def with_engine_logprobs(completions: list[Completion], logprobs: list[list[float | None]]) -> list[Completion]:
    pairs = zip(completions, logprobs)
    return [Completion(c.prompt_index, c.token_ids, c.text, c.finish_reason, list(lp)) for c, lp in pairs]


def fabricated_logprobs(completions: list[Completion], seed: int = 0) -> list[list[float]]:
    generator = torch.Generator().manual_seed(seed)
    return [(-0.1 - 3 * torch.rand(len(c.token_ids), generator=generator)).tolist() for c in completions]


class ForwardLog:
    """Which models `models.response_logprobs` ran (the policy's and the reference's logprob forwards)."""

    def __init__(self, monkeypatch):
        self.models: list = []
        real = models.response_logprobs

        def logged(model, *args, **kwargs):
            self.models.append(model)
            return real(model, *args, **kwargs)

        monkeypatch.setattr(models, "response_logprobs", logged)

    def count(self, model) -> int:
        return sum(m is model for m in self.models)


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    return fixed_rollout(load_tokenizer(tiny_model_dir))


def test_old_logprobs_from_vllm_are_the_engines_and_no_policy_forward_runs(tiny_model_dir, rollout, monkeypatch):
    prompts, completions = rollout
    tokenizer = load_tokenizer(tiny_model_dir)
    # Row 0 goes on after its stop token (tokens the learner truncates): their engine logprobs must not be read.
    extra = tokenizer.encode(" and more", add_special_tokens=False)
    completions = list(completions)
    completions[0] = Completion(0, completions[0].token_ids + extra, completions[0].text, "stop")
    engine = fabricated_logprobs(completions)
    learner, reward_manager = build_learner(tiny_model_dir, "--old_logprobs_from", "vllm")
    forwards = ForwardLog(monkeypatch)
    exp, metrics, _ = learner.make_experience(prompts, with_engine_logprobs(completions, engine), reward_manager)

    assert forwards.count(learner.policy) == 0 and forwards.count(learner.ref_policy) > 0
    lengths = exp.response_mask.sum(1).tolist()
    assert lengths[0] == len(completions[0].token_ids) - len(extra)  # truncated after the stop token
    for row, length in enumerate(lengths):
        assert exp.logprob[row, :length].tolist() == engine[row][:length]  # exactly the engine's numbers
        assert exp.logprob[row, length:].eq(0).all()
    assert metrics["debug/old_logprobs_from_learner_frac"] == 0.0
    assert not any(key.startswith("debug/vllm_vs_learner") for key in metrics)  # measured in train instead
    assert "time/old_logprob_forward" not in metrics and "time/ref_logprob_forward" in metrics


def test_a_token_without_an_engine_logprob_takes_the_learners(tiny_model_dir, rollout):
    prompts, completions = rollout
    engine = fabricated_logprobs(completions)
    engine[2][-1] = None  # e.g. a stop token added back after generation
    learner, reward_manager = build_learner(tiny_model_dir, "--old_logprobs_from", "vllm")
    exp, metrics, _ = learner.make_experience(prompts, with_engine_logprobs(completions, engine), reward_manager)

    learner_logprob, _ = models.response_logprobs(
        learner.policy, exp.query_response, exp.attention_mask, exp.context_length, learner.args.gen.temperature
    )
    last = len(engine[2]) - 1
    assert exp.logprob[2, last].item() == pytest.approx(learner_logprob[2, last].item(), abs=1e-5)
    assert exp.logprob[2, :last].tolist() == engine[2][:last]
    assert exp.logprob[0, : len(engine[0])].tolist() == engine[0]
    assert metrics["debug/old_logprobs_from_learner_frac"] == pytest.approx(1 / exp.response_mask.sum().item())
    # The learner's forward ran, so the agreement was measured here, on the tokens the engine scored.
    assert metrics["debug/vllm_vs_learner_logprob_diff_mean"] > 0.1
    assert exp.engine_logprob_to_check is None


def test_vllm_old_logprobs_equal_to_the_learners_give_the_same_ppo_step(tiny_model_dir, rollout):
    prompts, completions = rollout
    reference, reward_manager = build_learner(tiny_model_dir)
    exp, _, _ = reference.make_experience(prompts, completions, reward_manager)
    reference_metrics = reference.train(exp)
    lengths = exp.response_mask.sum(1).tolist()
    engine = [exp.logprob[row, :length].tolist() for row, length in enumerate(lengths)]  # an exact fp32 engine

    learner, _ = build_learner(tiny_model_dir, "--old_logprobs_from", "vllm")
    vllm_exp, _, _ = learner.make_experience(prompts, with_engine_logprobs(completions, engine), reward_manager)
    metrics = learner.train(vllm_exp)
    # Checked on the first minibatch (2 of 4 prompts' responses here), before the first update.
    assert metrics["debug/vllm_vs_learner_logprob_diff_mean"] < 1e-5
    assert metrics["debug/vllm_vs_learner_ratio_min"] == pytest.approx(1.0, abs=1e-5)
    for key in ("loss/policy_avg", "loss/value_avg", "policy/approxkl_avg", "val/ratio"):
        assert metrics[key] == pytest.approx(reference_metrics[key], rel=1e-4, abs=1e-6), key
    for (name, param), (_, expected) in zip(learner.backend.hf_model(learner.policy).named_parameters(), reference.backend.hf_model(reference.policy).named_parameters()):
        torch.testing.assert_close(param, expected, atol=1e-5, rtol=1e-5, msg=name)


def test_vllm_old_logprobs_far_from_the_learners_stop_before_any_update(tiny_model_dir, rollout):
    prompts, completions = rollout
    learner, reward_manager = build_learner(tiny_model_dir, "--old_logprobs_from", "vllm")
    exp, _, _ = learner.make_experience(
        prompts, with_engine_logprobs(completions, fabricated_logprobs(completions)), reward_manager
    )
    before = {name: p.detach().clone() for name, p in learner.backend.hf_model(learner.policy).named_parameters()}
    with pytest.raises(RuntimeError, match=r"This rollout \(first minibatch\): vLLM and the learner disagree"):
        learner.train(exp)
    for name, param in learner.backend.hf_model(learner.policy).named_parameters():
        assert torch.equal(param, before[name]), f"{name} was updated before the check"


def test_beta_0_loads_and_runs_no_reference_model(tiny_model_dir, rollout, monkeypatch, tmp_path):
    prompts, completions = rollout
    loaded = []  # the `trainable` flag of each causal LM the learner loads: the reference is the frozen one
    real_load = models.load_model

    def logged_load(spec, device):
        if not spec.scalar_head:
            loaded.append(spec.trainable)
        return real_load(spec, device)

    monkeypatch.setattr(models, "load_model", logged_load)
    with_kl, reward_manager = build_learner(tiny_model_dir)
    assert loaded == [True, False] and with_kl.ref_policy is not None  # the default builds a reference

    loaded.clear()
    learner, _ = build_learner(
        tiny_model_dir, "--beta", "0", "--kl_in_loss", "true", "--save_dtype", "bfloat16", "--learning_rate", "1e-2"
    )
    assert loaded == [True] and learner.ref_policy is None
    forwards = ForwardLog(monkeypatch)
    exp, metrics, _ = learner.make_experience(prompts, completions, reward_manager)
    assert len(forwards.models) > 0 and all(model is learner.policy for model in forwards.models)
    assert exp.ref_logprob is None and "objective/kl" not in metrics and "time/ref_logprob_forward" not in metrics
    assert metrics["objective/non_score_reward"] == 0.0
    learner.train(exp)

    # Checkpoints hold no reference model: a fresh --beta 0 learner resumes from the state.
    resumed, _ = build_learner(tiny_model_dir, "--beta", "0")
    resumed.load_state_dict(learner.state_dict())
    for (name, param), (_, expected) in zip(resumed.backend.hf_model(resumed.policy).named_parameters(), learner.backend.hf_model(learner.policy).named_parameters()):
        assert torch.equal(param, expected), name
    # A bf16 save still measures what rounding removed, against the initial weights read again from the model's files.
    saved = learner.save(str(tmp_path / "model"))
    assert saved.rounding is not None and saved.rounding["changed"] > 0


def test_truncated_importance_sampling_weights_the_policy_loss_by_hand(tiny_model_dir, rollout):
    prompts, completions = rollout
    # One micro-batch, one minibatch, one epoch: the loss is computed once, before any update, at ratio 1.
    one_pass = ["--per_device_train_batch_size", "8", "--num_mini_batches", "1", "--num_epochs", "1"]
    plain, reward_manager = build_learner(tiny_model_dir, *one_pass)
    plain_exp, _, _ = plain.make_experience(prompts, completions, reward_manager)
    lengths = plain_exp.response_mask.sum(1).tolist()
    # Engine logprobs = the learner's old ones minus ln 3, plus ln 2, or equal, token by token in turn:
    # pi_old / pi_vllm = 3 -> capped at 2, 0.5, 1.
    offsets, expected_weights = [math.log(3), -math.log(2), 0.0], [2.0, 0.5, 1.0]
    engine = [
        [plain_exp.logprob[row, t].item() - offsets[t % 3] for t in range(length)] for row, length in enumerate(lengths)
    ]
    learner, _ = build_learner(tiny_model_dir, *one_pass, "--truncated_importance_sampling_ratio_cap", "2")
    exp, metrics, _ = learner.make_experience(prompts, with_engine_logprobs(completions, engine), reward_manager)

    weight = torch.zeros_like(exp.logprob)
    for row, length in enumerate(lengths):
        for t in range(length):
            weight[row, t] = expected_weights[t % 3]
    mask = exp.response_mask
    torch.testing.assert_close(torch.where(mask, exp.tis_weight, 0.0), weight, atol=1e-5, rtol=0)
    capped = sum(1 for length in lengths for t in range(length) if t % 3 == 0)
    assert metrics["policy/tis_capped_frac"] == pytest.approx(capped / sum(lengths))

    # At ratio 1 the clipped surrogate of a token is -A; TIS weights it: loss = sum(-A * w) / tokens.
    advantage = exp.advantage
    expected_loss = sum(
        -advantage[row, t].item() * weight[row, t].item() for row, length in enumerate(lengths) for t in range(length)
    ) / sum(lengths)
    tis_metrics = learner.train(exp)
    assert tis_metrics["loss/policy_avg"] == pytest.approx(expected_loss, abs=1e-5)
    # Without TIS the same batch's loss is -mean(A) = 0 (whitened advantages): the weights are what changed it.
    assert plain.train(plain_exp)["loss/policy_avg"] == pytest.approx(0.0, abs=1e-5)
    assert abs(expected_loss) > 1e-3  # far outside the 1e-5 tolerances above


def test_bf16_compute_on_cpu_trains_fp32_master_weights_close_to_fp32_compute(tiny_model_dir, rollout, tmp_path):
    """--learner_compute_dtype bfloat16: autocast forwards, fp32 weights and a saved fp32 update near fp32's."""
    prompts, completions = rollout
    results = {}
    for dtype in ("float32", "bfloat16"):
        learner, reward_manager = build_learner(tiny_model_dir, "--learner_compute_dtype", dtype)
        assert learner.compute_dtype == getattr(torch, dtype)
        initial = {name: p.detach().clone() for name, p in learner.backend.hf_model(learner.policy).named_parameters()}
        exp, metrics, _ = learner.make_experience(prompts, completions, reward_manager)
        learner.train(exp)
        assert all(p.dtype == torch.float32 for p in learner.backend.hf_model(learner.policy).parameters())
        saved = learner.save(str(tmp_path / dtype))
        assert saved.dtype == "float32"
        reloaded = models.load_policy(saved.path, torch.device("cpu"), trainable=True)
        update = {name: p.detach() - initial[name] for name, p in reloaded.named_parameters()}
        results[dtype] = (exp.logprob, update)
    fp32_logprob, fp32_update = results["float32"]
    bf16_logprob, bf16_update = results["bfloat16"]
    mask = fp32_logprob != 0
    # bf16 has 8 significant bits: logprobs move by ~1e-2, not by a different model's amount.
    assert 0 < (fp32_logprob - bf16_logprob)[mask].abs().mean() < 0.1
    # The saved update is there and points the way fp32's does.
    flat32 = torch.cat([u.reshape(-1) for u in fp32_update.values()])
    flat16 = torch.cat([bf16_update[name].reshape(-1) for name in fp32_update])
    assert flat16.abs().max() > 0
    assert torch.nn.functional.cosine_similarity(flat32, flat16, dim=0) > 0.5


@pytest.mark.parametrize("chunk_size", [0, 5])
def test_a_learner_step_holds_no_more_vocabulary_logits_than_a_chunk(tiny_model_dir, rollout, chunk_size):
    """Watched op by op (TorchDispatchMode): with --logprob_chunk_size C no fp32 [..., vocab] tensor of more than C
    positions is created in make_experience or train (the logprob and entropy passes and their backward); with 0 the
    whole micro-batch's logits exist, which shows the watch sees them."""
    from tests.support.vocab_watch import LargestVocabTensor

    prompts, completions = rollout
    learner, reward_manager = build_learner(tiny_model_dir, "--logprob_chunk_size", str(chunk_size))
    vocab = learner.backend.hf_model(learner.policy).config.vocab_size
    with LargestVocabTensor(vocab) as watch:
        exp, _, _ = learner.make_experience(prompts, completions, reward_manager)
        metrics = learner.train(exp)
    micro_positions = learner.args.ppo.per_device_train_batch_size * exp.response_mask.shape[1]
    if chunk_size:
        assert 0 < watch.most_positions <= chunk_size < micro_positions
    else:
        assert watch.most_positions >= micro_positions
    assert math.isfinite(metrics["policy/entropy_avg"]) and metrics["policy/entropy_avg"] > 0


def test_chunked_and_whole_logprobs_give_the_same_learner_step(tiny_model_dir, rollout):
    """The same PPO step (metrics to 1e-6, weights to 1% of a step) whether the vocabulary projection is whole or chunked."""
    prompts, completions = rollout
    steps = {}
    for chunk_size in (0, 3):
        learner, reward_manager = build_learner(tiny_model_dir, "--logprob_chunk_size", str(chunk_size))
        exp, metrics, _ = learner.make_experience(prompts, completions, reward_manager)
        metrics.update(learner.train(exp))
        weights = {name: p.detach().clone() for name, p in learner.backend.hf_model(learner.policy).named_parameters()}
        steps[chunk_size] = (metrics, weights)
    (whole, whole_weights), (chunked, chunked_weights) = steps[0], steps[3]
    for key, value in whole.items():
        if not is_timing(key):
            assert chunked[key] == pytest.approx(value, abs=1e-6), key
    # AdamW divides each gradient by its own running size, so where a gradient is near zero a rounding difference of
    # 1e-9 in it moves the weight by a visible share of the learning rate (1e-3 here): the weights are held to 1% of
    # one step, the metrics above to 1e-6.
    for name, weight in whole_weights.items():
        torch.testing.assert_close(chunked_weights[name], weight, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("flags,experience_roles", [
    (["--old_logprobs_from", "learner", "--beta", "0.05"], ["policy", "reference policy", "value model"]),
    (["--old_logprobs_from", "vllm", "--beta", "0", "--max_vllm_logprob_diff", "100"], ["value model"]),
])  # fmt: skip
def test_the_steps_work_counts_every_pass_the_learner_ran(tiny_model_dir, rollout, flags, experience_roles):
    """perf/*: make_experience counts the forwards it ran (none skipped by a switch), train adds
    num_epochs x (policy and value) forward + backward; padding is what the padded rows hold."""
    from open_instruct.learner.experience import layout_rollout
    from open_instruct.run.flops import ModelFlops

    prompts, completions = rollout
    completions = with_engine_logprobs(completions, fabricated_logprobs(completions))
    learner, reward_manager = build_learner(tiny_model_dir, *flags)
    tensors = layout_rollout(prompts, completions, learner.tokenizer.pad_token_id, learner.stop_token_ids, "cpu")
    mask, response_mask = tensors.attention_mask, tensors.response_mask
    experience, _, _ = learner.make_experience(prompts, completions, reward_manager)
    config = learner.backend.hf_model(learner.policy).config
    policy, value = ModelFlops.of_config("p", config, True), ModelFlops.of_config("v", config, False)
    flops_of = {"policy": policy, "reference policy": policy, "value model": value}
    forward = {role: flops_of[role].forward_flops(mask.sum(1), response_mask.sum(1)) for role in flops_of}
    assert learner.work.real_tokens == int(mask.sum()) < mask.numel()  # the fixed rollout's rows differ in length
    assert learner.work.passes_token_slots == len(experience_roles) * mask.numel()
    assert learner.work.flops == pytest.approx(sum(forward[role] for role in experience_roles), rel=1e-12)
    metrics = learner.train(experience)
    passes = len(experience_roles) + 2 * 2  # --num_epochs 2: policy and value, each forward and backward
    assert learner.work.passes_token_slots == passes * mask.numel()
    trained = 2 * 3 * (forward["policy"] + forward["value model"])  # 2 epochs of forward + backward (3x forward)
    assert learner.work.flops == pytest.approx(sum(forward[role] for role in experience_roles) + trained, rel=1e-12)
    assert metrics["perf/padding_fraction"] == pytest.approx(1 - int(mask.sum()) / mask.numel())
    assert metrics["perf/tokens_per_second"] == pytest.approx(int(mask.sum()) / learner.work.seconds)
    assert 0 < metrics["perf/learner_flops_utilization"] < 1


TOOL_OUTPUT = [1000, 1001, 1002]  # token ids none of the fixed responses holds: they mark a tool's output


def with_tool_outputs(completions: list[Completion]) -> list[Completion]:
    """The fixed responses with tools' outputs inserted: none in row 1, one in most rows, three in row 0."""
    calls_by_row = {0: [1, 2, 3], 1: []}
    result = []
    for row, c in enumerate(completions):
        assert not set(TOOL_OUTPUT) & set(c.token_ids)
        token_ids, sampled = list(c.token_ids), [True] * len(c.token_ids)
        for at in reversed(calls_by_row.get(row, [2])):
            token_ids[at:at] = TOOL_OUTPUT
            sampled[at:at] = [False] * len(TOOL_OUTPUT)
        result.append(Completion(c.prompt_index, token_ids, c.text, c.finish_reason, sampled=sampled))
    return result


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_absurd_logprobs_and_values_on_tool_tokens_change_nothing(tiny_model_dir, rollout, monkeypatch, algorithm):
    """Every model output on a tool's tokens (old, new and reference logprobs, entropy, values) replaced by absurd
    numbers: the update, the losses and the metrics are those of the clean run to the last bit, so no loss, KL,
    entropy, value loss or advantage reads them (a multiplication by a 0 mask would turn them into NaN)."""
    prompts, completions = rollout
    completions = with_tool_outputs(completions)
    flags = ("--algorithm", "grpo") if algorithm == "grpo" else ()

    def one_step():
        learner, reward_manager = build_learner(tiny_model_dir, *flags)
        metrics = one_ppo_step(learner, prompts, completions, reward_manager)
        models_trained = [learner.policy] + ([learner.value_model] if learner.value_model is not None else [])
        return metrics, [p.detach().clone() for m in models_trained for p in learner.backend.hf_model(m).parameters()]

    clean_metrics, clean_params = one_step()
    real_logprobs, real_values = models.response_logprobs, models.response_values

    def absurd_logprobs(model, query_response, attention_mask, context_length, *args, **kwargs):
        logprob, entropy = real_logprobs(model, query_response, attention_mask, context_length, *args, **kwargs)
        tool = torch.isin(query_response[:, context_length:], torch.tensor(TOOL_OUTPUT))
        # new (with gradients) 1e4, old -1e4: an exp(2e4) = inf ratio, times a 0 mask, would be NaN
        logprob = torch.where(tool, 1e4 if torch.is_grad_enabled() else -1e4, logprob)
        return logprob, (torch.where(tool, 1e4, entropy) if entropy is not None else None)

    def absurd_values(model, query_response, attention_mask, context_length):
        value = real_values(model, query_response, attention_mask, context_length)
        tool = torch.isin(query_response[:, context_length:], torch.tensor(TOOL_OUTPUT))
        return torch.where(tool, -1e6 if torch.is_grad_enabled() else 1e6, value)

    monkeypatch.setattr(models, "response_logprobs", absurd_logprobs)
    monkeypatch.setattr(models, "response_values", absurd_values)
    metrics, params = one_step()
    compared = [key for key in clean_metrics if not is_timing(key)]
    assert {"loss/policy_avg", "policy/entropy_avg", "objective/entropy", "val/sequence_lengths"} <= set(compared)
    assert {key: metrics[key] for key in compared} == {key: clean_metrics[key] for key in compared}
    assert all(torch.equal(got, want) for got, want in zip(params, clean_params))


def test_old_logprobs_auto_follows_the_dtype_the_learner_computes_in(tiny_model_dir, rollout, monkeypatch):
    """--old_logprobs_from auto on this CPU (fp32 engine): an fp32 learner takes the engine's logprobs and runs no
    policy forward; a bf16 learner runs its own and weights each token by its truncated ratio to the engine's."""
    prompts, completions = rollout
    completions = with_engine_logprobs(completions, fabricated_logprobs(completions))
    forwards = ForwardLog(monkeypatch)
    fp32, reward_manager = build_learner(tiny_model_dir, "--old_logprobs_from", "auto", "--learner_compute_dtype",
                                         "float32", "--vllm_dtype", "float32")  # fmt: skip
    _, metrics, _ = fp32.make_experience(prompts, completions, reward_manager)
    assert forwards.count(fp32.policy) == 0 and metrics["debug/old_logprobs_from_learner_frac"] == 0.0
    assert "policy/tis_capped_frac" not in metrics
    bf16, _ = build_learner(tiny_model_dir, "--old_logprobs_from", "auto", "--learner_compute_dtype", "bfloat16",
                            "--vllm_dtype", "float32")  # fmt: skip
    exp, metrics, _ = bf16.make_experience(prompts, completions, reward_manager)
    assert forwards.count(bf16.policy) > 0 and "debug/old_logprobs_from_learner_frac" not in metrics  # all its own
    assert metrics["debug/vllm_vs_learner_logprob_diff_mean"] > 0.1  # the fabricated engine logprobs differ
    assert bf16.tis_cap == 2.0 and "policy/tis_capped_frac" in metrics and exp.tis_weight is not None
