"""The GPU self-check: on a GPU node, what the CPU test suite cannot run, as one table.

    bash scripts/check_gpu.sh                           # install if needed, then every check (embedded model)
    python scripts/check_gpu.py --list                  # the checks and what each needs
    python scripts/check_gpu.py --only cuda_graphs bf16_step --model tiny --json out.json

Each check runs in a subprocess of its own (one process cannot reliably hold two vLLM engines, and a failed check
must not leave GPU memory behind for the next); a check whose hardware is missing is SKIPped with the reason. Exit
code 0 when nothing FAILed. The checks, and what PASS means:

  gpus            the GPUs torch sees (information)
  bf16_step       one PPO step (2 epochs x 2 minibatches) of the single-process learner on a fixed rollout, computing
                  in bf16 autocast vs fp32 from the same start: the learner's logprobs of the rollout within
                  BF16_LOGPROB_TOLERANCE nats per token, and the parameter updates pointing the same way (cosine
                  >= BF16_UPDATE_COSINE). Runs on a CPU too (that is how the tolerances were checked).
  cuda_graphs     an engine with CUDA graphs (the GPU default) on model A, then loaded with B's weights through the
                  trainer's in-process sync, must decode B exactly as a fresh CUDA-graph engine on B does (greedy
                  token ids identical), and within CUDA_GRAPH_LOGPROB_TOLERANCE of a fresh eager engine on B; A's own
                  output must differ (else the load proved nothing). vLLM's reload writes into the captured tensors.
  nccl_transfer   2+ GPUs: 2 PPO steps with a Ray learner rank and an engine actor on GPUs of their own: the run's log
                  must name vLLM's NCCL transfer (checked by our checksum every step), and a fresh engine on the saved
                  model must reproduce the run's final greedy eval exactly, prompt by prompt.
  ipc_transfer    1+ GPU: the same with --single_gpu_mode (learner and engine share a GPU: vLLM's CUDA IPC transfer).
  single_gpu_run  3 steps of the single-GPU debug recipe (configs/train_configs/ppo_arithmetic_gpu.yaml) in sync mode
                  at SINGLE_GPU_LEARNING_RATE: exit 0, seconds per step, and every step's engine-vs-learner logprob gap
                  within GAP_BOUND_STALE_WEIGHTS, which an engine left with stale weights breaks.
  memory_plan     the memory plan (open_instruct/run/memory_plan.py) of a single-process learner step (bf16, 4 x 640
                  tokens, no engine) vs the measured HBM peak (allocator peak + what the process holds outside it),
                  within MEMORY_PLAN_TOLERANCE.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAINER = [sys.executable, "-m", "open_instruct.ppo_vllm_thread_ray_gtrl"]
# bf16 vs fp32, one PPO step of the embedded model from the same start, measured on a CPU with native bf16 (AMD EPYC,
# avx512_bf16, 2026-11-24): logprob gap 0.046 nats per token, update cosine 0.82 (the tiny model: 0.0007 and 1.00).
# Adam's first steps move each weight by about lr * sign(gradient), so small gradients whose sign bf16 flips lower
# the cosine; a learner that lost its fp32 master weights (updates rounded away) or computed garbage falls far
# below these bounds, which leave room for other hardware.
BF16_LOGPROB_TOLERANCE = 0.1  # nats per token
BF16_UPDATE_COSINE = 0.7
CUDA_GRAPH_LOGPROB_TOLERANCE = 0.05  # graphs vs eager run different kernels (bf16 sums in another order)
MEMORY_PLAN_TOLERANCE = 0.15  # the plan vs the measured peak; on CPUs it was within 15% (docs/distributed.md)
# single_gpu_run: the debug recipe for SINGLE_GPU_STEPS steps in sync mode, where the engine samples with the weights
# the learner scores with, so a synced engine's gap (`debug/vllm_vs_learner_logprob_diff_mean`) is rounding alone and
# a stale engine's is the policy change of the updates it missed. Rounding, bf16 engine: 0.026-0.039 nats per token
# (docs/ppo_details.md, sync mode, CPU with avx512_bf16, SmolLM2 at temperature 0.7). One update's change is what
# separates them, and at the recipe's own learning rate (3e-6 x 8 AdamW steps a PPO step) it is about as small
# (async mode's one-update lag at 1e-5 x 4 steps: 0.017-0.033); so the check trains at SINGLE_GPU_LEARNING_RATE.
# Measured there on a CPU (scripts/benchmark/stale_weights_gap.py, fp32, docs/measurements/2026-11-27-epyc): synced,
# 3e-6 at every step; sync skipped, 0.57 at step 2, the first on stale weights. GAP_BOUND_STALE_WEIGHTS is 2.5x the
# bf16 rounding and under a fifth of one missed update; an engine that loads part of the weights (the tied head left
# packed: 0.01-0.2, docs/ppo_details.md) lands in between and may pass.
SINGLE_GPU_STEPS = 3
SINGLE_GPU_LEARNING_RATE = "1e-4"
GAP_BOUND_STALE_WEIGHTS = 0.1  # nats per token
RUN_TIMEOUT_S = 1800
QUESTIONS = [(a, b) for a in range(1, 9) for b in (2, 7)]  # 16 one-digit additions for the evals


@dataclass
class Row:
    check: str
    status: str  # PASS, FAIL or SKIP
    measured: str = ""
    tolerance: str = ""
    detail: str = ""


@dataclass(frozen=True)
class Check:
    name: str
    gpus: int  # GPUs it needs (0: runs anywhere)
    summary: str


CHECKS = [
    Check("gpus", 1, "the GPUs torch sees"),
    Check("bf16_step", 0, "a PPO step in bf16 autocast vs fp32 (logprobs, update direction)"),
    Check("cuda_graphs", 1, "CUDA graphs stay valid after a weight load (vs fresh graph and eager engines)"),
    Check("nccl_transfer", 2, "vLLM's NCCL transfer to an engine actor; fresh engine reproduces the final eval"),
    Check("ipc_transfer", 1, "--single_gpu_mode: vLLM's CUDA IPC transfer; fresh engine reproduces the final eval"),
    Check("single_gpu_run", 1, "3 steps of the single-GPU debug recipe (s/step, engine-vs-learner gap)"),
    Check("memory_plan", 1, "the memory plan of a learner step vs the measured HBM peak"),
]


def one_line(text: str) -> str:
    return " ".join(str(text).split())[:300]


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_quietly(command: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        **(env or {}),
    }
    return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def last_json_line(process: subprocess.CompletedProcess, what: str):
    if process.returncode != 0:
        tail = [line for line in process.stderr.splitlines() if line.strip()][-3:]
        raise RuntimeError(f"{what} failed (exit {process.returncode}): {one_line(' | '.join(tail))}")
    return json.loads(process.stdout.strip().splitlines()[-1])


# ---- the checks (each runs in its own process: `--run-one NAME`) ---------------------------------------------------


def check_gpus(options) -> Row:
    import torch

    names = [f"{torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
             for i in range(torch.cuda.device_count())]  # fmt: skip
    return Row(
        "gpus",
        "PASS",
        f"{len(names)} GPU(s)",
        "",
        f"{'; '.join(names)}; torch {torch.__version__}, CUDA {torch.version.cuda}",
    )


def fixed_rollout(tokenizer):
    """Four arithmetic prompts with two responses each (right and wrong, stopped and cut off): a step's worth."""
    from open_instruct.data.batches import PromptBatch
    from open_instruct.generation.vllm_engine import Completion

    questions = QUESTIONS[:4]
    responses = ["The answer is {s}.", "{a} + {b} = {w}", "It is {w}", "{s}"]
    token_ids = [tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}],
                                               add_generation_prompt=True, return_dict=False) for a, b in questions]  # fmt: skip
    prompts = PromptBatch(token_ids=token_ids, ground_truths=[str(a + b) for a, b in questions],
                          verifier_names=["arithmetic"] * 4, texts=[tokenizer.decode(ids) for ids in token_ids])  # fmt: skip
    completions = []
    for row, (a, b) in enumerate(questions):
        for k, template in enumerate(responses[row % 2 * 2 : row % 2 * 2 + 2]):
            text = template.format(a=a, b=b, s=a + b, w=a + b + 1)
            ids = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if k == 0 else [])
            completions.append(Completion(row, ids, text, "stop" if k == 0 else "length"))
    return prompts, completions


def bf16_step(options) -> Row:
    import torch

    from open_instruct.data.embedded import resolve_model_path
    from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
    from open_instruct.learner.ppo import PPOLearner
    from open_instruct.rl.rewards import RewardManager
    from open_instruct.run.args import compute_batch_sizes, parse_args

    path = resolve_model_path(options.model)
    tokenizer = load_tokenizer(path)
    prompts, completions = fixed_rollout(tokenizer)
    outcome = {}
    for dtype in ("float32", "bfloat16"):
        args = parse_args(["--model_name_or_path", path, "--learner_compute_dtype", dtype, "--local_rollout_batch_size",
                           "4", "--number_samples_per_prompt", "2", "--per_device_train_batch_size", "2",
                           "--num_mini_batches", "2", "--num_epochs", "2", "--total_episodes", "16",
                           "--response_length", "16", "--learning_rate", "1e-5", "--beta", "0.05", "--seed", "3"])  # fmt: skip
        torch.manual_seed(args.run.seed)
        learner = PPOLearner(args, compute_batch_sizes(args), tokenizer, path, stop_token_ids_for(tokenizer, "eos"))
        start = {name: p.detach().float().cpu().clone() for name, p in learner.policy.named_parameters()}
        experience, _, _ = learner.make_experience(prompts, completions, RewardManager(args.reward))
        learner.train(experience)
        update = torch.cat([(p.detach().float().cpu() - start[name]).reshape(-1)
                            for name, p in learner.policy.named_parameters()])  # fmt: skip
        # The learner's logprobs of the rollout (--old_logprobs_from learner), on the real response tokens.
        outcome[dtype] = (experience.logprob.float().cpu(), experience.response_mask.cpu(), update, learner.device.type)
        del learner, experience
    (logprob32, mask, update32, device), (logprob16, _, update16, _) = outcome["float32"], outcome["bfloat16"]
    logprob_gap = (logprob32 - logprob16).abs()[mask].mean().item()
    cosine = torch.nn.functional.cosine_similarity(update32, update16, dim=0).item()
    return Row("bf16_step", bf16_verdict(logprob_gap, cosine), f"logprob gap {logprob_gap:.4f}, update cosine {cosine:.3f}",
               f"<= {BF16_LOGPROB_TOLERANCE}, >= {BF16_UPDATE_COSINE}", f"{options.model} on {device}")  # fmt: skip


def bf16_verdict(logprob_gap: float, cosine: float) -> str:
    return "PASS" if logprob_gap <= BF16_LOGPROB_TOLERANCE and cosine >= BF16_UPDATE_COSINE else "FAIL"


def perturbed_copy(source: str, target: Path, scale: float = 0.02) -> str:
    """`source` with every weight moved by N(0, scale) noise (fp32), saved with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return str(target)


def eval_prompt_ids(model_dir: str) -> list[list[int]]:
    from open_instruct.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return [tokenizer.apply_chat_template([{"role": "user", "content": question(a, b)}], add_generation_prompt=True,
                                          return_dict=False) for a, b in QUESTIONS]  # fmt: skip


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}? Give the final answer as a number at the end."


def engine_job(job: dict) -> dict:
    """One engine in this process (`--engine-job`): created from `start` (CUDA graphs unless `eager`), loaded with
    `load`'s weights when given (the trainer's in-process sync), then greedy decoding with logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    from open_instruct.generation.vllm_engine import (
        EngineConfig,
        create_engine,
        engine_dtype,
        generate,
        load_weights,
        sampling_params,
    )

    config = EngineConfig(job["start"], max_model_len=512, enforce_eager=job.get("eager"), gpu_memory_utilization=0.3)
    llm = create_engine(config)
    if job.get("load"):
        model = AutoModelForCausalLM.from_pretrained(job["load"], dtype=getattr(torch, engine_dtype()))
        load_weights(
            llm,
            [
                (name, p.detach().to("cuda" if torch.cuda.is_available() else "cpu"))
                for name, p in model.named_parameters()
            ],
        )
    params = sampling_params(n=1, temperature=0.0, max_tokens=job["max_tokens"], stop_token_ids=[], with_logprobs=True)
    completions = generate(llm, job["prompts"], params)
    return {"token_ids": [c.token_ids for c in completions], "logprobs": [c.logprobs for c in completions]}


def run_engine_job(job: dict, workdir: Path) -> dict:
    path = workdir / f"job_{time.time_ns()}.json"
    path.write_text(json.dumps(job))
    return last_json_line(run_quietly([sys.executable, __file__, "--engine-job", str(path)], REPO), "an engine job")


def cuda_graphs(options) -> Row:
    from open_instruct.data.embedded import resolve_model_path

    with tempfile.TemporaryDirectory() as folder:
        workdir = Path(folder)
        model_a = resolve_model_path(options.model)
        model_b = perturbed_copy(model_a, workdir / "b")
        job = {"prompts": eval_prompt_ids(model_a), "max_tokens": 32}
        reloaded = run_engine_job({**job, "start": model_a, "load": model_b}, workdir)
        before = run_engine_job({**job, "start": model_a}, workdir)
        fresh_graphs = run_engine_job({**job, "start": model_b}, workdir)
        fresh_eager = run_engine_job({**job, "start": model_b, "eager": True}, workdir)
    return cuda_graphs_verdict(reloaded, before, fresh_graphs, fresh_eager)


def cuda_graphs_verdict(reloaded: dict, before: dict, fresh_graphs: dict, fresh_eager: dict) -> Row:
    """The verdict on four engine jobs' outputs (`engine_job`: token ids and logprobs per question): A's engine
    loaded with B, A's engine as it started, fresh CUDA-graph and eager engines on B."""
    same = sum(x == y for x, y in zip(reloaded["token_ids"], fresh_graphs["token_ids"], strict=True)) / len(QUESTIONS)
    moved = reloaded["token_ids"] != before["token_ids"]
    gaps = [abs(x - y) for a, b in zip(reloaded["logprobs"], fresh_eager["logprobs"]) for x, y in zip(a, b)
            if x is not None and y is not None]  # fmt: skip
    gap = sum(gaps) / max(1, len(gaps))
    ok = same == 1.0 and moved and gap <= CUDA_GRAPH_LOGPROB_TOLERANCE
    return Row("cuda_graphs", "PASS" if ok else "FAIL", f"identical {same:.2f}, eager gap {gap:.4f}",
               f"1.00, <= {CUDA_GRAPH_LOGPROB_TOLERANCE}", "the load changed the output" if moved else
               "the load changed nothing: the comparison proves nothing")  # fmt: skip


def transfer_run(options, name: str, transport: str, flags: list[str]) -> Row:
    """2 PPO steps with a Ray learner and an engine actor; the weights must have gone over `transport`, and a fresh
    engine on the saved model must reproduce the final greedy eval."""
    from open_instruct.data.embedded import resolve_model_path

    with tempfile.TemporaryDirectory() as folder:
        workdir = Path(folder)
        eval_path = workdir / "eval.jsonl"
        eval_path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": question(a, b)}],
                                                 "ground_truth": str(a + b), "dataset": "arithmetic"}) + "\n"
                                     for a, b in QUESTIONS))  # fmt: skip
        output = workdir / "output"
        command = TRAINER + ["--model_name_or_path", resolve_model_path(options.model), "--num_learners_per_node", "1",
                             "--vllm_num_engines", "1", "--total_episodes", "64", "--local_rollout_batch_size", "8",
                             "--number_samples_per_prompt", "4", "--per_device_train_batch_size", "8", "--num_epochs",
                             "1", "--response_length", "32", "--num_evals", "1", "--eval_samples_per_prompt", "0",
                             "--learning_rate", "1e-5", "--dataset_mixer_eval_list", str(eval_path), "1.0",
                             "--output_dir", str(output), *flags]  # fmt: skip
        process = run_quietly(command, workdir)
        if process.returncode != 0:
            return Row(name, "FAIL", f"exit {process.returncode}", "exit 0", one_line(process.stderr.splitlines()[-1:]))
        model = str(output / "model")
        prompt_ids = eval_prompt_ids(model)
        fresh = run_engine_job({"start": model, "prompts": prompt_ids, "max_tokens": 32}, workdir)
        fresh_by_prompt = dict(zip(prompt_texts(model, prompt_ids), fresh["token_ids"], strict=True))
        return transfer_verdict(name, transport, process.stdout + process.stderr, output, fresh_by_prompt)


def prompt_texts(model_dir: str, prompt_ids: list[list[int]]) -> list[str]:
    """The prompts as the trainer writes them in samples.jsonl (`prompt`: its tokenizer's decoding of the ids)."""
    from open_instruct.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return [tokenizer.decode(ids) for ids in prompt_ids]


def transfer_verdict(name: str, transport: str, log: str, output: Path, fresh_by_prompt: dict[str, list[int]]) -> Row:
    """The verdict on a transfer run, from what it left: the transport its log names, the final greedy eval in
    output/samples.jsonl, the weight transfers in output/metrics.jsonl, and a fresh engine's greedy tokens on the saved
    model for each eval prompt (`fresh_by_prompt`).

    The eval's answers are matched by prompt: the eval's 16 questions have 13 distinct sums, so matching by ground
    truth compared answers to different questions (identical 0.81 on a working transfer). A run's answer stopped at
    EOS is a prefix of the fresh engine's, which runs on to max_tokens."""
    announced = [line.split(" over ", 1)[1].split()[0] for line in log.splitlines()
                 if "[vllm] weight transfer:" in line]  # fmt: skip
    used = announced[0] if announced else "no transfer announced"
    if used != transport:
        return Row(name, "FAIL", f"{used}, not {transport}", transport,
                   "the check names a transport the run did not use: it proves nothing about that one")  # fmt: skip
    steps = [json.loads(line) for line in open(output / "metrics.jsonl")]
    steps = [m for m in steps if "policy_version/learner" in m]
    seconds = [m["time/weight_broadcast"] for m in steps if "time/weight_broadcast" in m]
    rows = [json.loads(line) for line in open(output / "samples.jsonl")]
    evals = [r for r in rows if r["table"] == "eval_completions"]
    final_version = max((r["policy_version"] for r in evals), default=None)
    if not seconds or final_version != len(steps):
        return Row(name, "FAIL", f"{len(seconds)} transfer(s), final eval at version {final_version}", "1.00",
                   f"{len(steps)} steps: the final eval must run on the weights of the last one")  # fmt: skip
    final: dict[str, list[int]] = {}
    for row in evals:
        if row["policy_version"] == final_version:
            if row["prompt"] in final:
                raise ValueError(f"the final eval holds the prompt {row['prompt']!r} twice: the check cannot match it")
            final[row["prompt"]] = row["token_ids"]
    if final.keys() != fresh_by_prompt.keys():
        return Row(name, "FAIL", f"{transport}, {len(final)} eval prompts vs {len(fresh_by_prompt)} fresh", "1.00",
                   "the run's final eval and the fresh engine answered different prompts")  # fmt: skip
    same = sum(fresh_by_prompt[prompt][: len(tokens)] == tokens for prompt, tokens in final.items()) / len(final)
    return Row(name, "PASS" if same == 1.0 else "FAIL", f"{transport}, identical {same:.2f}", "1.00",
               f"transfer {max(seconds):.2f}s; checksums equal every step (the run would have stopped)")  # fmt: skip


def nccl_transfer(options) -> Row:
    return transfer_run(options, "nccl_transfer", "nccl", [])


def ipc_transfer(options) -> Row:
    return transfer_run(options, "ipc_transfer", "ipc", ["--single_gpu_mode", "true",
                                                         "--vllm_gpu_memory_utilization", "0.3"])  # fmt: skip


def single_gpu_run(options) -> Row:
    """3 steps of the single-GPU debug recipe, in sync mode: a synced engine samples with exactly the weights the
    learner scores with, so the gap it logs is rounding alone, and an engine that kept stale weights shows."""
    with tempfile.TemporaryDirectory() as folder:
        output = Path(folder) / "output"
        command = TRAINER + ["configs/train_configs/ppo_arithmetic_gpu.yaml", "--model_name_or_path", options.model,
                             "--total_episodes", "384", "--num_evals", "1", "--async_mode", "false",
                             "--learning_rate", SINGLE_GPU_LEARNING_RATE, "--output_dir", str(output)]  # fmt: skip
        process = run_quietly(command, REPO)
        if process.returncode != 0:
            return Row("single_gpu_run", "FAIL", f"exit {process.returncode}", "exit 0",
                       one_line(process.stderr.splitlines()[-1:]))  # fmt: skip
        return single_gpu_verdict(output / "metrics.jsonl", options.model)


def single_gpu_verdict(metrics_path: Path, model: str) -> Row:
    """The verdict on the single-GPU run's metrics.jsonl: SINGLE_GPU_STEPS steps, each with an engine-vs-learner gap
    (`debug/vllm_vs_learner_logprob_diff_mean`) within GAP_BOUND_STALE_WEIGHTS."""
    steps = [json.loads(line) for line in open(metrics_path)]
    steps = [m for m in steps if "policy_version/learner" in m]
    gaps = [m.get("debug/vllm_vs_learner_logprob_diff_mean") for m in steps]
    if len(steps) < SINGLE_GPU_STEPS or None in gaps:
        return Row("single_gpu_run", "FAIL", f"{len(steps)} steps, gaps {gaps}", f"{SINGLE_GPU_STEPS} steps",
                   "the run ended early or logged no engine-vs-learner gap")  # fmt: skip
    seconds = [m["time/step"] for m in steps[1:]]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    ok = gaps[worst] <= GAP_BOUND_STALE_WEIGHTS
    return Row("single_gpu_run", "PASS" if ok else "FAIL",
               f"{sum(seconds) / len(seconds):.1f} s/step, logprob gap {', '.join(f'{g:.4f}' for g in gaps)}",
               f"gap <= {GAP_BOUND_STALE_WEIGHTS}", f"{len(steps)} steps of {model}, sync mode" +
               ("" if ok else f"; step {worst + 1}'s engine samples from other weights than the learner's (stale?)"))


def synthetic_rollout(tokenizer, responses: int, response_tokens: int):
    """`responses` completions of exactly `response_tokens` random tokens (cut off) to one arithmetic prompt."""
    import torch

    from open_instruct.data.batches import PromptBatch
    from open_instruct.generation.vllm_engine import Completion

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                           return_dict=False)  # fmt: skip
    prompts = PromptBatch([prompt] * responses, ["5"] * responses, ["arithmetic"] * responses, ["q"] * responses)
    generator = torch.Generator().manual_seed(0)
    completions = [Completion(row, torch.randint(100, 40000, (response_tokens,), generator=generator).tolist(), "5",
                              "length") for row in range(responses)]  # fmt: skip
    return prompts, completions


def memory_plan_args(path: str):
    """The learner step the memory_plan check measures: bf16 compute, micro-batch 4 x 640 tokens, a reference and a
    value model, one process."""
    from open_instruct.run.args import parse_args

    return parse_args(["--model_name_or_path", path, "--learner_compute_dtype", "bfloat16",
                       "--local_rollout_batch_size", "8", "--number_samples_per_prompt", "1",
                       "--per_device_train_batch_size", "4",
                       "--num_mini_batches", "1", "--num_epochs", "1", "--total_episodes", "8", "--response_length",
                       "512", "--max_token_length", "640", "--max_prompt_token_length", "128", "--beta", "0.05"])  # fmt: skip


def planned_learner_step(args, longest_prompt: int):
    """The plan of what the check measures: the learner alone. Its process holds no vLLM engine and hands it no policy
    copies, so the plan leaves the engine's share out (`with_engine=False`)."""
    from open_instruct.run.memory_plan import plan_memory
    from open_instruct.run.model_shapes import run_model_shapes

    return plan_memory(args, run_model_shapes(args), "gpu", None, longest_prompt, with_engine=False)


def memory_plan(options) -> Row:
    """The memory plan of a single-process learner on this GPU (`memory_plan_args`) vs its measured peak over loading
    and two PPO steps: the caching allocator's peak reserve plus what the process holds outside it (CUDA context,
    cuBLAS workspaces)."""
    import torch

    from open_instruct.data.embedded import resolve_model_path
    from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
    from open_instruct.learner.ppo import PPOLearner
    from open_instruct.rl.rewards import RewardManager
    from open_instruct.run.args import compute_batch_sizes

    path = resolve_model_path(options.model)
    tokenizer = load_tokenizer(path)
    args = memory_plan_args(path)
    prompts, completions = synthetic_rollout(tokenizer, 8, 512)
    plan = planned_learner_step(args, max(len(ids) for ids in prompts.token_ids))
    torch.manual_seed(args.run.seed)
    learner = PPOLearner(args, compute_batch_sizes(args), tokenizer, path, stop_token_ids_for(tokenizer, "eos"))
    # Two steps: AdamW makes its moments at the first optimizer step, after the first step's forward and backward
    # passes; from the second step on they are held through them, which is the steady state the plan describes.
    for _ in range(2):
        experience, _, _ = learner.make_experience(prompts, completions, RewardManager(args.reward))
        learner.train(experience)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    outside_allocator = (total - free) - torch.cuda.memory_reserved()
    measured = torch.cuda.max_memory_reserved() + outside_allocator
    error = plan.peak / measured - 1
    return Row("memory_plan", memory_plan_verdict(plan.peak, measured),
               f"planned {plan.peak / 1e9:.2f} GB, measured {measured / 1e9:.2f} GB ({error:+.0%})",
               f"within {MEMORY_PLAN_TOLERANCE:.0%}", f"{options.model}, single process, bf16, no engine")  # fmt: skip


def memory_plan_verdict(planned: float, measured: float) -> str:
    return "PASS" if abs(planned / measured - 1) <= MEMORY_PLAN_TOLERANCE else "FAIL"


RUNNERS = {"gpus": check_gpus, "bf16_step": bf16_step, "cuda_graphs": cuda_graphs, "nccl_transfer": nccl_transfer,
           "ipc_transfer": ipc_transfer, "single_gpu_run": single_gpu_run, "memory_plan": memory_plan}  # fmt: skip


# ---- the driver: one subprocess per check, then the table ----------------------------------------------------------


def run_check(check: Check, options, gpus: int) -> Row:
    if gpus < check.gpus:
        return Row(check.name, "SKIP", detail=f"needs {check.gpus} GPU(s); this machine has {gpus}")
    command = [sys.executable, __file__, "--run-one", check.name, "--model", options.model]
    try:
        return Row(**last_json_line(run_quietly(command, REPO), check.name))
    except Exception as error:  # noqa: BLE001 - a failed check is a row, not the end of the table
        return Row(check.name, "FAIL", detail=one_line(f"{type(error).__name__}: {error}"))


def format_table(rows: list[Row]) -> str:
    header = ["check", "result", "measured", "tolerance", "detail"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += [f"| {r.check} | {r.status} | {r.measured} | {r.tolerance} | {r.detail} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=[c.name for c in CHECKS], help="run these checks only")
    parser.add_argument("--model", default="embedded", help="the policy: embedded (SmolLM2-135M), tiny, or a folder")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("--run-one", help=argparse.SUPPRESS)  # a check in this subprocess: one JSON row on stdout
    parser.add_argument("--engine-job", help=argparse.SUPPRESS)  # an engine in this subprocess (cuda_graphs, transfers)
    options = parser.parse_args(argv)
    if options.engine_job:
        print(json.dumps(engine_job(json.loads(Path(options.engine_job).read_text()))))
        return 0
    if options.run_one:
        print(json.dumps(asdict(RUNNERS[options.run_one](options))))
        return 0
    if options.list:
        for check in CHECKS:
            print(f"{check.name:<15} needs {check.gpus} GPU(s)  {check.summary}")
        return 0
    gpus = gpu_count()
    print(
        f"[check_gpu] {gpus} GPU(s); model {options.model}; {len(options.only or CHECKS)} check(s), each in its own process"
    )
    rows = []
    for check in CHECKS:
        if options.only and check.name not in options.only:
            continue
        started = time.time()
        rows.append(run_check(check, options, gpus))
        print(f"[check_gpu] {check.name}: {rows[-1].status} ({time.time() - started:.0f}s)", flush=True)
    print(format_table(rows))
    if options.json:
        Path(options.json).write_text(json.dumps([asdict(row) for row in rows], indent=2))
    return 1 if any(row.status == "FAIL" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
