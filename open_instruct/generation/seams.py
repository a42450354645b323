"""The seams of the rollout side: what an engine offers the generation thread, and what the generation side needs
from a learner. Each is declared once here; tests/test_seams.py compares every implementation's methods with it,
parameter by parameter, so that a backend cannot drift from the others.

    Engine             one vLLM engine in this process (generation_thread.InProcessEngine), or engine actors on Ray
                       (engine_actors.EngineGroup)
    HandsOutWeights    a learner that hands the engine a copy of its weights (every learner: learner/seams.Learner)
    BroadcastsWeights  Ray learner ranks, whose rank 0 sends each policy version to the engines over a transfer
                       group instead (learner/ray_group.LearnerGroup)

The learner's own seam (make_experience, train, save, ...) is learner/seams.Learner; it sits in the learner layer,
which may import this one, and extends HandsOutWeights.
"""

import threading
from collections.abc import Callable
from typing import Protocol

import torch

from open_instruct.generation.vllm_engine import Completion
from open_instruct.generation.weight_broadcast import Bucket
from open_instruct.generation.weight_transfer import WeightTransfer


class Engine(Protocol):
    """What the generation thread calls: weights in, batches admitted and generated, the batches in the engine for a
    checkpoint, and the receiving side of Ray learners' transfers. A backend without a use for a method answers it
    honestly and does nothing (an in-process engine is never restarted, so it never re-forms a weight group)."""

    num_workers: int  # engine workers in the weight group (learner rank 0 is rank 0; they take ranks 1..)
    regroup_pending: bool  # the engines of the weight group changed: the learner must `regroup` before it sends
    restarts: int  # engine restarts so far (--max_engine_restarts counts over the whole run; a checkpoint keeps it)

    def wait_until_ready(self) -> None:
        """Block until the engine has loaded (on a GPU: vLLM has sized its KV cache)."""
        ...

    # ---- weights ----
    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]], policy_version: int) -> float:
        """Load `named_tensors` (HF names) as policy `policy_version`; returns the seconds it took."""
        ...

    def device_reports(self) -> list[dict]:
        """Every engine worker's own report of its device, in weight-group rank order."""
        ...

    def join_weight_group(self, transfer: WeightTransfer) -> None:
        """The workers take ranks 1.. of `transfer`'s group (learner rank 0 joins at the same time)."""
        ...

    def ready_to_receive(self, policy_version: int) -> None:
        """Return once every engine is idle and alive, so that learner rank 0 may start sending."""
        ...

    def receive_weights(self, policy_version: int, learner_done: threading.Event) -> list[dict]:
        """The engines' side of one transfer; per engine: {"seconds", "checksums"}."""
        ...

    def regroup(self, learner: "BroadcastsWeights") -> None:
        """The learner's side of a change of engines (`regroup_pending`): a new weight group before rank 0 sends."""
        ...

    # ---- the batches in the engine ----
    def admit(self, batch_id, prompt_token_ids: list[list[int]], params: dict, sampling_seed: int | None,
              rows: list[dict] | None = None) -> None:  # fmt: skip
        """Start generating `prompt_token_ids` (vllm_engine.sampling_params `params`) as batch `batch_id`; `rows`: with
        --tools, each prompt's dataset row, for its environment's `reset`."""
        ...

    def run_until_complete(self, batch_id, between_steps: Callable[[], None] | None = None) -> list[Completion]:
        """Step the engine until batch `batch_id` is complete (`between_steps()` between two steps); its completions
        in prompt order."""
        ...

    def partial_batches(self) -> list[dict]:
        """The batches in the engine as they stand (a checkpoint's)."""
        ...

    def restore(self, partial_batches: list[dict]) -> None:
        """Put back what `partial_batches` returned (resume)."""
        ...

    def engine_steps(self) -> int:
        """Engine steps taken so far (all engines together)."""
        ...

    def restart_metrics(self) -> dict[str, float]:
        """`engine/restarts` and `time/engine_restart` for the learner's metrics (none for an engine never restarted)."""
        ...

    def batch_metrics(self, batch_id) -> dict[str, float]:
        """A completed batch's own metrics for the learner (an agent batch's agent/*; none for a dataset batch)."""
        ...

    def shutdown(self) -> None:
        ...


class HandsOutWeights(Protocol):
    """A learner whose weights travel to an engine in this process inside the generation request."""

    def weights_for_engine(self, slot: int | None = None) -> list[tuple[str, torch.Tensor]] | None:
        """The policy's weights in the engine's dtype, copied (into reusable buffer `slot` where the learner keeps
        one): the engine loads them while the learner trains on."""
        ...


class BroadcastsWeights(HandsOutWeights, Protocol):
    """Ray learner ranks: learner rank 0 sends each policy version to every engine (actors, or the in-process one)."""

    def device_reports(self) -> list[dict]:
        """Each learner rank's own report of its device (rank 0 first): the transfer is chosen from these."""
        ...

    def weight_bucket_plan(self, bucket_bytes: int, dtype_name: str) -> list[Bucket]:
        """The policy's tensors in sending order, in buckets of at most `bucket_bytes`, in the engines' dtype."""
        ...

    def weight_group_address(self) -> tuple[str, int]:
        """Learner rank 0's node and a free port: the weight group's rendezvous."""
        ...

    def join_weight_group(self, transfer: WeightTransfer, client=None) -> None:
        """Rank 0 joins `transfer`'s group (ipc: every rank builds vLLM's trainer side, driving `client`)."""
        ...

    def broadcast_weights(self) -> dict | None:
        """Send the current policy to every engine; rank 0's report (checksums, timings)."""
        ...
