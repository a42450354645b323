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

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file as load_safetensors
from transformers import AutoModelForCausalLM, AutoTokenizer

from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
from open_instruct.generation.vllm_engine import Completion, engine_dtype
from open_instruct.learner.ppo import PPOLearner
from open_instruct.learner.saving import weights_sha256
from open_instruct.rewards.manager import RewardManager
from open_instruct.run.args import compute_batch_sizes, parse_args
from open_instruct.run.flops import is_timing
from tests.support.deepspeed_ranks import run_two_ranks
from tests.support.fake_hub import FakeHub, download_env, folder_files
from tests.support.learner_steps import EQUIVALENCE_FLAGS, fixed_rollout, one_ppo_step, single_process_ppo_step
from tests.support.ray_runs import (
    kill_an_actor_and_wait_for_the_run_to_end,
    needs_loopback_namespace,
    ray_trainer_command,
)
from tests.support.trainer_runs import (
    EVAL_QUESTIONS,
    STEP_METRICS,
    Run,
    assert_saved_weights_are_the_learners,
    explain_mismatch,
    fresh_engine_greedy,
    hf_greedy,
    is_finite_number,
    last_lines,
    run_to_completion,
)

# One logical CPU per Ray node (tests/conftest.py's ray_cluster): a learner rank on each of the two nodes.
RAY_CPUS_PER_NODE = 1


# ---- the compute dtype: one for all ranks ---------------------------------------------------------------------------


DTYPE_CASES = [
    (["bfloat16", "float32"], "torch.float32"),  # rank 1's CPU has no fast bf16: both ranks compute in fp32
    (["float32", "bfloat16"], "torch.float32"),
    (["bfloat16", "bfloat16"], "torch.bfloat16"),
    (["float32", "float32"], "torch.float32"),
]


def choose_dtypes_on_rank(rank: int, port: int, results, cases: list) -> None:
    """One learner rank (a spawned process) joins a real 2-rank gloo group on 127.0.0.1 and agrees on its dtype for
    each case in turn: `results[(case, rank)]` is (dtype, why)."""
    from open_instruct.learner import deepspeed_backend
    from open_instruct.run import devices

    deepspeed_backend.init_process_group(rank, 2, "127.0.0.1", port, 60)
    backend = deepspeed_backend.DeepSpeedBackend(stage=2, micro_batch_size=1, gather_whole_model=False)
    for case, (choices, _) in enumerate(cases):
        dtype, why = devices.compute_dtype_of_all_ranks(getattr(torch, choices[rank]), "probe", backend.all_sum)
        results[(case, rank)] = (str(dtype), why)


@pytest.fixture(scope="module")
def agreed_dtypes() -> dict:
    """Every case of DTYPE_CASES agreed by the same 2 spawned ranks (one start of two processes, ~8 s, for all)."""
    return run_two_ranks(choose_dtypes_on_rank, DTYPE_CASES)


@pytest.mark.e2e
@needs_loopback_namespace
@pytest.mark.parametrize("choices, expected", DTYPE_CASES)
def test_learner_ranks_whose_cpus_choose_different_dtypes_all_compute_in_fp32(choices, expected, agreed_dtypes):
    """Each rank's `--learner_compute_dtype auto` probes its own CPU, and nodes can differ; ranks computing in
    different dtypes would take different steps, so one fp32 rank makes every rank fp32."""
    case = DTYPE_CASES.index((choices, expected))
    results = [agreed_dtypes[(case, rank)] for rank in range(2)]
    assert [results[rank][0] for rank in range(2)] == [expected, expected]
    for rank in range(2):
        overruled = choices[rank] == "bfloat16" and expected == "torch.float32"
        assert ("other learner rank" in results[rank][1]) == overruled, results[rank]


# ---- equivalence with the single-process learner ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_process_step(tiny_model_dir):
    return single_process_ppo_step(tiny_model_dir)


@pytest.mark.e2e
@pytest.mark.ray
@needs_loopback_namespace
@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_take_the_single_process_ppo_step(stage, ray_cluster, single_process_step, tiny_model_dir, tmp_path):
    assert_two_ranks_take_the_step(single_process_step, stage, ray_cluster, tiny_model_dir, tmp_path)


@pytest.mark.e2e
@pytest.mark.ray
@needs_loopback_namespace
def test_two_ranks_with_engine_old_logprobs_and_no_reference_take_the_single_process_step(
    ray_cluster, tiny_model_dir, tmp_path
):
    """`--old_logprobs_from vllm --beta 0`: no old-logprob or reference forward; the engine-vs-learner agreement is
    measured on the first minibatch, gathered over the ranks in the minibatch's row order (a wrong order would
    compare rows with other rows' engine logprobs and change the debug metrics)."""
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts, completions = fixed_rollout(tokenizer)
    args = parse_args(["--model_name_or_path", tiny_model_dir, *EQUIVALENCE_FLAGS])
    torch.manual_seed(args.run.seed)
    learner = PPOLearner(args, compute_batch_sizes(args), tokenizer, tiny_model_dir, stop_token_ids_for(tokenizer, "eos"))
    exp, _, _ = learner.make_experience(prompts, completions, RewardManager(args.reward))
    # An engine off the learner by up to 0.05 nats per token, differently on every row.
    noise = 0.1 * torch.rand(exp.logprob.shape, generator=torch.Generator().manual_seed(0)) - 0.05
    engine = [(exp.logprob[row] + noise[row])[: len(c.token_ids)].tolist() for row, c in enumerate(completions)]
    completions = [
        Completion(c.prompt_index, c.token_ids, c.text, c.finish_reason, logprobs) for c, logprobs in zip(completions, engine)
    ]
    switches = ["--old_logprobs_from", "vllm", "--beta", "0"]
    expected = single_process_ppo_step(tiny_model_dir, completions, *switches)
    assert expected[2]["debug/vllm_vs_learner_logprob_diff_mean"] == pytest.approx(0.025, abs=0.01)
    assert_two_ranks_take_the_step(expected, 2, ray_cluster, tiny_model_dir, tmp_path, completions, *switches)


def assert_two_ranks_take_the_step(
    single_process_step, stage, ray_cluster, tiny_model_dir, tmp_path, completions=None, *switches: str
):
    from open_instruct.learner.ray_group import LearnerGroup

    initial, expected_params, expected_metrics = single_process_step
    flags = ["--num_learners_per_node", "1", "1", "--deepspeed_stage", str(stage), "--ray_address", ray_cluster.address,
             "--output_dir", str(tmp_path / "output")]  # fmt: skip
    args = parse_args(["--model_name_or_path", tiny_model_dir, *EQUIVALENCE_FLAGS, *flags, *switches])
    sizes = compute_batch_sizes(args)
    assert (sizes.num_learners, sizes.gradient_accumulation_steps) == (2, 1)  # the single process accumulates 2
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts, fixed_completions = fixed_rollout(tokenizer)
    group = LearnerGroup(args, sizes, tiny_model_dir, stop_token_ids_for(tokenizer, "eos"))
    try:
        metrics = one_ppo_step(group, prompts, completions or fixed_completions, RewardManager(args.reward))
        params = dict(group.weights_for_engine())  # fp32 on CPU: exactly the learner's weights
        saved = group.save(str(tmp_path / "model"))
    finally:
        group.shutdown()

    assert metrics.keys() == expected_metrics.keys()
    differing = {
        key: (metrics[key], expected)
        for key, expected in expected_metrics.items()
        if not is_timing(key) and metrics[key] != pytest.approx(expected, abs=1e-4, rel=1e-4)
    }
    assert not differing, f"metrics (ZeRO-{stage}, single process): {differing}"
    assert params.keys() == expected_params.keys()
    for name, expected in expected_params.items():
        assert params[name].dtype == torch.float32
        moved = (expected - initial[name]).abs().max().item()
        assert moved > 1e-4, f"{name} hardly moved ({moved}): the comparison would prove nothing"
        torch.testing.assert_close(params[name], expected, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")

    # The saved folder (fp32 by default) holds exactly the ranks' gathered weights, which match the single process.
    saved_weights = load_safetensors(f"{saved.path}/model.safetensors")
    assert saved.dtype == "float32" and weights_sha256(saved_weights) == saved.weights_sha256
    for name, param in AutoModelForCausalLM.from_pretrained(saved.path, dtype=torch.float32).named_parameters():
        assert torch.equal(param, params[name]), f"saved {name} differs from the ranks' weights"


# ---- end to end: the trainer on two Ray nodes ----------------------------------------------------------------------


@dataclass
class RayRun(Run):
    stdout: str = ""
    hub: FakeHub | None = None  # the async run's policy came from it (stopped after the run; its requests stay)
    hub_commit: str = ""
    hf_cache: Path | None = None


def ray_run_command(ray_cluster, eval_file, workdir: Path, policy: str, mode: str, stage: int, *flags: str):
    return ray_trainer_command(
        policy, ray_cluster, eval_file, workdir / "output",
        "--deepspeed_stage", str(stage),
        "--async_mode", str(mode == "async").lower(),
        "--total_episodes", "16",
        "--num_evals", "1",
        # High enough that two steps change the tiny model's greedy output; the saved folder is bf16 and an engine
        # in bf16 holds exactly those weights.
        "--learning_rate", "1e-2",
        "--lr_scheduler_type", "constant",
        "--vllm_dtype", "bfloat16",
        *flags,
    )  # fmt: skip


@pytest.fixture(scope="module")
def async_zero3_run(ray_cluster, tiny_model_dir, eval_file, tmp_path_factory) -> RayRun:
    """Async at ZeRO-3, its policy named by a hub id: `org/tiny` at --model_revision v2, served by a local
    fake Hub whose main holds only a config (a run that ignored the revision could not load it). One run serves
    the metric, final-eval and hub-id tests: each trainer start on two Ray nodes costs ~30 s."""
    workdir = tmp_path_factory.mktemp("ray_async")
    with FakeHub() as hub:
        hub.add_repo("org/tiny", {"config.json": folder_files(tiny_model_dir)["config.json"]})
        commit = hub.add_repo("org/tiny", folder_files(tiny_model_dir), branch="v2")
        command = ray_run_command(ray_cluster, eval_file, workdir, "org/tiny", "async", 3, "--model_revision", "v2")
        process = run_to_completion(command, cwd=workdir, env=download_env(hub, workdir / "hf_cache"))
    return RayRun(workdir / "output", num_steps=2, async_mode=True, stdout=process.stdout, hub=hub, hub_commit=commit,
                  hf_cache=workdir / "hf_cache")  # fmt: skip


@pytest.fixture(scope="module")
def sync_zero2_run(ray_cluster, tiny_model_dir, eval_file, tmp_path_factory) -> RayRun:
    workdir = tmp_path_factory.mktemp("ray_sync")
    # --seed 2: sampling noise under which two steps change the tiny model's greedy eval answers (under --seed 1's, since
    # each sample draws from a seed of its own, the two updates left every greedy answer as it was).
    command = ray_run_command(ray_cluster, eval_file, workdir, tiny_model_dir, "sync", 2, "--seed", "2")
    process = run_to_completion(command, cwd=workdir)
    return RayRun(workdir / "output", num_steps=2, async_mode=False, stdout=process.stdout)


@pytest.fixture(params=["async_zero3_run", "sync_zero2_run"], ids=["async-zero3", "sync-zero2"])
def ray_run(request) -> RayRun:
    return request.getfixturevalue(request.param)


@pytest.mark.e2e
@pytest.mark.ray
@needs_loopback_namespace
def test_ray_run_logs_every_metric_and_the_expected_policy_versions(ray_run):
    lines = ray_run.step_lines()
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        step = line["step"]
        missing = [key for key in STEP_METRICS if key not in line]
        assert not missing, f"step {step} did not log {missing}"
        assert all(is_finite_number(line[key]) for key in STEP_METRICS), line
        # The trainer's in-process engine got each new policy by learner rank 0's transfer (gloo here), which logs
        # these, not by the whole model through Ray's object store (version 0 is the engine's own: no transfer).
        transfer = ["time/engine_ready_wait", "time/weight_broadcast", "weight_broadcast/buckets"]
        assert all(key in line for key in transfer) == (line["policy_version/rollout"] > 0), line
        assert line["policy_version/learner"] == step - 1
        assert line["policy_version/rollout"] == (max(0, step - 2) if ray_run.async_mode else step - 1)
        assert line["episode"] == step * 8
    evals = [line for line in ray_run.metrics() if "eval/policy_version" in line]
    assert [e["eval/policy_version"] for e in evals] == [0, 2]


@pytest.mark.e2e
@pytest.mark.ray
@needs_loopback_namespace
def test_ray_run_final_model_loads_and_a_fresh_vllm_engine_reproduces_the_final_eval(ray_run, eval_file, tmp_path):
    """The final eval ran in the trainer's vLLM right after it loaded the gathered final weights; the saved folder
    (gathered on rank 0 under ZeRO-3) must load in transformers and give a fresh engine exactly the same output."""
    model_dir = ray_run.model_dir
    _, loading_info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not loading_info["missing_keys"] and not loading_info["unexpected_keys"], loading_info
    final_rows = ray_run.eval_rows(policy_version=ray_run.num_steps)
    initial_rows = {row["ground_truth"]: row for row in ray_run.eval_rows(policy_version=0)}
    assert len(final_rows) == len(EVAL_QUESTIONS)
    assert any(row["token_ids"] != initial_rows[row["ground_truth"]]["token_ids"] for row in final_rows), (
        "training did not change any greedy output; the comparison would prove nothing"
    )
    assert_saved_weights_are_the_learners(ray_run.output_dir)
    prompts, fresh_engine_ids = fresh_engine_greedy(model_dir, eval_file, final_rows, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    saved_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, engine_dtype()))
    for prompt, fresh_ids in zip(prompts, fresh_engine_ids):  # the saved folder means the same in both libraries
        saved_model_ids = hf_greedy(saved_model, tokenizer, prompt)
        assert fresh_ids == saved_model_ids, explain_mismatch(saved_model, tokenizer, prompt, fresh_ids, saved_model_ids)
    # The trainer's engine made the final eval right after loading the gathered final weights by sync.
    assert fresh_engine_ids == [row["token_ids"] for row in final_rows]


# ---- the policy named by a hub id -------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.ray
@needs_loopback_namespace
def test_a_zero3_run_whose_policy_is_a_hub_id_trains(async_zero3_run, tiny_model_dir):
    """The 8B recipe names its models by hub id; `async_zero3_run`'s policy is `org/tiny` at --model_revision v2.
    The driver downloads that commit before Ray starts; 2 learner ranks on 2 Ray nodes at ZeRO-3 read their shares
    from the snapshot folder, the engine loads the same folder, and the run trains. (Before: the ranks looked for
    safetensors in a folder named `org/tiny` and failed after Ray, placement and the engine had started.)"""
    run, commit = async_zero3_run, async_zero3_run.hub_commit
    snapshot = run.hf_cache / "models--org--tiny" / "snapshots" / commit
    assert f"[ppo] policy org/tiny ({snapshot})" in run.stdout, last_lines(run.stdout)
    assert folder_files(snapshot) == folder_files(tiny_model_dir)
    # Every file came from the v2 commit, each once: the driver downloaded, the ranks and the engine read the folder.
    downloads = [request.path for request in run.hub.requests if request.method == "GET" and "/resolve/" in request.path]
    assert sorted(downloads) == sorted(f"/org/tiny/resolve/{commit}/{path}" for path in folder_files(snapshot))
    lines = run.step_lines()
    assert [line["episode"] for line in lines] == [8, 16], lines
    assert all(is_finite_number(line["loss/policy_avg"]) for line in lines), lines
    assert (run.model_dir / "model.safetensors").is_file()


# ---- a dead learner ends the run -------------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.ray
@needs_loopback_namespace
def test_killing_a_learner_actor_ends_the_run_naming_it(ray_cluster, tiny_model_dir, eval_file, tmp_path):
    output_dir = tmp_path / "output"
    command = ray_trainer_command(
        tiny_model_dir, ray_cluster, eval_file, output_dir, "--total_episodes", "400", "--num_evals", "0"
    )
    run = kill_an_actor_and_wait_for_the_run_to_end(command, tmp_path, output_dir, "[ppo] learner rank 1: pid ",
                                                    "its learner rank 1")  # fmt: skip
    assert run.returncode != 0
    assert "LearnerFailed: learner rank 1 died during" in run.stderr, last_lines(run.stderr)
    assert run.seconds < 60, f"the run took {run.seconds:.0f}s to end after its learner died"


@pytest.mark.ray
@needs_loopback_namespace
def test_a_peer_failing_because_another_died_reports_the_death_first(ray_cluster):
    """A killed engine breaks the broadcast on its peers at once, and Ray reports the death a moment later: the
    error must still name the dead actor, and a plain failure must not wait long for a death that never comes."""
    import ray

    from open_instruct.run.cluster import PEER_DEATH_GRACE_S, wait_for_actors

    class CollectivePeer:  # defined here, so that Ray ships it by value to workers that cannot import tests/
        """An actor in a collective: `fail` raises what a live peer sees when another drops out, `die` ends its
        process as a kill would."""

        def fail(self, after_s: float) -> None:
            time.sleep(after_s)
            raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer")

        def die(self, after_s: float) -> None:
            time.sleep(after_s)
            os._exit(1)

    peer = ray.remote(num_cpus=0, max_restarts=0)(CollectivePeer)
    live, dying, hanging = peer.remote(), peer.remote(), peer.remote()
    names = ["vLLM engine 0", "vLLM engine 1"]
    with pytest.raises(RuntimeError) as raised:
        refs = [live.fail.remote(0.2), dying.die.remote(1.5)]
        wait_for_actors(refs, names, "receive_weights", 60, RuntimeError, "")
    message = str(raised.value)
    assert message.startswith("vLLM engine 1 died during receive_weights: "), message
    assert "(then vLLM engine 0 failed in receive_weights: RuntimeError: " in message and "reset by peer" in message

    started = time.time()
    with pytest.raises(RuntimeError, match="^vLLM engine 0 failed in receive_weights: RuntimeError: .*reset by peer"):
        refs = [live.fail.remote(0.2), hanging.fail.remote(60)]
        wait_for_actors(refs, names, "receive_weights", 60, RuntimeError, "")
    assert time.time() - started < 0.2 + PEER_DEATH_GRACE_S + 5
    for actor in (live, hanging):
        ray.kill(actor)


def test_an_actor_at_rays_default_nice_15_is_named_with_the_fix_and_one_at_0_is_not():
    from open_instruct.run.cluster import niceness_warning

    warning = niceness_warning("learner rank 1", 15)
    assert warning.startswith("[ppo] warning: learner rank 1 runs at nice 15") and "RAY_worker_niceness=0" in warning
    assert niceness_warning("learner rank 1", 0) is None


@pytest.mark.ray
@needs_loopback_namespace
def test_the_clusters_workers_run_at_the_priority_of_every_other_process(ray_cluster):
    """Ray's default is nice 15; the suite's clusters (conftest.py), the trainer's local one and the scripts' run
    their workers at 0, or a Ray file's ranks starve beside a busy process (2.1x their time on a 2-core machine)."""
    import ray

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)

    assert ray.get(niceness.remote(), timeout=120) == 0


def test_minibatches_must_split_evenly_over_the_learners():
    args = parse_args(
        ["--dataset_mixer_list", "data/prompts.jsonl", "1.0", "--local_rollout_batch_size", "4",
         "--number_samples_per_prompt", "2", "--per_device_train_batch_size", "8", "--num_learners_per_node", "1", "1"]
    )  # fmt: skip
    assert args.dist.uses_ray and args.dist.num_learners == 2
    with pytest.raises(ValueError) as error:
        compute_batch_sizes(args)
    assert str(error.value) == (
        "The minibatch of 8 responses does not split into --per_device_train_batch_size 8 micro-batches evenly over "
        "2 learners; make the minibatch a multiple of 16."
    )


# ---- the single-process path stays free of ray and deepspeed ---------------------------------------------------------


ALGORITHMS = {"ppo": "PPOLearner", "grpo": "GRPOLearner"}


@pytest.fixture(scope="module")
def single_process_learners(tiny_model_dir) -> dict[str, str]:
    """Import the trainer and build each algorithm's single-process learner in one fresh interpreter (one import of
    torch, vLLM and transformers for both), looking at sys.modules after each: algorithm -> "Learner [modules]"."""
    script = f"""
import sys
from open_instruct.data.tokenizer import load_tokenizer
from open_instruct.learner.saving import weights_sha256
from open_instruct.ppo_vllm_thread_ray_gtrl import RunData, build_learner
from open_instruct.run.args import compute_batch_sizes, parse_args

for algorithm in {list(ALGORITHMS)!r}:
    args = parse_args(["--model_name_or_path", {tiny_model_dir!r}, "--total_episodes", "32"], algorithm=algorithm)
    data = RunData({tiny_model_dir!r}, load_tokenizer({tiny_model_dir!r}), [], None, None, args)
    learner = build_learner(args, compute_batch_sizes(args), data)
    print(algorithm, type(learner).__name__, sorted(m for m in ("ray", "deepspeed") if m in sys.modules))
"""
    process = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, last_lines(process.stderr)
    lines = [line.split(" ", 1) for line in process.stdout.splitlines() if line.split(" ", 1)[0] in ALGORITHMS]
    return dict(lines)


@pytest.mark.parametrize("algorithm, learner", list(ALGORITHMS.items()))
def test_single_process_trainer_imports_neither_ray_nor_deepspeed(algorithm, learner, single_process_learners):
    """The trainer imported and its single-process learner built (in a fresh interpreter, `single_process_learners`)
    leave ray and deepspeed out of sys.modules."""
    assert single_process_learners[algorithm] == f"{learner} []"
