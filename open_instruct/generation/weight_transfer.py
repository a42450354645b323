"""How learner rank 0's weights reach the vLLM engines, and the engines' side of each way (Ray learners only; the
single-process learner hands its tensors to its in-process engine directly).

    gloo   CPUs: our buckets over a stateless gloo group (weight_broadcast.py), through host memory
    nccl   GPUs of their own: vLLM's NCCL weight-transfer engine (GPU to GPU, packed buffers, double-buffered)
    ipc    a learner rank and an engine on one GPU (--single_gpu_mode): vLLM's CUDA IPC weight-transfer engine; each
           engine maps its own GPU's learner copy (no copy between GPUs, no NCCL group, which refuses two ranks on
           one GPU)

Who decides: every process that computes reports its device (run.devices.device_report: type, GPU UUID), learner rank
0 and its peers at creation, every engine worker once loaded; `choose_transport` decides from those reports alone,
so a driver on a head node without a GPU (or with one it never uses) decides for the GPUs where the actors are. What
each engine builds at start (vLLM's weight_transfer_config) follows the same rule where the engine runs
(vllm_engine.vllm_transfer_backend); the reports say what it built.

Whatever the transport, the check is ours: each engine worker sums the raw words of every tensor its loader is handed
(weight_broadcast.StreamingChecksum, wrapped around the model's `load_weights`), learner rank 0 of every tensor it
sends, and the learner stops the run unless they agree.

`connect_engines` sets the transfer up at the start of a run (learner rank 0 and every engine worker join its group,
`join_transfer`), for the engine actors and the trainer's in-process engine alike.
"""

import logging
import time
from dataclasses import dataclass

from open_instruct.generation.weight_broadcast import Bucket, run_beside
from open_instruct.run.args import ConfigError

log = logging.getLogger(__name__)

TRANSPORTS = ("gloo", "nccl", "ipc")
PACKED_NUM_BUFFERS = 2  # vLLM's double buffering: pack chunk k+1 while chunk k is on the wire


def choose_transport(requested: str, learner_reports: list[dict], engine_reports: list[dict]) -> tuple[str, str]:
    """(transport, why) from --vllm_sync_backend and the devices' own reports: learner ranks (rank 0 first) and
    every engine worker (`device_type`, `gpu_uuid`, `transfer_engine`: the vLLM engine it built). Raises ConfigError
    with one line when the asked transport cannot work on these devices."""
    rank0 = learner_reports[0]
    members = [rank0, *engine_reports]
    all_cuda = all(report["device_type"] == "cuda" for report in members)
    learner_gpus = {report["gpu_uuid"] for report in learner_reports}
    beside_rank0 = (
        [i for i, report in enumerate(engine_reports) if report["gpu_uuid"] == rank0["gpu_uuid"]] if all_cuda else []
    )
    colocated = all_cuda and all(report["gpu_uuid"] in learner_gpus for report in engine_reports)
    built = {report.get("transfer_engine") for report in engine_reports}
    devices = f"learner rank 0 on {describe(rank0)}, engine workers on {', '.join(describe(r) for r in engine_reports)}"
    if requested == "gloo":
        return "gloo", "asked for (--vllm_sync_backend gloo)"
    if requested in ("nccl", "ipc") and not all_cuda:
        raise ConfigError(
            f"--vllm_sync_backend {requested} needs every member on a GPU, but {devices}; use gloo or auto."
        )
    if beside_rank0 and not colocated:
        raise ConfigError(
            f"engine worker(s) {beside_rank0} share learner rank 0's GPU but not every engine sits on a learner's GPU "
            f"({devices}): NCCL refuses two ranks on one GPU and IPC needs all engines beside learners; use "
            "--single_gpu_mode (one engine per learner GPU) or give the engines GPUs of their own."
        )
    if requested == "nccl" and colocated:
        raise ConfigError(
            f"--vllm_sync_backend nccl: {devices}, and NCCL refuses two ranks on one GPU ('Duplicate GPU detected'); "
            "use --vllm_sync_backend auto (CUDA IPC) or gloo."
        )
    if requested == "ipc" and not colocated:
        raise ConfigError(
            f"--vllm_sync_backend ipc needs each engine on a learner's GPU, but {devices}; use auto or nccl."
        )
    if not any(report["device_type"] == "cuda" for report in members):
        return "gloo", "auto: learner rank 0 and the engines are on CPUs"
    if not all_cuda:
        return "gloo", f"auto: not every member is on a GPU ({devices})"
    transport = "ipc" if colocated else "nccl"
    if built != {transport}:
        raise ConfigError(
            f"the engines built vLLM's {sorted(map(str, built))} weight-transfer engine but the devices call for "
            f"{transport} ({devices}); pass --vllm_sync_backend gloo, or place engines and learners as they were planned."
        )
    why = (
        "engines share the learners' GPUs"
        if colocated
        else "learner rank 0 and every engine worker on GPUs of their own"
    )
    return transport, f"{'asked for' if requested != 'auto' else 'auto'}: {why}"


def decide_transfer(requested: str, learner, engines) -> tuple[str, str, str]:
    """(transport, why, the engines' dtype) from what the learner ranks (`learner.device_reports()`, rank 0 first)
    and the engine workers (`engines.device_reports()`) said about their own devices; nothing here looks at the
    devices of the process that calls it."""
    engine_reports = engines.device_reports()
    transport, why = choose_transport(requested, learner.device_reports(), engine_reports)
    return transport, why, engine_dtype_of(engine_reports)


def describe(report: dict) -> str:
    if report["device_type"] != "cuda":
        return report["device_type"]
    return f"GPU {str(report['gpu_uuid'])[:13]}"


def engine_dtype_of(engine_reports: list[dict]) -> str:
    """The dtype every engine worker holds its weights in (as it reported it): what the learner sends."""
    dtypes = {report["dtype"] for report in engine_reports}
    if len(dtypes) != 1:
        raise ConfigError(
            f"the vLLM engines hold their weights in different dtypes {sorted(dtypes)}; pass --vllm_dtype."
        )
    return dtypes.pop()


@dataclass
class WeightTransfer:
    """One run's weight transfer, as both sides learn it when they connect."""

    transport: str
    host: str  # learner rank 0's node: it hosts the group's rendezvous (gloo, nccl)
    port: int
    world_size: int  # learner rank 0 + every engine worker
    plan: list[Bucket]  # the tensors in sending order (names, shapes, engine dtype); gloo's buckets
    bucket_bytes: int  # gloo's bucket cap; vLLM's packed buffer size (nccl, ipc)
    timeout_s: float

    @property
    def slots(self) -> list:
        return [slot for bucket in self.plan for slot in bucket.slots]

    @property
    def dtype(self):
        return self.plan[0].dtype

    def packed_buffer_bytes(self) -> int:
        """vLLM's packed buffer: the bucket size, or the largest tensor (IPC refuses a tensor larger than its buffer)."""
        return max(self.bucket_bytes, max(slot.numel for slot in self.slots) * self.dtype.itemsize)

    def update_info(self) -> dict:
        """vLLM's per-round NCCL update info: what each broadcast carries, in order (fixed for the run)."""
        dtype_name = str(self.dtype).removeprefix("torch.")
        return {
            "names": [slot.name for slot in self.slots],
            "dtype_names": [dtype_name] * len(self.slots),
            "shapes": [list(slot.shape) for slot in self.slots],
        }

    def nccl_init_info(self, first_rank: int) -> dict:
        """vLLM's NCCL init info of one engine: its workers take ranks first_rank.. of the group (vLLM's own trainer
        side would put every engine at rank 1, so the handshake is ours)."""
        return {
            "master_address": self.host,
            "master_port": self.port,
            "rank_offset": first_rank,
            "world_size": self.world_size,
            "packed": True,
            "packed_buffer_size_bytes": self.packed_buffer_bytes(),
            "packed_num_buffers": PACKED_NUM_BUFFERS,
        }


# ---- the engine's side (in the engine actor's process, or the trainer's for its in-process engine) ----


def engine_device_reports(llm) -> list[dict]:
    """Each worker's device, GPU, dtype and the vLLM weight-transfer engine it built."""
    return llm.collective_rpc("oi_device_report")


def join(llm, transfer: WeightTransfer, first_rank: int) -> None:
    """Join the learner's group (gloo: ours; nccl: vLLM's, with its rank offset) and watch what the loader takes."""
    if transfer.transport == "gloo":
        llm.collective_rpc("oi_join_weight_group", args=(transfer.host, transfer.port, first_rank, transfer.world_size,
                                                          "gloo", transfer.timeout_s, transfer.plan))  # fmt: skip
        return
    llm.collective_rpc("oi_watch_transfers")
    if transfer.transport == "nccl":
        llm.init_weight_transfer_engine({"init_info": transfer.nccl_init_info(first_rank)})
    # ipc: learner rank 0 sends vLLM's init info itself (through EngineActorsClient), no rendezvous


def receive(llm, transfer: WeightTransfer) -> list[dict]:
    """This engine's side of one broadcast (gloo, nccl), run while learner rank 0 sends; per worker: the checksum of
    what its loader took and how many tensors."""
    if transfer.transport == "gloo":
        per_worker = llm.collective_rpc("oi_receive_weights")
        llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        return per_worker
    start_update(llm)
    llm.update_weights({"update_info": transfer.update_info()})
    return finish_update(llm)


def start_update(llm) -> None:
    llm.collective_rpc("oi_reset_transfer_checksum")
    llm.start_weight_update()


def finish_update(llm) -> list[dict]:
    """vLLM's layer-wise reload finishes here, writing into the tensors the model (and its CUDA graphs) hold."""
    llm.finish_weight_update()
    llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
    return llm.collective_rpc("oi_transfer_report")


def transfer_result(per_worker: list[dict], seconds: float) -> dict:
    """One engine's side of a transfer: its time, and per worker the checksum and count of what its loader took."""
    return {
        "seconds": seconds,
        "checksums": [worker["checksum"] for worker in per_worker],
        "tensors": [worker["tensors"] for worker in per_worker],
    }


def connect_engines(learner, engines, dist) -> WeightTransfer:
    """Learner rank 0 and every engine worker agree on the transfer and set it up.

    `learner`: the Ray learner ranks (learner/ray_group.LearnerGroup); `engines`: the engine actors, or the trainer's
    in-process engine (generation_thread.InProcessEngine). The transport and the dtype come from what the learner ranks
    and the engine workers reported about their devices, never from this process's view.
    """
    started = time.time()
    transport, why, dtype_name = decide_transfer(dist.vllm_sync_backend, learner, engines)
    bucket_bytes = int(dist.vllm_sync_bucket_mb * 2**20)
    plan = learner.weight_bucket_plan(bucket_bytes, dtype_name)
    host, port = learner.weight_group_address()  # rank 0 hosts the group's rendezvous, on its node
    transfer = WeightTransfer(transport, host, port, 1 + engines.num_workers, plan, bucket_bytes, dist.vllm_sync_timeout_s)
    join_transfer(learner, engines, transfer)
    buckets = f", {len(plan)} bucket(s) of <= {dist.vllm_sync_bucket_mb:g} MB" if transport == "gloo" else ""
    log.info(
        f"[vllm] weight transfer: learner rank 0 -> {engines.num_workers} engine worker(s) over {transport} ({why}), "
        f"{sum(bucket.nbytes for bucket in plan) / 2**20:.0f} MB in {dtype_name}{buckets} "
        f"({time.time() - started:.1f}s to set up)"
    )
    return transfer


def join_transfer(learner, engines, transfer: WeightTransfer) -> None:
    """Learner rank 0 and the engine workers join `transfer` (at the start, and again after a change of engines)."""
    if transfer.transport == "ipc":  # no rendezvous: the engines watch their loaders, then every rank builds vLLM's trainer side
        engines.join_weight_group(transfer)
        learner.join_weight_group(transfer, engines.client())
    else:  # both sides block in the group's rendezvous until all have joined
        learner_side = run_beside(learner.join_weight_group, transfer, None)
        engines.join_weight_group(transfer)
        learner_side.result(transfer.timeout_s, "join the weight transfer group")
