"""A full disk under Separation: the trainer's second checkpoint hits ENOSPC (simulated in
the node processes by a sitecustomize: every torch.save after the first one fails). The
run stops at once with one error naming the path and the free space, the first checkpoint
intact, and the trainer is not restarted into the same error."""

import json
import os
from pathlib import Path

import pytest

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.rl.checkpoint import load_latest
from rlhf_async.strategies.separation.startup import PipelineError

pytestmark = [pytest.mark.timeout(300)]
SITE = """\
import os
if os.environ.get("RLHF_TEST_DISK_FULL"):  # a file counting torch.save calls of all processes
    import errno, torch
    _save = torch.save

    def _full(obj, f, *args, **kwargs):
        with open(os.environ["RLHF_TEST_DISK_FULL"], "ab+") as calls:
            calls.write(b".")
            if calls.tell() > 1:  # the disk stays full, whichever process writes next
                raise OSError(errno.ENOSPC, "No space left on device")
        return _save(obj, f, *args, **kwargs)
    torch.save = _full
"""

def test_a_full_disk_stops_separation_with_one_error_and_no_restarts(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)  # node processes start after this
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p))
    monkeypatch.setenv("RLHF_TEST_DISK_FULL", str(tmp_path / "saves"))
    cfg = load_config(None, [
        # a fresh interpreter per node (the sitecustomize runs in each), which also keeps
        # the exec start of Separation's nodes tested
        "runtime.node_start=exec",
        "placement.strategy=separation", "placement.devices=2", "sft.steps=2",
        "reward_model.steps=2", "train.steps=4", "run.checkpoint_every=1",
        "run.eval_prompts=4", "run.progress=false", "run.plot=false", "run.name=full",
        f"run.output_dir={json.dumps(str(tmp_path / 'runs'))}",
        f"run.cache_dir={json.dumps(str(tmp_path / 'cache'))}"])
    run_dir = (tmp_path / "runs" / "full").resolve()
    with pytest.raises(PipelineError) as e:
        job.run(cfg)
    checkpoints = run_dir / "checkpoints"
    assert str(e.value).startswith(
        f"trainer: no space left on device writing {checkpoints / 'ckpt-00000002'}: ")
    assert (" free there; the newest checkpoint, ckpt-00000001, is intact: free some space, "
            f"then continue with `rlhf-async resume {run_dir}`") in str(e.value)
    assert load_latest(checkpoints).step == 1
    assert [p.name for p in checkpoints.iterdir()] == ["ckpt-00000001"]
    log = Path(run_dir / "logs" / "trainer.log").read_text()
    assert log.count('"node_ready"') == 1  # never restarted
