"""GRPO: the learner on the tiny model and a fixed rollout, its flags, and the GRPO trainer end to end.

The group-advantage math itself is tested in test_rl_math.py. Here:

- GRPOLearner: no value model is loaded, trained or checkpointed; the advantages of the fixed rollout are its
  group-normalised scores worked out by hand (std on and off) on every real token; the policy loss of one pass
  is the one those advantages give, by token and by sequence; one step moves the policy and leaves the reference;
  Ray learner ranks build the same class (checked without starting Ray).
- Flags: fewer than 2 samples per prompt, a KL in the reward and value-model flags fail in one line.
- `python -m open_instruct.grpo_vllm_thread_ray_gtrl` on the tiny model with a reward model (random but fixed
  scores, so every group has a spread) added to the verifiers of a mix of sources (arithmetic, IFEval and code rows,
  the code run in the sandbox): 2 steps, every metric logged and finite, each source's correct rate logged, no value metric, a checkpoint
  without a value model, a saved folder that loads and holds the trained weights; resuming from the step-1
  checkpoint gives the uninterrupted run's step 2 and final model.
"""

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from open_instruct import grpo_vllm_thread_ray_gtrl
from open_instruct.data.embedded import arithmetic_data_path
from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
from open_instruct.learner import models
from open_instruct.learner.algorithms import learner_class
from open_instruct.learner.grpo import GRPOLearner
from open_instruct.learner.ppo import PPOLearner
from open_instruct.rewards.manager import RewardManager
from open_instruct.run.args import compute_batch_sizes, parse_args
from open_instruct.run.checkpoint import save_checkpoint
from open_instruct.run.tracking import read_metrics
from tests.support.learner_steps import EQUIVALENCE_FLAGS, fixed_rollout
from tests.support.resume_runs import assert_same_run
from tests.support.trainer_runs import (
    STEP_METRICS,
    assert_saved_weights_are_the_learners,
    is_finite_number,
    run_to_completion,
)

# The Ray equivalence tests' flags (4 prompts x 2 samples, lr 1e-3) without the value model's learning rate, which
# GRPO refuses.
_VALUE_LR = EQUIVALENCE_FLAGS.index("--value_learning_rate")
LEARNER_FLAGS = EQUIVALENCE_FLAGS[:_VALUE_LR] + EQUIVALENCE_FLAGS[_VALUE_LR + 2 :]
# The fixed rollout's scores (arithmetic verifier), two responses per prompt: 1+2 right, wrong; 3+4 right, wrong
# (cut off); 2+2 right, wrong; 5+1 right, right (the second cut off, but no --non_stop_penalty).
SCORES = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
# Groups of two scores 1 and 0: mean 0.5, unbiased std sqrt(0.5) = 0.70711, so A = +-0.5 / 0.70711 = +-0.70711;
# without the std, +-0.5. The last group is all equal: 0.
WITH_STD = [1 / math.sqrt(2), -1 / math.sqrt(2)] * 3 + [0.0, 0.0]
WITHOUT_STD = [0.5, -0.5] * 3 + [0.0, 0.0]


def build_grpo_learner(model_dir: str, *flags: str, cls=None):
    args = parse_args(["--model_name_or_path", model_dir, *LEARNER_FLAGS, *flags], algorithm="grpo")
    tokenizer = load_tokenizer(model_dir)
    torch.manual_seed(args.run.seed)
    learner_cls = cls or learner_class(args.ppo.algorithm)
    learner = learner_cls(args, compute_batch_sizes(args), tokenizer, model_dir, stop_token_ids_for(tokenizer, "eos"))
    return learner, RewardManager(args.reward)


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    return fixed_rollout(load_tokenizer(tiny_model_dir))


def row_advantages(exp) -> list[float]:
    """The one advantage each row holds on all its real tokens (asserted), and 0 on its padding."""
    values = []
    for row, length in enumerate(exp.response_mask.sum(1).tolist()):
        tokens = exp.advantage[row, :length]
        assert torch.equal(tokens, tokens[:1].expand(length)), f"row {row}: not one advantage on every token"
        assert exp.advantage[row, length:].eq(0).all()
        values.append(tokens[0].item())
    return values


# ---- the learner --------------------------------------------------------------------------------------------------


def test_grpo_learner_builds_no_value_model_and_its_advantages_are_the_group_normalised_scores(
    tiny_model_dir, rollout, monkeypatch
):
    loaded_roles = []  # every model the learner's backend loads (SingleProcess.load_model -> models.load_model)
    real_load = models.load_model
    def logged_load(spec, *rest):
        loaded_roles.append(spec.role)
        return real_load(spec, *rest)

    monkeypatch.setattr(models, "load_model", logged_load)
    prompts, completions = rollout
    learner, reward_manager = build_grpo_learner(tiny_model_dir)
    assert isinstance(learner, GRPOLearner) and learner.args.ppo.algorithm == "grpo"
    assert loaded_roles == ["policy", "reference policy"]  # no scalar-head model: no value model
    assert learner.value_model is None and learner.trainers == (learner.policy_trainer,)
    assert learner.ref_policy is not None  # --beta 0.05 by default: the KL to the reference is a loss term

    exp, metrics, samples = learner.make_experience(prompts, completions, reward_manager)
    assert samples["score"] == SCORES
    assert row_advantages(exp) == pytest.approx(WITH_STD, abs=1e-5)
    assert exp.value is None and exp.return_ is None
    assert metrics["grpo/zero_std_groups_frac"] == 0.25  # the 5 + 1 group: both right
    assert metrics["grpo/group_score_std_mean"] == pytest.approx(3 * math.sqrt(0.5) / 4)
    assert metrics["objective/non_score_reward"] == 0.0  # the KL is in the loss, not the reward
    assert not {"val/value_mean", "time/value_forward"} & set(metrics)

    dr_grpo, _ = build_grpo_learner(tiny_model_dir, "--grpo_std_normalize", "false")
    dr_exp, _, _ = dr_grpo.make_experience(prompts, completions, reward_manager)
    assert row_advantages(dr_exp) == pytest.approx(WITHOUT_STD, abs=1e-6)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_one_grpo_pass_takes_the_loss_of_the_group_advantages_and_moves_only_the_policy(
    aggregation, tiny_model_dir, rollout
):
    # One micro-batch, one minibatch, one epoch: the loss is computed once, before the update, at ratio 1 and with
    # the policy equal to the reference (k3 KL 0), so it is -(aggregated advantage).
    one_pass = ["--per_device_train_batch_size", "8", "--num_mini_batches", "1", "--num_epochs", "1"]
    prompts, completions = rollout
    learner, reward_manager = build_grpo_learner(tiny_model_dir, *one_pass, "--loss_aggregation", aggregation)
    exp, _, _ = learner.make_experience(prompts, completions, reward_manager)
    lengths = exp.response_mask.sum(1).tolist()
    if aggregation == "token":  # each token weighs the same: the group's +-A do not cancel when lengths differ
        expected = -sum(a * n for a, n in zip(WITH_STD, lengths)) / sum(lengths)
        assert abs(expected) > 1e-2
    else:  # each response weighs the same: every group's advantages sum to 0
        expected = 0.0
    before = {name: p.detach().clone() for name, p in learner.backend.hf_model(learner.policy).named_parameters()}
    reference = {name: p.detach().clone() for name, p in learner.backend.hf_model(learner.ref_policy).named_parameters()}

    metrics = learner.train(exp)
    assert metrics["loss/policy_avg"] == pytest.approx(expected, abs=1e-5)
    assert metrics["objective/loss"] == pytest.approx(expected, abs=1e-5)
    assert not {"loss/value_avg", "val/clipfrac_avg"} & set(metrics)
    moved = [name for name, p in learner.backend.hf_model(learner.policy).named_parameters() if not torch.equal(p, before[name])]
    assert len(moved) == len(before), "one step must change every policy weight"
    assert all(torch.equal(p, reference[name]) for name, p in learner.backend.hf_model(learner.ref_policy).named_parameters())


def test_grpo_checkpoint_holds_no_value_model_and_resumes_only_into_grpo(tiny_model_dir, rollout, tmp_path):
    prompts, completions = rollout
    learner, reward_manager = build_grpo_learner(tiny_model_dir, "--beta", "0")
    exp, _, _ = learner.make_experience(prompts, completions, reward_manager)
    learner.train(exp)
    state = learner.state_dict()
    assert "value_model" not in state and len(state["optimizers"]) == len(state["schedulers"]) == 1
    path = save_checkpoint(str(tmp_path), 1, learner, {"step": 1}, learner.args, keep_last_n=1).path
    saved = torch.load(Path(path) / "learner.pt", weights_only=False)
    assert json.loads((Path(path) / "args.json").read_text())["algorithm"] == "grpo"

    resumed, _ = build_grpo_learner(tiny_model_dir, "--beta", "0")
    resumed.load_state_dict(saved)
    for (name, param), (_, expected) in zip(resumed.backend.hf_model(resumed.policy).named_parameters(), learner.backend.hf_model(learner.policy).named_parameters()):
        assert torch.equal(param, expected), name
    assert resumed.policy_trainer.optimizer.state_dict()["state"].keys() == state["optimizers"][0]["state"].keys()
    ppo, _ = build_grpo_learner(tiny_model_dir, "--beta", "0", cls=PPOLearner)
    with pytest.raises(ValueError, match="the checkpoint holds no value model but this PPOLearner trains a value"):
        ppo.load_state_dict(saved)


def test_ray_learner_ranks_build_the_runs_learner_class(tiny_model_dir, monkeypatch):
    """LearnerRank.setup on the GRPO args builds a GRPOLearner (DeepSpeed's group and backend replaced by the
    single-process ones, so no Ray or process group starts)."""
    from open_instruct.learner import deepspeed_backend
    from open_instruct.learner.ray_group import LearnerRank
    from open_instruct.learner.single_process import SingleProcess

    monkeypatch.setattr(deepspeed_backend, "init_process_group", lambda *args, **kwargs: None)
    monkeypatch.setattr(deepspeed_backend, "DeepSpeedBackend", lambda *args: SingleProcess())
    args = parse_args(["--model_name_or_path", tiny_model_dir, *LEARNER_FLAGS, "--beta", "0"], algorithm="grpo")
    rank = LearnerRank(0)
    rank.setup(args, compute_batch_sizes(args), tiny_model_dir, [0], ("127.0.0.1", 0))
    assert type(rank.learner) is GRPOLearner and rank.learner.value_model is None


# ---- flags --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--number_samples_per_prompt", "1", "--local_rollout_batch_size", "8"],
         "error: --number_samples_per_prompt 1 is too few for GRPO, whose advantages compare the responses to the "
         "same prompt with each other; pass --number_samples_per_prompt 2 or more (e.g. 8)."),
        (["--kl_in_loss", "false"], "error: GRPO takes its advantages from the scores alone, so --beta 0.05 with "
         "--kl_in_loss false (a KL penalty in the reward) would be ignored; pass --kl_in_loss true"),
        (["--value_learning_rate", "1e-5", "--whiten_rewards", "true"], "error: --value_learning_rate, "
         "--whiten_rewards configure PPO's value model and per-token rewards, which GRPO does not use"),
    ],
)  # fmt: skip
def test_grpo_flags_that_cannot_work_fail_in_one_line(flags, expected, tmp_path, capsys):
    argv = ["--model_name_or_path", "tiny", "--total_episodes", "16", "--output_dir", str(tmp_path / "out"), *flags]
    with pytest.raises(SystemExit) as exit_info:
        grpo_vllm_thread_ray_gtrl.cli(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and err.startswith(expected), err
    assert not (tmp_path / "out").exists()  # refused before the run claimed its output_dir


def test_algorithm_defaults_follow_the_entry_point_and_lose_to_given_flags():
    def settings(args) -> tuple:
        ppo = args.ppo
        return (ppo.algorithm, ppo.kl_in_loss, ppo.kl_estimator, ppo.num_epochs, ppo.whiten_advantages,
                args.run.output_dir)

    tiny = ["--model_name_or_path", "tiny"]
    grpo_output = os.path.abspath("output/grpo")  # made absolute where the trainer starts
    assert settings(parse_args(tiny, algorithm="grpo")) == ("grpo", True, "k3", 1, False, grpo_output)
    assert parse_args(tiny, algorithm="grpo").run.run_name.startswith("grpo__")
    given = parse_args([*tiny, "--num_epochs", "2", "--whiten_advantages", "true"], algorithm="grpo")
    assert (given.ppo.num_epochs, given.ppo.whiten_advantages) == (2, True)
    assert settings(parse_args(tiny)) == ("ppo", False, "k1", 4, True, os.path.abspath("output/ppo"))
    assert settings(parse_args([*tiny, "--algorithm", "grpo"]))[3] == 1  # --algorithm itself brings the defaults too


@pytest.mark.parametrize("name", ["grpo_arithmetic_cpu.yaml", "grpo_arithmetic_gpu.yaml", "grpo_tools_cpu.yaml",
                                  "grpo_native_tools_cpu.yaml"])
def test_shipped_grpo_configs_are_grpo_and_pass_the_flag_checks(name):
    from open_instruct.run.validation import check_flags

    args = parse_args([str(Path(__file__).resolve().parents[1] / "configs" / "train_configs" / name)])
    assert args.ppo.algorithm == "grpo" and args.ppo.number_samples_per_prompt >= 2  # even under the PPO trainer
    check_flags(args)


# ---- the GRPO trainer end to end ----------------------------------------------------------------------------------

GRPO_TRAINER = [sys.executable, "-m", "open_instruct.grpo_vllm_thread_ray_gtrl"]
NUM_STEPS = 2
# 2 prompts x 4 samples a step. The tiny model never answers an arithmetic question right, so every group would
# score all 0 and teach nothing: a reward model (the tiny model with a fixed random score head) gives each
# response its own score.
GRPO_RUN = [
    "--local_rollout_batch_size", "2",
    "--number_samples_per_prompt", "4",
    "--per_device_train_batch_size", "4",
    "--num_mini_batches", "2",
    "--response_length", "16",
    "--total_episodes", str(8 * NUM_STEPS),
    "--learning_rate", "1e-3",
    "--lr_scheduler_type", "constant",
    "--num_evals", "1",
    "--save_freq", "1",
]  # fmt: skip
GRPO_STEP_METRICS = [key for key in STEP_METRICS if key != "loss/value_avg"] + [
    "grpo/zero_std_groups_frac", "grpo/group_score_std_mean", "val/ratio", "policy/approxkl_avg",
]  # fmt: skip
VALUE_METRICS = {"loss/value_avg", "val/value_mean", "val/clipfrac_avg", "time/value_forward"}


# The training rows: 2 arithmetic questions, 1 IFEval row and 1 code problem, each graded by its own verifier (the
# code one in the sandbox) and all drawn in the run's 2 steps of 2 prompts. The reward model's score is added to each.
FIXTURES = Path(__file__).resolve().parent.parent / "open_instruct" / "data" / "fixtures"


def mixed_sources() -> list[str]:
    return ["--dataset_mixer_list", arithmetic_data_path(), "2", str(FIXTURES / "ifeval_google.jsonl"), "1",
            str(FIXTURES / "code_problems.jsonl"), "1"]  # fmt: skip


def grpo_command(tiny_model_dir: str, eval_path: Path, output_dir: Path, *extra: str) -> list[str]:
    return GRPO_TRAINER + [
        "--model_name_or_path", tiny_model_dir, *mixed_sources(),
        "--reward_model_path", tiny_model_dir, "--reward_model_multiplier", "1",
        "--dataset_mixer_eval_list", str(eval_path), "1.0",
        "--output_dir", str(output_dir),
        *GRPO_RUN, *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def grpo_run(tiny_model_dir, eval_file, tmp_path_factory) -> Path:  # noqa: F811
    workdir = tmp_path_factory.mktemp("grpo_run")
    run_to_completion(grpo_command(tiny_model_dir, eval_file, workdir / "output"), cwd=workdir)
    return workdir / "output"


@pytest.mark.e2e
def test_grpo_trainer_logs_every_step_saves_a_loadable_model_and_a_checkpoint_without_a_value_model(
    grpo_run, tiny_model_dir
):
    lines = [line for line in read_metrics(str(grpo_run / "metrics.jsonl")) if "policy_version/learner" in line]
    assert [line["step"] for line in lines] == list(range(1, NUM_STEPS + 1))
    for line in lines:
        missing = [key for key in GRPO_STEP_METRICS if key not in line]
        assert not missing, f"step {line['step']} did not log {missing}"
        assert all(is_finite_number(line[key]) for key in GRPO_STEP_METRICS), line
        assert not VALUE_METRICS & set(line), f"step {line['step']} logged {VALUE_METRICS & set(line)}"
        assert line["grpo/zero_std_groups_frac"] == 0.0  # the reward model scores every response differently
        assert line["policy_version/rollout"] == max(0, line["step"] - 2)  # async, as PPO
    evals = [line for line in read_metrics(str(grpo_run / "metrics.jsonl")) if "eval/policy_version" in line]
    assert [e["eval/policy_version"] for e in evals] == [0, NUM_STEPS]
    # Rewards by source: each row's verifier graded it, and each verifier's correct rate was logged.
    logged = {key for line in lines for key in line if key.endswith("_correct_rate")}
    assert {"objective/arithmetic_correct_rate", "objective/ifeval_correct_rate", "objective/code_correct_rate"} <= logged
    assert all(line["time/reward"] > 0 for line in lines)

    summary = json.loads((grpo_run / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert_saved_weights_are_the_learners(grpo_run)  # fp32, the digest of the learner's weights
    model, info = AutoModelForCausalLM.from_pretrained(grpo_run / "model", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    assert not [name for name, p in model.named_parameters() if torch.equal(p, initial[name])], "nothing was trained"
    assert json.loads((grpo_run / "model" / "open_instruct_args.json").read_text())["algorithm"] == "grpo"

    checkpoint = grpo_run / "checkpoints" / f"step_{NUM_STEPS}"
    state = torch.load(checkpoint / "learner.pt", weights_only=False)
    assert "value_model" not in state and len(state["optimizers"]) == 1
    assert state["compute_dtype"] in ("float32", "bfloat16")  # a resumed run computes in it (auto: not re-probed)
    assert json.loads((checkpoint / "args.json").read_text())["algorithm"] == "grpo"


@pytest.mark.e2e
def test_grpo_resumed_from_step_1_repeats_step_2_and_the_final_model(
    grpo_run, tiny_model_dir, eval_file, tmp_path  # noqa: F811
):
    output_dir = tmp_path / "output"
    shutil.copytree(grpo_run, output_dir, ignore=shutil.ignore_patterns(".run.lock"))
    step_1 = str(output_dir / "checkpoints" / "step_1")
    command = grpo_command(tiny_model_dir, eval_file, output_dir, "--resume", step_1)
    process = run_to_completion(command, cwd=tmp_path)
    assert "resuming run grpo__" in process.stdout + process.stderr

    assert_same_run(output_dir, grpo_run)  # every logged row (timings aside) and the final model


@pytest.mark.e2e
def test_the_ppo_trainer_refuses_to_resume_a_grpo_checkpoint(
    grpo_run, tiny_model_dir, eval_file, tmp_path, capsys  # noqa: F811
):
    from open_instruct.ppo_vllm_thread_ray_gtrl import cli

    output_dir = tmp_path / "output"
    shutil.copytree(grpo_run, output_dir, ignore=shutil.ignore_patterns(".run.lock"))
    flags = grpo_command(tiny_model_dir, eval_file, output_dir, "--resume")[len(GRPO_TRAINER) :]
    with pytest.raises(SystemExit) as exit_info:
        cli(flags)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert "with other settings: --algorithm 'ppo' (checkpoint: 'grpo')" in err, err


def test_an_agent_rollouts_split_samples_share_one_run_of_their_group():
    """The shares GRPO's group mean and std weigh each response by: 1/k for the k samples of an agent rollout that
    split, none at all where every run left one sample (dataset prompts, or agents that never split)."""
    from open_instruct.generation.vllm_engine import Completion
    from open_instruct.learner.grpo import run_shares

    def sample(prompt: int, rollout: int | None) -> Completion:
        agent = None if rollout is None else {"reward": 1.0, "rollout": rollout, "split": 0}
        return Completion(prompt, [1], "", "stop", agent=agent)

    assert run_shares([sample(0, None), sample(0, None)]) is None
    assert run_shares([sample(0, 0), sample(0, 1), sample(1, 2), sample(1, 3)]) is None
    split = [sample(0, 0), sample(0, 0), sample(0, 1), sample(1, 0), sample(1, 2), sample(1, 2), sample(1, 2)]
    torch.testing.assert_close(run_shares(split), torch.tensor([0.5, 0.5, 1.0, 1.0, 1 / 3, 1 / 3, 1 / 3]))
