"""Bad inputs fail fast: exit code 2, one line `error: ...` naming the problem, before any model loads, and the
output_dir's earlier contents untouched.

The table runs through `cli()` in this process (no model can load in the time bound, and no vLLM engine starts:
the test checks that nothing printed an engine line). A few cases also run as real subprocesses, for the process's
own exit code and stderr. Printed at the end (with -s): the table of case, exit code, seconds, message.
"""

import fcntl
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from open_instruct.ppo_vllm_thread_ray_gtrl import cli
from open_instruct.run.args import SIZE_FLAGS
from open_instruct.run.command_line import exit_on_bad_command_line
from tests.support.small_disk import small_disk_unavailable

TIME_BOUND_S = 20.0  # loading the tiny model plus starting vLLM takes longer than this on the CI machines
SUBPROCESS_TIME_BOUND_S = 60.0  # python start and imports (torch, transformers) included
BASE = [
    "--model_name_or_path", "tiny",
    "--local_rollout_batch_size", "4",
    "--number_samples_per_prompt", "2",
    "--per_device_train_batch_size", "4",
    "--response_length", "16",
    "--total_episodes", "16",
]  # fmt: skip
RESULTS: list[tuple[str, int, float, str]] = []


@dataclass
class Case:
    name: str
    flags: list[str]  # {data}, {out}, {tmp} are replaced by the case's paths
    expected: str  # a piece of the one-line message that names the problem
    rows: list[dict] | None = None  # the training data; None: the embedded arithmetic task
    raw_data: bytes | None = None  # the training file's bytes, for cases about the file itself
    env: dict[str, str] = field(default_factory=dict)
    setup: str | None = None  # name of a function below that prepares the case's files


def arithmetic_row(**changes) -> dict:
    row = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "ground_truth": "5", "dataset": "arithmetic"}
    return {**row, **changes}


def ifeval_row(ground_truth: dict) -> dict:
    return arithmetic_row(ground_truth=json.dumps(ground_truth), dataset="ifeval")


GOOD_ROWS = [arithmetic_row() for _ in range(8)]


def code_row(tests: str) -> dict:
    return {"messages": [{"role": "user", "content": "Write add(a, b)."}], "ground_truth": tests, "dataset": "code"}


GOOD_CODE_TESTS = '["assert add(1, 2) == 3"]'
HUB_ONLINE = {"HF_HUB_OFFLINE": "0", "HF_TOKEN": "hf_fake", "HF_ENDPOINT": "http://127.0.0.1:9"}

CASES = [
    # ---- flag values ----
    Case("temperature 0", ["--temperature", "0"], "--temperature 0.0 is not valid; expected a number > 0: PPO samples at it"),
    Case("negative temperature", ["--temperature", "-1"], "--temperature -1.0 is not valid"),
    Case("unknown tool", ["--tools", "calculator", "web_search"], "--tools web_search: unknown; expected names from calculator"),
    Case("tool named twice", ["--tools", "calculator", "calculator"], "names a tool twice"),
    Case("zero tool calls", ["--tools", "calculator", "--max_tool_calls", "0"], "--max_tool_calls 0 is not valid"),
    Case("tool timeout 0", ["--tools", "calculator", "--tool_timeout_s", "0"], "--tool_timeout_s 0.0 is not valid"),
    Case("tool workers 0", ["--tools", "calculator", "--tool_workers", "0"],
         "--tool_workers 0 is not valid; expected an integer >= 1"),
    Case("parallel tool calls 0", ["--tools", "calculator", "--max_parallel_tool_calls", "0"],
         "--max_parallel_tool_calls 0 is not valid; expected an integer >= 1"),
    Case("tool output budget 0", ["--tools", "calculator", "--tool_output_max_tokens", "0"],
         "--tool_output_max_tokens 0 is not valid"),
    Case("tool wrapper without output", ["--tools", "calculator", "--tool_output_wrapper", "<o></o>"],
         "--tool_output_wrapper '<o></o>' is not valid; expected a text holding {{output}} once"),
    Case("agent file missing", ["--rollout_agent", "{tmp}/agent.py:run"],
         "--rollout_agent '{tmp}/agent.py:run': no file {tmp}/agent.py"),
    Case("agent spec without function", ["--rollout_agent", "tests/support/agents.py"],
         "--rollout_agent 'tests/support/agents.py': expected path/to/agent.py:function"),
    Case("agent function missing", ["--rollout_agent", "tests/support/agents.py:nope"],
         "--rollout_agent 'tests/support/agents.py:nope': tests/support/agents.py defines no function 'nope'"),
    Case("agent with the wrong signature", ["--rollout_agent", "tests/support/agents.py:not_an_agent"],
         "--rollout_agent 'tests/support/agents.py:not_an_agent': not_an_agent(row) must take (row, client)"),
    Case("agent with tools", ["--rollout_agent", "tests/support/agents.py:one_call", "--tools", "calculator"],
         "--tools with --rollout_agent: the agent runs its own tools: drop --tools"),
    Case("agent endpoints past the last port", ["--rollout_agent", "tests/support/agents.py:one_call",
         "--vllm_num_engines", "2", "--agent_port", "65535"],
         "--agent_port 65535: with 2 engines the endpoints would need ports up to 65536; pass a port of at most 65534"),
    Case("agent timeout 0", ["--rollout_agent", "tests/support/agents.py:one_call", "--agent_timeout_s", "0"],
         "--agent_timeout_s 0.0 is not valid; expected a number > 0"),
    Case("agent flag without an agent", ["--agent_concurrency", "4"],
         "--agent_concurrency 4 shapes agent rollouts, and --rollout_agent is not set"),
    Case("tool limit without tools", ["--max_tool_calls", "3"],
         "--max_tool_calls 3 shapes tool calls, and --tools is not set (no tool is called); pass --tools NAME"),
    Case("environment column without tools", ["--environment_column", "env"],
         "--environment_column 'env' shapes tool calls, and --tools is not set"),
    Case("row naming an environment not in --tools", ["--tools", "calculator", "--environment_column", "env"],
         "row 0: column `env` (--environment_column) names 'maze', which is not one of --tools calculator; add it "
         "to --tools, or fix the row", rows=[arithmetic_row(env="maze")] + GOOD_ROWS),
    Case("tool whose constructor raises", ["--tools", "{tmp}/tools.py:NeedsKey"],
         "--tools {tmp}/tools.py:NeedsKey: NeedsKey() in {tmp}/tools.py raised RuntimeError: set MY_KEY when built "
         "(the engine builds one per sample, with no arguments); fix its __init__, or drop", setup="tool_file"),
    Case("environment whose constructor raises", ["--tools", "{tmp}/tools.py:EnvNeedsKey"],
         "--tools {tmp}/tools.py:EnvNeedsKey: EnvNeedsKey() in {tmp}/tools.py raised KeyError: 'MY_KEY' when built",
         setup="tool_file"),
    Case("python tool where the sandbox cannot isolate", ["--tools", "python"],
         "--tools python: the python tool runs the model's programs in the code sandbox, always isolated "
         "(--code_sandbox does not apply to it), and the code sandbox needs util-linux's", env={"PATH": "/nonexistent"}),
    Case("negative learning rate", ["--learning_rate", "-0.001"], "--learning_rate -0.001 is not valid"),
    Case("NaN learning rate", ["--learning_rate", "nan"], "--learning_rate nan is not valid"),
    Case("zero total_episodes", ["--total_episodes", "0"], "--total_episodes 0 is not valid; expected an integer >= 1"),
    Case("zero num_epochs", ["--num_epochs", "0"], "--num_epochs 0 is not valid"),
    Case("zero num_mini_batches", ["--num_mini_batches", "0"], "--num_mini_batches 0 is not valid"),
    Case("zero micro-batch", ["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0 is not valid"),
    Case("zero prompts per step", ["--local_rollout_batch_size", "0"], "--local_rollout_batch_size 0 is not valid"),
    Case("zero samples per prompt", ["--number_samples_per_prompt", "0"], "--number_samples_per_prompt 0 is not valid"),
    Case("zero response_length", ["--response_length", "0"], "--response_length 0 is not valid"),
    Case("gamma above 1", ["--gamma", "1.5"], "--gamma 1.5 is not valid; expected a number in [0, 1]"),
    Case("negative lam", ["--lam", "-0.1"], "--lam -0.1 is not valid"),
    Case("zero cliprange", ["--cliprange", "0"], "--cliprange 0.0 is not valid"),
    Case("warmup_ratio 1", ["--warmup_ratio", "1"], "--warmup_ratio 1.0 is not valid; expected a number in [0, 1)"),
    Case("unknown scheduler", ["--lr_scheduler_type", "bogus"], "--lr_scheduler_type 'bogus' is not valid; expected one of"),
    Case("zero GPU memory", ["--vllm_gpu_memory_utilization", "0"], "--vllm_gpu_memory_utilization 0.0 is not valid"),
    Case("save_freq 0", ["--save_freq", "0"], "--save_freq 0 is not valid; expected -1 (no checkpoints) or steps >= 1"),
    Case("save_model_freq 0", ["--save_model_freq", "0"],
         "--save_model_freq 0 is not valid; expected -1 (final model only) or steps >= 1"),
    Case("keep_last_n 0", ["--keep_last_n", "0"], "--keep_last_n 0 is not valid"),
    Case("negative seed", ["--seed", "-1"], "--seed -1 is not valid"),
    # ---- LoRA (docs/lora.md) ----
    Case("lora dropout", ["--lora_rank", "8", "--lora_dropout", "0.1"],
         "--lora_dropout 0.1 is not valid; expected 0: the engine samples with the merged weights and no dropout"),
    Case("lora unknown target", ["--lora_rank", "8", "--lora_target_modules", "q_proj", "c_attn"],
         "--lora_target_modules c_attn: no linear layer of the LlamaForCausalLM decoder has that name; expected some "
         "of down_proj gate_proj k_proj o_proj q_proj up_proj v_proj"),
    Case("lora targets without a rank", ["--lora_target_modules", "q_proj"],
         "--lora_target_modules q_proj names the layers of LoRA adapters, and --lora_rank is 0"),
    Case("negative lora rank", ["--lora_rank", "-1"], "--lora_rank -1 is not valid"),
    Case("lora alpha without a rank", ["--lora_alpha", "32"],
         "--lora_alpha 32 scales LoRA adapters, and --lora_rank is 0 (full fine-tuning, no adapters); pass --lora_rank"),
    Case("adapter sync without lora", ["--lora_weight_sync", "adapter"],
         "--lora_weight_sync adapter sends LoRA adapters, and --lora_rank is 0"),
    Case("adapter sync above vllm's ranks", ["--lora_rank", "600", "--lora_weight_sync", "adapter"],
         "--lora_weight_sync adapter: vLLM serves adapters of rank <= 512, and --lora_rank is 600"),
    Case("adapter sync with engine actors", ["--lora_rank", "8", "--lora_weight_sync", "adapter", "--vllm_num_engines", "1"],
         "--lora_weight_sync adapter runs with one learner process and its in-process engine"),
    Case("negative num_evals", ["--num_evals", "-1"], "--num_evals -1 is not valid"),
    Case("negative eval samples", ["--eval_samples_per_prompt", "-2"], "--eval_samples_per_prompt -2 is not valid"),
    Case("negative critic layers", ["--value_model_num_layers", "-1"], "--value_model_num_layers -1 is not valid"),
    Case("GRPO with a smaller critic", ["--algorithm", "grpo", "--value_model_num_layers", "1"],
         "--value_model_num_layers configure PPO's value model"),
    Case("negative mid-run eval samples", ["--mid_run_eval_samples_per_prompt", "-1"],
         "--mid_run_eval_samples_per_prompt -1 is not valid"),
    Case("zero max_grad_norm", ["--max_grad_norm", "0"], "--max_grad_norm 0.0 is not valid"),
    Case("zero queue timeout", ["--queue_timeout_s", "0"], "--queue_timeout_s 0.0 is not valid"),
    Case("a queue timeout no rollout can meet", ["--queue_timeout_s", "0.5"],
         "--queue_timeout_s 0.5 is not valid; expected seconds >= 60"),  # fmt: skip
    Case("run_name with a slash", ["--run_name", "a/b"], "--run_name 'a/b' is not valid; expected a name without '/'"),
    Case("TIS cap below 1", ["--truncated_importance_sampling_ratio_cap", "0.5"],
         "--truncated_importance_sampling_ratio_cap 0.5 is not valid; expected 0 (off) or a number >= 1"),  # fmt: skip
    Case("TIS with the engine's old logprobs",
         ["--truncated_importance_sampling_ratio_cap", "2", "--old_logprobs_from", "vllm"],
         "which is 1 with --old_logprobs_from vllm; pass --old_logprobs_from learner"),  # fmt: skip
    Case("GRPO with one sample per prompt", ["--algorithm", "grpo", "--number_samples_per_prompt", "1",
         "--local_rollout_batch_size", "8"], "--number_samples_per_prompt 1 is too few for GRPO"),  # fmt: skip
    Case("GRPO with the KL in the reward", ["--algorithm", "grpo", "--kl_in_loss", "false"],
         "GRPO takes its advantages from the scores alone"),  # fmt: skip
    # ---- asynchrony ----
    Case("async steps 0", ["--async_steps", "0"], "--async_steps 0 is not valid; expected an integer >= 1"),
    Case("async steps in sync mode", ["--async_mode", "false", "--async_steps", "2"],
         "--async_steps 2 needs async mode, and --async_mode is false"),  # fmt: skip
    Case("in-flight updates in sync mode", ["--async_mode", "false", "--inflight_updates", "true"],
         "--inflight_updates true needs async mode"),  # fmt: skip
    Case("stale PPO ratio against the engine", ["--async_steps", "2", "--old_logprobs_from", "vllm"],
         "--async_steps 2 trains on data up to 2 policy versions old, and --old_logprobs_from vllm would take PPO's "
         "ratio against that stale policy"),  # fmt: skip
    Case("engine restarts with in-flight updates", ["--async_steps", "2", "--inflight_updates", "true",
         "--vllm_num_engines", "2", "--max_engine_restarts", "1"],
         "--max_engine_restarts 1 with --inflight_updates"),  # fmt: skip
    Case("several versions ahead, Ray learners, no in-flight updates", ["--async_steps", "2",
         "--num_learners_per_node", "2", "--per_device_train_batch_size", "2"],
         "--async_steps 2 without --inflight_updates with Ray learners"),  # fmt: skip
    Case("more async steps than the run has", ["--async_steps", "2"],  # 16 episodes: 2 steps, lag at most 1
         "--async_steps 2 lets data lag 2 policy versions, but the run's 2 step(s) can lag at most 1"),  # fmt: skip
    Case("all cores to the engine", ["--vllm_cpu_cores", "999"], "--vllm_cpu_cores 999 leaves no core to the learner"),
    Case("engine cores with engine actors", ["--vllm_cpu_cores", "1", "--vllm_num_engines", "1"],
         "--vllm_cpu_cores 1 splits a CPU machine's cores between the learner and the engine in this process"),  # fmt: skip
    Case("zero-std filter with PPO", ["--filter_zero_std_groups", "true"],
         "--filter_zero_std_groups drops groups whose scores are all equal because GRPO"),  # fmt: skip
    Case("zero-std filter with a reward model", ["--algorithm", "grpo", "--filter_zero_std_groups", "true",
         "--reward_model_multiplier", "1", "--reward_model_path", "tiny"],
         "--filter_zero_std_groups scores each batch before the learner runs"),  # fmt: skip
    Case("filter metric without the filter", ["--algorithm", "grpo", "--filter_metric", "score"],
         "--filter_metric score says what the groups of --filter_zero_std_groups must differ in, and that filter is off"),  # fmt: skip
    Case("negative extra batches", ["--filter_max_extra_batches", "-1"], "--filter_max_extra_batches -1 is not valid"),
    Case("overlong buffer as long as the responses", ["--overlong_buffer_length", "16"],
         "--overlong_buffer_length 16 is not below --response_length 16"),  # fmt: skip
    Case("negative overlong penalty", ["--overlong_penalty_factor", "-1"], "--overlong_penalty_factor -1.0 is not valid"),
    Case("unknown loss aggregation", ["--loss_aggregation", "sample"], "invalid choice: 'sample' (choose from 'token', 'sequence')"),
    Case("unknown old logprobs source", ["--old_logprobs_from", "engine"], "--old-logprobs-from: invalid choice: 'engine' (choose from 'learner', 'vllm', 'auto')"),
    # ---- flag syntax ----
    Case("choice not allowed", ["--kl_estimator", "k4"], "argument --kl_estimator/--kl-estimator: invalid choice: 'k4'"),
    Case("not a number", ["--learning_rate", "abc"], "--learning_rate/--learning-rate: invalid float value: 'abc'"),
    Case("abbreviated flag", ["--learn", "1e-3"], "Unknown arguments ['--learn', '1e-3']"),
    Case("unknown flag", ["--no_such_flag", "1"], "Unknown arguments ['--no_such_flag', '1']"),
    Case("missing YAML config", ["{tmp}/missing.yaml"], "config file {tmp}/missing.yaml does not exist"),
    # ---- sizes ----
    Case("minibatches do not divide", ["--num_mini_batches", "3"], "--num_mini_batches 3 does not divide the rollout"),
    Case("micro-batch does not divide", ["--per_device_train_batch_size", "3"], "--per_device_train_batch_size 3 does not divide"),
    Case("less than one step", ["--total_episodes", "4"], "--total_episodes 4 is less than one step of 8 responses"),
    Case("response longer than context", ["--response_length", "600"], "--response_length 600 leaves no room"),
    Case("prompt + response too long", ["--max_prompt_token_length", "500"], "--max_prompt_token_length 500 + --response_length 16"),
    Case("context beyond the model", ["--max_token_length", "4096"], "--max_token_length 4096 exceeds the policy's 2048 positions"),
    Case("sampling that could never end", ["--number_samples_per_prompt", "10000000000", "--total_episodes", "40000000000"],
         "one step samples up to 640,000,000,000 response tokens (--local_rollout_batch_size 4 x --number_samples_per_prompt 10000000000 x --response_length 16), more than a day's work"),  # fmt: skip
    Case("a run that could never end", ["--total_episodes", "1000000000000000"], "more than a year's work even at"),
    Case(
        "activations cannot fit in memory",
        ["--per_device_train_batch_size", "4096", "--local_rollout_batch_size", "4096", "--number_samples_per_prompt",
         "1", "--total_episodes", "4096", "--response_length", "1000", "--max_token_length", "2048"],
        "the biggest item is activations: policy, 4096 x 1038 tokens"  # the longest prompt (38) + 1000,
    ),
    Case(
        "whole logits cannot fit in memory",
        ["--per_device_train_batch_size", "256", "--local_rollout_batch_size", "256", "--number_samples_per_prompt",
         "1", "--total_episodes", "256", "--response_length", "1000", "--max_token_length", "2048",
         "--logprob_chunk_size", "0", "--gradient_checkpointing", "true"],
        "the biggest item is logits over 49152 tokens (whole: 256 x 1000)",
    ),
    Case("engine restarts with one engine", ["--vllm_num_engines", "1", "--max_engine_restarts", "1"],
         "--max_engine_restarts 1 needs --vllm_num_engines 2 or more (got 1): a surviving engine generates a dead one's prompts"),  # fmt: skip
    Case("negative engine restarts", ["--max_engine_restarts", "-1"], "--max_engine_restarts -1 is not valid; expected an integer >= 0"),
    Case("zero device memory", ["--device_memory_gb", "0"], "--device_memory_gb 0.0 is not valid; expected a number of GB > 0"),
    Case("negative token budget", ["--max_tokens_per_micro_batch", "-1"],
         "--max_tokens_per_micro_batch -1 is not valid; expected an integer >= 0"),
    Case("token budget below one sequence", ["--max_tokens_per_micro_batch", "40"],  # the longest prompt: 38 tokens
         "--max_tokens_per_micro_batch 40 is below one sequence: the longest prompt (38 tokens) plus "
         "--response_length 16 make 54"),  # fmt: skip
    # ---- rewards, models, hub ----
    Case("reward model weight without a model", ["--reward_model_multiplier", "1"], "needs a reward model; pass --reward_model_path"),
    Case("no reward at all", ["--apply_verifiable_reward", "false"], "No reward is enabled"),
    Case("reward function file missing", ["--reward_function", "{tmp}/no_reward.py:score"],
         "--reward_function '{tmp}/no_reward.py:score': {tmp}/no_reward.py is not a file"),  # fmt: skip
    Case("reward function not in its file", ["--reward_function", "{tmp}/reward.py:scroe"],
         "reward.py defines no function 'scroe' (its functions: one_argument, score)", setup="reward_file"),  # fmt: skip
    Case("reward function with the wrong signature", ["--reward_function", "{tmp}/reward.py:one_argument"],
         "one_argument(response) cannot be called as one_argument(response, ground_truth)", setup="reward_file"),  # fmt: skip
    Case("reward function without a file name", ["--reward_function", "score"],
         "--reward_function 'score' is not a file and a function's name; give path/to/file.py:function"),  # fmt: skip
    Case("reward function with verifiable rewards off", ["--reward_function", "{tmp}/reward.py:score",
         "--apply_verifiable_reward", "false", "--reward_model_multiplier", "1", "--reward_model_path", "tiny"],
         "replaces the rows' verifiers, and --apply_verifiable_reward is false", setup="reward_file"),  # fmt: skip
    Case("policy folder missing", ["--model_name_or_path", "{tmp}/no_model"], "is not a folder; give an existing HF model folder"),
    Case("policy folder without a model", ["--model_name_or_path", "{tmp}/empty_model"], "Could not load the tokenizer", setup="empty_model"),
    Case(
        "value model with a smaller vocabulary",
        ["--value_model_path", "{tmp}/small_vocab_model"],
        "embeds 1000 token ids but the policy's tokenizer has 49152",
        setup="small_vocab_model",
    ),
    Case("push offline", ["--push_to_hub", "--hf_entity", "me"], "HF_HUB_OFFLINE is on"),
    Case("push without hf_entity, Hub unreachable", ["--push_to_hub"], "pass --hf_entity", env=HUB_ONLINE),
    Case("push with a bad repo name", ["--push_to_hub", "--hf_entity", "me", "--hf_repo_id", "bad name"],
         "Hub repo name (hf_repo_id, default exp_name) 'bad name' is not a valid name", env=HUB_ONLINE),  # fmt: skip
    # ---- output_dir and resume ----
    Case("output_dir is a file", ["--output_dir", "{tmp}/a_file"], "--output_dir '{tmp}/a_file' is not valid", setup="a_file"),
    Case("output_dir holds an earlier run", [], "already holds a run (metrics.jsonl, model); pass --resume", setup="earlier_run"),
    Case("overwrite, with a typo in the data path", ["--overwrite_output_dir", "true", "--dataset_mixer_list", "{tmp}/typo.jsonl", "1.0"],
         "Dataset path {tmp}/typo.jsonl does not exist", setup="earlier_run"),  # fmt: skip
    Case("overwrite, with a broken model folder", ["--overwrite_output_dir", "true", "--model_name_or_path", "{tmp}/empty_model"],
         "Could not load the tokenizer", setup="earlier_run_and_empty_model"),  # fmt: skip
    Case("fallback_save_dir is a file", ["--fallback_save_dir", "{tmp}/a_file"], "--fallback_save_dir '{tmp}/a_file' is not valid; expected a folder", setup="a_file"),
    Case("output_dir locked by a live run", [], "is in use by run other-run (pid", setup="locked"),
    Case("resume without a checkpoint", ["--resume"], "--resume found no complete checkpoint"),
    Case("resume from an incomplete checkpoint", ["--resume", "{tmp}/half"], "is not a complete checkpoint", setup="half"),
    Case("resume and overwrite", ["--resume", "--overwrite_output_dir", "true"], "pick one"),
    Case("resume with other settings", ["--resume", "--learning_rate", "1e-4"],
         "with other settings: --learning_rate 0.0001 (checkpoint: 3e-06); resume with the run's own flags",
         setup="checkpoint_at_lr_3e_6"),  # fmt: skip
    # ---- data ----
    Case("data file missing", ["--dataset_mixer_list", "{tmp}/none.jsonl", "1.0"], "Dataset path {tmp}/none.jsonl does not exist"),
    Case("hub dataset offline", ["--dataset_mixer_list", "no-such-owner/no-such-dataset", "1.0"],
         "Dataset no-such-owner/no-such-dataset is not a local file or folder, so it was read as a hub dataset, and "
         "HF_HUB_OFFLINE is set and the datasets cache has no copy of it"),  # fmt: skip
    Case("mixer amount missing", ["--dataset_mixer_list", "{data}"], "has an odd number of values"),
    Case("empty ground truth", [], "row 3: the ground truth is empty", rows=GOOD_ROWS[:3] + [arithmetic_row(ground_truth="")]),
    Case("no verifier name", [], "row 1: has a ground truth but no verifier name", rows=[arithmetic_row(), arithmetic_row(dataset=None)]),
    Case("unknown verifier", [], "row 0: Unknown verifier 'physics'", rows=[arithmetic_row(dataset="physics")]),
    Case("non-numeric answer", [], "row 2: Ground truth 'five' holds no number", rows=GOOD_ROWS[:2] + [arithmetic_row(ground_truth="five")]),
    Case("unknown IF func_name", [], "row 1: ifeval ground truth '{{\"func_name\": \"verify_keywordz\"}}': unknown func_name 'verify_keywordz'",
         rows=[arithmetic_row(), ifeval_row({"func_name": "verify_keywordz"})]),
    Case("unknown IFEval instruction id", [], "unknown instruction id 'keywords:existance'",
         rows=[ifeval_row({"instruction_id_list": ["keywords:existance"], "kwargs": [{}]})]),  # fmt: skip
    Case("IF constraint missing its argument", [],
         "IFEval constraint 'length_constraints:number_words' needs argument 'relation'",
         rows=[arithmetic_row(), ifeval_row({"instruction_id_list": ["length_constraints:number_words"], "kwargs": [{"num_words": 50}]})]),
    Case("no reward source", [], "row 1: has no reward source", rows=[arithmetic_row(), arithmetic_row(ground_truth=None)]),
    Case("row without a prompt", [], "row 0 has no prompt field", rows=[{"question": "2+3?", "ground_truth": "5"}]),
    Case("invalid JSON line", [], "line 2 is not valid JSON", raw_data=b'{"prompt": "a", "ground_truth": "1", "dataset": "arithmetic"}\n{oops\n'),
    Case("invalid UTF-8", [], "line 2 is not valid UTF-8", raw_data=b'{"prompt": "a", "ground_truth": "1", "dataset": "arithmetic"}\n{"prompt": "\xff"}\n'),
    Case("unknown chat template", ["--chat_template_name", "bogus"], "bogus"),
    # ---- code rows ----
    Case("code row without tests", [], "row 1: code tests '" + '{{"inputs": [], "outputs": []}}' + "' hold no test",
         rows=[code_row(GOOD_CODE_TESTS), code_row('{"inputs": [], "outputs": []}')]),
    Case("code tests not JSON", [], "row 0: code tests 'assert add(1, 2) == 3' are not valid JSON",
         rows=[code_row("assert add(1, 2) == 3")]),
    Case("code assert that cannot be checked outside the program", [], "row 0: code test 'total = add(1, 2)' cannot "
         "be checked outside the program (a statement that is not an assert)",
         rows=[code_row('["total = add(1, 2)\\nassert total == 3"]')]),
    Case("code inputs and outputs differ in length", [], "row 0: code tests have 2 inputs but 1 outputs",
         rows=[code_row('{"inputs": ["1", "2"], "outputs": ["1"]}')]),
    Case("code sandbox cannot start", [], "the data has code rows, whose tests run in a sandbox, but the code sandbox "
         "needs util-linux's", rows=[code_row(GOOD_CODE_TESTS)], env={"PATH": "/nonexistent"}),
    Case("unknown code sandbox", ["--code_sandbox", "none"], "--code_sandbox 'none' is not valid; expected one of isolated"),
    Case("zero code workers", ["--code_workers", "0"], "--code_workers 0 is not valid"),
    Case("zero reward timeout", ["--reward_timeout_s", "0"], "--reward_timeout_s 0.0 is not valid; expected a number > 0"),
    Case("negative reward failures in a row", ["--reward_max_consecutive_failures", "-1"],
         "--reward_max_consecutive_failures -1 is not valid; expected an integer >= 0 (0: never stop)"),
    Case("code pass threshold above 1", ["--code_pass_threshold", "1.5"], "--code_pass_threshold 1.5 is not valid"),
]  # fmt: skip


# ---- setups: files a case needs besides the data --------------------------------------------------------------------


def setup_empty_model(tmp: Path, out: Path) -> None:
    (tmp / "empty_model").mkdir()


def setup_small_vocab_model(tmp: Path, out: Path) -> None:
    from open_instruct.data.embedded import tiny_model_path

    folder = tmp / "small_vocab_model"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(tiny_model_path()) / name, folder / name)
    config = json.loads((Path(tiny_model_path()) / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))


def setup_reward_file(tmp: Path, out: Path) -> None:
    (tmp / "reward.py").write_text(
        "def score(response, ground_truth):\n    return 1.0\n\n\ndef one_argument(response):\n    return 1.0\n"
    )


def setup_tool_file(tmp: Path, out: Path) -> None:
    (tmp / "tools.py").write_text(
        "from open_instruct.environments import tools\n\n\n"
        "class NeedsKey(tools.Tool):\n    name, start, end = 'k', '<k>', '</k>'\n\n"
        "    def __init__(self):\n        raise RuntimeError('set MY_KEY')\n\n\n"
        "class EnvNeedsKey(tools.Environment):\n    end_strings = ('</k>',)\n\n"
        "    def __init__(self):\n        raise KeyError('MY_KEY')\n"
    )


def setup_a_file(tmp: Path, out: Path) -> None:
    (tmp / "a_file").write_text("not a folder")


def setup_earlier_run(tmp: Path, out: Path) -> None:
    (out / "metrics.jsonl").write_text('{"step": 1, "x": 1.0}\n')
    (out / "model").mkdir()
    (out / "model" / "config.json").write_text("{}")


def setup_earlier_run_and_empty_model(tmp: Path, out: Path) -> None:
    setup_earlier_run(tmp, out)
    (out / "logs").mkdir()
    (out / "logs" / "libraries.log").write_text("the earlier run's libraries\n")
    setup_empty_model(tmp, out)


def setup_half(tmp: Path, out: Path) -> None:
    (tmp / "half").mkdir()
    (tmp / "half" / "learner.pt").write_bytes(b"cut off")


def setup_checkpoint_at_lr_3e_6(tmp: Path, out: Path) -> None:
    from open_instruct.run.args import parse_args
    from open_instruct.run.checkpoint import LearnerStateFile, save_checkpoint

    args = parse_args(BASE + ["--dataset_mixer_list", str(tmp / "train.jsonl"), "1.0", "--output_dir", str(out)])
    state = {"policy": {}, "value_model": {}}
    save_checkpoint(str(out), 2, LearnerStateFile(state), {"step": 2}, args, keep_last_n=1)


def setup_locked(tmp: Path, out: Path):
    lock = open(out / ".run.lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a live run holds it
    lock.write("run other-run (pid 1 on elsewhere, since 2026-01-01 00:00:00)")
    lock.flush()
    return lock


# ---- running a case -------------------------------------------------------------------------------------------------


def prepare(case: Case, tmp: Path) -> tuple[list[str], Path, dict[str, bytes]]:
    out = tmp / "output"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file, which must survive")
    data = tmp / "train.jsonl"
    if case.raw_data is not None:
        data.write_bytes(case.raw_data)
    else:
        data.write_text("".join(json.dumps(row) + "\n" for row in (case.rows or GOOD_ROWS)))
    flags = [f.format(data=data, out=out, tmp=tmp) for f in case.flags]
    config_first = flags[:1] if flags and flags[0].endswith(".yaml") else []
    argv = config_first + BASE + ["--dataset_mixer_list", str(data), "1.0", "--output_dir", str(out)] + flags[len(config_first):]
    if "--dataset_mixer_list" in flags:  # the case's own mixer replaces the default one
        index = argv.index("--dataset_mixer_list")
        del argv[index : index + 3]
    return argv, out, {}


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes, except the run lock (an empty file a refused run may add)."""
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != ".run.lock"
    }


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_fails_fast_with_one_line(case: Case, tmp_path, capsys, monkeypatch):
    argv, out, _ = prepare(case, tmp_path)
    held_lock = globals()[f"setup_{case.setup}"](tmp_path, out) if case.setup else None
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    if case.env.get("HF_HUB_OFFLINE") == "0":
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read once at import; this case is "online"
    before = snapshot(out)
    capsys.readouterr()
    start = time.time()
    with pytest.raises(SystemExit) as exit_info:
        cli(argv)
    seconds = time.time() - start
    captured = capsys.readouterr()
    if held_lock is not None:
        held_lock.close()
    error_lines = [line for line in captured.err.splitlines() if line.startswith("error:")]
    message = error_lines[-1] if error_lines else ""
    RESULTS.append((case.name, exit_info.value.code, seconds, message))

    assert exit_info.value.code == 2, captured.err[-2000:]
    assert len(error_lines) == 1 and captured.err.strip().endswith(message), captured.err[-2000:]
    assert "Traceback" not in captured.err
    assert case.expected.format(tmp=tmp_path, out=out) in message, message
    assert seconds < TIME_BOUND_S
    assert "[vllm] engine" not in captured.out + captured.err, "a model was loaded before the error"
    assert snapshot(out) == before, "the run changed output_dir's earlier contents"


def test_debug_flag_shows_the_traceback(tmp_path, capsys):
    argv, _, _ = prepare(CASES[0], tmp_path)
    with pytest.raises(SystemExit):
        cli(argv + ["--debug", "true"])
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: --temperature 0.0 is not valid")


def test_settings_that_work_but_not_as_written_are_named_at_start(tmp_path, capsys):
    """Episodes a step cannot hold, a flag that does nothing and checkpoints that never come: one warning line each, before anything loads (the
    run here then stops on a missing data file)."""
    flags = ["--total_episodes", "20", "--save_freq", "5", "--inflight_updates", "true", "--dataset_mixer_list",
             "{tmp}/typo.jsonl", "1.0"]  # fmt: skip
    argv, _, _ = prepare(Case("warnings", flags, expected=""), tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli(argv)
    assert exit_info.value.code == 2
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[ppo] warning:")]
    assert warnings == [
        "[ppo] warning: --total_episodes 20 is not a multiple of a step's 8 responses: the run trains 2 steps (16 "
        "episodes) and drops the last 4; pass --total_episodes 16 or 24.",
        "[ppo] warning: --inflight_updates does nothing at --async_steps 1: the engine holds one batch at a time and "
        "takes each policy between batches; pass --async_steps 2 or more for it, or drop it.",
        "[ppo] warning: --save_freq 5 is more than the run's 2 steps: no checkpoint will be written (only the final "
        "model, and one on SIGTERM/SIGINT); pass --save_freq 2 or less for one.",
    ]


def test_a_failed_start_removes_the_output_dir_it_made(tmp_path, capsys):
    """A new --output_dir that a refused start (here a typo in the data path, found after the folder is locked) made
    is gone again, not left holding only the run lock; one that existed stays, with the user's files."""
    argv, out, _ = prepare(Case("typo", ["--dataset_mixer_list", "{tmp}/typo.jsonl", "1.0"], expected=""), tmp_path)
    new_dir = tmp_path / "new" / "output"
    with pytest.raises(SystemExit) as exit_info:
        cli([a if a != str(out) else str(new_dir) for a in argv])
    assert exit_info.value.code == 2 and "typo.jsonl does not exist" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # nor the parent it made
    with pytest.raises(SystemExit):
        cli(argv)
    assert (out / "notes.txt").exists()


def test_a_step_two_cpu_cores_cannot_sample_in_a_day_is_refused(monkeypatch):
    """The rate the day's-work check assumes is the device's: on CPUs a generous 1,000 tokens/s per core (the engine
    measured ~120), so 192 M response tokens a step are refused on 2 cores (at the 10,000 tokens/s per engine assumed
    before, 5.3 hours: accepted), and on a GPU engine they are not."""
    import torch

    from open_instruct.run.args import ConfigError, compute_batch_sizes, parse_args
    from open_instruct.run.validation import generous_sampling_rate, validate_work

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU machine's rate, on any test machine
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    args = parse_args(BASE + ["--number_samples_per_prompt", "3000000", "--total_episodes", "12000000"])
    with pytest.raises(ConfigError, match=r"one step samples up to 192,000,000 response tokens .* more than a day's "
                                          r"work even at 2,000 tokens/s \(2 CPU core\(s\)\)"):  # fmt: skip
        validate_work(args, compute_batch_sizes(args))
    assert generous_sampling_rate(True, 1, 2) == (200_000, "1 GPU engine(s)")
    assert 192_000_000 / generous_sampling_rate(True, 1, 2)[0] < 24 * 3600


SUBPROCESS_CASES = ["temperature 0", "no verifier name", "output_dir locked by a live run"]


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_bad_input_as_a_real_process(name, tmp_path):
    """The process itself: exit code 2, stderr's last line the error, quickly, and output_dir intact."""
    case = next(case for case in CASES if case.name == name)
    argv, out, _ = prepare(case, tmp_path)
    held_lock = globals()[f"setup_{case.setup}"](tmp_path, out) if case.setup else None
    before = snapshot(out)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    start = time.time()
    process = subprocess.run(
        [sys.executable, "-m", "open_instruct.ppo_vllm_thread_ray_gtrl", *argv],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    seconds = time.time() - start
    if held_lock is not None:
        held_lock.close()
    last_line = process.stderr.strip().splitlines()[-1]
    RESULTS.append((f"{name} (process)", process.returncode, seconds, last_line))
    assert process.returncode == 2, process.stderr[-2000:]
    assert last_line.startswith("error: ") and case.expected.format(tmp=tmp_path) in last_line, last_line
    assert "Traceback" not in process.stderr
    assert seconds < SUBPROCESS_TIME_BOUND_S
    assert snapshot(out) == before


# Runs an entry point as `python -m` does (runpy, as __main__) and, when it exits, says which heavy libraries it had
# loaded by then: the command-line check must end the process before the trainer's imports.
RUN_AS_MAIN = """
import runpy, sys
entry, sys.argv = sys.argv[1], sys.argv[1:]
try:
    runpy.run_module(entry, run_name="__main__", alter_sys=True)
finally:
    print("loaded:", sorted(name for name in ("torch", "vllm", "datasets", "deepspeed", "ray") if name in sys.modules))
"""


@pytest.mark.parametrize("entry, flags, code, expected", [
    ("open_instruct.ppo_vllm_thread_ray_gtrl", [*BASE, "--learning_rat", "1e-5"], 2,
     "error: Unknown arguments ['--learning_rat', '1e-5']"),
    ("open_instruct.grpo_vllm_thread_ray_gtrl", [*BASE, "--per_device_train_batch_size", "3"], 2,
     "error: --per_device_train_batch_size 3 does not divide the minibatch of 8 responses"),
    ("open_instruct.grpo_vllm_thread_ray_gtrl", [*BASE, "--number_samples_per_prompt", "0"], 2,
     "error: --number_samples_per_prompt 0 is not valid; expected an integer >= 1."),
    ("open_instruct.ppo_vllm_thread_ray_gtrl", [*BASE, "--local_rollout_batch_size", "-4"], 2,
     "error: --local_rollout_batch_size -4 is not valid; expected an integer >= 1."),
    ("open_instruct.ppo_vllm_thread_ray_gtrl", ["--help"], 0, "--per_device_train_batch_size"),
])  # fmt: skip
def test_a_mistyped_command_line_is_answered_before_the_trainers_imports(entry, flags, code, expected, tmp_path):
    """Both entry points parse the flags first (run/command_line.py): a typo or batch sizes that do not fit exit with
    code 2 and one line, and `--help` lists the flags, while torch, vLLM and datasets are not even loaded (~2 s, not
    the ~8 s of the trainer's imports). (Values of the wrong type take the same path: the in-process cases above.)"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    process = subprocess.run([sys.executable, "-c", RUN_AS_MAIN, entry, *flags], capture_output=True, text=True,
                             env=env, cwd=tmp_path, timeout=120)  # fmt: skip
    assert process.returncode == code, process.stderr[-2000:]
    # (No "loaded:" line at all: the process ended by the trainer's cli, whose os._exit skips `finally`.)
    assert process.stdout.strip().splitlines()[-1:] == ["loaded: []"], process.stdout[-2000:]
    if code == 2:
        last_line = process.stderr.strip().splitlines()[-1]
        assert last_line.startswith(expected), last_line
        assert "Traceback" not in process.stderr
    else:
        assert expected in process.stdout and "--learning_rate" in process.stdout


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
@pytest.mark.parametrize("value", ["0", "-4"])
@pytest.mark.parametrize("flag", SIZE_FLAGS)
def test_a_size_below_one_is_named_by_its_flag_before_the_trainers_imports(flag, value, algorithm, capsys):
    """The command line's early check computes the batch sizes before each flag's own check runs: a size below 1 is
    refused there by its own flag, not as a division by zero or as another flag's mistake."""
    with pytest.raises(SystemExit) as exit_info:
        exit_on_bad_command_line([*BASE, f"--{flag}", value], algorithm)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: --{flag} {value} is not valid; expected an integer >= 1."


def test_an_output_dir_that_cannot_be_written_is_one_line(tmp_path):
    """An --output_dir under a read-only mount (a real one: a tmpfs mounted read-only in a private mount namespace)
    names the folder and the fix, exit code 2, instead of the run's traceback."""
    reason = small_disk_unavailable()
    if reason is not None:
        pytest.skip(reason)
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    command = [sys.executable, "-m", "open_instruct.ppo_vllm_thread_ray_gtrl", *BASE,
               "--output_dir", str(read_only / "runs" / "out")]  # fmt: skip
    script = f"mount -t tmpfs -o ro tmpfs {shlex.quote(str(read_only))} || exit 99; exec {shlex.join(command)}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    process = subprocess.run(["unshare", "-m", "bash", "-c", script], capture_output=True, text=True, env=env,
                             timeout=120)  # fmt: skip
    assert process.returncode == 2, process.stderr[-2000:]
    assert process.stderr.strip().splitlines()[-1] == (
        f"error: --output_dir {read_only}/runs/out cannot be written (Read-only file system: {read_only}/runs); give "
        f"an --output_dir on a disk this user can write to, or make {read_only} writable.")  # fmt: skip
    assert "Traceback" not in process.stderr


@pytest.mark.parametrize("exit_with, code, stderr", [
    ("None", 0, ""), ("2", 2, ""), ("'error: the message'", 1, "error: the message"),
])  # fmt: skip
def test_the_exit_without_teardown_keeps_the_exit_code_and_what_was_printed(exit_with, code, stderr):
    """The trainer's `python -m` ends by console.exit_without_teardown (os._exit after flushing): the exit code of
    sys.exit, its message, and everything printed before it (buffered in a pipe) still reach the caller."""
    script = ("import sys; from open_instruct.run import console\n"
              f"console.exit_without_teardown(lambda: (print('the last line', end=''), sys.exit({exit_with})))")  # fmt: skip
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}  # stdout block-buffered
    process = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert (process.returncode, process.stdout, process.stderr.strip()) == (code, "the last line", stderr)


@pytest.mark.parametrize("ends_without_teardown", [True, False])
def test_what_is_kept_until_exit_is_freed_with_the_process_only_when_it_ends_without_teardown(ends_without_teardown):
    """The in-process engine is kept until exit (console.keep_until_exit: vLLM's shutdown only frees memory, ~1 s):
    its finalizer never runs in a process that ends by os._exit, and does at once in one that goes on (tests calling
    `main` in process)."""
    script = ("import weakref; from open_instruct.run import console\n"
              "class Engine: pass\n"
              "def entry():\n"
              "    engine = Engine()\n"
              "    weakref.finalize(engine, print, 'engine freed', flush=True)\n"
              "    console.keep_until_exit(engine)\n"
              "    del engine\n"
              "    print('entry returned', flush=True)\n"
              + ("console.exit_without_teardown(entry)\n" if ends_without_teardown else "entry()\n"))  # fmt: skip
    process = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert process.returncode == 0, process.stderr[-2000:]
    lines = process.stdout.splitlines()
    assert lines == (["entry returned"] if ends_without_teardown else ["engine freed", "entry returned"]), lines


def test_print_the_table():
    """Not a check: prints the table of every case run above (pytest -s shows it)."""
    print("\n| case | exit code | seconds | message |\n| --- | --- | --- | --- |")
    for name, code, seconds, message in RESULTS:
        print(f"| {name} | {code} | {seconds:.2f} | {message} |")
