"""What the engine actors do when one dies: end the run naming it, or (--max_engine_restarts K, with 2+ engines)
replace it.

An engine that dies while it generates or waits between batches is replaced. Its slice of the batch is generated
again at once by a surviving engine, with the dead engine's seed (`sampling_seed + i`) and the same weights, so the
batch is the very one it would have given (each request is seeded from it, engine_batches.request_seed, whatever
engine runs it: bit for bit; tests/test_engine_actors.py checks it). A new actor for the dead one's index loads
meanwhile in its place (same config, same placement bundle); until it has loaded, its slices go to the survivors, and
nobody waits for it. At each weight sync, once every engine has said it is ready, the engines that hold the weights,
and a replacement that has loaded, form a new weight group with learner rank 0 (`regroup`, on a new rendezvous port;
the old group is dropped), and the transfer gives the replacement the current weights, checked by the same checksums.
A death during a weight transfer, a replacement that fails to load, or a death with no restart (or no surviving
engine) left ends the run as before.
"""

import dataclasses
import logging
import threading
import time

import ray
from ray.exceptions import RayError

from open_instruct.generation.weight_transfer import join_transfer
from open_instruct.run.cluster import ActorDied, first_line

log = logging.getLogger(__name__)


class EngineFailed(RuntimeError):
    """An engine actor died, raised, or did not answer in time; the message names it and says why."""


class EngineDied(EngineFailed, ActorDied):
    """An engine actor's process is gone (`position`: its call among those waited on); with restarts left, replaced."""


@dataclasses.dataclass
class Replacement:
    """A new actor for a dead engine's index, loading (or loaded) until it joins the weight group."""

    actor: object
    loaded: object  # ObjectRef of its `where()`, answered once its engine has loaded
    died_at: float  # when the death was seen: the restart's seconds run from here to the replacement holding weights
    restart: int  # 1..--max_engine_restarts


def describe_where(where: dict) -> str:
    gpus = f", GPU {','.join(map(str, where['gpu_ids']))}" if where["gpu_ids"] else ""
    return f"pid {where['pid']} on node {where['node_id'][:12]}{gpus}"


class EngineRestarts:
    """The restart side of engine_actors.EngineGroup (it provides `actors`, `names`, `_create_actor`, `transfer`,
    `num_workers` and `policy_version`)."""

    def __init__(self, num_engines: int, max_restarts: int):
        """`serving[i]`: engine i holds the current weights and generates its own slice; `members`: the engines whose
        workers are in the weight group (or join it at the next sync), in rank order."""
        self.max_restarts, self.restarts = max_restarts, 0
        self.serving = [True] * num_engines
        self.members = list(range(num_engines))
        self.replacements: dict[int, Replacement] = {}
        self.joining: list[int] = []  # loaded replacements that join the group at this sync
        self.regroup_pending = False  # set by the generation thread; the learner side re-forms the group (`regroup`)
        self.regrouped = threading.Event()
        self.regroup_error: BaseException | None = None
        self.restart_seconds: list[float] = []  # restarts completed since the last `restart_metrics()`

    def restart_metrics(self) -> dict[str, float]:
        """For the learner's metrics: the restarts so far, and the seconds of one completed since the last call."""
        metrics = {"engine/restarts": float(self.restarts)}
        if self.restart_seconds:
            metrics["time/engine_restart"] = max(self.restart_seconds)
            self.restart_seconds = []
        return metrics

    def _lose(self, index: int, death: EngineDied) -> None:
        """Engine `index` is dead: replace it if a restart and a surviving engine are left, else end the run."""
        if self.max_restarts == 0:
            raise death  # today's behaviour: the run ends naming the engine
        if self.restarts >= self.max_restarts:
            raise EngineFailed(f"{death}; no engine restart left (--max_engine_restarts {self.max_restarts} used up)")
        self.serving[index] = False
        if not any(self.serving):
            raise EngineFailed(f"{death}; no engine is left to generate its prompts until its replacement loads")
        self.restarts += 1
        ray.kill(self.actors[index], no_restart=True)  # gone already, or lost to Ray: either way, free its bundle
        replacement = self._create_actor(index)
        self.replacements[index] = Replacement(replacement, replacement.where.remote(), time.time(), self.restarts)

    def _replacement_line(self, index: int) -> str:
        return (f"a replacement is loading (restart {self.replacements[index].restart} of {self.max_restarts}); "
                "the other engines take its prompts until it joins")  # fmt: skip

    def _rerun_lost_slices(self, batch: dict, refs: list, death: EngineDied) -> None:
        """An engine died while it generated `batch`: its slices start again on survivors (their calls into `refs`),
        with its seed; the other engines' calls go on."""
        runs_on = batch["runs_on"]
        dead = runs_on[death.position]
        self._lose(dead, death)
        lost = [i for i in range(len(runs_on)) if runs_on[i] == dead]
        for i in lost:
            refs[i] = self._stand_in_for(batch, i)
        count = sum(len(batch["prompts"][i]) for i in lost)
        took_over = ", ".join(sorted({self.names[runs_on[i]] for i in lost}))
        log.info(f"[vllm] {death}; its {count} prompt(s) are generated again on {took_over} with its seed; "
                 f"{self._replacement_line(dead)}")  # fmt: skip

    def _stand_in_for(self, batch: dict, i: int):
        """Slice i generated alone, with its seed, by the serving engine with the fewest slices of this batch."""
        runs_on = batch["runs_on"]
        runs_on[i] = None
        serving = [index for index in range(len(self.actors)) if self.serving[index]]
        runs_on[i] = min(serving, key=lambda index: (runs_on.count(index), index))
        return self.actors[runs_on[i]].generate.remote(batch["prompts"][i], batch["seeds"][i], batch["params"],
                                                       batch["rows"][i])  # fmt: skip

    def _take_in_loaded_replacements(self) -> None:
        """A replacement that has loaded takes its engine's place (it joins the weight group at this sync); if the
        engines of the weight group change, the learner re-forms it (`regroup_pending`) before learner rank 0 sends."""
        for index, replacement in self.replacements.items():
            if index in self.joining or not ray.wait([replacement.loaded], timeout=0)[0]:
                continue
            try:
                where = ray.get(replacement.loaded)
            except RayError as error:
                raise EngineFailed(f"the replacement of {self.names[index]} failed to load: {first_line(error)}") from None
            log.info(f"[vllm] {self.names[index]} (replacement {replacement.restart}): {describe_where(where)}, loaded "
                     f"{time.time() - replacement.died_at:.1f}s after the death; it joins at this weight sync")  # fmt: skip
            self.actors[index] = replacement.actor
            self.joining.append(index)
        members = sorted([index for index in range(len(self.actors)) if self.serving[index]] + self.joining)
        if members != self.members:
            self.members, self.regroup_pending, self.regroup_error = members, True, None
            self.regrouped.clear()

    def _wait_for_regroup(self) -> None:
        """Before the engines receive after a change of engines: the learner's `regroup` comes first."""
        if not self.regroup_pending:
            return
        if not self.regrouped.wait(self.sync_timeout_s):
            raise EngineFailed(f"the learner did not re-form the weight group within {self.sync_timeout_s:.0f}s; "
                               "raise --vllm_sync_timeout_s if it is that slow")  # fmt: skip
        if self.regroup_error is not None:
            raise EngineFailed(f"re-forming the weight group failed: {first_line(self.regroup_error)}")
        self.regroup_pending = False

    def _welcome_back(self, policy_version: int) -> None:
        """The replacements that joined the weight group hold the current weights now (checked by the learner, as
        every engine's): they serve again."""
        for index in self.joining:
            replacement = self.replacements.pop(index)
            seconds = time.time() - replacement.died_at
            self.serving[index] = True
            self.restart_seconds.append(seconds)
            log.info(f"[vllm] {self.names[index]} is back: its replacement joined the weight group and received policy "
                     f"version {policy_version}, {seconds:.1f}s after the death (restart {replacement.restart} of "
                     f"{self.max_restarts})")  # fmt: skip
        self.joining = []

    def regroup(self, learner) -> None:
        """The learner's side of a change of engines (main thread, after the engines said they are ready and before
        learner rank 0 sends): the same transfer over a new group of learner rank 0 and the `members`' workers."""
        started = time.time()
        try:
            host, port = learner.weight_group_address()  # a new rendezvous port: the old group's may still be bound
            transfer = dataclasses.replace(self.transfer, host=host, port=port, world_size=1 + self.num_workers)
            join_transfer(learner, self, transfer)
        except BaseException as error:
            self.regroup_error = error
            raise
        finally:
            self.regrouped.set()  # the generation thread waits for it before it receives
        log.info(f"[vllm] weight group re-formed: learner rank 0 + {', '.join(self.names[i] for i in self.members)} "
                 f"({time.time() - started:.1f}s)")
