"""Every backend behind a seam offers the seam's methods with the seam's parameters.

The trainer's loop calls a learner, a generation engine and a scorer without knowing which backend runs them (one
process or Ray learner ranks; an engine in this process or engine actors; the verifiers or scores computed before),
and the learner runs the same code on one process or a DeepSpeed rank (its backend and trainers).
Each seam is a `typing.Protocol` (generation/seams.py, learner/seams.py, rewards/manager.Scorer); here each implementation
is held to it member by member: a method must be a method with the same parameters (names, kinds, defaults), a
property a property, an attribute present on the class or set in its `__init__`. `isinstance` on a runtime-checkable
Protocol would only look at the names.
"""

import ast
import dataclasses
import inspect
import textwrap

import pytest

from open_instruct.generation.engine_actors import EngineGroup
from open_instruct.generation.generation_thread import InProcessEngine
from open_instruct.generation.seams import BroadcastsWeights, Engine, HandsOutWeights
from open_instruct.learner.algorithms import LEARNERS
from open_instruct.learner.deepspeed_backend import DeepSpeedBackend, DeepSpeedTrainer
from open_instruct.learner.ppo import PPOLearner
from open_instruct.learner.ray_group import LearnerGroup
from open_instruct.learner.seams import EngineCheckpoints, Learner, LearnerBackend, ModelTrainer
from open_instruct.learner.single_process import AdamWTrainer, SingleProcess
from open_instruct.rewards.manager import PrecomputedScores, RewardManager, Scorer, VerifiedScores
from open_instruct.run.args import ALGORITHM_DEFAULTS, PPOArgs

IMPLEMENTATIONS = [
    (Engine, InProcessEngine),
    (Engine, EngineGroup),
    *[(Learner, learner) for learner in LEARNERS.values()],  # every --algorithm's learner class
    (Learner, LearnerGroup),
    (BroadcastsWeights, LearnerGroup),
    (LearnerBackend, SingleProcess),
    (EngineCheckpoints, DeepSpeedBackend),
    (ModelTrainer, AdamWTrainer),
    (ModelTrainer, DeepSpeedTrainer),
    (Scorer, RewardManager),
    (Scorer, PrecomputedScores),
    (Scorer, VerifiedScores),
]
SEAMS = [Engine, HandsOutWeights, BroadcastsWeights, Learner, LearnerBackend, EngineCheckpoints, ModelTrainer, Scorer]
ATTRIBUTE = "attribute"


def seam_members(protocol: type) -> dict[str, object]:
    """The members a Protocol declares, its Protocol bases' included: name -> function, property, or ATTRIBUTE."""
    members: dict[str, object] = {}
    for base in reversed(protocol.__mro__):
        if not getattr(base, "_is_protocol", False) or base.__module__ == "typing":
            continue
        members.update({name: ATTRIBUTE for name in base.__dict__.get("__annotations__", {})})
        members.update({name: value for name, value in vars(base).items()
                        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))})  # fmt: skip
    return members


def parameters(function) -> list[tuple]:
    """What a caller relies on: each parameter's name, kind and default (annotations may name a backend's own type)."""
    return [(p.name, p.kind.description, p.default) for p in inspect.signature(function).parameters.values()]


def set_in_init(cls: type) -> set[str]:
    """The attributes `self.x = ...` of the `__init__` of `cls` and its bases."""
    names = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if not inspect.isfunction(init):
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(init)))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []  # fmt: skip
            for target in targets:
                for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name) and element.value.id == "self":
                        names.add(element.attr)
    return names


def seam_problems(protocol: type, cls: type) -> list[str]:
    """How `cls` differs from the seam `protocol`: one line per member missing or different."""
    problems = []
    for name, declared in seam_members(protocol).items():
        found = inspect.getattr_static(cls, name, None)
        if declared is ATTRIBUTE:
            if found is None and name not in set_in_init(cls):
                problems.append(f"{cls.__name__}.{name}: missing (the seam declares an attribute)")
        elif isinstance(declared, property):
            if not isinstance(found, property):
                problems.append(f"{cls.__name__}.{name}: not a property, as {protocol.__name__} declares it")
        elif not inspect.isfunction(found):
            problems.append(f"{cls.__name__}.{name}: not a method, as {protocol.__name__} declares it")
        elif parameters(found) != parameters(declared):
            problems.append(f"{cls.__name__}.{name}{inspect.signature(found)}: the seam's parameters are "
                            f"{inspect.signature(declared)}")  # fmt: skip
    return problems


@pytest.mark.parametrize("protocol, cls", IMPLEMENTATIONS, ids=[f"{p.__name__}-{c.__name__}" for p, c in IMPLEMENTATIONS])
def test_every_backend_offers_its_seams_methods(protocol, cls):
    assert seam_problems(protocol, cls) == []


def test_every_seam_has_its_members_and_an_implementation():
    implemented = {protocol for protocol, _ in IMPLEMENTATIONS}
    for seam in SEAMS:
        assert seam_members(seam), f"{seam.__name__} declares nothing"
        assert any(seam in p.__mro__ for p in implemented), f"{seam.__name__}: no backend"
    assert {"weights_for_engine", "make_experience", "train", "save", "lr", "shutdown"} <= set(seam_members(Learner))


def test_the_check_sees_a_backend_that_drifted():
    """A learner whose `train` renamed its parameter, whose `save` lost a default, whose `lr` is a method and which
    has no `shutdown`: each one is named."""

    class DriftedLearner(PPOLearner):
        def train(self, batch):
            return {}

        def save(self, output_dir, extra_files):
            return None

        def lr(self):
            return 0.0

        shutdown = None

    problems = seam_problems(Learner, DriftedLearner)
    assert [line.split(":")[0].split("(")[0] for line in problems] == [
        "DriftedLearner.lr", "DriftedLearner.train", "DriftedLearner.save", "DriftedLearner.shutdown",
    ]  # fmt: skip
    assert "DriftedLearner.train(self, batch): the seam's parameters are (self, experience: object)" in problems[1]

    class EngineWithoutRestarts:
        regroup_pending = False

        def __init__(self):
            self.num_workers = 1

    missing = {line.split(":")[0] for line in seam_problems(Engine, EngineWithoutRestarts)}
    assert "EngineWithoutRestarts.restarts" in missing and "EngineWithoutRestarts.num_workers" not in missing


def test_every_algorithm_has_a_learner_and_its_defaults():
    """--algorithm's choices (run/args.py, which may not import the learner layer), the learner classes that run them
    (learner/algorithms.LEARNERS, each held to the Learner seam above) and their flag defaults name the same ones."""
    choices = next(f for f in dataclasses.fields(PPOArgs) if f.name == "algorithm").metadata["choices"]
    assert set(choices) == set(LEARNERS) == set(ALGORITHM_DEFAULTS)
