"""bench helpers: time-to-target, steady throughput, time series, plots, TRL tokenizer, soak output."""

import importlib.util
import json

import pytest
import torch

from bench import trl_compare, trl_mfu, trl_rows, ttq
from bench.bench_decode import compare as decode_compare
from bench.plots import plot_runs
from bench.strategies import mfu_means, print_table, series
from rlhf_async.config import TaskConfig, load_config
from rlhf_async.runtime.cpu import flushes_denormal
from rlhf_async.strategies.registry import plan_placement, runner_problems
from rlhf_async.task import SortDigitsTask

pytestmark = pytest.mark.timeout(60)


def test_time_to_target_uses_a_rolling_mean():
    times = [1.0, 2.0, 3.0, 4.0, 5.0]
    hidden = [0.9, 0.1, 0.5, 0.6, 0.7]
    # windows of 3: (0.9, 0.1, 0.5) = 0.5, (0.1, 0.5, 0.6) = 0.4, (0.5, 0.6, 0.7) = 0.6
    assert ttq.time_to_target(times, hidden, 0.5) == 3.0
    assert ttq.time_to_target(times, hidden, 0.55) == 5.0
    assert ttq.time_to_target(times, hidden, 0.61) is None


def test_summarise_leaves_out_warmup_steps():
    s = ttq.summarise([10.0, 1.0, 2.0], [8, 8, 8], [40, 40, 20], [0.1, 0.2, 0.3],
                              warmup=1, target=0.2)
    assert s["completions_per_s"] == pytest.approx(16 / 3)
    assert s["tokens_per_s"] == pytest.approx(60 / 3)
    assert s["times"] == [10.0, 11.0, 13.0]
    assert s["time_to_target_s"] == 13.0  # mean(0.1, 0.2, 0.3) = 0.2


def _flat(step):
    return {"step": step, "samples": 8.0, "response_length": 5.0, "hidden_score": 0.1 * step,
            "time_generate": 0.5, "time_score": 0.25, "time_train": 0.25}


def test_series_of_flattening_and_separation_records():
    s = series([_flat(0), _flat(1)])
    assert s["t"] == [1.0, 2.0] and s["samples_per_s"] == [8.0, 8.0]
    assert s["tokens_per_s"] == [40.0, 40.0] and "weight_sync_s" not in s
    sep = {**_flat(0), "time_step": 2.0, "weight_sync_s": 0.01, "staleness/mean": 0.5,
           "queue/generated": 2, "queue/scored": 1}
    s = series([sep])
    assert s["t"] == [2.0] and s["samples_per_s"] == [4.0]
    assert s["queue_depth"] == [3] and s["staleness"] == [0.5] and s["weight_sync_s"] == [0.01]


def test_plot_runs_writes_a_png(tmp_path):
    results = {"flattening": {"series": series([_flat(0), _flat(1)]),
                              "utilisation": {"generate": 0.5, "train": 0.25}},
               "separation": {"series": series([{**_flat(0), "time_step": 2.0,
                                                 "weight_sync_s": 0.01}]),
                              "utilisation": {"trainer": 0.9}}}
    out = plot_runs(results, tmp_path / "b.png", "t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tokenizer_ids_match_the_task(tmp_path):
    from transformers import AutoTokenizer

    trl_compare.save_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    task = SortDigitsTask(TaskConfig())
    ids, _ = task.encode_prompts([[3, 1, 4]])
    text = "<bos> 3 1 4 <sep>"
    assert tok(text, add_special_tokens=False)["input_ids"] == ids[0][ids[0] != 0].tolist()
    assert tok.pad_token_id == 0 and tok.eos_token_id == 3 and tok.padding_side == "left"


def test_reward_fn_scores_and_traces_hidden():
    task = SortDigitsTask(TaskConfig())

    class Constant(torch.nn.Module):
        def forward(self, ids, mask, pos):
            return mask.float().cumsum(1)  # score = length of the sequence

    fn = trl_compare.RewardFn(Constant(), task, task.response_len)
    sorted_, unsorted = task.answer_tokens([1, 3, 4]), task.answer_tokens([4, 1, 3])
    scores = fn([], [], [sorted_, unsorted[:2]], [[3, 1, 4], [3, 1, 4]])
    assert scores == [5.0 + 4, 5.0 + 2]  # prompt BOS 3 1 4 SEP = 5 tokens, + response
    assert fn.hidden == [pytest.approx(0.5)] and fn.tokens == [6.0]
    wide = trl_compare.RewardFn(Constant(), task, 10)  # --new-tokens 10: all ten scored
    assert wide([], [], [list(range(4, 14))], [[3, 1, 4]]) == [5.0 + 10]


def test_new_tokens_fixes_our_response_length():
    import argparse

    assert trl_compare.new_tokens(argparse.Namespace(new_tokens=0)) == []
    over = trl_compare.new_tokens(argparse.Namespace(new_tokens=48))
    cfg = load_config(None, over)
    assert cfg.generation.max_new_tokens == 48 and cfg.generation.min_new_tokens == 47



def test_trl_text_rule_reward_reads_conversational_and_plain_text():
    from types import SimpleNamespace

    from bench.trl_text import RuleReward
    from rlhf_async.task.rewards.reward_fn import RuleReward as Rule

    seen = []
    fn = Rule(lambda p, r: seen.append((p, r)) or float(len(r)), "f", False, 5.0)
    rule = RuleReward(SimpleNamespace(rule=fn))  # type: ignore[arg-type]  # only .rule used
    out = rule([[{"role": "user", "content": "Name a fruit."}], "plain"],
               [[{"role": "assistant", "content": "Apple."}], "ok"], [[5, 6, 7], [8]])
    assert out == [6.0, 2.0] and seen == [("Name a fruit.", "Apple."), ("plain", "ok")]
    assert rule.hidden == [4.0] and rule.tokens == [4.0]


def test_trl_text_refuses_a_config_without_a_text_task(tmp_path, capsys):
    from bench import trl_text

    cfg = tmp_path / "digits.toml"
    cfg.write_text('[task]\nname = "sort_digits"\n')
    assert trl_text.main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "needs a text task" in err and "Traceback" not in err


def test_bf16_rows_run_every_model_in_bf16():
    import argparse

    args = argparse.Namespace(bf16=True, trl_bf16=False, trl_threads=[1, 2], compiled=False,
                              trl_flush_denormal=False)
    assert trl_rows.our_rows(args) == [
        "flattening", "separation k=1", "flattening bf16", "separation k=1 bf16",
        "flattening bf16 gen-fp32", "separation k=1 bf16 gen-fp32",
        "separation k=1 bf16 scorer@trainer"]
    assert trl_rows.trl_rows(args)[-1] == ("trl 2t bf16", 2, True, False)
    cfg = load_config(None, ["algo.name=grpo", *trl_rows.OURS_BF16["separation k=1 bf16"]])
    assert set(cfg.placement.dtype) == {"actor=bf16", "shadow_actor=bf16", "reward=bf16",
                                        "reference=bf16"}
    for name in ("flattening bf16 gen-fp32", "separation k=1 bf16 gen-fp32"):
        cfg = load_config(None, ["algo.name=grpo", *trl_rows.OURS_BF16[name]])
        assert set(cfg.placement.dtype) == {"actor=bf16", "reward=bf16", "reference=bf16"}
        placement = plan_placement(cfg.placement, "grpo")
        assert runner_problems(cfg, placement) == []  # each strategy runs its fp32 generation
    cfg = load_config(None, ["algo.name=grpo", "placement.devices=2",
                             *trl_rows.OURS_BF16["separation k=1 bf16 scorer@trainer"]])
    placement = plan_placement(cfg.placement, "grpo")
    assert placement.by_role("scorer")[0].devices == placement.by_role("trainer")[0].devices
    assert runner_problems(cfg, placement) == []
    assert trl_rows.our_rows(argparse.Namespace(bf16=False, compiled=False)) == list(
        trl_rows.OURS)


def test_trl_rows_flushed_and_our_compiled_row_are_what_their_flags_ask():
    import argparse

    args = argparse.Namespace(bf16=False, trl_bf16=True, trl_threads=[1, 2], compiled=True,
                              trl_flush_denormal=True)
    assert trl_rows.trl_rows(args) == [("trl 1t ftz", 1, False, True),
                                          ("trl 2t ftz", 2, False, True),
                                          ("trl 2t bf16 ftz", 2, True, True)]
    assert trl_rows.our_rows(args) == ["flattening", "separation k=1",
                                          "separation k=1 compiled"]
    cfg = load_config(None, ["algo.name=grpo",
                             *trl_rows.OURS_COMPILED["separation k=1 compiled"]])
    assert cfg.generation.compile == "on" and cfg.placement.strategy == "separation"
    before = flushes_denormal()  # (a job run in this process earlier flushes: its default)
    with trl_compare.flushed(not before):  # this thread only, and back after
        assert flushes_denormal() is not before
    assert flushes_denormal() is before


def test_bench_decode_times_both_paths_on_the_same_samples():
    r = decode_compare("llama 4x128", rounds=1, rows=4, new_tokens=5)
    assert r["tokens_equal"] and r["logprob_max_diff"] < 1e-5
    assert r["hf_ms"] > 0 and r["step_ms"] > 0


def test_soak_keeps_its_raw_samples_out_of_the_summary(tmp_path):
    import argparse

    from bench.soak import write_results

    args = argparse.Namespace(out=tmp_path / "results" / "soak_demo.json",
                              samples_out=tmp_path / "runs" / "soak_demo_samples.json")
    samples = [{"t": float(i), "rss": {"sink0": 1 << 20}, "received": i} for i in range(3)]
    write_results(args, {"flat": True, "rows": {}}, samples)
    summary = json.loads(args.out.read_text())
    assert summary["summary"] == {"flat": True, "rows": {}} and "samples" not in summary
    assert json.loads(args.samples_out.read_text())["samples"] == samples


def test_eval_seeds_writes_curves_apart_from_the_rows(tmp_path):
    from bench.eval_seeds import write_results

    row = {"algo": "ppo", "seed": 3, "sft": 0.4, "final": 0.7, "curve": [0.4, 0.5],
           "kl_curve": [0.1, 0.2]}
    out, curves = tmp_path / "results" / "e.json", tmp_path / "runs" / "e_curves.json"
    write_results([row], out, curves, {"load": [1.0, 1.0]})
    summary = json.loads(out.read_text())
    assert summary.pop("meta")["utc"]  # every summary's run facts (bench/output.py)
    assert summary == {
        "load": [1.0, 1.0], "rows": [{"algo": "ppo", "seed": 3, "sft": 0.4, "final": 0.7}]}
    assert json.loads(curves.read_text())["rows"] == [
        {"algo": "ppo", "seed": 3, "curve": [0.4, 0.5], "kl_curve": [0.1, 0.2]}]


def test_eval_seeds_variants_parse_and_compare_with_the_first():
    import argparse

    from bench.eval_seeds import parse_variant, versus_baseline

    assert parse_variant("sync:") == ("sync", [])
    assert parse_variant("k1p:algo.max_staleness=1,algo.proximal=true") == (
        "k1p", ["algo.max_staleness=1", "algo.proximal=true"])
    for bad in ("nolabel", ":a=1", "a/b:x=1", "k1:algo.proximal"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_variant(bad)
    rows = [{"algo": f"ppo/{v}", "seed": s, "final": f} for v, s, f in (
        ("sync", 0, 0.70), ("sync", 1, 0.60), ("k1p", 0, 0.65), ("k1p", 1, 0.64))]
    # k1p - sync: -0.05 and +0.04 -> mean -0.005
    assert versus_baseline(rows) == [
        "ppo/k1p - ppo/sync: mean -0.005 over 2 seeds (min -0.050, max +0.040)"]
    assert versus_baseline([{"algo": "ppo", "seed": 0, "final": 0.7}]) == []


def test_engine_tps_measures_the_torch_engine_and_reports_an_engine_that_cannot_run(
        tmp_path, monkeypatch):
    """bench/vllm_engine_tps.py at a tiny size: our torch engine on the default model; an
    engine that cannot serve (here vLLM, not installed in this venv) is that row's result."""
    from bench import vllm_engine_tps

    out = tmp_path / "tps.json"
    monkeypatch.setattr("sys.argv", ["x", "--runs", "ours,torch", "--model", "default",
                                     "--requests", "3", "--tokens", "4", "--out", str(out)])
    real = importlib.util.find_spec  # no vLLM here, wherever the test runs
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    vllm_engine_tps.main()
    res = json.loads(out.read_text())
    assert res["torch_tok_s"] > 0 and res["prompt_tokens"] == [8, 8]
    assert "vllm" in res["ours_error"] and "ours_tok_s" not in res
    assert "torch_over_ours" not in res


def test_trl_text_compares_rewards_at_the_same_number_of_samples():
    from bench.trl_text import same_samples

    rows = {"trl": {"samples": [8, 8], "hidden": [0.3, 0.9]},
            "flattening": {"samples": [4, 4, 4, 4], "hidden": [0.1, 0.5, 0.7, 0.9]},
            "separation k=1": {"samples": [4] * 5, "hidden": [0.2, 0.4, 0.6, 0.8, 2.0]}}
    same = same_samples(rows, window=2)  # 16 samples: the fifth separation batch left out
    assert {n: q["samples"] for n, q in same.items()} == dict.fromkeys(rows, 16)
    assert same["flattening"]["reward"] == pytest.approx(0.8)
    assert same["flattening"]["vs_base"] == pytest.approx(1.0)
    assert same["separation k=1"]["reward"] == pytest.approx(0.7)
    assert same["separation k=1"]["vs_base"] == pytest.approx(0.875)
    assert same["trl"]["reward"] == pytest.approx(0.6)
    assert same["trl"]["vs_base"] == pytest.approx(0.75)
    assert same_samples({"trl": rows["trl"]}, 2)["trl"]["vs_base"] is None  # no flattening


def test_trl_text_compares_our_final_policies_on_the_held_out_prompts(capsys):
    from bench.trl_text import final_policies, print_final_policies

    ev = {"prompts": 12, "samples": 8}
    rows = {"trl": {"samples": [8]},  # TRL's policy is not evaluated by our evaluation
            "flattening": {"eval": {"initial": 0.4, "final": 1.6, **ev}},
            "separation k=1": {"eval": {"initial": 0.4, "final": 1.2, **ev}}}
    finals = final_policies(rows)
    assert set(finals) == {"flattening", "separation k=1"}
    assert finals["separation k=1"]["vs_base"] == pytest.approx(0.75)
    print_final_policies("m", finals)
    out = capsys.readouterr().out
    assert "12 prompts x 8 samples" in out and "0.400 -> 1.200   0.75x flattening" in out
    no_base = final_policies({"separation k=1": rows["separation k=1"]})
    assert no_base["separation k=1"]["vs_base"] is None


def test_trl_text_only_moves_overrides_and_refuses_unknown_rows(capsys):
    import argparse

    from bench import trl_text

    ap = argparse.ArgumentParser()
    args = argparse.Namespace(only=["trl", "run.seed=1", "separation k=1", "model.path=/m-1"],
                              overrides=["a=b"])
    trl_text.split_only(ap, args)
    assert args.only == ["trl", "separation k=1"]
    assert args.overrides == ["run.seed=1", "model.path=/m-1", "a=b"]
    with pytest.raises(SystemExit) as e:
        trl_text.main(["--only", "trl", "separation"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown row(s) 'separation'" in err and "'separation k=1'" in err


def test_bench_table_shows_mfu_weighted_by_step_time(capsys):
    rows = [{"time_step": 1.0, "mfu/step": 0.2, "mfu/train": 0.4},
            {"time_step": 3.0, "mfu/step": 0.6, "mfu/train": 0.8}]
    mfu = mfu_means(rows)
    assert mfu == pytest.approx({"step": 0.5, "train": 0.7})
    print_table({"flattening": {"samples_per_s": 10.0, "tokens_per_s": 100.0, "rl_wall_s": 5.0,
                                "sft_hidden_score": 0.1, "final_hidden_score": 0.2,
                                "utilisation": {"train": 0.5}, "mfu": mfu}})
    line = capsys.readouterr().out.splitlines()[-1]
    assert "50.0%" in line and "train=70.0%" in line


def test_trl_and_ours_mfu_computed_the_same_way(tmp_path):
    from types import SimpleNamespace

    from transformers import GPT2Config, GPT2LMHeadModel

    from rlhf_async.modeling.flops import TOKEN_KEYS, FlopShape, train_flops
    from rlhf_async.modeling.models import scalar_model_from_actor

    lm = GPT2LMHeadModel(GPT2Config(vocab_size=10, n_positions=16, n_embd=8, n_layer=2,
                                    n_head=2))
    lm.save_pretrained(tmp_path / "sft")
    scalar_model_from_actor(lm, 0).save(tmp_path / "rm")
    art = SimpleNamespace(sft_dir=tmp_path / "sft", rm_dir=tmp_path / "rm")
    counts = dict(zip(TOKEN_KEYS, (5.0, 3.0, 1.0, 9.0, 4.0, 21.0), strict=True)) | {
        "samples": 2.0}
    ours = {**counts, "flops/train": train_flops(FlopShape.of_module(lm), None, 3.0, counts)}
    trl = trl_mfu.step_mfu(art, [counts], 3.0, wall=2.0, peak=1e4)
    assert trl == trl_mfu.step_mfu(art, [ours], None, wall=2.0, peak=1e4)
    # by hand (tests/unit/modeling/test_flops.py): generate 19744, score 52352, train 3/4 of
    # the 105600 of four passes
    assert trl == pytest.approx((19744 + 52352 + 79200) / 2e4)


def test_mfu_rescaled_to_the_best_peak_measured():
    # rows divided by a peak of 300 measured under load; a later measurement of 400 is
    # the machine's: every row's MFU falls by 3/4, and a row without one is left alone
    rows = {"ours": {"mfu_step": 0.6}, "trl": {"mfu_step": 0.4}, "failed": {}}
    trl_mfu.rescale_mfu(rows, measured=300.0, peak=400.0)
    assert rows == {"ours": {"mfu_step": pytest.approx(0.45)},
                    "trl": {"mfu_step": pytest.approx(0.3)}, "failed": {}}


def test_our_row_without_a_peak_has_no_mfu(tmp_path, monkeypatch, capsys):
    # trl_text and trl_gym run our row with no peak measured (and a task that is not
    # sort-digits): it divided by zero after the whole job; now it has no MFU, shown as "-"
    run = tmp_path / "run"
    run.mkdir()
    recs = [{"step": i, "time_step": 2.0, "samples": 8, "response_length": 5.0,
             "hidden_score": 0.1 * i} for i in range(3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = {"run_dir": str(run), "rl_seconds": 7.0, "sft_hidden_score": 0.0,
               "final_hidden_score": 0.3, "eval_prompts": 4}
    monkeypatch.setattr(trl_compare.job, "run", lambda cfg: summary)
    monkeypatch.setattr(trl_compare, "prepare_artefacts", lambda *a: pytest.fail("a sort task"))
    row = trl_compare.run_ours("separation k=1", [], warmup=1, target=0.5)
    assert "mfu_step" not in row and row["completions_per_s"] == pytest.approx(4.0)
    trl_compare.print_table("text", {"separation k=1": row}, 0.5)
    assert capsys.readouterr().out.splitlines()[-1].endswith(" -")
