"""Rewards: `RewardManager.score` turns responses into one scalar score each, from each row's verifier (see
`verifiers`; with --reward_function, the user's own for every row: `reward_function`), an optional reward model's
score, an optional R1-style format reward and DAPO's soft overlong penalty, then applies the non-stop penalty ("The N
Implementation Details of RLHF with PPO"). Code rows run their tests in sandboxes, --code_workers at a time
(`code_tests`).
"""

import time
from collections.abc import Iterable
from typing import Protocol

import torch

from open_instruct.rl.code_tests import CodeVerifier
from open_instruct.rl.reward_config import CODE_VERIFIER, RewardConfig, code_limits
from open_instruct.rl.reward_function import absolute_spec, checked_score, load_reward_function, split_spec
from open_instruct.rl.verifiers import VERIFIER_ALIASES, VERIFIERS, r1_format, resolve_verifier_name
from open_instruct.sandbox import Sandbox


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


class RewardManager:
    """Turns responses into one scalar score each, following a RewardConfig."""

    def __init__(self, config: RewardConfig, max_response_length: int | None = None):
        """`max_response_length`: --response_length, which the overlong penalty counts back from. A --reward_function
        is loaded here (its problems raise ValueError now, not at the first score)."""
        self.config = config
        self.max_response_length = max_response_length
        self.reward_function_spec = None if config.reward_function is None else absolute_spec(config.reward_function)
        self._reward_function = None
        if self.reward_function_spec is not None:
            self._reward_function = load_reward_function(self.reward_function_spec)
        self._code_verifier: CodeVerifier | None = None

    def __getstate__(self) -> dict:
        # A function from the user's file is loaded again from its path where the manager is unpickled (a Ray learner
        # rank): pickle would look for its module by name, which only this process has. The code verifier's threads
        # are this process's own: a rank starts its own on first use.
        return {**self.__dict__, "_reward_function": None, "_code_verifier": None}

    def code_verifier(self) -> CodeVerifier:
        """The verifier of code rows, from the --code_* flags; built on first use (runs without code rows need no
        sandbox). Raises SandboxUnavailable where the sandbox cannot isolate."""
        if self._code_verifier is None:
            config = self.config
            sandbox = Sandbox(config.code_sandbox, code_limits(config))
            self._code_verifier = CodeVerifier(sandbox, config.code_max_tests, config.code_pass_threshold,
                                               config.code_workers)  # fmt: skip
        return self._code_verifier

    def verify(self, response: str, ground_truth: str, verifier_name: str | None, index: int) -> tuple[str, float]:
        """(the verifier's name in the metrics, its score in [0, 1]) of response `index`: the --reward_function for
        every row when one is given, else the row's own verifier."""
        if self.reward_function_spec is not None:
            if self._reward_function is None:
                self._reward_function = load_reward_function(self.reward_function_spec)
            score = self._reward_function(response, ground_truth)
            return split_spec(self.reward_function_spec)[1], checked_score(score, self.config.reward_function, index)
        if verifier_name is None:
            raise ValueError(
                f"Row {index} has a ground truth but no verifier name; set its `dataset`/`data_source` to one "
                f"of {', '.join(sorted(VERIFIER_ALIASES))}."
            )
        canonical = resolve_verifier_name(verifier_name)
        if canonical == CODE_VERIFIER:
            return canonical, self.code_verifier().score(response, ground_truth)
        return canonical, VERIFIERS[canonical](response, ground_truth)

    def is_code_row(self, verifier_name: str | None) -> bool:
        """Whether the row's program runs against tests (scored in a batch on the sandbox pool, not row by row)."""
        return self.reward_function_spec is None and verifier_name is not None and (
            resolve_verifier_name(verifier_name) == CODE_VERIFIER
        )

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

    def score_and_correct(
        self,
        responses: list[str],
        ground_truths: list[str | None],
        verifier_names: list[str | None],
        stopped: list[bool],
        rm_scores: torch.Tensor | None = None,
        response_lengths: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Score each response; returns (score float32 [batch], correct float32 [batch], metrics), `correct` being the
        verifier's score alone, in [0, 1] (0 where no verifier ran): what DAPO's dynamic sampling filters on.

        score = reward_model_multiplier * rm_score + verification_reward * verifier_score
        + r1_style_format_reward * format_score + the overlong penalty (each term when enabled), then replaced by
        penalty_reward_value for responses that did not stop when non_stop_penalty is on
        (N implementation details, "non-stop penalty"). `response_lengths`: in tokens, for the overlong penalty, which
        shapes training scores only (an eval passes none).
        """
        config = self.config
        started = time.perf_counter()
        batch = len(responses)
        lengths = {"ground_truths": len(ground_truths), "verifier_names": len(verifier_names), "stopped": len(stopped)}
        if rm_scores is not None:
            lengths["rm_scores"] = rm_scores.numel()
        mismatched = {name: length for name, length in lengths.items() if length != batch}
        if mismatched:
            raise ValueError(
                f"RewardManager.score got {batch} responses but lengths {mismatched}; pass one entry per response."
            )
        use_reward_model = rm_scores is not None and config.reward_model_multiplier != 0

        score = torch.zeros(batch, dtype=torch.float32)
        correct_each = torch.zeros(batch, dtype=torch.float32)
        if use_reward_model:
            score += config.reward_model_multiplier * rm_scores.detach().float().cpu().flatten()
        correct_by_verifier: dict[str, list[float]] = {}

        def record(i: int, canonical: str, correct: float) -> None:
            correct_by_verifier.setdefault(canonical, []).append(correct)
            correct_each[i] = correct
            score[i] += config.verification_reward * correct

        format_scores = []
        code_rows = []  # scored together below, on the sandbox pool: a step's programs run side by side
        for i, (response, ground_truth, name) in enumerate(zip(responses, ground_truths, verifier_names)):
            verified = config.apply_verifiable_reward and ground_truth is not None
            if not verified and not use_reward_model:
                raise ValueError(
                    f"Row {i} has no reward source (ground truth {ground_truth!r} with apply_verifiable_reward="
                    f"{config.apply_verifiable_reward}, and no reward model); give it a ground truth or enable "
                    f"`--reward_model_multiplier`."
                )
            if verified and self.is_code_row(name):
                code_rows.append(i)
            elif verified:
                record(i, *self.verify(response, ground_truth, name, i))
            if config.add_r1_style_format_reward:
                format_score = r1_format(response)
                format_scores.append(format_score)
                score[i] += config.r1_style_format_reward * format_score
        if code_rows:
            code_scores = self.code_verifier().score_many([responses[i] for i in code_rows],
                                                          [ground_truths[i] for i in code_rows])  # fmt: skip
            for i, correct in zip(code_rows, code_scores):
                record(i, CODE_VERIFIER, correct)

        overlong = self.overlong(response_lengths)
        if overlong is not None:
            score += overlong

        not_stopped = torch.tensor([not s for s in stopped], dtype=torch.bool)
        if config.non_stop_penalty:
            score = torch.where(not_stopped, torch.tensor(config.penalty_reward_value, dtype=torch.float32), score)

        metrics = self.length_metrics(stopped, overlong)
        all_correct = [c for values in correct_by_verifier.values() for c in values]
        if all_correct:
            metrics["objective/verifiable_correct_rate"] = sum(all_correct) / len(all_correct)
        for canonical, values in sorted(correct_by_verifier.items()):
            metrics[f"objective/{canonical}_correct_rate"] = sum(values) / len(values)
        if format_scores:
            metrics["objective/format_reward"] = sum(format_scores) / len(format_scores)
        metrics["time/reward"] = time.perf_counter() - started  # the verifiers' wall time: code tests dominate it
        return score, correct_each, metrics

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
