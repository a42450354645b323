"""Decisions taken where the device is, and what a GPU engine is built with: pure, no Ray, no GPU.

- The weight transfer (gloo, vLLM's NCCL, vLLM's CUDA IPC) follows the devices' own reports: a driver that sees no
  CUDA (this machine) decides NCCL for actors that report GPUs of their own, IPC for engines on the learners' GPUs,
  and refuses NCCL there ('Duplicate GPU detected') with one line. The driver's torch.cuda is never consulted.
- What the learner sends is in the dtype the engines report, and vLLM's NCCL init info gives engine i's workers their
  own ranks (vLLM's own trainer side would put every engine at rank 1).
- An engine on a GPU runs with CUDA graphs unless --vllm_enforce_eager, one on a CPU eagerly; the KV cache flag maps
  to vLLM's kv_cache_memory_bytes, and unset a CPU engine's cache is room for its batch of longest sequences.
- The checksum vLLM transports use equals our gloo one, and the source handed to vLLM's IPC trainer engine yields
  exactly what its metadata declares.
- The memory check of Ray learners uses learner rank 0's own free memory; output_dir is absolute and checked from
  learner rank 0's side.
- An engine built with a vLLM transfer engine (a stand-in for NCCL/IPC on this CPU) reports the checksum of exactly
  what its loader took through vLLM's start/update/finish, and then computes with the new weights.
"""

import os

import pytest
import torch

from open_instruct.generation import weight_broadcast
from open_instruct.generation.vllm_engine import EngineConfig, configure_vllm_environment, engine_kwargs
from open_instruct.generation.weight_transfer import WeightTransfer, choose_transport, decide_transfer
from open_instruct.run.args import ConfigError, parse_args
from open_instruct.run.cluster import folder_problem, write_folder_token
from open_instruct.run.engine_memory import cpu_kv_cache_bytes, kv_cache_bytes_per_token
from open_instruct.run.validation import check_flags, check_memory
from tests.support.trainer_runs import run_command


def gpu(uuid: str, transfer_engine: str | None = None, dtype: str = "bfloat16") -> dict:
    return {"device_type": "cuda", "gpu_uuid": uuid, "transfer_engine": transfer_engine, "dtype": dtype}


def cpu(dtype: str = "float32") -> dict:
    return {"device_type": "cpu", "gpu_uuid": None, "transfer_engine": None, "dtype": dtype}


# ---- the transport, from the reports --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "requested, learners, engines, expected",
    [
        ("auto", [gpu("L0"), gpu("L1")], [gpu("E0", "nccl"), gpu("E1", "nccl")], "nccl"),
        ("auto", [gpu("L0"), gpu("L1")], [gpu("L0", "ipc"), gpu("L1", "ipc")], "ipc"),  # --single_gpu_mode
        ("auto", [cpu(), cpu()], [cpu()], "gloo"),
        ("auto", [gpu("L0")], [cpu()], "gloo"),  # a CPU engine beside a GPU learner: through host memory
        ("gloo", [gpu("L0")], [gpu("E0", None)], "gloo"),
        ("nccl", [gpu("L0")], [gpu("E0", "nccl")], "nccl"),
        ("ipc", [gpu("L0")], [gpu("L0", "ipc")], "ipc"),
    ],
)
def test_the_transport_follows_the_devices_reports(requested, learners, engines, expected):
    transport, why = choose_transport(requested, learners, engines)
    assert transport == expected, why


@pytest.mark.parametrize(
    "requested, learners, engines, message",
    [
        ("nccl", [gpu("L0")], [gpu("L0", "ipc")], "NCCL refuses two ranks on one GPU ('Duplicate GPU detected')"),
        ("nccl", [cpu()], [cpu()], "--vllm_sync_backend nccl needs every member on a GPU"),
        ("ipc", [gpu("L0")], [gpu("E0", "nccl")], "--vllm_sync_backend ipc needs each engine on a learner's GPU"),
        (
            "auto",
            [gpu("L0"), gpu("L1")],
            [gpu("L0", "ipc"), gpu("E1", "ipc")],
            "share learner rank 0's GPU but not every",
        ),
        ("auto", [gpu("L0")], [gpu("E0", None)], "the engines built vLLM's ['None'] weight-transfer engine"),
    ],
)
def test_a_transport_the_devices_cannot_carry_is_refused_in_one_line(requested, learners, engines, message):
    with pytest.raises(ConfigError) as error:
        choose_transport(requested, learners, engines)
    assert message in str(error.value) and "\n" not in str(error.value)


class ReportsGPUs:
    """Stands for the learner ranks and the engine actors: their own reports (GPUs), whatever this process sees."""

    def __init__(self, reports: list[dict]):
        self.reports = reports

    def device_reports(self) -> list[dict]:
        return self.reports


def test_a_driver_without_cuda_decides_from_the_actors_reports_and_never_asks_its_own_cuda(monkeypatch):
    assert not torch.cuda.is_available()  # this machine: the driver's own view would say gloo

    def looked_at_the_drivers_cuda(*args, **kwargs):
        raise AssertionError("the driver consulted its own CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", looked_at_the_drivers_cuda)
    monkeypatch.setattr(torch.cuda, "mem_get_info", looked_at_the_drivers_cuda)
    learner = ReportsGPUs([gpu("GPU-aaaa"), gpu("GPU-bbbb")])
    engines = ReportsGPUs([gpu("GPU-cccc", "nccl"), gpu("GPU-dddd", "nccl")])
    assert decide_transfer("auto", learner, engines) == (
        "nccl", "auto: learner rank 0 and every engine worker on GPUs of their own", "bfloat16"
    )  # fmt: skip


def test_engines_in_different_dtypes_are_refused():
    with pytest.raises(ConfigError, match=r"different dtypes \['bfloat16', 'float32'\]; pass --vllm_dtype"):
        decide_transfer("auto", ReportsGPUs([cpu()]), ReportsGPUs([cpu("float32"), cpu("bfloat16")]))


def test_vllms_nccl_init_info_gives_each_engine_its_own_ranks_and_the_plan_in_the_engines_dtype():
    plan = weight_broadcast.plan_buckets([("a", (4, 4)), ("b", (300,)), ("c", (2,))], torch.bfloat16, bucket_bytes=64)
    transfer = WeightTransfer("nccl", "10.0.0.1", 29500, 1 + 2 * 2, plan, bucket_bytes=64, timeout_s=60)
    assert transfer.update_info() == {"names": ["a", "b", "c"], "dtype_names": ["bfloat16"] * 3,
                                      "shapes": [[4, 4], [300], [2]]}  # fmt: skip
    # engine 1 of 2 engines x 2 workers: its workers are ranks 3 and 4 of the group, learner rank 0 is rank 0
    info = transfer.nccl_init_info(first_rank=3)
    assert (info["rank_offset"], info["world_size"], info["master_address"], info["packed"]) == (3, 5, "10.0.0.1", True)
    assert info["packed_buffer_size_bytes"] == 600  # the largest tensor: IPC refuses one larger than its buffer


# ---- what an engine is built with, where it runs --------------------------------------------------------------------


def test_an_engine_on_a_gpu_uses_cuda_graphs_and_vllms_transfer_engine_and_one_on_a_cpu_runs_eager():
    config = EngineConfig("model", max_model_len=256, weight_sync="auto", kv_cache_memory_gb=1.5, max_num_seqs=64)
    on_gpu = engine_kwargs(config, on_cuda=True)
    assert on_gpu["enforce_eager"] is False and on_gpu["max_num_seqs"] == 64
    assert on_gpu["kv_cache_memory_bytes"] == int(1.5 * 2**30)
    assert on_gpu["weight_transfer_config"] == {"backend": "nccl"}
    assert on_gpu["worker_extension_cls"].endswith("WeightReceiverExtension")
    colocated = engine_kwargs(
        EngineConfig("model", max_model_len=256, weight_sync="auto", colocated=True), on_cuda=True
    )
    assert colocated["weight_transfer_config"] == {"backend": "ipc"}
    on_cpu = engine_kwargs(config, on_cuda=False)
    assert on_cpu["enforce_eager"] is True
    assert "weight_transfer_config" not in on_cpu and on_cpu["kv_cache_memory_bytes"] == int(1.5 * 2**30)
    forced = engine_kwargs(EngineConfig("model", max_model_len=256, enforce_eager=True), on_cuda=True)
    assert forced["enforce_eager"] is True and "worker_extension_cls" not in forced  # single process: no transfer


def test_a_cpu_engines_kv_cache_is_the_flag_else_the_environment_else_room_for_its_batch(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, keys and values in fp32: 46 KB a token.
    per_token = kv_cache_bytes_per_token(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=4)
    assert per_token == 46080
    assert cpu_kv_cache_bytes(2.5, 256, 512, per_token) == int(2.5 * 2**30)  # the flag, to the byte
    assert cpu_kv_cache_bytes(None, 8, 256, per_token) == 8 * 256 * per_token
    assert cpu_kv_cache_bytes(None, 8, 300, per_token) == 8 * 512 * per_token  # whole blocks of any size vllm-cpu uses
    assert cpu_kv_cache_bytes(None, 256, 512, per_token) == 2 * 2**30  # 6 GB of room asked: 2 GiB at most
    tiny = kv_cache_bytes_per_token(num_layers=2, num_kv_heads=1, head_dim=64, dtype_bytes=4)
    assert cpu_kv_cache_bytes(None, 256, 512, tiny) == 128 * 2**20  # the tests' tiny model: 128 MiB, not 2 GiB
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # vllm-cpu reads it itself, over the engine argument
    assert cpu_kv_cache_bytes(None, 8, 256, per_token) == 3 * 2**30
    configure_vllm_environment(None)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"
    configure_vllm_environment(0.5)  # an explicit flag wins: the variable would override the engine argument
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ


def test_enforce_eager_is_unset_by_default_so_that_each_engine_decides():
    args = parse_args(["--dataset_mixer_list", "data.jsonl", "1.0"])
    assert args.gen.vllm_enforce_eager is None and args.gen.vllm_max_num_seqs == 256
    assert parse_args(["--dataset_mixer_list", "d.jsonl", "1.0", "--vllm_enforce_eager", "true"]).gen.vllm_enforce_eager


# ---- checksums ------------------------------------------------------------------------------------------------------


def test_the_streaming_checksum_of_vllms_transports_equals_the_gloo_checksum():
    torch.manual_seed(0)
    tensors = [torch.randn(7, 5), torch.randn(3).to(torch.bfloat16), torch.randn(2, 2, 2)]
    streaming = weight_broadcast.StreamingChecksum()
    for tensor in tensors:
        streaming.add(tensor)
    assert streaming.result() == weight_broadcast.weights_checksum(tensors)
    assert weight_broadcast.StreamingChecksum().result() == {"numel": 0, "word_sum": 0}


def test_the_source_handed_to_vllms_ipc_trainer_engine_yields_what_it_declares_and_sums_it():
    from open_instruct.learner.weight_sender import plan_source

    named = [("a", torch.randn(4, 4).to(torch.bfloat16)), ("b", torch.randn(3).to(torch.bfloat16))]
    plan = weight_broadcast.plan_buckets([(n, tuple(t.shape)) for n, t in named], torch.bfloat16, 2**20)
    transfer = WeightTransfer("ipc", "h", 1, 2, plan, 2**20, 60)
    checksum = weight_broadcast.StreamingChecksum()
    source = plan_source(transfer, lambda: iter(named), checksum)
    assert [(m.name, m.dtype, m.shape) for m in source.metadata()] == [("a", torch.bfloat16, (4, 4)),
                                                                       ("b", torch.bfloat16, (3,))]  # fmt: skip
    assert [name for name, _ in source] == ["a", "b"]
    assert checksum.result() == weight_broadcast.weights_checksum(t for _, t in named)
    swapped = plan_source(transfer, lambda: iter(named[::-1]), None)
    with pytest.raises(RuntimeError, match=r"expected a \(4, 4\), the learner gave b \(3,\)"):
        list(swapped)


# ---- memory and output_dir where the learner runs -------------------------------------------------------------------


def test_the_memory_check_of_ray_learners_uses_learner_rank_0s_own_free_memory():
    """The plan is checked against the free memory learner rank 0 reported for its own device (a GPU here), never the
    driver's; an unknown amount (None) is planned only."""
    args = parse_args(["--dataset_mixer_list", "d.jsonl", "1.0", "--per_device_train_batch_size", "64",
                       "--response_length", "1000", "--max_token_length", "2048"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"but learner rank 0's GPU \(free memory\) has 1.1 GB; the biggest item"):
        check_memory(args, 100, "cuda", 2**30, "learner rank 0's")
    assert check_memory(args, 100, "cuda", None, "learner rank 0's").peak > 2**30  # unknown: planned, not checked


def test_output_dir_is_made_absolute_where_the_trainer_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_args(["--dataset_mixer_list", "d.jsonl", "1.0", "--output_dir", "out/run"]).run.output_dir == str(
        tmp_path / "out" / "run"
    )


def test_learner_rank_0_sees_whether_output_dir_is_the_drivers_folder(tmp_path):
    driver_folder, other_node_folder = tmp_path / "shared", tmp_path / "local_disk_of_another_node"
    driver_folder.mkdir()
    other_node_folder.mkdir()
    token_path, token = write_folder_token(str(driver_folder))
    assert folder_problem(str(driver_folder), token) is None
    assert "the file the driver just wrote into it is not there" in folder_problem(str(other_node_folder), token)
    os.remove(token_path)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            [
                "--num_learners_per_node",
                "2",
                "--vllm_num_engines",
                "2",
                "--single_gpu_mode",
                "true",
                "--vllm_sync_backend",
                "nccl",
            ],
            "NCCL refuses two ranks of a group on one GPU",
        ),  # fmt: skip
        (["--vllm_num_engines", "1", "--vllm_sync_backend", "ipc"], "it needs --single_gpu_mode"),
        (["--vllm_sync_backend", "gloo"], "the single-process learner hands its tensors to its engine directly"),
        (["--vllm_kv_cache_memory_gb", "0"], "--vllm_kv_cache_memory_gb 0.0 is not valid"),
        (["--vllm_max_num_seqs", "0"], "--vllm_max_num_seqs 0 is not valid"),
    ],
)
def test_transfer_and_engine_flags_that_cannot_work_fail_before_ray_starts(flags, message):
    args = parse_args(["--dataset_mixer_list", "d.jsonl", "1.0", *flags])
    with pytest.raises(ConfigError) as error:
        check_flags(args)
    assert message in str(error.value)


# ---- the engine's side of vLLM's transfer engines, with a stand-in transport on a CPU ---------------------------------


@pytest.mark.e2e
def test_an_engine_with_a_vllm_transfer_engine_reports_the_checksum_of_what_its_loader_took(tiny_model_dir):
    """tests/support/vllm_transfer_glue.py: a real vllm-cpu engine built as for a GPU engine actor (our extension, a vLLM
    weight-transfer engine: a stand-in that loads the update's tensors as the IPC engine loads what it maps), taken
    through vLLM's start/update/finish (layer-wise reload). The checksum our wrapper took equals the sender's (the
    engine joined twice, as after an engine restart: still summed once), and the engine then holds and decodes with
    the new weights."""
    import json
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent / "support" / "vllm_transfer_glue.py"
    process, _ = run_command([sys.executable, str(script), tiny_model_dir], Path.cwd(), timeout_s=600)
    assert process.returncode == 0, process.stderr[-3000:]
    result = json.loads(process.stdout.strip().splitlines()[-1])
    assert [report["transfer_engine"] for report in result["reports"]] == ["stand_in"]
    (worker,) = result["received"]
    assert worker["tensors"] == 20 and weight_broadcast.checksum_mismatch(result["sent"], worker["checksum"]) is None
    assert result["holds_the_new_weights"] and result["greedy_changed"]
