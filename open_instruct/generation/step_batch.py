"""What one training step trains on (`BatchCollector.collect`): the oldest rollout in flight, after the requests in flight are
topped up to --async_steps, held to the staleness bound; with --filter_zero_std_groups, GRPO's dynamic sampling.

Dynamic sampling (DAPO, Yu et al. 2025, section 3.2, eq. 11): a group whose responses are all right or all wrong
teaches little: with equal scores its advantage is 0 on every token, so it adds nothing to the policy gradient but
still costs a forward and backward pass and dilutes the batch. Such groups are dropped and more batches are drawn
until the step has --local_rollout_batch_size groups that differ; the surplus of the last draw is discarded (as DAPO
and verl do: keeping it would make it older at the next step). What must differ is --filter_metric: `correct`, the
verifiers' verdicts (DAPO's accuracy, verl's default), or `score`, the whole training score; with the soft overlong
penalty an all-correct group whose answers differ only in length has scores that differ, and `correct` drops it all
the same. After --filter_max_extra_batches extra draws the step is filled with dropped groups instead, so that its
shapes (minibatches, ranks) stay what the run was sized for. The choice needs each response's score before the
learner runs: the verifiers score every draw here, and the chosen batch's scores go to the learner
(rl.PrecomputedScores) rather than being computed twice. The correct rates of the step are its first draw's, an
unbiased sample of the policy (the chosen groups are biased toward half right); `val/num_non_stop` and
`objective/overlong_penalty` describe the chosen batch, whose scores they are part of.
"""

import logging
from dataclasses import dataclass, field, replace

import torch

from open_instruct.data.batches import PromptBatch
from open_instruct.generation.generation_thread import Rollout, WaitAbandoned
from open_instruct.generation.rollout_requests import RolloutRequests, check_staleness
from open_instruct.generation.vllm_engine import Completion
from open_instruct.rewards.manager import PrecomputedScores, RewardManager, Scorer, Verdicts, VerifiedScores

log = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """What one step trains on, and where it came from."""

    prompts: PromptBatch
    rollout: Rollout  # its completions (under --filter_zero_std_groups, groups joined from several rollouts)
    requests: list  # the rollout requests it came from (their evals, their weight syncs)
    # what scores it: the verifiers' verdicts computed here (rl.VerifiedScores), or the filter's or the tools' scores
    # (rl.PrecomputedScores): a batch's responses are verified once, in this process, whichever learner ranks train on it
    scorer: Scorer
    metrics: dict  # staleness, and the filter's


@dataclass
class BatchCollector:
    """Collects each step's batch from the rollout requests (one per run, built by the trainer)."""

    rollouts: RolloutRequests
    reward_manager: RewardManager
    max_lag: int  # --async_steps; sync: 0
    groups_per_step: int  # --local_rollout_batch_size
    zero_std_filter: bool  # --filter_zero_std_groups
    max_extra_batches: int  # --filter_max_extra_batches
    stop_token_ids: list[int]
    filter_metric: str = "correct"  # --filter_metric: what must differ within a kept group
    # --tools: the batch is scored here (its tools/* metrics need each response's verdict), and the learner gets the
    # scores (rl.PrecomputedScores) rather than computing them twice
    with_tools: bool = False
    # --rollout_agent: each response's score is its rollout's reward, returned by the agent (agent_batches.py)
    with_agent: bool = False
    compares_groups: bool = False  # GRPO: a prompt's responses are compared with each other (at least 2 needed)
    cut_outputs_noted: bool = field(default=False, init=False)  # the line of `note_cut_outputs` was shown

    def note_cut_outputs(self, count: float, where: str) -> None:
        """One console line, the first time tools' outputs were cut to --tool_output_max_tokens (tools/outputs_cut and
        eval/tool_outputs_cut count them all): a tool that returns far more than the model reads spends its time, and
        the engine's, on every call, and a slow run would otherwise not say why."""
        if count > 0 and not self.cut_outputs_noted:
            self.cut_outputs_noted = True
            log.warning(f"[tools] warning: {count:g} tool output(s) in {where} were longer than "
                        "--tool_output_max_tokens and were cut (counted in tools/outputs_cut and eval/tool_outputs_cut); "
                        "a tool that returns far more than the model reads costs time on every call: make it return "
                        "less, or raise --tool_output_max_tokens if the model needs it all. (Shown once.)")  # fmt: skip

    def collect(self, learner_version: int, steps_left: int) -> StepBatch:
        """The batch of the learner at `learner_version` with `steps_left` steps to go (this one included). A wait
        given up (WaitAbandoned, a preemption) puts the requests this step received back in flight first, so that the
        state is the previous step's: what its checkpoint must hold."""
        requests = []  # received by this step, oldest first
        try:
            return self._collect(learner_version, steps_left, requests)
        except WaitAbandoned:
            self.rollouts.put_back(requests)
            raise

    def _collect(self, learner_version: int, steps_left: int, requests: list) -> StepBatch:
        self.rollouts.top_up(learner_version, steps_left)
        request, rollout = self.rollouts.receive()
        requests.append(request)
        staleness = check_staleness(rollout, learner_version, self.max_lag)
        if self.with_agent:
            rollout, lone = without_lone_rollouts(rollout) if self.compares_groups else (rollout, 0)
            return StepBatch(request.prompts, rollout, requests, PrecomputedScores(agent_scores(rollout), {}),
                             {**staleness, "agent/lone_rollouts_dropped": float(lone)})  # fmt: skip
        if not self.zero_std_filter and not self.with_tools:
            verified = verdicts(self.reward_manager, request.prompts, rollout.completions)
            return StepBatch(request.prompts, rollout, requests, VerifiedScores(self.reward_manager, verified), staleness)
        if not self.zero_std_filter:
            scored = score(self.reward_manager, request.prompts, rollout.completions, self.stop_token_ids)
            tools = tool_metrics(rollout.completions, scored.correct.tolist())
            self.note_cut_outputs(tools["tools/outputs_cut"], f"the batch of policy version {rollout.policy_version}")
            return StepBatch(request.prompts, rollout, requests, PrecomputedScores(scored.scores, scored.metrics),
                             {**staleness, **tools})  # fmt: skip
        groups = GroupFilter(self.groups_per_step, self.max_extra_batches, self.filter_metric)
        received, reward_metrics, scoring_seconds = [rollout], None, 0.0
        while True:
            scored = score(self.reward_manager, request.prompts, rollout.completions, self.stop_token_ids)
            reward_metrics = reward_metrics or scored.metrics
            scoring_seconds += scored.metrics.get("time/reward", 0.0)  # every draw was scored, not only the first
            groups.add(split_groups(request.prompts, rollout.completions, scored))
            if groups.full:
                break
            self.rollouts.top_up(learner_version, steps_left)
            request, rollout = self.rollouts.receive()
            requests.append(request)
            check_staleness(rollout, learner_version, self.max_lag)
            received.append(rollout)
        chosen, filter_metrics = groups.batch()
        prompts, completions, scores = join_groups(chosen)
        joined = join_rollouts(received, completions)
        overlong = self.reward_manager.overlong([length for group in chosen for length in group.lengths])
        trained = self.reward_manager.length_metrics([c.finish_reason == "stop" for c in completions], overlong)
        reward_metrics = {**reward_metrics, "time/reward": scoring_seconds}
        tools = tool_metrics(completions, [c for group in chosen for c in group.correct]) if self.with_tools else {}
        self.note_cut_outputs(tools.get("tools/outputs_cut", 0.0), f"the batch of policy version {joined.policy_version}")
        return StepBatch(prompts, joined, requests, PrecomputedScores(scores, {**reward_metrics, **trained}),
                         {**check_staleness(joined, learner_version, self.max_lag), **filter_metrics, **tools})  # fmt: skip


def without_lone_rollouts(rollout: Rollout) -> tuple[Rollout, int]:
    """GRPO: the rollout without the samples of prompts left with a single agent run (the others failed and were
    dropped, --agent_failed_rollouts drop): a run compared with no other teaches nothing, and GRPO's groups need two.
    Also how many runs were left out so."""
    runs: dict[int, set[int]] = {}
    for completion in rollout.completions:
        runs.setdefault(completion.prompt_index, set()).add(completion.agent["rollout"])
    kept = [c for c in rollout.completions if len(runs[c.prompt_index]) >= 2]
    lone = sum(len(indices) for indices in runs.values() if len(indices) < 2)
    return replace(rollout, completions=kept), lone


def agent_scores(rollout: Rollout) -> torch.Tensor:
    """Each sample's score: its rollout's reward. A batch whose every rollout failed stops the run (the agent is
    broken, not unlucky), naming why."""
    if not rollout.completions:
        raise RuntimeError(f"no agent rollout of batch {rollout.batch_id} returned a reward or made a call "
                           f"(agent/errors {rollout.engine_metrics.get('agent/errors', 0):g}, agent/timeouts "
                           f"{rollout.engine_metrics.get('agent/timeouts', 0):g}, agent/no_calls "
                           f"{rollout.engine_metrics.get('agent/no_calls', 0):g}): the first failures are on the "
                           "console above; fix the agent or raise --agent_timeout_s")  # fmt: skip
    return torch.tensor([c.agent["reward"] for c in rollout.completions], dtype=torch.float32)


def verdicts(reward_manager: RewardManager, prompts: PromptBatch, completions: list[Completion]) -> Verdicts:
    """The verifiers' verdicts of a rollout's responses, for the learner to combine with its own terms."""
    return reward_manager.verdicts([c.text for c in completions],
                                   [prompts.ground_truths[c.prompt_index] for c in completions],
                                   [prompts.verifier_names[c.prompt_index] for c in completions])  # fmt: skip


@dataclass
class Scored:
    """One draw's responses as the learner would score them, each [batch]."""

    scores: torch.Tensor
    correct: torch.Tensor  # the verifiers' verdicts alone
    lengths: list[int]  # in tokens, up to the first stop token
    metrics: dict


def score(reward_manager: RewardManager, prompts: PromptBatch, completions: list[Completion],
          stop_token_ids: list[int]) -> Scored:  # fmt: skip
    """Each response's score as the learner computes it: its length counts up to its first stop token (the PPO detail
    "truncate at the stop token", learner/experience.layout_rollout)."""
    lengths = [next((i + 1 for i, token in enumerate(c.token_ids) if token in stop_token_ids and ends_response(c, i)),
                    len(c.token_ids)) for c in completions]  # fmt: skip
    scores, correct, metrics = reward_manager.score_and_correct(
        [c.text for c in completions], [prompts.ground_truths[c.prompt_index] for c in completions],
        [prompts.verifier_names[c.prompt_index] for c in completions], [c.finish_reason == "stop" for c in completions],
        None, lengths,
    )  # fmt: skip
    # An Environment's own reward (environments/tools.py) adds to the verifier's score.
    scores = scores + torch.tensor([(c.tool_stats or {}).get("reward", 0.0) for c in completions])
    return Scored(scores, correct, lengths, metrics)


def ends_response(completion: Completion, index: int) -> bool:
    """Whether a stop token at `index` may end the response: the model sampled it, and it does not end a turn that a
    tool's or an agent's turn follows (rl.turn_ends, as the learner's truncation)."""
    sampled = completion.sampled
    return sampled is None or (sampled[index] and (index + 1 == len(sampled) or sampled[index + 1]))


def tool_metrics(completions: list[Completion], correct: list[float]) -> dict[str, float]:
    """The tools/* metrics of a batch (--tools): calls per response; calls answered with an error, cut at
    --tool_timeout_s, and outputs cut to --tool_output_max_tokens; responses whose environment could not start; calls
    past their time left running in a thread (tools/abandoned_threads); the
    seconds the calls took, summed over the responses (they run together, so the engine waited less); the share of the response tokens that are tools' outputs; and the
    share of correct answers (the verifiers' verdicts) whose response called a tool."""
    stats = [c.tool_stats or {} for c in completions]
    calls = [s.get("calls", 0) for s in stats]
    tool_tokens = sum(c.sampled.count(False) for c in completions if c.sampled is not None)
    all_tokens = max(1, sum(len(c.token_ids) for c in completions))
    correct_total = sum(correct)
    correct_with_tool = sum(verdict for verdict, n in zip(correct, calls) if n > 0)
    return {
        "tools/calls_per_sample": sum(calls) / max(1, len(completions)),
        "tools/errors": float(sum(s.get("errors", 0) for s in stats)),
        "tools/timeouts": float(sum(s.get("timeouts", 0) for s in stats)),
        "tools/outputs_cut": float(sum(s.get("outputs_cut", 0) for s in stats)),
        "tools/start_errors": float(sum(s.get("start_errors", 0) for s in stats)),
        "tools/abandoned_threads": float(sum(s.get("abandoned_threads", 0) for s in stats)),
        "tools/time": float(sum(s.get("seconds", 0.0) for s in stats)),
        "tools/token_fraction": tool_tokens / all_tokens,
        "tools/correct_with_tool": correct_with_tool / correct_total if correct_total > 0 else 0.0,
    }


def join_rollouts(rollouts: list[Rollout], completions: list[Completion]) -> Rollout:
    """One rollout of `completions` drawn from `rollouts`: the oldest version, their timings summed."""
    timings: dict[str, float] = {}
    for rollout in rollouts:
        for key, value in rollout.timings.items():
            timings[key] = timings.get(key, 0.0) + value
    return Rollout(min(r.policy_version for r in rollouts), completions, timings,
                   engine_metrics=rollouts[-1].engine_metrics, batch_id=rollouts[0].batch_id)  # fmt: skip


@dataclass
class Group:
    """One prompt and its responses, with their scores."""

    token_ids: list[int]
    ground_truth: str | None
    verifier_name: str | None
    text: str
    completions: list[Completion]
    scores: list[float]
    correct: list[float] = field(default_factory=list)  # the verifiers' verdicts
    lengths: list[int] = field(default_factory=list)  # in tokens, up to the first stop token

    def differs(self, metric: str) -> bool:
        """Whether its responses differ in `metric` (--filter_metric: correct or score)."""
        values = self.correct if metric == "correct" else self.scores
        return max(values) != min(values)


def split_groups(prompts: PromptBatch, completions: list[Completion], scored: Scored) -> list[Group]:
    """The groups of a rollout, in prompt order (completions come grouped by prompt)."""
    groups = [Group(ids, truth, name, text, [], []) for ids, truth, name, text in
              zip(prompts.token_ids, prompts.ground_truths, prompts.verifier_names, prompts.texts)]  # fmt: skip
    for completion, score, correct, length in zip(completions, scored.scores.tolist(), scored.correct.tolist(),
                                                  scored.lengths):  # fmt: skip
        group = groups[completion.prompt_index]
        group.completions.append(completion)
        group.scores.append(score)
        group.correct.append(correct)
        group.lengths.append(length)
    return groups


def join_groups(groups: list[Group]) -> tuple[PromptBatch, list[Completion], torch.Tensor]:
    """The groups as one batch: their prompts, their completions (prompt_index into the new batch) and scores."""
    prompts = PromptBatch([g.token_ids for g in groups], [g.ground_truth for g in groups],
                          [g.verifier_name for g in groups], [g.text for g in groups])  # fmt: skip
    completions = [
        replace(c, prompt_index=index)
        for index, group in enumerate(groups)
        for c in group.completions
    ]
    return prompts, completions, torch.tensor([s for group in groups for s in group.scores], dtype=torch.float32)


@dataclass
class GroupFilter:
    """The groups drawn for one step: `add` each rollout's groups until `full`; `batch` then gives the step's batch."""

    groups_per_step: int
    max_extra_batches: int
    metric: str = "correct"  # --filter_metric
    kept: list[Group] = field(default_factory=list)
    dropped: list[Group] = field(default_factory=list)
    draws: int = 0

    def add(self, groups: list[Group]) -> None:
        self.draws += 1
        for group in groups:
            (self.kept if group.differs(self.metric) else self.dropped).append(group)

    @property
    def full(self) -> bool:
        """Enough groups that differ, or no extra draw left."""
        return len(self.kept) >= self.groups_per_step or self.draws > self.max_extra_batches

    def batch(self) -> tuple[list[Group], dict[str, float]]:
        """The step's groups (kept ones first, then dropped ones if the draws ran out) and the filter's metrics."""
        filled = max(0, self.groups_per_step - len(self.kept))
        chosen = self.kept[: self.groups_per_step] + self.dropped[:filled]
        metrics = {
            "filter/zero_std_groups_dropped": float(len(self.dropped)),
            "filter/extra_batches": float(self.draws - 1),
            "filter/filled_groups": float(filled),
            "filter/discarded_groups": float(max(0, len(self.kept) - self.groups_per_step)),
        }
        return chosen, metrics
