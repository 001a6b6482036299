"""Progress: a bar on a terminal, a plain line every few seconds elsewhere, nothing when off;
the end-of-run summary says plainly when RL made the policy worse."""

import io

from rlhf_async.job.local import format_summary
from rlhf_async.metrics import Progress
from rlhf_async.progress import Phase, announce


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_start_at_once_then_every_few_seconds(monkeypatch):
    clock = iter([0.0, 0.0, 1.0, 2.0, 6.0, 7.0, 8.0, 9.0, 9.0, 9.0])
    monkeypatch.setattr("rlhf_async.progress.time.perf_counter", lambda: next(clock))
    out = io.StringIO()
    bar = Phase("sft", 5, stream=out, every_s=5.0)
    for _ in range(5):
        bar.update(1, loss=0.5)
    lines = out.getvalue().splitlines()
    # start (0/5), the update 6 s in (3/5), the last one (5/5); none in between
    assert [x.split("] ")[1].split(" ")[0] for x in lines] == ["0/5", "3/5", "5/5"]
    assert "eta" in lines[1] and "| loss 0.500" in lines[2]


def test_a_terminal_gets_a_bar_with_rate_and_metrics():
    out = Tty()
    p = Progress(4, stream=out)
    for step in range(4):
        p.update({"step": step, "reward": 1.5, "kl": 2.0})
    p.close()
    text = out.getvalue()
    assert "rl" in text and "4/4" in text and "step/s" in text and "rm 1.500 | kl 2.000" in text


def test_disabled_progress_prints_nothing():
    out = Tty()
    with Phase("eval", 3, enabled=False, stream=out) as bar:
        bar.update(3)
    announce("sft", "cached", enabled=False, stream=out)
    Progress(2, enabled=False, stream=out).update({"step": 0, "reward": 1.0})
    assert out.getvalue() == ""


def _summary(**over):
    s = {"run_dir": "runs/x", "algo": "ppo", "seed": 0, "strategy": "flattening",
         "devices": 1, "sft_hidden_score": 0.40, "final_hidden_score": 0.60,
         "sft_reward": -1.0, "final_reward": 2.0, "eval_prompts": 256, "rm_accuracy": 0.9,
         "rm_label_accuracy": 0.8, "pretrain_seconds": 1.0, "rl_seconds": 1.0,
         "rl_samples_per_s": 10.0, "wall_seconds": 2.0}
    return format_summary({**s, **over})


def test_the_summary_says_when_the_final_policy_is_worse():
    assert "WORSE" not in _summary()
    text = _summary(final_hidden_score=0.10)
    assert "WORSE than the SFT policy on the hidden score (0.400 -> 0.100)" in text
    assert "reward hacking" in text and "runs/x/metrics.png" in text
    rule = _summary(rm_accuracy=None, sft_reward=0.5, final_reward=0.2)
    assert "WORSE than the initial policy on the rule reward (0.500 -> 0.200)" in rule


def test_the_summary_names_the_samples_per_held_out_prompt():
    assert "hidden score on 256 held-out prompts: SFT" in _summary()
    assert "hidden score on 12 held-out prompts x 8 samples: SFT" in _summary(
        eval_prompts=12, eval_samples=8)
