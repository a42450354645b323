"""What of a learner a checkpoint holds, and how it comes back (run/checkpoint.py writes the folder around it).

PPOLearner inherits these. One process: its `state_dict` in one file, learner.pt. DeepSpeed ranks: each trained
model's own DeepSpeed checkpoint, every rank writing its partition in parallel, and each rank's generators and compute
dtype in rank_<r>.pt. The frozen reference (and reward) model are reloaded from their paths, so the KL reference stays
the run's initial policy.
"""

import dataclasses
import logging
import os

import torch

from open_instruct.run import checkpoint, devices, disk_space

log = logging.getLogger(__name__)


class LearnerState:
    """The checkpoint side of PPOLearner (it provides backend, policy, value_model, the trainers, shuffle_generator
    and compute_dtype)."""

    def checkpoint_bytes(self) -> int:
        """About how many bytes this rank's part of a checkpoint takes (the free-space check before writing)."""
        if not self.backend.saves_engines:
            return disk_space.tensor_bytes(self.state_dict())
        return self.backend.engine_checkpoint_bytes([trainer for _, trainer in self.named_trainers])

    def write_checkpoint(self, folder: str) -> int:
        """This rank's part of checkpoint `folder` (already there); returns the bytes it wrote, fsynced.

        One process: learner.pt, the `state_dict`. DeepSpeed ranks: each trained model's DeepSpeed checkpoint in
        `folder/<role>/` (every rank writes its own partition of the weights, fp32 masters, optimizer state and the
        scheduler, in parallel: a collective) and `rank_<r>.pt`, this rank's generators and compute dtype. Non-finite
        weights are never written."""
        if not self.backend.saves_engines:
            return checkpoint.write_learner_file(folder, self.state_dict())
        written = 0
        for role, trainer in self.named_trainers:
            written += self.backend.save_engine_checkpoint(trainer, os.path.join(folder, role), role)
        rank_file = os.path.join(folder, f"rank_{self.backend.rank}.pt")
        return written + checkpoint.write_torch_file(rank_file, self.rank_state())

    def read_checkpoint(self, folder: str) -> None:
        """Restore what `write_checkpoint` wrote (on DeepSpeed ranks: into engines built as the run built them, so the
        checkpoint's rank count and ZeRO stage must be this run's: checkpoint.check_topology said so before)."""
        if not self.backend.saves_engines:
            path = os.path.join(folder, checkpoint.LEARNER_FILE)
            self.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
            return
        rank_state = torch.load(os.path.join(folder, f"rank_{self.backend.rank}.pt"), weights_only=False)
        self.check_same_algorithm(rank_state["trains_value_model"])
        self.check_same_lora(rank_state)
        for role, trainer in self.named_trainers:
            self.backend.load_engine_checkpoint(trainer, os.path.join(folder, role))
        self.restore_rank_state(rank_state)

    @property
    def named_trainers(self) -> list[tuple[str, object]]:
        """The trained models by the folder name of their part of a checkpoint."""
        return [("policy", self.policy_trainer)] + ([("value_model", self.value_trainer)] if self.value_trainer else [])

    def rank_state(self) -> dict:
        """What of a checkpoint belongs to this rank, not to a model: its generators and the compute dtype."""
        return {
            "shuffle_generator": self.shuffle_generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "compute_dtype": devices.dtype_name(self.compute_dtype),
            "trains_value_model": self.value_model is not None,
            "lora": dataclasses.asdict(self.lora) if self.lora is not None else None,
        }

    def check_same_algorithm(self, checkpoint_has_value_model: bool) -> None:
        if checkpoint_has_value_model != (self.value_model is not None):
            held, wanted = ("a", "no") if checkpoint_has_value_model else ("no", "a")
            raise ValueError(
                f"the checkpoint holds {held} value model but this {type(self).__name__} trains {wanted} value model "
                "(a PPO checkpoint resumed by GRPO, or the reverse); resume with the trainer that wrote it."
            )

    def restore_rank_state(self, state: dict) -> None:
        self.shuffle_generator.set_state(state["shuffle_generator"])
        torch.set_rng_state(state["torch_rng"])
        # `--learner_compute_dtype auto` decides by a timing probe, which a busy machine can tip the other way: a
        # resumed run computes in the dtype the run computed in, so that it goes on as the uninterrupted one would.
        run_dtype = state.get("compute_dtype")  # absent from checkpoints written before it was saved
        if run_dtype is not None and getattr(torch, run_dtype) != self.compute_dtype:
            if self.backend.rank == 0:
                log.info(f"[learner] computing in {run_dtype}, as the run did before this checkpoint "
                         f"(this start alone chose {devices.dtype_name(self.compute_dtype)})")  # fmt: skip
            self.compute_dtype = getattr(torch, run_dtype)

    def state_dict(self) -> dict:
        """Everything of the learner a resumed run needs; the frozen reference (and reward) model are reloaded from
        their original paths instead, so the KL reference stays the run's initial policy (with --beta 0 there is
        none, in the run and in its resumption: --beta must match the checkpoint's). Without a value model (GRPO)
        there is no "value_model" entry, and one optimizer and scheduler."""
        state = {"policy": self.model_state(self.policy)}
        if self.value_model is not None:
            state["value_model"] = self.model_state(self.value_model)
        return {
            **state,
            "optimizers": [trainer.optimizer.state_dict() for trainer in self.trainers],
            "schedulers": [trainer.scheduler.state_dict() for trainer in self.trainers],
            **self.rank_state(),
        }

    def model_state(self, model) -> dict:
        """A trained model's weights for a checkpoint: all of them, or with LoRA the trained ones alone (the adapters,
        a value model's score head); the frozen base is reloaded from its path, as the reference is."""
        hf_model = self.backend.hf_model(model)
        if self.lora is None:
            return hf_model.state_dict()
        return {name: param.detach() for name, param in hf_model.named_parameters() if param.requires_grad}

    def load_model_state(self, model, state: dict) -> None:
        hf_model = self.backend.hf_model(model)
        if self.lora is None:
            hf_model.load_state_dict(state)
            return
        missing, unexpected = hf_model.load_state_dict(state, strict=False)
        trained = {name for name, param in hf_model.named_parameters() if param.requires_grad}
        if unexpected or trained & set(missing):  # check_same_lora compared the settings; this is the tensors' names
            raise ValueError(f"the checkpoint's weights are not this run's adapters ({(unexpected or missing)[0]})")

    def check_same_lora(self, state: dict) -> None:
        """A checkpoint resumes only into a run with its LoRA settings (or, without any, into full fine-tuning)."""
        written = state.get("lora")  # absent from checkpoints written before LoRA: full fine-tuning
        wanted = dataclasses.asdict(self.lora) if self.lora is not None else None
        if written != wanted:
            raise ValueError(
                f"the checkpoint was written with LoRA {written or 'off'} and this run has LoRA {wanted or 'off'} "
                "(--lora_rank, --lora_alpha, --lora_target_modules); resume with the LoRA flags of the run that wrote it."
            )

    def load_state_dict(self, state: dict) -> None:
        self.check_same_algorithm("value_model" in state)
        self.check_same_lora(state)
        self.load_model_state(self.policy, state["policy"])
        if self.value_model is not None:
            self.load_model_state(self.value_model, state["value_model"])
        for trainer, optimizer_state, scheduler_state in zip(self.trainers, state["optimizers"], state["schedulers"]):
            trainer.optimizer.load_state_dict(optimizer_state)
            trainer.scheduler.load_state_dict(scheduler_state)
        self.restore_rank_state(state)
