"""Environments as datasets write them: an environment's `reset(row)` gets its dataset row (the prompt's messages and
every other column), a column may name each row's environment (one run mixes several), and a step's reward is
recorded on the turn's last sampled token, where PPO's per-token rewards put it (GRPO adds it to the score).

The data, routing, checkpoint and reward math tests run without an engine; the last ones drive the real vLLM engine on
the tiny model (tests/support/tool_environments.py: TaskFromRow, QuietTask).
"""

import copy
import dataclasses
import json

import pytest
import torch

from open_instruct import rl
from open_instruct.data.prompt_dataset import load_prompt_dataset
from open_instruct.data.sources import extra_columns_text
from open_instruct.environments import routing, tools
from open_instruct.environments.routing import environment_rows
from open_instruct.generation.generation_thread import Rollout, rollout_from_dict, rollout_to_dict
from open_instruct.generation.samples import Sample
from open_instruct.generation.vllm_engine import Completion
from tests.support.tool_environments import QuietTask, TaskFromRow

SUPPORT = "tests/support/tool_environments.py"


def task_row(index: int, **columns) -> dict:
    return {"messages": [{"role": "user", "content": f"question {index}"}], "ground_truth": str(index),
            "dataset": "arithmetic", "label": f"L{index}", "turn_reward": 0.5, "max_turns": 2,
            "files": {"a.txt": "alpha", "b.txt": ""}, "table": [[1, 2], [3, 4]], **columns}  # fmt: skip


# ---------------------------------------------------------------- the row's columns reach reset


def test_a_rows_extra_columns_are_kept_for_its_environment_only_when_asked(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(task_row(i)) + "\n" for i in range(3)))
    kept = load_prompt_dataset([str(path), "1.0"], ["train"], seed=0, keep_extra_columns=True)
    rows = sorted(environment_rows(kept, list(range(3))), key=lambda row: row["label"])
    assert rows[1]["files"] == {"a.txt": "alpha", "b.txt": ""} and rows[1]["table"] == [[1, 2], [3, 4]]
    assert rows[1]["messages"] == [{"role": "user", "content": "question 1"}]
    assert (rows[1]["ground_truth"], rows[1]["dataset"], rows[1]["label"]) == ("1", "arithmetic", "L1")
    assert json.loads(json.dumps(rows)) == rows  # JSON values: they travel to engine actors and into checkpoints
    plain = load_prompt_dataset([str(path), "1.0"], ["train"], seed=0)
    assert "extra_columns" not in plain.column_names  # without --tools the dataset is what it was
    assert set(environment_rows(plain, [0])[0]) == {"messages", "ground_truth", "dataset", "source"}


def test_a_column_json_cannot_hold_is_refused_with_its_name():
    with pytest.raises(ValueError, match=r"data.parquet row 3: column `image` holds a bytes that JSON cannot hold"):
        extra_columns_text({"prompt": "hi", "image": b"\x89PNG"}, "data.parquet row 3")
    verl_row = {"prompt": [{"role": "user", "content": "hi"}], "data_source": "maze", "extra_info": {"seed": 3}}
    assert json.loads(extra_columns_text(verl_row, "here")) == {"data_source": "maze", "extra_info": {"seed": 3}}


# ---------------------------------------------------------------- routing by a column


@pytest.fixture
def environment_names():
    """--tools as a user writes them (one registered environment, one from a file, one tool) -> the engine's names."""
    tools.ENVIRONMENTS["quiet"] = QuietTask
    written = ["quiet", f"{SUPPORT}:TaskFromRow", "calculator"]
    yield dict(zip(written, tools.absolute_names(written)))
    del tools.ENVIRONMENTS["quiet"]


def test_each_row_gets_the_environment_its_column_names_and_rows_without_one_the_tools(environment_names):
    route = routing.environment_router(environment_names, "env")
    assert isinstance(route({"env": "quiet"})(), QuietTask)
    assert type(route({"env": f"{SUPPORT}:TaskFromRow"})()).__name__ == "TaskFromRow"
    default = route({"label": "no env column"})()
    assert isinstance(default, tools.ToolEnvironment) and [t.name for t in default.tools] == ["calculator"]
    with pytest.raises(ValueError, match="names 'maze', which is not one of --tools quiet"):
        route({"env": "maze"})()  # only that sample's environment fails to start (the data check refuses it first)
    environments_only = {name: environment_names[name] for name in ("quiet", f"{SUPPORT}:TaskFromRow")}
    assert isinstance(routing.environment_router(environments_only, "env")({})(), QuietTask)  # the first name
    assert isinstance(routing.environment_router({"quiet": "quiet"}, None)({"env": "anything"})(), QuietTask)


def test_environments_may_stand_beside_each_other_only_when_a_column_routes_them(environment_names):
    names = list(environment_names)
    assert routing.routing_problem(names, "env") is None
    assert "runs alone" in routing.routing_problem(names, None)
    assert "names a tool twice" in routing.routing_problem(["quiet", "quiet"], "env")
    assert "unknown" in routing.routing_problem(["quiet", "web_search"], "env")
    assert routing.row_environment_problem({"env": 3}, "env", names).startswith("column `env` (--environment_column) "
                                                                                "holds a int")
    assert routing.row_environment_problem({}, "env", names) is None


# ---------------------------------------------------------------- checkpoints


def test_a_samples_row_and_turn_rewards_survive_a_checkpoint_and_old_checkpoints_still_load():
    sample = Sample(0, 1, [5, 6], 24, seed=3, index=2, token_ids=[7, 8, 9], row=task_row(1),
                    turn_rewards=[[1, 0.5], [2, -1.0]])  # fmt: skip
    stored = json.loads(json.dumps(dataclasses.asdict(sample)))  # a checkpoint holds its JSON
    assert Sample(**stored) == sample
    old = {key: value for key, value in stored.items() if key not in ("row", "turn_rewards")}
    assert Sample(**old).row is None and Sample(**old).turn_rewards == []
    completion = Completion(0, [7, 8, 9], "abc", "stop", sampled=[True, True, True], tool_stats={"reward": -0.5},
                            turn_rewards=[[1, 0.5], [2, -1.0]])  # fmt: skip
    data = json.loads(json.dumps(rollout_to_dict(Rollout(1, [completion]))))
    assert rollout_from_dict(data).completions == [completion]
    del data["completions"][0]["turn_rewards"]
    assert rollout_from_dict(data).completions[0].turn_rewards is None


# ---------------------------------------------------------------- per-turn rewards: the math


# Two turns, each followed by a tool's output: the policy's tokens at 0-2 and 5-6, the outputs at 3-4 and 7, padding 8.
RESPONSE_MASK = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 0, 0]], dtype=torch.bool)
TURN_REWARDS = [[[2, 1.0], [6, 0.25]]]  # each on its turn's last sampled token: 2, then 6


def test_a_turn_reward_lands_on_the_last_sampled_token_of_its_turn():
    placed = rl.turn_rewards_at_tokens(TURN_REWARDS, RESPONSE_MASK)
    assert placed.tolist() == [[0, 0, 1.0, 0, 0, 0, 0.25, 0, 0]]
    # An index past the last real token (the response cut at an earlier stop token) goes on the last real one.
    assert rl.turn_rewards_at_tokens([[[8, 2.0]], None], torch.tensor([[1, 1, 0], [1, 0, 0]]).bool()).tolist() == [
        [0, 2.0, 0], [0, 0, 0]]  # fmt: skip
    reward, non_score = rl.per_token_rewards(torch.tensor([3.0]), torch.zeros(1, 9), RESPONSE_MASK, 0.1, placed)
    assert reward.tolist() == [[0, 0, 1.0, 0, 0, 0, 3.25, 0, 0]]  # the final score on the last token, 6
    assert non_score.abs().sum() == 0


def test_gae_credits_a_turn_reward_to_the_tokens_before_it_not_to_later_turns():
    """gamma = lam = 1 and zero values: each token's advantage is the sum of the rewards at or after it. Turn 1's
    reward is in the advantage of turn 1's tokens alone; placed at the end (as one summed score) it would be in
    turn 2's as well."""
    placed = rl.turn_rewards_at_tokens(TURN_REWARDS, RESPONSE_MASK)
    score = torch.tensor([3.0])  # the verifier's part of the score
    reward, _ = rl.per_token_rewards(score, torch.zeros(1, 9), RESPONSE_MASK, 0.0, placed)
    advantage, _ = rl.compute_gae(reward, torch.zeros(1, 9), RESPONSE_MASK, gamma=1.0, lam=1.0)
    assert advantage[0, [0, 1, 2]].tolist() == [4.25, 4.25, 4.25]
    assert advantage[0, [5, 6]].tolist() == [3.25, 3.25]
    summed, _ = rl.per_token_rewards(score + placed.sum(1), torch.zeros(1, 9), RESPONSE_MASK, 0.0)
    summed_advantage, _ = rl.compute_gae(summed, torch.zeros(1, 9), RESPONSE_MASK, gamma=1.0, lam=1.0)
    assert summed_advantage[0, 5].item() == 4.25  # turn 2 credited with turn 1's reward: what placing avoids
    # Discounted: turn 1's reward counts whole at its token, the later ones two policy steps away (5, then 6; the
    # tool's output between is no step of the policy's).
    discounted, _ = rl.compute_gae(reward, torch.zeros(1, 9), RESPONSE_MASK, gamma=0.5, lam=1.0)
    assert discounted[0, 2].item() == 1.0 + 0.5 * 0.5 * 3.25


def test_without_turn_rewards_the_per_token_rewards_are_bit_for_bit_what_they_were():
    generator = torch.Generator().manual_seed(0)
    score, kl = torch.randn(3, generator=generator), torch.randn(3, 9, generator=generator)
    mask = torch.rand(3, 9, generator=generator) > 0.3
    mask[:, 0] = True
    before = rl.per_token_rewards(score, kl, mask, 0.05)
    after = rl.per_token_rewards(score, kl, mask, 0.05, None)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_grpo_reads_the_summed_score_which_placing_turn_rewards_leaves_whole():
    """GRPO's score is the verifier's plus the sum of the turn rewards (step_batch.score, from tool_stats["reward"]);
    PPO's per-token rewards move the turn rewards onto their tokens and keep their total."""
    placed = rl.turn_rewards_at_tokens(TURN_REWARDS, RESPONSE_MASK)
    score = torch.tensor([3.0]) + torch.tensor([1.25])  # what step_batch.score gives GRPO and PPO
    reward, _ = rl.per_token_rewards(score - placed.sum(1), torch.zeros(1, 9), RESPONSE_MASK, 0.0, placed)
    assert reward.sum().item() == score.item() == 4.25
    group_score = torch.tensor([4.25, 3.0])
    advantage, _ = rl.group_advantages(group_score, torch.tensor([0, 0]))
    assert advantage[0] > 0 > advantage[1]


# ---------------------------------------------------------------- in the engine (the tiny model)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [20, 21, 22, 23]]


def engine_settings(**tool_flags) -> dict:
    return {"n": 2, "temperature": 1.0, "max_tokens": 24, "stop_token_ids": [2], "stop_strings": None,
            "with_logprobs": True,
            "tools": {"names": ["task_from_row"], "max_calls": 4, "timeout_s": 5.0, "output_max_tokens": 16,
                      "wrapper": "{output}", **tool_flags}}  # fmt: skip


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from open_instruct.generation import vllm_engine

    tools.ENVIRONMENTS["task_from_row"], tools.ENVIRONMENTS["quiet"] = TaskFromRow, QuietTask
    yield vllm_engine.create_engine(vllm_engine.EngineConfig(model_path=tiny_model_dir, max_model_len=256, seed=0))
    del tools.ENVIRONMENTS["task_from_row"], tools.ENVIRONMENTS["quiet"]


def turn_ends(completion) -> list[int]:
    """The index of each sampled token that a tool's output follows."""
    sampled = completion.sampled or [True] * len(completion.token_ids)
    return [i for i in range(len(sampled) - 1) if sampled[i] and not sampled[i + 1]]


@pytest.mark.e2e
def test_in_the_engine_reset_reads_the_row_and_each_turns_reward_sits_before_its_observation(llm):
    from open_instruct.generation.engine_batches import EngineBatches, generate_batch

    rows = [task_row(i, max_turns=2 + i % 2) for i in range(len(PROMPTS))]
    completions = generate_batch(llm, PROMPTS, engine_settings(), sampling_seed=4, rows=copy.deepcopy(rows))
    for completion in completions:
        if completion.tool_stats is None:  # it never wrote a letter: no turn
            continue
        row = rows[completion.prompt_index]
        assert f"<{row['label']}>" in completion.text  # the observation came from the row's own column
        assert completion.tool_stats["calls"] <= row["max_turns"]
        indices = [index for index, _ in completion.turn_rewards]
        assert len(indices) == completion.tool_stats["calls"] and set(turn_ends(completion)) <= set(indices)
        for index in indices:  # the model's last token of the turn, and the tool's output (if it fit) right after it
            assert completion.sampled[index] and (index + 1 == len(completion.sampled) or not completion.sampled[index + 1])
        assert all(reward == 0.5 for _, reward in completion.turn_rewards)
        assert sum(reward for _, reward in completion.turn_rewards) == completion.tool_stats["reward"]
    assert any(len(c.turn_rewards or ()) >= 2 for c in completions)
    # Without rows (an engine driven directly, a checkpoint older than rows) reset gets the prompt's tokens alone.
    batches = EngineBatches(llm)
    batches.admit(0, PROMPTS[:1], engine_settings(), sampling_seed=4)
    assert [a.error for a in batches.unstarted.values()] == ["Error: the environment could not start: KeyError: 'label'"] * 2
    batches.run_until_complete(0)


@pytest.mark.e2e
def test_a_snapshot_holds_each_samples_row_and_turn_rewards_and_a_restored_sample_is_reset_with_its_row(llm):
    """A checkpoint taken after the first turns (its JSON, as the trainer writes it) restores into a fresh
    EngineBatches: the turn rewards recorded before it are kept, and the restored samples' new environments are reset
    with the rows the snapshot holds (their later observations read the row's label)."""
    from open_instruct.generation.engine_batches import EngineBatches

    rows = [task_row(i, max_turns=3) for i in range(len(PROMPTS))]
    batches = EngineBatches(llm)
    batches.admit(0, PROMPTS, engine_settings(), sampling_seed=6, rows=rows)
    while not any(s.turn_rewards for s in batches.batches[0]):
        batches.step()
    snapshot = json.loads(json.dumps(batches.partial_batches()))
    batches.run_until_complete(0)
    stored = snapshot[0]["samples"]
    assert [s["row"]["label"] for s in stored] == [f"L{i}" for i in range(len(PROMPTS)) for _ in range(2)]
    restored = EngineBatches(llm)
    restored.restore(snapshot)
    completions = restored.run_until_complete(0)
    read_its_row = []
    for completion, sample in zip(completions, stored):
        assert (completion.turn_rewards or [])[: len(sample["turn_rewards"])] == sample["turn_rewards"]
        after_snapshot = completion.text[len(sample["text"]) :]
        others = {f"<L{i}>" for i in range(len(PROMPTS))} - {f"<{sample['row']['label']}>"}
        assert not any(label in after_snapshot for label in others)
        read_its_row.append(f"<{sample['row']['label']}>" in after_snapshot)
    assert any(read_its_row)  # some sample called again after the restore, and read its own row's label


@pytest.mark.e2e
def test_in_the_engine_one_batch_mixes_the_environments_its_rows_name(llm):
    from open_instruct.generation.engine_batches import generate_batch

    rows = [task_row(0, env="quiet"), task_row(1), task_row(2, env="task_from_row")]
    settings = engine_settings(names=["task_from_row", "quiet"], environment_column="env",
                               environment_names={"task_from_row": "task_from_row", "quiet": "quiet"})
    completions = generate_batch(llm, PROMPTS, settings, sampling_seed=4, rows=rows)
    quiet = [c for c in completions if c.prompt_index == 0]
    rewarded = [c for c in completions if c.prompt_index == 2]
    default = [c for c in completions if c.prompt_index == 1]  # no column, no tool in --tools: the first name
    assert all("[1]" in c.text and c.turn_rewards is None for c in quiet if c.tool_stats)
    assert all("<L2>" in c.text and c.turn_rewards for c in rewarded if c.tool_stats)
    assert all("<L1>" in c.text for c in default if c.tool_stats)
    assert any(c.tool_stats for c in quiet) and any(c.tool_stats for c in rewarded)


# ---------------------------------------------------------------- a training run, as a user starts it


@pytest.mark.e2e
def test_a_run_mixing_two_environments_by_a_column_trains_on_their_turn_rewards(tiny_model_dir, tmp_path):
    """The rows reach their environments through the whole trainer (prompt order -> rollout request -> engine):
    TaskFromRow's rows are rewarded per turn, QuietTask's are not. The tiny model never gets an answer right, so the
    scores PPO trains on are the turn rewards alone."""
    from open_instruct.run.tracking import read_metrics
    from tests.support.trainer_runs import SMALL_RUN, TESTS_DIR, TRAINER, run_to_completion

    task, quiet = (f"{TESTS_DIR / 'support' / 'tool_environments.py'}:{name}" for name in ("TaskFromRow", "QuietTask"))
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"}], "ground_truth": str(i + 1),
             "dataset": "arithmetic", "label": f"L{i}",
             "turn_reward": 0.5, "max_turns": 2, **({"env": quiet} if i % 2 else {})} for i in range(8)]  # fmt: skip
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    command = [
        *TRAINER, "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "output"), *SMALL_RUN,
        "--dataset_mixer_list", str(data), "1.0", "--async_mode", "false", "--total_episodes", "16",
        "--num_evals", "0", "--response_length", "24", "--tools", task, quiet, "--environment_column", "env",
    ]  # fmt: skip
    run_to_completion(command, cwd=tmp_path)
    steps = [line for line in read_metrics(str(tmp_path / "output" / "metrics.jsonl")) if "tools/calls_per_sample" in line]
    assert len(steps) == 2
    for step in steps:
        assert 0 < step["tools/calls_per_sample"] <= 2
        # TaskFromRow's samples earn 0.5 a turn and QuietTask's nothing: the mean score is more than zero and at most
        # half the calls per sample.
        assert 0 < step["objective/scores"] <= 0.5 * step["tools/calls_per_sample"]
