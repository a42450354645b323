"""A stand-in engine for the generation thread's schedule tests: each batch's one response has a scripted length and
every engine step adds one token to every unfinished response, tagged with the version of the weights the engine
holds, as EngineBatches does. `start_requests` starts the real GenerationThread on it with the learner's real
RolloutRequests (tests/test_async_schedule.py, test_preemption.py, test_reward_failures.py).
"""

import datasets
import torch

from open_instruct.data.batches import ShufflingIterator
from open_instruct.generation.generation_thread import GenerationSettings, GenerationThread
from open_instruct.generation.rollout_requests import RolloutRequests
from open_instruct.generation.vllm_engine import Completion, EngineConfig


class ScriptedEngine:
    """Batches of one response each, of `lengths[batch_id]` tokens; every step adds a token, tagged with the current
    version, to every unfinished response of every batch in the engine."""

    regroup_pending = False

    def __init__(self, lengths: dict[int, int]):
        self.lengths, self.version, self.batches = lengths, 0, {}
        self.loads: list[tuple[int, list]] = []  # (version loaded, the batches in the engine then)

    def wait_until_ready(self) -> None:
        pass

    def admit(self, batch_id, prompt_token_ids, params, sampling_seed, rows=None) -> None:
        self.batches[batch_id] = []

    def step(self) -> None:
        for batch_id, versions in self.batches.items():
            if len(versions) < self.lengths[batch_id]:
                versions.append(self.version)

    def run_until_complete(self, batch_id, between_steps=None) -> list[Completion]:
        while len(self.batches[batch_id]) < self.lengths[batch_id]:
            if between_steps is not None:
                between_steps()
            self.step()
        versions = self.batches.pop(batch_id)
        return [Completion(0, list(range(len(versions))), "", "stop", [0.0] * len(versions), versions)]

    def load_weights(self, named_tensors, policy_version: int) -> float:
        self.loads.append((policy_version, sorted(self.batches)))
        self.version = policy_version
        return 0.0

    def restart_metrics(self) -> dict:
        return {}

    def batch_metrics(self, batch_id) -> dict:
        return {}

    def shutdown(self) -> None:
        pass


class InstantLearner:
    def weights_for_engine(self, slot=None):
        return [("weight", torch.zeros(1))]


class Tokenizer:
    def decode(self, ids):
        return " ".join(map(str, ids))


def start_requests(engine, async_steps: int, batches_in_engine: int = 1) -> tuple[GenerationThread, RolloutRequests]:
    """A generation thread started on `engine`, and the learner's requests to it: one prompt each, of 50."""
    settings = GenerationSettings(EngineConfig("unused", max_model_len=64), samples_per_prompt=1, temperature=1.0,
                                  response_length=16, stop_token_ids=[], stop_strings=None,
                                  batches_in_engine=batches_in_engine)  # fmt: skip
    thread = GenerationThread(settings, poll_s=0.01, timeout_s=20.0, engine=engine)
    thread.start()
    dataset = datasets.Dataset.from_dict(
        {"input_ids_prompt": [[i] for i in range(50)], "ground_truth": ["0"] * 50, "dataset": ["arithmetic"] * 50}
    )
    requests = RolloutRequests(thread, InstantLearner(), dataset, Tokenizer(), ShufflingIterator(50, 1, 0), None, 0, 0,
                               sync_timeout_s=20, broadcast=False, async_steps=async_steps)  # fmt: skip
    return thread, requests
