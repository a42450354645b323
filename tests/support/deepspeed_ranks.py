"""Two DeepSpeed learner ranks started here and joined over gloo on 127.0.0.1, without Ray."""

import multiprocessing
import socket

import torch
import torch.multiprocessing as mp

from tests.support.learner_steps import EQUIVALENCE_FLAGS


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What every rank imports, imported once per pytest worker by its fork server: each pair of ranks is forked from it,
# fresh processes that skip the imports (spawned, each rank took ~8 CPU-s to import them, 26 ranks in the suite).
RANK_PRELOAD = ["torch", "deepspeed", "transformers", "peft", "open_instruct.learner.ppo",
                "open_instruct.learner.deepspeed_backend", "tests.support.learner_steps"]  # fmt: skip


def run_two_ranks(fn, *args) -> dict:
    """fn(rank, port, results, *args) on 2 new rank processes (forked from a fork server that holds RANK_PRELOAD);
    returns what each rank put in `results`."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(RANK_PRELOAD)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(fn, args=(free_port(), results, *args), nprocs=2, join=True, start_method="forkserver")
        return dict(results)


def learner_on_rank(rank: int, port: int, model_dir: str, stage: int, *flags: str):
    """A PPOLearner on this spawned rank's DeepSpeed backend, as LearnerRank.setup builds it (without Ray)."""
    from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
    from open_instruct.learner import deepspeed_backend
    from open_instruct.learner.ppo import PPOLearner
    from open_instruct.run.args import compute_batch_sizes, parse_args

    deepspeed_backend.init_process_group(rank, 2, "127.0.0.1", port, 120)
    args = parse_args(["--model_name_or_path", model_dir, *EQUIVALENCE_FLAGS, "--num_learners_per_node", "1", "1",
                       "--deepspeed_stage", str(stage), *flags])  # fmt: skip
    backend = deepspeed_backend.DeepSpeedBackend(
        stage, args.ppo.per_device_train_batch_size, False,
        deepspeed_backend.weights_dtype(args.dist.deepspeed_weights_dtype, args.model.learner_compute_dtype),
    )  # fmt: skip
    torch.manual_seed(args.run.seed)
    tokenizer = load_tokenizer(model_dir)
    return PPOLearner(args, compute_batch_sizes(args), tokenizer, model_dir, stop_token_ids_for(tokenizer, "eos"),
                      backend=backend), tokenizer  # fmt: skip


def recorded_rank_gradients(learner) -> list[dict[str, torch.Tensor]]:
    """What `learner_steps.recorded_gradients` gives for one process, on a DeepSpeed rank: the gradients each optimizer
    step receives (summed over micro-batches and ranks, before clipping), one dict per model and step. Read at each
    minibatch's end, after its last backward and before DeepSpeed's step applies them; every rank must call it (the
    reads are collectives: ZeRO holds each rank's partition of the gradients)."""
    from deepspeed.utils import safe_get_full_grad

    steps = []
    for role, trainer in zip(("policy", "value"), learner.trainers):
        engine = trainer.engine

        def recording_step(*args, engine=engine, role=role, step=engine.step, **kwargs):
            if engine.is_gradient_accumulation_boundary():
                steps.append({f"{role}:{name}": safe_get_full_grad(param).detach().cpu().clone()
                              for name, param in engine.module.named_parameters() if param.requires_grad})  # fmt: skip
            return step(*args, **kwargs)

        engine.step = recording_step
    return steps
