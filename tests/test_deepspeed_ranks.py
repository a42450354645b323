"""DeepSpeed learner ranks without Ray: two real rank processes started here, joined over gloo on 127.0.0.1, tiny model.

- ZeRO-3 loading: every rank holds only its share of each model (the value model's new head included), and the
  shares put together are exactly the whole load of the single process.
- What is saved under DeepSpeed's bf16 weights (--deepspeed_weights_dtype bfloat16, the GPU default; this CPU runs
  the same DeepSpeed code path in bf16): the folder holds the optimizer's fp32 master weights, not the bf16 copies
  the engines compute with; and the engines sum gradients in fp32.
- ZeRO-3 traces and prefetches the value model: its forward is one module's (models.TokenScores), so the parameter
  coordinator's trace completes after a step.

Several processes talk over TCP, so these tests run only inside the loopback-only network namespace that
scripts/test.sh makes (OPEN_INSTRUCT_LOOPBACK_ONLY=1); elsewhere they skip with that reason.
"""

import pytest
import torch

from tests.support.deepspeed_ranks import learner_on_rank, run_two_ranks
from tests.support.learner_steps import EQUIVALENCE_FLAGS, fixed_rollout, one_ppo_step
from tests.support.ray_runs import needs_loopback_namespace

pytestmark = [pytest.mark.e2e, needs_loopback_namespace]


# ---- ZeRO-3 loading -------------------------------------------------------------------------------------------------


def load_shares(rank: int, port: int, results, model_dir: str) -> None:
    import deepspeed

    learner, _ = learner_on_rank(rank, port, model_dir, 3, "--beta", "0.05")
    shares, gathered = {}, {}
    for role, model in (("policy", learner.policy), ("value", learner.value_model), ("reference", learner.ref_policy)):
        hf_model = learner.backend.hf_model(model)
        for name, param in hf_model.named_parameters():
            shares[f"{role}:{name}"] = (param.ds_tensor.numel(), param.ds_numel, param.numel())
            with deepspeed.zero.GatheredParameters([param]):
                gathered[f"{role}:{name}"] = param.detach().clone().float()
    results[rank] = (shares, gathered if rank == 0 else None)


def test_zero3_ranks_hold_their_shares_and_together_the_single_process_models(tiny_model_dir):
    from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
    from open_instruct.learner.ppo import PPOLearner
    from open_instruct.run.args import compute_batch_sizes, parse_args

    results = run_two_ranks(load_shares, tiny_model_dir)
    for rank in range(2):
        for name, (local, full, visible) in results[rank][0].items():
            assert local == -(-full // 2), f"rank {rank} holds {local} of {name}'s {full} elements, not half"
            assert visible == 0, f"{name} is also whole on rank {rank}"
    args = parse_args(["--model_name_or_path", tiny_model_dir, *EQUIVALENCE_FLAGS, "--beta", "0.05"])
    torch.manual_seed(args.run.seed)
    tokenizer = load_tokenizer(tiny_model_dir)
    single = PPOLearner(args, compute_batch_sizes(args), tokenizer, tiny_model_dir, stop_token_ids_for(tokenizer, "eos"))
    expected = {}
    for role, model in (("policy", single.policy), ("value", single.value_model), ("reference", single.ref_policy)):
        for name, param in single.backend.hf_model(model).named_parameters():
            expected[f"{role}:{name}"] = param.detach().float()
    gathered = results[0][1]
    assert gathered.keys() == expected.keys()
    for name, tensor in expected.items():  # the value model's new score head included: PPO's init, the run's seed
        assert torch.equal(gathered[name], tensor), f"{name} differs from the single process's load"


# ---- bf16 weights: the fp32 masters are saved, gradients sum in fp32 -------------------------------------------------


def bf16_step_and_save(rank: int, port: int, results, model_dir: str, stage: int, output_dir: str) -> None:
    from deepspeed.utils import safe_get_full_fp32_param

    from open_instruct.rewards.manager import RewardManager

    learner, tokenizer = learner_on_rank(rank, port, model_dir, stage, "--deepspeed_weights_dtype", "bfloat16")
    prompts, completions = fixed_rollout(tokenizer)
    one_ppo_step(learner, prompts, completions, RewardManager(learner.args.reward))
    data_types = {name: [str(t) for t in trainer.engine.get_data_types()]
                  for name, trainer in (("policy", learner.policy_trainer), ("value", learner.value_trainer))}  # fmt: skip
    masters, copies = {}, {}
    import deepspeed

    for name, param in learner.backend.hf_model(learner.policy).named_parameters():
        masters[name] = safe_get_full_fp32_param(param).detach().cpu().clone()  # a collective: every rank calls it
        with deepspeed.zero.GatheredParameters([param], enabled=stage == 3):
            copies[name] = param.detach().cpu().clone()
    saved = learner.save(output_dir)
    results[rank] = (data_types, masters if rank == 0 else None, copies if rank == 0 else None, saved)


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_ranks_save_their_fp32_masters_and_sum_gradients_in_fp32(stage, tiny_model_dir, tmp_path):
    from open_instruct.learner.saving import read_saved_weights, weights_sha256

    output_dir = str(tmp_path / "model")
    results = run_two_ranks(bf16_step_and_save, tiny_model_dir, stage, output_dir)
    for rank in range(2):
        assert results[rank][0] == {name: ["torch.bfloat16", "torch.float32"] for name in ("policy", "value")}
    _, masters, copies, saved = results[0]
    assert results[1][3] is None and saved.dtype == "float32"
    on_disk = read_saved_weights(output_dir)
    assert weights_sha256(on_disk) == saved.weights_sha256
    finer_than_bf16 = 0
    for name, copy in copies.items():
        if name not in on_disk:  # a tied head is stored once, under the embedding's name
            continue
        assert copy.dtype == torch.bfloat16 and on_disk[name].dtype == torch.float32
        assert torch.equal(on_disk[name], masters[name]), f"{name}: the saved weights are not the fp32 masters"
        assert torch.equal(on_disk[name].to(torch.bfloat16), copy), f"{name}: the masters do not round to the copies"
        finer_than_bf16 += int((on_disk[name] != copy.float()).sum())
    # The step moved the masters by amounts bf16 cannot hold: a save of the bf16 copies would have lost them.
    assert finer_than_bf16 > 1000, finer_than_bf16


# ---- ZeRO-3 traces the value model -----------------------------------------------------------------------------------


def trace_after_steps(rank: int, port: int, results, model_dir: str) -> None:
    from open_instruct.rewards.manager import RewardManager

    # Chunks of 7 positions: the policy's backward projects each chunk again (activation checkpointing) under ZeRO-3.
    learner, tokenizer = learner_on_rank(rank, port, model_dir, 3, "--beta", "0.05", "--num_epochs", "1",
                                         "--logprob_chunk_size", "7")  # fmt: skip
    prompts, completions = fixed_rollout(tokenizer)
    states = []
    for _ in range(2):
        one_ppo_step(learner, prompts, completions, RewardManager(learner.args.reward))
        states.append({
            "policy (training)": learner.policy_trainer.engine.optimizer.parameter_offload.get_param_coordinator(),
            "value (training)": learner.value_trainer.engine.optimizer.parameter_offload.get_param_coordinator(),
            "reference (inference)": learner.ref_policy.optimizer.get_param_coordinator(),
        })  # fmt: skip
        states[-1] = {name: coordinator.is_complete_trace() for name, coordinator in states[-1].items()}
    results[rank] = states


def test_zero3_traces_the_value_model_and_the_reference_so_it_can_prefetch(tiny_model_dir):
    results = run_two_ranks(trace_after_steps, tiny_model_dir)
    for rank in range(2):
        assert results[rank][-1] == {"policy (training)": True, "value (training)": True,
                                     "reference (inference)": True}, results[rank]  # fmt: skip


# ---- the finite check before a save: ZeRO-3's padding is not a weight ------------------------------------------------


def nan_in_padding_then_in_a_weight(rank: int, port: int, results, folder: str) -> None:
    """A ZeRO-3 engine of a 3 x 3 linear layer (9 weights and 3 biases: odd counts, so rank 1's partitions end in
    padding) over 2 ranks; NaN in the padding, then in a real weight."""
    from open_instruct.learner import deepspeed_backend
    from open_instruct.learner.single_process import OptimizerSettings
    from open_instruct.run.checkpoint import NonFiniteError

    deepspeed_backend.init_process_group(rank, 2, "127.0.0.1", port, 120)
    backend = deepspeed_backend.DeepSpeedBackend(3, 1, False)
    torch.manual_seed(0)
    settings = OptimizerSettings(1e-3, 0.0, "constant", 0, 1, 1.0, 1, 1)
    trainer = backend.trainable(torch.nn.Linear(3, 3), settings)
    layer = deepspeed_backend.unwrap(trainer.engine)
    padding = {}
    with torch.no_grad():
        for name, param in layer.named_parameters():
            real = deepspeed_backend.real_partition(param).numel()
            padding[name] = (param.ds_tensor.numel(), real)
            param.ds_tensor[real:] = float("nan")
    backend.save_engine_checkpoint(trainer, folder, "policy")  # every rank: a collective
    with torch.no_grad():
        layer.bias.ds_tensor[0] = float("nan")  # a real bias on each rank
    try:
        backend.check_finite(trainer.engine, "policy")
        refused = None
    except NonFiniteError as error:
        refused = str(error)
    results[rank] = (padding, refused)


def test_zero3_padding_is_not_checked_for_nan_before_a_save_but_every_real_weight_is(tmp_path):
    results = run_two_ranks(nan_in_padding_then_in_a_weight, str(tmp_path / "engine"))
    # ceil(9 / 2) = 5 and ceil(3 / 2) = 2 elements per rank; rank 1 holds 4 and 1 real ones, then padding.
    assert results[0][0] == {"weight": (5, 5), "bias": (2, 2)}
    assert results[1][0] == {"weight": (5, 4), "bias": (2, 1)}
    assert (tmp_path / "engine" / "engine").is_dir()  # NaN in the padding alone: the checkpoint was written
    for rank in range(2):
        assert results[rank][1] == f"the policy's weight bias holds NaN or inf on rank {rank}; refusing to save it"


# ---- LoRA on DeepSpeed ranks: the single-process step, the merged weights, the save and the checkpoint -----------------

# Rank 80 on every linear layer: most adapter matrices (80 x 128 and larger) are above ZeRO-3's persistence threshold
# (10000 elements, configs/ds_configs/zero3_train.json), so ZeRO-3 partitions them as it does an 8B model's, and the
# merge must gather them. A KL reference (the policy with its adapters disabled), a learning rate far above a real
# run's so that one step moves every adapted layer visibly.
LORA_STEP_FLAGS = ["--lora_rank", "80", "--lora_alpha", "160", "--learning_rate", "1e-3", "--beta", "0.05"]


def lora_step_save_and_resume(rank: int, port: int, results, model_dir: str, stage: int, workdir: str) -> None:
    import os

    from open_instruct.rewards.manager import RewardManager

    learner, tokenizer = learner_on_rank(rank, port, model_dir, stage, *LORA_STEP_FLAGS)
    rollout, reward = fixed_rollout(tokenizer), RewardManager(learner.args.reward)

    def engine_weights() -> dict:  # what learner rank 0 streams to the engines (weight_sender.WeightSender)
        return dict(learner.backend.iter_named_weights(learner.policy, torch.float32))

    # The module parameters DeepSpeed's ZeRO optimizer steps (its param_groups hold its own flat fp32 partitions).
    zero_groups = [getattr(trainer.engine.optimizer, "bit16_groups" if stage == 2 else "fp16_groups")
                   for trainer in learner.trainers]  # fmt: skip
    in_optimizer = {id(p) for groups in zero_groups for group in groups for p in group}
    trained = {id(p) for model in (learner.policy, learner.value_model)
               for p in learner.backend.hf_model(model).parameters() if p.requires_grad}  # fmt: skip
    metrics = one_ppo_step(learner, *rollout, reward)
    stepped = engine_weights()
    shapes = learner.backend.weight_shapes(learner.policy)
    saved = learner.save(os.path.join(workdir, "model"))
    checkpoint = os.path.join(workdir, "checkpoint")
    os.makedirs(checkpoint, exist_ok=True)
    written = learner.write_checkpoint(checkpoint)
    one_ppo_step(learner, *rollout, reward)
    second = engine_weights()
    learner.read_checkpoint(checkpoint)  # back to step 1: the adapters, their AdamW state, the shuffle order
    one_ppo_step(learner, *rollout, reward)
    second_again = engine_weights()
    repeated = rank != 0 or all(torch.equal(second[name], second_again[name]) for name in second)
    moved = rank != 0 or any(not torch.equal(second[name], stepped[name]) for name in second)
    results[rank] = (metrics, stepped if rank == 0 else None, shapes, saved, written, in_optimizer == trained,
                     repeated, moved)  # fmt: skip


@pytest.fixture(scope="module")
def single_process_lora_step(tiny_model_dir):
    """The reference: the single-process LoRA learner's first step on the fixed rollout, and its merged weights."""
    from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
    from open_instruct.learner.ppo import PPOLearner
    from open_instruct.rewards.manager import RewardManager
    from open_instruct.run.args import compute_batch_sizes, parse_args

    args = parse_args(["--model_name_or_path", tiny_model_dir, *EQUIVALENCE_FLAGS, *LORA_STEP_FLAGS])
    tokenizer = load_tokenizer(tiny_model_dir)
    torch.manual_seed(args.run.seed)
    single = PPOLearner(args, compute_batch_sizes(args), tokenizer, tiny_model_dir, stop_token_ids_for(tokenizer, "eos"))
    initial = dict(single.weights_for_engine())
    metrics = one_ppo_step(single, *fixed_rollout(tokenizer), RewardManager(args.reward))
    return initial, dict(single.weights_for_engine()), metrics


@pytest.mark.parametrize("stage", [2, 3])
def test_two_lora_ranks_take_the_single_process_lora_step_and_save_and_checkpoint_the_adapters(
    stage, single_process_lora_step, tiny_model_dir, tmp_path
):
    """2 DeepSpeed ranks with --lora_rank: the optimizer holds the adapters (and the value model's score head) alone;
    one PPO step gives the single-process metrics and merged weights (what rank 0 streams to the engines, computed
    layer by layer from the gathered base under ZeRO-3); the saved folder holds those merged weights in fp32 and the
    adapters in peft's format; the checkpoint holds the trained state alone, and reading it back repeats the next
    step bit for bit."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from open_instruct.learner import lora
    from open_instruct.run.flops import is_timing

    initial, expected, expected_metrics = single_process_lora_step
    results = run_two_ranks(lora_step_save_and_resume, tiny_model_dir, stage, str(tmp_path))
    metrics, weights, shapes, saved, written, optimizer_holds_trained, repeated, moved = results[0]
    assert optimizer_holds_trained and results[1][5], "DeepSpeed's optimizer holds more than the adapters and the head"
    assert results[1][3] is None and saved.dtype == "float32"
    differing = {key: (metrics[key], want) for key, want in expected_metrics.items()
                 if not is_timing(key) and metrics[key] != pytest.approx(want, abs=1e-4, rel=1e-4)}  # fmt: skip
    assert metrics.keys() == expected_metrics.keys() and not differing, f"ZeRO-{stage} vs single process: {differing}"
    assert expected_metrics["objective/kl"] == 0.0  # the reference (adapters disabled) is the step-0 policy
    # The engine gets the base model's names and shapes, the merged weights equal the single process's.
    assert [name for name, _ in shapes] == list(expected) == list(weights)
    assert all(shape == tuple(expected[name].shape) for name, shape in shapes)
    for name, want in expected.items():
        merged = name.rsplit(".", 2)[-2] in {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        moved_by = (want - initial[name]).abs().max().item()
        assert (moved_by > 1e-4) if merged else moved_by == 0, f"{name} moved by {moved_by}"
        torch.testing.assert_close(weights[name], want, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")

    model_dir = tmp_path / "model"
    on_disk = load_file(str(model_dir / "model.safetensors"))
    assert all(torch.equal(on_disk[name], weights[name]) for name in on_disk) and set(on_disk) <= set(weights)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, str(model_dir / lora.ADAPTER_FOLDER)).merge_and_unload()
    for name, param in with_adapter.named_parameters():  # peft's merge, in place in fp32: rounding apart
        torch.testing.assert_close(param.detach(), on_disk.get(name, weights[name]), atol=1e-6, rtol=0)

    checkpoint = tmp_path / "checkpoint"
    files = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    full = 12 * sum(t.numel() for t in initial.values())  # a full fine-tuning checkpoint: weights and 2 moments, fp32
    assert files < full / 5, (files, full)  # the adapters' 0.66M parameters; the frozen base alone is 26 MB
    module_states = list((checkpoint / "policy" / "engine").glob("*model_states.pt"))  # ZeRO-3: one per rank
    assert module_states and all("lora_" in name for path in module_states
                                 for name in torch.load(path, weights_only=False)["module"]), "the base was saved"
    assert repeated and moved, "the step after reading the checkpoint back differs from the step after writing it"
    print(f"\nZeRO-{stage} LoRA r80 checkpoint {files / 1e6:.2f} MB (2 ranks); full fine-tuning ~{full / 1e6:.0f} MB")
