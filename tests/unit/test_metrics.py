import io
import json
import random
import subprocess
import sys
import time

from rlhf_async.metrics import (
    MetricsWriter,
    Progress,
    format_progress,
    progress_columns,
    read_metrics,
    summarize,
)
from rlhf_async.ops.plotting import plot_metrics


def test_writer_progress_summary_and_plot(tmp_path):
    w = MetricsWriter(tmp_path / "m.jsonl")
    for s in range(6):
        w.write({"step": s, "reward": float(s), "hidden_score": 0.1 * s, "kl": 0.5})
    w.close()
    recs = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in recs] == list(range(6))
    line = format_progress(recs[2], 6)
    assert line.startswith("step 3/6") and "rm 2.000" in line and "hidden 0.200" in line
    buf = io.StringIO()
    Progress(6, stream=buf).update(recs[0])
    Progress(6, enabled=False, stream=buf).update(recs[1])
    assert buf.getvalue().count("\n") == 1
    s = summarize(recs, ("reward",), last=2)
    assert s == {"reward_first": 0.5, "reward_last": 4.5}
    out = plot_metrics(tmp_path / "m.jsonl", tmp_path / "m.png", "t")
    assert out.stat().st_size > 1000


def test_progress_columns_are_named_for_what_they_show():
    record = {"step": 0, "reward": 0.5, "hidden_score": 0.5, "kl": 0.1, "samples_per_s": 8.0,
              "failed_steps": 0}
    # a rule (or an environment, an agent) makes the reward: no reward model, and the
    # hidden score is that same reward
    rule = format_progress(record, 4, progress_columns(rule_reward=True, has_rule=True))
    assert rule == "step 1/4 | reward 0.500 | kl 0.100 | smp/s 8.000"
    # a reward model beside a rule (the built-in task): the rule's score is the hidden one
    both = format_progress(record, 4, progress_columns(rule_reward=False, has_rule=True))
    assert both.startswith("step 1/4 | rm 0.500 | hidden 0.500 | kl")
    # a reward model alone: no hidden score of its own
    rm = format_progress(record, 4, progress_columns(rule_reward=False, has_rule=False))
    assert rm.startswith("step 1/4 | rm 0.500 | kl") and "hidden" not in rm
    # a step that trained on nothing says so, with the run of such steps so far
    failing = format_progress({**record, "failed_steps": 2}, 4,
                              progress_columns(rule_reward=True, has_rule=True))
    assert failing.endswith("smp/s 8.000 | failed 2")
    buf = io.StringIO()
    evaluated = {**record, "eval_reward": 0.7, "eval_hidden_score": 0.7}
    Progress(1, stream=buf, columns=progress_columns(True, True)).update(evaluated)
    assert "| reward 0.500 |" in buf.getvalue() and "rm " not in buf.getvalue() \
        and "hidden" not in buf.getvalue() and "eval after step 1 | reward 0.700" \
        in buf.getvalue()


def test_rule_reward_runs_plot_one_reward_panel():
    from rlhf_async.ops.plotting import panels_for

    recs = [{"step": 0, "reward": 1.0, "hidden_score": 1.0, "kl": 0.1}]
    assert [k for k, _ in panels_for(recs)] == ["reward", "hidden_score", "kl"]
    assert panels_for(recs, rule_reward=True)[:2] == [("reward", "rule reward"),
                                                      ("kl", "KL to reference (per sample)")]


def test_importing_the_job_leaves_matplotlib_for_the_first_plot():
    """Every node or rank a script starts re-imports that script's imports: pyplot's ~0.4 s
    is paid only where a plot is drawn."""
    code = "import sys; from rlhf_async.job import run; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_truncating_for_a_resume_restores_a_record_the_coordinator_never_wrote(tmp_path):
    from rlhf_async.metrics import truncate_metrics

    w = MetricsWriter(tmp_path / "metrics.jsonl")
    for s in (0, 1, 2, 5):  # step 3 and 4 trained and checkpointed, never recorded
        w.write({"step": s, "loss": 1.0, "util/gen0": 0.5})
    w.close()
    t = MetricsWriter(tmp_path / "trained_samples.jsonl")
    for s in range(6):
        t.write({"step": s, "sample_ids": [s], "version": s, "metrics": {"loss": 0.1 * s}})
    t.close()
    truncate_metrics(tmp_path, 5)  # resume from the checkpoint of step 5
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]
    assert recs[3] == {"step": 3, "loss": 0.30000000000000004, "restored": True}
    assert recs[2]["util/gen0"] == 0.5  # the coordinator's own records are kept as they were
    assert [r["step"] for r in read_metrics(tmp_path / "trained_samples.jsonl")] == list(range(5))


def test_a_rollback_beside_a_running_trainer_never_replaces_its_log(tmp_path):
    """A restarted trainer truncates its own log and keeps appending to it; the coordinator
    rolling back to the same checkpoint only reads it. Rewriting it there replaced the file
    under the trainer's open handle: the next four steps' records were lost (chaos run)."""
    from rlhf_async.metrics import truncate_metrics

    MetricsWriter(tmp_path / "metrics.jsonl").write({"step": 0, "loss": 1.0})
    trainer = MetricsWriter(tmp_path / "trained_samples.jsonl")
    for s in range(4):  # steps 0-3 trained; the new trainer restored the checkpoint of 2
        trainer.write({"step": s, "sample_ids": [s], "metrics": {"loss": 0.1 * s}})
    inode = (tmp_path / "trained_samples.jsonl").stat().st_ino
    with (tmp_path / "trained_samples.jsonl").open("a") as f:
        f.write('{"step": 2, "sample_')  # a line the trainer is writing just now
    truncate_metrics(tmp_path, 2, trainer_running=True)
    assert (tmp_path / "trained_samples.jsonl").stat().st_ino == inode
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]
    trainer.close()


def test_a_full_disk_while_writing_metrics_names_the_file_and_the_free_space(tmp_path):
    import errno

    import pytest

    class Full:
        def write(self, _):
            raise OSError(errno.ENOSPC, "No space left on device")

    w = MetricsWriter(tmp_path / "metrics.jsonl")
    w._f.close()
    w._f = Full()  # type: ignore[assignment]
    with pytest.raises(OSError, match=r"No space left on device writing .*metrics.jsonl "
                       r"\(\d+ MiB free there\)"):
        w.write({"step": 0})


_REWRITER = """
import json, sys
from pathlib import Path
from rlhf_async.metrics import truncate_jsonl
path = Path(sys.argv[1])
while True:  # add a step past the checkpoint, then drop it again, as a resume does
    with path.open("a") as f:
        f.write(json.dumps({"step": 10**6}) + "\\n")
    truncate_jsonl(path, 10**6)
"""


def test_a_kill_while_truncating_never_loses_the_records_before_the_checkpoint(tmp_path):
    """A restarted trainer SIGKILLed while it truncated trained_samples.jsonl left it
    empty: every step before the checkpoint lost (chaos run, 1 in 7)."""
    path = tmp_path / "trained_samples.jsonl"
    base = [json.dumps({"step": i, "sample_ids": list(range(64))}) for i in range(2000)]
    path.write_text("".join(x + "\n" for x in base))
    rng = random.Random(0)
    for _ in range(8):
        p = subprocess.Popen([sys.executable, "-c", _REWRITER, str(path)])
        time.sleep(0.6 + rng.random() * 0.3)  # past the import, inside the loop
        p.kill()
        p.wait()
        steps = [json.loads(x)["step"] for x in path.read_text().splitlines()]
        assert steps[:2000] == list(range(2000)) and set(steps[2000:]) <= {10**6}
