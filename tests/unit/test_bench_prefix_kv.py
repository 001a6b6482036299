"""bench.prefix_kv: both ways sample the same episodes, and the kept way reuses every
later turn's KV."""

import argparse

import pytest

from bench.prefix_kv import long, measure

pytestmark = pytest.mark.timeout(120)


def test_the_long_workload_reuses_every_later_turn_and_samples_the_same_tokens():
    lm, params, run, n = long(argparse.Namespace(chunks=1, prompts=1))
    got = measure(lm, params, run, n, repeats=1)  # raises when the tokens differ
    assert got["episodes"] == 4 and got["turns_reusing_kv"] == 4 * 2
    assert got["tokens_per_episode"] == 24 * 3 + 24 * 2
