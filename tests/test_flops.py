"""The learner's work accounting (run/flops.py) and the peak it is measured against (run/devices.py): pure, fast."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from open_instruct.run import devices
from open_instruct.run.flops import LearnerWork, ModelFlops

# A config small enough to count by hand: per layer q and o 4x(2*2) each, k and v 4x(1*2) each, MLP 3 x 4x6.
TINY = LlamaConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=2)  # fmt: skip


def test_body_params_by_hand_and_as_the_model_holds_them():
    flops = ModelFlops.of_config("policy", TINY, causal_lm=True)
    assert flops.body_params == 2 * 4 * 4 + 2 * 4 * 2 + 3 * 4 * 6 == 120
    assert (flops.head_params, flops.num_layers, flops.attention_width) == (40, 1, 4)
    assert ModelFlops.of_config("value model", TINY, causal_lm=False).head_params == 4
    # The same count as the weights of every linear map in a real model's decoder layers (norms are not matmuls).
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
    model = LlamaForCausalLM(config)
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    assert ModelFlops.of_config("policy", config, causal_lm=True).body_params == linear


def test_forward_flops_by_hand_attention_included():
    flops = ModelFlops.of_config("policy", TINY, causal_lm=True)
    # Two rows: 3 real tokens (1 of them response) and 5 (3 response).
    # Linear maps: 2 FLOPs per weight per real token: 2 * 120 * 8 = 1920. Head on response tokens: 2 * 40 * 4 = 320.
    # Attention: token j attends j keys; per key QK^T and AV cost 2 * width each = 16 FLOPs. Keys: 1+2+3 = 6 for
    # the first row, 1+...+5 = 15 for the second: 16 * 21 = 336.
    forward = flops.forward_flops(torch.tensor([3, 5]), torch.tensor([1, 3]))
    assert forward == 1920 + 320 + 336


def test_work_counts_padding_and_backward():
    flops = ModelFlops.of_config("policy", TINY, causal_lm=True)
    # Left-padded prompts, right-padded responses: 3 real tokens of 5 slots, and 5 of 5.
    attention_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    response_mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    work = LearnerWork(real_tokens=8)
    work.add_pass(flops, attention_mask, response_mask, backward=False)
    assert (work.passes_real_tokens, work.passes_token_slots, work.flops) == (8, 10, 2576)
    assert work.padding_fraction == pytest.approx(0.2)
    work.add_pass(flops, attention_mask, response_mask, backward=True)  # forward + backward: 3x the forward
    assert work.flops == 2576 + 3 * 2576
    work.add_pass(flops, attention_mask, response_mask, backward=True, token_slots=8)  # a packed pass: no padding
    assert work.padding_fraction == pytest.approx(1 - 24 / 28)
    work.seconds = 2.0
    metrics = work.metrics(peak_flops_per_second=1000.0, num_devices=2)
    assert metrics["perf/tokens_per_second"] == 4.0
    assert metrics["perf/learner_flops_utilization"] == pytest.approx(7 * 2576 / 2.0 / 2000.0)
    assert metrics["perf/padding_fraction"] == pytest.approx(4 / 28)


def test_datasheet_peaks_by_gpu_name():
    assert devices.datasheet_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert devices.datasheet_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert devices.datasheet_peak_flops("NVIDIA H200", torch.float32) == 67e12
    assert devices.datasheet_peak_flops("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312e12
    assert devices.datasheet_peak_flops("Some Future GPU", torch.bfloat16) is None


def test_cpu_peak_is_the_probe_matmul_measured_once(monkeypatch):
    peak, source = devices.peak_flops_per_second(torch.device("cpu"), torch.float32)
    flops, size = devices.cpu_matmul_flops((torch.float32,))[torch.float32]
    assert peak == flops and f"measured {size}^3 float32" in source
    assert 1e9 < peak < 1e14  # 1 GFLOP/s .. 100 TFLOP/s: a CPU
    monkeypatch.setattr(devices, "_seconds", lambda a, b: pytest.fail("the probe ran again"))
    assert devices.peak_flops_per_second(torch.device("cpu"), torch.float32)[0] == peak  # cached


def test_the_probe_times_only_the_dtypes_asked_for_at_a_size_each_dtype_runs_fast(monkeypatch):
    """A dtype the CPU emulates (bf16 on AVX2 only: 1.3 GFLOP/s at every size, measured) gets a small probe: the
    fixed 1024^3 one took 2.3 s a matmul there, ~14 s of every trainer start. Rates here are made up per dtype."""
    rates = {torch.float32: 78e9, torch.bfloat16: 1.3e9, torch.float16: 20e9}
    timed = []

    def seconds(a, b):
        timed.append((a.dtype, a.shape[0]))
        return 2 * a.shape[0] ** 3 / rates[a.dtype]

    monkeypatch.setattr(devices, "_seconds", seconds)
    monkeypatch.setattr(devices, "_cpu_matmul_flops", {})
    peak, source = devices.peak_flops_per_second(torch.device("cpu"), torch.float32)
    assert peak == pytest.approx(78e9) and "1024^3 float32" in source
    assert {dtype for dtype, _ in timed} == {torch.float32}  # fp32 compute: bf16 is not timed at all
    timed.clear()
    flops = devices.cpu_matmul_flops((torch.float32, torch.bfloat16, torch.float16), repeats=3)
    # 256^3 at 1.3 GFLOP/s: 0.026 s (512^3 would take 0.21 s > PROBE_MATMUL_S); 20 GFLOP/s: 512^3 in 0.013 s,
    # 1024^3 in 0.11 s.
    assert flops == {torch.float32: (pytest.approx(78e9), 1024), torch.bfloat16: (pytest.approx(1.3e9), 256),
                     torch.float16: (pytest.approx(20e9), 512)}  # fmt: skip
    assert torch.float32 not in {dtype for dtype, _ in timed}  # measured once per process
    assert devices.bf16_matmul_speedup() == pytest.approx(1.3 / 78)
