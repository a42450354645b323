"""Rewards: `RewardManager.score` turns responses into one scalar score each, from each row's verifier (see
`verifiers`; with --reward_function, the user's own for every row: `reward_function`), an optional reward model's
score, an optional R1-style format reward and DAPO's soft overlong penalty, then applies the non-stop penalty ("The N
Implementation Details of RLHF with PPO"). Code rows run their tests in sandboxes, --code_workers at a time
(`code_tests`); the --reward_function and the verifiers that can run long on one response run in the reward worker,
cut at --reward_timeout_s (`reward_worker`); a response its verifier fails on scores 0 and is counted (`reward_failures`).

The verifiers' part (`verdicts`) is computed once per response where the trainer collects the batch; the learner,
one process or every Ray rank, adds its own terms to those verdicts (`VerifiedScores`).
"""

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from open_instruct.rewards.code_tests import OUTCOMES, CodeVerifier
from open_instruct.rewards.config import CODE_VERIFIER, RewardConfig, code_limits
from open_instruct.rewards.failures import FailureTally, Outcome, outcome_of
from open_instruct.rewards.reward_function import absolute_spec, load_reward_function, split_spec
from open_instruct.rewards.verifiers import (
    IN_PROCESS_VERIFIERS,
    VERIFIER_ALIASES,
    VERIFIERS,
    r1_format,
    resolve_verifier_name,
)
from open_instruct.rewards.worker import WORKER
from open_instruct.sandbox import Sandbox


def check_lengths(batch: int, lengths: dict[str, int]) -> None:
    mismatched = {name: length for name, length in lengths.items() if length != batch}
    if mismatched:
        raise ValueError(
            f"RewardManager.score got {batch} responses but lengths {mismatched}; pass one entry per response."
        )


def overlong_penalty(response_lengths: torch.Tensor, max_length: int, buffer_length: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al., 2025, eq. 13) of each response [batch]: 0 up to max_length -
    buffer_length tokens, then falling linearly to -factor at max_length (a response cannot be longer). Shorter
    answers are not rewarded; answers near the limit are pushed back gradually instead of all truncated ones getting
    the same penalty."""
    start = max_length - buffer_length
    return -factor * ((response_lengths.float() - start) / buffer_length).clamp(0.0, 1.0)


class Scorer(Protocol):
    """The rewards' seam: what the learner calls to score a rollout (`RewardManager`, or `PrecomputedScores` when the
    driver scored the batch already). tests/test_seams.py holds both to this signature."""

    def score(
        self,
        responses: list[str],
        ground_truths: list[str | None],
        verifier_names: list[str | None],
        stopped: list[bool],
        rm_scores: torch.Tensor | None = None,
        response_lengths: list[int] | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """One score per response (float32 [batch]) and the step's reward metrics."""
        ...


@dataclass
class Verdicts:
    """The verifiers' part of a batch's scores: what `RewardManager.verdicts` computes once per response, where the
    batch is collected, for every learner rank to combine with its own terms (`VerifiedScores`)."""

    correct: torch.Tensor  # [batch] each response's verifier score in [0, 1]; 0 where none ran or it failed
    verified: list[bool]  # whether a verifier scored the response (it has a ground truth and they are on)
    format_scores: list[float]  # the R1 format reward of each response; empty when it is off
    metrics: dict[str, float]  # objective/*_correct_rate, reward/{errors,timeouts}/*, time/reward


class RewardManager:
    """Turns responses into one scalar score each, following a RewardConfig."""

    def __init__(self, config: RewardConfig, max_response_length: int | None = None):
        """`max_response_length`: --response_length, which the overlong penalty counts back from. A --reward_function
        is loaded here once, so that its problems raise ValueError now, not at the first score (it scores in the
        reward worker)."""
        self.config = config
        self.max_response_length = max_response_length
        self.reward_function_spec = None if config.reward_function is None else absolute_spec(config.reward_function)
        if self.reward_function_spec is not None:
            load_reward_function(self.reward_function_spec)
        self._code_verifier: CodeVerifier | None = None
        self.failures = FailureTally(config.reward_max_consecutive_failures)

    def __getstate__(self) -> dict:
        # The code verifier's threads are this process's own: a process that unpickles the manager starts its own.
        return {**self.__dict__, "_code_verifier": None}

    def code_verifier(self) -> CodeVerifier:
        """The verifier of code rows, from the --code_* flags; built on first use (runs without code rows need no
        sandbox). Raises SandboxUnavailable where the sandbox cannot isolate."""
        if self._code_verifier is None:
            config = self.config
            sandbox = Sandbox(config.code_sandbox, code_limits(config))
            self._code_verifier = CodeVerifier(sandbox, config.code_max_tests, config.code_pass_threshold,
                                               config.code_workers)  # fmt: skip
        return self._code_verifier

    def verifier_of(self, verifier_name: str | None, index: int) -> tuple[str, str, str]:
        """(its name in the metrics, how the console names it, what the reward worker calls) of row `index`'s
        verifier: the --reward_function for every row when one is given, else the row's own."""
        if self.reward_function_spec is not None:
            spec = self.reward_function_spec
            return split_spec(spec)[1], f"--reward_function {spec}", spec
        if verifier_name is None:
            raise ValueError(
                f"Row {index} has a ground truth but no verifier name; set its `dataset`/`data_source` to one "
                f"of {', '.join(sorted(VERIFIER_ALIASES))}."
            )
        canonical = resolve_verifier_name(verifier_name)
        return canonical, f"the {canonical} verifier", canonical

    def outcome(self, function: str, response: str, ground_truth: str) -> Outcome:
        """One response's score by `function` (a verifier's name or the --reward_function spec), or its failure."""
        if function in IN_PROCESS_VERIFIERS:
            return outcome_of(lambda: VERIFIERS[function](response, ground_truth))
        return outcome_of(lambda: WORKER.call(function, response, ground_truth, self.config.reward_timeout_s))

    def validate(self, verifier_names: Iterable[str | None]) -> None:
        """Fail at start-up, not mid-run: some reward must be on, and every dataset name must have a verifier."""
        if not self.config.apply_verifiable_reward and self.config.reward_model_multiplier == 0:
            raise ValueError(
                "No reward is enabled (apply_verifiable_reward is false and reward_model_multiplier is 0); "
                "pass `--apply_verifiable_reward true` or a non-zero `--reward_model_multiplier`."
            )
        if self.config.apply_verifiable_reward and self.reward_function_spec is None:
            for name in set(verifier_names):
                if name is not None:
                    resolve_verifier_name(name)

    def score(
        self,
        responses: list[str],
        ground_truths: list[str | None],
        verifier_names: list[str | None],
        stopped: list[bool],
        rm_scores: torch.Tensor | None = None,
        response_lengths: list[int] | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Score each response; returns (score float32 [batch], metrics). See `score_and_correct`."""
        score, _, metrics = self.score_and_correct(
            responses, ground_truths, verifier_names, stopped, rm_scores, response_lengths
        )
        return score, metrics

    def verdicts(
        self, responses: list[str], ground_truths: list[str | None], verifier_names: list[str | None]
    ) -> Verdicts:
        """Each response's verifier score (and format reward): the rows' verifiers, or the --reward_function, in the
        reward worker (cut at --reward_timeout_s), code rows on the sandbox pool. A response its verifier fails on
        scores 0 and is counted (reward_failures); structural problems of the batch (a row with a ground truth and
        no verifier name, an unknown name) raise ValueError."""
        config = self.config
        started = time.perf_counter()
        lengths = {"ground_truths": len(ground_truths), "verifier_names": len(verifier_names)}
        check_lengths(len(responses), lengths)
        verified = [config.apply_verifiable_reward and truth is not None for truth in ground_truths]
        verifier_of = {i: self.verifier_of(verifier_names[i], i) for i in range(len(responses)) if verified[i]}
        code_rows = [i for i, (_, _, function) in verifier_of.items() if function == CODE_VERIFIER]
        metrics: dict[str, float] = {}
        outcomes = {i: self.outcome(function, responses[i], ground_truths[i])
                    for i, (_, _, function) in verifier_of.items() if function != CODE_VERIFIER}  # fmt: skip
        if code_rows:  # a step's programs run side by side, --code_workers at a time
            verifier = self.code_verifier()
            code_outcomes = verifier.pool.map(
                lambda i: outcome_of(lambda: verifier.score(responses[i], ground_truths[i])), code_rows
            )
            outcomes.update(zip(code_rows, code_outcomes))
            metrics_of_code_tests(verifier.take_outcomes(), metrics)
        correct = torch.zeros(len(responses), dtype=torch.float32)
        correct_by_verifier: dict[str, list[float]] = {}
        for i in sorted(outcomes):  # in the batch's order: the failures in a row are the responses' order
            name, described, _ = verifier_of[i]
            self.failures.count(name, described, outcomes[i], metrics)
            correct[i] = outcomes[i].score
            correct_by_verifier.setdefault(name, []).append(outcomes[i].score)
        all_correct = [c for values in correct_by_verifier.values() for c in values]
        if all_correct:
            metrics["objective/verifiable_correct_rate"] = sum(all_correct) / len(all_correct)
        for name, values in sorted(correct_by_verifier.items()):
            metrics[f"objective/{name}_correct_rate"] = sum(values) / len(values)
        format_scores = [r1_format(response) for response in responses] if config.add_r1_style_format_reward else []
        if format_scores:
            metrics["objective/format_reward"] = sum(format_scores) / len(format_scores)
        metrics["time/reward"] = time.perf_counter() - started  # the verifiers' wall time: code tests dominate it
        return Verdicts(correct, verified, format_scores, metrics)

    def score_and_correct(
        self,
        responses: list[str],
        ground_truths: list[str | None],
        verifier_names: list[str | None],
        stopped: list[bool],
        rm_scores: torch.Tensor | None = None,
        response_lengths: list[int] | None = None,
        verdicts: Verdicts | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Score each response; returns (score float32 [batch], correct float32 [batch], metrics), `correct` being the
        verifier's score alone, in [0, 1] (0 where no verifier ran): what DAPO's dynamic sampling filters on.
        `verdicts`: the verifiers' part computed before (`verdicts`), else computed here.

        score = reward_model_multiplier * rm_score + verification_reward * verifier_score
        + r1_style_format_reward * format_score + the overlong penalty (each term when enabled), then replaced by
        penalty_reward_value for responses that did not stop when non_stop_penalty is on
        (N implementation details, "non-stop penalty"). `response_lengths`: in tokens, for the overlong penalty, which
        shapes training scores only (an eval passes none).
        """
        config = self.config
        batch = len(responses)
        lengths = {"ground_truths": len(ground_truths), "verifier_names": len(verifier_names), "stopped": len(stopped)}
        if rm_scores is not None:
            lengths["rm_scores"] = rm_scores.numel()
        if verdicts is not None:
            lengths["verdicts"] = len(verdicts.verified)
        check_lengths(batch, lengths)
        use_reward_model = rm_scores is not None and config.reward_model_multiplier != 0
        for i, verified in enumerate(verdicts.verified if verdicts is not None else
                                     [config.apply_verifiable_reward and t is not None for t in ground_truths]):  # fmt: skip
            if not verified and not use_reward_model:
                raise ValueError(
                    f"Row {i} has no reward source (ground truth {ground_truths[i]!r} with apply_verifiable_reward="
                    f"{config.apply_verifiable_reward}, and no reward model); give it a ground truth or enable "
                    f"`--reward_model_multiplier`."
                )
        if verdicts is None:
            verdicts = self.verdicts(responses, ground_truths, verifier_names)

        score = config.verification_reward * verdicts.correct
        if use_reward_model:
            score += config.reward_model_multiplier * rm_scores.detach().float().cpu().flatten()
        if verdicts.format_scores:
            score += config.r1_style_format_reward * torch.tensor(verdicts.format_scores, dtype=torch.float32)
        overlong = self.overlong(response_lengths)
        if overlong is not None:
            score += overlong

        not_stopped = torch.tensor([not s for s in stopped], dtype=torch.bool)
        if config.non_stop_penalty:
            score = torch.where(not_stopped, torch.tensor(config.penalty_reward_value, dtype=torch.float32), score)
        return score, verdicts.correct.clone(), {**self.length_metrics(stopped, overlong), **verdicts.metrics}

    def overlong(self, response_lengths: list[int] | None) -> torch.Tensor | None:
        """Each response's overlong penalty [batch], or None when it is off or no lengths were given (an eval)."""
        config = self.config
        if config.overlong_buffer_length <= 0 or response_lengths is None:  # training only; evals grade answers alone
            return None
        if self.max_response_length is None:
            raise ValueError("the overlong penalty needs --response_length: pass max_response_length")
        return overlong_penalty(torch.tensor(response_lengths), self.max_response_length,
                                config.overlong_buffer_length, config.overlong_penalty_factor)  # fmt: skip

    @staticmethod
    def length_metrics(stopped: list[bool], overlong: torch.Tensor | None) -> dict[str, float]:
        """`val/num_non_stop` and, when the penalty is on, `objective/overlong_penalty` (the mean of `overlong`, see
        `overlong`) of these responses: what describes the batch trained on, where GRPO's filter chose it from several
        draws."""
        metrics = {"val/num_non_stop": float(sum(not s for s in stopped))}
        if overlong is not None:
            metrics["objective/overlong_penalty"] = overlong.mean().item()
        return metrics


class PrecomputedScores:
    """A RewardManager's `score` answered with scores already computed (GRPO's zero-std filter scored the batch before
    it chose it), so that the learner does not run the verifiers again; `metrics` are the step's reward metrics."""

    def __init__(self, scores: torch.Tensor, metrics: dict[str, float]):
        self.scores, self.metrics = scores, metrics

    def score(
        self,
        responses: list[str],
        ground_truths: list[str | None],
        verifier_names: list[str | None],
        stopped: list[bool],
        rm_scores: torch.Tensor | None = None,
        response_lengths: list[int] | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The scores computed before; the other arguments are those they were computed from."""
        if len(responses) != len(self.scores):
            raise ValueError(f"{len(self.scores)} precomputed scores for {len(responses)} responses")
        return self.scores.clone(), dict(self.metrics)


class VerifiedScores:
    """A RewardManager's `score` with the verifiers' verdicts computed before (`RewardManager.verdicts`, once per
    response where the batch was collected): every learner rank combines the same verdicts with its own terms (the
    reward model's score, the penalties), so that a verifier that times out on one rank and not on another cannot
    give the ranks different advantages, and no rank runs the verifiers again."""

    def __init__(self, manager: RewardManager, verdicts: Verdicts):
        self.manager, self.verdicts = manager, verdicts

    def score(
        self,
        responses: list[str],
        ground_truths: list[str | None],
        verifier_names: list[str | None],
        stopped: list[bool],
        rm_scores: torch.Tensor | None = None,
        response_lengths: list[int] | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The manager's score of these responses, from the verdicts computed before."""
        score, _, metrics = self.manager.score_and_correct(responses, ground_truths, verifier_names, stopped, rm_scores,
                                                           response_lengths, self.verdicts)  # fmt: skip
        return score, metrics


def metrics_of_code_tests(counts: dict[str, int], metrics: dict[str, float]) -> None:
    """`code/tests_<outcome>`: the share of the step's code tests that ended each way (code_tests.OUTCOMES: passed,
    wrong, crashed, timeout, no_value, bad_value, ...), so that a policy drifting into crashes, timeouts or values the
    verifier refuses shows as a curve, not only as a lower correct rate."""
    total = sum(counts.values())
    for outcome in OUTCOMES:
        metrics[f"code/tests_{outcome}"] = counts.get(outcome, 0) / total if total else 0.0
