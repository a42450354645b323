"""LoRA (docs/lora.md): the adapters train, the base never moves, the reference is the base, and what the engine and
the user get are the exact merged weights `W + (alpha / r) B A`.

The fast tier builds a small Llama in memory (no files) for the math and the learner's tiny model for what the
learner trains, checkpoints and saves; the e2e tier runs the trainer with --lora_rank on the tiny model and opens
what it left as a user would (transformers without peft, peft on the base, a fresh vLLM engine).
"""

import copy
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
from open_instruct.generation import vllm_engine
from open_instruct.generation.engine_batches import EngineBatches
from open_instruct.learner import lora, models
from open_instruct.learner.algorithms import learner_class
from open_instruct.learner.ppo import PPOLearner
from open_instruct.rewards.manager import RewardManager
from open_instruct.run.args import compute_batch_sizes, parse_args
from open_instruct.run.memory_budget import plan_memory
from open_instruct.run.model_shapes import run_model_shapes
from open_instruct.run.tracking import read_metrics
from tests.support.forked_runs import start_run
from tests.support.learner_steps import EQUIVALENCE_FLAGS, fixed_rollout, one_ppo_step
from tests.support.resume_runs import (
    assert_same_model,
    assert_same_run,
    log_of,
    sampled_tokens,
    wait_for_step,
)
from tests.support.trainer_runs import (
    FP32_LEARNER,
    SMALL_RUN,
    SYNC_MAX_LOGPROB_DIFF,
    TRAINER,
    Run,
    fresh_engine_greedy,
    last_lines,
    run_to_completion,
)

SETTINGS = lora.LoraSettings(rank=4, alpha=16.0)
ADAPTED = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def small_llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float().eval()


TOKENS = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(1))
MASK = torch.ones_like(TOKENS, dtype=torch.bool)


def logprobs(model) -> torch.Tensor:
    """The logprob of each of the last 6 tokens of TOKENS under `model` (a models.TokenLogprobs, or its reference)."""
    with torch.no_grad():
        return models.response_logprobs(model, TOKENS, MASK, 6, temperature=1.0)[0]


def adapted_pair():
    """(the base model, the same weights with adapters: a models.TokenLogprobs, and its peft wrapper)."""
    base = small_llama()
    policy = copy.deepcopy(base)
    peft_model = lora.add_adapters(policy, SETTINGS, seed=3)
    return models.TokenLogprobs(base), models.TokenLogprobs(policy), peft_model


def train_adapters(policy, steps: int) -> None:
    """`steps` AdamW steps on the adapters at a large learning rate: B leaves 0, every adapted layer changes."""
    optimizer = torch.optim.AdamW(lora.trained_parameters(policy).values(), lr=1e-2)
    for _ in range(steps):
        loss = -models.response_logprobs(policy, TOKENS, MASK, 6, temperature=1.0)[0].mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def base_weights(hf_model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in hf_model.named_parameters() if not p.requires_grad}


# ---- the reference is the base ------------------------------------------------------------------------------------


def test_at_step_0_policy_reference_and_base_give_identical_logprobs():
    base, policy, _ = adapted_pair()
    assert set(lora.trained_parameters(policy)) and all("lora_" in name for name in lora.trained_parameters(policy))
    reference = lora.AdaptersDisabled(policy)
    assert torch.equal(logprobs(policy), logprobs(base))  # B = 0: the adapters add exactly nothing
    assert torch.equal(logprobs(reference), logprobs(base))


def test_after_training_disabled_adapters_give_the_base_bit_for_bit():
    base, policy, _ = adapted_pair()
    train_adapters(policy, steps=3)
    assert not torch.allclose(logprobs(policy), logprobs(base), atol=1e-3), "the adapters did not train"
    assert torch.equal(logprobs(lora.AdaptersDisabled(policy)), logprobs(base))
    assert torch.equal(logprobs(lora.AdaptersDisabled(policy)), logprobs(base))  # and again: the context restored them
    assert not torch.allclose(logprobs(policy), logprobs(base), atol=1e-3), "the adapters stayed disabled"


# ---- the weights for the engine ------------------------------------------------------------------------------------


def test_merged_tensor_is_w_plus_s_b_a_under_the_base_names_and_computes_as_the_adapted_model():
    base, policy, _ = adapted_pair()
    train_adapters(policy, steps=3)
    merged = {name: (tensor, is_merged) for name, tensor, is_merged in lora.merged_named_weights(policy.hf_model,
                                                                                                   torch.float32)}  # fmt: skip
    assert list(merged) == [name for name, _ in base.hf_model.named_parameters()]  # the engine's HF names, in order
    assert {name.split(".")[-2] for name, (_, is_merged) in merged.items() if is_merged} == ADAPTED
    for name, (tensor, is_merged) in merged.items():
        if not is_merged:  # handed over as the frozen tensor itself: nothing copied, nothing changed
            assert tensor.data_ptr() == dict(policy.hf_model.named_parameters())[name].data_ptr()
            continue
        layer = policy.hf_model.get_submodule(name.removesuffix(".weight"))
        w = layer.base_layer.weight.double()
        a, b = layer.lora_A[lora.ADAPTER].weight.double(), layer.lora_B[lora.ADAPTER].weight.double()
        assert b.abs().max() > 0
        expected = w + SETTINGS.scaling * (b @ a)
        torch.testing.assert_close(tensor.double(), expected, rtol=0, atol=1e-6)
        assert not torch.equal(tensor, layer.base_layer.weight)
    # A plain model with the merged weights computes what the adapted model computes.
    plain = small_llama()
    plain.load_state_dict({name: tensor for name, (tensor, _) in merged.items()}, strict=False)
    torch.testing.assert_close(logprobs(models.TokenLogprobs(plain)), logprobs(policy), rtol=0, atol=1e-5)


def test_base_weights_unchanged_after_100_syncs():
    _, policy, _ = adapted_pair()
    initial = base_weights(policy.hf_model)
    generator = torch.Generator().manual_seed(5)
    for _ in range(100):
        with torch.no_grad():  # a training step's worth of change in every adapter
            for param in lora.trained_parameters(policy).values():
                param.add_(0.01 * torch.randn(param.shape, generator=generator))
        for _ in lora.merged_weights(policy.hf_model, torch.bfloat16):  # as a bf16 engine gets them
            pass
    after = base_weights(policy.hf_model)
    assert after.keys() == initial.keys() and all(torch.equal(after[name], initial[name]) for name in initial)


# ---- what the learner trains, checkpoints and saves ----------------------------------------------------------------

# One epoch of the fixed rollout's two minibatches: two updates, enough to move every adapter, at a learning rate far
# above a real run's so that they move visibly.
LORA_FLAGS = ["--lora_rank", "4", "--lora_alpha", "8", "--learning_rate", "1e-2", "--num_epochs", "1"]


def build_learner(tiny_model_dir: str, *flags: str) -> PPOLearner:
    args = parse_args(["--model_name_or_path", tiny_model_dir, *EQUIVALENCE_FLAGS, *LORA_FLAGS, *flags])
    tokenizer = load_tokenizer(tiny_model_dir)
    torch.manual_seed(args.run.seed)
    return PPOLearner(args, compute_batch_sizes(args), tokenizer, tiny_model_dir, stop_token_ids_for(tokenizer, "eos"))


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    return fixed_rollout(load_tokenizer(tiny_model_dir))


@pytest.fixture(scope="module")
def stepped_learner(tiny_model_dir, rollout, tmp_path_factory):
    """A LoRA learner after one PPO step, its checkpoint written, and its base weights from before the step."""
    learner = build_learner(tiny_model_dir)
    initial = {"policy": base_weights(learner.policy.hf_model), "value": base_weights(learner.value_model.hf_model)}
    metrics = one_ppo_step(learner, *rollout, RewardManager(learner.args.reward))
    folder = tmp_path_factory.mktemp("lora_checkpoint")
    written = learner.write_checkpoint(str(folder))
    return learner, initial, metrics, folder, written


def test_learner_trains_only_adapters_and_the_score_head_and_checkpoints_only_them(stepped_learner):
    learner, initial, metrics, folder, written = stepped_learner
    assert isinstance(learner.ref_policy, lora.AdaptersDisabled)  # no reference model loaded
    policy, value = learner.policy.hf_model, learner.value_model.hf_model
    for trainer, model in ((learner.policy_trainer, policy), (learner.value_trainer, value)):
        in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
        assert in_optimizer == {id(p) for p in lora.trained_parameters(model).values()}
        assert set(trainer.optimizer.state) <= {p for p in lora.trained_parameters(model).values()}
    assert {name.rsplit(".", 1)[0] for name in lora.trained_parameters(value) if "lora_" not in name} == {"score"}
    assert metrics["objective/kl"] == 0.0  # before the first update the policy is its base

    state = torch.load(folder / "learner.pt", weights_only=False)
    assert set(state["policy"]) == set(lora.trained_parameters(policy))
    assert set(state["value_model"]) == set(lora.trained_parameters(value))
    assert len(state["optimizers"][0]["state"]) == len(state["policy"])  # AdamW moments of the adapters alone
    full = 12 * sum(p.numel() for model in (policy, value) for p in model.parameters())  # fp32 weights + 2 moments
    assert written == os.path.getsize(folder / "learner.pt") < full / 10, (written, full)
    print(f"\nLoRA r4 checkpoint {written / 1e6:.2f} MB vs full fine-tuning's ~{full / 1e6:.1f} MB")
    # the base did not move; the adapters did
    assert all(torch.equal(p, initial["policy"][n]) for n, p in base_weights(policy).items())
    assert all(torch.equal(p, initial["value"][n]) for n, p in base_weights(value).items())
    assert any(p.abs().max() > 0 for n, p in lora.trained_parameters(policy).items() if "lora_B" in n)


def without_timings(metrics: dict) -> dict:
    return {key: value for key, value in metrics.items() if not key.startswith(("time/", "perf/"))}


def test_learner_resumed_from_its_checkpoint_takes_the_same_next_step(stepped_learner, tiny_model_dir, rollout):
    learner, _, _, folder, _ = stepped_learner
    resumed = build_learner(tiny_model_dir)
    resumed.read_checkpoint(str(folder))
    reward = RewardManager(learner.args.reward)
    got = one_ppo_step(resumed, *rollout, reward)
    assert without_timings(got) == without_timings(one_ppo_step(learner, *rollout, reward))
    for (name, want), (_, have) in zip(lora.merged_weights(learner.policy.hf_model, torch.float32),
                                       lora.merged_weights(resumed.policy.hf_model, torch.float32)):  # fmt: skip
        assert torch.equal(have, want), name


def test_a_run_with_other_lora_flags_refuses_the_checkpoint(stepped_learner, tiny_model_dir):
    _, _, _, folder, _ = stepped_learner
    other = build_learner(tiny_model_dir, "--lora_rank", "2")
    with pytest.raises(ValueError, match="resume with the LoRA flags of the run that wrote it"):
        other.read_checkpoint(str(folder))


def test_grpo_learner_with_lora_trains_the_policy_adapters_against_its_base(tiny_model_dir, rollout):
    value_lr = EQUIVALENCE_FLAGS.index("--value_learning_rate")
    flags = EQUIVALENCE_FLAGS[:value_lr] + EQUIVALENCE_FLAGS[value_lr + 2 :]
    args = parse_args(["--model_name_or_path", tiny_model_dir, *flags, *LORA_FLAGS], algorithm="grpo")
    tokenizer = load_tokenizer(tiny_model_dir)
    learner = learner_class("grpo")(args, compute_batch_sizes(args), tokenizer, tiny_model_dir,
                                    stop_token_ids_for(tokenizer, "eos"))  # fmt: skip
    assert learner.value_model is None and isinstance(learner.ref_policy, lora.AdaptersDisabled)
    policy = learner.policy.hf_model
    initial = base_weights(policy)
    in_optimizer = {id(p) for group in learner.policy_trainer.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in lora.trained_parameters(policy).values()}
    metrics = one_ppo_step(learner, *rollout, RewardManager(args.reward))
    assert metrics["objective/kl"] == 0.0 and metrics["loss/policy_avg"] != 0.0
    assert all(torch.equal(p, initial[n]) for n, p in base_weights(policy).items())
    assert set(learner.state_dict()["policy"]) == set(lora.trained_parameters(policy))


def test_saved_model_is_plain_hf_with_the_merged_weights_and_the_adapter_loads_with_peft(
    tiny_model_dir, rollout, tmp_path
):
    from peft import PeftModel

    learner = build_learner(tiny_model_dir, "--beta", "0")
    one_ppo_step(learner, *rollout, RewardManager(learner.args.reward))
    saved = learner.save(str(tmp_path / "model"))
    expected = logprobs_of(learner.policy)

    plain, info = AutoModelForCausalLM.from_pretrained(tmp_path / "model", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not any("lora" in n for n in info)
    assert {t.dtype for t in load_file(str(tmp_path / "model" / "model.safetensors")).values()} == {torch.float32}
    assert saved.dtype == "float32"
    torch.testing.assert_close(logprobs_of(models.TokenLogprobs(plain)), expected, rtol=0, atol=1e-5)

    adapter_dir = tmp_path / "model" / lora.ADAPTER_FOLDER
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == 4
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, str(adapter_dir))
    torch.testing.assert_close(logprobs_of(models.TokenLogprobs(with_adapter.base_model.model)), expected,
                               rtol=0, atol=1e-6)  # fmt: skip
    print(f"\nadapter {os.path.getsize(adapter_dir / 'adapter_model.safetensors') / 1e6:.2f} MB, merged model "
          f"{os.path.getsize(tmp_path / 'model' / 'model.safetensors') / 1e6:.1f} MB")


def logprobs_of(model) -> torch.Tensor:
    """Logprobs of a fixed token sequence under a models.TokenLogprobs of the tiny model (its vocabulary)."""
    tokens = torch.randint(0, 49152, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return models.response_logprobs(model, tokens, torch.ones_like(tokens, dtype=torch.bool), 5, 1.0)[0]


def test_memory_plan_with_lora_holds_no_reference_and_only_the_adapters_gradients_and_moments(tiny_model_dir):
    def plan(*flags):
        args = parse_args(["--model_name_or_path", tiny_model_dir, "--beta", "0.05", *flags])
        shapes = run_model_shapes(args)
        return shapes, {item.name: item for item in plan_memory(args, shapes, "gpu", 80e9).items}

    full_shapes, full = plan()
    lora_shapes, adapted = plan("--lora_rank", "8")
    assert [s.role for s in full_shapes] == ["policy", "reference policy", "value model"]
    assert [s.role for s in lora_shapes] == ["policy", "value model"]
    policy = lora_shapes[0]
    # rank 8 on q,k,v,o (128 -> 128, 64, 64, 128) and gate, up, down (128 <-> 256), 2 layers
    assert policy.trained_params == 2 * 8 * ((128 + 128) * 2 + (128 + 64) * 2 + (128 + 256) * 3)
    assert lora_shapes[1].trained_params == policy.trained_params + 128  # and the score head
    assert adapted["policy AdamW moments (fp32)"].steady == 8 * policy.trained_params
    assert full["policy AdamW moments (fp32)"].steady == 8 * full_shapes[0].num_params
    assert not [name for name in adapted if name.startswith("reference policy")]
    _, served = plan("--lora_rank", "8", "--lora_weight_sync", "adapter")  # the engine gets the adapters alone
    assert served["policy copies for the engine (2 in flight, bf16)"].steady == 2 * 2 * policy.trained_params
    assert adapted["policy copies for the engine (2 in flight, bf16)"].steady == 2 * 2 * policy.num_params


# ---- the trainer ---------------------------------------------------------------------------------------------------

# Sync mode: the engine samples with the very weights the learner then scores, so the run's own guard
# (--max_vllm_logprob_diff) checks the merged weights at every step. A learning rate far above a real run's, so that two
# steps change the tiny model's greedy output and the fresh-engine comparison would catch stale or wrong weights.
RUN = [*SMALL_RUN, "--total_episodes", "16", "--async_mode", "false", "--lora_rank", "8", "--learning_rate", "2e-2",
       "--lr_scheduler_type", "constant", "--save_freq", "1", "--beta", "0.05",
       "--max_vllm_logprob_diff", str(SYNC_MAX_LOGPROB_DIFF), *FP32_LEARNER]  # fmt: skip


def lora_command(tiny_model_dir: str, eval_file: Path, output_dir: Path, *extra: str) -> list[str]:
    return TRAINER + ["--model_name_or_path", tiny_model_dir, "--dataset_mixer_eval_list", str(eval_file), "1.0",
                      "--output_dir", str(output_dir), *RUN, *extra]  # fmt: skip


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, eval_file, tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("lora_run")
    run_to_completion(lora_command(tiny_model_dir, eval_file, workdir / "output"), cwd=workdir)
    return workdir / "output"


@pytest.mark.e2e
def test_lora_run_engine_agrees_with_learner_and_a_fresh_engine_on_the_saved_model_equals_it(
    lora_run, tiny_model_dir, eval_file, tmp_path
):
    """The run's engine agrees with its learner at every step; a fresh engine on the saved merged `model/` gives the
    run's last greedy eval answers, and so does a fresh engine on the base serving the saved `model/adapter` with
    vLLM's own LoRA (`LoRARequest`, as a user serving the adapter does; fp32 engines on CPUs)."""
    rows = read_metrics(str(lora_run / "metrics.jsonl"))
    steps = [row for row in rows if "debug/vllm_vs_learner_logprob_diff_max" in row]
    assert [row["step"] for row in steps] == [1, 2]
    # The engine sampled with the merged weights the learner sent: its logprobs are the learner's (the run's own guard
    # stops a run far above this).
    assert all(row["debug/vllm_vs_learner_logprob_diff_max"] < SYNC_MAX_LOGPROB_DIFF for row in steps), steps
    summary = json.loads((lora_run / "summary.json").read_text())
    assert summary["status"] == "completed"
    model_dir = lora_run / "model"
    assert (model_dir / lora.ADAPTER_FOLDER / "adapter_model.safetensors").is_file()
    state = torch.load(lora_run / "checkpoints" / "step_2" / "learner.pt", weights_only=False)
    assert all("lora_" in name for name in state["policy"])

    run = Run(lora_run, num_steps=2, async_mode=False)
    final, initial_rows = run.eval_rows(policy_version=2), run.eval_rows(policy_version=0)
    assert final and any(a["token_ids"] != b["token_ids"] for a, b in zip(final, initial_rows)), "nothing changed"
    _, fresh = fresh_engine_greedy(model_dir, eval_file, final, tmp_path)
    assert fresh == [row["token_ids"] for row in final]
    _, served = fresh_engine_greedy(Path(tiny_model_dir), eval_file, final, tmp_path, model_dir / lora.ADAPTER_FOLDER)
    assert served == fresh
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    trained = load_file(str(model_dir / "model.safetensors"))
    assert [name for name in trained if not torch.equal(trained[name], initial[name])], "nothing was trained"


@pytest.mark.e2e
def test_lora_run_killed_9_after_its_first_checkpoint_and_resumed_equals_the_uninterrupted_run(
    lora_run, tiny_model_dir, eval_file, tmp_path
):
    """The run of `lora_run` again, killed with SIGKILL as soon as its step-1 checkpoint (the adapters, their AdamW
    state; not the base) is complete, then `--resume`d: every logged step and the final model equal the uninterrupted
    run's."""
    output_dir = tmp_path / "output"
    command = lora_command(tiny_model_dir, eval_file, output_dir)
    process = start_run(command, tmp_path, tmp_path / "killed.log")
    process.log_path = tmp_path / "killed.log"
    checkpoint = output_dir / "checkpoints" / "step_1"
    wait_for_step(process, output_dir, 1)
    while not checkpoint.is_dir() and process.poll() is None:
        time.sleep(0.05)
    process.kill()
    assert process.wait() == -signal.SIGKILL, f"the run ended before the kill:\n{last_lines(log_of(process))}"
    assert all("lora_" in name for name in torch.load(checkpoint / "learner.pt", weights_only=False)["policy"])
    run_to_completion(command + ["--resume"], cwd=tmp_path)
    assert_same_run(output_dir, lora_run)


@pytest.mark.e2e
def test_lora_run_with_the_engine_serving_the_adapters_equals_the_merged_run_and_sends_only_them(
    lora_run, tiny_model_dir, eval_file, tmp_path
):
    """`--lora_weight_sync adapter`: each sync sends the adapters alone and vLLM's LoRA layers compute `W x + s B A x`.
    The run of `lora_run` again that way: its engine's logprobs are the learner's at every step (the policy has moved
    off the base by step 2: an engine that ignored the adapters would be off by the KL's order), it samples the same
    tokens, ends with the same saved model, and each sync sent the adapters' bytes (a fraction of the merged weights')."""
    output_dir = tmp_path / "output"
    run_to_completion(lora_command(tiny_model_dir, eval_file, output_dir, "--lora_weight_sync", "adapter"), cwd=tmp_path)
    rows = {row["step"]: row for row in read_metrics(str(output_dir / "metrics.jsonl")) if "objective/kl" in row}
    merged = {row["step"]: row for row in read_metrics(str(lora_run / "metrics.jsonl")) if "objective/kl" in row}
    assert rows[2]["objective/kl"] > 0.01, "the policy did not move: the test shows nothing"
    assert all(row["debug/vllm_vs_learner_logprob_diff_max"] < SYNC_MAX_LOGPROB_DIFF for row in rows.values()), rows
    adapter_bytes = sum(tensor.numel() * 4 for tensor in load_file(
        str(output_dir / "model" / lora.ADAPTER_FOLDER / "adapter_model.safetensors")).values())  # fmt: skip
    assert rows[2]["weight_sync/megabytes"] == pytest.approx(adapter_bytes / 2**20)
    assert rows[2]["weight_sync/megabytes"] < merged[2]["weight_sync/megabytes"] / 10
    assert sampled_tokens(output_dir) == sampled_tokens(lora_run)
    assert_same_model(output_dir / "model", lora_run / "model")


@pytest.mark.e2e
def test_an_engine_serving_adapters_samples_each_token_from_the_version_it_holds(tiny_model_dir):
    """Three adapter versions into one engine (`--lora_weight_sync adapter`), the second loaded in flight (mid-batch:
    the samples go back into the engine with it, as at an in-flight update): the engine's logprob of every token is
    the learner's under the version that generated it (1e-4). vLLM keeps a loaded adapter by its id; an engine that
    went on serving an older version would be off by what two versions differ by (asserted large)."""
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    lora.add_adapters(hf_model, lora.LoraSettings(rank=8, alpha=16.0), seed=0)
    llm = vllm_engine.create_engine(vllm_engine.EngineConfig(
        tiny_model_dir, max_model_len=128, seed=0, dtype="float32", lora_rank=8, lora_alpha=16.0))  # fmt: skip
    batches = EngineBatches(llm)
    params = dict(n=2, temperature=1.0, max_tokens=12, stop_token_ids=[], stop_strings=None, with_logprobs=True)
    prompts = [list(range(100, 120)), list(range(500, 510))]
    generator, versions = torch.Generator().manual_seed(0), {}

    def load(version: int) -> None:
        with torch.no_grad():
            for layer in lora.lora_layers(hf_model):
                weight = layer.lora_B[lora.ADAPTER].weight
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.05)
        versions[version] = {name: p.detach().clone() for name, p in hf_model.named_parameters() if "lora_B" in name}
        with batches.new_weights(version):
            vllm_engine.load_weights(llm, lora.adapter_weights(hf_model, torch.float32))

    load(1)
    batches.admit(0, prompts, params, sampling_seed=0)
    for _ in range(4):
        batches.step()
    load(2)
    completions = batches.run_until_complete(0)
    load(3)
    batches.admit(1, prompts, params, sampling_seed=1)
    completions += batches.run_until_complete(1)
    assert {version for completion in completions for version in completion.versions} == {1, 2, 3}

    params_by_name = dict(hf_model.named_parameters())
    for version, state in versions.items():
        with torch.no_grad():
            for name, tensor in state.items():
                params_by_name[name].copy_(tensor)
        for completion in completions:
            prompt = prompts[completion.prompt_index]
            ids = torch.tensor([prompt + completion.token_ids])
            with torch.no_grad():
                logits = hf_model(ids).logits[0, len(prompt) - 1 : -1].float()
            learner = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
            gap = (torch.tensor(completion.logprobs) - learner).abs()
            own = torch.tensor([v == version for v in completion.versions])
            if own.any():
                assert gap[own].max() < 1e-4, f"version {version}"
            if (~own).any():  # the tokens another version generated: far from this version's logprobs
                assert gap[~own].max() > 1e-2, f"version {version}"
