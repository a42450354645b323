#!/usr/bin/env bash
# Install what is needed (once) and run the test suite.
#
#   bash scripts/test.sh                 # everything (CI runs this)
#   bash scripts/test.sh --fast          # the inner loop: no engine, Ray, DeepSpeed ranks or trainer run
#   bash scripts/test.sh -k rl_math     # extra arguments go to pytest
#
# The tiers are markers (pytest.ini, tests/README.md): e2e, ray and slow tests are left out of --fast, whose
# tests each get 300 s at most instead of 900 s.
#
# The whole suite runs on two pytest-xdist workers, each taking a whole file at a time (a file's module fixtures are
# built once) and each with torch on one thread (OMP_NUM_THREADS=1 unless set: two workers with two threads each
# oversubscribe two cores; the fast tier took 255 s so, 125 s with one each, against 199 s in one process). A file
# that starts Ray runs beside heavy and light files but never beside another one, the two-node file beside light
# files only (memory); xdist's scheduler gives a worker the next file that may start beside the other's
# (tests/support/worker_turns.py; tests/README.md, "Two workers", says why and has the times).
# OPEN_INSTRUCT_TEST_WORKERS=N sets the number (0: no workers, pytest's own process).
#
# Tests run inside a loopback-only network namespace when the machine allows it (root), because
# Ray listens on every interface otherwise; Ray tests skip with a reason when it does not.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
bash scripts/install.sh ${OPEN_INSTRUCT_CURRENT_ENV:+--current-env}
python="${OPEN_INSTRUCT_VENV:-$REPO/.venv}/bin/python"
[[ -n "${OPEN_INSTRUCT_CURRENT_ENV:-}" ]] && python="$(command -v python3)"

export WANDB_MODE=offline WANDB_SILENT=true HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
# Build the embedded model once, with the network still there for nothing: it is all local.
"$python" -c "from open_instruct.data.embedded import smollm2_path, tiny_model_path; smollm2_path(); tiny_model_path()"

tier=()
workers="${OPEN_INSTRUCT_TEST_WORKERS:-2}"
if [[ "${1:-}" == "--fast" ]]; then
  shift
  tier=(-m "not e2e and not ray and not slow" --timeout 300)
  # Runs forked from a zygote that did their imports (tests/support/forked_runs.py) pay off over the whole suite's ~60
  # runs; the fast tier starts ~4, fewer than the zygote's own imports cost (test_check_gpu 24 s -> 40 s with it).
  export OPEN_INSTRUCT_TEST_FORK="${OPEN_INSTRUCT_TEST_FORK:-0}"
fi
distribute=()
if [[ "$workers" != 0 ]]; then
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  distribute=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
pytest_cmd=("$python" -m pytest tests -q -ra --durations=15 "${distribute[@]}" "${tier[@]}" "$@")
status=0
if unshare -n true 2>/dev/null; then
  echo "[test] running pytest in a loopback-only network namespace"
  unshare -n bash -c 'ip link set lo up && OPEN_INSTRUCT_LOOPBACK_ONLY=1 exec "$@"' _ "${pytest_cmd[@]}" || status=$?
else
  echo "[test] cannot create a network namespace here; Ray tests will be skipped"
  "${pytest_cmd[@]}" || status=$?
fi
if [[ $status == 5 ]]; then
  echo "[test] pytest collected no tests: the test setup is broken" >&2
  exit 1
fi
exit $status
