"""The two workers' rules (tests/support/worker_turns.py): which file runs beside which, in what order, on how many
threads. The lock is tested with threads of this process: flock locks belong to an open file, so two opens of the same
lock file in one process exclude each other as two processes' do."""

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.support.worker_turns import (
    ALONE,
    HEAVY,
    LIGHT,
    RAY,
    file_kind,
    may_start_beside,
    next_file,
    turn,
    worker_file_order,
)


def item(*markers: str):
    return SimpleNamespace(get_closest_marker=lambda name: name if name in markers else None)


def test_a_file_is_alone_ray_heavy_or_light_by_its_markers():
    assert file_kind([item(), item("e2e", "ray", "alone")]) == ALONE
    assert file_kind([item(), item("e2e", "ray")]) == RAY
    assert file_kind([item(), item("slow")]) == HEAVY
    assert file_kind([item("e2e"), item()]) == HEAVY
    assert file_kind([item(), item()]) == LIGHT  # e.g. a Ray file under -m "not ray": its other tests need no turn


def test_a_ray_file_starts_beside_heavy_and_light_files_but_not_another_ray_file_and_an_alone_file_beside_light_ones():
    assert may_start_beside(RAY, [HEAVY, LIGHT]) and may_start_beside(RAY, [])
    assert not may_start_beside(RAY, [RAY]) and not may_start_beside(RAY, [HEAVY, ALONE])
    assert may_start_beside(HEAVY, [RAY, HEAVY]) and not may_start_beside(HEAVY, [ALONE])
    assert may_start_beside(ALONE, [LIGHT, LIGHT]) and not may_start_beside(ALONE, [HEAVY])
    assert not may_start_beside(ALONE, [RAY]) and not may_start_beside(ALONE, [ALONE])
    assert all(may_start_beside(LIGHT, [kind]) for kind in (ALONE, RAY, HEAVY, LIGHT))


def test_the_order_is_alone_ray_heavy_light_longest_first_and_a_worker_takes_the_first_that_may_start():
    files = {
        "tests/test_placement.py": RAY, "tests/test_ray_resume.py": RAY, "tests/test_engine_actors.py": RAY,
        "tests/test_multinode_local.py": ALONE, "tests/test_resume.py": HEAVY, "tests/test_never_lose_a_run.py": HEAVY,
        "tests/test_new_heavy.py": HEAVY, "tests/test_bad_inputs.py": LIGHT, "tests/test_rl_math.py": LIGHT,
        "tests/test_ppo_learner.py": LIGHT,
    }  # fmt: skip
    order = worker_file_order(files)
    assert [Path(path).stem.removeprefix("test_") for path in order] == [
        "multinode_local", "engine_actors", "ray_resume", "placement", "never_lose_a_run", "resume",
        "new_heavy",  # a file the table does not list counts 3 s
        "ppo_learner", "bad_inputs", "rl_math",
    ]  # fmt: skip
    kinds = [files[path] for path in order]
    assert next_file(kinds, []) == 0
    assert next_file(kinds, [LIGHT]) == 0
    assert next_file(kinds, [ALONE]) == 7  # the first light file
    assert next_file(kinds[1:], [RAY, HEAVY]) == 3  # the first heavy file: the other worker holds a Ray file
    assert next_file(kinds[1:], [HEAVY, HEAVY]) == 0
    assert next_file([RAY, RAY], [RAY]) == 0  # none may start: the first, which waits for its turn
    # None may start beside the two-node file and a Ray file: a heavy file (it waits for the two-node file only), not
    # a second Ray file (it would wait for both, a core idle meanwhile: seen on a slower machine, ~500 s).
    assert next_file(kinds[1:7], [ALONE, RAY]) == 3
    assert next_file([RAY, ALONE, HEAVY], [ALONE, RAY]) == 2


def fake_file(kind: str, tests: int, seconds: float = 0.3) -> str:
    marks = {ALONE: "[pytest.mark.ray, pytest.mark.alone]", RAY: "[pytest.mark.ray]", HEAVY: "[pytest.mark.e2e]"}
    return (
        "import os, time\nimport pytest\n"
        f"pytestmark = {marks.get(kind, '[]')}\n"
        f"@pytest.mark.parametrize('i', range({tests}))\n"
        "def test_it(i):\n"
        "    with open(os.environ['TURNS_LOG'], 'a') as log:\n"
        "        log.write(f\"{os.environ['PYTEST_XDIST_WORKER']} {__name__} {time.time()}\\n\")\n"
        f"    time.sleep({seconds})\n"
    )


def workers_of_a_fake_suite(tmp_path, files: list[tuple]) -> dict[str, set]:
    """Runs fake files ((name, kind, tests, seconds per test)) with the real hooks (tests/conftest.py) under xdist's
    two workers: {name: the workers that ran its tests}."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(
        "from tests.conftest import FILE_KINDS, machine_turn, pytest_collection_modifyitems, pytest_xdist_make_scheduler\n"
    )
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    ray: r\n    alone: a\n    e2e: e\n")
    for name, kind, tests, seconds in files:
        (suite / f"test_{name}.py").write_text(fake_file(kind, tests, seconds))
    log = tmp_path / "turns.log"
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")}  # not this worker's
    env.update(TURNS_LOG=str(log), PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile",
         "--no-loadscope-reorder", "--basetemp", str(tmp_path / "base"), str(suite)],
        cwd=suite, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    workers: dict[str, set] = {}
    for line in log.read_text().splitlines():
        worker, module, _ = line.split()
        workers.setdefault(module.removeprefix("test_"), set()).add(worker)
    assert all(len(held) == 1 for held in workers.values()), workers  # a file on one worker (loadfile)
    return workers


def test_under_two_workers_the_ray_files_run_one_after_the_other_on_one_worker_and_a_heavy_file_on_the_other(
    tmp_path,
):
    """2 Ray files of 4 tests, 2 heavy files of 8."""
    workers = workers_of_a_fake_suite(
        tmp_path, [("r1", RAY, 4, 0.3), ("r2", RAY, 4, 0.3), ("h1", HEAVY, 8, 0.3), ("h2", HEAVY, 8, 0.3)]
    )
    # The first worker starts the first Ray file; the second, which may not start the other Ray file beside it, the first
    # heavy file; the second Ray file follows the first on its worker (xdist's own scheduling gives it the second
    # worker, which then waits). The second heavy file goes to whichever worker is free first.
    assert workers["r1"] == workers["r2"] != workers["h1"], workers


def test_a_worker_that_may_start_nothing_beside_the_two_node_file_and_a_ray_file_takes_a_heavy_file_not_a_ray_one(
    tmp_path,
):
    """What a slower machine did: worker 1 runs the two-node file (4 x 1.5 s) and, asking for its next file while
    worker 2 still runs the light file, is given the first Ray file; worker 2 then asks (the light file's 10 x 0.575 s
    end before the two-node file) while worker 1 holds the two-node file and a Ray file. It must take the heavy file
    (it waits for the two-node file only, then runs beside the Ray file), not the second Ray file (which would wait
    for both with a core idle, as ~500 s did there). The second Ray file then follows the first on worker 1."""
    workers = workers_of_a_fake_suite(
        tmp_path,
        [("a1", ALONE, 4, 1.5), ("r1", RAY, 4, 0.3), ("r2", RAY, 4, 0.3), ("h1", HEAVY, 8, 0.3), ("l1", LIGHT, 10, 0.575)],
    )
    assert workers["a1"] == workers["r1"] != workers["l1"], workers  # the set-up this test is about
    assert workers["r2"] == workers["r1"] != workers["h1"], workers


def hold(run_folder, kind, entered: threading.Event, leave: threading.Event, seen: dict):
    def body():
        with turn(run_folder, kind):
            seen[kind + "_omp"] = os.environ.get("OMP_NUM_THREADS")
            entered.set()
            leave.wait(30)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def test_a_ray_file_runs_beside_a_heavy_one_not_beside_a_ray_one_and_an_alone_file_waits_for_both(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what scripts/test.sh gives each worker
    names = ("heavy1", "ray1", "ray2", "light", "alone", "heavy2")
    events = {name: (threading.Event(), threading.Event()) for name in names}
    seen: dict = {}
    threads = {}

    def start(name: str, kind: str) -> None:
        threads[name] = hold(tmp_path, kind, *events[name], seen if name in ("ray1", "alone") else {})

    def entered(*these: str) -> set:
        return {name for name in these if events[name][0].is_set()}

    def turnstile_held() -> bool:  # by a file waiting for the machine exclusive
        with open(tmp_path / "turnstile.lock", "w") as turnstile:
            try:
                fcntl.flock(turnstile, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            return False

    start("heavy1", HEAVY)
    assert events["heavy1"][0].wait(10)
    start("ray1", RAY)
    assert events["ray1"][0].wait(10)  # a Ray file beside a heavy one
    start("ray2", RAY)
    start("light", LIGHT)
    assert events["light"][0].wait(10)  # a light file beside anything
    time.sleep(0.5)
    assert entered("ray2") == set()  # never two Ray files
    start("alone", ALONE)
    deadline = time.time() + 10
    while not turnstile_held() and time.time() < deadline:
        time.sleep(0.05)
    start("heavy2", HEAVY)
    time.sleep(0.5)
    assert entered("alone", "heavy2") == set()  # the alone file waits for both; a new heavy file waits behind it

    events["ray1"][1].set()
    time.sleep(0.5)
    assert entered("ray2", "alone", "heavy2") == set()  # the second Ray file, too, waits behind the alone file
    events["heavy1"][1].set()
    assert events["alone"][0].wait(10)
    time.sleep(0.5)
    assert entered("ray2", "heavy2") == set()
    events["alone"][1].set()
    assert events["ray2"][0].wait(10) and events["heavy2"][0].wait(10)  # once it ends
    for name in ("ray2", "heavy2", "light"):
        events[name][1].set()
    for thread in threads.values():
        thread.join(10)
        assert not thread.is_alive()
    assert seen == {"ray_omp": "1", "alone_omp": "1"}  # every kind keeps the worker's one thread


@pytest.mark.parametrize("kind", [ALONE, RAY, HEAVY, LIGHT])
def test_every_kind_of_file_keeps_the_workers_one_thread(tmp_path, monkeypatch, kind):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    with turn(tmp_path, kind):
        assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == threads
