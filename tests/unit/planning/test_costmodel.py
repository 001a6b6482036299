"""Cost model and planner: hand-checked memory and phase arithmetic, what makes Flattening
slow at scale, `auto`'s choice and reason, and the `plan` command."""

import dataclasses
import importlib.machinery
import importlib.util
import json

import pytest

from rlhf_async.cli import main
from rlhf_async.config import ConfigError, JobConfig, PlacementConfig, load_config
from rlhf_async.planning import planner
from rlhf_async.planning.costmodel import (
    DEVICES,
    LLAMA,
    Calibration,
    DeviceSpec,
    GiB,
    ModelShape,
    Workload,
    activation_bytes,
    memory_plan,
    predict,
)
from rlhf_async.planning.machine import load_calibration
from rlhf_async.planning.planner import (
    SIM_WORK,
    choose,
    plan_job,
    priced_job,
    resolve_auto,
    sim_job,
    sim_options,
    simulate,
)
from rlhf_async.strategies.placement import PlacementError
from rlhf_async.strategies.registry import plan_placement, runnable_placement

SHAPE = ModelShape("toy", 1e6, 2, 64, 16)
BIG_MEMORY = DeviceSpec("test", 1e12, 100 * GiB, 1e11, 1e10, 1e9, 8)
WORK = Workload(samples=64, prompt_len=8, gen_len=8, epochs=2, minibatches=2)


def _placement(strategy, n=2, **kw):
    return plan_placement(PlacementConfig(strategy=strategy, devices=n, **kw), "ppo")


def test_memory_is_summed_per_device_and_sharded_only_when_needed():
    mem, zero3 = memory_plan(_placement("flattening"), SHAPE, BIG_MEMORY)
    # actor + critic: 16 bytes/param each; reward + reference: fp32 on cpu, 4 bytes each
    assert not zero3 and mem == {0: 40e6, 1: 40e6}
    small = dataclasses.replace(BIG_MEMORY, memory=40e6)  # budget 36 MB: must shard
    mem, zero3 = memory_plan(_placement("flattening"), SHAPE, small)
    # actor and critic sharded over the 2 replicas; reward and reference whole, as the
    # runners hold them (the reference is copied from the actor before ZeRO shards it)
    assert zero3 and mem == {0: 24e6, 1: 24e6}
    # one replica: ZeRO-3 would shard nothing, so the plan does not ask for it
    assert memory_plan(_placement("flattening", 1), SHAPE, small) == ({0: 40e6}, False)
    mem, _ = memory_plan(_placement("interleaving", 4), SHAPE, BIG_MEMORY)
    assert mem == {0: 36e6, 1: 36e6, 2: 36e6, 3: 36e6}  # one frozen model per device


def test_interleaving_scores_once_per_device_where_flattening_scores_twice():
    cal = Calibration(score_call_s=1.0, score_eff=1.0)  # fixed cost dominates scoring
    flat = predict(_placement("flattening"), SHAPE, WORK, BIG_MEMORY, cal)
    inter = predict(_placement("interleaving"), SHAPE, WORK, BIG_MEMORY, cal)
    assert flat.phases["score"] == pytest.approx(2 * SHAPE.layers * 1.0, rel=1e-3)
    assert inter.phases["score"] == pytest.approx(SHAPE.layers * 1.0, rel=1e-2)  # + gather


def test_separation_overlaps_only_with_staleness():
    p = _placement("separation", 3, generator=[1], reward=[2])
    k0 = predict(p, SHAPE, WORK, BIG_MEMORY, Calibration())
    k1 = predict(p, SHAPE, dataclasses.replace(WORK, max_staleness=1), BIG_MEMORY,
                 Calibration())
    ph = k0.phases
    # generator and scorers on their own devices overlap each other (chunks), not training
    assert k0.step_s == pytest.approx(max(ph["generate"], ph["score"]) + ph["train"]
                                      + ph["sync"])
    # with staleness they overlap the trainer too
    assert k1.step_s == pytest.approx(max(ph["generate"], ph["score"],
                                          ph["train"] + ph["sync"]))


def test_scorers_beside_the_trainer_take_its_time_not_the_generators():
    work = dataclasses.replace(WORK, max_staleness=1)
    beside = predict(_placement("separation", 2, reward=[0], reference=[0]), SHAPE, work,
                     BIG_MEMORY, Calibration())
    ph = beside.phases
    assert beside.step_s == pytest.approx(max(ph["generate"],
                                              ph["train"] + ph["sync"] + ph["score"]))
    shared = predict(_placement("separation", 2), SHAPE, work, BIG_MEMORY, Calibration())
    ph = shared.phases
    assert shared.step_s == pytest.approx(max(ph["generate"] + ph["score"],
                                              ph["train"] + ph["sync"]))


def test_flattening_at_scale_gathers_weights_every_token_and_loses_to_separation():
    n, shape = 64, LLAMA["13B"]
    # the simulation's workload: checkpointed activations leave room for the whole reward
    # model and reference beside the sharded training copies
    flat = predict(_placement("flattening", n, device="cuda"), shape, SIM_WORK,
                   DEVICES["H100"], Calibration())
    assert flat.feasible and any("gathers" in note for note in flat.notes)
    rows = simulate("H100", ["13B"], [n])
    best = {r["strategy"]: r for r in rows}
    assert best["flattening"]["step_s"] == pytest.approx(flat.step_s)
    assert best["separation k=0"]["step_s"] < flat.step_s / 3
    assert best["separation k=1"]["step_s"] <= best["separation k=0"]["step_s"]


def test_kv_cache_left_over_bounds_generation_passes():
    tight = dataclasses.replace(DEVICES["H100"], memory=40 * GiB)
    p = _placement("separation", 4, device="cuda", generator=[1], reward=[2, 3])
    pred = predict(p, LLAMA["7B"],
                   Workload(samples=512, prompt_len=512, gen_len=480), tight, Calibration())
    assert any("generation passes" in n for n in pred.notes)


def test_auto_picks_the_predicted_fastest_and_says_why():
    cfg = load_config(None, ["placement.strategy=auto", "placement.devices=2"])
    placement, reason = choose(cfg)
    for name in ("flattening", "interleaving", "separation"):
        assert name in reason
    assert f"{placement.strategy} is the fastest feasible" in reason
    assert resolve_auto(cfg).placement.strategy == placement.strategy
    one = load_config(None, ["placement.strategy=auto", "placement.devices=1"])
    _, reason = choose(one)
    assert "interleaving not possible" in reason
    gpus = load_config(None, ["placement.strategy=auto", "placement.device=cuda",
                              "placement.devices=8"])
    placement, reason = choose(gpus)  # never what `run` would refuse
    assert placement.strategy != "interleaving"
    assert "interleaving not possible (placement.device: this build runs interleaving on " \
        "cpu only)" in reason


def test_plan_job_reports_memory_over_budget_with_placement_conflicts():
    cfg = load_config(None, ["placement.strategy=interleaving", "placement.devices=2",
                             "placement.reward=[0]", "placement.memory_gb=0.0001"])
    with pytest.raises(PlacementError) as e:
        plan_job(cfg)
    text = "\n".join(e.value.problems)
    assert "also hold the reference" in text and "predicted memory over budget" in text


def test_bad_calibration_file_is_one_config_error(tmp_path):
    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps({"calibration": {"gen_eff": 0.5, "warp": 9}}))
    with pytest.raises(ConfigError, match="not a calibration JSON"):
        load_calibration(str(bad))
    with pytest.raises(ConfigError, match="not found"):
        load_calibration(str(tmp_path / "missing.json"))


def test_plan_command_prints_table_and_simulation(capsys):
    assert main(["plan", "placement.strategy=interleaving", "placement.devices=4"]) == 0
    out = capsys.readouterr().out
    assert "worker3" in out and "predicted step" in out and "reward     infer    2-3" in out
    assert main(["plan", "--simulate", "--models", "7B", "--gpus", "8,16", "--gpu",
                 "A100"]) == 0
    out = capsys.readouterr().out
    assert "Assumptions:" in out and "| 7B | 16 | " in out and "sep k=0 vs flat" in out
    assert main(["plan", "--simulate", "--gpus", "eight"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--gpus" in err[1]


def test_a_kv_cache_that_cannot_fit_one_sequence_stops_the_run_before_any_work(tmp_path,
                                                                              capsys):
    model = tmp_path / "model"  # an HF config whose context is no limit: memory is
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"n_embd": 64, "n_layer": 2,
                                                   "vocab_size": 16, "n_positions": 10**9}))
    args = [f"model.path={str(model)!r}", "generation.max_new_tokens=100000000",
            "placement.memory_gb=8", f"run.output_dir={str(tmp_path / 'runs')!r}"]
    with pytest.raises(PlacementError) as e:
        plan_job(load_config(None, args))
    # training on such sequences would not fit either: its activations are the other problem
    memory, problem = e.value.problems
    assert memory.startswith("placement: predicted memory over budget on device 0") \
        and "training micro-batch's activations" in memory
    assert problem.startswith("generation.max_new_tokens: 100000000 new tokens after a "
                              "8-token prompt need a predicted 95.4 GiB of KV cache")
    assert main(["run", *args]) == 2
    err = capsys.readouterr().err
    assert "95.4 GiB of KV cache" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_activations_are_a_micro_batch_of_rows_x_sequence_x_hidden_x_layers():
    p = _placement("flattening")  # cpu: fp32; actor and critic on both devices, 2 replicas
    actor = p.model("actor")
    # 64 samples over 2 replicas, 2 minibatches, 2 micro-batches: 8 rows of 8 + 8 tokens
    work = dataclasses.replace(WORK, grad_accum=2)
    row_layer = 8 * 16 * 64 * 4  # rows x sequence x hidden x fp32 bytes
    assert activation_bytes(actor, SHAPE, work) == row_layer * 16 * 2  # 16 values, 2 layers
    ckpt = dataclasses.replace(work, checkpointing=True)  # inputs kept + one layer recomputed
    assert activation_bytes(actor, SHAPE, ckpt) == row_layer * (2 + 16)
    pred = predict(p, SHAPE, work, BIG_MEMORY, Calibration())
    assert pred.activations == {0: 2 * row_layer * 32, 1: 2 * row_layer * 32}  # actor + critic
    assert pred.memory[0] == pytest.approx(40e6 + pred.activations[0])
    assert pred.resident[0] == pytest.approx(40e6)  # what the KV cache competes with


def test_a_micro_batch_whose_activations_do_not_fit_is_infeasible_until_accumulated():
    small = dataclasses.replace(BIG_MEMORY, memory=60e6)  # budget 54 MB; the states take 40
    p = _placement("flattening")
    big = Workload(samples=4096, prompt_len=8, gen_len=8, epochs=1, minibatches=2)
    pred = predict(p, SHAPE, big, small, Calibration())
    assert not pred.feasible
    assert any("training activations" in note for note in pred.notes)
    accumulated = predict(p, SHAPE, dataclasses.replace(big, grad_accum=64), small,
                          Calibration())
    assert accumulated.feasible and accumulated.peak_memory <= 0.9 * small.memory


def test_plan_job_names_a_micro_batchs_activations_and_what_lowers_them():
    args = ["train.prompts_per_step=4096", "placement.memory_gb=0.05"]
    with pytest.raises(PlacementError) as e:
        plan_job(load_config(None, args))
    (problem,) = e.value.problems
    assert "training micro-batch's activations" in problem and "train.grad_accum" in problem
    plan_job(load_config(None, [*args, "train.grad_accum=64"]))  # fits: no error


def test_plan_says_when_its_prediction_needs_zero3_that_the_config_lacks():
    # 3.2M-parameter actor and critic: whole, their training states crowd 0.12 GB a device
    args = ["placement.devices=2", "model.hidden=256", "model.layers=4",
            "train.grad_accum=32", "placement.memory_gb=0.12"]
    _, pred = plan_job(load_config(None, args))
    assert pred.zero3
    assert any("set train.backend=deepspeed train.zero_stage=3" in n for n in pred.notes)
    _, pred = plan_job(load_config(None, [*args, "train.backend=deepspeed",
                                          "train.zero_stage=3"]))
    assert pred.zero3 and not any("train.backend=deepspeed" in n for n in pred.notes)
    _, pred = plan_job(load_config(None, args[:-1]))  # room enough: nothing to shard for
    assert not pred.zero3 and not any("ZeRO-3" in n for n in pred.notes)


def test_every_simulated_proposal_is_a_layout_run_accepts(monkeypatch):
    runnable, refused = sim_options(8, SIM_WORK)["separation"]
    # the grid tries tensor-parallel generators and scorers; the runners run the first on
    # vLLM and refuse the second
    assert any(p.startswith("placement.tensor_parallel: reward=") for p in refused)
    assert runnable and all(m.tensor_parallel == 1 for _, p in runnable for m in p.models
                            if m.model != "shadow_actor")
    tp_jobs = [job for job, p in runnable if p.model("shadow_actor").tensor_parallel > 1]
    assert tp_jobs and all(job.generation.backend == "vllm" for job in tp_jobs)
    rows = simulate("H100", ["7B"], [8, 16])
    proposed = [r for r in rows if r["runnable"]]
    assert {"flattening", "separation k=0", "separation k=1"} <= {r["strategy"] for r in proposed}
    assert any(" tp" in r["layout"] for r in proposed)
    # loading a vLLM row's overrides only checks that vllm exists, which it need not here
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: importlib.machinery
                        .ModuleSpec(name, None) if name == "vllm" else real(name, *a))
    zero3_rows = 0
    for r in proposed:
        # the row's own overrides, on a model with room for the 992-token sequences
        cfg = load_config(None, [*r["overrides"], "model.max_positions=1024"])
        placement = runnable_placement(cfg)  # PlacementError: what `run` would refuse
        assert r["strategy"].startswith(placement.strategy)
        tp = placement.model("shadow_actor").tensor_parallel if placement.model(
            "shadow_actor") else 1
        assert (f"tp{tp}" in r["layout"]) == (tp > 1)
        assert (cfg.generation.backend == "vllm") == (tp > 1)
        # a price that shards the training copies comes with the engine that shards them
        zero3 = any(n.startswith("ZeRO-3 sharding") for n in r["notes"])
        engine = ("deepspeed", 3) if zero3 else ("torch", JobConfig().train.zero_stage)
        assert (cfg.train.backend, cfg.train.zero_stage) == engine
        # and the job the overrides describe is priced the same way again
        work = dataclasses.replace(SIM_WORK, grad_accum=cfg.train.grad_accum,
                                   max_staleness=cfg.algo.max_staleness)
        again = predict(placement, LLAMA["7B"], work, DEVICES["H100"], Calibration())
        assert again.zero3 == zero3 and again.step_s == pytest.approx(r["step_s"])
        zero3_rows += zero3
    assert zero3_rows  # 7B's training states (16 bytes/param) fit no H100 unsharded
    for r in rows:
        assert r["runnable"] or (r["notes"] and r["step_s"] is None and not r["overrides"])


def test_a_simulated_job_runs_on_the_engine_its_price_assumes():
    job = sim_job(PlacementConfig(strategy="flattening", devices=2), SIM_WORK)
    p = runnable_placement(job)
    roomy = predict(p, SHAPE, WORK, BIG_MEMORY, Calibration())
    tight = predict(p, SHAPE, WORK, dataclasses.replace(BIG_MEMORY, memory=40e6),
                    Calibration())
    assert not roomy.zero3 and tight.zero3
    plain = priced_job(job, roomy, 2).train
    assert (plain.backend, plain.zero_stage, plain.grad_accum) == ("torch", 2, 2)
    sharded = priced_job(job, tight, 1)
    assert (sharded.train.backend, sharded.train.zero_stage) == ("deepspeed", 3)
    assert runnable_placement(sharded) == p  # `run` executes it as planned


def test_a_row_whose_engine_run_would_refuse_is_refused_not_proposed(monkeypatch):
    real = planner.runnable_placement

    def no_deepspeed(cfg: JobConfig):
        if cfg.train.backend == "deepspeed":
            raise PlacementError(["train.backend: deepspeed is refused here"])
        return real(cfg)
    monkeypatch.setattr(planner, "runnable_placement", no_deepspeed)
    flat = next(r for r in simulate("H100", ["7B"], [8]) if r["strategy"] == "flattening")
    assert not flat["runnable"] and not flat["overrides"] and flat["step_s"] is None
    assert flat["notes"] == ["train.backend: deepspeed is refused here"]


def test_calibration_peak_is_the_faster_of_fp32_and_bf16_matmuls():
    """A config computing in bf16 is fitted against the machine's real peak (bf16 runs up
    to 4x fp32's speed on AVX-512 BF16 CPUs), so its phase efficiencies stay <= 1."""
    from rlhf_async.planning.calibrate import peak_flops

    peaks = peak_flops()
    assert peaks["fp32"] > 0 and peaks["bf16"] > 0
    assert peaks["peak"] == max(peaks["fp32"], peaks["bf16"])
