"""Run the PPO trainer with one fault injected; everything else, the vLLM engine included, is real.

    python tests/support/inject_fault.py FAULT [trainer flags ...]

Faults:
- `generation_crash`: the second time the generation thread runs a batch to its end (`EngineBatches.run_until_complete`)
  it raises RuntimeError("injected generation failure").
- `generation_stalls`: the second time the generation thread runs a batch to its end it never gets there: it keeps
  calling the thread's `between_steps` (so it still takes the learner's requests and stops when told to) without
  ever stepping the engine, as an engine too slow to finish in time would. It says so on the console (`STALL_MESSAGE`).
- `skip_weight_sync`: `vllm_engine.load_weights` returns without loading anything, so the engine keeps
  generating with its start weights while the learner moves on.
- `nan_loss`: the third call of `rl.policy_loss` (made by the learner) returns a NaN loss, still attached to
  the graph, so backward sends NaN into every gradient.
- `learner_rank_dies_in_checkpoint`: Ray learner rank 1 dies (os._exit) in the middle of writing the checkpoint of
  step 4: after its share of the policy's DeepSpeed checkpoint, before the value model's and its own file.
- `engine_1_dies` (engine actors): vLLM engine 1's process exits (os._exit) in the middle of its second batch
  (`run_until_complete`), once per run (a replacement of engine 1 does not die again).

tests/test_ppo_trainer.py and tests/test_resume.py check that each ends the run (or, for `nan_loss` with
--skip_nonfinite_updates, skips that one update) with its cause, without hanging, and that nothing bad reaches disk;
tests/test_never_lose_a_run.py that a SIGTERM during `generation_stalls` still leaves a checkpoint that resumes.
"""

import os
import sys
import time

from open_instruct import ppo_vllm_thread_ray_gtrl, rl
from open_instruct.generation import vllm_engine
from open_instruct.generation.engine_batches import EngineBatches
from open_instruct.run import console
from open_instruct.run.console import say

INJECTED_MESSAGE = "injected generation failure"
FAIL_ON_CALL = 2

real_run_until_complete = EngineBatches.run_until_complete
calls = 0


def run_until_complete_then_fail(self, *args, **kwargs):
    global calls
    calls += 1
    if calls == FAIL_ON_CALL:
        raise RuntimeError(INJECTED_MESSAGE)
    return real_run_until_complete(self, *args, **kwargs)


STALL_MESSAGE = "[inject_fault] the generation stalls"


def run_until_complete_then_stall(self, batch_id, between_steps=None):
    global calls
    calls += 1
    if calls == FAIL_ON_CALL:
        say(STALL_MESSAGE, error=True)  # on the console: the trainer sends fds 1 and 2 to logs/libraries.log
        while True:
            between_steps()
            time.sleep(0.05)
    return real_run_until_complete(self, batch_id, between_steps)


def load_nothing(llm, named_tensors) -> float:
    return 1e-3  # a plausible sync time, so nothing but the weights themselves gives the skip away


real_policy_loss = rl.policy_loss
NAN_ON_CALL = 3
policy_loss_calls = 0


def policy_loss_with_one_nan(*args, **kwargs):
    global policy_loss_calls
    policy_loss_calls += 1
    pg_loss, *rest = real_policy_loss(*args, **kwargs)
    if policy_loss_calls == NAN_ON_CALL:
        pg_loss = pg_loss * float("nan")
    return (pg_loss, *rest)


def learner_rank_dying_in_checkpoint():
    from open_instruct.learner import ray_group

    class RankDyingInCheckpoint(ray_group.LearnerRank):  # defined in __main__: Ray ships the class itself to the actor
        def write_checkpoint(self, folder: str) -> int:
            if self.rank == 1 and os.path.basename(folder).startswith(".step_4-"):
                backend = self.learner.backend
                backend.save_engine_checkpoint(self.learner.policy_trainer, os.path.join(folder, "policy"), "policy")
                os._exit(1)
            return super().write_checkpoint(folder)

    return RankDyingInCheckpoint


def engine_1_dies() -> None:
    """Engine actors are created from a subclass that lets engine 1 die in its second batch. Ray ships a class
    defined here (in __main__) to the actor by value; the marker file makes the death happen once per run."""
    import os
    import tempfile

    from open_instruct.generation import engine_actors

    marker = os.path.join(tempfile.mkdtemp(prefix="engine_1_died_"), "died")

    class EngineThatDiesOnce(engine_actors.EngineActor):
        batches_run = 0

        def run_until_complete(self, *args, **kwargs):
            self.batches_run += 1
            if self.index == 1 and self.batches_run == 2 and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)  # no Python clean-up: as a crash or a kill -9 of the engine's process
            return super().run_until_complete(*args, **kwargs)

    class EngineGroupWithADyingEngine(engine_actors.EngineGroup):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, actor_class=EngineThatDiesOnce, **kwargs)

    engine_actors.EngineGroup = EngineGroupWithADyingEngine  # start_engine_actors looks it up at each call


FAULTS = {
    "generation_crash": (EngineBatches, "run_until_complete", run_until_complete_then_fail),
    "generation_stalls": (EngineBatches, "run_until_complete", run_until_complete_then_stall),
    "skip_weight_sync": (vllm_engine, "load_weights", load_nothing),
    "nan_loss": (rl, "policy_loss", policy_loss_with_one_nan),
}

if __name__ == "__main__":
    if sys.argv[1] == "engine_1_dies":
        engine_1_dies()  # imports ray: only for the fault that needs it
    elif sys.argv[1] == "learner_rank_dies_in_checkpoint":
        from open_instruct.learner import ray_group

        ray_group.LearnerRank = learner_rank_dying_in_checkpoint()  # LearnerGroup looks it up at each call
    else:
        module, name, replacement = FAULTS[sys.argv[1]]
        setattr(module, name, replacement)  # callers look it up on the module at each call
    console.exit_without_teardown(lambda: ppo_vllm_thread_ray_gtrl.cli(sys.argv[2:]))
