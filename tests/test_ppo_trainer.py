"""End-to-end runs of the PPO trainer on the tiny model: real vLLM engine, learner, queues, files, Hub push.

Every run is a subprocess with a timeout (tests/support/trainer_runs.py). Runs are few (30-60 s each on 2 CPU
cores) and shared through module-scoped fixtures:

- `async_run`: the default asynchronous mode, 4 steps.
- `sync_run`: `--async_mode false`, 3 steps at a high learning rate, pushing to a local fake Hub, with wandb
  tracking in offline mode, and a tight `--max_vllm_logprob_diff`: the run itself checks every step that the
  engine samples from exactly the learner's weights.
- two fault runs (tests/support/inject_fault.py): a crash in the generation thread, and a weight sync that loads nothing.

The argument parsing and batch-size checks at the end run in-process: they load no model.
"""

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from open_instruct.generation.vllm_engine import engine_dtype
from open_instruct.ppo_vllm_thread_ray_gtrl import main
from open_instruct.run.args import compute_batch_sizes, parse_args
from open_instruct.run.plots import read_histograms
from open_instruct.run.tracking import read_metrics
from tests.support.fake_hub import FakeHub
from tests.support.trainer_runs import (
    EVAL_QUESTIONS,
    FP32_LEARNER,
    ROLLOUT_BATCH_SIZE,
    RUN_TIMEOUT_S,
    SMALL_RUN,
    STEP_METRICS,
    SYNC_MAX_LOGPROB_DIFF,
    TESTS_DIR,
    TRAINER,
    Run,
    assert_saved_weights_are_the_learners,
    eval_messages,
    explain_mismatch,
    fresh_engine_greedy,
    hf_greedy,
    is_finite_number,
    last_lines,
    run_command,
    run_to_completion,
)

HUB_USER, HUB_REPO, HUB_TOKEN = "test-user", "tiny-ppo", "hf_fake_token_for_tests"


@pytest.fixture(scope="module")
def async_run(tiny_model_dir, eval_file, tmp_path_factory) -> Run:
    workdir = tmp_path_factory.mktemp("async_run")
    command = TRAINER + [
        "--model_name_or_path", tiny_model_dir,
        "--total_episodes", "32",
        "--num_evals", "2",
        "--eval_samples_per_prompt", "3",
        "--mid_run_eval_samples_per_prompt", "1",
        "--dataset_mixer_eval_list", str(eval_file), "1.0",
        "--output_dir", str(workdir / "output"),
        *SMALL_RUN,
    ]  # fmt: skip
    run_to_completion(command, cwd=workdir)
    return Run(workdir / "output", num_steps=4, async_mode=True)


@dataclass
class SyncRun:
    run: Run
    hub: FakeHub  # stopped after the run; what it received stays readable
    hub_endpoint: str
    workdir: Path


@pytest.fixture(scope="module")
def sync_run(tiny_model_dir, eval_file, tmp_path_factory) -> SyncRun:
    workdir = tmp_path_factory.mktemp("sync_run")
    with FakeHub(user=HUB_USER) as hub:
        command = TRAINER + [
            "--model_name_or_path", tiny_model_dir,
            "--async_mode", "false",
            "--total_episodes", "24",
            # Far above a real run's learning rate: 3 steps must change the tiny model's greedy output, so that
            # comparing vLLM with the learner would catch an engine left on stale weights.
            "--learning_rate", "1e-2",
            "--lr_scheduler_type", "constant",
            "--num_evals", "1",
            "--dataset_mixer_eval_list", str(eval_file), "1.0",
            "--output_dir", str(workdir / "output"),
            "--max_vllm_logprob_diff", str(SYNC_MAX_LOGPROB_DIFF),
            *FP32_LEARNER,
            "--with_tracking", "true",
            "--push_to_hub", "true",
            "--hf_endpoint", hub.endpoint,
            "--hf_entity", HUB_USER,
            "--hf_repo_id", HUB_REPO,
            *SMALL_RUN,
        ]  # fmt: skip
        env = {"HF_HUB_OFFLINE": "0", "HF_TOKEN": HUB_TOKEN, "WANDB_DIR": str(workdir)}
        run_to_completion(command, cwd=workdir, env=env)
        endpoint = hub.endpoint
    return SyncRun(Run(workdir / "output", num_steps=3, async_mode=False), hub, endpoint, workdir)


# ---- 1. every step is logged, finite, with the right policy versions -----------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("run_fixture", ["async_run", "sync_run"])
def test_every_step_logs_finite_metrics_and_the_expected_policy_versions(run_fixture, request):
    fixture = request.getfixturevalue(run_fixture)
    run = fixture.run if isinstance(fixture, SyncRun) else fixture
    lines = run.step_lines()
    assert [line["step"] for line in lines] == list(range(1, run.num_steps + 1))
    for plot in ("training_curves.png", "correct_rate_vs_time.png", "length_histograms.png"):
        assert (run.output_dir / plot).stat().st_size > 10_000, plot
    # Prompt lengths once (the dataset), response lengths at every step: one per response.
    histograms = read_histograms(str(run.output_dir / "lengths.jsonl"))
    assert [step for step, _ in histograms["lengths/prompt_tokens"]] == [0]
    assert [step for step, _ in histograms["lengths/response_tokens"]] == list(range(1, run.num_steps + 1))
    assert all(len(values) == ROLLOUT_BATCH_SIZE for _, values in histograms["lengths/response_tokens"])
    for line in lines:
        step = line["step"]
        missing = [key for key in STEP_METRICS if key not in line]
        assert not missing, f"step {step} did not log {missing}"
        not_finite = {key: line[key] for key in STEP_METRICS if not is_finite_number(line[key])}
        assert not not_finite, f"step {step} logged non-finite metrics {not_finite}"
        # The learner trains policy step-1 into policy step; async trains on data one version older than sync.
        assert line["policy_version/learner"] == step - 1
        expected_rollout_version = max(0, step - 2) if run.async_mode else step - 1
        assert line["policy_version/rollout"] == expected_rollout_version, f"step {step}"
        assert line["episode"] == step * ROLLOUT_BATCH_SIZE
        # Version 0 is the engine's own start; every later version was loaded into the engine first.
        loaded_weights = line["policy_version/rollout"] > 0
        assert (line["time/weight_sync"] > 0) == loaded_weights, f"step {step}: {line['time/weight_sync']}"
        assert line["time/generation"] > 0 and line["time/training"] > 0
        # The learner's work: the rollout's real tokens (its responses' at least) went through the learner
        # in at most the scoring and training time; some slots are padding, never all; the useful FLOP/s are a
        # fraction of the measured peak (a tiny model on a CPU: far below it, but not nothing).
        response_tokens = sum(dict(histograms["lengths/response_tokens"])[step])
        learner_seconds = line["time/scoring"] + line["time/training"]
        assert line["perf/tokens_per_second"] >= response_tokens / learner_seconds, f"step {step}"
        assert 0.0 <= line["perf/padding_fraction"] < 0.9, f"step {step}"
        assert 1e-6 < line["perf/learner_flops_utilization"] < 1.0, f"step {step}"
        # The value loss is logged as is; the objective weights it by --vf_coef (0.1 by default).
        assert line["objective/loss"] == pytest.approx(line["loss/policy_avg"] + 0.1 * line["loss/value_avg"], abs=1e-5)
    assert all(a["time/from_scratch"] < b["time/from_scratch"] for a, b in zip(lines, lines[1:]))

    # Evals: the first of the initial policy at step 1, the last of the final policy, at the last step.
    evals = [line for line in run.metrics() if "eval/policy_version" in line]
    assert evals[0]["step"] == 1 and evals[0]["eval/policy_version"] == 0
    assert evals[-1]["step"] == run.num_steps and evals[-1]["eval/policy_version"] == run.num_steps
    assert all(is_finite_number(line["eval/correct_rate"]) for line in evals)
    assert all(0.0 <= line["eval/sampled_correct_rate"] <= 1.0 for line in evals)
    assert len(run.eval_rows(policy_version=run.num_steps)) == len(EVAL_QUESTIONS)
    if run.async_mode:  # 4 steps, --num_evals 2: the first and final evals sample 3 a prompt, the one between 1
        assert [(e["eval/policy_version"], e["eval/samples_per_prompt"]) for e in evals] == [(0, 3), (2, 1), (4, 3)]


# ---- 2. after a weight sync, vLLM generates exactly what the learner's weights do ------------------------------------


def rows_by_ground_truth(rows: list[dict]) -> dict[str, dict]:
    return {row["ground_truth"]: row for row in rows}


@pytest.mark.e2e
def test_after_a_weight_sync_vllm_generates_what_the_learner_weights_generate(sync_run, eval_file, tiny_model_dir):
    """The final eval is generated by vLLM right after it loaded the final learner weights (in the engine's dtype:
    fp32 on CPUs); the saved model run greedily by transformers in that dtype must produce the same tokens on every
    eval prompt."""
    run = sync_run.run
    final_rows = run.eval_rows(policy_version=run.num_steps)
    assert sorted(row["ground_truth"] for row in final_rows) == sorted(str(a + b) for a, b in EVAL_QUESTIONS)
    messages = eval_messages(eval_file)
    tokenizer = AutoTokenizer.from_pretrained(run.model_dir)
    prompts = {
        truth: tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
        for truth, chat in messages.items()
    }
    dtype = getattr(torch, engine_dtype())
    final_model = AutoModelForCausalLM.from_pretrained(run.model_dir, dtype=dtype)
    for row in final_rows:
        learner_ids = hf_greedy(final_model, tokenizer, prompts[row["ground_truth"]])
        assert row["token_ids"] == learner_ids, explain_mismatch(
            final_model, tokenizer, prompts[row["ground_truth"]], row["token_ids"], learner_ids
        )

    # Not trivially true: the run trained every weight, and the initial weights greedily generate something else,
    # which is what the engine did generate at version 0, before any sync.
    initial_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    initial_params = dict(initial_model.named_parameters())
    unchanged = [name for name, p in final_model.named_parameters() if torch.equal(p, initial_params[name])]
    assert not unchanged, f"training left these weights unchanged: {unchanged}"
    first_rows = rows_by_ground_truth(run.eval_rows(policy_version=0))
    for row in final_rows:
        initial_ids = hf_greedy(initial_model, tokenizer, prompts[row["ground_truth"]])
        assert initial_ids != row["token_ids"], "training did not change the greedy output; the check proves nothing"
        assert first_rows[row["ground_truth"]]["token_ids"] == initial_ids


# ---- 3. what the user keeps: the saved folder is the trained model -------------------------------------------------


@pytest.mark.e2e
def test_sync_run_engine_sampled_from_exactly_the_learner_weights_at_every_step(sync_run):
    """The run enforced it (`--max_vllm_logprob_diff`); check the logged agreement as a user would read it."""
    lines = sync_run.run.step_lines()
    assert [line["debug/vllm_vs_learner_logprob_diff_mean"] < SYNC_MAX_LOGPROB_DIFF / 10 for line in lines] == [True] * 3
    assert all(abs(line["debug/vllm_vs_learner_ratio_mean"] - 1) < 1e-3 for line in lines)


@pytest.mark.e2e
@pytest.mark.parametrize("run_fixture", ["async_run", "sync_run"])
def test_saved_folder_holds_the_trained_weights_and_a_fresh_engine_reproduces_the_final_eval(
    run_fixture, request, eval_file, tmp_path
):
    """What a user keeps is what the run trained: the folder holds the learner's fp32 weights (the digest the run
    computed from its in-memory policy equals the file's), and a fresh vLLM engine on the folder, in the learner's
    dtype, generates exactly the run's final eval (the engine that made it had received those weights by sync)."""
    fixture = request.getfixturevalue(run_fixture)
    run = fixture.run if isinstance(fixture, SyncRun) else fixture
    model_dir = run.model_dir
    assert_saved_weights_are_the_learners(run.output_dir)

    final_rows = run.eval_rows(policy_version=run.num_steps)
    _, reloaded_ids = fresh_engine_greedy(model_dir, eval_file, final_rows, tmp_path)
    assert reloaded_ids == [row["token_ids"] for row in final_rows]


@pytest.mark.e2e
def test_saved_model_folder_loads_with_its_tokenizer_config_and_args(sync_run, tiny_model_dir):
    model_dir = sync_run.run.model_dir
    _, loading_info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not loading_info["missing_keys"] and not loading_info["unexpected_keys"], loading_info
    config = AutoConfig.from_pretrained(model_dir)
    assert config.architectures == ["LlamaForCausalLM"] and config.tie_word_embeddings
    tokenizer, base_tokenizer = AutoTokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.get_vocab() == base_tokenizer.get_vocab()
    assert tokenizer.chat_template and tokenizer.chat_template == base_tokenizer.chat_template
    generation_config = GenerationConfig.from_pretrained(model_dir)
    assert generation_config.eos_token_id == tokenizer.eos_token_id
    with open(model_dir / "open_instruct_args.json") as f:
        saved_args = json.load(f)
    assert saved_args["learning_rate"] == 1e-2 and saved_args["async_mode"] is False
    assert saved_args["save_dtype"] == "float32"


# ---- 4. faults end the run with their cause ---------------------------------------------------------------


def run_with_fault(fault: str, tiny_model_dir: str, tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, float]:
    command = [
        sys.executable, str(TESTS_DIR / "support" / "inject_fault.py"), fault,
        "--model_name_or_path", tiny_model_dir,
        "--output_dir", str(tmp_path / "output"),
        *SMALL_RUN, *flags,
    ]  # fmt: skip
    return run_command(command, cwd=tmp_path)


@pytest.mark.e2e
def test_generation_thread_crash_ends_the_run_with_its_cause(tiny_model_dir, tmp_path):
    """The generation thread fails at its second vLLM call; the run must exit non-zero, name the cause, not hang
    (the learner's queue timeout stays at its 30-minute default), leave no final model, and say in summary.json
    that the run failed and why."""
    process, seconds = run_with_fault(
        "generation_crash", tiny_model_dir, tmp_path, "--total_episodes", "32", "--num_evals", "0"
    )
    assert process.returncode != 0, "the run ignored the failure of its generation thread"
    assert "RuntimeError: injected generation failure" in process.stderr, last_lines(process.stderr)
    assert "GenerationThreadError: The vLLM generation thread failed" in process.stderr
    assert seconds < RUN_TIMEOUT_S / 2, f"the crashed run took {seconds:.0f}s to end"
    assert not (tmp_path / "output" / "model").exists()
    summary = json.loads((tmp_path / "output" / "summary.json").read_text())
    assert summary["status"] == "failed" and "injected generation failure" in summary["error"]


@pytest.mark.e2e
def test_a_skipped_weight_sync_stops_the_run_before_it_trains_on_off_policy_data(tiny_model_dir, tmp_path):
    """Sync mode at a high learning rate: step 1 samples from the start weights (version 0, no sync needed) and
    passes; step 2's sync loads nothing, so the engine samples from version 0 while the learner holds version 1."""
    process, _ = run_with_fault(
        "skip_weight_sync", tiny_model_dir, tmp_path,
        "--async_mode", "false", "--total_episodes", "24", "--num_evals", "0",
        "--learning_rate", "1e-2", "--lr_scheduler_type", "constant",
        "--max_vllm_logprob_diff", str(SYNC_MAX_LOGPROB_DIFF), *FP32_LEARNER,
    )  # fmt: skip
    assert process.returncode != 0, "the run trained on rollouts from stale engine weights"
    assert "Step 2: vLLM and the learner disagree on the logprobs of the sampled tokens" in process.stderr, (
        last_lines(process.stderr)
    )
    [step_1] = read_metrics(str(tmp_path / "output" / "metrics.jsonl"))
    assert step_1["debug/vllm_vs_learner_logprob_diff_mean"] < SYNC_MAX_LOGPROB_DIFF / 10
    assert not (tmp_path / "output" / "model").exists()


@pytest.mark.e2e
def test_with_the_engines_old_logprobs_and_no_reference_a_skipped_weight_sync_still_stops_the_run(
    tiny_model_dir, tmp_path
):
    """The same fault with `--old_logprobs_from vllm --beta 0`: the learner runs no old-logprob and no reference
    forward, so the agreement is measured on the first minibatch of each step, before its update. Step 1 (real
    engine, fp32, sync) matches the learner's logprobs; step 2 (stale engine) stops the run."""
    process, _ = run_with_fault(
        "skip_weight_sync", tiny_model_dir, tmp_path,
        "--async_mode", "false", "--total_episodes", "24", "--num_evals", "0",
        "--learning_rate", "1e-2", "--lr_scheduler_type", "constant",
        "--max_vllm_logprob_diff", str(SYNC_MAX_LOGPROB_DIFF), *FP32_LEARNER,
        "--old_logprobs_from", "vllm", "--beta", "0",
    )  # fmt: skip
    assert process.returncode != 0, "the run trained on rollouts from stale engine weights"
    assert "This rollout (first minibatch): vLLM and the learner disagree" in process.stderr, last_lines(process.stderr)
    [step_1] = read_metrics(str(tmp_path / "output" / "metrics.jsonl"))
    assert step_1["debug/vllm_vs_learner_logprob_diff_mean"] < SYNC_MAX_LOGPROB_DIFF / 10
    assert step_1["debug/old_logprobs_from_learner_frac"] == 0.0  # the engine scored every response token
    assert "time/value_forward" in step_1
    skipped = {"objective/kl", "time/old_logprob_forward", "time/ref_logprob_forward"}
    assert not skipped & set(step_1), f"logged {skipped & set(step_1)}"


# ---- 5. push to the Hub, wandb tracking ------------------------------------------------------------------------------


@pytest.mark.e2e
def test_push_to_hub_uploads_the_model_folder_to_the_run_branch(sync_run):
    hub, model_dir = sync_run.hub, sync_run.run.model_dir
    with open(model_dir / "open_instruct_args.json") as f:
        run_name = json.load(f)["run_name"]
    repo_id = f"{HUB_USER}/{HUB_REPO}"
    assert set(hub.repos) == {repo_id}
    assert set(hub.repos[repo_id]) == {"main", run_name}
    [commit] = hub.commits
    assert (commit.repo_id, commit.revision) == (repo_id, run_name)
    folder = {path.name: path.read_bytes() for path in model_dir.iterdir()}
    assert commit.files == folder
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(folder)
    card = folder["README.md"].decode()
    assert card.startswith("---\n") and f"# {HUB_REPO}" in card and "- ppo" in card
    assert "- Weights: saved in float32" in card
    assert all(request.authorization == f"Bearer {HUB_TOKEN}" for request in hub.requests)
    assert hub.unhandled == []
    with open(sync_run.run.output_dir / "summary.json") as f:
        summary = json.load(f)
    assert summary["hub_url"] == f"{sync_run.hub_endpoint}/{repo_id}/tree/{run_name}"
    assert summary["model_dir"] == str(model_dir)


@pytest.mark.e2e
def test_with_tracking_writes_an_offline_wandb_run(sync_run):
    offline_runs = list((sync_run.workdir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1, f"expected one offline wandb run under {sync_run.workdir / 'wandb'}"
    assert list(offline_runs[0].glob("run-*.wandb")), f"{offline_runs[0]} holds no .wandb log"


# ---- 6. arguments: YAML config with command-line overrides, batch-size checks (in-process, no model) ---------------


def test_yaml_config_with_a_command_line_override(tmp_path):
    config = {
        "model_name_or_path": "tiny",
        "dataset_mixer_list": ["data/prompts.jsonl", 500],
        "learning_rate": 1.0e-4,
        "total_episodes": 64,
        "async_mode": False,
        "stop_strings": ["</answer>", "Question:"],
    }
    config_path = tmp_path / "ppo.yaml"
    config_path.write_text(yaml.safe_dump(config))

    args = parse_args([str(config_path), "--learning_rate", "5e-5"])

    assert args.ppo.learning_rate == 5e-5  # the command line wins
    assert args.model.model_name_or_path == "tiny"
    assert args.data.dataset_mixer_list == ["data/prompts.jsonl", "500"]
    assert args.ppo.total_episodes == 64
    assert args.gen.async_mode is False
    assert args.gen.stop_strings == ["</answer>", "Question:"]
    assert args.ppo.num_epochs == 4  # not in the file: the default


@pytest.mark.parametrize(
    "name",
    ["ppo_arithmetic_cpu.yaml", "ppo_arithmetic_gpu.yaml", "ppo_tulu3_8b.yaml", "ppo_tulu3_8b_lora_1node.yaml",
     "grpo_arithmetic_cpu.yaml", "grpo_arithmetic_gpu.yaml", "ppo_word_problems_cpu.yaml", "grpo_tools_cpu.yaml",
     "ppo_tools_cpu.yaml", "grpo_native_tools_cpu.yaml"],
)  # fmt: skip
def test_shipped_configs_parse_into_consistent_sizes(name):
    """The shipped recipes: a key the dataclasses do not know, or sizes that do not divide, fails here."""
    args = parse_args([str(TESTS_DIR.parent / "configs" / "train_configs" / name)])
    sizes = compute_batch_sizes(args)
    rollout = args.ppo.local_rollout_batch_size * args.ppo.number_samples_per_prompt
    assert sizes.num_training_steps * rollout <= args.ppo.total_episodes
    assert sizes.mini_batch_size * args.ppo.num_mini_batches == rollout
    assert args.gen.response_length + args.data.max_prompt_token_length <= args.gen.max_token_length


def sizes_error(*flags: str) -> str:
    args = parse_args(["--dataset_mixer_list", "data/prompts.jsonl", "1.0", *flags])
    with pytest.raises(ValueError) as error:
        compute_batch_sizes(args)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_batch_size_errors_name_the_values_and_the_fix():
    rollout_of_12 = ["--local_rollout_batch_size", "4", "--number_samples_per_prompt", "3"]
    assert sizes_error(*rollout_of_12, "--num_mini_batches", "5") == (
        "--num_mini_batches 5 does not divide the rollout batch of 12 responses (local_rollout_batch_size 4 x "
        "number_samples_per_prompt 3); pick a divisor of 12."
    )
    assert sizes_error(*rollout_of_12, "--per_device_train_batch_size", "8") == (
        "--per_device_train_batch_size 8 does not divide the minibatch of 12 responses; pick a divisor of 12."
    )
    assert sizes_error(*rollout_of_12, "--per_device_train_batch_size", "4", "--total_episodes", "8") == (
        "--total_episodes 8 is less than one step of 12 responses; raise it."
    )


def test_inconsistent_sizes_fail_before_any_model_loads():
    # The model path does not exist: reaching the model loading would raise FileNotFoundError instead.
    with pytest.raises(ValueError, match="--num_mini_batches 3 does not divide"):
        main(["--model_name_or_path", "/no/such/model", "--dataset_mixer_list", "data/prompts.jsonl", "1.0",
              "--num_mini_batches", "3"])  # fmt: skip
