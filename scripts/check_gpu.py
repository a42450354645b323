"""The GPU self-check: on a GPU node, what the CPU test suite cannot run, as one table.

    bash scripts/check_gpu.sh                           # install if needed, then every check (embedded model)
    python scripts/check_gpu.py --list                  # the checks and what each needs
    python scripts/check_gpu.py --only cuda_graphs bf16_step --model tiny --json out.json
    python scripts/check_gpu.py --cpu-checks            # no GPU here: run the checks that need none (bf16_step)

Each check runs in a subprocess of its own (one process cannot reliably hold two vLLM engines, and a failed check
must not leave GPU memory behind for the next); a check whose GPUs are missing is SKIPped with the reason. Exit
code 0 when nothing FAILed. Where torch sees no GPU: if the driver lists GPUs (`nvidia-smi -L`, or /dev/nvidiaN where
nvidia-smi is missing) the `gpus` row FAILs (a CPU build of torch on a GPU node would otherwise skip every check and
pass); if the driver lists none either, one line says so and the exit code is 1, unless --cpu-checks asks for the
checks that need no GPU. The checks, and what PASS means:

  gpus            the GPUs torch sees (information), FAIL where the driver lists GPUs torch cannot see
  bf16_step       one PPO step (2 epochs x 2 minibatches) of the single-process learner on a fixed rollout, computing
                  in bf16 autocast vs fp32 from the same start: the learner's logprobs of the rollout within
                  BF16_LOGPROB_TOLERANCE nats per token, and the parameter updates pointing the same way (cosine
                  >= BF16_UPDATE_COSINE). Runs on a CPU too (that is how the tolerances were checked).
  cuda_graphs     an engine with CUDA graphs (the GPU default) on model A, then loaded with B's weights through the
                  trainer's in-process sync, must decode B exactly as a fresh CUDA-graph engine on B does (greedy
                  token ids identical), and within CUDA_GRAPH_LOGPROB_TOLERANCE of a fresh eager engine on B; A's own
                  output must differ (else the load proved nothing). vLLM's reload writes into the captured tensors.
  nccl_transfer   2+ GPUs: 2 PPO steps with a Ray learner rank and an engine actor on GPUs of their own: the run's log
                  must name vLLM's NCCL transfer (checked by our checksum every step), a fresh engine on the saved
                  model must reproduce the run's final greedy eval exactly, prompt by prompt, and a stale engine (the
                  start model, no transfer) must answer at least one prompt otherwise (else a transfer that did
                  nothing would pass too).
  ipc_transfer    1+ GPU: the same with --single_gpu_mode (learner and engine share a GPU: vLLM's CUDA IPC transfer).
  single_gpu_run  3 steps of the single-GPU debug recipe (configs/train_configs/ppo_arithmetic_gpu.yaml) in sync mode
                  at SINGLE_GPU_LEARNING_RATE: exit 0, seconds per step, every step's engine-vs-learner logprob gap
                  within GAP_BOUND_STALE_WEIGHTS, which an engine left with stale weights breaks, and the saved model
                  at least MIN_RELATIVE_UPDATE from the start (a learner that never updates keeps the gap at 0).
  memory_plan     the memory plan (open_instruct/run/memory_budget.py) of a single-process learner step (bf16, 4 x 640
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
sys.path.insert(0, str(REPO / "scripts"))  # the verdicts beside this file, also where a test loads it by its path
from check_gpu_verdicts import (  # noqa: E402
    BF16_LOGPROB_TOLERANCE,
    BF16_UPDATE_COSINE,
    MEMORY_PLAN_TOLERANCE,
    SINGLE_GPU_LEARNING_RATE,
    Row,
    TransferRun,
    bf16_verdict,
    cuda_graphs_verdict,
    listed_gpus,
    memory_plan_verdict,
    single_gpu_verdict,
    torch_blind_row,
    transfer_verdict,
)

TRAINER = [sys.executable, "-m", "open_instruct.ppo_vllm_thread_ray_gtrl"]
NVIDIA_SMI_TIMEOUT_S = 30  # a driver that does not list its GPUs in this long is broken
DEVICE_DIR = Path("/dev")  # where the driver's /dev/nvidiaN files are (one per GPU)
RUN_TIMEOUT_S = 1800
QUESTIONS = [(a, b) for a in range(1, 9) for b in (2, 7)]  # 16 one-digit additions for the evals


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


def torch_gpus() -> tuple[int, str]:
    """The GPUs torch can use, and its build (a CPU-only wheel sees none on any machine)."""
    import torch

    build = f"torch {torch.__version__} " + (
        f"(CUDA {torch.version.cuda})" if torch.version.cuda else "(a CPU-only build)"
    )
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        build += f", CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}"
    return (torch.cuda.device_count() if torch.cuda.is_available() else 0), build


def driver_gpus() -> tuple[int, str]:
    """The NVIDIA GPUs the driver lists, and how it was asked: `nvidia-smi -L`, or where nvidia-smi is not installed
    (some containers) the /dev/nvidiaN device files. A driver that does not answer counts as one GPU: it is a broken
    GPU node, not a machine without one."""
    devices = len(list(DEVICE_DIR.glob("nvidia[0-9]*")))
    try:
        answer = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except FileNotFoundError:
        return devices, f"no nvidia-smi; {devices} /dev/nvidiaN device file(s)"
    except subprocess.TimeoutExpired:
        return max(1, devices), f"nvidia-smi -L did not answer in {NVIDIA_SMI_TIMEOUT_S} s"
    listed = listed_gpus(answer.stdout)
    said = one_line(answer.stdout + answer.stderr)[:120]
    return max(listed, devices), f"nvidia-smi -L lists {listed}" + ("" if listed else f" ({said or 'no output'})")


def no_gpu_line(driver: tuple[int, str], torch_build: str) -> str:
    cpu_side = " ".join(check.name for check in CHECKS if check.gpus == 0)
    return (f"[check_gpu] no GPU on this machine ({driver[1]}; {torch_build} sees none): nothing was checked. Run it "
            f"on a GPU node, or pass --cpu-checks to run the checks that need no GPU ({cpu_side}).")  # fmt: skip


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
    from open_instruct.rewards.manager import RewardManager
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


def transfer_run(options, name: str, transport: str, flags: list[str]) -> Row:
    """2 PPO steps with a Ray learner and an engine actor; the weights must have gone over `transport`, a fresh
    engine on the saved model must reproduce the final greedy eval, and a stale one on the start model must not.

    The steps are the single-GPU recipe's updates (4 epochs x 2 minibatches at SINGLE_GPU_LEARNING_RATE: a policy
    change of 0.57 nats per token, check_gpu_verdicts.py), large enough to move greedy answers: 2 AdamW steps at 1e-5
    moved none of the tiny model's 16 (scripts/benchmark/update_size.py). In sync mode, so that the run's own
    engine-vs-learner guard (0.5 nats) compares an engine and a learner on the same weights."""
    from open_instruct.data.embedded import resolve_model_path

    with tempfile.TemporaryDirectory() as folder:
        workdir = Path(folder)
        eval_path = workdir / "eval.jsonl"
        eval_path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": question(a, b)}],
                                                 "ground_truth": str(a + b), "dataset": "arithmetic"}) + "\n"
                                     for a, b in QUESTIONS))  # fmt: skip
        output = workdir / "output"
        start = resolve_model_path(options.model)
        command = TRAINER + ["--model_name_or_path", start, "--num_learners_per_node", "1",
                             "--vllm_num_engines", "1", "--total_episodes", "64", "--local_rollout_batch_size", "8",
                             "--number_samples_per_prompt", "4", "--per_device_train_batch_size", "8", "--num_epochs",
                             "4", "--num_mini_batches", "2", "--async_mode", "false", "--response_length", "32",
                             "--num_evals", "1", "--eval_samples_per_prompt", "0", "--learning_rate",
                             SINGLE_GPU_LEARNING_RATE, "--dataset_mixer_eval_list", str(eval_path), "1.0",
                             "--output_dir", str(output), *flags]  # fmt: skip
        process = run_quietly(command, workdir)
        if process.returncode != 0:
            return Row(name, "FAIL", f"exit {process.returncode}", "exit 0", one_line(process.stderr.splitlines()[-1:]))
        model = str(output / "model")
        prompt_ids = eval_prompt_ids(model)
        texts = prompt_texts(model, prompt_ids)
        job = {"prompts": prompt_ids, "max_tokens": 32}
        fresh = dict(zip(texts, answers(run_engine_job({**job, "start": model}, workdir)), strict=True))
        # The engine the run would have had if no transfer ever reached it: the start weights.
        stale = dict(zip(texts, answers(run_engine_job({**job, "start": start}, workdir)), strict=True))
        return transfer_verdict(
            name, transport, read_transfer_run(process.stdout + process.stderr, output), fresh, stale
        )


def answers(engine_output: dict) -> list[tuple[list[int], list[float | None]]]:
    """An engine job's greedy token ids and their logprobs, question by question."""
    return list(zip(engine_output["token_ids"], engine_output["logprobs"], strict=True))


def prompt_texts(model_dir: str, prompt_ids: list[list[int]]) -> list[str]:
    """The prompts as the trainer writes them in samples.jsonl (`prompt`: its tokenizer's decoding of the ids)."""
    from open_instruct.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return [tokenizer.decode(ids) for ids in prompt_ids]


def read_transfer_run(log: str, output: Path) -> TransferRun:
    """The transport the log names, the weight transfers in output/metrics.jsonl and the final greedy eval in
    output/samples.jsonl.

    The eval's answers are kept by prompt: the eval's 16 questions have 13 distinct sums, so matching by ground
    truth compared answers to different questions (identical 0.81 on a working transfer)."""
    announced = [line.split(" over ", 1)[1].split()[0] for line in log.splitlines()
                 if "[vllm] weight transfer:" in line]  # fmt: skip
    steps = [json.loads(line) for line in open(output / "metrics.jsonl")]
    steps = [m for m in steps if "policy_version/learner" in m]
    rows = [json.loads(line) for line in open(output / "samples.jsonl")]
    evals = [r for r in rows if r["table"] == "eval_completions"]
    final_version = max((r["policy_version"] for r in evals), default=None)
    final: dict[str, list[int]] = {}
    for row in evals:
        if row["policy_version"] == final_version:
            if row["prompt"] in final:
                raise ValueError(f"the final eval holds the prompt {row['prompt']!r} twice: the check cannot match it")
            final[row["prompt"]] = row["token_ids"]
    return TransferRun(announced[0] if announced else "no transfer announced",
                       [m["time/weight_broadcast"] for m in steps if "time/weight_broadcast" in m], len(steps),
                       final_version, final)  # fmt: skip


def nccl_transfer(options) -> Row:
    return transfer_run(options, "nccl_transfer", "nccl", [])


def ipc_transfer(options) -> Row:
    return transfer_run(options, "ipc_transfer", "ipc", ["--single_gpu_mode", "true",
                                                         "--vllm_gpu_memory_utilization", "0.3"])  # fmt: skip


def single_gpu_run(options) -> Row:
    """3 steps of the single-GPU debug recipe, in sync mode: a synced engine samples with exactly the weights the
    learner scores with, so the gap it logs is rounding alone, and an engine that kept stale weights shows."""
    from open_instruct.data.embedded import resolve_model_path

    with tempfile.TemporaryDirectory() as folder:
        output = Path(folder) / "output"
        command = TRAINER + ["configs/train_configs/ppo_arithmetic_gpu.yaml", "--model_name_or_path", options.model,
                             "--total_episodes", "384", "--num_evals", "1", "--async_mode", "false",
                             "--learning_rate", SINGLE_GPU_LEARNING_RATE, "--output_dir", str(output)]  # fmt: skip
        process = run_quietly(command, REPO)
        if process.returncode != 0:
            return Row("single_gpu_run", "FAIL", f"exit {process.returncode}", "exit 0",
                       one_line(process.stderr.splitlines()[-1:]))  # fmt: skip
        steps = [json.loads(line) for line in open(output / "metrics.jsonl")]
        steps = [m for m in steps if "policy_version/learner" in m]
        update = relative_update(resolve_model_path(options.model), str(output / "model"))
        return single_gpu_verdict([m.get("debug/vllm_vs_learner_logprob_diff_mean") for m in steps],
                                  [m["time/step"] for m in steps], update, options.model)  # fmt: skip


def relative_update(start: str, saved: str) -> float:
    """||saved - start|| / ||start|| over the saved model's tensors, each start tensor cast to its saved dtype first,
    so that a learner that never updated gives exactly 0 whatever --save_dtype rounded."""
    import torch
    from safetensors.torch import load_file

    def tensors(folder: str) -> dict:
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder} holds no *.safetensors: no saved model to compare")
        return {name: tensor for file in files for name, tensor in load_file(file).items()}

    before, after = tensors(start), tensors(saved)
    if missing := sorted(after.keys() - before.keys()):
        raise ValueError(f"the saved model has tensors the start model lacks ({', '.join(missing[:3])}): other models")
    change = sum((after[n].double() - before[n].to(after[n].dtype).double()).square().sum() for n in after)
    size = sum(before[n].double().square().sum() for n in after)
    return float(torch.sqrt(change / size))


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
    from open_instruct.run.memory_budget import plan_memory
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
    from open_instruct.rewards.manager import RewardManager
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
    parser.add_argument("--cpu-checks", action="store_true",
                        help="where torch sees no GPU, run the checks that need none (else: one line, exit 1)")  # fmt: skip
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
    gpus, torch_build = torch_gpus()
    driver = driver_gpus()
    blind = torch_blind_row(gpus, driver, torch_build)
    if gpus == 0 and blind is None and not options.cpu_checks:
        print(no_gpu_line(driver, torch_build), file=sys.stderr)
        return 1
    print(f"[check_gpu] {gpus} GPU(s) ({driver[1]}); model {options.model}; {len(options.only or CHECKS)} check(s), "
          "each in its own process")  # fmt: skip
    rows = [blind] if blind is not None else []  # whatever --only picked: a table without it would pass
    for check in CHECKS:
        if (options.only and check.name not in options.only) or (blind is not None and check.name == "gpus"):
            continue
        started = time.time()
        if gpus == 0 and not options.cpu_checks:
            rows.append(
                Row(check.name, "SKIP", detail="torch sees no GPU; --cpu-checks runs the checks that need none")
            )
        else:
            rows.append(run_check(check, options, gpus))
        print(f"[check_gpu] {check.name}: {rows[-1].status} ({time.time() - started:.0f}s)", flush=True)
    print(format_table(rows))
    if options.json:
        Path(options.json).write_text(json.dumps([asdict(row) for row in rows], indent=2))
    return 1 if any(row.status == "FAIL" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
