"""scripts/check_gpu.sh and scripts/check_gpu.py, as far as a CPU machine can run them: the scripts parse; a machine
without a GPU is told so in one line within seconds; a CPU build of torch where the driver lists GPUs (a fake
`nvidia-smi` first on PATH) is a FAIL; with --cpu-checks every GPU check is skipped with its reason, the table is
printed and the exit code says whether anything failed, and the one check that runs on a CPU too (a PPO step in bf16
vs fp32, on the tiny model) passes within its stated tolerances, measuring a real difference between the two. Each GPU
check's verdict is tested on the numbers of a working and of a broken GPU; the GPU checks themselves run only on a GPU
node (docs/gpu_check.md).

Never run check_gpu.sh here with an `nvidia-smi` that lists a GPU: past its first lines it runs scripts/install.sh,
which would install the GPU stack into the environment the tests run from."""

import importlib.util
import json
import os
import py_compile
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.trainer_runs import run_command

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "check_gpu.py"


def load_check_gpu():
    spec = importlib.util.spec_from_file_location("check_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def verdicts():
    """The verdicts module check_gpu.py imports (loaded with it)."""
    load_check_gpu()
    return sys.modules["check_gpu_verdicts"]


def fake_nvidia_smi(folder: Path, listing: str, exit_code: int = 0) -> dict[str, str]:
    """A PATH whose first `nvidia-smi` prints `listing` (as `nvidia-smi -L` would) and exits with `exit_code`."""
    folder.mkdir(exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncat <<'LIST'\n{listing}\nLIST\nexit {exit_code}\n")
    script.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


H100_LISTING = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5f0d3a1c-0d0e-4b1e-9d7a-2a51c9f0e001)"
NO_DEVICES = "No devices were found"  # nvidia-smi -L on a machine with the driver and no GPU (exit 6)
# The driver's device files: where they exist, torch on this machine not seeing a GPU is the failure under test.
HAS_DEVICE_FILES = any(Path("/dev").glob("nvidia[0-9]*"))


def test_the_scripts_parse():
    py_compile.compile(str(SCRIPT), doraise=True)
    py_compile.compile(str(REPO / "scripts" / "check_gpu_verdicts.py"), doraise=True)
    assert subprocess.run(["bash", "-n", str(REPO / "scripts" / "check_gpu.sh")]).returncode == 0


def test_every_check_has_a_runner_and_the_list_names_them(capsys):
    check_gpu = load_check_gpu()
    assert [check.name for check in check_gpu.CHECKS] == list(check_gpu.RUNNERS)
    assert check_gpu.main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == list(check_gpu.RUNNERS)


@pytest.mark.skipif(HAS_DEVICE_FILES, reason="this machine has NVIDIA device files: not a machine without a GPU")
@pytest.mark.parametrize("script", ["check_gpu.sh", "check_gpu.py"])
def test_a_machine_without_a_gpu_is_told_so_in_one_line_within_seconds(script, tmp_path):
    """No GPU at all (nvidia-smi: "No devices were found", torch sees none): one line, exit 1, and no check runs (the
    CPU-side bf16 step took over 5 minutes on an AVX2-only CPU); --cpu-checks asks for those."""
    command = ["bash", str(REPO / "scripts" / script)] if script.endswith(".sh") else [sys.executable, str(SCRIPT)]
    started = time.time()
    process = subprocess.run(command, cwd=tmp_path, env={**os.environ, **fake_nvidia_smi(tmp_path / "bin", NO_DEVICES, 6)},
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    seconds = time.time() - started
    assert process.returncode == 1, (process.returncode, process.stdout[-2000:], process.stderr[-2000:])
    assert process.stdout == "" and len(process.stderr.splitlines()) == 1, process.stderr
    assert process.stderr.startswith("[check_gpu] no GPU on this machine (") and "--cpu-checks" in process.stderr
    assert seconds < (10 if script.endswith(".sh") else 60), seconds  # the script alone; python's is torch's import


def test_a_cpu_torch_where_the_driver_lists_gpus_fails(tmp_path, monkeypatch, capsys):
    """A CPU wheel of torch on a GPU node (this machine's torch, a fake nvidia-smi listing an H100): every GPU check
    would SKIP, so the `gpus` row FAILs and the exit code is 1, also where --only picked other checks."""
    check_gpu = load_check_gpu()
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "bin", H100_LISTING)["PATH"])
    if check_gpu.torch_gpus()[0] > 0:
        pytest.skip("torch sees a GPU here")
    for only in ([], ["--only", "bf16_step", "cuda_graphs"]):
        rows_path = tmp_path / "rows.json"
        assert check_gpu.main([*only, "--json", str(rows_path)]) == 1
        rows = {row["check"]: row for row in json.loads(rows_path.read_text())}
        assert rows["gpus"]["status"] == "FAIL", rows
        assert rows["gpus"]["measured"] == "torch sees 0 GPUs; nvidia-smi -L lists 1", rows["gpus"]
        assert "a CPU-only build" in rows["gpus"]["detail"] or "CUDA" in rows["gpus"]["detail"], rows["gpus"]
        assert all(row["status"] == "SKIP" for name, row in rows.items() if name != "gpus"), rows
        assert len(rows) == (len(check_gpu.CHECKS) if not only else 3), rows
    assert "| gpus | FAIL | torch sees 0 GPUs; nvidia-smi -L lists 1 |" in capsys.readouterr().out


def test_the_drivers_listing_is_read_line_by_line():
    listed_gpus = verdicts().listed_gpus
    mig = f"{H100_LISTING}\n  MIG 1g.10gb     Device  0: (UUID: MIG-aa)\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-b)\n"
    assert [listed_gpus(text) for text in (H100_LISTING, mig, NO_DEVICES, "")] == [1, 2, 0, 0]


@pytest.mark.parametrize("torch_count, listed, fails", [(0, 1, True), (0, 0, False), (1, 1, False), (2, 8, False),
                                                        (1, 0, False)])  # fmt: skip
def test_only_a_driver_with_gpus_torch_cannot_see_is_a_failed_gpus_row(torch_count, listed, fails):
    """Torch seeing fewer GPUs than the driver is CUDA_VISIBLE_DEVICES at work, and a driver that lists none where
    torch sees one is a container without nvidia-smi: only torch seeing none of the driver's GPUs fails."""
    row = verdicts().torch_blind_row(torch_count, (listed, f"nvidia-smi -L lists {listed}"), "torch 2.13.0+cpu")
    assert (row is not None and row.status == "FAIL") == fails, row


@pytest.mark.skipif(HAS_DEVICE_FILES, reason="this machine has NVIDIA device files: not a machine without a GPU")
def test_with_cpu_checks_the_gpu_checks_are_skipped_with_their_reason_and_bf16_step_passes(tmp_path):
    """The whole script, as check_gpu.sh runs it with --cpu-checks, on this CPU machine with the tiny model."""
    rows_path = tmp_path / "rows.json"
    process, _ = run_command([sys.executable, str(SCRIPT), "--cpu-checks", "--model", "tiny", "--json", str(rows_path)],
                             REPO, env=fake_nvidia_smi(tmp_path / "bin", NO_DEVICES, 6), timeout_s=600)  # fmt: skip
    assert process.returncode == 0, process.stderr[-3000:]
    rows = {row["check"]: row for row in json.loads(rows_path.read_text())}
    assert rows["bf16_step"]["status"] == "PASS", rows["bf16_step"]
    # ... and the check compares two different computations: a bf16 run that silently computed in fp32 would pass any
    # tolerance and prove nothing (measured on the tiny model: a gap of 7e-4 nats; its update cosine prints as 1.000).
    gap, cosine = map(
        float, re.fullmatch(r"logprob gap (\S+), update cosine (\S+)", rows["bf16_step"]["measured"]).groups()
    )
    assert gap > 0, rows["bf16_step"]
    judge = verdicts()  # the verdict on these numbers: within the stated tolerances, not within none
    assert judge.bf16_verdict(gap, cosine) == "PASS"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(judge, "BF16_LOGPROB_TOLERANCE", 0.0)
        patch.setattr(judge, "BF16_UPDATE_COSINE", 1.0 + 1e-6)
        assert judge.bf16_verdict(gap, cosine) == "FAIL"
    for name in ("gpus", "cuda_graphs", "nccl_transfer", "ipc_transfer", "single_gpu_run", "memory_plan"):
        assert rows[name]["status"] == "SKIP" and "this machine has 0" in rows[name]["detail"], rows[name]
    assert "| bf16_step | PASS | logprob gap " in process.stdout  # the table on stdout


def test_a_check_that_crashes_is_a_failed_row_and_the_exit_code_says_so(monkeypatch, capsys):
    check_gpu = load_check_gpu()
    broken = check_gpu.Check("bf16_step", 0, "")
    options = type("Options", (), {"model": "/no/such/model"})()
    row = check_gpu.run_check(broken, options, gpus=0)
    assert row.status == "FAIL" and "bf16_step failed (exit 1)" in row.detail, row
    table = check_gpu.format_table([row, check_gpu.Row("gpus", "SKIP", detail="needs 1 GPU(s)")])
    assert table.splitlines()[0] == "| check | result | measured | tolerance | detail |"


@pytest.mark.parametrize("needs, has, skipped", [(2, 1, True), (1, 1, False), (0, 0, False)])
def test_a_check_runs_only_where_its_gpus_are(needs, has, skipped, monkeypatch):
    check_gpu = load_check_gpu()
    ran = []
    monkeypatch.setattr(check_gpu, "run_quietly", lambda command, cwd, env=None: ran.append(command) or
                        subprocess.CompletedProcess(command, 0, json.dumps({"check": "x", "status": "PASS"}), ""))  # fmt: skip
    row = check_gpu.run_check(check_gpu.Check("x", needs, ""), type("O", (), {"model": "tiny"})(), gpus=has)
    assert (row.status == "SKIP") == skipped and bool(ran) != skipped


def test_the_memory_plan_check_plans_its_gpu_step_offline_and_judges_within_its_tolerance():
    """The GPU check's own plan (its flags, the embedded model's config, a GPU device) is computed here without a GPU,
    and the verdict passes a plan within MEMORY_PLAN_TOLERANCE of the measured peak only."""
    from open_instruct.data.embedded import resolve_model_path
    from open_instruct.data.tokenizer import load_tokenizer
    from open_instruct.run.args import parse_args
    from open_instruct.run.memory_budget import plan_memory
    from open_instruct.run.model_shapes import run_model_shapes

    check_gpu = load_check_gpu()
    path = resolve_model_path("embedded")
    prompts, completions = check_gpu.synthetic_rollout(load_tokenizer(path), 8, 512)
    assert [len(c.token_ids) for c in completions] == [512] * 8
    args = parse_args(["--model_name_or_path", path, "--per_device_train_batch_size", "4", "--response_length", "512",
                       "--max_token_length", "640", "--max_prompt_token_length", "128", "--beta", "0.05"])  # fmt: skip
    plan = plan_memory(args, run_model_shapes(args), "gpu", None, max(len(ids) for ids in prompts.token_ids))
    assert 1e9 < plan.peak < 20e9, plan.peak
    tolerance = check_gpu.MEMORY_PLAN_TOLERANCE
    assert check_gpu.memory_plan_verdict(plan.peak, plan.peak * (1 + tolerance * 0.9)) == "PASS"
    assert check_gpu.memory_plan_verdict(plan.peak, plan.peak / (1 + tolerance * 1.5)) == "FAIL"


# ---- the verdicts of the GPU checks, on hand-made run folders (what a working and a broken run leave) ----------------

TRANSFER_LOG = ("[vllm] weight transfer: learner rank 0 -> 1 engine worker(s) over {transport} (auto: ...), 257 MB in "
                "bfloat16 (0.4s to set up)\n")  # fmt: skip


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def transfer_run_folder(folder: Path, check_gpu, steps: int = 2, eval_version: int = 2) -> dict:
    """What a 2-step transfer run leaves (metrics.jsonl, samples.jsonl with the final eval of the check's 16
    questions), and what a fresh engine on its saved model answers, prompt by prompt (token ids, logprobs): the run's
    answer, stopped at EOS, then more tokens (the fresh engine runs on to max_tokens). Each question has its own answer;
    the questions whose sums coincide (6 + 2 and 1 + 7, ...) answer differently, as the model reads the numbers."""
    folder.mkdir()
    write_jsonl(folder / "metrics.jsonl", [{"policy_version/learner": step, "time/weight_broadcast": 0.4,
                                            "time/step": 9.0} for step in range(steps)])  # fmt: skip
    rows, fresh = [], {}
    for a, b in check_gpu.QUESTIONS:
        prompt = f"<|im_start|>user\n{check_gpu.question(a, b)}<|im_end|>\n<|im_start|>assistant\n"
        answer = [100 + a, 200 + b, 2]  # ... ending in EOS
        rows.append({"step": steps, "table": "eval_completions", "policy_version": eval_version, "prompt": prompt,
                     "ground_truth": str(a + b), "response": "...", "token_ids": answer})  # fmt: skip
        fresh[prompt] = (answer + [7, 7, 7], [-0.5, -0.25, -0.1, -1.0, -1.0, -1.0])
    rows.insert(0, {**rows[0], "policy_version": 0, "token_ids": [1]})  # an earlier eval, other weights
    write_jsonl(folder / "samples.jsonl", rows)
    return fresh


def stale_answers(fresh: dict, changed: int) -> dict:
    """A stale engine's answers (the start model): logprobs 0.3 nats from the fresh engine's on the same tokens, and
    on the first `changed` prompts another second token (the update changed those greedy answers)."""
    stale = {}
    for number, (prompt, (tokens, logprobs)) in enumerate(fresh.items()):
        tokens = [tokens[0], 999, *tokens[2:]] if number < changed else list(tokens)
        stale[prompt] = (tokens, [x - 0.3 for x in logprobs])
    return stale


def transfer_verdict(name: str, transport: str, log_transport: str, output: Path, fresh: dict, stale: dict):
    check_gpu = load_check_gpu()
    run = check_gpu.read_transfer_run(TRANSFER_LOG.format(transport=log_transport) if log_transport else "", output)
    return check_gpu.transfer_verdict(name, transport, run, fresh, stale)


def test_the_eval_questions_share_sums_so_answers_are_matched_by_prompt():
    sums = [a + b for a, b in load_check_gpu().QUESTIONS]
    assert len(sums) == 16 and len(set(sums)) == 13  # matched by ground truth, 3 answers went to other questions


@pytest.mark.parametrize("name, transport", [("nccl_transfer", "nccl"), ("ipc_transfer", "ipc")])
def test_a_working_transfer_passes(name, transport, tmp_path):
    """The run's eval is the fresh engine's on every prompt, and the stale engine's on 11 only."""
    fresh = transfer_run_folder(tmp_path / "output", load_check_gpu())
    row = transfer_verdict(name, transport, transport, tmp_path / "output", fresh, stale_answers(fresh, changed=5))
    assert (row.status, row.measured) == ("PASS", f"{transport}, identical 1.00, unlike stale 5/16, stale gap 0.3000")


def test_a_transfer_that_lost_weights_fails(tmp_path):
    """The fresh engine on the saved model answers one question differently from the run's engine: the weights the run's
    engine held were not the ones saved."""
    fresh = transfer_run_folder(tmp_path / "output", load_check_gpu())
    stale = stale_answers(fresh, changed=5)
    prompt = list(fresh)[-1]
    fresh[prompt] = ([999, *fresh[prompt][0][1:]], fresh[prompt][1])
    row = transfer_verdict("nccl_transfer", "nccl", "nccl", tmp_path / "output", fresh, stale)
    assert (row.status, row.measured) == ("FAIL", "nccl, identical 0.94, unlike stale 5/16, stale gap 0.3000"), row


@pytest.mark.parametrize("update_changed_answers", [True, False])
def test_a_transfer_that_did_nothing_fails(update_changed_answers, tmp_path):
    """The run's engine kept the start weights, so its eval is the stale engine's. Where the update changed greedy
    answers, the fresh engine's differ from the run's; where it changed none (a small update: logprobs 0.3 nats away,
    the same tokens), the run's eval matches the fresh engine's on every prompt, as a working transfer's does: only
    the stale engine tells them apart."""
    check_gpu = load_check_gpu()
    fresh = transfer_run_folder(tmp_path / "output", check_gpu)
    stale = stale_answers(fresh, changed=5 if update_changed_answers else 0)
    rows = [json.loads(line) for line in open(tmp_path / "output" / "samples.jsonl")]
    for row in rows[1:]:  # the final eval, on the start weights: the stale answers, stopped at EOS
        row["token_ids"] = stale[row["prompt"]][0][:3]
    write_jsonl(tmp_path / "output" / "samples.jsonl", rows)
    row = transfer_verdict("ipc_transfer", "ipc", "ipc", tmp_path / "output", fresh, stale)
    assert row.status == "FAIL", row
    if update_changed_answers:
        assert row.measured == "ipc, identical 0.69, unlike stale 0/16, stale gap 0.3000", row
    else:
        assert row.measured == "ipc, identical 1.00, unlike stale 0/16, stale gap 0.3000", row
        assert row.detail.startswith("the run's eval is the start model's"), row


def test_a_transfer_over_another_transport_fails(tmp_path):
    """--single_gpu_mode runs whose weights went over gloo (or any other transport) prove nothing about IPC."""
    fresh = transfer_run_folder(tmp_path / "output", load_check_gpu())
    stale = stale_answers(fresh, changed=5)
    row = transfer_verdict("ipc_transfer", "ipc", "gloo", tmp_path / "output", fresh, stale)
    assert (row.status, row.measured) == ("FAIL", "gloo, not ipc"), row
    row = transfer_verdict("ipc_transfer", "ipc", "", tmp_path / "output", fresh, stale)
    assert (row.status, row.measured) == ("FAIL", "no transfer announced, not ipc"), row


def test_a_transfer_run_whose_final_eval_is_not_on_the_last_weights_fails(tmp_path):
    fresh = transfer_run_folder(tmp_path / "output", load_check_gpu(), eval_version=1)
    row = transfer_verdict("nccl_transfer", "nccl", "nccl", tmp_path / "output", fresh, stale_answers(fresh, 5))
    assert (row.status, row.measured) == ("FAIL", "2 transfer(s), final eval at version 1"), row


WORKING_SYNC_GAPS = [0.031, 0.036, 0.039]  # bf16 rounding (docs/ppo_details.md: 0.026-0.039)
# An engine that missed updates, yet under the run's own guard (--max_vllm_logprob_diff 0.5), so the run exits 0: the
# old check passed it. Measured at the check's settings: one missed update gave 0.57 (stale_weights_gap.py).
STALE_SYNC_GAPS = [0.031, 0.25, 0.45]
SECONDS = [30.0, 11.0, 12.0]  # the first step compiles and warms up: left out of s/step
WORKING_UPDATE = 2.7e-3  # RELATIVE_UPDATE_MEASURED below


def test_a_single_gpu_run_whose_engine_follows_the_learner_passes():
    """Sync mode with working syncs: the gap is rounding alone (bf16 engine and learner: docs/ppo_details.md measured
    0.026-0.039 nats per token for a bf16 engine against an fp32 learner), and the weights moved."""
    row = load_check_gpu().single_gpu_verdict(WORKING_SYNC_GAPS, SECONDS, WORKING_UPDATE, "embedded")
    assert row.status == "PASS", row
    assert row.measured == "11.5 s/step, logprob gap 0.0310, 0.0360, 0.0390, update 2.70e-03"


def test_a_single_gpu_run_whose_engine_kept_stale_weights_fails():
    """Exit 0, but the engine samples from other weights than the learner's: from step 2 its gap is the policy change
    it missed (scripts/benchmark/stale_weights_gap.py: 0.57 for one whole update at the check's settings)."""
    row = load_check_gpu().single_gpu_verdict(STALE_SYNC_GAPS, SECONDS, WORKING_UPDATE, "embedded")
    assert row.status == "FAIL" and "step 3's engine samples from other weights" in row.detail, row


def test_a_single_gpu_run_whose_learner_never_updates_fails():
    """A learner that never applies an update, and an engine that follows it faithfully: the gap is rounding, as a
    working pair's, and only the saved weights, still the start's, show it."""
    row = load_check_gpu().single_gpu_verdict([0.031, 0.030, 0.032], SECONDS, 0.0, "embedded")
    assert row.status == "FAIL" and row.detail.endswith(
        "the learner's weights did not move: it never applied an update"
    )


def test_a_single_gpu_run_that_ended_early_fails():
    row = load_check_gpu().single_gpu_verdict(WORKING_SYNC_GAPS[:2], SECONDS[:2], WORKING_UPDATE, "embedded")
    assert row.status == "FAIL" and row.measured.startswith("2 steps"), row


@pytest.mark.parametrize("save_dtype", ["float32", "bfloat16"])
def test_the_update_is_measured_between_the_saved_and_the_start_model(save_dtype, tmp_path):
    """relative_update on real model files (the tiny model's, stored in bf16; the trainer saves --save_dtype): the start
    saved again in either dtype, as a learner that never updated saves it, is exactly 0; every weight moved by 1% of
    itself (a change bf16 holds) reads 1e-2, above MIN_RELATIVE_UPDATE."""
    import torch
    from safetensors.torch import load_file, save_file

    from open_instruct.data.embedded import resolve_model_path

    check_gpu = load_check_gpu()
    start = resolve_model_path("tiny")
    weights = {
        name: t.to(getattr(torch, save_dtype)) for name, t in load_file(Path(start) / "model.safetensors").items()
    }
    for folder, change in (("same", 0.0), ("moved", 1e-2)):
        (tmp_path / folder).mkdir()
        signs = {name: torch.randint(0, 2, t.shape, generator=torch.Generator().manual_seed(0)) * 2 - 1
                 for name, t in weights.items()}  # fmt: skip
        save_file({name: (t.float() * (1 + change * signs[name])).to(t.dtype) for name, t in weights.items()},
                  tmp_path / folder / "model.safetensors")  # fmt: skip
    assert check_gpu.relative_update(start, str(tmp_path / "same")) == 0.0
    moved = check_gpu.relative_update(start, str(tmp_path / "moved"))
    assert verdicts().MIN_RELATIVE_UPDATE < moved == pytest.approx(1e-2, rel=0.02), moved


def test_the_memory_plan_check_plans_the_learner_without_the_engine_it_never_makes():
    """The check measures a learner process that holds no vLLM engine: its plan has no engine share and no policy copies
    for one (they were 4 bytes a parameter over the measured step: 0.54 GB of the embedded model's plan)."""
    from open_instruct.data.embedded import resolve_model_path
    from open_instruct.run.memory_budget import plan_memory
    from open_instruct.run.model_shapes import run_model_shapes

    check_gpu = load_check_gpu()
    args = check_gpu.memory_plan_args(resolve_model_path("embedded"))
    plan = check_gpu.planned_learner_step(args, 40)
    assert not [item.name for item in plan.items if "engine" in item.name or "weight sync" in item.name]
    with_engine = plan_memory(args, run_model_shapes(args), "gpu", None, 40)
    copies = next(item for item in with_engine.items if item.name.startswith("policy copies for the engine"))
    assert with_engine.steady - plan.steady == pytest.approx(copies.steady * 1.05)  # + the allocator's slack on them


def test_the_fresh_engines_prompts_are_the_trainers_eval_prompts_text_for_text(tmp_path):
    """transfer_verdict matches the fresh engine's answers to the run's by prompt text: the check's own prompt ids,
    decoded, must be the texts the trainer writes in samples.jsonl for its eval file (built here as the trainer builds
    them, from the same file transfer_run writes)."""
    from open_instruct.data.batches import prompt_batch
    from open_instruct.data.embedded import resolve_model_path
    from open_instruct.data.prompt_dataset import build_prompt_datasets
    from open_instruct.data.tokenizer import load_tokenizer
    from open_instruct.run.args import parse_args

    check_gpu = load_check_gpu()
    model = resolve_model_path("embedded")
    eval_path = tmp_path / "eval.jsonl"
    write_jsonl(eval_path, [{"messages": [{"role": "user", "content": check_gpu.question(a, b)}],
                             "ground_truth": str(a + b), "dataset": "arithmetic"} for a, b in check_gpu.QUESTIONS])  # fmt: skip
    args = parse_args(["--model_name_or_path", model, "--dataset_mixer_eval_list", str(eval_path), "1.0",
                       "--dataset_cache_dir", str(tmp_path / "cache")])  # fmt: skip
    tokenizer = load_tokenizer(model)
    _, evaluation = build_prompt_datasets(args.data, tokenizer)
    trainer_texts = prompt_batch(evaluation, list(range(len(evaluation))), tokenizer).texts
    check_texts = check_gpu.prompt_texts(model, check_gpu.eval_prompt_ids(model))
    assert sorted(trainer_texts) == sorted(check_texts) and len(set(check_texts)) == len(check_gpu.QUESTIONS)


def engine_output(check_gpu, first_token: int, logprob: float) -> dict:
    """An engine job's output for the check's 16 questions: 3 greedy tokens each, with their logprobs."""
    return {"token_ids": [[first_token + q, 5, 6] for q in range(len(check_gpu.QUESTIONS))],
            "logprobs": [[logprob, -0.5, -0.25] for _ in check_gpu.QUESTIONS]}  # fmt: skip


def test_cuda_graphs_that_follow_a_weight_load_pass_and_graphs_left_on_the_old_weights_fail():
    check_gpu = load_check_gpu()
    model_a, model_b = engine_output(check_gpu, 100, -1.0), engine_output(check_gpu, 200, -2.0)
    eager_b = engine_output(check_gpu, 200, -2.01)  # eager kernels sum in another order: a small gap
    row = check_gpu.cuda_graphs_verdict(model_b, model_a, model_b, eager_b)
    assert (row.status, row.measured) == ("PASS", "identical 1.00, eager gap 0.0033"), row
    # The graphs replay what they captured from A: the reload did not reach them.
    row = check_gpu.cuda_graphs_verdict(model_a, model_a, model_b, eager_b)
    assert row.status == "FAIL" and row.detail == "the load changed nothing: the comparison proves nothing", row
    # B's tokens, but logprobs far from an eager engine's on B (e.g. half the layers still A's).
    row = check_gpu.cuda_graphs_verdict(engine_output(check_gpu, 200, -1.5), model_a, model_b, eager_b)
    assert (row.status, row.measured) == ("FAIL", "identical 1.00, eager gap 0.1700"), row
