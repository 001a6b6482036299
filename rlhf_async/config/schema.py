"""Typed job configuration: nested dataclasses, loaded from TOML with dotted overrides.

Every problem (unknown key, wrong type, bad value) is collected and raised together in one
`ConfigError` (`load.py`). `configs/reference.toml` is rendered from these classes
(`reference.py`), so the two cannot drift. `[algo]` lives with its presets (`presets.py`);
`opt` and `ConfigError` in `fields.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rlhf_async.config.fields import opt
from rlhf_async.config.presets import AlgoConfig
from rlhf_async.config.sim import SimConfig
from rlhf_async.config.task import TASK_DEFAULTS, TaskConfig

# re-exported: config/task.py, config/sim.py
__all__ = ["TASK_DEFAULTS", "SimConfig", "TaskConfig"]

@dataclass
class RunConfig:
    name: str = opt("", "run directory name under output_dir; empty = a UTC timestamp")
    seed: int = opt(0, "seed for every keyed random stream (sampling, shuffling, init)", ge=0)
    output_dir: str = opt("runs", "where run directories are created")
    cache_dir: str = opt("runs/cache", "where SFT and reward-model artefacts are cached")
    eval_prompts: int = opt(256, "held-out prompts for the SFT-vs-final comparison", ge=1)
    eval_samples: int = opt(1, "sampled responses per held-out prompt, averaged: more give a "
                            "steadier score on a small held-out set", ge=1)
    progress: bool = opt(True, "print a compact progress line per step to stderr")
    plot: bool = opt(True, "write metrics.png at the end of the run")
    checkpoint_every: int = opt(10, "checkpoint every N RL steps (and on stop); 0 = on stop only",
                                ge=0)
    keep_checkpoints: int = opt(3, "newest checkpoints kept in RUN_DIR/checkpoints", ge=1)
    max_failed_steps: int = opt(3, "stop the run (with a checkpoint) after this many steps "
                                "in a row whose every episode failed (an agent or "
                                "environment that fails trains nothing)", ge=1)
    report_to: list[str] = opt([], "also report metrics to: tensorboard (RUN_DIR/"  # noqa: RUF009
                               "tensorboard), wandb (WANDB_MODE=offline works offline)")
    eval_every: int = opt(0, "evaluate on the held-out prompts (run.eval_prompts) every N "
                          "RL steps: eval_* fields in that step's metrics record; 0 = before "
                          "and after the run only", ge=0)
    keep_best: bool = opt(False, "with run.eval_every: keep the best policy so far by "
                          "run.best_metric in RUN_DIR/best")
    best_metric: str = opt("", "what run.keep_best ranks by (higher is better); empty = "
                           "hidden_score where the task has one, else reward",
                           choices=("", "hidden_score", "reward"))
    log_samples: int = opt(4, "per step, this many trained samples (prompt, response, "
                           "reward, advantage, weight version) as text in "
                           "RUN_DIR/samples.jsonl; 0 = none", ge=0)


@dataclass
class ModelConfig:
    path: str = opt("", "the actor's Hugging Face model: a local directory, or a hub id "
                    "(org/name) already in the local HF cache; empty = built-in")
    arch: str = opt("gpt2", "architecture of the built-in tiny model", choices=("gpt2", "llama"))
    hidden: int = opt(64, "hidden size of the built-in model", ge=8)
    layers: int = opt(2, "transformer layers of the built-in model", ge=1)
    heads: int = opt(4, "attention heads of the built-in model", ge=1)
    dropout: float = opt(0.0, "dropout of the built-in model (in RL only with "
                         "train.disable_dropout = false)", ge=0.0, le=0.9)
    max_positions: int = opt(64, "context length of the built-in model", ge=8)


@dataclass
class SFTConfig:
    steps: int = opt(250, "supervised fine-tuning steps (built-in task: before RL; "
                     "`rlhf-async sft`: on sft.data)", ge=0)
    batch_size: int = opt(64, "demonstrations per SFT step", ge=1)
    lr: float = opt(3e-3, "SFT learning rate (the built-in model's; unset with model.path: "
                    "scaled to its size, config/sizing.py; 135M: 8.4e-5)",
                    gt=0.0)
    data: str = opt("", "`rlhf-async sft`: your demonstrations, any source task.prompts "
                    "takes; rows of prompt_key + response_key, or messages_key")
    split: str = opt("train", "the split of sft.data to use, when it has splits")
    prompt_key: str = opt("prompt", "sft.data: the prompt column")
    response_key: str = opt("response", "sft.data: the response column (the loss is on it)")
    messages_key: str = opt("messages", "sft.data: the chat column used when a row has no "
                            "prompt_key; the last turn, an assistant one, is the response")
    max_tokens: int = opt(1024, "sft.data: longest prompt + response (tokens); a longer "
                          "response is cut", ge=2)


@dataclass
class RewardModelConfig:
    path: str = opt("", "a trained reward model (AutoModelForSequenceClassification, "
                    "num_labels = 1, the policy's tokenizer): a local directory or a cached "
                    "hub id; text task only; it also starts PPO's critic. Empty = the task's "
                    "own (built-in: trained here; text: the task.reward rule)")
    weight: float = opt(1.0, "weight of reward_model.path's score in the reward", ge=0.0)
    steps: int = opt(1200, "Bradley-Terry training steps", ge=0)
    batch_size: int = opt(64, "preference pairs per step", ge=1)
    lr: float = opt(1e-3, "reward-model learning rate (the built-in model's; unset with "
                    "model.path: scaled to its size, config/sizing.py; 135M: 2.8e-5)", gt=0.0)
    label_noise: float = opt(0.05, "temperature of the noisy labeller: P(a>b)=sigmoid(dh/t)",
                             gt=0.0)
    heldout_pairs: int = opt(1024, "held-out pairs for reward-model accuracy (built-in "
                             "task)", ge=1)
    data: str = opt("", "`rlhf-async rm`: your preference pairs, any source task.prompts "
                    "takes; rows of prompt_key + chosen_key + rejected_key (strings, or chat "
                    "lists whose last turn is the response); ~1 in 8 held out")
    split: str = opt("train", "the split of reward_model.data to use, when it has splits")
    prompt_key: str = opt("prompt", "reward_model.data: the prompt column (may be absent "
                          "when chosen/rejected are chat lists)")
    chosen_key: str = opt("chosen", "reward_model.data: the preferred response's column")
    rejected_key: str = opt("rejected", "reward_model.data: the other response's column")
    max_tokens: int = opt(1024, "reward_model.data: longest prompt + response (tokens); a "
                          "longer response is cut", ge=2)


@dataclass
class CriticConfig:
    path: str = opt("", "PPO's initial critic: a sequence classifier with one label on the "
                    "policy's tokenizer (as reward_model.path), a directory or a cached hub "
                    "id; text task only. Empty = the reward model (reward_model.path, or the "
                    "built-in task's), else the policy's trunk with a fresh value head")


@dataclass
class TeacherConfig:
    path: str = opt("", "on-policy distillation's teacher: a causal LM (a directory or a "
                    "cached hub id) on the student's tokenizer and vocabulary, frozen, placed "
                    "and held like the reference model (its dtype: placement.dtype's "
                    "reference=; devices of its own: placement.teacher); needed by "
                    "algo.name = 'distill' and algo.distill_coef > 0")


@dataclass
class GenerationConfig:
    max_new_tokens: int = opt(8, "response length limit (tokens, EOS included); with an "
                              "environment, of each policy turn", ge=1)
    compile: str = opt("auto", "our torch engine's decode step compiled by torch.compile "
                       "(inductor; GPT-2 and Llama shapes): on, off, or auto = on CPU when the run "
                       "decodes enough steps to repay the warm-up (logged)",
                       choices=("auto", "on", "off"))
    max_episode_tokens: int = opt(32, "with an environment: an episode's tokens after its "
                                  "prompt, every turn's (policy and environment)", ge=1)
    temperature: float = opt(1.0, "sampling temperature (also used for training log-probs)",
                             gt=0.0)
    top_k: int = opt(0, "sample from the k most likely tokens; 0 = all", ge=0)
    top_p: float = opt(1.0, "sample from the smallest set of tokens whose probability "
                       "reaches top_p (nucleus); 1 = all", gt=0.0, le=1.0)
    min_new_tokens: int = opt(0, "tokens before EOS or a stop token may end a response",
                              ge=0)
    stop_token_ids: list[int] = opt([], "token ids that end a response like EOS does "  # noqa: RUF009
                                    "(kept in it, e.g. <|im_end|>)")
    stop_strings: list[str] = opt([], "strings that end a response at the token completing "  # noqa: RUF009
                                  "one (kept in it; task.name = 'text')")
    backend: str = opt("auto", "generation engine of separation's generators, and beside "
                       "each flattening/interleaving rank when not torch (ours, which there "
                       "generates with the rank's actor itself): a name in engines.ENGINES "
                       "(one module each behind engines/interface.py; checked before the "
                       "run, an unknown one listing them) or auto. auto (by the tokens/s in "
                       "bench/README.md): torch for the built-in model; for model.path, the "
                       "first of engines.AUTO_ORDER installed here that can run the job "
                       "(device, head size, stop strings), else torch")
    dtype: str = opt("", "what Flattening and Interleaving generate in (the actor's own "
                     "weights, under autocast); '' = the actor's dtype (placement.dtype). On "
                     "CPU narrow models generate faster in fp32 while they train in bf16 "
                     "(bench/README.md). Separation's generators use placement.dtype "
                     "shadow_actor=...", choices=("", "fp32", "bf16"))
    partial_rollout: bool = opt(False, "separation: a generator commits a newly published "
                                "weight version between two decode steps of its running "
                                "requests (in-flight update; an engine that cannot keep them "
                                "aborts and resubmits them with what they generated) "
                                "instead of after its chunk; each token records its "
                                "version (token_versions), the "
                                "rollout's version is its oldest token's, and "
                                "algo.max_staleness bounds that one")
    continuous_batching: bool = opt(False, "with partial_rollout: a generator keeps up to "
                                    "batch_slots rows decoding; a finished row's slot "
                                    "takes the next waiting prompt (of this chunk or a "
                                    "later one) at once, and a chunk goes out as soon as "
                                    "its last row ends (long-tailed lengths)")
    batch_slots: int = opt(0, "continuous_batching: rows a generator decodes at once; 0 = "
                           "the rows of one chunk", ge=0)
    prefix_cache_mb: int = opt(512, "torch engine, multi-turn episodes (task.env): MiB of "
                               "KV kept from finished turns (least recently used out "
                               "first), so that an episode's next turn prefills only its "
                               "new tokens; KV is reused only under the weights that "
                               "computed it (a commit drops it); 0 = off, every turn "
                               "prefills its whole conversation", ge=0)


@dataclass
class TrainConfig:
    steps: int = opt(100, "RL steps (one global batch each)", ge=1)
    prompts_per_step: int = opt(32, "prompts per global batch (x group_size samples)", ge=1)
    epochs: int = opt(2, "passes over each batch", ge=1)
    minibatches: int = opt(2, "optimizer steps per epoch", ge=1)
    lr: float = opt(5e-4, "actor learning rate (the built-in model's; unset with "
                    "model.path: scaled to its size, config/sizing.py; 135M: 1.4e-5, 7B: "
                    "1.9e-6; x10 with LoRA)", gt=0.0)
    critic_lr: float = opt(1e-3, "critic learning rate (ppo; the built-in model's; unset "
                           "with model.path: scaled as train.lr, 135M: 2.8e-5)", gt=0.0)
    lr_schedule: str = opt("constant", "learning rate over the RL steps, for actor and "
                           "critic, after the warm-up: constant, linear (to 0 at "
                           "train.steps), cosine (to 0 at train.steps)",
                           choices=("constant", "linear", "cosine"))
    warmup_steps: int = opt(0, "RL steps over which the learning rate rises linearly from "
                            "lr / warmup_steps to lr", ge=0)
    grad_clip: float = opt(1.0, "global gradient-norm clip; 0 = off", ge=0.0)
    weight_decay: float = opt(0.0, "AdamW weight decay", ge=0.0)
    publish_every: int = opt(1, "publish weights to generators every N steps", ge=1)
    backend: str = opt("torch", "training engine for actor and critic: a name in "
                       "engines.TRAINING_BACKENDS (checked before the run, an unknown one "
                       "listing them; one that needs an extra names it; sim = simulated "
                       "devices', placement.device = sim)")
    zero_stage: int = opt(2, "DeepSpeed ZeRO stage (train.backend = deepspeed)",
                          choices=(1, 2, 3))
    grad_accum: int = opt(1, "micro-batches per minibatch (gradient accumulation)", ge=1)
    max_tokens_per_microbatch: int = opt(0, "cut each minibatch into micro-batches by this "
                                         "many tokens (prompt + response; padding counts "
                                         "where rows are not packed) instead of by rows, "
                                         "long rows together; rows packed without padding "
                                         "where the model allows; a row over it trains "
                                         "alone; 0 = off (train.grad_accum rows)", ge=0)
    disable_dropout: bool = opt(True, "zero every dropout of actor and critic for RL (as TRL "
                                "and OpenRLHF do): dropout noise is not keyed, so a step "
                                "would depend on the placement (GPT-2 configs default to "
                                "0.1)")
    gradient_checkpointing: bool = opt(False, "recompute actor and critic activations in "
                                       "the backward pass instead of keeping them (less "
                                       "memory, ~30% more compute)")


@dataclass
class LoraConfig:
    rank: int = opt(0, "LoRA rank: train low-rank adapters (peft, extra [lora]) instead of "
                    "every weight of the actor (and critic); 0 = off, full fine-tuning", ge=0)
    alpha: int = opt(16, "LoRA alpha: an adapter adds B @ A * alpha / rank to its layer",
                     ge=1)
    dropout: float = opt(0.0, "dropout on the adapters' inputs (only with "
                         "train.disable_dropout = false, which otherwise zeroes it)",
                         ge=0.0, le=0.9)
    target_modules: list[str] = opt(["all-linear"], "layers that get adapters: names or "  # noqa: RUF009
                                    "name suffixes (e.g. ['q_proj', 'v_proj']; GPT-2: "
                                    "c_attn, c_proj, c_fc), or ['all-linear'] = every linear "
                                    "layer but the LM head")
    critic: bool = opt(True, "PPO's critic trains adapters too (its value head trains "
                       "whole); false = the critic is fully fine-tuned")


@dataclass
class WeightSyncConfig:
    bucket_mb: float = opt(100.0, "flattened bucket size for weight broadcasts (MB)", gt=0.0)
    backend: str = opt("auto", "collective for the broadcast; auto = nccl on cuda, else gloo",
                       choices=("auto", "gloo", "nccl"))
    timeout_s: float = opt(60.0, "limit for joining the group and for each transfer (s)",
                           gt=0.0)
    delta: str = opt("auto", "send only the changed values to generators holding the last "
                     "version (full after a restart or regroup; ~4% of full in GRPO); auto "
                     "= off: the codec costs ~1 s per 269 MB, so it pays only on links "
                     "under ~2 Gb/s (set on there; bench/README.md)",
                     choices=("auto", "on", "off"))


@dataclass
class RuntimeConfig:
    time_to_dead: float = opt(10.0, "seconds without a heartbeat before a node is dead; nodes "
                              "beat every fifth of it, so a hung node is declared dead at most "
                              "time_to_dead + 0.5 s after it hangs, and killed and restarted",
                              gt=0.0)
    restart_limit: int = opt(3, "consecutive restarts of a node before the run stops with a "
                             "checkpoint; a node healthy for stable_after_s has its count reset",
                             ge=0)
    stable_after_s: float = opt(300.0, "seconds a restarted node must stay ready and heard "
                                "from before its consecutive-failure count starts over (so a "
                                "long job survives rare deaths; a crash loop still stops it)",
                                gt=0.0)
    step_deadline_s: float = opt(1800.0, "seconds one generation, scoring or training step of a "
                                 "separation node may take; a node past it (a hung kernel) "
                                 "stops its heartbeats and is restarted like a dead one. A "
                                 "weight broadcast's deadline is 2 x weight_sync.timeout_s",
                                 gt=0.0)
    stop_grace_s: float = opt(60.0, "after a stop (SIGTERM, SIGINT, `rlhf-async stop`), "
                              "seconds to finish the step and write the checkpoint; a "
                              "second signal cuts it short", gt=0.0)
    ready_timeout_s: float = opt(120.0, "seconds a node process may take to start and load "
                                 "its models (separation), and a multi-rank trainer's "
                                 "ranks to form their group", gt=0.0)
    node_start: str = opt("fork", "how node processes (separation) and rank processes "
                          "(flattening, interleaving) start on this host: fork = forked from "
                          "a server that imported torch and the node programs once (starts "
                          "and restarts in well under a second); exec = a fresh interpreter "
                          "each", choices=("fork", "exec"))


@dataclass
class PlacementConfig:
    strategy: str = opt("flattening", "placement strategy: auto, or one registered in "
                        "rlhf_async/strategies/registry.py (`rlhf-async plan` lists them)")
    device: str = opt("cpu", "device kind; sim = simulated GPUs (placement.gpu, [sim]): every "
                      "node runs its real program, the model math is timed by the cost "
                      "model (docs/howto/twin.md)", choices=("cpu", "cuda", "sim"))
    devices: int = opt(1, "devices (CPU slots or GPUs) for the job", ge=1)
    cpu_threads: int = opt(1, "torch threads per process on CPU (tiny models run best on 1)",
                           ge=1)
    flush_denormal: bool = opt(True, "every process computing on CPU reads and writes subnormal "
                               "floats (below ~1.2e-38 in fp32) as zero: x86 takes a slow "
                               "path on them, and a trainer's step ran ~1.7x slower on the "
                               "attention's subnormal gradients; false = IEEE subnormals")
    actor: list[int] = opt([], "explicit device ids for the actor; empty = strategy decides")  # noqa: RUF009
    critic: list[int] = opt([], "explicit device ids for the critic")  # noqa: RUF009
    reward: list[int] = opt([], "explicit device ids for the reward model")  # noqa: RUF009
    reference: list[int] = opt([], "explicit device ids for the reference model")  # noqa: RUF009
    teacher: list[int] = opt([], "explicit device ids for the distillation teacher "  # noqa: RUF009
                             "(teacher.path; separation: scorer i holds it on "
                             "teacher[i mod n] instead of its own device, e.g. a teacher "
                             "larger than the reference on a GPU of its own); empty = with "
                             "the reference")
    generator: list[int] = opt([], "explicit device ids for generator shadows (separation)")  # noqa: RUF009
    generators: int = opt(0, "generator replicas (separation); 0 = one per device of the "
                          "generator group", ge=0)
    scorers: int = opt(0, "scorer replicas, each holding reward + reference (separation); "
                       "0 = one per device of the scorer group", ge=0)
    replicas: list[str] = opt([], "per-model data-parallel replicas, e.g. ['reward=2']")  # noqa: RUF009
    tensor_parallel: list[str] = opt([], "per-model tensor-parallel size, e.g. ['actor=2']")  # noqa: RUF009
    dtype: list[str] = opt([], "per-model dtype, e.g. ['reference=bf16'] (fp32 | bf16 | "  # noqa: RUF009
                           "fp16); a bare one is every model's: ['bf16', 'shadow_actor=fp32']")
    memory_gb: float = opt(0.0, "per-device memory budget for validation (GiB); 0 = the "
                           "device's own", ge=0.0)
    gpu: str = opt("H100", "GPU kind the cost model assumes when device = cuda, and that "
                   "device = sim simulates",
                   choices=("A100", "H100", "H200"))
    calibration: str = opt("", "calibration JSON from `rlhf-async plan --calibrate`; empty = "
                           "the built-in one")
    peak_flops: float = opt(0.0, "one device's peak FLOP/s in the actor's dtype, what mfu/* "
                            "metrics divide by; 0 = resolved when the run starts (and written "
                            "in its config.json): placement.calibration's measured peak, the "
                            "GPU's data sheet, or a short matmul measurement on CPU", ge=0.0)
    rebalance: bool = opt(False, "separation: move a device between generators and scorers "
                          "while the job runs when measured stage times predict a faster step")
    rebalance_every: int = opt(5, "steps of stage times each rebalancing decision averages; "
                               "also the least steps between two moves", ge=1)
    rebalance_gain: float = opt(0.1, "the predicted step-time gain (a fraction) a move must "
                                "pass (0 < gain < 1)", gt=0.0, le=0.99)
    launcher: str = opt("local", "who starts the node processes (separation): local = this "
                        "machine; ray = a Ray cluster places them (the [ray] extra; see [ray])",
                        choices=("local", "ray"))


@dataclass
class RayConfig:
    address: str = opt("auto", "placement.launcher = ray: the cluster to join (auto = the "
                       "running one, as `ray start` left it or RAY_ADDRESS names it; "
                       "HOST:PORT; or local = start one in this process)")
    placement_strategy: str = opt("PACK", "how the job's placement group (one bundle per "
                                  "device) spreads over the Ray nodes",
                                  choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
    placement_timeout_s: float = opt(60.0, "longest wait for the placement group's "
                                     "resources (s); past it the run stops with what is "
                                     "missing", gt=0.0)


@dataclass
class JobConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    sim: SimConfig = field(default_factory=SimConfig)


def weight_sync_backend(cfg: JobConfig) -> str:
    """The collective the weight broadcast uses: `weight_sync.backend`, with auto resolved."""
    if cfg.weight_sync.backend != "auto":
        return cfg.weight_sync.backend
    return collective_backend(cfg.placement.device)


def weight_sync_delta(cfg: JobConfig) -> bool:
    """Whether weight updates go as deltas: `weight_sync.delta`, with auto resolved (off:
    on a GPU host the codec took 0.66 s to encode and 0.34 s to decode a 269 MB update, a
    full update over NVLink or InfiniBand takes milliseconds, over gloo 0.44 s)."""
    return cfg.weight_sync.delta == "on"


def collective_backend(device: str) -> str:
    """The torch.distributed backend for a device kind ("cuda", "cpu", "cuda:1")."""
    return "nccl" if device.startswith("cuda") else "gloo"


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
