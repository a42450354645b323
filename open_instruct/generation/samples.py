"""One response as the engine generates it (`Sample`: its tokens, logprobs, the policy version of each token, what
the policy sampled and what a tool or an agent's turn appended), and the sampling seed of each of its requests."""

from dataclasses import dataclass, field

import numpy as np

from open_instruct.generation import vllm_engine


def request_seed(batch_seed: int, sample_index: int, policy_version: int, tokens_so_far: int) -> int:
    """The sampling seed of one vLLM request: sample `sample_index` of the batch seeded `batch_seed`, submitted under
    policy `policy_version` with `tokens_so_far` tokens. vLLM gives a seeded request a generator of its own, so its
    noise depends on these alone: not on the engine's global generator (which the engine's warm-up, other batches, an
    eval or the learner may draw from or reseed), nor on which engine or process runs it. A resubmission (an in-flight
    update, a tool's answer, a restored snapshot) starts a new stream, the same one in every run that gets there."""
    return int(np.random.SeedSequence([batch_seed, sample_index, policy_version, tokens_so_far]).generate_state(1)[0])


TOOL_STATS = ("calls", "errors", "timeouts", "outputs_cut", "seconds", "reward", "start_errors", "abandoned_threads")


@dataclass
class Sample:
    """One response being generated: its prompt, what it has generated so far, and the version of each token."""

    batch_id: int
    prompt_index: int  # into its batch's prompts
    prompt_token_ids: list[int]
    max_tokens: int
    seed: int | None = None  # the batch's sampling seed (None: vLLM's global generator; greedy needs none)
    index: int = 0  # its place in the batch (the requests' seeds: `request_seed`)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)  # the policy version of each token; None: a tool's
    sampled: list[bool] = field(default_factory=list)  # whether the model sampled each token (False: a tool's output)
    text: str = ""
    finish_reason: str | None = None  # set when it finished: "stop", "length", "max_tool_calls", "environment_error"
    stop_reason: int | str | None = None
    # With --tools: where the model's current turn starts in `text`, how much of the text was searched for the
    # environment's end strings, and what its calls did (Completion.tool_stats).
    turn_start: int = 0
    searched_up_to: int = 0
    stop_searched_up_to: int = 0  # how much of `text` was searched for the stop strings
    tool_stats: dict = field(default_factory=lambda: dict.fromkeys(TOOL_STATS, 0))
    # With --tools: the dataset row its environment's `reset` gets (JSON values; None: the engine was given no rows),
    # and the turns' rewards, [index of the turn's last sampled token, reward] each (Completion.turn_rewards).
    row: dict | None = None
    turn_rewards: list[list] = field(default_factory=list)
    # With --rollout_agent (agent_batches.py): its rollout's index in the batch; the call its request answers (where
    # its tokens, text and budget start and end, its stop strings); whether it waits for its agent's next call (no
    # request in the engine); how its last call ended.
    rollout: int | None = None
    call: dict | None = None
    waiting: bool = False
    last_finish: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_ids, logprobs, text: str, version: int) -> None:
        self.token_ids += token_ids
        if logprobs is None:
            self.logprobs += [None] * len(token_ids)
        else:
            self.logprobs += [step[token].logprob for step, token in zip(logprobs, token_ids)]
        self.versions += [version] * len(token_ids)
        self.sampled += [True] * len(token_ids)
        self.text += text

    def add_observation(self, token_ids: list[int], text: str) -> None:
        """An environment's answer (a tool's output): tokens the policy did not sample, so no logprob and no version;
        the model's next turn starts after it."""
        self.token_ids += token_ids
        self.logprobs += [None] * len(token_ids)
        self.versions += [None] * len(token_ids)
        self.sampled += [False] * len(token_ids)
        self.text += text
        self.turn_start = self.searched_up_to = self.stop_searched_up_to = len(self.text)

    def finish(self, finish_reason: str, stop_reason, version: int) -> None:
        self.keep_stop_token(finish_reason, stop_reason, version)
        self.finish_reason, self.stop_reason = finish_reason, stop_reason

    def keep_stop_token(self, finish_reason: str, stop_reason, version: int) -> None:
        """A response that stopped on a stop token keeps it as its last token (vLLM leaves stop token ids out of the
        output, so it is added back here, without an engine logprob): the learner scores and trains on it."""
        if finish_reason == "stop" and isinstance(stop_reason, int):
            if not self.token_ids or self.token_ids[-1] != stop_reason:
                self.token_ids.append(stop_reason)
                self.logprobs.append(None)
                self.versions.append(version)
                self.sampled.append(True)

    def completion(self, with_logprobs: bool) -> vllm_engine.Completion:
        with_tools = not all(self.sampled) or self.tool_stats["calls"] > 0
        return vllm_engine.Completion(
            self.prompt_index, list(self.token_ids), self.text, self.finish_reason,
            list(self.logprobs) if with_logprobs else None, list(self.versions),
            list(self.sampled) if with_tools else None, dict(self.tool_stats) if with_tools else None,
            [list(turn) for turn in self.turn_rewards] or None,
        )  # fmt: skip
