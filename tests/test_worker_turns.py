"""The two workers' rules (tests/support/worker_turns.py): which file runs beside which, in what order, on how many
threads. The lock is tested with threads of this process: flock locks belong to an open file, so two opens of the same
lock file in one process exclude each other as two processes' do."""

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.support.worker_turns import ALONE, HEAVY, LIGHT, file_kind, turn, worker_file_order


def item(*markers: str):
    return SimpleNamespace(get_closest_marker=lambda name: name if name in markers else None)


def test_a_file_is_alone_with_a_ray_test_heavy_with_an_e2e_or_slow_one_and_light_otherwise():
    assert file_kind([item(), item("e2e", "ray")]) == ALONE
    assert file_kind([item(), item("slow")]) == HEAVY
    assert file_kind([item("e2e"), item()]) == HEAVY
    assert file_kind([item(), item()]) == LIGHT  # e.g. a Ray file under -m "not ray": its other tests need no turn


def test_the_order_is_the_ray_files_longest_first_with_light_files_between_then_the_heavy_ones_then_the_rest():
    files = {
        "tests/test_placement.py": ALONE, "tests/test_ray_resume.py": ALONE, "tests/test_engine_actors.py": ALONE,
        "tests/test_resume.py": HEAVY, "tests/test_never_lose_a_run.py": HEAVY, "tests/test_new_heavy.py": HEAVY,
        "tests/test_bad_inputs.py": LIGHT, "tests/test_ppo_learner.py": LIGHT, "tests/test_rl_math.py": LIGHT,
        "tests/test_layers.py": LIGHT,
    }  # fmt: skip
    order = worker_file_order(files)
    assert sorted(order) == sorted(files)  # every file once
    # The light files' share of the Ray files' time after each (longest first): 59 s against 496 s of Ray files here.
    assert [Path(path).stem.removeprefix("test_") for path in order] == [
        "engine_actors", "ppo_learner", "ray_resume", "bad_inputs", "layers", "placement", "rl_math",
        "never_lose_a_run", "resume", "new_heavy",  # a file the table does not list counts 3 s
    ]  # fmt: skip
    assert worker_file_order({"tests/test_a.py": LIGHT, "tests/test_b.py": HEAVY}) == [
        "tests/test_b.py",
        "tests/test_a.py",
    ]


def hold(run_folder, kind, entered: threading.Event, leave: threading.Event, seen: dict):
    def body():
        with turn(run_folder, kind):
            seen[kind + "_omp"] = os.environ.get("OMP_NUM_THREADS")
            entered.set()
            leave.wait(30)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def test_a_ray_file_waits_for_the_heavy_file_running_and_a_heavy_file_after_it_waits_for_it(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what scripts/test.sh gives each worker
    threads_before = torch.get_num_threads()
    events = {name: (threading.Event(), threading.Event()) for name in ("heavy1", "ray", "heavy2", "light")}
    seen: dict = {}

    heavy1 = hold(tmp_path, HEAVY, *events["heavy1"], seen)
    assert events["heavy1"][0].wait(10)
    ray = hold(tmp_path, ALONE, *events["ray"], seen)
    time.sleep(0.5)
    assert not events["ray"][0].is_set()  # the heavy file runs: the Ray file waits
    heavy2 = hold(tmp_path, HEAVY, *events["heavy2"], {})
    light = hold(tmp_path, LIGHT, *events["light"], {})
    assert events["light"][0].wait(10)  # a light file runs beside anything
    time.sleep(0.5)
    assert not events["heavy2"][0].is_set()  # behind the waiting Ray file, though a shared lock would let it in

    events["heavy1"][1].set()  # the first heavy file ends: the Ray file's turn, alone
    assert events["ray"][0].wait(10)
    time.sleep(0.5)
    assert not events["heavy2"][0].is_set()
    assert seen["alone_omp"] is None  # the Ray file's processes run as under one pytest process ...
    events["ray"][1].set()
    assert events["heavy2"][0].wait(10)  # ... and the next heavy file runs once it ends
    assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == threads_before  # given back
    for name in ("heavy2", "light"):
        events[name][1].set()
    for thread in (heavy1, ray, heavy2, light):
        thread.join(10)
        assert not thread.is_alive()


@pytest.mark.parametrize("kind", [HEAVY, LIGHT])
def test_a_heavy_or_light_file_keeps_the_workers_one_thread(tmp_path, monkeypatch, kind):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with turn(tmp_path, kind):
        assert os.environ["OMP_NUM_THREADS"] == "1"
