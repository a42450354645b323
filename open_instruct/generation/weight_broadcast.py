"""Weight broadcast from learner rank 0 to the vLLM engines' workers, in flat buckets (the gloo transport; see
weight_transfer.py for the choice between it and vLLM's own NCCL and IPC transfer engines on GPUs).

One torch.distributed group spans learner rank 0 (group rank 0) and every engine worker (ranks 1..). It is created
with vLLM's `stateless_init_torch_distributed_process_group`, so neither the learners' DeepSpeed group nor vLLM's own
tensor-parallel group is touched: gloo on CPUs, NCCL on GPUs.

A sync is one RPC per engine and one broadcast per bucket, whatever the number of parameters:

    learner rank 0:  for each bucket of the plan: copy its tensors (engine dtype) into one flat buffer, broadcast it
    engine worker:   reload_weights(iterator over the received buckets, cut back into named tensors)

Both sides know the bucket plan (names, shapes, dtypes, offsets) before the first sync: it is computed once by
`plan_buckets` from the policy's parameter list and given to the engines when the group is made.

After each sync every engine worker reports the checksum of the tensors it received and loaded, and the learner the
checksum of what it sent (an exact integer sum of the raw words): equal only if every bucket arrived intact.
"""

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch


@dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    offset: int  # in elements, within its bucket
    numel: int


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    numel: int
    slots: tuple[TensorSlot, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_buckets(named_shapes: Iterable[tuple[str, tuple[int, ...]]], dtype: torch.dtype, bucket_bytes: int) -> list[Bucket]:
    """Cut the tensors, in order, into buckets of at most `bucket_bytes` (a larger tensor gets a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    buckets, slots, used = [], [], 0
    for name, shape in named_shapes:
        numel = 1
        for size in shape:
            numel *= int(size)
        if slots and (used + numel) * dtype.itemsize > bucket_bytes:
            buckets.append(Bucket(dtype, used, tuple(slots)))
            slots, used = [], 0
        slots.append(TensorSlot(name, tuple(int(s) for s in shape), used, numel))
        used += numel
    if slots:
        buckets.append(Bucket(dtype, used, tuple(slots)))
    return buckets


def new_checksum() -> dict[str, int]:
    return {"numel": 0, "word_sum": 0}


WORD_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def add_to_checksum(checksum: dict[str, int], tensor: torch.Tensor) -> None:
    """Add the integer sum of the tensor's raw words (its bit patterns) to `checksum`.

    Exact and independent of summation order and thread count, so both sides of a broadcast get the same integer for
    the same bytes; any changed value changes it (unless changes cancel exactly). One pass over memory: 0.35 s for
    512 MB on 2 cores here, a third of three float64 reductions.
    """
    words = tensor.detach().contiguous().view(-1).view(WORD_DTYPES[tensor.element_size()])
    checksum["numel"] += words.numel()
    checksum["word_sum"] += int(words.sum(dtype=torch.int64).item())


class StreamingChecksum:
    """`add_to_checksum` for tensors on a GPU: each tensor's word sum stays on the device until `result()`, one host
    sync per transfer instead of one per tensor (vLLM's NCCL and IPC transfers pack hundreds of tensors)."""

    def __init__(self):
        self.numel, self.partial_sums = 0, []

    def add(self, tensor: torch.Tensor) -> None:
        words = tensor.detach().contiguous().view(-1).view(WORD_DTYPES[tensor.element_size()])
        self.numel += words.numel()
        self.partial_sums.append(words.sum(dtype=torch.int64).reshape(1))

    def result(self) -> dict[str, int]:
        sums = torch.cat([part.cpu() for part in self.partial_sums]).tolist() if self.partial_sums else []
        return {"numel": self.numel, "word_sum": sum(int(value) for value in sums)}


def weights_checksum(tensors: Iterable[torch.Tensor]) -> dict[str, int]:
    """The checksum of tensors taken in any order and layout (a sum: fused, reordered or concatenated alike)."""
    checksum = new_checksum()
    for tensor in tensors:
        add_to_checksum(checksum, tensor)
    return checksum


def checksum_mismatch(expected: dict[str, int], actual: dict[str, int]) -> str | None:
    """None when `actual` equals `expected`; else what differs."""
    problems = [f"{key} {actual[key]} != {expected[key]}" for key in ("numel", "word_sum") if actual[key] != expected[key]]
    return "; ".join(problems) or None


# ---- the group (both sides) ----


def init_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float):
    """This process's membership in the broadcast group (blocks until all `world_size` members joined)."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        host, port, rank, world_size, backend, timeout=timedelta(seconds=timeout_s)
    )


def buffer_device(backend: str, device) -> torch.device:
    """Where the bucket buffers live: on the GPU for NCCL, in host memory for gloo."""
    return torch.device(device) if backend == "nccl" else torch.device("cpu")


def broadcast_from_rank0(group, tensor: torch.Tensor) -> None:
    """`group.broadcast` with group rank 0 as the root: a stateless group is unknown to `torch.distributed.broadcast`."""
    group.broadcast(tensor, 0).wait()


# ---- learner rank 0 ----


def send_buckets(group, plan: list[Bucket], named_tensors: Iterator[tuple[str, torch.Tensor | None]], device) -> dict:
    """Broadcast the tensors (in plan order) bucket by bucket; returns the checksum of what was sent and timings.

    `named_tensors` may be a generator that gathers each parameter as it is asked for (ZeRO-3), so that at most
    one bucket and one parameter are materialised at a time.
    """
    start, copy_s, wire_s = time.time(), 0.0, 0.0
    checksum = new_checksum()
    for bucket in plan:
        copy_start = time.time()
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
        for slot in bucket.slots:
            name, tensor = next(named_tensors)
            if name != slot.name or tuple(tensor.shape) != slot.shape:
                raise RuntimeError(
                    f"weight broadcast: expected {slot.name} {slot.shape}, the learner gave {name} {tuple(tensor.shape)}"
                )
            flat[slot.offset : slot.offset + slot.numel].copy_(tensor.reshape(-1))
        add_to_checksum(checksum, flat)
        wire_start = time.time()
        copy_s += wire_start - copy_start
        broadcast_from_rank0(group, flat)
        wire_s += time.time() - wire_start
    return {
        "checksum": checksum,
        "seconds": time.time() - start,
        "copy_seconds": copy_s,
        "broadcast_seconds": wire_s,
        "bytes": sum(bucket.nbytes for bucket in plan),
        "buckets": len(plan),
    }


# ---- engine workers (vLLM's `worker_extension_cls`) ----


class ReceivedWeights:
    """The named tensors of each bucket as it arrives, and the checksum of everything received.

    A fresh buffer per bucket: the loader may keep views of it. `missed` lists what the loader did not ask for.
    """

    def __init__(self, group, plan: list[Bucket], device):
        self.group, self.plan, self.device = group, plan, device
        self.checksum = new_checksum()
        self.received = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.plan:
            flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=self.device)
            broadcast_from_rank0(self.group, flat)
            add_to_checksum(self.checksum, flat)
            for slot in bucket.slots:
                self.received += 1
                yield slot.name, flat[slot.offset : slot.offset + slot.numel].view(slot.shape)


class WeightReceiverExtension:
    """Mixed into every vLLM worker of an engine fed by Ray learners (`worker_extension_cls`, see
    vllm_engine.WORKER_EXTENSION); methods are called with `llm.collective_rpc`.

    Names carry an `oi_` prefix: vLLM refuses an extension whose names clash with the worker's own
    (`update_weights`, `reload_weights`, ...).
    """

    def oi_device_report(self) -> dict:
        """This worker's device as it sees it (run.devices.device_report), its weights' dtype, and the vLLM
        weight-transfer engine it built (None: ours receives, over gloo)."""
        from open_instruct.run.devices import device_report

        transfer_config = self.vllm_config.weight_transfer_config
        return {
            **device_report(torch.device(self.device)),
            "dtype": str(self.model_config.dtype).removeprefix("torch."),
            "transfer_engine": transfer_config.backend if transfer_config is not None else None,
        }

    # ---- vLLM's own transfer engines (nccl, ipc): the checksum of what they hand the loader ----
    def oi_watch_transfers(self) -> None:
        """vLLM's NCCL and IPC transfer engines hand every received chunk to the model's `load_weights`: wrap it, so
        this worker sums the raw words of exactly what it loads (the same words learner rank 0 summed as it sent).
        Once per worker: a group formed again after an engine restart must not wrap it twice (each word summed twice)."""
        self.oi_reset_transfer_checksum()
        model = self.weight_transfer_engine.model
        if getattr(model, "oi_summing_loads", False):
            return
        load_weights = model.load_weights

        def load_weights_and_sum(weights):
            weights = list(weights)
            for _, tensor in weights:
                self.oi_transfer_checksum.add(tensor)
            self.oi_transfer_tensors += len(weights)
            return load_weights(weights)

        model.load_weights = load_weights_and_sum
        model.oi_summing_loads = True

    def oi_reset_transfer_checksum(self) -> None:
        self.oi_transfer_checksum, self.oi_transfer_tensors, self.oi_transfer_start = StreamingChecksum(), 0, time.time()

    def oi_transfer_report(self) -> dict:
        return {"seconds": time.time() - self.oi_transfer_start, "checksum": self.oi_transfer_checksum.result(),
                "tensors": self.oi_transfer_tensors}  # fmt: skip

    # ---- our gloo broadcast ----

    def oi_join_weight_group(self, host: str, port: int, first_rank: int, world_size: int, backend: str,
                             timeout_s: float, plan: list[Bucket]) -> int:  # fmt: skip
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = first_rank + get_tensor_model_parallel_rank()
        self.oi_plan = plan
        self.oi_device = buffer_device(backend, self.device)
        self.oi_group = init_group(host, port, rank, world_size, backend, timeout_s)
        return rank

    def oi_receive_weights(self) -> dict:
        """Load one broadcast into the model as the buckets arrive: copied in place by the model's loader where its weights
        are plain tensors (CPU default), else by vLLM's layer-wise reload, which fuses, shards and repacks.

        Returns the seconds it took and the checksum of the received tensors, computed here as they streamed into the
        loader: it equals the learner's only if every bucket arrived intact, in order, and the loader took all of them.
        (What the kernels then compute with is checked every step by comparing the engine's logprobs with the
        learner's: on CPUs vLLM packs linear weights into opaque kernel handles, so a parameter sum cannot see them.)
        """
        from open_instruct.generation.vllm_engine import load_in_place, repack_tied_embeddings, weights_load_in_place

        start = time.time()
        received = ReceivedWeights(self.oi_group, self.oi_plan, self.oi_device)
        stream = iter(received)
        model = self.model_runner.get_model()
        in_place = weights_load_in_place(model)
        if in_place:  # plain CPU weights (--vllm_cpu_weight_layout plain): copied in place
            load_in_place(model, stream)
        else:
            self.reload_weights(weights_iterator=stream)
        unloaded = [name for name, _ in stream]  # still take part in every broadcast, or rank 0 would hang
        if unloaded:
            raise RuntimeError(f"vLLM's loader did not take {len(unloaded)} tensors of the broadcast: {unloaded[:3]}")
        if not in_place:
            repack_tied_embeddings(model)
        return {"seconds": time.time() - start, "checksum": received.checksum, "tensors": received.received}


class Beside(threading.Thread):
    """A call run in a daemon thread, so the caller can watch other things (the generation thread) meanwhile."""

    def __init__(self, fn, *fn_args):
        super().__init__(daemon=True, name=f"beside-{fn.__name__}")
        self.fn, self.fn_args = fn, fn_args
        self.value, self.error = None, None

    def run(self) -> None:
        try:
            self.value = self.fn(*self.fn_args)
        except BaseException as error:  # noqa: BLE001 - re-raised in result()
            self.error = error

    def result(self, timeout_s: float, what: str, watch=None):
        """The call's value; raises its error, or after `timeout_s`, or as soon as `watch()` raises."""
        deadline = time.time() + timeout_s
        while self.is_alive():
            self.join(timeout=0.5)
            if watch is not None:
                watch()
            if self.is_alive() and time.time() > deadline:
                raise TimeoutError(f"the learner did not {what} within {timeout_s:.0f}s; raise --vllm_sync_timeout_s if it is that slow")
        if self.error is not None:
            raise self.error
        return self.value


def run_beside(fn, *fn_args) -> Beside:
    thread = Beside(fn, *fn_args)
    thread.start()
    return thread


def stateless_destroy(group) -> None:
    """Leave a broadcast group (the benchmark makes one per bucket size)."""
    from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

    stateless_destroy_torch_distributed_process_group(group)
