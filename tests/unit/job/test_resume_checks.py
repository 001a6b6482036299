"""What `rlhf-async resume` refuses before anything starts: a checkpoint the run's changed
config cannot continue from."""

from pathlib import Path

import pytest

from rlhf_async.job.local import _check_strategy
from rlhf_async.rl.checkpoint import Checkpoint, CheckpointError


def _ck(strategy: str | None) -> Checkpoint:
    meta = {} if strategy is None else {"strategy": strategy}
    return Checkpoint(Path("runs/x/checkpoints/ckpt-00000002"), 2, {}, meta)


def test_a_run_continues_under_the_strategy_family_that_wrote_its_checkpoint():
    _check_strategy(None, "separation")  # no checkpoint: starts at step 0
    _check_strategy(_ck(None), "separation")  # older checkpoints name none
    _check_strategy(_ck("flattening"), "interleaving")  # both lock-step: the same state
    _check_strategy(_ck("separation"), "separation")
    with pytest.raises(CheckpointError, match="written by placement.strategy = 'flattening'; "
                       "this run has 'separation', which cannot continue from it"):
        _check_strategy(_ck("flattening"), "separation")
    with pytest.raises(CheckpointError, match="'separation'; this run has 'interleaving'"):
        _check_strategy(_ck("separation"), "interleaving")
