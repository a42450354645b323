"""The learner's side of the weight transfer to the vLLM engines (Ray learner ranks; generation/weight_transfer.py says
which transport and why). Every rank holds one `WeightSender`: under ZeRO-3 every rank takes part in gathering each
parameter, and with IPC every rank shares its own copy with the engine on its GPU; learner rank 0 sends.

    gloo  rank 0: our buckets over a stateless gloo group (weight_broadcast.send_buckets)
    nccl  rank 0: vLLM's packed NCCL producer (weights copied into 2 rotating buffers on the GPU, each broadcast on
          its own stream while the next is packed), over vLLM's NCCL group, which rank 0 joins with vLLM's own
          trainer-side helper; the engines were told their rank offsets by us (vLLM's trainer engine would put them
          all at rank 1)
    ipc   every rank: vLLM's IPC trainer engine (`WeightTransferTrainerFactory.trainer_init` + `send_weights`); rank 0
          drives the engine actors through engine_actors.EngineActorsClient

Rank 0 sums the raw words of every tensor as it goes out (weight_broadcast checksums); each engine worker sums what
its loader took; the trainer compares them after every transfer.
"""

import time
from collections.abc import Iterator

import torch

from open_instruct.generation import weight_broadcast
from open_instruct.generation.weight_transfer import PACKED_NUM_BUFFERS, WeightTransfer


def in_plan_order(named: Iterator[tuple[str, torch.Tensor | None]], slots: list, check: bool) -> Iterator:
    """`named` as it comes (a ZeRO-3 gather per step), checked against the plan where tensors are real."""
    for slot, (name, tensor) in zip(slots, named, strict=True):
        if check and (name != slot.name or tuple(tensor.shape) != slot.shape):
            raise RuntimeError(f"weight transfer: expected {slot.name} {slot.shape}, the learner gave {name} "
                               f"{tuple(tensor.shape)}")  # fmt: skip
        yield name, tensor


def plan_source(transfer: WeightTransfer, tensors, checksum: weight_broadcast.StreamingChecksum | None):
    """vLLM's `WeightSource` over the policy: metadata from the plan (no gather), each pass a fresh iteration
    (`tensors()`), summed into `checksum` on rank 0."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class PlanSource(WeightSource):
        def metadata(self) -> list:
            return [ParamMeta(slot.name, transfer.dtype, slot.shape) for slot in transfer.slots]

        def __iter__(self):
            for name, tensor in in_plan_order(tensors(), transfer.slots, check=True):
                if checksum is not None:
                    checksum.add(tensor)
                yield name, tensor

    return PlanSource()


class WeightSender:
    """One learner rank's side of the transfer; `learner` is its PPOLearner (policy and backend)."""

    def __init__(self, learner):
        self.learner = learner
        self.rank = learner.backend.rank
        self.transfer: WeightTransfer | None = None
        self.group = None  # gloo: our stateless group; nccl: vLLM's PyNcclCommunicator (rank 0 only)
        self.ipc_engine = None  # ipc: vLLM's IPC trainer engine (every rank)
        self.checksum: weight_broadcast.StreamingChecksum | None = None

    def plan(self, bucket_bytes: int, dtype_name: str) -> list[weight_broadcast.Bucket]:
        """The policy's tensors in sending order, in the dtype the engines reported, cut into gloo buckets."""
        shapes = self.learner.backend.weight_shapes(self.learner.policy)
        return weight_broadcast.plan_buckets(shapes, getattr(torch, dtype_name), bucket_bytes)

    def join(self, transfer: WeightTransfer, client=None) -> None:
        """Rank 0 joins the engines' group (gloo, nccl); with ipc every rank builds vLLM's trainer side (`client`:
        the engine actors, driven by rank 0 only)."""
        self.transfer = transfer
        if transfer.transport == "ipc":
            from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            init_info = IPCTrainerInitInfo(
                rank=self.rank, packed=True, packed_buffer_size_bytes=transfer.packed_buffer_bytes()
            )
            source = plan_source(transfer, self.every_rank_tensors, None)
            self.ipc_engine = WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)
            return
        if self.rank != 0:
            return
        if transfer.transport == "gloo":
            self.group = weight_broadcast.init_group(transfer.host, transfer.port, 0, transfer.world_size, "gloo",
                                                     transfer.timeout_s)  # fmt: skip
        else:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init

            self.group = trainer_init({"master_address": transfer.host, "master_port": transfer.port,
                                       "world_size": transfer.world_size})  # fmt: skip

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The policy in the engines' dtype, one parameter at a time (rank 0 holds them; None elsewhere)."""
        return self.learner.backend.iter_named_weights(self.learner.policy, self.transfer.dtype)

    def every_rank_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The same on every rank (IPC: each rank shares its own copy with the engine on its GPU)."""
        return self.learner.backend.iter_named_weights(self.learner.policy, self.transfer.dtype, every_rank=True)

    def send(self) -> dict | None:
        """One transfer; on rank 0 the checksum of what went out, its time and size. Every rank must call it."""
        transport = self.transfer.transport
        if transport == "gloo" and self.rank == 0:
            device = weight_broadcast.buffer_device("gloo", self.learner.device)
            return weight_broadcast.send_buckets(self.group, self.transfer.plan, self.named_tensors(), device)
        start = time.time()
        checksum = weight_broadcast.StreamingChecksum() if self.rank == 0 else None
        if transport == "ipc":
            self.ipc_engine.source = plan_source(self.transfer, self.every_rank_tensors, checksum)
            self.ipc_engine.send_weights()
        elif self.rank == 0:  # nccl
            from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

            def sum_and_send(item: tuple[str, torch.Tensor]) -> torch.Tensor:
                checksum.add(item[1])
                return item[1]

            packed_nccl_broadcast_producer(
                iterator=in_plan_order(self.named_tensors(), self.transfer.slots, check=True),
                group=self.group,
                src=0,
                post_iter_func=sum_and_send,
                buffer_size_bytes=self.transfer.packed_buffer_bytes(),
                num_buffers=PACKED_NUM_BUFFERS,
            )
        if self.rank != 0:
            if transport != "ipc":
                for _ in self.named_tensors():  # under ZeRO-3 each step gathers a parameter with rank 0
                    pass
            return None
        return {"checksum": checksum.result(), "seconds": time.time() - start,
                "bytes": sum(bucket.nbytes for bucket in self.transfer.plan)}  # fmt: skip
