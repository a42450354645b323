"""scripts/check_gpu.sh and scripts/check_gpu.py, as far as a CPU machine can run them: the scripts parse, every GPU
check is skipped with its reason, the table is printed and the exit code says whether anything failed, and the one
check that runs on a CPU too (a PPO step in bf16 vs fp32, on the tiny model) passes within its stated tolerances,
measuring a real difference between the two. The GPU checks themselves run only on a GPU node (docs/gpu_check.md)."""

import importlib.util
import json
import py_compile
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "check_gpu.py"


def load_check_gpu():
    spec = importlib.util.spec_from_file_location("check_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_scripts_parse():
    py_compile.compile(str(SCRIPT), doraise=True)
    assert subprocess.run(["bash", "-n", str(REPO / "scripts" / "check_gpu.sh")]).returncode == 0


def test_every_check_has_a_runner_and_the_list_names_them(capsys):
    check_gpu = load_check_gpu()
    assert [check.name for check in check_gpu.CHECKS] == list(check_gpu.RUNNERS)
    assert check_gpu.main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == list(check_gpu.RUNNERS)


def test_on_a_cpu_machine_the_gpu_checks_are_skipped_with_their_reason_and_bf16_step_passes(tmp_path):
    """The whole script, as check_gpu.sh runs it, on this CPU machine with the tiny model."""
    rows_path = tmp_path / "rows.json"
    process = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--json", str(rows_path)],
                             capture_output=True, text=True, timeout=600, cwd=REPO)  # fmt: skip
    assert process.returncode == 0, process.stderr[-3000:]
    rows = {row["check"]: row for row in json.loads(rows_path.read_text())}
    assert rows["bf16_step"]["status"] == "PASS", rows["bf16_step"]
    # ... and the check compares two different computations: a bf16 run that silently computed in fp32 would pass any
    # tolerance and prove nothing (measured on the tiny model: a gap of 7e-4 nats; its update cosine prints as 1.000).
    gap, cosine = map(float, re.fullmatch(r"logprob gap (\S+), update cosine (\S+)", rows["bf16_step"]["measured"]).groups())
    assert gap > 0, rows["bf16_step"]
    check_gpu = load_check_gpu()  # the verdict on these numbers: within the stated tolerances, not within none
    assert check_gpu.bf16_verdict(gap, cosine) == "PASS"
    check_gpu.BF16_LOGPROB_TOLERANCE, check_gpu.BF16_UPDATE_COSINE = 0.0, 1.0 + 1e-6
    assert check_gpu.bf16_verdict(gap, cosine) == "FAIL"
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
    from open_instruct.run.memory_plan import plan_memory
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
