"""What a learner rank holds, item by item, and the bytes of each, from the models' configs and the run's flags
before any model loads: per backend (the single-process learner, DeepSpeed ZeRO-2 and ZeRO-3), for the trainable and
the frozen models, the transients of each phase of a step and the weight sync. memory_budget.py sums them into the
plan of a rank and checks it against the device; engine_memory.py counts what a vLLM engine takes.

What is counted, and where the numbers come from (P parameters of a model, N learner ranks; bytes):

- **Trainable models** (policy; PPO's value model). One process (and DeepSpeed ZeRO-0): fp32 weights 4P, fp32
  gradients 4P, AdamW's two moments 8P. DeepSpeed 0.19.8 (`runtime/zero/stage_1_and_2.py`, `stage3.py`), with w
  the bytes of the weights the engine computes with (2 for bf16, 4 for fp32, --deepspeed_weights_dtype):
  - ZeRO-2: the whole weights wP (one flat buffer); fp32 masters 4P/N (always a copy: `single_partition_of_fp32_groups`
    is cloned even from fp32 weights); the fp32 gradient partition 4P/N from the model's first backward to the end
    of its step (policy and value model interleave their micro-batches: with several micro-batches per step both
    hold their gradients, with one they never overlap); a reduce
    bucket (`reduce_bucket_size` elements) during each backward of one model; AdamW's moments 8P/N from the first
    step.
  - ZeRO-3: weights wP/N; fp32 masters 4P/N (a copy even of fp32 weights: `fp32_partitioned_groups_flat`); the
    fp32 gradient partitions 4P/N and the reduce bucket are allocated when the engine is built; AdamW 8P/N; and
    while a model runs, its gathered parameters: at most the model, else the module running, the prefetch bucket
    and the parameters kept for reuse (`stage3_prefetch_bucket_size`, `stage3_max_reuse_distance`;
    configs/ds_configs/*.json).
  - The optimizer step, one model at a time: AdamW's `sqrt(v)` temporaries (fp32; 8 bytes per parameter of a tensor
    on CPUs, stepped tensor by tensor; 4 per parameter of the whole list on GPUs, `foreach`), at ZeRO-3 per sub-group
    (`sub_group_size`) and with the sub-group's gradient flattened into a new fp32 tensor first (4 more).
- **LoRA** (--lora_rank): a trainable model keeps its whole weights (the frozen base: fp32 in one process, wP or
  wP/N on DeepSpeed), but gradients, AdamW's moments, ZeRO's fp32 masters and the step's temporaries are those of its
  T trained parameters only (the adapters, and a value model's score head): 4P + 12T instead of 16P in one process;
  no reference model (the policy with its adapters disabled is the reference). The weight sync computes each adapted
  layer's merged weight in fp32 from its gathered base (the merged tensor, and an fp32 copy of a bf16 base).
- **Frozen models** (reference with a non-zero --beta, reward model with a non-zero --reward_model_multiplier) in the
  inference dtype (bf16 on GPUs, fp32 on CPUs): whole, or 1/N at ZeRO-3 plus their gathered parameters while they run.
- **Activations** of one micro-batch of b rows x T tokens (prompt + response), what autograd saves per Llama-style layer
  and token, with h hidden, q = heads x head_dim, I intermediate, H heads (counted with saved_tensors_hooks on
  transformers 5.19's Llama with SDPA, tests/test_memory_plan.py checks them):
  fp32 `24h + 16q + 16I + 4H + 8 + 4T`; bf16 autocast on fp32 weights `26h + 8q + 8I + 4H + 8 + 2T` plus a bf16 copy
  of every weight (2P) until the backward; bf16 weights `16h + 8q + 8I + 4H + 8 + 2T` (the T term is a per-layer copy
  of the attention mask). With gradient checkpointing only each layer's input stays (4h, or 2h on bf16 weights), and
  the backward recomputes one layer at a time. One more layer's worth is the backward's own workspace.
- **Logits**: with --logprob_chunk_size C, the largest is [C, vocab] fp32; a chunk's forward and backward peak at 20
  bytes per element of [C, vocab] (17 without gradients); with 0, the whole micro-batch's [b, response, vocab]
  peaks at 16 bytes per element (measured on a CPU: scripts/benchmark/memory_plan_vs_measured.py).
- **The process**: on GPUs the CUDA context, NCCL and the caching allocator's slack (assumed: 1.5 GiB + 5%); on
  CPUs the Python process with torch, transformers and DeepSpeed (measured here). A device the vLLM engine shares
  (one process on a GPU, --single_gpu_mode) gives it --vllm_gpu_memory_utilization of its memory; a CPU process
  that holds the in-process engine gives it its weights, its KV cache (VLLM_CPU_KVCACHE_SPACE) and the copies of
  the policy handed to it.
- **The weight sync** (Ray learners): learner rank 0 sends the policy to the engines between steps, one tensor at a
  time, packed into chunks on GPUs (`weight_sync_items`: at 8B in bf16, 7.4 GB at ZeRO-3). The plan is rank 0's.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from open_instruct.run.args import Args
from open_instruct.run.model_shapes import ModelShape, describe_count

GB = 1e9  # the plan speaks in GB (10^9 bytes), as GPUs are sold: an "80 GB" H100 holds 85.0e9 bytes
DS_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "ds_configs"
# DeepSpeed 0.19.8's defaults for the keys a config leaves out (runtime/zero/config.py).
DS_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
}
GPU_PROCESS_BYTES = 1.5 * GB  # CUDA context, NCCL buffers, cuBLAS workspaces; one process without NCCL: 0.80 GB measured (H200, torch 2.11, CUDA 13)
GPU_ALLOCATOR_SLACK = 0.05  # the caching allocator's fragmentation, on top of what tensors hold (assumed)
CPU_PROCESS_BYTES = 0.7 * GB  # Python, torch, transformers, DeepSpeed, gloo, a tokenizer: measured in a learner rank
LOGIT_BYTES_TRAIN, LOGIT_BYTES_NO_GRAD, LOGIT_BYTES_WHOLE = 20.0, 17.0, 16.0  # per [positions x vocab] element
ADAM_TEMPORARY_BYTES = {"cpu": 8, "gpu": 4}  # per stepped parameter (step_temporaries says why)

# The packed transfer's rotating buffers (generation/weight_transfer.PACKED_NUM_BUFFERS; run/ cannot import it).
PACKED_SYNC_BUFFERS = 2

HELD, LOADING, FORWARD, TRAINING, STEP, SYNC = "held", "loading", "forward", "fwd/bwd", "opt step", "wt sync"
PHASES = (FORWARD, TRAINING, STEP, SYNC)  # steady state: held + the largest of these


@dataclass
class Item:
    name: str
    at_load: float  # bytes
    steady: float  # bytes
    when: str  # HELD, LOADING, or one of PHASES
    fix: str  # what changes it: a flag, said when the item is the biggest of a run that cannot fit


@dataclass
class Layout:
    """How a learner rank holds its models: what the flags and the device decide."""

    device: str  # "gpu" or "cpu"
    ranks: int
    stage: int | None  # DeepSpeed ZeRO stage; None: the single-process learner (no DeepSpeed)
    weight_bytes: int  # of the trainable models' weights as the learner computes with them
    compute_bytes: int
    frozen_bytes: int
    micro_batch: int
    seq_len: int
    response_len: int
    chunk: int
    checkpointing: bool
    accumulation: int  # micro-batches a rank sums into one optimizer step
    engine_share: str  # "" / "gpu" (the engine takes a fraction of this GPU) / "cpu" (in this process)
    ds: dict = field(default_factory=dict)

    @property
    def regime(self) -> str:
        if self.compute_bytes == 4:
            return "fp32"
        return "bf16" if self.weight_bytes == 2 else "autocast"


def dtype_label(nbytes: int) -> str:
    return {2: "bf16", 4: "fp32"}[nbytes]


def ds_settings(stage: int | None) -> dict:
    """The ZeRO numbers the plan uses, from configs/ds_configs (DeepSpeed's defaults for keys left out)."""
    if stage is None:
        return {}
    settings = {}
    for name in (f"zero{stage}_train.json", "zero3_inference.json"):
        path = DS_CONFIG_DIR / name
        zero = json.loads(path.read_text()).get("zero_optimization", {}) if path.is_file() else {}
        prefix = "inference_" if "inference" in name else ""
        for key, default in DS_DEFAULTS.items():
            settings[prefix + key] = int(float(zero.get(key, default)))
    return settings


def layout_of(args: Args, device: str, longest_prompt: int | None = None) -> Layout:
    """The learner's layout on `device` ("gpu"/"cpu"): ranks, ZeRO stage, dtypes, batch shape, engine sharing.
    `longest_prompt`: the training data's longest prompt in tokens, when known (else --max_prompt_token_length)."""
    dist, ppo, gen = args.dist, args.ppo, args.gen
    compute = {"float32": 4, "bfloat16": 2}.get(args.model.learner_compute_dtype, 2 if device == "gpu" else 4)
    stage = dist.deepspeed_stage if dist.uses_ray else None
    weights = 4
    if stage in (2, 3):
        requested = dist.deepspeed_weights_dtype
        weights = 2 if requested == "bfloat16" or (requested == "auto" and device == "gpu" and compute == 2) else 4
    ranks = dist.num_learners if dist.uses_ray else 1
    minibatch = ppo.local_rollout_batch_size * ppo.number_samples_per_prompt // ppo.num_mini_batches
    engine_share = ""
    if dist.vllm_num_engines == 0 and not dist.uses_ray:
        engine_share = device  # the in-process engine: on this GPU, or in this CPU process
    elif dist.single_gpu_mode and device == "gpu":
        engine_share = "gpu"
    return Layout(
        device=device,
        ranks=ranks,
        stage=stage,
        weight_bytes=weights,
        compute_bytes=compute,
        frozen_bytes=2 if device == "gpu" else 4,
        micro_batch=ppo.per_device_train_batch_size,
        seq_len=min(gen.max_token_length, (longest_prompt or args.data.max_prompt_token_length) + gen.response_length),
        response_len=gen.response_length,
        chunk=ppo.logprob_chunk_size,
        checkpointing=args.model.gradient_checkpointing,
        accumulation=max(1, minibatch // (ppo.per_device_train_batch_size * ranks)),
        engine_share=engine_share,
        ds=ds_settings(stage),
    )


# ---- activations and logits -------------------------------------------------------------------------------------


def layer_bytes_per_token(shape: ModelShape, regime: str, seq_len: int) -> float:
    """What autograd saves per layer and token (module docstring; counted by tests/test_memory_plan.py)."""
    h, q, i, heads = shape.hidden_size, shape.attention_width, shape.intermediate_size, shape.num_heads
    if regime == "fp32":
        return 24 * h + 16 * q + 16 * i + 4 * heads + 8 + 4 * seq_len
    if regime == "autocast":
        return 26 * h + 8 * q + 8 * i + 4 * heads + 8 + 2 * seq_len
    return 16 * h + 8 * q + 8 * i + 4 * heads + 8 + 2 * seq_len


def activation_bytes(shape: ModelShape, layout: Layout) -> float:
    """One micro-batch's forward + backward of `shape`: saved activations, the backward's workspace, and on bf16
    autocast over fp32 weights the bf16 copies of the weights autograd keeps for the backward."""
    tokens = layout.micro_batch * layout.seq_len
    per_layer = tokens * layer_bytes_per_token(shape, layout.regime, layout.seq_len)
    if layout.checkpointing:
        residual = 2 if layout.weight_bytes == 2 else 4
        saved = tokens * shape.num_layers * residual * shape.hidden_size + 2 * per_layer  # + a recomputed layer
    else:
        saved = shape.num_layers * per_layer + per_layer
    final_norm = tokens * 8 * shape.hidden_size
    weight_casts = 2 * shape.num_params if layout.regime == "autocast" else 0
    return saved + final_norm + weight_casts


def logits_bytes(shape: ModelShape, layout: Layout, with_grad: bool) -> tuple[float, str]:
    """The logprob (and entropy) pass's largest tensors over the vocabulary, and how they are described."""
    positions = layout.micro_batch * layout.response_len
    if layout.chunk == 0:
        return LOGIT_BYTES_WHOLE * positions * shape.vocab_size, f"whole: {layout.micro_batch} x {layout.response_len}"
    chunk = min(layout.chunk, positions)
    per_element = LOGIT_BYTES_TRAIN if with_grad else LOGIT_BYTES_NO_GRAD
    return per_element * chunk * shape.vocab_size, f"chunks of {chunk}"


# ---- the items ---------------------------------------------------------------------------------------------------


def gathered_bytes(shape: ModelShape, layout: Layout, dtype_bytes: int, inference: bool) -> float:
    """ZeRO-3: a running model's gathered parameters (module docstring)."""
    prefix = "inference_" if inference else ""
    bound = (shape.largest_module_params + layout.ds[prefix + "stage3_prefetch_bucket_size"]
             + layout.ds[prefix + "stage3_max_reuse_distance"])  # fmt: skip
    return dtype_bytes * min(shape.num_params, bound)


def trained_params(shape: ModelShape) -> int:
    """The parameters that get gradients and AdamW moments: with --lora_rank the adapters' (and a score head's)."""
    return shape.num_params if shape.trained_params is None else shape.trained_params


def trainable_items(shape: ModelShape, layout: Layout) -> list[Item]:
    p, n, stage, w = shape.num_params, layout.ranks, layout.stage, layout.weight_bytes
    role, shard = shape.role, f", 1/{n}" if n > 1 else ""
    more_ranks = "more learner ranks (--num_learners_per_node)" + ("" if stage == 3 else " at --deepspeed_stage 3")
    if stage in (None, 0):
        lora = "" if shape.trained_params is None else f", LoRA: {describe_count(shape.trained_params)} trained"
        return [
            Item(f"{role} weights (fp32{lora})", 4 * p, 4 * p, HELD, more_ranks),
            *gradient_items(shape, layout, HELD),
            Item(f"{role} AdamW moments (fp32)", 0, 8 * trained_params(shape), HELD, more_ranks),
        ]
    weights, t = (w * p if stage == 2 else w * p / n), trained_params(shape)
    # With LoRA the frozen base is among the engine's weights (DeepSpeed casts it to w bytes too), and the optimizer's
    # masters and moments are the trained parameters' alone.
    lora = "" if shape.trained_params is None else " of the trained"
    items = [
        Item(f"{role} weights ({dtype_label(w)}{'' if stage == 2 else shard})", weights, weights, HELD, more_ranks),
        Item(f"{role} fp32 master weights{lora}{shard}", 4 * t / n, 4 * t / n, HELD, more_ranks),
        *gradient_items(shape, layout, HELD),
        Item(f"{role} AdamW moments (fp32{lora}{shard})", 0, 8 * t / n, HELD, more_ranks),
    ]
    if stage == 3:  # ZeRO-3 allocates its reduce bucket with the engine (ZeRO-2: `reduce_bucket_item`)
        bucket = reduce_bucket_bytes(shape, layout)
        items.append(Item(f"{role} gradient reduce bucket", bucket, bucket, HELD,
                          "a smaller reduce_bucket_size in configs/ds_configs"))  # fmt: skip
    return items


def gradient_items(shape: ModelShape, layout: Layout, phase: str) -> list[Item]:
    """A trainable model's fp32 gradients (whole, or its 1/N partition at ZeRO-2/3), listed under `phase`.
    ZeRO-3 allocates its partitions with the engine: held. Elsewhere they live from the model's first backward to
    the end of its optimizer step (then freed: DeepSpeed's stage_1_and_2.py, the single process's set_to_none);
    policy and value model interleave their micro-batches, so with more than one micro-batch per step both models
    hold theirs (held), and with one they never overlap (a part of that model's forward + backward and of its step).
    """
    p, n, stage = trained_params(shape), layout.ranks, layout.stage
    held_throughout = stage == 3 or layout.accumulation > 1
    if held_throughout != (phase == HELD):
        return []
    more_ranks = "more learner ranks (--num_learners_per_node)" + ("" if stage == 3 else " at --deepspeed_stage 3")
    size = 4 * p if stage in (None, 0) else 4 * p / n
    shard = f", 1/{n}" if n > 1 and stage in (2, 3) else ""
    at_load = size if stage == 3 else 0
    return [Item(f"{shape.role} gradients (fp32{shard})", at_load, size, phase, more_ranks)]


def reduce_bucket_bytes(shape: ModelShape, layout: Layout) -> float:
    bucket_elements = layout.ds["reduce_bucket_size"]
    if layout.device == "cpu":  # only what gradients fill of it is resident, never more than the model
        bucket_elements = min(bucket_elements, shape.num_params)
    return layout.weight_bytes * bucket_elements


def reduce_bucket_item(shape: ModelShape, layout: Layout) -> list[Item]:
    """ZeRO-2 fills its reduce bucket (plus one parameter's own gradient) during each backward of the model, and
    frees it after: part of that model's forward + backward, never of two models at once."""
    if layout.stage != 2:
        return []
    bucket = reduce_bucket_bytes(shape, layout) + layout.weight_bytes * shape.largest_param
    return [Item(f"{shape.role} gradient reduce bucket", 0, bucket, TRAINING,
                 "a smaller reduce_bucket_size in configs/ds_configs")]  # fmt: skip


def step_temporaries(shape: ModelShape, layout: Layout) -> float:
    """AdamW's `sqrt(v) / c` (two fp32 temporaries) over what one step call sees, and ZeRO-3's copy of the gradient."""
    p, n = trained_params(shape), layout.ranks
    # torch AdamW: on CPUs tensor by tensor, `(sqrt(v) / c).add_(eps)` (two fp32 temporaries of the tensor); on GPUs
    # `foreach` over the whole list at once, one fp32 temporary (`_foreach_sqrt`) of everything it steps.
    adam = ADAM_TEMPORARY_BYTES[layout.device]
    if layout.stage in (None, 0):
        return adam * (min(shape.largest_param, p) if layout.device == "cpu" else p)
    if layout.stage == 2:  # one flat partition, its gradient already flat
        return adam * p / n
    sub_group = min(p / n, layout.ds["sub_group_size"])  # ZeRO-3 steps one sub-group at a time
    return (4 + adam) * sub_group  # + the sub-group's gradients flattened into a new fp32 tensor


def frozen_items(shape: ModelShape, layout: Layout) -> list[Item]:
    f, p, n = layout.frozen_bytes, shape.num_params, layout.ranks
    fix = "--beta 0 (no reference model)" if shape.role == "reference policy" else "more ranks at --deepspeed_stage 3"
    if layout.stage == 3:
        name = f"{shape.role} weights ({dtype_label(f)}{f', 1/{n}' if n > 1 else ''})"
        return [Item(name, f * p / n, f * p / n, HELD, fix)]
    return [Item(f"{shape.role} weights ({dtype_label(f)})", f * p, f * p, HELD, fix + " or --deepspeed_stage 3")]


def phase_items(shapes: list[ModelShape], layout: Layout) -> list[Item]:
    """The transients of each phase of a step, for the model whose pass is the largest in that phase."""
    train_fix = "--gradient_checkpointing true" if not layout.checkpointing else "a lower --per_device_train_batch_size"
    chunk_fix = "--logprob_chunk_size 1024" if layout.chunk == 0 else "a lower --logprob_chunk_size"
    zero3_fix = "lower stage3_max_reuse_distance in configs/ds_configs"
    training, forward = [], []
    for shape in shapes:
        pass_items = []
        if shape.trainable:
            pass_items.append(Item(f"activations: {shape.role}, {layout.micro_batch} x {layout.seq_len} tokens"
                                   f"{', checkpointed' if layout.checkpointing else ''}", 0,
                                   activation_bytes(shape, layout), TRAINING, train_fix))  # fmt: skip
            if shape.causal_lm:
                size, how = logits_bytes(shape, layout, with_grad=True)
                pass_items.append(Item(f"logits over {shape.vocab_size} tokens ({how})", 0, size, TRAINING, chunk_fix))
            if layout.stage == 3:
                size = gathered_bytes(shape, layout, layout.weight_bytes, inference=False)
                pass_items.append(Item(f"ZeRO-3 gathered parameters ({shape.role})", 0, size, TRAINING, zero3_fix))
            training.append(pass_items + reduce_bucket_item(shape, layout) + gradient_items(shape, layout, TRAINING))
        # Every model runs forward over the rollout without gradients, a micro-batch at a time.
        one_layer = layout.micro_batch * layout.seq_len * layer_bytes_per_token(shape, layout.regime, layout.seq_len)
        no_grad = [Item(f"forward without gradients ({shape.role})", 0, one_layer, FORWARD, train_fix)]
        if shape.causal_lm:
            size, how = logits_bytes(shape, layout, with_grad=False)
            no_grad.append(Item(f"logits without gradients ({how})", 0, size, FORWARD, chunk_fix))
        if layout.stage == 3:
            dtype_bytes = layout.weight_bytes if shape.trainable else layout.frozen_bytes
            size = gathered_bytes(shape, layout, dtype_bytes, inference=not shape.trainable)
            no_grad.append(Item(f"ZeRO-3 gathered parameters ({shape.role}, forward)", 0, size, FORWARD, zero3_fix))
        forward.append(no_grad)
    more_ranks = "more learner ranks (--num_learners_per_node)"
    step = [[Item(f"optimizer step temporaries ({shape.role})", 0, step_temporaries(shape, layout), STEP, more_ranks),
             *gradient_items(shape, layout, STEP)] for shape in shapes if shape.trainable]  # fmt: skip
    return [item for groups in (forward, training, step) for item in max(groups, key=group_bytes)]


def group_bytes(items: list[Item]) -> float:
    return sum(item.steady for item in items)


def loading_item(shapes: list[ModelShape], layout: Layout) -> Item | None:
    """The transient of loading on top of what the loaded models and their engines hold at the end of it (the peak
    of loading is at its end, the last engine built, plus this). None where there is none."""
    trainable = [shape for shape in shapes if shape.trainable]
    if layout.stage == 2:
        # Whole models load in fp32 and stay fp32 until their engine is built: with bf16 weights every trainable model
        # is 4P before the first engine casts it; and building an engine makes a temporary fp32 copy of the rank's
        # partition beside the master weights it becomes (4P/N more while it is built: measured 4P/N at 1 and 2 ranks
        # on both models, not the whole flat buffer).
        cast = sum((4 - layout.weight_bytes) * shape.num_params for shape in trainable)
        flatten = max(4 * trained_params(shape) / layout.ranks for shape in trainable)
        return Item("loading: fp32 loads, flattening into DeepSpeed's buffers", cast + flatten, 0, LOADING,
                    "--deepspeed_stage 3 (each model loads partitioned)")  # fmt: skip
    if layout.stage is None and layout.device == "cpu":
        # from_pretrained maps the checkpoint file: its pages are resident while a model is read.
        size = max(shape.checkpoint_bytes * shape.num_params for shape in shapes)
        return Item("loading: the checkpoint's pages while it is read", size, 0, LOADING, "")
    # ZeRO-3 loads partitioned (one module whole at a time) before any engine exists, and each engine's buffers are
    # allocated after the partitions they replace are freed: the end of loading is its peak (measured).
    return None


def weight_sync_items(args: Args, policy: ModelShape, layout: Layout) -> list[Item]:
    """Learner rank 0's transient while it sends the policy to the engines of Ray learners (learner/weight_sender.py),
    between training steps: its own phase. The tensors go out one at a time as copies in the engines' dtype (L bytes
    for the largest), under ZeRO-3 each gathered first (its weight dtype).

    - GPUs (nccl, and ipc with --single_gpu_mode, where every rank sends its own copy): vLLM's packed producer
      (`packed_nccl_broadcast_producer`) joins copies into a chunk until it passes its buffer size B (the bucket size,
      or L if larger: `WeightTransfer.packed_buffer_bytes`), so a chunk is up to B + L; PACKED_SYNC_BUFFERS - 1 chunks
      are still on the wire while the next is packed, and that one exists twice until `torch.cat` returns (its
      tensors and their concatenation). At 8B in bf16 (L = B = 1.05 GB): 3 x 2.1 GB + the gathered 1.05 GB = 7.4 GB.
    - CPUs (gloo): one flat bucket of at most max(B, L) and the copy being put into it.
    """
    if not args.dist.uses_ray:
        return []  # the single process hands its in-process engine the tensors themselves (`engine_items`)
    dtype = 4 if args.gen.vllm_dtype == "float32" or (args.gen.vllm_dtype == "auto" and layout.device == "cpu") else 2
    largest, whole = dtype * policy.largest_param, dtype * policy.num_params
    buffer = max(args.dist.vllm_sync_bucket_mb * 2**20, largest)
    gathered = layout.weight_bytes * policy.largest_param if layout.stage == 3 else 0
    if policy.trained_params is not None:
        # LoRA: an adapted layer's W + s B A is computed in fp32 from its (gathered) base, out of place: the merged
        # tensor, and an fp32 copy of a bf16 base (the largest adapted layer: an MLP projection).
        merged = policy.hidden_size * policy.intermediate_size
        gathered = max(gathered, layout.weight_bytes * merged if layout.stage == 3 else 0)
        gathered += (4 + (4 if layout.weight_bytes < 4 else 0)) * merged
    fix = "a lower --vllm_sync_bucket_mb"
    if layout.device == "gpu":
        chunk = min(buffer + largest, whole)  # a chunk (or bucket) never holds more than the whole policy
        size = (PACKED_SYNC_BUFFERS + 1) * chunk + gathered
        name = f"weight sync: {PACKED_SYNC_BUFFERS + 1} packed chunks of <= {chunk / GB:.2f} GB"
    else:
        bucket = min(buffer, whole)
        size, name = bucket + largest + gathered, f"weight sync: a bucket of <= {bucket / GB:.2f} GB"
    what = " + the LoRA merge in fp32" if policy.trained_params is not None else " + the gathered parameter"
    return [Item(name + (what if gathered else ""), 0, size, SYNC, fix)]
