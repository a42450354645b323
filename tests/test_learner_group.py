"""Learner ranks as Ray actors on DeepSpeed (real Ray, real DeepSpeed on CPU with gloo, tiny model).

One two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`, one logical CPU per node) serves the
whole module. Ray listens on every interface, so these tests run only inside the loopback-only network
namespace scripts/test.sh makes (OPEN_INSTRUCT_LOOPBACK_ONLY=1); elsewhere they skip with that reason.

- Equivalence: 2 ranks at ZeRO-2 and at ZeRO-3 take the same PPO step on a fixed rollout as the single-process
  PPOLearner: same parameters (1e-5) and metrics (1e-4). The proof that the distributed learner is the same
  algorithm.
- End to end: the trainer with `--num_learners_per_node 1 1` on the two nodes, async (ZeRO-3) and sync (ZeRO-2).
- A learner actor killed mid-run ends the run within 60 s, naming the actor.
- The single-process trainer imports neither ray nor deepspeed.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from open_instruct.ground_truth_utils import RewardManager
from open_instruct.model_utils import load_tokenizer
from open_instruct.ppo_args import compute_batch_sizes, parse_args
from open_instruct.ppo_learner import PPOLearner, PromptBatch
from open_instruct.ppo_vllm_thread_ray_gtrl import stop_token_ids_for
from open_instruct.vllm_utils import Completion

TESTS_DIR = Path(__file__).resolve().parent
TRAINER = [sys.executable, "-m", "open_instruct.ppo_vllm_thread_ray_gtrl"]

needs_loopback_namespace = pytest.mark.skipif(
    os.environ.get("OPEN_INSTRUCT_LOOPBACK_ONLY") != "1",
    reason="Ray listens on every interface: run through scripts/test.sh, which uses a loopback-only namespace",
)


@pytest.fixture(scope="module")
def ray_cluster():
    """Two Ray nodes on this machine, one logical CPU each; the test process is connected as a driver."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


# ---- equivalence with the single-process learner ----------------------------------------------------------------------

QUESTIONS = [(1, 2), (3, 4), (2, 2), (5, 1)]
# Two responses per prompt, of different lengths, right and wrong, one cut off without a stop token.
RESPONSES = [
    ("The answer is 3.", "stop"), ("1 + 2 = 4", "stop"),
    ("3 + 4 = 7. So the answer is 7", "stop"), ("It is 8", "length"),
    ("4", "stop"), ("2 + 2 is 5, I think", "stop"),
    ("The sum of 5 and 1 is 6.", "stop"), ("6", "length"),
]  # fmt: skip
EQUIVALENCE_FLAGS = [
    "--local_rollout_batch_size", "4",
    "--number_samples_per_prompt", "2",
    "--per_device_train_batch_size", "2",
    "--num_mini_batches", "2",
    "--num_epochs", "2",
    "--learning_rate", "1e-3",  # far above a real run's, so that the step moves every weight visibly
    "--value_learning_rate", "3e-3",
    "--lr_scheduler_type", "linear",
    "--total_episodes", "16",
    "--response_length", "16",
    "--seed", "3",
]  # fmt: skip


def fixed_rollout(tokenizer) -> tuple[PromptBatch, list[Completion]]:
    chats = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in QUESTIONS]
    token_ids = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False) for chat in chats]
    prompts = PromptBatch(
        token_ids=token_ids,
        ground_truths=[str(a + b) for a, b in QUESTIONS],
        verifier_names=["arithmetic"] * len(QUESTIONS),
        texts=[tokenizer.decode(ids) for ids in token_ids],
    )
    completions = []
    for row, (text, finish_reason) in enumerate(RESPONSES):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if finish_reason == "stop":
            ids.append(tokenizer.eos_token_id)
        completions.append(Completion(prompt_index=row // 2, token_ids=ids, text=text, finish_reason=finish_reason))
    return prompts, completions


def one_ppo_step(learner, prompts, completions, reward_manager) -> dict[str, float]:
    experience, metrics, _ = learner.make_experience(prompts, completions, reward_manager)
    metrics.update(learner.train(experience))
    metrics["lr"] = learner.lr
    return metrics


@pytest.fixture(scope="module")
def single_process_step(tiny_model_dir):
    """The reference: today's PPOLearner in this process, one step on the fixed rollout."""
    args = parse_args(["--model_name_or_path", tiny_model_dir, *EQUIVALENCE_FLAGS])
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts, completions = fixed_rollout(tokenizer)
    torch.manual_seed(args.run.seed)
    learner = PPOLearner(args, compute_batch_sizes(args), tokenizer, tiny_model_dir, stop_token_ids_for(tokenizer, "eos"))
    initial = {name: p.detach().clone() for name, p in learner.policy.named_parameters()}
    metrics = one_ppo_step(learner, prompts, completions, RewardManager(args.reward))
    params = {name: p.detach().clone() for name, p in learner.policy.named_parameters()}
    return initial, params, metrics


@needs_loopback_namespace
@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_take_the_single_process_ppo_step(stage, ray_cluster, single_process_step, tiny_model_dir):
    from open_instruct.learner_group import LearnerGroup

    initial, expected_params, expected_metrics = single_process_step
    flags = ["--num_learners_per_node", "1", "1", "--deepspeed_stage", str(stage), "--ray_address", ray_cluster.address]
    args = parse_args(["--model_name_or_path", tiny_model_dir, *EQUIVALENCE_FLAGS, *flags])
    sizes = compute_batch_sizes(args)
    assert (sizes.num_learners, sizes.gradient_accumulation_steps) == (2, 1)  # the single process accumulates 2
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts, completions = fixed_rollout(tokenizer)
    group = LearnerGroup(args, sizes, tiny_model_dir, stop_token_ids_for(tokenizer, "eos"))
    try:
        metrics = one_ppo_step(group, prompts, completions, RewardManager(args.reward))
        params = dict(group.weights_for_engine())  # fp32 on CPU: exactly the learner's weights
    finally:
        group.shutdown()

    assert metrics.keys() == expected_metrics.keys()
    differing = {
        key: (metrics[key], expected)
        for key, expected in expected_metrics.items()
        if metrics[key] != pytest.approx(expected, abs=1e-4, rel=1e-4)
    }
    assert not differing, f"metrics (ZeRO-{stage}, single process): {differing}"
    assert params.keys() == expected_params.keys()
    for name, expected in expected_params.items():
        assert params[name].dtype == torch.float32
        moved = (expected - initial[name]).abs().max().item()
        assert moved > 1e-4, f"{name} hardly moved ({moved}): the comparison would prove nothing"
        torch.testing.assert_close(params[name], expected, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
