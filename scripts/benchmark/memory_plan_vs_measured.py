"""The memory plan against measurement: per-rank peak memory of one learner step, predicted vs measured.

    unshare -n bash -c 'ip link set lo up && PYTHONPATH=$PWD python scripts/benchmark/memory_plan_vs_measured.py \
        --model embedded --ranks 2 --stage 3 --json out.json'
    python scripts/benchmark/memory_plan_vs_measured.py --from_json out.json   # the plan as it stands, no runs

Each case spawns its learner ranks here (torch.multiprocessing, DeepSpeed over gloo on 127.0.0.1: run it in a
loopback-only network namespace as above), builds a PPOLearner (GRPOLearner for the larger model) on a DeepSpeedBackend
as a Ray learner rank does, and runs one step (make_experience + train) on a synthetic rollout of fixed lengths.
Measured: each rank process's peak resident memory (VmHWM, the CPU's analogue of a GPU's peak memory) while the
models load, and again (reset through /proc/self/clear_refs) during the step. The step trains 2 epochs: the second
runs with AdamW's moments allocated, as every step after the first does. The ranks run with glibc's
MALLOC_MMAP_THRESHOLD_ at 64 KiB (--malloc_mmap_threshold), so that a freed tensor leaves the resident set as it
leaves a GPU's allocated memory; with glibc's default, freed heap memory stays resident and the peaks measured here
were 0.8-3.7 GB higher on the embedded model at 1 rank (docs/memory.md). Predicted: `plan_memory` for the same
flags on a CPU, computed in this process from the configs alone before any rank starts.

Models: `embedded` (SmolLM2-135M; PPO with value model and reference) and `larger` (a random-weight Llama of 0.30B
parameters written with save_pretrained to a temporary folder; GRPO, no reference, so that 1 rank fits beside other
jobs on a 24 GiB machine; micro-batches of 2).
"""

import argparse
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

PROMPT_TOKENS, RESPONSE_TOKENS = 64, 192
COMMON_FLAGS = [
    "--learner_compute_dtype", "float32",  # the same on every CPU (auto would probe this one's bf16)
    "--max_prompt_token_length", str(PROMPT_TOKENS),
    "--response_length", str(RESPONSE_TOKENS),
    "--max_token_length", str(PROMPT_TOKENS + RESPONSE_TOKENS),
    "--per_device_train_batch_size", "4",
    "--local_rollout_batch_size", "4",
    "--number_samples_per_prompt", "2",
    "--num_mini_batches", "1",
    "--num_epochs", "2",  # the second epoch trains with AdamW's moments allocated: the steady state
    "--total_episodes", "8",
]  # fmt: skip
MODEL_FLAGS = {
    "embedded": ["--algorithm", "ppo", "--beta", "0.05"],
    "larger": ["--algorithm", "grpo", "--beta", "0", "--per_device_train_batch_size", "2"],
}
# The larger model: a Llama of 0.30B parameters with SmolLM2's tokenizer (untied LM head).
LARGER_CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=18, num_attention_heads=16,
                     num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False)


def status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set ("high water mark") restarts from the current one


def build_larger_model(folder: str) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from open_instruct.data.embedded import smollm2_path

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    config = LlamaConfig(vocab_size=len(tokenizer), **special, **LARGER_CONFIG)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)  # safetensors
    tokenizer.save_pretrained(folder)


def synthetic_rollout(tokenizer, num_prompts: int, samples: int):
    """Prompts of PROMPT_TOKENS tokens or a few fewer (so that the batch is left-padded and attention takes a mask,
    as in a real rollout), and responses of exactly RESPONSE_TOKENS (none stops early)."""
    from open_instruct.data.batches import PromptBatch
    from open_instruct.generation.vllm_engine import Completion

    generator = torch.Generator().manual_seed(0)
    prompt_ids = [torch.randint(200, 40000, (PROMPT_TOKENS - row,), generator=generator).tolist()
                  for row in range(num_prompts)]  # fmt: skip
    prompts = PromptBatch(prompt_ids, ["4"] * num_prompts, ["arithmetic"] * num_prompts, [""] * num_prompts)
    completions = []
    for row in range(num_prompts * samples):
        ids = torch.randint(200, 40000, (RESPONSE_TOKENS,), generator=generator).tolist()
        completions.append(Completion(row // samples, ids, tokenizer.decode(ids), "length"))
    return prompts, completions


class PhaseTrace:
    """Each phase's peak and end resident memory: `wrap` makes a method mark the end of a phase when it returns."""

    def __init__(self):
        self.phases: list[tuple[str, int, int]] = []  # (phase, peak, resident at its end)

    def mark(self, label: str) -> None:
        self.phases.append((label, status_bytes("VmHWM"), status_bytes("VmRSS")))
        reset_peak()

    def wrap(self, owner, name: str, label: str) -> None:
        method = getattr(owner, name)

        def traced(*args, **kwargs):
            result = method(*args, **kwargs)
            self.mark(label)
            return result

        setattr(owner, name, traced)


def trace_learner_phases(trace: PhaseTrace, backend) -> None:
    """Marks after each model loads and each engine is built (the learner's __init__ calls these in order)."""
    trace.wrap(backend, "load_model", "load a model")
    trace.wrap(backend, "trainable", "build a training engine")
    trace.wrap(backend, "frozen", "build an inference engine")


def trace_step_phases(trace: PhaseTrace, learner) -> None:
    """Marks after each model's backward and optimizer step (DeepSpeedTrainer.backward calls both)."""
    for trainer in learner.trainers:
        role = "policy" if trainer is learner.policy_trainer else "value"
        trace.wrap(trainer.engine, "backward", f"{role} forward + backward")
        trace.wrap(trainer.engine, "step", f"{role} engine step")


def learner_rank(rank: int, world_size: int, port: int, model_dir: str, flags: list[str], results) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
    from open_instruct.learner import deepspeed_backend
    from open_instruct.learner.algorithms import learner_class
    from open_instruct.rewards.manager import RewardManager
    from open_instruct.run.args import compute_batch_sizes, parse_args

    deepspeed_backend.init_process_group(rank, world_size, "127.0.0.1", port, 600)
    args = parse_args(["--model_name_or_path", model_dir, *flags])
    tokenizer = load_tokenizer(model_dir)
    baseline = status_bytes("VmRSS")
    reset_peak()
    backend = deepspeed_backend.DeepSpeedBackend(
        args.dist.deepspeed_stage, args.ppo.per_device_train_batch_size, False,
        deepspeed_backend.weights_dtype(args.dist.deepspeed_weights_dtype, args.model.learner_compute_dtype),
    )  # fmt: skip
    trace = PhaseTrace()
    trace_learner_phases(trace, backend)
    torch.manual_seed(args.run.seed)
    learner = learner_class(args.ppo.algorithm)(
        args, compute_batch_sizes(args), tokenizer, model_dir, stop_token_ids_for(tokenizer, "eos"), backend=backend,
        compute_dtype=(torch.float32, "pinned"),
    )  # fmt: skip
    load_peak = max(peak for _, peak, _ in trace.phases)
    after_load = status_bytes("VmRSS")
    trace_step_phases(trace, learner)
    prompts, completions = synthetic_rollout(tokenizer, args.ppo.local_rollout_batch_size,
                                             args.ppo.number_samples_per_prompt)  # fmt: skip
    reset_peak()
    start = time.time()
    step_start = len(trace.phases)
    experience, _, _ = learner.make_experience(prompts, completions, RewardManager(args.reward))
    trace.mark("make_experience")
    learner.train(experience)
    trace.mark("rest of train")
    results[rank] = {
        "phases": trace.phases,
        "baseline": baseline,
        "load_peak": load_peak,
        "after_load": after_load,
        "step_peak": max(peak for _, peak, _ in trace.phases[step_start:]),
        "after_step": status_bytes("VmRSS"),
        "step_s": time.time() - start,
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def case_flags(model: str, ranks: int, stage: int) -> list[str]:
    return [*COMMON_FLAGS, *MODEL_FLAGS[model], "--deepspeed_stage", str(stage),
            "--num_learners_per_node", *(["1"] * ranks)]  # fmt: skip


def predict(model_dir: str, flags: list[str]):
    """The plan of a rank on a CPU, from the configs alone (as the trainer's driver computes it)."""
    from open_instruct.run.args import parse_args
    from open_instruct.run.memory_budget import plan_memory
    from open_instruct.run.model_shapes import run_model_shapes

    args = parse_args(["--model_name_or_path", model_dir, *flags])
    return plan_memory(args, run_model_shapes(args), "cpu")


def run_case(model: str, model_dir: str, ranks: int, stage: int) -> dict:
    flags = case_flags(model, ranks, stage)
    plan = predict(model_dir, flags)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(learner_rank, args=(ranks, free_port(), model_dir, flags, results), nprocs=ranks, join=True)
        measured = dict(results)
    worst = {key: max(result[key] for result in measured.values()) for key in ("load_peak", "step_peak")}
    return {
        "model": model,
        "ranks": ranks,
        "stage": stage,
        "predicted_load": plan.at_load,
        "predicted_step": plan.steady,
        "measured_load": worst["load_peak"],
        "measured_step": worst["step_peak"],
        "per_rank": {str(rank): result for rank, result in sorted(measured.items())},
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default"),
        "plan": plan.lines(),
    }


def replan(cases: list[dict]) -> list[dict]:
    """The measured cases with the predictions of the plan as the code stands now (no rank runs again)."""
    from transformers import LlamaConfig

    from open_instruct.data.embedded import resolve_model_path

    with tempfile.TemporaryDirectory(prefix="memory-plan-config-") as config_dir:
        LlamaConfig(vocab_size=49152, **LARGER_CONFIG).save_pretrained(config_dir)  # the larger model's, no weights
        for case in cases:
            model_dir = config_dir if case["model"] == "larger" else resolve_model_path(case["model"])
            plan = predict(model_dir, case_flags(case["model"], case["ranks"], case["stage"]))
            case.update(predicted_load=plan.at_load, predicted_step=plan.steady, plan=plan.lines())
    return cases


def table(cases: list[dict]) -> list[str]:
    gb = 1e9
    lines = ["| model | ranks | ZeRO | load: predicted | measured | error | step: predicted | measured | error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for case in cases:
        load_error = case["predicted_load"] / case["measured_load"] - 1
        step_error = case["predicted_step"] / case["measured_step"] - 1
        lines.append(f"| {case['model']} | {case['ranks']} | {case['stage']} | {case['predicted_load'] / gb:.2f} GB "
                     f"| {case['measured_load'] / gb:.2f} GB | {load_error:+.0%} "
                     f"| {case['predicted_step'] / gb:.2f} GB | {case['measured_step'] / gb:.2f} GB "
                     f"| {step_error:+.0%} |")  # fmt: skip
    return lines


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODEL_FLAGS), nargs="+", default=["embedded"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--stage", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--json", help="also write the cases (with every rank's numbers and the plans) here")
    parser.add_argument(
        "--malloc_mmap_threshold", type=int, default=65536,
        help="glibc's MALLOC_MMAP_THRESHOLD_ in the ranks (bytes): tensors above it are mapped on their own and "
        "leave the resident set when freed, as freed tensors leave a GPU's allocated memory. 0: glibc's default, "
        "which moves the threshold up to 32 MB and keeps freed heap memory resident.",
    )  # fmt: skip
    parser.add_argument("--from_json", nargs="+", help="no runs: recompute the predictions of these measured cases")
    options = parser.parse_args(argv)
    if options.from_json:
        cases = replan([case for path in options.from_json for case in json.load(open(path))])
        print("\n".join(table(cases)))
        if options.json:
            with open(options.json, "w") as f:
                json.dump(cases, f, indent=1)
        return
    if options.malloc_mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(options.malloc_mmap_threshold)  # read by each spawned rank at start
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cases = []
    for model in options.model:
        temporary = tempfile.mkdtemp(prefix="memory-plan-") if model == "larger" else None
        try:
            if temporary:
                build_larger_model(temporary)
            from open_instruct.data.embedded import resolve_model_path

            model_dir = temporary or resolve_model_path(model)
            for stage in options.stage:
                for ranks in options.ranks:
                    case = run_case(model, model_dir, ranks, stage)
                    print("\n".join(case["plan"]), flush=True)
                    for rank, result in case["per_rank"].items():
                        print(f"rank {rank}: baseline {result['baseline'] / 1e9:.2f} GB; phase: peak / resident at "
                              "its end (GB): " + ", ".join(f"{label} {peak / 1e9:.2f}/{resident / 1e9:.2f}"
                                                          for label, peak, resident in result["phases"]))  # fmt: skip
                    print("\n".join(table([case])), flush=True)
                    cases.append(case)
        finally:
            if temporary:
                shutil.rmtree(temporary, ignore_errors=True)
    print("\n".join(table(cases)))
    if options.json:
        with open(options.json, "w") as f:
            json.dump(cases, f, indent=1)
    print(json.dumps([{k: v for k, v in case.items() if k not in ("plan", "per_rank")} for case in cases]))


if __name__ == "__main__":
    main(sys.argv[1:])
