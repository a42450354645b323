"""Where Ray puts the learner ranks and, with --single_gpu_mode, the vLLM engine actors: one placement group.

Without --single_gpu_mode: one bundle per node entry of --num_learners_per_node ({"CPU": n, "GPU": n} on a cluster
with GPUs), STRICT_SPREAD over nodes when there are several entries, PACK for one; each learner takes a whole GPU of
its node's bundle, and the engine actors get placement groups of their own (engine_actors.py).

With --single_gpu_mode: one bundle per learner rank, {"CPU": 2, "GPU": 1}, PACKed onto the nodes (the per-node counts
only set the total). Learner i and engine i both go into bundle i and ask for half a GPU each, so they get the same
GPU, and no two learners can share one: a bundle holds one GPU, and Ray packs fractional requests of different
actors onto one GPU only within a bundle. (Half-GPU actors without bundles may all land on one GPU.)

The plan is pure (`plan_placement`); `reserve_placement` asks Ray for it before any actor is created, so engines placed
elsewhere cannot take what the learners' strategy needs. Imported only when Ray is used.
"""

from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from open_instruct.run.cluster import start_ray


class PlacementFailed(RuntimeError):
    """Ray could not reserve the learners' (and colocated engines') bundles in time."""


@dataclass(frozen=True)
class PlacementPlan:
    bundles: tuple[dict, ...]
    strategy: str
    learner_bundle: tuple[int, ...]  # the bundle of each learner rank
    learner_gpus: float  # num_gpus of one learner actor
    engine_bundle: tuple[int, ...]  # --single_gpu_mode: the bundle of each engine actor; empty: engines placed apart
    engine_gpus: float  # num_gpus of one colocated engine actor

    @property
    def colocated(self) -> bool:
        return bool(self.engine_bundle)


def plan_placement(num_learners_per_node: list[int], vllm_num_engines: int, single_gpu_mode: bool,
                   cluster_gpus: float) -> PlacementPlan:  # fmt: skip
    """The bundles, strategy and per-actor shares for these flags on a cluster with `cluster_gpus` GPUs (Ray's view of
    the cluster: where the devices are, not what the driver's process sees)."""
    use_gpu = cluster_gpus > 0
    if single_gpu_mode:
        num_learners = sum(num_learners_per_node)
        share = 0.5 if use_gpu else 0.0  # learner i and engine i split bundle i's one GPU
        bundle = {"CPU": 2, **({"GPU": 1} if use_gpu else {})}
        return PlacementPlan(tuple(dict(bundle) for _ in range(num_learners)), "PACK", tuple(range(num_learners)),
                             share, tuple(range(vllm_num_engines)), share)  # fmt: skip
    bundles = tuple({"CPU": n, **({"GPU": n} if use_gpu else {})} for n in num_learners_per_node)
    learner_bundle = tuple(node for node, count in enumerate(num_learners_per_node) for _ in range(count))
    strategy = "STRICT_SPREAD" if len(bundles) > 1 else "PACK"
    return PlacementPlan(bundles, strategy, learner_bundle, 1.0 if use_gpu else 0.0, (), 0.0)


class Placement:
    """A reserved placement group and the Ray options that put each learner (and colocated engine) into its bundle."""

    def __init__(self, group, plan: PlacementPlan):
        self.group, self.plan = group, plan

    @property
    def colocated(self) -> bool:
        return self.plan.colocated

    @property
    def uses_gpus(self) -> bool:
        return any(bundle.get("GPU", 0) > 0 for bundle in self.plan.bundles)

    def learner_options(self, rank: int) -> dict:
        in_bundle = PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=self.plan.learner_bundle[rank]
        )
        return dict(num_cpus=1, num_gpus=self.plan.learner_gpus, scheduling_strategy=in_bundle)

    def engine_options(self, index: int) -> dict:
        """A colocated engine actor's options: its learner's bundle, half its GPU."""
        in_bundle = PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=self.plan.engine_bundle[index]
        )
        return dict(num_cpus=1, num_gpus=self.plan.engine_gpus, scheduling_strategy=in_bundle)

    def remove(self) -> None:
        if self.group is not None and ray.is_initialized():
            remove_placement_group(self.group)
        self.group = None


def reserve_placement(dist) -> Placement:
    """Start (or join) Ray and reserve the learners' placement group, waiting up to --learner_timeout_s for it."""
    start_ray(dist.ray_address, dist.num_learners + dist.vllm_num_engines * dist.vllm_tensor_parallel_size)
    plan = plan_placement(dist.num_learners_per_node, dist.vllm_num_engines, dist.single_gpu_mode,
                          ray.cluster_resources().get("GPU", 0))  # fmt: skip
    group = placement_group(list(plan.bundles), strategy=plan.strategy)
    try:
        ray.get(group.ready(), timeout=dist.learner_timeout_s)
    except GetTimeoutError:
        remove_placement_group(group)
        what = "learners and their engines" if plan.colocated else "learners"
        raise PlacementFailed(
            f"Ray could not place the {what} {list(plan.bundles)} ({plan.strategy}) within {dist.learner_timeout_s:.0f}s "
            f"on a cluster with {ray.cluster_resources()}; lower --num_learners_per_node or add nodes."
        ) from None
    return Placement(group, plan)
