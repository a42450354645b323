"""The verdicts of scripts/check_gpu.py: pure functions from what a check measured to its row (PASS or FAIL), with the
tolerances they judge by and why. Kept apart from the checks so that each verdict is tested on CPU with the numbers of
a working and of a broken GPU (tests/test_check_gpu.py).
"""

import re
from dataclasses import dataclass

# bf16 vs fp32, one PPO step of the embedded model from the same start, measured on a CPU with native bf16 (AMD EPYC,
# avx512_bf16, 2026-11-24): logprob gap 0.046 nats per token, update cosine 0.82 (the tiny model: 0.0007 and 1.00).
# Adam's first steps move each weight by about lr * sign(gradient), so small gradients whose sign bf16 flips lower
# the cosine; a learner that lost its fp32 master weights (updates rounded away) or computed garbage falls far
# below these bounds, which leave room for other hardware.
BF16_LOGPROB_TOLERANCE = 0.1  # nats per token
BF16_UPDATE_COSINE = 0.7
CUDA_GRAPH_LOGPROB_TOLERANCE = 0.05  # graphs vs eager run different kernels (bf16 sums in another order)
MEMORY_PLAN_TOLERANCE = 0.15  # the plan vs the measured peak; on CPUs it was within 15% (docs/distributed.md)
# single_gpu_run: the debug recipe for SINGLE_GPU_STEPS steps in sync mode, where the engine samples with the weights
# the learner scores with, so a synced engine's gap (`debug/vllm_vs_learner_logprob_diff_mean`) is rounding alone and
# a stale engine's is the policy change of the updates it missed. Rounding, bf16 engine: 0.026-0.039 nats per token
# (docs/ppo_details.md, sync mode, CPU with avx512_bf16, SmolLM2 at temperature 0.7). One update's change is what
# separates them, and at the recipe's own learning rate (3e-6 x 8 AdamW steps a PPO step) it is about as small
# (async mode's one-update lag at 1e-5 x 4 steps: 0.017-0.033); so the check trains at SINGLE_GPU_LEARNING_RATE.
# Measured there on a CPU (scripts/benchmark/stale_weights_gap.py, fp32, docs/measurements/2026-11-27-epyc): synced,
# 3e-6 at every step; sync skipped, 0.57 at step 2, the first on stale weights. GAP_BOUND_STALE_WEIGHTS is 2.5x the
# bf16 rounding and under a fifth of one missed update; an engine that loads part of the weights (the tied head left
# packed: 0.01-0.2, docs/ppo_details.md) lands in between and may pass.
SINGLE_GPU_STEPS = 3
SINGLE_GPU_LEARNING_RATE = "1e-4"
GAP_BOUND_STALE_WEIGHTS = 0.1  # nats per token
# A learner that never updates (no optimizer step applied, a zero learning rate) keeps the engine's gap at rounding, as
# a working one does: only the weights show it. ||saved - start|| / ||start||, the start cast to the saved dtype, is
# then exactly 0. AdamW's first steps move each weight that has a gradient by about the learning rate: 2 steps at 1e-4
# moved the tiny model by 1.3e-3 (scripts/benchmark/update_size.py, most of its weights an embedding whose unseen rows
# get none); the embedded model (weights' rms 0.18, 21% embedding) moves about 5 x lr per step, so the run's ~23
# AdamW steps at up to 1e-4 give 1e-3 or more (an estimate: not measured at these settings). The bound is 1e-4.
MIN_RELATIVE_UPDATE = 1e-4


@dataclass
class Row:
    check: str
    status: str  # PASS, FAIL or SKIP
    measured: str = ""
    tolerance: str = ""
    detail: str = ""


def listed_gpus(nvidia_smi_output: str) -> int:
    """`nvidia-smi -L` prints one `GPU i: NAME (UUID: ...)` line per GPU (MIG devices indented under theirs)."""
    return len(re.findall(r"^GPU \d+:", nvidia_smi_output, flags=re.MULTILINE))


def torch_blind_row(torch_count: int, driver: tuple[int, str], torch_build: str) -> Row | None:
    """The `gpus` row where the driver lists GPUs torch cannot use (a CPU wheel on a GPU node, CUDA_VISIBLE_DEVICES
    empty, a driver older than torch's CUDA): every GPU check would be SKIPped, and a table of SKIPs must not pass."""
    listed, how = driver
    if torch_count > 0 or listed == 0:
        return None
    return Row("gpus", "FAIL", f"torch sees 0 GPUs; {how}", "torch sees the driver's GPUs",
               f"{torch_build}: install a CUDA build of torch (bash scripts/install.sh on this node) or fix "
               "CUDA_VISIBLE_DEVICES")  # fmt: skip


def bf16_verdict(logprob_gap: float, cosine: float) -> str:
    return "PASS" if logprob_gap <= BF16_LOGPROB_TOLERANCE and cosine >= BF16_UPDATE_COSINE else "FAIL"


def cuda_graphs_verdict(reloaded: dict, before: dict, fresh_graphs: dict, fresh_eager: dict) -> Row:
    """The verdict on four engine jobs' outputs (`engine_job`: token ids and logprobs per question): A's engine
    loaded with B, A's engine as it started, fresh CUDA-graph and eager engines on B."""
    pairs = list(zip(reloaded["token_ids"], fresh_graphs["token_ids"], strict=True))
    same = sum(x == y for x, y in pairs) / len(pairs)
    moved = reloaded["token_ids"] != before["token_ids"]
    gaps = [abs(x - y) for a, b in zip(reloaded["logprobs"], fresh_eager["logprobs"]) for x, y in zip(a, b)
            if x is not None and y is not None]  # fmt: skip
    gap = sum(gaps) / max(1, len(gaps))
    ok = same == 1.0 and moved and gap <= CUDA_GRAPH_LOGPROB_TOLERANCE
    return Row("cuda_graphs", "PASS" if ok else "FAIL", f"identical {same:.2f}, eager gap {gap:.4f}",
               f"1.00, <= {CUDA_GRAPH_LOGPROB_TOLERANCE}", "the load changed the output" if moved else
               "the load changed nothing: the comparison proves nothing")  # fmt: skip


@dataclass
class TransferRun:
    """What a transfer run left (`read_transfer_run`)."""

    transport: str  # the transport its log names
    transfer_seconds: list[float]  # each step's weight transfer (metrics.jsonl)
    steps: int
    final_version: int | None  # the policy version of its last eval
    final: dict[str, list[int]]  # that eval's greedy token ids, by prompt


Answers = dict[str, tuple[list[int], list[float | None]]]  # an engine's greedy token ids and logprobs, by prompt


def transfer_verdict(name: str, transport: str, run: TransferRun, fresh: Answers, stale: Answers) -> Row:
    """The verdict on a transfer run (`read_transfer_run`) and two engines' greedy answers to its eval prompts: a
    fresh engine on the saved model, and a stale one on the start model (what the run's engine held had no transfer
    reached it). The run's answers must be the fresh engine's (an answer stopped at EOS is a prefix of the fresh one,
    which runs on to max_tokens) and, on one prompt at least, not the stale engine's: the run's eval records tokens
    only, so where the update changed no greedy answer a transfer that did nothing reads identical too. The stale
    engine's logprob gap to the fresh one, on the tokens both chose alike, sizes the update."""
    if run.transport != transport:
        return Row(name, "FAIL", f"{run.transport}, not {transport}", transport,
                   "the check names a transport the run did not use: it proves nothing about that one")  # fmt: skip
    if not run.transfer_seconds or run.final_version != run.steps:
        return Row(name, "FAIL", f"{len(run.transfer_seconds)} transfer(s), final eval at version {run.final_version}",
                   "1.00", f"{run.steps} steps: the final eval must run on the weights of the last one")  # fmt: skip
    if run.final.keys() != fresh.keys() or fresh.keys() != stale.keys():
        return Row(name, "FAIL", f"{transport}, {len(run.final)} eval prompts vs {len(fresh)} fresh, {len(stale)} stale",
                   "1.00", "the run's final eval and the engines answered different prompts")  # fmt: skip
    same = sum(fresh[prompt][0][: len(tokens)] == tokens for prompt, tokens in run.final.items()) / len(run.final)
    unlike_stale = sum(stale[prompt][0][: len(tokens)] != tokens for prompt, tokens in run.final.items())
    gap = alike_logprob_gap(fresh, stale)
    measured = f"{transport}, identical {same:.2f}, unlike stale {unlike_stale}/{len(run.final)}, stale gap {gap:.4f}"
    if unlike_stale == 0:
        return Row(name, "FAIL", measured, "1.00, >= 1 unlike stale",
                   "the run's eval is the start model's: the transfer did nothing, or the update changed no greedy "
                   "answer and the check proves nothing")  # fmt: skip
    return Row(name, "PASS" if same == 1.0 else "FAIL", measured, "1.00, >= 1 unlike stale",
               f"transfer {max(run.transfer_seconds):.2f}s; checksums equal every step (the run would have stopped)")  # fmt: skip


def alike_logprob_gap(fresh: Answers, stale: Answers) -> float:
    """Mean |logprob difference| per token over each prompt's tokens up to where the two answers part (0 if none)."""
    gaps = []
    for prompt, (tokens, logprobs) in fresh.items():
        for token, other, x, y in zip(tokens, stale[prompt][0], logprobs, stale[prompt][1]):
            if token != other:
                break
            if x is not None and y is not None:
                gaps.append(abs(x - y))
    return sum(gaps) / max(1, len(gaps))


def single_gpu_verdict(gaps: list[float | None], seconds: list[float], update: float, model: str) -> Row:
    """The verdict on the single-GPU run: SINGLE_GPU_STEPS steps, each with an engine-vs-learner gap
    (`debug/vllm_vs_learner_logprob_diff_mean`) within GAP_BOUND_STALE_WEIGHTS, and the saved model moved from the
    start by MIN_RELATIVE_UPDATE at least (`relative_update`): in sync mode a learner that never updates and an engine
    that follows it agree as well as a working pair."""
    if len(gaps) < SINGLE_GPU_STEPS or None in gaps:
        return Row("single_gpu_run", "FAIL", f"{len(gaps)} steps, gaps {gaps}", f"{SINGLE_GPU_STEPS} steps",
                   "the run ended early or logged no engine-vs-learner gap")  # fmt: skip
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    synced, moved = gaps[worst] <= GAP_BOUND_STALE_WEIGHTS, update >= MIN_RELATIVE_UPDATE
    detail = f"{len(gaps)} steps of {model}, sync mode"
    if not synced:
        detail += f"; step {worst + 1}'s engine samples from other weights than the learner's (stale?)"
    if not moved:
        detail += "; the learner's weights did not move: it never applied an update"
    return Row("single_gpu_run", "PASS" if synced and moved else "FAIL",
               f"{sum(seconds[1:]) / max(1, len(seconds) - 1):.1f} s/step, logprob gap "
               f"{', '.join(f'{g:.4f}' for g in gaps)}, update {update:.2e}",
               f"gap <= {GAP_BOUND_STALE_WEIGHTS}, update >= {MIN_RELATIVE_UPDATE:.0e}", detail)  # fmt: skip


def memory_plan_verdict(planned: float, measured: float) -> str:
    return "PASS" if abs(planned / measured - 1) <= MEMORY_PLAN_TOLERANCE else "FAIL"
