"""Code sandbox throughput: the cost of one sandboxed test, and code rows scored per second on 1, 2 and 4 workers.

    python scripts/benchmark/sandbox_throughput.py [--runs 40] [--rows 32] [--workers 1 2 4] [--json out.json]

Per-test overhead: the median wall time of a trivial program (`pass`) run `--runs` times in the isolated sandbox (also
without its seccomp filter, and without its cgroups, to show what each wall costs), in the unsafe mode (limits only)
and as a bare `python -I -S` subprocess; the isolation's own cost is the difference. The variants take turns, run by
run, so that a change in the machine's load falls on all of them alike.
Rows per second: `--rows` rows of the shipped fixture (open_instruct/data/fixtures/code_problems.jsonl, 3-4 tests
each), each answered by a right program, scored through `CodeVerifier.score_many` with each worker count.
Needs root for the isolated sandbox (as the trainer does).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from open_instruct.rewards.code_tests import CodeVerifier  # noqa: E402
from open_instruct.sandbox import ISOLATED, UNSAFE_NO_ISOLATION, Limits, Sandbox  # noqa: E402

FIXTURE = REPO / "open_instruct" / "data" / "fixtures" / "code_problems.jsonl"
SOLUTIONS = [  # a right program for each fixture row, in its order
    "a, b = map(int, input().split())\nprint(a + b)\n",
    "print(input()[::-1])\n",
    "print(int(input()) * 2)\n",
    "print(input().upper())\n",
    "def add(a, b):\n    return a + b\n",
    "def is_even(n):\n    return n % 2 == 0\n",
    "def square(x):\n    return x * x\n",
    "def largest(numbers):\n    return max(numbers)\n",
]


def median_walls(variants: dict, runs: int) -> dict[str, float]:
    """name -> the median wall seconds of `variants[name]()`, the variants taking turns run by run."""
    times = {name: [] for name in variants}
    for run_once in variants.values():
        run_once()  # warm-up: page cache, first namespace
    for _ in range(runs):
        for name, run_once in variants.items():
            start = time.perf_counter()
            run_once()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40, help="trivial programs timed per mode")
    parser.add_argument("--rows", type=int, default=32, help="fixture rows scored per worker count")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    limits = Limits(wall_time_s=10.0)
    isolated = Sandbox(ISOLATED, limits)
    # The same sandbox less one wall: what that wall costs a run.
    no_seccomp, no_cgroups = Sandbox(ISOLATED, limits), Sandbox(ISOLATED, limits)
    no_seccomp.seccomp_program, no_cgroups.cgroups = None, ()
    unsafe = Sandbox(UNSAFE_NO_ISOLATION, limits)
    overhead = median_walls({
        "isolated": lambda: isolated.run_python("pass"),
        "isolated without seccomp": lambda: no_seccomp.run_python("pass"),
        "isolated without cgroups": lambda: no_cgroups.run_python("pass"),
        "unsafe_no_isolation": lambda: unsafe.run_python("pass"),
        "bare python -I -S": lambda: subprocess.run([isolated.interpreter, "-I", "-S", "-c", "pass"], check=True),
    }, args.runs)  # fmt: skip
    print(f"per-test overhead, median of {args.runs} runs of `pass` ({os.cpu_count()} CPUs):")
    for mode, seconds in overhead.items():
        print(f"  {mode:<26} {seconds * 1000:7.1f} ms")

    ground_truths = [json.loads(line)["ground_truth"] for line in FIXTURE.read_text().splitlines()]
    rows = [(SOLUTIONS[i % len(SOLUTIONS)], ground_truths[i % len(SOLUTIONS)]) for i in range(args.rows)]
    tests = sum(len(json.loads(ground_truth)) if ground_truth.startswith("[") else
                len(json.loads(ground_truth)["inputs"]) for _, ground_truth in rows)  # fmt: skip
    throughput = {}
    print(f"\n{args.rows} fixture rows ({tests} tests), right programs, isolated:")
    print("| workers | seconds | rows/s | tests/s | mean score |\n| --- | --- | --- | --- | --- |")
    for workers in args.workers:
        verifier = CodeVerifier(isolated, max_tests=0, workers=workers)
        start = time.perf_counter()
        scores = verifier.score_many([program for program, _ in rows], [ground_truth for _, ground_truth in rows])
        seconds = time.perf_counter() - start
        verifier.pool.close()
        throughput[workers] = {"seconds": seconds, "rows_per_s": args.rows / seconds, "tests_per_s": tests / seconds,
                               "mean_score": sum(scores) / len(scores)}  # fmt: skip
        print(f"| {workers} | {seconds:.2f} | {args.rows / seconds:.1f} | {tests / seconds:.1f} | "
              f"{sum(scores) / len(scores):.2f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"overhead_s": overhead, "throughput": throughput}, indent=2))


if __name__ == "__main__":
    main()
