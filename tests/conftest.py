"""Shared fixtures (the embedded model folders and data, built once per machine and cached; the eval prompts; the
Ray cluster) and the tiers: tests/README.md says which marker means what and which command runs which tier."""

import fcntl
import json
import os
from pathlib import Path

import pytest

from tests.support.trainer_runs import EVAL_QUESTIONS

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


# ---- Two workers: scripts/test.sh runs pytest-xdist, a file per worker at a time (--dist loadfile) -----------------

@pytest.fixture(scope="module", autouse=True)
def machine_turn(request, tmp_path_factory):
    """A file with a Ray test has the machine to itself; other files run two at a time (one per worker). Two Ray
    clusters at once, or the two-node cluster beside a trainer run, ran the 24 GiB machine into Ray's memory monitor
    in two of the first three two-worker suite runs (it kills engine and learner workers at 95% of the node's memory:
    7 and 4 tests failed); every other pair of files fitted. A readers-writer lock over the module: other files
    hold it shared, a Ray file exclusive; a turnstile makes new readers wait behind a waiting writer."""
    if "PYTEST_XDIST_TESTRUNUID" not in os.environ:  # one process: nothing runs beside this file
        yield
        return
    selected = request.session.items  # after -m and -k: a Ray file's other tests (the fast tier) need no turn alone
    alone = any(item.path == request.node.path and item.get_closest_marker("ray") for item in selected)
    run_folder = tmp_path_factory.getbasetemp().parent  # the workers' temporary folders are in one per pytest run
    turnstile, machine = open(run_folder / "turnstile.lock", "w"), open(run_folder / "machine.lock", "w")
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    if alone:
        fcntl.flock(machine, fcntl.LOCK_EX)  # waits for the other worker's file to end; new files wait at the turnstile
        fcntl.flock(turnstile, fcntl.LOCK_UN)
    else:
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(machine, fcntl.LOCK_SH)
    try:
        yield
    finally:
        fcntl.flock(machine, fcntl.LOCK_UN)
        machine.close()
        turnstile.close()


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
        embedding[tokenizer.eos_token_id] = 2.0 * torch.randn(embedding.shape[1], generator=torch.Generator().manual_seed(0))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def eval_file(tmp_path_factory) -> Path:
    """A handful of arithmetic eval prompts (tests/support/trainer_runs.py's EVAL_QUESTIONS) as a dataset file."""
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
    RAY_CPUS_PER_NODE (default 3: 2 engines beside 2 learners or a trainer's actors; the learner modules take 1)."""
    import ray
    from ray.cluster_utils import Cluster

    cpus = getattr(request.module, "RAY_CPUS_PER_NODE", 3)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "include_dashboard": False})
    cluster.add_node(num_cpus=cpus)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
