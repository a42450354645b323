"""The memory plan (run/memory_items.py, run/engine_memory.py, run/memory_budget.py; python -m
open_instruct.memory_plan): fast, no model weights loaded except the tiny model's once.

- Parameter counts from configs alone equal a real loaded model's (tiny policy and its value model).
- Hand-checked terms of a 1M-parameter model at 2 ranks: weights, fp32 masters, gradients, AdamW at ZeRO-2, ZeRO-3
  (fp32 and bf16 weights) and in one process.
- The activation coefficients equal what autograd really saves per layer (saved_tensors_hooks on a small Llama), in
  fp32, bf16 autocast over fp32 weights, bf16 weights, with and without gradient checkpointing.
- A run that cannot fit is refused before any model loads, in one line naming the biggest item and its flag.
- The CLI plans the Tulu 3 8B recipe offline from the configs shipped in configs/model_configs (HF_HUB_OFFLINE=1).

The plan against measured peak memory of real learner ranks is scripts/benchmark/memory_plan_vs_measured.py (minutes,
not CI); its table is in docs/memory.md.
"""

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from open_instruct.run import devices
from open_instruct.run.args import ConfigError, parse_args
from open_instruct.run.memory_budget import plan_memory
from open_instruct.run.memory_items import layer_bytes_per_token
from open_instruct.run.model_shapes import ModelShape, model_shape, run_model_shapes
from tests.support.trainer_runs import run_command

REPO = Path(__file__).resolve().parents[1]
RECIPE_8B = REPO / "configs" / "train_configs" / "ppo_tulu3_8b.yaml"


def test_parameter_counts_from_the_config_equal_the_loaded_tiny_models(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    value = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    planned_policy = model_shape("policy", tiny_model_dir, trainable=True, scalar_head=False)
    planned_value = model_shape("value model", tiny_model_dir, trainable=True, scalar_head=True)
    assert planned_policy.num_params == sum(p.numel() for p in policy.parameters())  # tied head counted once
    assert planned_value.num_params == sum(p.numel() for p in value.parameters())  # the new score head included
    assert planned_value.num_params == planned_policy.num_params + 128  # hidden 128 -> 1 score, no LM head (tied)
    assert planned_policy.largest_param == 49152 * 128  # the embedding


# ---- hand-checked terms ---------------------------------------------------------------------------------------------

MILLION = 1_000_000


def one_million_parameter_shape(role: str, trainable: bool, causal_lm: bool = True) -> ModelShape:
    return ModelShape(role, trainable, num_params=MILLION, largest_module_params=100_000, largest_param=100_000,
                      vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=32, causal_lm=causal_lm, source="by hand")  # fmt: skip


def items_of(*flags: str, device: str = "cpu") -> dict[str, tuple[float, float]]:
    args = parse_args(["--model_name_or_path", "tiny", "--beta", "0.05", *flags])
    shapes = [one_million_parameter_shape("policy", True), one_million_parameter_shape("reference policy", False),
              one_million_parameter_shape("value model", True, causal_lm=False)]  # fmt: skip
    plan = plan_memory(args, shapes, device)
    return {item.name: (item.at_load, item.steady) for item in plan.items}


TWO_RANKS = ["--num_learners_per_node", "2"]


def test_the_plans_meta_model_waits_for_a_model_being_built_in_another_thread(tiny_model_dir):
    """transformers' from_config sets torch's (process-wide) default dtype to the config's (the tiny model's says
    bfloat16) while it builds: built beside the generation thread's vLLM engine, it gave a float32 engine bfloat16
    layers (a resumed Ray run failed at its first generate). It waits for `devices.MODEL_CONSTRUCTION`, which the
    engine's build and the learner's loads hold, and leaves the default dtype as it found it."""
    import threading

    shapes = []
    builder = threading.Thread(target=lambda: shapes.append(model_shape("policy", tiny_model_dir, True, False)))
    with devices.MODEL_CONSTRUCTION:  # another thread building a model
        builder.start()
        builder.join(timeout=1.0)
        assert builder.is_alive() and not shapes, "the meta model was built while another model was being built"
        assert torch.get_default_dtype() == torch.float32
    builder.join(timeout=60)
    assert shapes and shapes[0].num_params > 0 and torch.get_default_dtype() == torch.float32


def test_zero2_at_two_ranks_keeps_whole_weights_and_halves_the_optimizer():
    items = items_of(*TWO_RANKS, "--deepspeed_stage", "2")
    assert items["policy weights (fp32)"] == (4 * MILLION, 4 * MILLION)  # whole, fp32 on a CPU
    assert items["policy fp32 master weights, 1/2"] == (2 * MILLION, 2 * MILLION)  # a copy even of fp32 weights
    assert items["policy gradients (fp32, 1/2)"] == (0, 2 * MILLION)  # from the first backward
    assert items["policy AdamW moments (fp32, 1/2)"] == (0, 4 * MILLION)  # from the first step
    assert items["reference policy weights (fp32)"] == (4 * MILLION, 4 * MILLION)  # frozen: whole
    assert items["optimizer step temporaries (policy)"] == (0, 4 * MILLION)  # sqrt(v) and sqrt(v)/c on 1/2


def test_zero3_at_two_ranks_partitions_everything():
    items = items_of(*TWO_RANKS, "--deepspeed_stage", "3")
    assert items["policy weights (fp32, 1/2)"] == (2 * MILLION, 2 * MILLION)
    assert items["policy fp32 master weights, 1/2"] == (2 * MILLION, 2 * MILLION)  # a copy even of fp32 weights
    assert items["policy gradients (fp32, 1/2)"] == (2 * MILLION, 2 * MILLION)  # allocated with the engine
    assert items["policy AdamW moments (fp32, 1/2)"] == (0, 4 * MILLION)
    assert items["reference policy weights (fp32, 1/2)"] == (2 * MILLION, 2 * MILLION)
    assert items["optimizer step temporaries (policy)"] == (0, 6 * MILLION)  # + the gradient's fp32 copy
    # While the policy runs, ZeRO-3 gathers it: the whole model here (below the reuse distance), in fp32.
    assert items["ZeRO-3 gathered parameters (policy)"] == (0, 4 * MILLION)


def test_zero3_bf16_weights_keep_fp32_masters_and_gradients():
    items = items_of(*TWO_RANKS, "--deepspeed_stage", "3", "--deepspeed_weights_dtype", "bfloat16", device="gpu")
    assert items["policy weights (bf16, 1/2)"] == (MILLION, MILLION)
    assert items["policy fp32 master weights, 1/2"] == (2 * MILLION, 2 * MILLION)
    assert items["policy gradients (fp32, 1/2)"] == (2 * MILLION, 2 * MILLION)
    assert items["reference policy weights (bf16, 1/2)"] == (MILLION, MILLION)  # inference dtype on GPUs


def test_zero0_at_two_ranks_divides_nothing():
    items = items_of(*TWO_RANKS, "--deepspeed_stage", "0")
    assert items["policy weights (fp32)"] == (4 * MILLION, 4 * MILLION)  # every rank holds the whole model
    assert items["policy gradients (fp32)"] == (0, 4 * MILLION)
    assert items["policy AdamW moments (fp32)"] == (0, 8 * MILLION)
    assert items["reference policy weights (fp32)"] == (4 * MILLION, 4 * MILLION)
    assert not any("master" in name or "1/2" in name for name in items)


def test_zero2_fills_one_reduce_bucket_at_a_time():
    # Policy and value model train one after the other: one model's bucket is in the forward + backward phase.
    args = parse_args(["--model_name_or_path", "tiny", *TWO_RANKS, "--deepspeed_stage", "2"])
    shapes = [one_million_parameter_shape("policy", True), one_million_parameter_shape("value model", True, False)]
    plan = plan_memory(args, shapes, "cpu")
    buckets = [item for item in plan.items if "reduce bucket" in item.name]
    assert [(item.when, item.steady) for item in buckets] == [("fwd/bwd", 4 * MILLION + 4 * 100_000)]  # + a param


def test_zero2_gradients_are_held_only_while_micro_batches_accumulate():
    # 8 responses a step over 2 ranks: micro-batches of 2 accumulate (2 per rank), of 4 do not (1 per rank): then
    # each model frees its gradients at its step, before the other model's backward (measured: docs/memory.md).
    batch = ["--local_rollout_batch_size", "4", "--number_samples_per_prompt", "2", "--num_mini_batches", "1"]
    accumulating = plan_memory(parse_args(["--model_name_or_path", "tiny", *TWO_RANKS, "--deepspeed_stage", "2", *batch,
                                           "--per_device_train_batch_size", "2"]),
                               [one_million_parameter_shape("policy", True)], "cpu")  # fmt: skip
    one_micro_batch = plan_memory(parse_args(["--model_name_or_path", "tiny", *TWO_RANKS, "--deepspeed_stage", "2",
                                              *batch, "--per_device_train_batch_size", "4"]),
                                  [one_million_parameter_shape("policy", True)], "cpu")  # fmt: skip

    def gradients(plan):
        return [(item.when, item.steady) for item in plan.items if item.name == "policy gradients (fp32, 1/2)"]

    assert gradients(accumulating) == [("held", 2 * MILLION)]
    assert gradients(one_micro_batch) == [("fwd/bwd", 2 * MILLION), ("opt step", 2 * MILLION)]


def test_learner_rank_0_plans_the_weight_sync_as_a_phase_of_its_own():
    """The policy (1M parameters, largest 100k) sent to engine actors in 0.5 MiB buckets. GPU, bf16 engine: vLLM's
    packed producer holds 3 chunks of up to bucket + largest tensor (one on the wire, the one being packed and its
    concatenation), plus ZeRO-3's gathered parameter (bf16). CPU, fp32 engine: one gloo bucket and the copy going into
    it, plus the gathered parameter (fp32)."""
    sync = ["--vllm_num_engines", "1", "--vllm_sync_bucket_mb", "0.5", "--deepspeed_stage", "3", *TWO_RANKS]
    bucket, largest = 2**19, 100_000
    gpu = items_of(*sync, "--deepspeed_weights_dtype", "bfloat16", device="gpu")
    assert gpu["weight sync: 3 packed chunks of <= 0.00 GB + the gathered parameter"] == (
        0, 3 * (bucket + 2 * largest) + 2 * largest)
    cpu = items_of(*sync, device="cpu")
    assert cpu["weight sync: a bucket of <= 0.00 GB + the gathered parameter"] == (0, bucket + 4 * largest + 4 * largest)
    # The default 256 MB bucket is larger than this policy: a chunk never holds more than the policy (bf16: 2 MB).
    whole = items_of("--vllm_num_engines", "1", *TWO_RANKS, "--deepspeed_stage", "2", device="gpu")
    assert whole["weight sync: 3 packed chunks of <= 0.00 GB"] == (0, 3 * 2 * MILLION)
    assert not any(name.startswith("weight sync") for name in items_of())  # one process: its engine shares tensors


def test_one_process_holds_everything_whole():
    items = items_of()
    assert items["policy weights (fp32)"] == (4 * MILLION, 4 * MILLION)
    assert items["policy gradients (fp32)"] == (0, 4 * MILLION)
    assert items["policy AdamW moments (fp32)"] == (0, 8 * MILLION)
    assert not any("master" in name or "bucket" in name for name in items)


def test_steady_state_is_what_is_held_plus_the_largest_phase():
    args = parse_args(["--model_name_or_path", "tiny", *TWO_RANKS, "--deepspeed_stage", "2"])
    plan = plan_memory(args, [one_million_parameter_shape("policy", True)], "cpu")
    held = sum(item.steady for item in plan.items if item.when == "held")
    phases = {}
    for item in plan.items:
        if item.when in ("forward", "fwd/bwd", "opt step", "wt sync"):
            phases[item.when] = phases.get(item.when, 0) + item.steady
    assert plan.steady == held + max(phases.values())
    assert plan.at_load == sum(item.at_load for item in plan.items if item.when in ("held", "loading"))


# ---- activations: the coefficients against what autograd saves ------------------------------------------------------


def saved_bytes_per_layer(regime: str, checkpointing: bool, batch: int = 2, seq: int = 48) -> tuple[float, int]:
    """Bytes autograd saves for a 2-layer minus a 1-layer Llama (one layer's), and that layer's parameter count."""
    from transformers import LlamaConfig, LlamaModel

    def saved(layers: int) -> tuple[int, int]:
        config = LlamaConfig(hidden_size=96, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=24, num_hidden_layers=layers, vocab_size=300)  # fmt: skip
        torch.manual_seed(0)
        model = LlamaModel(config).to(torch.bfloat16 if regime == "bf16" else torch.float32).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in parameters:
                storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        input_ids = torch.randint(0, 300, (batch, seq), generator=torch.Generator().manual_seed(0))
        attention_mask = torch.ones(batch, seq, dtype=torch.long)
        attention_mask[0, :5] = 0  # left padding, as the learner's batches have
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime != "fp32")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        layer_params = sum(p.numel() for p in model.layers[0].parameters())
        return sum(storages.values()), layer_params

    (one, layer_params), (two, _) = saved(1), saved(2)
    return two - one, layer_params


@pytest.mark.parametrize("regime", ["fp32", "autocast", "bf16"])
def test_layer_coefficients_are_what_autograd_saves(regime):
    batch, seq = 2, 48
    measured, layer_params = saved_bytes_per_layer(regime, checkpointing=False, batch=batch, seq=seq)
    shape = replace(one_million_parameter_shape("policy", True), hidden_size=96, intermediate_size=160, num_heads=4,
                    num_kv_heads=2, head_dim=24)  # fmt: skip
    expected = batch * seq * layer_bytes_per_token(shape, regime, seq)
    if regime == "autocast":
        expected += 2 * (layer_params - 2 * 96)  # the bf16 copies of the layer's weights (its norms are not cast)
    assert measured == expected


@pytest.mark.parametrize("regime, residual_bytes", [("fp32", 4), ("bf16", 2)])
def test_checkpointed_layers_keep_only_their_input(regime, residual_bytes):
    batch, seq = 2, 48
    measured, _ = saved_bytes_per_layer(regime, checkpointing=True, batch=batch, seq=seq)
    assert measured == batch * seq * 96 * residual_bytes


# ---- refusing a run that cannot fit ---------------------------------------------------------------------------------


def test_a_run_that_cannot_fit_is_refused_naming_the_biggest_item_and_its_flag():
    args = parse_args(["--model_name_or_path", "tiny", "--logprob_chunk_size", "0",
                       "--per_device_train_batch_size", "64", "--local_rollout_batch_size", "64",
                       "--number_samples_per_prompt", "1", "--total_episodes", "64",
                       "--response_length", "1500", "--max_token_length", "2048"])  # fmt: skip
    plan = plan_memory(args, run_model_shapes(args), "cpu")
    with pytest.raises(ConfigError) as error:
        plan.check(16e9, "this machine (MemAvailable)")
    message = str(error.value)
    assert message.startswith(f"a learner rank needs {plan.peak / 1e9:.1f} GB in a training step but this machine "
                              "(MemAvailable) has 16.0 GB; the biggest item is logits over 49152 tokens (whole: 64 x "
                              "1500)")  # fmt: skip
    assert "--logprob_chunk_size 1024" in message
    plan.check(plan.peak, "a device that fits it exactly")  # no error


def run_trainer(*flags: str, tmp_path: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "open_instruct.ppo_vllm_thread_ray_gtrl", "--model_name_or_path", "tiny",
               "--output_dir", str(tmp_path / "out"), *flags]  # fmt: skip
    return run_command(command, REPO, timeout_s=120)[0]  # tests/conftest.py puts this checkout first on PYTHONPATH


def test_the_trainer_prints_the_plan_and_refuses_before_any_model_loads(tmp_path):
    process = run_trainer("--per_device_train_batch_size", "64", "--local_rollout_batch_size", "64",
                          "--number_samples_per_prompt", "1", "--total_episodes", "64", "--response_length", "1500",
                          "--max_token_length", "2048", "--device_memory_gb", "8", tmp_path=tmp_path)  # fmt: skip
    assert process.returncode == 2, process.stderr[-2000:]
    assert "[memory] plan of one learner rank on a cpu (one process, no DeepSpeed" in process.stdout
    last = process.stderr.strip().splitlines()[-1]
    assert last.startswith("error: a learner rank needs") and "--device_memory_gb 8 has 8.0 GB" in last, last
    # Sequences of the data's longest prompt + 1500 response tokens (not --max_prompt_token_length's 256 + 1500).
    assert re.search(r"the biggest item is activations: policy, 64 x 15\d\d tokens \(.*--gradient_checkpointing true",
                     last)
    assert "Loading weights" not in process.stdout + process.stderr and "[vllm]" not in process.stdout
    assert not (tmp_path / "out" / "model").exists()


def test_ray_learners_are_checked_against_device_memory_gb_without_starting_ray(tmp_path):
    process = run_trainer("--num_learners_per_node", "2", "--deepspeed_stage", "3", "--per_device_train_batch_size",
                          "4", "--device_memory_gb", "0.5", tmp_path=tmp_path)  # fmt: skip
    assert process.returncode == 2, process.stderr[-2000:]
    assert "(ZeRO-3 over 2 rank(s)" in process.stdout
    last = process.stderr.strip().splitlines()[-1]
    assert last.startswith("error: a learner rank needs") and "--device_memory_gb 0.5 has 0.5 GB" in last, last
    assert "Ray started locally" not in process.stdout  # refused before the cluster started


# ---- the CLI on the 8B recipe, offline ------------------------------------------------------------------------------


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "open_instruct.memory_plan", *argv], capture_output=True, text=True,
                          env=env, timeout=120, cwd=REPO)  # fmt: skip


def test_cli_plans_the_8b_recipe_offline_from_the_shipped_configs():
    process = run_cli(str(RECIPE_8B))
    assert process.returncode == 0, process.stderr[-2000:]
    out = process.stdout
    assert "ZeRO-3 over 8 rank(s); policy 8.03B, reference policy 8.03B, value model 7.50B" in out
    shipped = "config from configs/model_configs/allenai/Llama-3.1-Tulu-3-8B"
    assert f"policy: 8,030,326,784 parameters, {shipped}-DPO" in out
    assert f"value model: 7,504,961,536 parameters, {shipped}-RM" in out
    assert "gpu: 80.0 GB; peak" in out and "GB to spare" in out
    assert "each engine GPU (4 engine(s) x 2 GPU(s))" in out
    # Learner rank 0 sends the policy (bf16, embedding 1.05 GB): 3 chunks of <= 2 x 1.05 GB + the gathered embedding.
    assert re.search(r"weight sync: 3 packed chunks of <= 2.10 GB \+ the gathered parameter +wt sync +- +7.4 GB", out)
    # The recipe's header states this plan: it must change when the plan does.
    at_load, steady = re.search(r"  total +peak +([\d.]+) GB +([\d.]+) GB", out).groups()
    spare = re.search(r"\(\d+%\): ([\d.]+) GB to spare", out).group(1)
    header = RECIPE_8B.read_text().split("\nmodel_name_or_path")[0]
    assert f"at load {at_load} GB" in header and f"steady state {steady} GB" in header, (at_load, steady)
    assert f"{spare} GB (" in header and "to spare" in header, spare


RECIPE_8B_LORA_1NODE = REPO / "configs" / "train_configs" / "ppo_tulu3_8b_lora_1node.yaml"


def plan_of(recipe: Path, *flags: str):
    """The plan the trainer prints at start for `recipe` (and flags) on its 80 GB learner GPUs."""
    args = parse_args([str(recipe), *flags])
    return plan_memory(args, run_model_shapes(args), "gpu", args.dist.device_memory_gb * 1e9)


def test_the_8b_lora_recipe_fits_one_node_where_full_fine_tuning_does_not():
    """configs/train_configs/ppo_tulu3_8b_lora_1node.yaml: 4 learner ranks and 4 engines on one 8-GPU node. With LoRA
    a rank holds 1/4 of the frozen bf16 bases and the adapters' optimizer state; full fine-tuning on the same 4 ranks
    needs AdamW moments and masters of the whole models, and is refused."""
    args = parse_args([str(RECIPE_8B_LORA_1NODE)])
    assert args.dist.num_learners + args.dist.vllm_num_engines * args.dist.vllm_tensor_parallel_size == 8
    lora = plan_of(RECIPE_8B_LORA_1NODE)
    capacity = args.dist.device_memory_gb * 1e9
    lora.check(capacity, "an 80 GB GPU")  # accepted
    assert not [item.name for item in lora.items if item.name.startswith("reference policy")]
    full = plan_of(RECIPE_8B_LORA_1NODE, "--lora_rank", "0")
    with pytest.raises(ConfigError, match="the biggest item is policy AdamW moments"):
        full.check(capacity, "an 80 GB GPU")
    # The recipe's header states the plan: it must change when the plan does.
    header = RECIPE_8B_LORA_1NODE.read_text().split("\nmodel_name_or_path")[0]
    assert f"at load {lora.at_load / 1e9:.1f} GB; steady state {lora.steady / 1e9:.1f} GB" in header
    assert f"{(capacity - lora.peak) / 1e9:.1f} GB ({1 - lora.peak / capacity:.0%}) to spare" in header
    full_2 = plan_of(RECIPE_8B_LORA_1NODE, "--lora_rank", "0", "--per_device_train_batch_size", "2")
    assert f"does not fit: {full_2.peak / 1e9:.1f} GB at micro-batch 2 ({full.peak / 1e9:.1f} at 4)" in header


def test_cli_refuses_the_8b_recipe_without_gradient_checkpointing():
    process = run_cli(str(RECIPE_8B), "--gradient_checkpointing", "false")
    assert process.returncode == 2
    last = process.stderr.strip().splitlines()[-1]
    assert last.startswith("error: a learner rank needs") and "--device_memory_gb 80 has 80.0 GB" in last, last
    assert "the biggest item is activations: policy, 2 x 4096 tokens (" in last
    assert "GB): --gradient_checkpointing true" in last


def test_passes_without_gradients_keep_no_bf16_copy_of_the_trainable_weights():
    """Autocast caches the bf16 copy of every fp32 weight that requires grad, also under no_grad, until its region
    ends: 2 bytes a parameter on top of the plan's forward phase (2.15 GB of a 1.07B policy's 2.63 GB rollout peak,
    measured on an H200). The rollout's forwards turn the cache off; the training pass keeps it (its backward reuses
    the copies)."""
    from open_instruct.learner import models

    seen = []

    def forward(rows: torch.Tensor) -> torch.Tensor:
        seen.append(torch.is_autocast_cache_enabled())
        return rows

    models.no_grad_in_chunks(forward, 2, torch.zeros(4, 3), device=torch.device("cpu"), dtype=torch.bfloat16)
    assert seen == [False, False]
    with devices.autocast(torch.device("cpu"), torch.bfloat16):
        assert torch.is_autocast_cache_enabled()
