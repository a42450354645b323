"""Where and in which dtype each part of a run computes: the learner's device, the learner's compute dtype (bf16 only
where the device computes it fast: a short probe on CPUs), agreement between ranks, and the inference dtype of the
models that only run forward (reference, reward model, vLLM engine).

Every decision here is taken in the process that computes (a learner rank, an engine actor, or the single-process
trainer), never by a driver that only coordinates actors elsewhere: `device_report` is what such a process tells the
driver about its device, and the driver decides from the reports (see generation/weight_transfer.py).
"""

import functools
import math
import os
import threading
import time
from contextlib import nullcontext
from typing import Callable

import torch

# torch's default dtype is one per process, and model constructors set it while they build: transformers'
# `from_pretrained`/`from_config` to the dtype they are given (or the config's), vLLM's engine to its own. Two threads
# building at once give each other's layers their dtype: a float32 vLLM engine built in the generation thread while
# the driver built the memory plan's meta model (the tiny model's config says bfloat16) got bfloat16 layers and failed
# at its first generate ("expected m1 and m2 to have the same dtype"), and a policy loaded in fp32 beside a bf16
# engine can get bf16 master weights. Every model built in a process that may host an engine is built holding this.
MODEL_CONSTRUCTION = threading.Lock()


def learner_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def local_gpu_index(ray_gpu_ids: list, cuda_visible_devices: str | None) -> int | None:
    """The CUDA device index, as torch numbers devices in this process, of the GPU Ray gave this actor (None: none).

    Ray normally sets CUDA_VISIBLE_DEVICES to the actor's own GPUs, so its GPU is device 0. With
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES it leaves the variable alone: every GPU of the node is visible and the
    actor's GPU is at its id's position in the variable, or is the id itself when the variable is unset. Hard-coding 0
    would put every rank of the node on GPU 0."""
    if not ray_gpu_ids:
        return None
    gpu = str(ray_gpu_ids[0])
    if cuda_visible_devices is None:
        if not gpu.isdigit():
            raise RuntimeError(f"Ray gave this actor GPU {gpu!r}, which is not a device index, and CUDA_VISIBLE_DEVICES is unset")
        return int(gpu)
    visible = [device.strip() for device in cuda_visible_devices.split(",") if device.strip()]
    if gpu not in visible:
        raise RuntimeError(f"Ray gave this actor GPU {gpu}, which CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} hides")
    return visible.index(gpu)


def narrow_visible_gpus(ray_gpu_ids: list) -> str | None:
    """Make the GPUs Ray gave this process its CUDA devices 0.. by setting CUDA_VISIBLE_DEVICES to them, before CUDA
    starts here; returns the value set (None: nothing to change, or no GPU).

    For a process that cannot choose its device itself: a vLLM engine's worker takes `cuda:<local rank>`, device 0
    for a single-GPU engine. Ray normally narrows the variable to the actor's GPUs already; with
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES it leaves it alone, and every such engine of a node would land on
    GPU 0. (Learner ranks choose their device instead: `local_gpu_index`.)"""
    if not ray_gpu_ids:
        return None
    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    for gpu in ray_gpu_ids:
        local_gpu_index([gpu], current)  # raises for a GPU the variable hides
    wanted = ",".join(str(gpu) for gpu in ray_gpu_ids)
    if current == wanted:
        return None
    if torch.cuda.is_initialized():
        raise RuntimeError(f"CUDA started in this process before it could be narrowed to GPU(s) {wanted}; narrow first")
    os.environ["CUDA_VISIBLE_DEVICES"] = wanted
    return wanted


def free_memory_bytes(device: torch.device) -> int | None:
    """Free memory of `device`: GPU memory on CUDA (this creates a CUDA context: call it only in a process that
    computes on that GPU), else MemAvailable of the machine."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def device_report(device: torch.device | None = None) -> dict:
    """What a process that computes tells the driver about its device: type, the GPU's UUID (two processes on one
    GPU report the same one), and free memory."""
    device = device or learner_device()
    uuid = None
    if device.type == "cuda":
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    return {"device_type": device.type, "gpu_uuid": uuid, "free_memory_bytes": free_memory_bytes(device)}


NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
BF16_MIN_SPEEDUP = 1.2  # below this the probe keeps fp32: bf16 loses precision for nothing


def native_bf16_cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> list[str]:
    """The CPU flags among NATIVE_BF16_CPU_FLAGS this machine has (empty where /proc/cpuinfo is missing)."""
    try:
        with open(cpuinfo_path) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in NATIVE_BF16_CPU_FLAGS if flag in flags]


PROBE_SIZES = (256, 512, 1024)  # the CPU matmul probe's n x n x n, the largest whose matmul fits PROBE_MATMUL_S
PROBE_MATMUL_S = 0.1  # the longest one timed matmul may take (1024^3: 0.03 s fp32 on a 2-core EPYC, 2.3 s emulated bf16)
_cpu_matmul_flops: dict[torch.dtype, tuple[float, int]] = {}  # dtype -> (FLOP/s, size): measured once per process


def _seconds(a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter()
    a @ b
    return time.perf_counter() - start


def cpu_matmul_flops(dtypes: tuple[torch.dtype, ...], repeats: int = 5) -> dict[torch.dtype, tuple[float, int]]:
    """FLOP/s of the best of `repeats` n x n matmuls on the CPU for each of `dtypes`, and the n: measured once per
    process and dtype (the bf16 probe and the peak FLOP/s both read it), only for the dtypes asked for.

    n is the largest of PROBE_SIZES whose matmul a 256^3 one predicts under PROBE_MATMUL_S: 1024 for fp32 and native
    bf16; 256 for bf16 without native support (AVX2 only), where a 1024^3 matmul takes 2.3 s and the old fixed probe
    spent ~14 s of every trainer start measuring that (its rate is the same at every size: 1.3 GFLOP/s).
    The dtypes are timed in turns, so a load that starts or stops during the probe (another process, the engine
    loading) slows both alike instead of only the one measured second: on 2 busy cores an all-fp32-then-all-bf16
    probe gave anything from 2.2x to 9.7x on a machine that measures 4.3x when quiet."""
    missing = [dtype for dtype in dtypes if dtype not in _cpu_matmul_flops]
    matrices = {}
    for dtype in missing:
        small = torch.randn(PROBE_SIZES[0], PROBE_SIZES[0], dtype=dtype)
        small @ small  # warm-up: oneDNN builds its kernel on the first call
        small_s = _seconds(small, small)
        fitting = [n for n in PROBE_SIZES if small_s * (n / PROBE_SIZES[0]) ** 3 <= PROBE_MATMUL_S]
        size = max(fitting, default=PROBE_SIZES[0])
        matrices[dtype] = (torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype))
        if size != PROBE_SIZES[0]:
            matrices[dtype][0] @ matrices[dtype][1]  # warm-up at the probe's size
    best = {dtype: math.inf for dtype in missing}
    for _ in range(repeats):
        for dtype, (a, b) in matrices.items():
            best[dtype] = min(best[dtype], _seconds(a, b))
    for dtype, (a, _) in matrices.items():
        _cpu_matmul_flops[dtype] = (2 * a.shape[0] ** 3 / best[dtype], a.shape[0])
    return {dtype: _cpu_matmul_flops[dtype] for dtype in dtypes}


def bf16_matmul_speedup(repeats: int = 5) -> float:
    """bf16 FLOP/s / fp32 FLOP/s of the CPU's matmul (`cpu_matmul_flops`, both timed in turns)."""
    flops = cpu_matmul_flops((torch.float32, torch.bfloat16), repeats)
    return flops[torch.bfloat16][0] / flops[torch.float32][0]


# Dense (no sparsity) tensor-core peaks from the vendors' datasheets, FLOP/s: (name fragment, bf16, fp32). fp32 is
# the plain (non-TF32) rate: autocast leaves fp32 matmuls in fp32 unless TF32 is switched on. First match wins, so
# a longer name comes before its prefix ("H100 PCIe" before "H100").
GPU_DATASHEET_PEAKS = (
    ("H200", 989e12, 67e12),
    ("H100 PCIe", 756e12, 51e12),
    ("H100", 989e12, 67e12),  # SXM
    ("GH200", 989e12, 67e12),
    ("B200", 2250e12, 75e12),
    ("A100", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12),
    ("A10G", 70e12, 31.2e12),
    ("L4", 121e12, 30.3e12),
)


def datasheet_peak_flops(gpu_name: str, dtype: torch.dtype) -> float | None:
    """The datasheet's dense peak FLOP/s of `dtype` (bf16 or fp32) for a GPU named `gpu_name` (as torch names it,
    e.g. "NVIDIA H100 80GB HBM3"); None for a GPU not in GPU_DATASHEET_PEAKS."""
    for fragment, bf16, fp32 in GPU_DATASHEET_PEAKS:
        if fragment.lower() in gpu_name.lower():
            return bf16 if dtype == torch.bfloat16 else fp32
    return None


@functools.cache
def measured_gpu_peak_flops(device: torch.device, dtype: torch.dtype, size: int = 8192, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` size x size matmuls on a GPU not in the datasheet table."""
    a, b = (torch.randn(size, size, dtype=dtype, device=device) for _ in range(2))
    a @ b
    best = math.inf
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_flops_per_second(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The learner device's peak FLOP/s in its compute dtype, and where the number comes from: the datasheet on a
    known GPU, else a measured matmul (on CPUs the start-up probe's, `cpu_matmul_flops`, run once per dtype)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = datasheet_peak_flops(name, dtype)
        if peak is not None:
            return peak, f"{name} datasheet, {dtype_name(dtype)}"
        return measured_gpu_peak_flops(device, dtype), f"{name}, measured {dtype_name(dtype)} matmul"
    flops, size = cpu_matmul_flops((dtype,))[dtype]
    return flops, f"CPU, measured {size}^3 {dtype_name(dtype)} matmul"


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: as configs, flags and checkpoints spell it (`getattr(torch, name)` inverts it)."""
    return str(dtype).removeprefix("torch.")


def learner_compute_dtype(requested: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype the learner computes in under autocast (its weights stay fp32), and why.

    GPUs: bf16 unless float32 is asked for. CPUs: `auto` takes bf16 only where the CPU has native bf16
    (avx512_bf16 or AMX) *and* a short matmul probe finds it at least BF16_MIN_SPEEDUP x faster than fp32.
    The probe decides because the flags alone do not: on a 2-core avx512_bf16 machine without AMX, bf16
    matmuls measured 2x *slower* than fp32 (9.2 vs 4.8 ms for 800x576x1536) and SmolLM2-135M's
    forward+backward 1.7x slower; on an AVX2-only machine bf16 backward was 40x slower (emulated).
    """
    if requested == "float32":
        return torch.float32, "float32 asked for (--learner_compute_dtype)"
    if requested == "bfloat16" or device.type == "cuda":
        return torch.bfloat16, f"bfloat16 {'on a GPU' if requested == 'auto' else 'asked for'}"
    flags = native_bf16_cpu_flags()
    if not flags:
        return torch.float32, "float32: this CPU has no native bf16 (avx512_bf16 / amx_bf16)"
    speedup = bf16_matmul_speedup()
    if speedup < BF16_MIN_SPEEDUP:
        return torch.float32, f"float32: bf16 matmul only {speedup:.2f}x fp32 here despite {'/'.join(flags)}"
    return torch.bfloat16, f"bfloat16: {'/'.join(flags)}, bf16 matmul {speedup:.2f}x fp32"


def compute_dtype_of_all_ranks(
    dtype: torch.dtype, why: str, all_sum: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.dtype, str]:
    """The compute dtype every learner rank uses: fp32 if any rank chose it (its CPU lacks fast bf16), else this
    rank's choice. Every rank must call it (`all_sum` sums a tensor over the ranks)."""
    ranks_on_fp32 = int(all_sum(torch.tensor([int(dtype == torch.float32)], dtype=torch.int64)).item())
    if ranks_on_fp32 and dtype != torch.float32:
        return torch.float32, f"float32: {ranks_on_fp32} other learner rank(s) chose it (this rank alone: {why})"
    return dtype, why


def autocast(device: torch.device, dtype: torch.dtype = torch.bfloat16, training: bool = True):
    """Compute in `dtype` (bf16) with fp32 master weights; plain fp32 when `dtype` is float32.
    `learner_compute_dtype` picks the dtype.

    Autocast keeps the bf16 copy of every trainable fp32 weight it casts until the region ends, also under
    `torch.no_grad()`: the backward needs them, a pass without gradients does not (`training=False`). Measured on an
    H200 (1.07B policy, bf16 compute): the rollout's no-grad forwards peaked 2.63 GB over the loaded models with the
    cache, of which 2.15 GB were those copies (docs/gpu_check.md)."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=training)


def inference_dtype(device: torch.device) -> torch.dtype:
    """The dtype of everything that only runs forward: the reference and reward models, and the vLLM engine.

    bf16 on GPUs. fp32 on CPUs: the 2-core CI machines have AVX2 but no native bf16, so plain bf16
    forwards in torch ran 6x slower, and vLLM generated 3x slower in bf16 (16 responses of up to
    48 tokens: 17 s vs 5.5 s). fp32 also lets the engine hold exactly the learner's weights.
    """
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def split_cpu_cores(engine_cores: int, available: list[int] | None = None) -> tuple[list[int], list[int]]:
    """This process's CPU cores cut in two for --vllm_cpu_cores: (the learner's, the in-process engine's: the last
    `engine_cores`). Raises ValueError when the learner would be left without one."""
    available = sorted(os.sched_getaffinity(0)) if available is None else sorted(available)
    if not 0 < engine_cores < len(available):
        raise ValueError(
            f"--vllm_cpu_cores {engine_cores} leaves no core to the learner: this process may use {len(available)} "
            f"core(s) ({available}); pass 1..{len(available) - 1}, or 0 to let both use them all."
        )
    return available[:-engine_cores], available[-engine_cores:]


def pin_this_thread(cores: list[int]) -> None:
    """Run the calling thread, and the OpenMP threads its torch operations start from now on, on `cores` only, with
    as many threads as cores. (Linux affinity is per thread; vLLM's CPU worker replaces `torch.set_num_threads` with a
    no-op once it starts, so the binding's own entry point is called.)"""
    os.sched_setaffinity(0, cores)
    torch._C.set_num_threads(len(cores))
