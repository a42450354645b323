"""The suite's forked runs (tests/support/forked_runs.py) are the runs a new interpreter gives: the same argv, folder,
`sys.path[0]`, environment, streams, signal handlers, exit codes, atexit hooks and threads joined at exit, for a
script and for `-m`. (That a forked *trainer* run logs and saves what a `python -m` run does is checked on the
real trainer by test_never_lose_a_run.py's same_command_twice: its first run is a new interpreter, its second is
forked.) A small zygote with no preloaded modules serves these tests, so they run in the fast tier, but for one (e2e)
whose zygote imports vLLM and compiles, as the suite's do."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.support.forked_runs import MAY_DIFFER, Zygote, forkable, offline_env, start_run

PROBE = """
import atexit, json, os, signal, sys, threading, time

report = {
    "name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "stdin": sys.stdin.read(),
    "env": {name: os.environ.get(name) for name in ("PROBE", "PYTHONUNBUFFERED", "OPEN_INSTRUCT_DEBUG")},
    "handlers": {name: str(signal.getsignal(getattr(signal, name))) for name in ("SIGINT", "SIGTERM", "SIGPIPE")},
    "own_process_group": os.getpgid(0) == os.getpid(), "threads": threading.active_count(),
}
print(json.dumps(report), flush=True)
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.3), print("a non-daemon thread finished"))).start()
mode = sys.argv[1]
if mode == "exit_3":
    sys.exit(3)
if mode == "raise":
    raise ValueError("boom")
if mode.startswith("wait"):
    time.sleep(60)
"""


def test_runs_get_the_workers_environment_from_before_its_first_test_and_only_may_differ_from_now(monkeypatch):
    """What a test in the worker's process sets (an engine built in process sets vLLM's variables) does not reach the
    runs, so their zygote never has to start anew for it; the variables that may differ do."""
    monkeypatch.setenv("VLLM_DIST_IDENT", "set-by-an-in-process-engine")
    monkeypatch.setenv("OPEN_INSTRUCT_DEBUG", "1")
    env = offline_env()
    assert "VLLM_DIST_IDENT" not in env and env["OPEN_INSTRUCT_DEBUG"] == "1"
    assert env["PATH"] == os.environ["PATH"] and env["HF_HUB_OFFLINE"] == "1"


@pytest.mark.e2e
def test_a_zygote_that_imports_vllm_compiles_its_logprob_ranks_even_on_a_cold_cache_and_serves(tmp_path):
    """~15 s (vLLM's import, a compile from an empty inductor cache): the zygotes compile vLLM's logprob ranks
    (`compile_vllm_logprob_ranks`); on a cache miss inductor compiled in a pool of threads that stayed, and the zygote
    refused to fork (every run of that worker a new interpreter, ~12 s more each: a suite run took 20 minutes more)."""
    env = {**offline_env(), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # a fresh machine's: empty
    # Inductor's config read before vLLM's import sets TORCHINDUCTOR_COMPILE_THREADS=1, as the trainer's imports do:
    # inductor then compiles with one thread per core.
    zygote = Zygote(env, at_start=[], later=["torch._inductor.config", "vllm.v1.sample.ops.logprobs"])
    try:
        assert zygote.ready, zygote.why_not
        assert any((tmp_path / "inductor").rglob("*.py")), "nothing was compiled"
        script = tmp_path / "ranks.py"
        script.write_text("import time, torch\n"
                          "from vllm.v1.sample.ops.logprobs import batched_count_greater_than\n"
                          "x = torch.randn(5, 49152); v = x[:, :1].clone()\n"
                          "torch._dynamo.decorators.mark_unbacked(x, 0); torch._dynamo.decorators.mark_unbacked(v, 0)\n"
                          "start = time.time(); batched_count_greater_than(x, v); print(time.time() - start)\n")  # fmt: skip
        process = zygote.start([str(script)], tmp_path, env, tmp_path / "out", tmp_path / "err")
        assert process.wait(timeout=120) == 0, (tmp_path / "err").read_text()[-2000:]
        seconds = float((tmp_path / "out").read_text().split()[-1])
        assert seconds < 0.5, f"the forked process compiled again ({seconds:.2f} s)"  # ~1.5-2 s when it compiles
    finally:
        zygote.close()


@pytest.fixture(scope="module")
def bare_zygote():
    zygote = Zygote(offline_env(), at_start=[], later=[])
    assert zygote.ready, zygote.why_not
    yield zygote
    zygote.close()


def run_both_ways(zygote: Zygote, command: list[str], cwd: Path, env: dict, then=None, **options) -> list[dict]:
    """`command` forked from `zygote` and as a new interpreter: for each, the exit code, stdout, stderr."""
    results = []
    for way in ("forked", "new"):
        stdout, stderr = cwd / f"{way}.out", cwd / f"{way}.err"
        if way == "forked":
            for path in (stdout, stderr):
                path.write_bytes(b"")
            process = zygote.start(command[1:], cwd, env, stdout, stderr, **options)
        else:
            process = start_run(command, cwd, stdout, stderr, env=env, fork=False, **options)
        if then is not None:
            then(process, stdout)
        code = process.wait(timeout=60)
        results.append({"code": code, "stdout": stdout.read_text(), "stderr": stderr.read_text()})
    return results


def report_of(result: dict) -> dict:
    return json.loads(result["stdout"].splitlines()[0])


def test_a_forked_script_sees_what_a_new_interpreter_sees_and_exits_the_same_way(bare_zygote, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**offline_env(), "OPEN_INSTRUCT_DEBUG": "1"}
    forked, new = run_both_ways(bare_zygote, [sys.executable, str(script), "ok", "--flag"], tmp_path, env)
    assert report_of(forked) == report_of(new)
    assert report_of(forked)["argv"] == [str(script), "ok", "--flag"] and report_of(forked)["path0"] == str(tmp_path)
    assert report_of(forked)["env"] == {"PROBE": None, "PYTHONUNBUFFERED": "1", "OPEN_INSTRUCT_DEBUG": "1"}
    assert report_of(forked)["threads"] == 1 and not report_of(forked)["own_process_group"]
    # Interpreter shutdown as a new process's: the non-daemon thread is joined, then the atexit hooks run.
    assert forked["stdout"].splitlines()[1:] == new["stdout"].splitlines()[1:] == [
        "a non-daemon thread finished", "atexit ran"
    ]  # fmt: skip
    assert forked["stderr"] == new["stderr"] == "to stderr\n"
    assert forked["code"] == new["code"] == 0


def test_a_forked_module_is_run_as_python_m_runs_it(bare_zygote, tmp_path):
    (tmp_path / "probe_module.py").write_text(PROBE)
    env = {name: value for name, value in offline_env().items() if name != "PYTHONUNBUFFERED"}  # may differ
    forked, new = run_both_ways(bare_zygote, [sys.executable, "-m", "probe_module", "exit_3"], tmp_path, env)
    assert report_of(forked) == report_of(new)
    assert report_of(forked)["name"] == "__main__" and report_of(forked)["path0"] == str(tmp_path)
    assert report_of(forked)["argv"] == [str(tmp_path / "probe_module.py"), "exit_3"]
    assert report_of(forked)["env"]["PYTHONUNBUFFERED"] is None
    assert forked["code"] == new["code"] == 3


def test_an_uncaught_exception_a_kill_and_a_sigterm_end_a_forked_run_as_a_new_ones(bare_zygote, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    forked, new = run_both_ways(bare_zygote, [sys.executable, str(script), "raise"], tmp_path, offline_env())
    assert forked["code"] == new["code"] == 1
    assert forked["stderr"].splitlines()[-1] == new["stderr"].splitlines()[-1] == "ValueError: boom"

    def once_running(process, stdout: Path):
        deadline = time.time() + 30
        while not stdout.read_text() and time.time() < deadline:
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM if process.args[-1] == "wait" else signal.SIGKILL)

    for sig in (signal.SIGTERM, signal.SIGKILL):
        mode = "wait" if sig == signal.SIGTERM else "wait_for_kill"
        forked, new = run_both_ways(bare_zygote, [sys.executable, str(script), mode], tmp_path, offline_env(),
                                    then=once_running)  # fmt: skip
        assert forked["code"] == new["code"] == -sig


def test_a_forked_run_in_its_own_session_leads_its_process_group(bare_zygote, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    command = [sys.executable, str(script), "ok"]
    forked, new = run_both_ways(bare_zygote, command, tmp_path, offline_env(), start_new_session=True)
    assert report_of(forked)["own_process_group"] and report_of(new)["own_process_group"]


def test_a_retired_zygote_still_reports_the_runs_it_forked_then_ends(tmp_path):
    """What the shared zygote does when the worker's environment changes: a new one takes the next runs."""
    (tmp_path / "slow.py").write_text("import sys, time\ntime.sleep(1)\nsys.exit(5)\n")
    zygote = Zygote(offline_env(), at_start=[], later=[])
    process = zygote.start([str(tmp_path / "slow.py")], tmp_path, offline_env(), tmp_path / "out", tmp_path / "err")
    zygote.close(wait=False)
    assert process.wait(timeout=30) == 5
    zygote.close()  # it has ended: nothing left to wait for


def test_a_run_whose_zygote_was_killed_fails_clearly_once_it_has_ended(tmp_path):
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(1)\n")
    zygote = Zygote(offline_env(), at_start=[], later=[])
    process = zygote.start([str(tmp_path / "slow.py")], tmp_path, offline_env(), tmp_path / "out", tmp_path / "err")
    zygote._process.kill()
    with pytest.raises(RuntimeError, match="the zygote ended .* before it reported how run"):
        process.wait(timeout=30)
    zygote.close()


def test_a_zygote_refuses_a_run_whose_environment_it_cannot_give(bare_zygote, tmp_path):
    with pytest.raises(ValueError, match="PROBE"):
        bare_zygote.start(["probe.py"], tmp_path, {**offline_env(), "PROBE": "1"}, tmp_path / "out", tmp_path / "err")


def test_only_python_commands_whose_environment_libraries_read_at_import_is_the_zygotes_are_forked():
    env = offline_env()
    assert forkable([sys.executable, "-m", "open_instruct.evaluate"], env, env)
    assert forkable([sys.executable, "tests/support/vllm_greedy.py", "x"], env, env)
    assert not forkable([sys.executable, "-c", "print(1)"], env, env)
    assert not forkable(["bash", "scripts/test.sh"], env, env)
    for name in MAY_DIFFER:
        assert forkable([sys.executable, "-m", "x"], {**env, name: "changed"}, env)
    # huggingface_hub reads HF_HUB_OFFLINE and HF_ENDPOINT when imported: a run that changes them needs a new process.
    for changed in ({**env, "HF_HUB_OFFLINE": "0"}, {**env, "HF_ENDPOINT": "http://127.0.0.1:1"}):
        assert not forkable([sys.executable, "-m", "x"], changed, env)


def env_importing_from(folder: Path) -> dict[str, str]:
    env = offline_env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(folder)])
    return env


def test_a_forked_run_prints_first_what_its_start_imports_printed_and_not_what_the_later_ones_did(tmp_path):
    """A new process prints what its entry module's imports print before anything else; a module the trainer imports
    later prints into its logs/libraries.log, which a forked run cannot reproduce: that is dropped."""
    (tmp_path / "says_hello.py").write_text("import sys\nprint('hello')\nprint('warning', file=sys.stderr)\n")
    (tmp_path / "says_later.py").write_text("print('imported later')\n")
    (tmp_path / "run.py").write_text("import says_hello, says_later\nprint('the run')\n")
    env = env_importing_from(tmp_path)
    zygote = Zygote(env, at_start=["says_hello"], later=["says_later"])
    try:
        stdout, stderr = tmp_path / "out", tmp_path / "err"
        process = start_run([sys.executable, str(tmp_path / "run.py")], tmp_path, stdout, stderr, env=env, fork=False)
        assert process.wait(timeout=60) == 0
        assert stdout.read_text() == "hello\nimported later\nthe run\n" and stderr.read_text() == "warning\n"
        for path in (stdout, stderr):
            path.write_bytes(b"")
        assert zygote.start([str(tmp_path / "run.py")], tmp_path, env, stdout, stderr).wait(timeout=60) == 0
        assert stdout.read_text() == "hello\nthe run\n" and stderr.read_text() == "warning\n"
    finally:
        zygote.close()


def test_a_zygote_whose_imports_leave_a_thread_running_refuses_to_fork(tmp_path):
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    zygote = Zygote(env_importing_from(tmp_path), at_start=["starts_a_thread"], later=[])
    try:
        assert not zygote.ready
        assert zygote.why_not == "threads other than the main one after the zygote's imports: ['python']"
    finally:
        zygote.close()
