"""The tool pool (environments/tool_pool.py) on its own, no engine: a hung tool is cut at --tool_timeout_s and its
worker process killed and replaced (no worker leaked); a turn's several calls run --max_parallel_tool_calls at a time
and their outputs are joined in the calls' order; a stateful environment's hung step is abandoned, counted, and its
sample lost."""

import os
import time
from pathlib import Path

from open_instruct.environments import tool_pool, tools

SUPPORT = Path(__file__).resolve().parent / "support" / "tool_environments.py"
SLEEP = f"{SUPPORT}:Sleep"


def settings(timeout_s: float = 5.0, workers: int = 4, max_parallel_calls: int = 4) -> dict:
    return {"names": [SLEEP], "timeout_s": timeout_s, "workers": workers, "max_parallel_calls": max_parallel_calls}


def run_turn(environment, text: str, turn_settings: dict) -> tuple[tool_pool.TurnOutcome, float]:
    """The turn's outcome and its wall time."""
    turns, started = tool_pool.ParkedTurns(), time.monotonic()
    turns.start(7, environment, text, turn_settings)
    finished = []
    while not finished:
        finished = turns.finished(wait_s=0.05)
    assert [turn.key for turn in finished] == [7] and turns.pending == 0
    return finished[0].outcome(), time.monotonic() - started


def sleep_tools() -> tools.ToolEnvironment:
    return tools.ToolEnvironment([tools.tool_class(SLEEP)()])


def test_a_hung_tool_is_cut_at_the_timeout_and_its_worker_process_killed_and_replaced():
    turn_settings = settings(timeout_s=0.5, workers=1)
    outcome, _ = run_turn(sleep_tools(), "<sleep>0</sleep>", turn_settings)  # the worker starts: not the call's time
    assert outcome.observation == "<output>slept 0</output>\n" and outcome.timeouts == 0
    worker = tool_pool.shared_pool(1).processes[0]
    hung_pid = worker._process.pid
    outcome, took = run_turn(sleep_tools(), "<sleep>60</sleep>", turn_settings)
    assert outcome.observation == "<output>Error: the call took longer than 0.5 s and was stopped</output>\n"
    assert (outcome.timeouts, outcome.errors, outcome.abandoned_threads) == (1, 0, 0)
    assert took < 5
    try:  # killed and reaped: no process of that id is left
        os.kill(hung_pid, 0)
        raise AssertionError(f"the hung tool's worker {hung_pid} still runs")
    except ProcessLookupError:
        pass
    outcome, _ = run_turn(sleep_tools(), "<sleep>0.1</sleep>", turn_settings)  # a new worker answers the next call
    assert outcome.observation == "<output>slept 0.1</output>\n"
    assert worker._process.pid != hung_pid and len(tool_pool.shared_pool(1).processes) == 1


def test_a_hung_function_tool_runs_in_a_worker_process_that_is_killed_and_replaced(tmp_path):
    """A plain typed function in a file (`--tools naps.py:nap`) is the same class at each lookup, so its calls run in
    worker processes like a Tool class's: one that hangs is cut and its process replaced, no thread left running."""
    (tmp_path / "naps.py").write_text("import time\ndef nap(seconds: float) -> str:\n    time.sleep(float(seconds))\n"
                                      "    return f'slept {seconds}'\n")  # fmt: skip
    name = f"{tmp_path}/naps.py:nap"
    assert tools.tool_class(name) is tools.tool_class(name)
    turn_settings = {"names": [name], "timeout_s": 0.5, "workers": 1, "max_parallel_calls": 1}

    def naps() -> tools.ToolEnvironment:  # the tag call's text is the function's one argument
        return tools.ToolEnvironment([tools.tool_class(name)()])

    outcome, _ = run_turn(naps(), "<nap>0</nap>", turn_settings)  # the worker starts: not the call's time
    assert outcome.observation == "<output>slept 0</output>\n"
    worker = tool_pool.shared_pool(1).processes[0]
    hung_pid = worker._process.pid
    outcome, took = run_turn(naps(), "<nap>60</nap>", turn_settings)
    assert outcome.observation == "<output>Error: the call took longer than 0.5 s and was stopped</output>\n"
    assert (outcome.timeouts, outcome.abandoned_threads) == (1, 0) and took < 5
    try:  # killed and reaped: no process of that id is left
        os.kill(hung_pid, 0)
        raise AssertionError(f"the hung function's worker {hung_pid} still runs")
    except ProcessLookupError:
        pass
    outcome, _ = run_turn(naps(), "<nap>0.1</nap>", turn_settings)
    assert outcome.observation == "<output>slept 0.1</output>\n" and worker._process.pid != hung_pid


def test_a_turns_calls_run_max_parallel_at_a_time_and_their_outputs_join_in_order():
    several = tools.tool_class(f"{SUPPORT}:SeveralSleeps")
    text = "<sleep>0.4</sleep> then <sleep>0.05</sleep> and <sleep>0.4</sleep>, <sleep>0.3</sleep>"
    run_turn(several(), "<sleep>0</sleep>" * 4, settings())  # start the workers
    expected = "".join(f"<output>slept {s}</output>\n" for s in ("0.4", "0.05", "0.4", "0.3"))
    one_at_a_time, serial = run_turn(several(), text, settings(max_parallel_calls=1))
    all_at_once, parallel = run_turn(several(), text, settings(max_parallel_calls=4))
    assert one_at_a_time.observation == all_at_once.observation == expected
    assert serial >= 1.15  # 0.4 + 0.05 + 0.4 + 0.3
    assert parallel < serial - 0.4, (parallel, serial)
    assert all_at_once.seconds >= 1.15  # the calls' own times, summed


class Hangs(tools.Environment):
    end_strings = ("!",)

    def step(self, text):
        time.sleep(60)
        return "late", 1.0, False


def test_a_hung_environment_step_is_abandoned_counted_and_its_sample_lost():
    outcome, took = run_turn(Hangs(), "go!", settings(timeout_s=0.3))
    assert took < 5
    assert outcome.environment_lost and outcome.abandoned_threads == 1 and outcome.timeouts == 1
    assert "longer than 0.3 s" in outcome.observation and outcome.reward == 0.0


class UnreadableCalls(tools.ToolEnvironment):
    def calls(self, model_text):
        raise ValueError("no call in this turn")


def test_a_turn_whose_calls_cannot_be_read_is_answered_with_the_error():
    outcome, _ = run_turn(UnreadableCalls([tools.tool_class(SLEEP)()]), "<sleep>", settings())
    assert outcome.observation == "<output>Error: ValueError: no call in this turn</output>\n" and outcome.errors == 1
