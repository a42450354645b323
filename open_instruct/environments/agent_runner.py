"""Agent programs as rollouts (`--rollout_agent path/to/agent.py:run`, docs/agents.md): loading the function, and
running it once per rollout against the trainer's endpoint (agent_endpoint.py) with a client of the real `openai`
package whose API key is that rollout's own.

`run(row, client)` gets the dataset row (every column) and an `openai.OpenAI` client (an `openai.AsyncOpenAI` one
when `run` is `async def`), makes any number of calls and returns the rollout's reward: a number, or a dict with
"reward" and other numbers (logged as agent/<name>). At most --agent_concurrency rollouts run at once (asyncio tasks
on the endpoint's loop; a plain function runs in a thread), each cut at --agent_timeout_s. An agent that raises,
returns no number or runs out of time ends its rollout (counted; its samples dropped or scored 0,
--agent_failed_rollouts) and the run goes on: a plain function past its time cannot be stopped, so its thread is left
running and its key refuses every later call (409).
"""

import asyncio
import copy
import importlib.util
import inspect
import math
import os
import sys
import threading
import time
from collections.abc import Callable

from open_instruct.environments.agent_endpoint import AgentRollout, Endpoint


def agent_problem(spec: str) -> str | None:
    """Why `--rollout_agent spec` cannot be used (one line), or None. Checked before any model loads."""
    try:
        load_agent(spec)
    except ValueError as problem:
        return str(problem)
    return None


def load_agent(spec: str) -> Callable:
    """The function `path/to/file.py:name` names; a ValueError in one line when there is none or it cannot take
    (row, client)."""
    path, _, name = spec.rpartition(":")
    if not path or not name or not path.endswith(".py"):
        raise ValueError(f"--rollout_agent {spec!r}: expected path/to/agent.py:function")
    if not os.path.isfile(path):
        raise ValueError(f"--rollout_agent {spec!r}: no file {path}")
    module_name = f"open_instruct_agent_{abs(hash(os.path.abspath(path)))}"
    module = sys.modules.get(module_name)
    if module is None:
        loader = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader)
        try:
            loader.loader.exec_module(module)
        except Exception as error:  # noqa: BLE001 - the user's file: say what it raised, in one line
            raise ValueError(f"--rollout_agent {spec!r}: importing {path} raised {type(error).__name__}: "
                             f"{' '.join(str(error).split())[:200]}") from None  # fmt: skip
        sys.modules[module_name] = module
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"--rollout_agent {spec!r}: {path} defines no function {name!r}")
    try:
        inspect.signature(function).bind(None, None)
    except TypeError:
        raise ValueError(f"--rollout_agent {spec!r}: {name}{inspect.signature(function)} must take (row, client)") from None
    return function


def reward_of(returned) -> tuple[float, dict[str, float]]:
    """The reward and metrics an agent returned; a ValueError saying what was wrong with it."""
    metrics = {}
    if isinstance(returned, dict):
        metrics = {key: value for key, value in returned.items() if key != "reward"}
        returned = returned.get("reward")
    if isinstance(returned, bool) or not isinstance(returned, (int, float)) or not math.isfinite(returned):
        raise ValueError(f"the agent returned {returned!r} as its reward; return a finite number or {{'reward': ...}}")
    bad = [key for key, value in metrics.items() if isinstance(value, bool) or not isinstance(value, (int, float))]
    if bad:
        raise ValueError(f"the agent's metric {bad[0]!r} is not a number")
    return float(returned), {key: float(value) for key, value in metrics.items()}


class AgentRunner:
    """Runs an agent once per rollout, on the endpoint's loop, at most `concurrency` at once. `on_end(rollout)` is
    called (from that loop's thread) when a rollout has ended, whichever way."""

    def __init__(self, endpoint: Endpoint, base_url: str, concurrency: int, on_end: Callable[[AgentRollout], None]):
        self.endpoint, self.base_url, self.concurrency, self.on_end = endpoint, base_url, concurrency, on_end
        self.slots: asyncio.Semaphore | None = None

    def start(self, rollouts: list[AgentRollout], function: Callable, timeout_s: float) -> None:
        """Start the rollouts (callable from any thread): their keys are valid from now until they end."""
        for rollout in rollouts:
            self.endpoint.rollouts[rollout.key] = rollout
        self.endpoint.loop.call_soon_threadsafe(self._schedule, rollouts, function, timeout_s)

    def _schedule(self, rollouts: list[AgentRollout], function: Callable, timeout_s: float) -> None:
        if self.slots is None:
            self.slots = asyncio.Semaphore(self.concurrency)
        for rollout in rollouts:
            asyncio.get_running_loop().create_task(self._run(rollout, function, timeout_s))

    async def _run(self, rollout: AgentRollout, function: Callable, timeout_s: float) -> None:
        async with self.slots:
            started = time.time()
            is_async = inspect.iscoroutinefunction(function)
            client = self._client(rollout, is_async, timeout_s)
            try:
                returned = await asyncio.wait_for(self._call(rollout, function, is_async, client), timeout_s)
                rollout.reward, rollout.metrics = reward_of(returned)
                rollout.state = "done"
            except TimeoutError:  # a plain function's thread runs on: its key refuses every later call
                rollout.state, rollout.error = "timeout", f"ran past --agent_timeout_s {timeout_s:g}"
            except Exception as error:  # noqa: BLE001 - the agent is user code: its failure ends its rollout only
                rollout.state = "failed"
                rollout.error = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
            finally:
                rollout.seconds = time.time() - started
                if is_async:
                    await client.close()
                self.on_end(rollout)

    async def _call(self, rollout: AgentRollout, function: Callable, is_async: bool, client):
        row = copy.deepcopy(rollout.row)
        if is_async:
            return await function(row, client)
        # A plain function runs in a daemon thread of its own: one past its time is left behind without holding up
        # the process's exit (a pool's threads are joined at exit), and no pool caps how many run at once.
        loop = asyncio.get_running_loop()
        returned = loop.create_future()

        def settle(method, value) -> None:
            if not returned.done():  # a rollout cut at its timeout has stopped waiting
                getattr(returned, method)(value)

        def run() -> None:
            try:
                value = function(row, client)
            except BaseException as error:  # noqa: BLE001 - handed to the rollout, which ends failed
                loop.call_soon_threadsafe(settle, "set_exception", error)
            else:
                loop.call_soon_threadsafe(settle, "set_result", value)

        threading.Thread(target=run, name=f"agent-{rollout.batch_id}-{rollout.index}", daemon=True).start()
        return await returned

    def _client(self, rollout: AgentRollout, is_async: bool, timeout_s: float):
        """The real `openai` client on this rollout's key; no retries (a refused call is the agent's to see), no proxy
        from the environment (the endpoint is local)."""
        import httpx
        import openai

        timeout = httpx.Timeout(timeout_s + 5.0)
        if is_async:
            return openai.AsyncOpenAI(base_url=self.base_url, api_key=rollout.key, max_retries=0, timeout=timeout,
                                      http_client=httpx.AsyncClient(trust_env=False, timeout=timeout))  # fmt: skip
        return openai.OpenAI(base_url=self.base_url, api_key=rollout.key, max_retries=0, timeout=timeout,
                             http_client=httpx.Client(trust_env=False, timeout=timeout))  # fmt: skip

    def close(self) -> None:
        pass  # its threads are daemons; the endpoint's loop stops with the endpoint
