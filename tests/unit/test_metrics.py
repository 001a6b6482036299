import io

from rlhf_async.metrics import MetricsWriter, Progress, format_progress, read_metrics, summarize
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


def test_rule_reward_runs_plot_one_reward_panel():
    from rlhf_async.ops.plotting import panels_for

    recs = [{"step": 0, "reward": 1.0, "hidden_score": 1.0, "kl": 0.1}]
    assert [k for k, _ in panels_for(recs)] == ["reward", "hidden_score", "kl"]
    assert panels_for(recs, rule_reward=True)[:2] == [("reward", "rule reward"),
                                                      ("kl", "KL to reference (per sample)")]
