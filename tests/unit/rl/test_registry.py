"""The algorithm registries are the one list of names: every preset's estimator and loss is
registered, the config's help names each built-in, and an unknown name is a problem that
lists the accepted ones."""

import dataclasses

import pytest

from rlhf_async.config import AlgoConfig, TrainConfig
from rlhf_async.config.presets import PRESETS, resolve
from rlhf_async.rl.learner import Learner
from rlhf_async.rl.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, name_problems
from tests.unit.rl.test_learner_by_hand import Logits


def test_every_preset_names_a_registered_estimator_and_loss():
    for name in PRESETS:
        assert name_problems(resolve(AlgoConfig(name=name))) == [], name


@pytest.mark.parametrize(("key", "registry"), [("advantage_estimator", ADVANTAGE_ESTIMATORS),
                                               ("policy_loss", POLICY_LOSSES)])
def test_the_config_help_names_each_built_in(key, registry):
    help_text = {f.name: f.metadata["help"] for f in dataclasses.fields(AlgoConfig)}[key]
    for name in registry:
        assert f"{name} (" in help_text or f"{name}," in help_text, name


def test_an_explicit_name_wins_over_the_preset():
    r = resolve(AlgoConfig(name="grpo", advantage_estimator="leave_one_out",
                           policy_loss="cispo"))
    assert (r.baseline, r.surrogate, r.adv_norm) == ("leave_one_out", "cispo", "group")


def test_an_unknown_name_lists_the_accepted_ones():
    r = resolve(AlgoConfig(name="grpo", advantage_estimator="gea", policy_loss="ppo"))
    assert name_problems(r) == [
        "algo.advantage_estimator: unknown 'gea'; accepted: distill, gae, group_mean, "
        "leave_one_out, none (or '' = the preset's)",
        "algo.policy_loss: unknown 'ppo'; accepted: cispo, clip (or '' = the preset's)"]
    with pytest.raises(ValueError, match="algo.policy_loss: unknown 'ppo'"):
        Learner(Logits(), None, AlgoConfig(name="grpo", policy_loss="ppo"),
                TrainConfig(epochs=1, minibatches=1), seed=0)
