import time

import pytest

from rlhf_async.config import (
    AlgoConfig,
    GenerationConfig,
    JobConfig,
    PlacementConfig,
    TrainConfig,
    load_config,
)
from rlhf_async.strategies.placement import (
    Placement,
    PlacementError,
    ProcessPlacement,
    validate,
    with_engines,
)
from rlhf_async.strategies.registry import plan_placement, runner_problems
from rlhf_async.strategies.separation.runner import chunks_per_step


def test_separation_defaults_keep_training_apart():
    p = plan_placement(PlacementConfig(strategy="separation", devices=3, generators=2,
                                       scorers=2), "ppo")
    roles = {q.node_id: (q.role, q.devices, q.models) for q in p.processes}
    assert roles["trainer"] == ("trainer", (0,), ("actor", "critic"))
    assert roles["gen0"][1] == (1,) and roles["gen1"][1] == (2,)
    assert {roles["scorer0"][1], roles["scorer1"][1]} == {(1,), (2,)}
    assert "trainer" in p.table() and "cpu:0" in p.table()


def test_separation_uses_every_device_by_default_and_refuses_idle_gpus():
    """One generator and one scorer per device of their group: all 8 GPUs work. A plan
    that gives a process several GPUs (it would use the first) is refused, not run."""
    cfg = JobConfig(placement=PlacementConfig(strategy="separation", device="cuda",
                                              devices=8))
    p = plan_placement(cfg.placement, "ppo")
    used = {d for q in p.processes for d in q.devices}
    assert used == set(range(8)) and all(len(q.devices) == 1 for q in p.processes)
    assert len(p.by_role("generator")) == 7 and len(p.by_role("scorer")) == 7
    assert p.model("shadow_actor").replicas == 7 and "cuda:1-7" not in p.table()
    assert runner_problems(cfg, p) == []
    few = JobConfig(placement=PlacementConfig(strategy="separation", device="cuda",
                                              devices=8, generators=2))
    problems = runner_problems(few, plan_placement(few.placement, "ppo"))
    assert any("placement.generators: gen0 is given devices 1,3,5,7 but a generator "
               "process runs on one; use placement.generators = 7" in x for x in problems)
    on_cpu = JobConfig(placement=PlacementConfig(strategy="separation", devices=8,
                                                 generators=2))  # CPU slots are shared
    assert runner_problems(on_cpu, plan_placement(on_cpu.placement, "ppo")) == []


def test_grpo_trains_no_critic_and_flattening_puts_everything_everywhere():
    p = plan_placement(PlacementConfig(strategy="separation", devices=2), "grpo")
    assert p.by_role("trainer")[0].models == ("actor",)
    f = plan_placement(PlacementConfig(strategy="flattening", devices=2), "ppo")
    assert [q.devices for q in f.processes] == [(0,), (1,)]
    assert all(q.models == ("actor", "critic", "reward", "reference") for q in f.processes)


def test_every_conflict_is_reported_at_once():
    cfg = PlacementConfig(strategy="separation", devices=2, actor=[0], generator=[0, 5],
                          reward=[1], reference=[0])
    with pytest.raises(PlacementError) as e:
        plan_placement(cfg, "ppo")
    text = str(e.value)
    assert "placement.generator: device ids [5]" in text
    assert "placement.reference" in text
    cfg = PlacementConfig(strategy="separation", devices=2, actor=[0], generator=[0])
    with pytest.raises(PlacementError, match="shares device"):
        plan_placement(cfg, "ppo")


def test_interleaving_puts_reference_and_reward_on_exclusive_groups():
    p = plan_placement(PlacementConfig(strategy="interleaving", devices=4), "ppo")
    assert p.model("reference").devices == (0, 1) and p.model("reward").devices == (2, 3)
    assert p.model("actor").devices == (0, 1, 2, 3) and p.model("actor").replicas == 4
    assert next(q.models for q in p.processes) == ("actor", "critic", "reference")
    assert [q.models for q in p.processes][3] == ("actor", "critic", "reward")
    odd = plan_placement(PlacementConfig(strategy="interleaving", devices=3), "grpo")
    assert odd.model("reference").devices == (0, 1) and odd.model("reward").devices == (2,)
    assert odd.model("critic") is None
    text = p.table()
    assert "reference  infer    0-1" in text and "reward     infer    2-3" in text


def test_overrides_apply_to_every_preset():
    over = {"devices": 4, "tensor_parallel": ["reward=2"], "dtype": ["reference=bf16"]}
    for strategy in ("flattening", "interleaving", "separation"):
        extra = {"generator": [1], "reward": [2, 3]} if strategy == "separation" else {}
        p = plan_placement(PlacementConfig(strategy=strategy, **over, **extra), "ppo")
        assert p.model("reference").dtype == "bf16", strategy
        assert p.model("reward").tensor_parallel == 2, strategy
    sep = plan_placement(PlacementConfig(strategy="separation", devices=4,
                                         replicas=["shadow_actor=3"]), "ppo")
    assert len(sep.by_role("generator")) == 3 and sep.model("shadow_actor").replicas == 3


def test_placement_problems_are_all_reported_together():
    cfg = PlacementConfig(strategy="interleaving", devices=4, reward=[0, 1, 2],
                          tensor_parallel=["reward=2", "critic=two"], dtype=["nope=bf16"])
    with pytest.raises(PlacementError) as e:
        plan_placement(cfg, "ppo")
    text = "\n".join(e.value.problems)
    assert "'two' is not an integer" in text and "'nope=bf16' is not MODEL=VALUE" in text
    cfg = PlacementConfig(strategy="interleaving", devices=4, reward=[0, 1, 2],
                          tensor_parallel=["reward=2"])
    with pytest.raises(PlacementError) as e:
        plan_placement(cfg, "ppo")
    assert len(e.value.problems) == 2
    assert "2 does not divide the 3 device(s) of reward (0-2)" in e.value.problems[0]
    assert "also hold the reference" in e.value.problems[1]
    with pytest.raises(PlacementError, match="interleaving needs >= 2 devices"):
        plan_placement(PlacementConfig(strategy="interleaving", devices=1), "ppo")


def test_runner_limits_are_separate_from_plan_validity():
    cfg = JobConfig(placement=PlacementConfig(strategy="flattening", devices=2,
                                              tensor_parallel=["actor=2"]))
    problems = runner_problems(cfg, plan_placement(cfg.placement, "ppo"))
    assert any("actor=2 is not run" in x for x in problems)
    sep = JobConfig(train=TrainConfig(backend="deepspeed"),
                    generation=GenerationConfig(backend="vllm"),
                    placement=PlacementConfig(strategy="separation", devices=2))
    engines = with_engines(plan_placement(sep.placement, "ppo"), "deepspeed", "vllm")
    assert engines.model("actor").backend == "deepspeed"
    assert engines.model("shadow_actor").backend == "vllm"
    assert engines.model("reward").backend == "torch"
    assert runner_problems(sep, plan_placement(sep.placement, "ppo")) == []
    ok = JobConfig(placement=PlacementConfig(strategy="interleaving", devices=2,
                                             dtype=["reference=bf16"]))
    assert runner_problems(ok, plan_placement(ok.placement, "ppo")) == []


def test_each_strategy_reports_what_its_runner_cannot_do():
    flat = JobConfig(train=TrainConfig(prompts_per_step=3),
                     generation=GenerationConfig(backend="vllm"),
                     placement=PlacementConfig(strategy="flattening", devices=2))
    problems = runner_problems(flat, plan_placement(flat.placement, "ppo"))
    assert any("must divide evenly over placement.devices = 2" in p for p in problems)
    # a lock-step rank runs vLLM beside its trainer (strategies/colocated.py)
    assert not any(p.startswith("generation.backend") for p in problems)
    inter = JobConfig(train=TrainConfig(prompts_per_step=2),
                      placement=PlacementConfig(strategy="interleaving", devices=4,
                                                device="cuda", dtype=["actor=fp16"]))
    problems = runner_problems(inter, plan_placement(inter.placement, "ppo"))
    for needle in ("actor=fp16 trains only with loss scaling", "interleaving on cpu only",
                   "2 prompts cannot be shared by 4 devices"):
        assert any(needle in p for p in problems), (needle, problems)
    sep = JobConfig(train=TrainConfig(prompts_per_step=3),
                    placement=PlacementConfig(strategy="separation", devices=3, actor=[0, 1],
                                              generator=[2], replicas=["actor=1"]))
    problems = runner_problems(sep, plan_placement(sep.placement, "ppo"))
    for needle in ("placement.replicas: actor=1; the separation trainer runs one "
                   "data-parallel rank per device of its group (placement.actor: 2 device(s))",
                   "train.prompts_per_step: 3 must divide evenly over the 2 trainer ranks"):
        assert any(needle in p for p in problems), (needle, problems)


def test_separation_trainer_runs_one_rank_per_device_of_its_group():
    cfg = JobConfig(placement=PlacementConfig(strategy="separation", device="cuda",
                                              devices=8, actor=[0, 1, 2, 3]))
    p = plan_placement(cfg.placement, "ppo")
    ranks = p.by_role("trainer")
    assert [(q.node_id, q.devices) for q in ranks] == [
        ("trainer", (0,)), ("trainer1", (1,)), ("trainer2", (2,)), ("trainer3", (3,))]
    assert p.model("actor").replicas == 4 and p.model("critic").replicas == 4
    assert [q.devices for q in p.by_role("generator")] == [(4,), (5,), (6,), (7,)]
    assert runner_problems(cfg, p) == []
    assert "trainer3  trainer    train    cuda:3" in p.table()


def test_separation_cuts_a_step_into_one_chunk_per_generator_unless_scorers_stand_apart():
    """Two chunks per generator only pay in synchronous steps where a scorer can score one
    on its own device while the next is generated; on a shared device they would take
    turns, and with staleness the next step's generation overlaps already."""
    cfg = JobConfig(train=TrainConfig(prompts_per_step=8))
    shared = plan_placement(PlacementConfig(strategy="separation", devices=3), "grpo")
    assert chunks_per_step(cfg, shared) == 2  # two generators, each with a scorer beside
    apart = plan_placement(PlacementConfig(strategy="separation", devices=4, generator=[1, 2],
                                           reward=[3], reference=[3]), "grpo")
    assert {q.devices for q in apart.by_role("scorer")} == {(3,)}
    assert chunks_per_step(cfg, apart) == 4
    few = JobConfig(train=TrainConfig(prompts_per_step=3))
    assert chunks_per_step(few, apart) == 3  # never more chunks than prompts
    stale = JobConfig(train=TrainConfig(prompts_per_step=8), algo=AlgoConfig(max_staleness=1))
    assert chunks_per_step(stale, apart) == 2


def test_separation_scorers_may_share_the_trainers_devices_generators_may_not():
    """A scorer beside the trainer time-shares its device (where training leaves it idle);
    a generator there is refused, saying what is allowed."""
    p = plan_placement(PlacementConfig(strategy="separation", devices=2, reward=[0],
                                       reference=[0]), "grpo")
    assert [(q.role, q.devices) for q in p.processes] == [
        ("trainer", (0,)), ("generator", (1,)), ("scorer", (0,))]
    assert runner_problems(JobConfig(placement=PlacementConfig(
        strategy="separation", devices=2, reward=[0], reference=[0])), p) == []
    with pytest.raises(PlacementError, match="scorers may share the trainer's devices"):
        plan_placement(PlacementConfig(strategy="separation", devices=2, generator=[0, 1]),
                       "grpo")


def test_validating_a_huge_placement_takes_linear_time():
    """placement.devices = 100000 once took minutes in validate (a count per node id)."""
    n = 50_000
    procs = tuple(ProcessPlacement(f"rank{i}", "worker", ("actor", "reward", "reference"),
                                   (i,), "train") for i in range(n))
    twice = (*procs, procs[7])
    t0 = time.perf_counter()
    problems = validate(Placement("flattening", "cpu", n, twice), ["worker"])
    assert problems == ["placement: node id 'rank7' used twice"]
    assert time.perf_counter() - t0 < 5.0


def test_a_bare_dtype_is_every_models_and_a_models_own_overrides_it():
    cfg = load_config(None, ["placement.strategy=separation", "placement.devices=2",
                             "placement.dtype=bf16"])  # one value for the list: a list of one
    assert cfg.placement.dtype == ["bf16"]
    plan = plan_placement(cfg.placement, "ppo")
    assert {m.model: m.dtype for m in plan.models} == {m.model: "bf16" for m in plan.models}
    mixed = plan_placement(PlacementConfig(strategy="separation", devices=2,
                                           dtype=["shadow_actor=fp32", "bf16"]), "ppo")
    assert mixed.precision().name("shadow_actor") == "fp32"
    assert mixed.precision().name("actor") == mixed.precision().name("reward") == "bf16"
    with pytest.raises(PlacementError, match=r"placement.dtype\[1\]: 'bf17' is not MODEL=VALUE "
                       r"with MODEL one of .*, or one of fp32, bf16, fp16 for every model"):
        plan_placement(PlacementConfig(dtype=["bf16", "bf17"]), "ppo")
