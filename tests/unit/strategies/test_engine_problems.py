"""The generation engine's limits come from its capabilities, never from its name: a
registered engine that cannot match stop strings is refused with them, one that needs a
missing extra is refused, before a run here, naming it and what is installed (a training
backend's too)."""

import pytest

from rlhf_async.config import GenerationConfig, JobConfig, TrainConfig
from rlhf_async.engines import (
    ENGINES,
    TRAINING_BACKENDS,
    Backend,
    Capabilities,
    Engine,
    extra_problems,
)
from rlhf_async.strategies.registry import engine_problems


class NoStopStrings:
    capabilities = Capabilities(keep_on_update=True, stop_strings=False, prefix_cache=False,
                                tensor_parallel=False)


@pytest.fixture
def engines(monkeypatch):
    monkeypatch.setitem(ENGINES, "plain", Engine(f"{__name__}:NoStopStrings"))
    monkeypatch.setitem(ENGINES, "absent", Engine(f"{__name__}:NoStopStrings",
                                                  "no_such_package_here"))
    monkeypatch.setitem(TRAINING_BACKENDS, "absent", Backend("nowhere:Backend",
                                                             "no_such_trainer_here"))


def _cfg(backend: str, stops: tuple[str, ...] = (), train: str = "torch") -> JobConfig:
    return JobConfig(generation=GenerationConfig(backend=backend, stop_strings=stops),
                     train=TrainConfig(backend=train))


def test_stop_strings_are_refused_by_an_engine_that_cannot_match_them(engines):
    assert engine_problems(_cfg("plain")) == []
    assert engine_problems(_cfg("torch", ("</a>",))) == []
    [problem] = engine_problems(_cfg("plain", ("</a>",)))
    assert problem.startswith("generation.stop_strings: generation.backend = 'plain' cannot "
                              "match stop strings")
    assert problem.endswith("generation.backend = torch")


def test_an_engine_whose_extra_is_missing_names_it(engines):
    assert engine_problems(_cfg("absent")) == []  # a plan may be for another machine
    [problem] = extra_problems(_cfg("absent"))
    assert problem.startswith("generation.backend: ")
    assert "pip install 'rlhf-async[no_such_package_here]'" in problem
    assert "accepted here: torch" in problem and "absent" not in problem.split("here:")[1]
    assert extra_problems(_cfg("plain")) == []
    [problem] = extra_problems(_cfg("plain", train="absent"))
    assert problem.startswith("train.backend: ")
    assert "pip install 'rlhf-async[no_such_trainer_here]'" in problem
    assert "accepted here: torch" in problem and "absent" not in problem.split("here:")[1]
