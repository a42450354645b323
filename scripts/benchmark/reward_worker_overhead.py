"""The reward worker's cost (open_instruct/rewards/worker.py): what a verifier call costs in the killable process
against the same call in the trainer's process, and what a cut at the timeout costs.

    python scripts/benchmark/reward_worker_overhead.py [--calls 300] [--json out.json]

Per verifier (gsm8k, math, ifeval and a --reward_function), the median seconds of one call in-process and through the
worker, taken in turns call by call so that a change in the machine's load falls on both alike; the start of the
worker and each verifier's first call (its imports: sympy for math, langdetect's profiles for ifeval); a call that
hangs, cut at a 0.5 s timeout (the time until the caller has its answer), and the restart that follows it.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from open_instruct.rewards import verifiers  # noqa: E402
from open_instruct.rewards.reward_function import load_reward_function  # noqa: E402
from open_instruct.rewards.worker import WORKER, RewardTimeout  # noqa: E402

IFEVAL = json.dumps({"instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words"],
                     "kwargs": [{}, {"num_words": 5, "relation": "at least"}]})  # fmt: skip
REWARD_SOURCE = "def exact(response, ground_truth):\n    return float(response.strip() == ground_truth.strip())\n"


def seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", help="write the results here")
    options = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    (folder / "reward.py").write_text(REWARD_SOURCE + "import time\ndef hang(response, ground_truth):\n"
                                      "    time.sleep(3600)\n")  # fmt: skip
    spec = f"{folder / 'reward.py'}:exact"
    cases = {
        "gsm8k": (verifiers.gsm8k, "so the answer is 72", "72"),
        "math": (verifiers.math, "The answer is \\boxed{\\frac{1}{2}}", "0.5"),
        "ifeval": (verifiers.VERIFIERS["ifeval"], "one two three four five six", IFEVAL),
        "reward_function": (load_reward_function(spec), "72", "72"),
    }
    result = {"calls": options.calls, "worker_start_s": seconds(lambda: WORKER.call("gsm8k", "1", "1", 60))}
    for name, (function, response, truth) in cases.items():
        target = spec if name == "reward_function" else name
        function(response, truth)  # in-process imports, not measured
        first = seconds(lambda: WORKER.call(target, response, truth, 60))
        local, worker = [], []
        for _ in range(options.calls):
            local.append(seconds(lambda: function(response, truth)))
            worker.append(seconds(lambda: WORKER.call(target, response, truth, 60)))
        result[name] = {
            "first_call_s": first,
            "in_process_us": statistics.median(local) * 1e6,
            "worker_us": statistics.median(worker) * 1e6,
            "overhead_us": (statistics.median(worker) - statistics.median(local)) * 1e6,
        }
    hang = f"{folder / 'reward.py'}:hang"
    start = time.perf_counter()
    try:
        WORKER.call(hang, "", "", 0.5)
    except RewardTimeout:
        pass
    result["hang_cut_at_0_5_s_s"] = time.perf_counter() - start  # loading the file included
    result["restart_and_gsm8k_call_s"] = seconds(lambda: WORKER.call("gsm8k", "1", "1", 60))
    print(json.dumps(result, indent=2))
    if options.json:
        Path(options.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
