"""Agent rollouts inside the engine (`--rollout_agent`, docs/agents.md): each call an agent program makes to the
trainer's endpoint becomes a request of the same engine that generates the dataset's rollouts, and each rollout's calls
become its samples, token-exact.

An agent batch is admitted like any other (`EngineBatches.admit` with `params["agent"]`): --num_samples_per_prompt_rollout
rollouts per prompt, each an agent run on the prompt's dataset row (environments/agent_runner.py), with no request in
the engine until its first call. The endpoint (environments/agent_endpoint.py, a thread of its own) puts each call in
this engine's inbox; the engine thread takes them in before each step (`take_calls`):

- A rollout's first call starts its first sample: the call's prompt ids are the sample's prompt.
- A later call whose prompt ids extend the rollout's sample (its prompt + every token so far) continues it: the ids
  between are appended as not sampled (the tool turns and the next generation prompt, which the policy never chose:
  no logprob, no version, masked out of every loss), and the call is submitted as prompt + tokens so far, the path
  an in-flight update and a tool's answer take. Otherwise the sample ends and a new one starts with the call's prompt
  (counted in agent/splits); every sample of a rollout gets the rollout's reward.
- A call's tokens carry the policy version of each engine step (a weight load mid-call tags its later tokens with the
  new version) and are sampled with the batch's settings (the run's --temperature: the learner's ratio needs the
  behaviour policy it measures; the agent's own temperature is not used in training); its seed is its sample's
  (`request_seed`), so a deterministic agent's rollouts are the same in every run.
- When a call's request finishes (its stop token, --response_length's budget for the sample, the call's max_tokens or
  one of its stop strings) the call's future is answered and the sample waits, out of the engine, for the next call.
- When the agent returns, its rollout ends; a failed rollout's samples are dropped or kept with reward 0
  (--agent_failed_rollouts). The batch is complete when every rollout has ended.
"""

import logging
import queue
import time
from dataclasses import asdict

from open_instruct.environments.agent_endpoint import AgentRollout, CallResult, EngineCall, Refused
from open_instruct.generation import vllm_engine
from open_instruct.generation.samples import Sample

log = logging.getLogger(__name__)

MAX_ROLLOUTS = 1 << 20  # a sample's index in its batch (its seed's input): rollout index + split * this
AGENT_STATS = ("calls", "refused", "bridged", "retokenized_extends", "chat_calls")


def agent_tool_parser(name: str, renderer) -> str | None:
    """The vLLM tool parser that reads the calls in an agent's answers (--tool_call_parser; auto: from the chat
    template), or None where the template shows no tools (answers are then text only)."""
    from open_instruct.environments.native_tools import PROBE_SCHEMA
    from open_instruct.environments.tool_parsers import TAGS, renders_tools, resolve_parser_name

    def render(tools):
        return renderer.render([{"role": "user", "content": "Hi"}], tools, add_generation_prompt=True)

    try:
        resolved = resolve_parser_name(name, renderer.chat_template, renders_tools(render, [PROBE_SCHEMA]))
    except ValueError:
        return None
    return None if resolved == TAGS else resolved


def agent_sample_index(rollout_index: int, split: int) -> int:
    """A rollout's first sample has the index (and so the sampling seed) the dataset's sample in its place would have:
    a one-call agent samples what the in-engine path samples for the same prompt."""
    return rollout_index + split * MAX_ROLLOUTS


class AgentSamples:
    """The agent rollouts of one engine's batches (`EngineBatches.agents`), and the endpoint and runner they use."""

    def __init__(self, batches, settings: dict, engine_index: int = 0):
        """`engine_index`: with engine actors, which one this is: its endpoint serves on --agent_port + engine_index
        (0: a free port), and only the rollouts of its slices of each batch call it."""
        from transformers import AutoTokenizer

        from open_instruct.data.chat_templates import resolve_chat_template
        from open_instruct.environments.agent_endpoint import Endpoint, Renderer
        from open_instruct.environments.agent_runner import AgentRunner, load_agent
        from open_instruct.run.console import say

        self.batches, self.settings = batches, settings
        self.inbox: queue.Queue = queue.Queue()  # ("call", EngineCall) | ("end", AgentRollout), from other threads
        model_config = batches.llm.llm_engine.model_config
        self.max_model_len = model_config.max_model_len
        # The endpoint's own tokenizer: the engine's is used by this thread, and HF's fast tokenizers are not to be
        # shared between threads.
        tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer)
        _, template = resolve_chat_template(tokenizer, settings.get("chat_template_name"))
        renderer = Renderer(tokenizer, template)
        self.endpoint = Endpoint(renderer, agent_tool_parser(settings.get("parser", "auto"), renderer),
                                 settings["served_name"],
                                 model_config.max_model_len, self._submit_call, settings["host"],
                                 settings["port"] + engine_index if settings["port"] else 0)  # fmt: skip
        base_url = self.endpoint.start()
        on_engine = f" (engine {engine_index}'s rollouts)" if engine_index else ""
        say(f"[agent] {settings['spec']} talks to {base_url}{on_engine} (model {settings['served_name']!r}), at most "
            f"{settings['concurrency']} rollouts at once")  # fmt: skip
        self.runner = AgentRunner(self.endpoint, base_url, settings["concurrency"],
                                  lambda rollout: self.inbox.put(("end", rollout)))  # fmt: skip
        self.load_agent = load_agent
        self.rollouts: dict[object, list[AgentRollout]] = {}  # by batch id
        self.samples: dict[tuple, list] = {}  # (batch id, rollout index) -> its samples
        self.calls: dict[int, EngineCall] = {}  # id(sample) -> the call its running request answers
        self.seeds: dict[object, int | None] = {}  # each batch's sampling seed
        self.records: dict[object, dict] = {}  # by batch id, when complete: its rollouts' summaries (`record_of`)
        self.errors_noted = 0
        self.waited_s = 0.0  # the engine's time with nothing to decode, waiting for agents' calls (since last read)

    def _submit_call(self, call: EngineCall) -> None:
        self.inbox.put(("call", call))

    # ---- admission ----
    def admit(self, batch_id, prompt_count: int, params: dict, sampling_seed: int | None, rows: list[dict],
              start: bool = True) -> None:  # fmt: skip
        n = params["n"]
        rollouts = [AgentRollout(batch_id, index, index // n, rows[index // n]) for index in range(prompt_count * n)]
        self.rollouts[batch_id] = rollouts
        self.batches.batches[batch_id], self.batches.params[batch_id] = [], params
        self.seeds[batch_id] = sampling_seed
        if start:
            self._start(rollouts, params)

    def partial(self, batch_id) -> dict:
        """The batch as a checkpoint holds it: each ended rollout with its samples and reward; a running one as its row
        alone (an agent program cannot be stored mid-run: on resume it runs again from its row)."""
        rollouts, n = self.rollouts[batch_id], self.batches.params[batch_id]["n"]
        saved = [None if not rollout.ended_in_engine else {
            "state": rollout.state, "reward": rollout.reward, "metrics": rollout.metrics, "error": rollout.error,
            "seconds": rollout.seconds,
            "calls": rollout.calls, "stats": rollout.stats,
            "samples": [asdict(sample) for sample in self.samples.get((batch_id, rollout.index), [])]}
            for rollout in rollouts]  # fmt: skip
        return {"batch_id": batch_id, "params": self.batches.params[batch_id], "seed": self.seeds[batch_id],
                "rows": [rollout.row for rollout in rollouts[::n]], "agent_rollouts": saved}  # fmt: skip

    def restore(self, batch: dict) -> None:
        """Put a checkpoint's batch back (`partial`): its ended rollouts as they were, the others started again."""
        batch_id, params = batch["batch_id"], batch["params"]
        self.admit(batch_id, len(batch["rows"]), params, batch["seed"], batch["rows"], start=False)
        for rollout, saved in zip(self.rollouts[batch_id], batch["agent_rollouts"]):
            if saved is None:
                continue
            samples = [Sample(**sample) for sample in saved.pop("samples")]
            for key, value in saved.items():
                setattr(rollout, key, value)
            rollout.ended_in_engine = True
            self.samples[(batch_id, rollout.index)] = samples
            self.batches.batches[batch_id].extend(samples)
        self._start([rollout for rollout in self.rollouts[batch_id] if not rollout.ended_in_engine], params)

    def _start(self, rollouts: list[AgentRollout], params: dict) -> None:
        """Its batch's agent (each batch names its own: params["agent"]) on the rollouts."""
        settings = params["agent"]
        self.runner.start(rollouts, self.load_agent(settings["spec"]), settings["timeout_s"])

    def active(self) -> bool:
        return any(not rollout.ended_in_engine for rollouts in self.rollouts.values() for rollout in rollouts)

    # ---- before each step ----
    def take_calls(self, wait_s: float) -> None:
        """Every call and ended rollout in the inbox (waiting up to `wait_s` for the first one)."""
        started = time.perf_counter()
        try:
            events = [self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait()]
        except queue.Empty:
            return
        finally:
            if wait_s > 0:
                self.waited_s += time.perf_counter() - started
        while True:
            try:
                events.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for kind, item in events:
            if kind == "call":
                self._start_call(item)
            else:
                self._end_rollout(item)

    def _start_call(self, call: EngineCall) -> None:
        rollout, batches = call.rollout, self.batches
        if rollout.state != "running" or rollout.batch_id not in self.rollouts:
            call.future.set_exception(Refused(409, "this rollout has ended"))
            return
        params = batches.params[rollout.batch_id]
        max_calls = params["agent"]["max_calls"]
        if rollout.calls >= max_calls:
            call.future.set_exception(Refused(429, f"this rollout made --agent_max_calls {max_calls} calls; return "
                                                   "its reward"))  # fmt: skip
            return
        rollout.calls += 1
        samples = self.samples.setdefault((rollout.batch_id, rollout.index), [])
        sample = samples[-1] if samples else None
        context = None if sample is None else sample.prompt_token_ids + sample.token_ids
        prompt = call.prompt_token_ids
        if context is not None and len(prompt) >= len(context) and prompt[: len(context)] == context:
            between = prompt[len(context) :]  # the tool turns and the generation prompt: read, never sampled
            sample.add_observation(between, batches.llm.get_tokenizer().decode(between))
        else:
            sample = Sample(rollout.batch_id, rollout.prompt_index, list(prompt), params["max_tokens"],
                            self.seeds[rollout.batch_id], agent_sample_index(rollout.index, len(samples)),
                            rollout=rollout.index)  # fmt: skip
            samples.append(sample)
            batches.batches[rollout.batch_id].append(sample)
        # Within the sample's --response_length budget and the engine's --max_token_length.
        left = min(sample.max_tokens - len(sample.token_ids), self.max_model_len - len(prompt))
        if left <= 0:  # the sample's --response_length budget is spent: an empty answer that says so
            call.future.set_result(CallResult([], [], "", "length"))
            return
        start = len(sample.token_ids)
        sample.call = {"start": start, "end": start + min(left, call.max_tokens or left), "text_start": len(sample.text),
                       "stop": list(call.stop)}  # fmt: skip
        sample.stop_searched_up_to = len(sample.text)
        sample.waiting = False
        self.calls[id(sample)] = call
        batches._submit([sample], params)

    # ---- from the engine's step ----
    def call_ended(self, sample, finish_reason: str, stop_reason) -> None:
        """The sample's request finished (`EngineBatches.step`): its call is answered, the sample waits for the next."""
        sample.keep_stop_token(finish_reason, stop_reason, self.batches.policy_version)
        sample.waiting, sample.last_finish = True, finish_reason
        call, start = self.calls.pop(id(sample)), sample.call["start"]
        call.future.set_result(CallResult(sample.token_ids[start:], sample.logprobs[start:],
                                          sample.text[sample.call["text_start"] :], finish_reason,
                                          stop_reason))  # fmt: skip

    def _end_rollout(self, rollout: AgentRollout) -> None:
        """The agent returned (or failed): its samples end, a running call of it is aborted."""
        batches = self.batches
        for sample in self.samples.get((rollout.batch_id, rollout.index), []):
            request_ids = [rid for rid, running in batches.running.items() if running is sample]
            if request_ids:  # a call still running when its agent ran out of time
                batches.llm.llm_engine.abort_request(request_ids)
                for request_id in request_ids:
                    del batches.running[request_id]
                self.calls.pop(id(sample)).future.set_exception(Refused(409, "the rollout ended"))
            if not sample.done:
                reason = (sample.last_finish or "length") if rollout.state == "done" else "agent_error"
                sample.finish(reason, None, batches.policy_version)
        failed = batches.params[rollout.batch_id]["agent"]["failed"]
        if rollout.state != "done" and self.errors_noted < 3:
            self.errors_noted += 1
            log.warning(f"[agent] a rollout ended without a reward ({rollout.state}): {rollout.error}; it is "
                        f"{'scored 0' if failed == 'zero' else 'dropped'} (--agent_failed_rollouts)"
                        f"{'' if self.errors_noted < 3 else '. (Later ones are counted in agent/errors, agent/timeouts.)'}")  # fmt: skip
        rollout.ended_in_engine = True

    # ---- a batch that has ended ----
    def complete(self, batch_id) -> bool:
        return all(rollout.ended_in_engine for rollout in self.rollouts[batch_id])

    def completions(self, batch_id, with_logprobs: bool) -> list[vllm_engine.Completion]:
        """Each rollout's samples in rollout order (a prompt's rollouts together), each with its rollout's reward;
        a failed rollout's dropped or scored 0 (--agent_failed_rollouts). The batch's agent/* metrics are kept for
        `metrics_of`."""
        rollouts, failed_rollouts = self.rollouts.pop(batch_id), self.batches.params[batch_id]["agent"]["failed"]
        self.seeds.pop(batch_id, None)
        completions, splits = [], 0
        for rollout in rollouts:
            self.endpoint.forget(rollout.key)
            samples = self.samples.pop((batch_id, rollout.index), [])
            splits += max(0, len(samples) - 1)
            failed = rollout.state != "done"
            if failed and failed_rollouts == "drop":
                continue
            reward = 0.0 if failed else rollout.reward
            for split, sample in enumerate(samples):
                completion = sample.completion(with_logprobs)
                completion.sampled = list(sample.sampled)
                completion.tool_stats = None  # an agent's tools are its own: agent/* counts them, not tools/*
                completion.prompt_token_ids = list(sample.prompt_token_ids)
                completion.agent = {"reward": reward, "rollout": rollout.index, "split": split}
                completions.append(completion)
        # The engine's wait for agents while this batch ran (with other batches in the engine: theirs too).
        self.records[batch_id] = {"rollouts": [rollout_summary(rollout) for rollout in rollouts], "splits": splits,
                                  "failed": failed_rollouts, "waited_s": self.waited_s}  # fmt: skip
        self.waited_s = 0.0
        return completions

    def record_of(self, batch_id) -> dict | None:
        """What this engine saw of a completed batch's rollouts (plain data: engine actors send it to the driver,
        where `agent_metrics` merges the engines' records of one batch)."""
        return self.records.pop(batch_id, None)

    def metrics_of(self, batch_id) -> dict[str, float]:
        record = self.record_of(batch_id)
        return {} if record is None else agent_metrics([record])

    def close(self) -> None:
        self.runner.close()
        self.endpoint.stop()


def rollout_summary(rollout: AgentRollout) -> dict:
    """What the agent/* metrics read of an ended rollout."""
    return {"state": rollout.state, "reward": rollout.reward, "calls": rollout.calls, "seconds": rollout.seconds,
            "stats": dict(rollout.stats), "metrics": dict(rollout.metrics)}  # fmt: skip


def agent_metrics(records: list[dict]) -> dict[str, float]:
    """A batch's agent/* metrics from the records of the engines that ran its rollouts (`record_of`: one in-process
    engine, or one per engine actor that ran a slice of the batch). The engine's wait for agents is the engines' mean."""
    metrics = batch_metrics([rollout for record in records for rollout in record["rollouts"]], records[0]["failed"])
    metrics["agent/splits"] = float(sum(record["splits"] for record in records))
    metrics["time/engine_waiting_for_agents"] = sum(record["waited_s"] for record in records) / len(records)
    return metrics


def batch_metrics(rollouts: list[dict], failed_rollouts: str) -> dict[str, float]:
    """The agent/* metrics of one batch's rollouts (`rollout_summary`): rewards (of those that returned one), calls,
    failures, refused calls, and how often a call continued its conversation by the bridge (and would have by a fresh
    render)."""
    count = max(1, len(rollouts))
    done = [rollout for rollout in rollouts if rollout["state"] == "done"]
    continued = sum(max(0, rollout["stats"]["chat_calls"] - 1) for rollout in rollouts)
    user_metrics: dict[str, list[float]] = {}
    for rollout in done:
        for key, value in rollout["metrics"].items():
            user_metrics.setdefault(key, []).append(value)
    metrics = {
        "agent/reward": sum(rollout["reward"] for rollout in done) / max(1, len(done)),
        "agent/calls_per_rollout": sum(rollout["calls"] for rollout in rollouts) / count,
        "agent/errors": float(sum(rollout["state"] == "failed" for rollout in rollouts)),
        "agent/timeouts": float(sum(rollout["state"] == "timeout" for rollout in rollouts)),
        "agent/dropped": float(0 if failed_rollouts == "zero" else len(rollouts) - len(done)),
        "agent/refused_calls": float(sum(rollout["stats"]["refused"] for rollout in rollouts)),
        "agent/no_calls": float(sum(rollout["calls"] == 0 for rollout in rollouts)),
        "time/agent_rollout": sum(rollout["seconds"] for rollout in rollouts) / count,
    }
    if continued:
        metrics["agent/bridged_frac"] = sum(rollout["stats"]["bridged"] for rollout in rollouts) / continued
        metrics["agent/retokenized_extends_frac"] = (sum(rollout["stats"]["retokenized_extends"] for rollout in rollouts)
                                                     / continued)  # fmt: skip
    for key, values in user_metrics.items():
        metrics[f"agent/{key}"] = sum(values) / len(values)
    return metrics
