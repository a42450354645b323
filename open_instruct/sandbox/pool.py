"""A pool of sandboxes beside the learner: N threads, each waiting on its own sandboxed process, so that the code tests
of a step run N at a time instead of one after another (the waiting happens in the kernel: the GIL is free)."""

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class SandboxPool:
    """`map(fn, items)`: fn(item) for each item on `workers` threads, results in the items' order. Threads start on
    first use and live until `close()` (a run's child dies with the thread that started it: setpriv --pdeathsig)."""

    def __init__(self, workers: int):
        if workers < 1:
            raise ValueError(f"a sandbox pool needs at least 1 worker, got {workers}")
        self.workers = workers
        self._executor: ThreadPoolExecutor | None = None

    def map(self, fn: Callable[[Item], Result], items: Iterable[Item]) -> list[Result]:
        items = list(items)
        if self.workers == 1 or len(items) <= 1:
            return [fn(item) for item in items]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="sandbox")
        return list(self._executor.map(fn, items))

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def __getstate__(self) -> dict:
        # A pool travels to Ray learner ranks inside the reward manager: its threads do not; each process starts its own.
        return {"workers": self.workers, "_executor": None}
