"""Shared fixtures (the embedded model folders and data, built once per machine and cached; the eval prompts; the
Ray cluster) and the tiers: tests/README.md says which marker means what and which command runs which tier."""

import contextlib
import json
import os
import warnings
from pathlib import Path

import pytest

from tests.support import forked_runs
from tests.support.worker_turns import FileTurnScheduling, file_kind, turn, worker_file_order, write_file_kinds

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray's workers (learner ranks, engine actors) at the priority of every other process, as the trainer's own clusters
# run them (open_instruct/run/cluster.py): at Ray's default nice 15, a Ray file's ranks beside a heavy file on the other
# worker got a few percent of a core and took 2.1x their time (tests/README.md, "Two workers").
os.environ.setdefault("RAY_worker_niceness", "0")
# Every process the tests start (trainer runs, Ray's nodes and their workers, spawned ranks, scripts) imports this
# checkout's open_instruct. Without it a trainer started from a test's temporary folder imports the one the venv's
# editable install points at: for a second checkout sharing a venv (OPEN_INSTRUCT_VENV), the other checkout's code.
CHECKOUT = str(Path(__file__).resolve().parent.parent)
if os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] != CHECKOUT:
    os.environ["PYTHONPATH"] = os.pathsep.join([CHECKOUT, *filter(None, [os.environ.get("PYTHONPATH")])])
# The runs the tests start get this environment, not what in-process tests add to the worker's later
# (tests/support/forked_runs.py, `offline_env`).
forked_runs.remember_starting_environment()


# ---- Two workers: scripts/test.sh runs pytest-xdist, a file per worker at a time (--dist loadfile) -----------------
# What runs beside what, in which order, on how many threads: tests/support/worker_turns.py.


FILE_KINDS = pytest.StashKey[dict]()


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: the kinds and the order are the selected tests'
def pytest_collection_modifyitems(config, items):
    """Under workers, each file's kind (for machine_turn, and in the run's folder for the controller's scheduler),
    and the files in worker_file_order (scripts/test.sh passes --no-loadscope-reorder: xdist's own order is by number
    of tests). One process: pytest's order."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    config.stash[FILE_KINDS] = {file: file_kind(file_items) for file, file_items in by_file.items()}
    write_file_kinds(Path(config.option.basetemp).parent, config.stash[FILE_KINDS])  # xdist: <run folder>/gwN
    items[:] = [item for file in worker_file_order(config.stash[FILE_KINDS]) for item in by_file[file]]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with the next file chosen by what the other worker holds (worker_turns.FileTurnScheduling)."""
    if config.getvalue("dist") == "loadfile":
        return FileTurnScheduling(config, log)
    return None


@pytest.fixture(scope="module", autouse=True)
def machine_turn(request, tmp_path_factory):
    """Under workers, a file waits for its turn on the machine by its kind (tests/support/worker_turns.py)."""
    if "PYTEST_XDIST_TESTRUNUID" not in os.environ:  # one process: nothing runs beside this file
        yield
        return
    kind = request.config.stash[FILE_KINDS][request.node.nodeid.split("::")[0]]
    with turn(tmp_path_factory.getbasetemp().parent, kind):  # the workers' temporary folders are in one per run
        yield


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from open_instruct.data.embedded import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    from open_instruct.data.embedded import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def arithmetic_data_dir() -> str:
    from open_instruct.data.embedded import arithmetic_data_path

    return arithmetic_data_path()


@pytest.fixture(scope="session")
def varied_length_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model with a random, large embedding for its EOS token (tied to the LM head), so that its responses
    stop at varied lengths (measured: 3..16 tokens of 16, half at the limit), as a real model's do. The tiny model's
    own EOS row is zero, so every response runs to the limit and a batch never has a long tail."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("varied_length_model")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    embedding = model.get_input_embeddings().weight
    with torch.no_grad():
        embedding[tokenizer.eos_token_id] = 2.0 * torch.randn(
            embedding.shape[1], generator=torch.Generator().manual_seed(0)
        )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def eval_file(tmp_path_factory) -> Path:
    """A handful of arithmetic eval prompts (tests/support/trainer_runs.py's EVAL_QUESTIONS) as a dataset file."""
    # Imported here, not at the top: test_worker_turns' fake suites import this module and need none of it.
    from tests.support.trainer_runs import EVAL_QUESTIONS

    path = tmp_path_factory.mktemp("data") / "eval.jsonl"
    with open(path, "w") as f:
        for a, b in EVAL_QUESTIONS:
            question = f"What is {a} + {b}? Give the final answer as a number at the end."
            messages = [{"role": "user", "content": question}]
            f.write(json.dumps({"messages": messages, "ground_truth": str(a + b), "dataset": "arithmetic"}) + "\n")
    return path


# ---- Ray ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster(request):
    """Two Ray nodes on this machine with the test process connected as a driver, for one module: a module that
    kills actors or leaves placement groups leaves nothing to the next. Logical CPUs per node: the module's
    RAY_CPUS_PER_NODE (default 3: 2 engines beside 2 learners or a trainer's actors; the learner modules take 1). The
    nodes' Python workers are forked from a worker zygote (tests/support/ray_zygote.py) unless OPEN_INSTRUCT_TEST_FORK=0."""
    import ray
    from ray.cluster_utils import Cluster

    from tests.support.forked_runs import fork_enabled
    from tests.support.ray_zygote import RayWorkerZygote

    cpus = getattr(request.module, "RAY_CPUS_PER_NODE", 3)
    zygote = RayWorkerZygote(dict(os.environ)) if fork_enabled() else None
    if zygote is not None and not zygote.ready:
        warnings.warn(
            f"the Ray workers start as new interpreters: the worker zygote refused ({zygote.why_not})", stacklevel=2
        )
    node_args = {"num_cpus": cpus, **(zygote.node_args() if zygote is not None else {})}
    with zygote.raylet_environment() if zygote is not None else contextlib.nullcontext():
        cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
        cluster.add_node(**node_args)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    if zygote is not None:
        zygote.close()

