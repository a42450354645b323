"""Rollout batches inside one vLLM engine, decoded step by step, with every token tagged by the policy version that
generated it.

`EngineBatches` is what each engine (the generation thread's own, or an engine actor) runs. A batch is admitted
(its prompts become requests, each sample its own request with a sampling seed of its own, `request_seed`) and
`run_until_complete` steps the engine until every sample of one batch has finished. Several batches may be
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

With --tools (a batch's `params["tools"]`) each sample has an environment (environments/tools.py), and the engine looks for its
end strings in the sample's accumulated text after every step, in Python, so one split over two steps or over a
resubmission is found. A sample that reaches one leaves the engine and is parked: its turn runs on the tool pool
(environments/tool_pool.py: tools in worker processes, environments' steps in threads, each cut at --tool_timeout_s)
while the engine goes on stepping the other samples. A parked sample is due back --tool_reentry_steps engine steps
after its call (default 1: the next step), and the engine waits there for a call not yet back; while nothing else
runs, the samples due first come back as soon as their calls do. So which samples share each step, and every float
the engine computes, depends on the steps alone, never on how fast a tool answered: a run is bit for bit the same
whatever its tools' times (tests/test_engine_batches.py runs one batch twice with calls taking random times). With
--tool_reentry_steps 0 a sample comes back at the first step after its call is: fastest when tools are slow, and the
tokens are still the same (its request's seed is its sample's and its tokens so far, `request_seed`), but which
samples share a step can then move a logprob by one float32 ulp on vLLM's CPU kernels (measured 9.5e-7). Each answer
is tokenised once and appended with `sampled` False, no logprob and no version, and the sample is resubmitted as
prompt plus tokens so far, the path above. (With 0 and in-flight updates, the version a sample's next tokens carry
may depend on when its call returned.) The rule for weights and snapshots: `pause` (before a weight load) and
`partial_batches` (a checkpoint) first wait for every parked sample's turn (each cut at --tool_timeout_s) and take
it back, so no sample is mid-call while weights change and a snapshot never holds one mid-call; a restored sample
gets a fresh environment, reset with the dataset row stored with the sample (built-in tools are stateless). A step's
reward is recorded with the index of the turn's last sampled token (`Sample.turn_rewards`), where PPO places it. Every observation (a tool's output, an
environment's, an error's text) is cut to --tool_output_max_tokens. An environment is user code: its constructor and
`reset` run under --tool_timeout_s like its steps, and a sample whose environment cannot start (either raised or ran
past the time) ends at its first token reading why (finish reason "environment_error", counted in tools/start_errors);
the batch's other samples go on.

With a native tool-call format (--tool_call_parser hermes, ...; environments/native_tools.py) no string ends a turn:
a request that finishes on its stop token ends one, and when its environment reads a call in the turn's text the stop
token is kept as the turn's last sampled token and the sample is answered like any other turn, its observation the
chat template's tool turns as token ids, appended as they are (never decoded and tokenised again). The calls go to
its tools, or to its environment's `step_calls` (environments/native_tools.py `NativeEnvironment`), by its row's
--environment_column value where there is one.
"""

import copy
import itertools
import logging
from contextlib import contextmanager
from dataclasses import asdict

from open_instruct.environments import native_tools, routing, tool_pool, tools
from open_instruct.generation import vllm_engine
from open_instruct.generation.samples import Sample, request_seed

log = logging.getLogger(__name__)
# An observation longer than this many characters a token is cut to it before it is tokenised (the longest token of
# SmolLM2's vocabulary decodes to 81 characters, mostly ~4): a tool answering megabytes costs what a page does
# (tokenising 1 MB took 1.6-3.9 s, per call).
MAX_CHARS_PER_TOKEN = 32


# While only parked samples remain, the engine waits this long for a call to finish before it looks again.
PARKED_WAIT_S = 0.05


def observation_tokens(tokenizer, text: str) -> list[int]:
    """An observation's tokens, once: as plain text, so a tool printing "<|im_end|>" cannot insert the stop token."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def cut_to_tokens(tokenizer, text: str, budget: int) -> tuple[str, bool]:
    """`text` cut to at most `budget` tokens (--tool_output_max_tokens), and whether it was cut. Only its first
    MAX_CHARS_PER_TOKEN * budget characters are tokenised."""
    head = text[: MAX_CHARS_PER_TOKEN * budget]
    ids = observation_tokens(tokenizer, head)
    if len(ids) <= budget and len(head) == len(text):
        return text, False
    return tokenizer.decode(ids[:budget]), True


class EngineBatches:
    """The batches one engine holds (`llm`: a vLLM `LLM` whose engine core runs in this process) and the policy version
    of its weights."""

    def __init__(self, llm, policy_version: int = 0, engine_index: int = 0):
        """`engine_index`: the engine actor's index (--vllm_num_engines; its agent endpoint's port is --agent_port + it)."""
        self.llm, self.engine_index = llm, engine_index
        self.policy_version = policy_version
        self.batches: dict[int, list[Sample]] = {}  # admitted, not yet complete: their samples in prompt order
        self.params: dict[int, dict] = {}  # each batch's sampling settings (vllm_engine.sampling_params arguments)
        self.running: dict[str, Sample] = {}  # vLLM request id -> the sample it generates
        self.request_ids = itertools.count()
        self.steps = 0  # engine steps taken (the benchmark's engine work counter)
        # With --tools (a batch's params["tools"]): each sample's environment, by id(sample); the samples whose
        # environment could not start, with why (they end at their first token).
        self.environments: dict[int, tools.Environment] = {}
        self.unstarted: dict[int, tools.Attempt] = {}
        # The samples out of the engine while their turn runs on the tool pool, by id(sample), and those turns.
        self.parked: dict[int, Sample] = {}
        self.turns = tool_pool.ParkedTurns()
        # When each parked sample re-enters: the engine step it is due at (--tool_reentry_steps after its call), or
        # None: as soon as its turn is back (--tool_reentry_steps 0). `arrived`: turns back, not yet due.
        self.due_step: dict[int, int | None] = {}
        self.arrived: dict[int, tool_pool.ParkedTurn] = {}
        self.agents = None  # with --rollout_agent: agent_batches.AgentSamples, made at the first agent batch

    @property
    def admitted(self) -> list[int]:
        return list(self.batches)

    def admit(self, batch_id: int, prompt_token_ids: list[list[int]], params: dict, sampling_seed: int | None,
              rows: list[dict] | None = None) -> None:  # fmt: skip
        """Add a batch: `params["n"]` samples of each prompt, each its own request, in prompt order (as vLLM's own fan-out
        of n does), each seeded from `sampling_seed` (`request_seed`): what the batch draws depends only on its seed and
        on the weights. `rows`: with --tools, each prompt's dataset row, for its samples' environments."""
        if batch_id in self.batches:
            raise ValueError(f"batch {batch_id} is already in the engine")
        if params.get("agent"):  # --rollout_agent: the batch's samples come from its rollouts' calls
            self._agent_samples(params).admit(batch_id, len(prompt_token_ids), params, sampling_seed, rows)
            return
        prompts = [ids for ids in prompt_token_ids for _ in range(params["n"])]
        samples = [Sample(batch_id, index // params["n"], list(ids), params["max_tokens"], sampling_seed, index,
                          row=None if rows is None else rows[index // params["n"]])
                   for index, ids in enumerate(prompts)]  # fmt: skip
        self._add(batch_id, samples, params)

    def _agent_samples(self, params: dict):
        """The agent rollouts of this engine (agent_batches.AgentSamples: its endpoint starts at the first)."""
        if self.agents is None:
            from open_instruct.generation.agent_batches import AgentSamples

            self.agents = AgentSamples(self, params["agent"], self.engine_index)
        return self.agents

    def _add(self, batch_id: int, samples: list[Sample], params: dict) -> None:
        self.batches[batch_id], self.params[batch_id] = samples, params
        if params.get("tools"):
            self._start_environments([sample for sample in samples if not sample.done], params["tools"])
        self._submit(samples, params)

    def _start_environments(self, samples: list[Sample], settings: dict) -> None:
        """A fresh environment for each sample, constructed and reset all at once under --tool_timeout_s (a tool's
        output is cut to its token budget by the engine's tokenizer). A sample whose environment cannot start is kept
        in `unstarted`: it ends at its first token (`_end_unstarted`)."""
        tokenizer, budget = self.llm.get_tokenizer(), settings["output_max_tokens"]
        def cut_output(text: str) -> tuple[str, bool]:
            return cut_to_tokens(tokenizer, text, budget)

        # --environment_column: each row names its environment among the --tools names (as the rows write them); with
        # --tool_call_parser hermes, ... in the native format (environments/native_tools.py).
        route = native_tools.native_router(settings, tokenizer, cut_output) or routing.environment_router(
            settings.get("environment_names") or dict(zip(settings["names"], settings["names"])),
            settings.get("environment_column"), settings["wrapper"], cut_output)  # fmt: skip
        # Each sample its own copy: the n samples of a prompt share its row, and an environment may change what it got.
        rows = [{**copy.deepcopy(s.row or {}), "prompt_token_ids": s.prompt_token_ids, "prompt_index": s.prompt_index}
                for s in samples]  # fmt: skip
        builds = [route(row) for row in rows]
        failed = []
        for sample, attempt in zip(samples, tools.start_environments(builds, rows, settings["timeout_s"])):
            if attempt.error is None:
                self.environments[id(sample)] = attempt.value
            else:
                self.unstarted[id(sample)] = attempt
                failed.append(attempt.error)
        if failed:
            log.warning(f"--tools {' '.join(settings['names'])}: {len(failed)} of {len(samples)} samples' environments "
                        f"could not start, each ends at its first token (tools/start_errors): {failed[0][:300]}")  # fmt: skip

    def _submit(self, samples: list[Sample], params: dict) -> None:
        """Each unfinished sample as a request whose prompt is its prompt plus the tokens it has so far."""
        from vllm.sampling_params import RequestOutputKind

        for sample in samples:
            if sample.done or sample.waiting:
                continue
            # An agent's call ends at its own max_tokens (within the sample's budget).
            left = (sample.max_tokens if sample.call is None else sample.call["end"]) - len(sample.token_ids)
            settings = {key: value for key, value in params.items() if key not in ("tools", "agent")}
            # Stop strings are found here, on the accumulated text (`_stop_string_end`), never by vLLM.
            seed = None if sample.seed is None else request_seed(sample.seed, sample.index, self.policy_version,
                                                                  len(sample.token_ids))  # fmt: skip
            sampling = vllm_engine.sampling_params(**{**settings, "n": 1, "max_tokens": left, "stop_strings": None,
                                                      "seed": seed})  # fmt: skip
            sampling.output_kind = RequestOutputKind.DELTA  # each step's new tokens, tagged with the version of the step
            request_id = str(next(self.request_ids))
            prompt = {"prompt_token_ids": sample.prompt_token_ids + sample.token_ids}
            # With --lora_weight_sync adapter, the current version's adapters (a resubmission after a sync: the new ones).
            self.llm.llm_engine.add_request(request_id, prompt, sampling, lora_request=vllm_engine.lora_request(self.llm))
            self.running[request_id] = sample

    def step(self) -> None:
        """One engine step. First the parked samples whose turn has finished go back into the engine (`_reenter`);
        then every running request advances (a prefill chunk or one token). A sample whose text now ends a turn of its
        environment (a tool call's end string) is taken out of the engine and parked while its turn runs (`_park`).
        While only parked samples remain, it waits up to PARKED_WAIT_S for a turn to finish instead (and for an agent's
        call while only agents' samples waiting for one remain)."""
        if self.agents is not None and self.agents.active():
            self.agents.take_calls(wait_s=0.0 if self.running or self.parked else PARKED_WAIT_S)
            if not self.running and not self.parked:
                return
        if self.parked:
            self._reenter(self._turns_due())
            if not self.running:
                return
        turns, stopped = [], []
        for output in self.llm.llm_engine.step():
            sample = self.running[output.request_id]
            piece = output.outputs[0]
            sample.add(list(piece.token_ids), piece.logprobs, piece.text, self.policy_version)
            if id(sample) in self.unstarted and (piece.token_ids or output.finished):
                del self.running[output.request_id]
                if not output.finished:
                    stopped.append(output.request_id)
                self._end_unstarted(sample)
                continue
            stop_string = self._stop_string_end(sample)
            if stop_string is not None:  # as vLLM's own stop strings: the text ends with it, whatever ended the request
                self._end_request(sample, "stop", stop_string)
                del self.running[output.request_id]
                if not output.finished:
                    stopped.append(output.request_id)
            elif output.finished and self._ends_native_turn(sample, piece):
                turns.append((output.request_id, sample, len(sample.text)))  # its tool calls are answered: it goes on
            elif output.finished:
                self._end_request(sample, piece.finish_reason, piece.stop_reason)
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
            self._park([(sample, end) for _, sample, end in turns])
        self.steps += 1

    def _end_request(self, sample: Sample, finish_reason: str, stop_reason) -> None:
        """A request that ended: its sample finishes, or (an agent's) its call is answered and it waits for the next."""
        if sample.rollout is not None:
            self.agents.call_ended(sample, finish_reason, stop_reason)
        else:
            sample.finish(finish_reason, stop_reason, self.policy_version)

    def _ends_native_turn(self, sample: Sample, piece) -> bool:
        """Whether a request that finished ends a native turn that makes tool calls (--tool_call_parser hermes, ...):
        it stopped on its stop token and its environment reads a call in the turn. Then the stop token is kept as the
        turn's last sampled token (its text too: the template's turn end continues after it) and the sample goes on."""
        environment = self.environments.get(id(sample))
        if not isinstance(environment, native_tools.NATIVE_ENVIRONMENTS) or piece.finish_reason != "stop":
            return False
        if not environment.makes_calls(sample.text[sample.turn_start :]):
            return False
        tokenizer = self.llm.get_tokenizer()
        stop_id = piece.stop_reason if isinstance(piece.stop_reason, int) else tokenizer.eos_token_id
        if not sample.token_ids or sample.token_ids[-1] != stop_id:
            sample.add([stop_id], None, "", self.policy_version)
        sample.text += tokenizer.decode([stop_id])
        return True

    def _stop_string_end(self, sample: Sample) -> str | None:
        """The stop string the sample's text now completes (its text is then cut just after it), or None. Searched from
        where the last search ended, so a string split over two steps or a resubmission is found when it completes,
        and never inside a tool's output."""
        stop_strings = tuple((self.params[sample.batch_id].get("stop_strings") if sample.call is None
                              else sample.call["stop"]) or ())  # an agent's call: its own stop strings; fmt: skip
        if not stop_strings:
            return None
        end = tools.turn_end(sample.text, stop_strings, sample.stop_searched_up_to, sample.turn_start)
        sample.stop_searched_up_to = len(sample.text)
        if end is None:
            return None
        sample.text = sample.text[:end]
        return next(stop for stop in stop_strings if sample.text.endswith(stop))

    def _end_unstarted(self, sample: Sample) -> None:
        """A sample whose environment could not start ends here, after its first token (the learner needs a token the
        policy sampled to carry the sample's score), with the error as its observation: counted, never retried."""
        attempt = self.unstarted.pop(id(sample))
        stats = sample.tool_stats
        stats["start_errors"] = stats.get("start_errors", 0) + 1  # a checkpoint's sample may predate the key
        stats["seconds"] += attempt.seconds
        self._add_observation(sample, attempt.error, cut=True)
        sample.finish("environment_error", None, self.policy_version)

    def _add_observation(self, sample: Sample, observation: str, cut: bool) -> bool:
        """Append `observation`, cut to --tool_output_max_tokens where `cut`, and to the response budget left; whether
        it was cut to --tool_output_max_tokens."""
        tokenizer, was_cut = self.llm.get_tokenizer(), False
        if isinstance(observation, tools.TokenObservation):  # a chat template's tool turn, rendered as token ids
            observation_ids = observation.token_ids[: sample.max_tokens - len(sample.token_ids)]
            cut_text = len(observation_ids) < len(observation.token_ids)
            sample.add_observation(observation_ids, tokenizer.decode(observation_ids) if cut_text else observation.text)
            return False
        if cut:
            budget = self.params[sample.batch_id]["tools"]["output_max_tokens"]
            observation, was_cut = cut_to_tokens(tokenizer, observation, budget)
        observation_ids = observation_tokens(tokenizer, observation)
        left = sample.max_tokens - len(sample.token_ids)
        if len(observation_ids) > left:  # the response budget counts the tools' tokens too
            observation_ids = observation_ids[:left]
            observation = tokenizer.decode(observation_ids)
        sample.add_observation(observation_ids, observation)
        return was_cut

    def _park(self, turns: list[tuple[Sample, int]]) -> None:
        """Each sample whose turn ended leaves the engine with its turn started on the tool pool (environments/
        tool_pool.py), or ends there (it called once too often); the engine decodes the others meanwhile."""
        for sample, end in turns:
            settings = self.params[sample.batch_id]["tools"]
            if sample.tool_stats["calls"] >= settings["max_calls"]:
                sample.finish("max_tool_calls", None, self.policy_version)
                continue
            self.parked[id(sample)] = sample
            reentry_steps = settings.get("reentry_steps", 1)  # a checkpoint that predates the flag: the next step
            self.due_step[id(sample)] = self.steps + reentry_steps if reentry_steps > 0 else None
            self.turns.start(id(sample), self.environments[id(sample)], sample.text[sample.turn_start : end], settings)

    def _reenter(self, finished: list[tool_pool.ParkedTurn]) -> None:
        """The parked samples whose turn has finished, in their batches' order (never the order the calls finished
        in): each observation is tokenised once and appended, and the sample goes back into the engine as its prompt
        plus every token so far (or ends: its environment is done or was lost, or its budget is spent)."""
        parked = [(self.parked.pop(turn.key), turn) for turn in finished]
        for turn in finished:
            self.due_step.pop(turn.key, None)
        for sample, turn in sorted(parked, key=lambda pair: (pair[0].batch_id, pair[0].index)):
            outcome, stats = turn.outcome(), sample.tool_stats
            stats["calls"] += outcome.calls  # each of a turn's calls (a native turn may make several)
            stats["errors"] += outcome.errors
            stats["timeouts"] += outcome.timeouts
            stats["seconds"] += outcome.seconds
            stats["reward"] += outcome.reward
            stats["abandoned_threads"] = stats.get("abandoned_threads", 0) + outcome.abandoned_threads
            if outcome.reward:  # on the turn's last sampled token, before its observation is appended
                sample.turn_rewards.append([len(sample.token_ids) - 1, outcome.reward])
            # A ToolEnvironment cuts its tools' outputs before wrapping them (and counts them); any other environment's
            # observation, and the text of a step that raised or timed out, is cut here.
            stats["outputs_cut"] += outcome.outputs_cut + self._add_observation(sample, outcome.observation, outcome.cut)
            if outcome.environment_lost:  # its step hung: its thread runs on, its state can no longer be trusted
                self.environments.pop(id(sample), None)
                log.warning("--tools: an environment's step ran past --tool_timeout_s; its sample ends "
                            "(environment_error) and its thread is left running (tools/abandoned_threads)")  # fmt: skip
                sample.finish("environment_error", None, self.policy_version)
            elif outcome.done:
                sample.finish("stop", None, self.policy_version)
            elif len(sample.token_ids) >= sample.max_tokens:
                sample.finish("length", None, self.policy_version)
            else:
                self._submit([sample], self.params[sample.batch_id])

    def _turns_due(self) -> list[tool_pool.ParkedTurn]:
        """The parked turns that re-enter before this step. A turn is due at the step --tool_reentry_steps after its
        call, and the engine waits here for a due turn not yet back, so that which samples share each step depends on
        the steps alone, never on how fast a tool answered. While no sample runs, the turns due first are due now
        (nothing shares a step with them to be changed). With --tool_reentry_steps 0 a turn re-enters as soon as it is
        back; while nothing runs, the engine waits up to PARKED_WAIT_S for one."""
        for turn in self.turns.finished(wait_s=0.0):
            self.arrived[turn.key] = turn
        scheduled = {key: step for key, step in self.due_step.items() if step is not None}
        if self.running:
            due = {key for key, step in scheduled.items() if step <= self.steps}
        elif scheduled and not any(self.due_step[key] is None for key in self.arrived):
            first = min(scheduled.values())
            due = {key for key, step in scheduled.items() if step == first}
        else:
            due = set()
        if not self.running and not due and not self.arrived:
            for turn in self.turns.finished(wait_s=PARKED_WAIT_S):
                self.arrived[turn.key] = turn
        while not due <= self.arrived.keys():  # every call is cut at --tool_timeout_s, so this ends
            for turn in self.turns.finished(wait_s=PARKED_WAIT_S):
                self.arrived[turn.key] = turn
        ready = due | {key for key in self.arrived if self.due_step.get(key, 0) is None}
        return [self.arrived.pop(key) for key in ready]

    def _wait_for_parked(self) -> None:
        """Until no sample is parked: every call is cut at --tool_timeout_s, so this ends."""
        while self.parked:
            for turn in self.turns.finished(wait_s=PARKED_WAIT_S):
                self.arrived[turn.key] = turn
            if self.arrived.keys() >= self.parked.keys():
                self._reenter([self.arrived.pop(key) for key in list(self.arrived)])

    def run_until_complete(self, batch_id: int, between_steps=None) -> list[vllm_engine.Completion]:
        """Step until every sample of `batch_id` has finished (the other batches advance with it); its completions in
        prompt order, and the batch leaves the engine. `between_steps()` is called before each step (the generation
        thread answers the learner there)."""
        samples = self.batches[batch_id]  # an agent batch's grow as its rollouts call
        agents = self.agents if self.agents is not None and batch_id in self.agents.rollouts else None
        while not (all(sample.done for sample in samples) and (agents is None or agents.complete(batch_id))):
            if between_steps is not None:
                between_steps()
            self.step()
        if agents is not None:
            completions = agents.completions(batch_id, self.params[batch_id].get("with_logprobs", False))
            del self.batches[batch_id], self.params[batch_id]
            return completions
        del self.batches[batch_id]
        for sample in samples:
            self.environments.pop(id(sample), None)
            self.unstarted.pop(id(sample), None)
        with_logprobs = self.params.pop(batch_id).get("with_logprobs", False)
        return [sample.completion(with_logprobs) for sample in samples]

    @contextmanager
    def new_weights(self, policy_version: int):
        """Around a weight load between two steps: `pause` before, `resume` after."""
        self.pause()
        yield
        self.resume(policy_version)

    def pause(self) -> None:
        """Before a weight load: the parked samples' turns are waited for (each cut at --tool_timeout_s) and taken
        back, then every running request is aborted (its sample keeps its tokens), so that no request is in the engine
        while its weights change and none is mid-call."""
        self._wait_for_parked()
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
        stores. The parked samples' turns are waited for first (each cut at --tool_timeout_s), so no sample is
        mid-call; otherwise a read: what the engine generates next is what it would have without it."""
        self._wait_for_parked()
        return [
            self.agents.partial(batch_id) if self.agents is not None and batch_id in self.agents.rollouts else
            {"batch_id": batch_id, "params": self.params[batch_id], "samples": [asdict(s) for s in samples]}
            for batch_id, samples in self.batches.items()
        ]  # fmt: skip

    def restore(self, partial_batches: list[dict]) -> None:
        """Put `partial_batches` back (into a fresh engine, on resume): each unfinished sample continues as a request
        whose prompt is its prompt plus its tokens so far."""
        for batch in partial_batches:
            if "agent_rollouts" in batch:  # an agent batch: its ended rollouts as they were, the others run again
                self._agent_samples(batch["params"]).restore(batch)
                continue
            self._add(batch["batch_id"], [Sample(**sample) for sample in batch["samples"]], batch["params"])


def generate_batch(llm, prompt_token_ids: list[list[int]], params: dict, sampling_seed: int | None,
                   rows: list[dict] | None = None) -> list:  # fmt: skip
    """`params["n"]` completions of each prompt, grouped by prompt, decoded as training decodes them (with
    `params["tools"]`, tool calls answered and appended, each prompt's environment reset with its `rows` entry): one
    batch through a fresh `EngineBatches`. For evaluation and probes on a saved model."""
    batches = EngineBatches(llm)
    batches.admit(0, prompt_token_ids, params, sampling_seed, rows)
    return batches.run_until_complete(0)
