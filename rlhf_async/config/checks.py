"""Cross-field checks of a parsed `JobConfig` (each field's own type and range are checked
in `load.py` while parsing); every problem is one line naming its key."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from rlhf_async.config.presets import distills, resolve, with_critic
from rlhf_async.config.schema import JobConfig
from rlhf_async.config.task_checks import (
    episode_checks,
    has_env,
    reward_spec_problems,
    text_task_checks,
)


def cross_checks(cfg: JobConfig) -> list[str]:
    """Problems that involve several fields (each field alone already parsed)."""
    out = []
    name = cfg.run.name
    if name in (".", "..") or any(c in name for c in "/\\\0"):
        out.append(f"run.name: {name!r} must name one directory inside run.output_dir (no "
                   "'/', '\\', '.' or '..')")
    if cfg.task.min_len > cfg.task.max_len:
        out.append(f"task.min_len: {cfg.task.min_len} exceeds task.max_len {cfg.task.max_len}")
    out.extend(_length_tail_checks(cfg))
    out.extend(_algo_checks(cfg))
    out.extend(reward_spec_problems(cfg.task.reward))
    # (what only some strategies do, placement.rebalance, generation.partial_rollout and
    # algo.max_staleness > 0, is checked with the placement: strategies.registry.FEATURES)
    if cfg.algo.dynamic_sampling and cfg.algo.group_size < 2:
        out.append("algo.dynamic_sampling: drops groups whose rewards are all equal; it "
                   "needs algo.group_size >= 2 (a group of one never varies)")
    if cfg.task.name == "text":
        out.extend(text_task_checks(cfg))
    elif cfg.task.name == "sort_digits" and cfg.generation.max_new_tokens < cfg.task.max_len + 1:
        out.append(f"generation.max_new_tokens: {cfg.generation.max_new_tokens} cannot hold "
                   f"a full answer; needs >= task.max_len + 1 = {cfg.task.max_len + 1}")
    samples = cfg.train.prompts_per_step * cfg.algo.group_size
    if samples < cfg.train.minibatches:
        out.append(f"train.minibatches: {cfg.train.minibatches} exceeds the {samples} samples "
                   "per step")
    if cfg.train.max_tokens_per_microbatch and cfg.train.grad_accum > 1:
        out.append(f"train.grad_accum: {cfg.train.grad_accum} micro-batches by rows, and "
                   f"train.max_tokens_per_microbatch = {cfg.train.max_tokens_per_microbatch} "
                   "by tokens: set one (grad_accum = 1, or max_tokens_per_microbatch = 0)")
    if cfg.model.path:
        out.extend(model_dir_problems("model.path", cfg.model.path))
    # (the engines' names and extras are checked against their registries before the run:
    # engines.engine_name_problems, engines.extra_problems)
    out.extend(_scalar_model_checks(cfg))
    out.extend(_lora_checks(cfg))
    out.extend(_sim_checks(cfg))
    out.extend(_ray_checks(cfg))
    for name in cfg.run.report_to:
        if name not in ("tensorboard", "wandb"):
            out.append(f"run.report_to: unknown {name!r}; accepted: tensorboard, wandb")
        elif importlib.util.find_spec(name) is None:
            out.append(f"run.report_to: {name} is not installed (pip install "
                       f"'rlhf-async[{name}]')")
    g = cfg.generation
    if g.min_new_tokens >= g.max_new_tokens:
        out.append(f"generation.min_new_tokens: {g.min_new_tokens} leaves no token where a "
                   f"response may end; needs < generation.max_new_tokens = {g.max_new_tokens}")
    if any(t < 0 for t in g.stop_token_ids):
        out.append(f"generation.stop_token_ids: {g.stop_token_ids} holds a negative id")
    if g.stop_strings:
        out.extend(_stop_string_checks(cfg))
    if cfg.model.hidden % cfg.model.heads:
        out.append(f"model.hidden: {cfg.model.hidden} must be divisible by model.heads")
    out.extend(_context_checks(cfg))
    out.extend(episode_checks(cfg))
    out.extend(_partial_rollout_checks(cfg))
    out.extend(_eval_checks(cfg))
    return out


def _length_tail_checks(cfg: JobConfig) -> list[str]:
    """task.long_fraction splits sort_digits' prompt lengths at task.short_len."""
    t = cfg.task
    if t.long_fraction == 0:
        return []
    if t.name != "sort_digits":
        return [f"task.long_fraction: shapes the prompt lengths of sort_digits only; "
                f"task.name is {t.name!r} (accepted here: 0)"]
    if not t.min_len <= t.short_len < t.max_len:
        return [f"task.short_len: {t.short_len} must lie in [task.min_len, task.max_len) = "
                f"[{t.min_len}, {t.max_len}) when task.long_fraction > 0 (short prompts are "
                "min_len..short_len digits, long ones short_len+1..max_len)"]
    return []


def _partial_rollout_checks(cfg: JobConfig) -> list[str]:
    """`generation.partial_rollout`: any engine (one that cannot keep requests across an
    update has them aborted and resubmitted), single-turn responses; whether the strategy
    does it is asked of the strategy (strategies.registry.FEATURES)."""
    if not cfg.generation.partial_rollout:
        return ["generation.continuous_batching: needs generation.partial_rollout = true "
                "(rows of the next chunk decode beside the running chunk's, so new weights "
                "come in between two decode steps)"] if cfg.generation.continuous_batching \
            else []
    out = []
    if has_env(cfg):
        out.append("generation.partial_rollout: not supported with multi-turn episodes "
                   "(task.env / task.agent / task.name = 'calculator'): each turn is its "
                   "own generation; set generation.partial_rollout = false")
    return out


def _eval_checks(cfg: JobConfig) -> list[str]:
    """`run.eval_every` evaluates on the one process holding a whole actor; `keep_best`
    needs evaluations to rank."""
    r, out = cfg.run, []
    if r.keep_best and not r.eval_every:
        out.append("run.keep_best: needs run.eval_every > 0 (the policies it ranks are "
                   "the ones evaluated during the run)")
    no_rule = cfg.task.name == "text" and not cfg.task.reward and not cfg.task.env \
        and not cfg.task.agent
    if r.best_metric == "hidden_score" and no_rule:
        out.append("run.best_metric: 'hidden_score' is task.reward's score, and this text "
                   "task has none; accepted here: reward (or empty)")
    if r.eval_every and cfg.train.backend == "deepspeed" and cfg.train.zero_stage == 3:
        out.append("run.eval_every: evaluating during RL samples from one rank's whole "
                   "actor, which ZeRO-3 shards; set run.eval_every = 0 (the final policy is "
                   "still evaluated) or train.zero_stage <= 2")
    return out


def _sim_checks(cfg: JobConfig) -> list[str]:
    """Simulated devices run the simulated engines, and only those."""
    sim, out = cfg.placement.device == "sim", []
    if sim != (cfg.train.backend == "sim"):
        out.append(f"train.backend: {cfg.train.backend!r} with placement.device = "
                   f"{cfg.placement.device!r}; simulated devices train with 'sim', and only "
                   "they do")
    if sim and cfg.generation.backend not in ("auto", "sim"):
        out.append(f"generation.backend: {cfg.generation.backend!r} on simulated devices; "
                   "accepted: auto or sim")
    if not sim and cfg.generation.backend == "sim":
        out.append("generation.backend: sim generates on simulated devices only "
                   "(placement.device = 'sim')")
    if sim and cfg.placement.strategy not in ("separation", "auto"):
        out.append(f"placement.strategy: {cfg.placement.strategy!r} on simulated devices; "
                   "this build simulates separation")
    if sim and cfg.placement.launcher != "local":
        out.append("placement.launcher: simulated devices run on this machine (local)")
    return out


def _lora_checks(cfg: JobConfig) -> list[str]:
    """LoRA (`lora.rank` > 0): peft installed, the torch training engine, some targets."""
    lora = cfg.lora
    out: list[str] = []
    if not lora.rank:
        return out
    if importlib.util.find_spec("peft") is None:
        out.append("lora.rank: LoRA needs peft, which is not installed (pip install "
                   "'rlhf-async[lora]'); or lora.rank = 0 for full fine-tuning")
    if cfg.train.backend != "torch":
        out.append(f"lora.rank: LoRA trains with train.backend = 'torch' only; "
                   f"train.backend = {cfg.train.backend!r} with adapters is not supported "
                   "(the adapters' optimizer state is small: ZeRO has little to shard)")
    if not lora.target_modules or any(not t for t in lora.target_modules):
        out.append(f"lora.target_modules: {lora.target_modules} names no layer; accepted: "
                   "layer names or suffixes, or ['all-linear']")
    return out


def _ray_checks(cfg: JobConfig) -> list[str]:
    """placement.launcher = ray: Ray installed, and a cluster named."""
    if cfg.placement.launcher != "ray":
        return []
    out = []
    if importlib.util.find_spec("ray") is None:
        out.append("placement.launcher: ray is not installed (pip install 'rlhf-async[ray]'); "
                   "accepted here: local")
    if not cfg.ray.address:
        out.append("ray.address: empty; accepted: auto, local, or the cluster's HOST:PORT")
    return out


def model_context(cfg: JobConfig) -> tuple[int, str] | None:
    """The actor's context length and where it comes from; None when the model's config
    cannot be read (loading the model reports that)."""
    if not cfg.model.path:
        return cfg.model.max_positions, "model.max_positions"
    path = Path(cfg.model.path) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "n_positions"):
        if isinstance(hf.get(key), int):
            return hf[key], f"{key} in {path}"
    return None


def _context_checks(cfg: JobConfig) -> list[str]:
    """The longest prompt plus a full response must fit the model's positions (past them a
    GPT-2 position embedding raises an IndexError mid-generation). With
    `task.max_prompt_tokens = 0` the text task checks its data's longest prompt when it
    loads it (`TextTask`)."""
    if cfg.task.name == "text":
        if not cfg.task.max_prompt_tokens:
            return []
        prompt, prompt_key = cfg.task.max_prompt_tokens, "task.max_prompt_tokens"
    elif cfg.task.name == "calculator":
        prompt, prompt_key = 7, "a calculator prompt"
    else:
        prompt, prompt_key = cfg.task.max_len + 2, "task.max_len + 2"
    problem = context_problem(cfg, prompt, prompt_key)
    return [] if problem is None else [problem]


def context_problem(cfg: JobConfig, prompt: int, prompt_key: str) -> str | None:
    """The problem when a prompt of `prompt` tokens (from `prompt_key`) plus the new tokens
    (`generation.max_new_tokens`, or `max_episode_tokens` for episodes) exceeds the actor's
    context; None when it fits or the context cannot be read."""
    found = model_context(cfg)
    if found is None:
        return None
    context, source = found
    key = "generation.max_episode_tokens" if has_env(cfg) else "generation.max_new_tokens"
    new = cfg.generation.max_episode_tokens if has_env(cfg) else cfg.generation.max_new_tokens
    if prompt + new <= context:
        return None
    return (f"{key}: a prompt of up to {prompt} tokens ({prompt_key}) plus {new} new tokens "
            f"needs {prompt + new} positions, over the model's context of {context} "
            f"({source}); accepted: prompt + {key.split('.')[1]} <= {context}")


def _stop_string_checks(cfg: JobConfig) -> list[str]:
    """Stop strings are matched on decoded text, with the text task's tokenizer (whether the
    generation engine can match them is its capability: strategies.registry)."""
    key, out = "generation.stop_strings", []
    if "" in cfg.generation.stop_strings:
        out.append(f"{key}: holds an empty string, which would end every response at its "
                   "first token; remove it")
    if cfg.task.name != "text":
        out.append(f"{key}: task.name = {cfg.task.name!r} has no text to match them in; "
                   "they need task.name = 'text' (here: generation.stop_token_ids)")
    return out


def _algo_checks(cfg: JobConfig) -> list[str]:
    a, recipe = cfg.algo, resolve(cfg.algo)
    out = []
    if recipe.needs_groups and a.group_size < 2:
        why = f"adv_norm = {a.adv_norm!r}" if a.adv_norm == "group" else a.name
        out.append(f"algo.group_size: {why} needs >= 2 responses per prompt")
    if recipe.has_critic and recipe.adv_norm == "group":
        out.append("algo.adv_norm: ppo's advantages are per token, normalised over the "
                   "batch or not at all; accepted: batch, none")
    if a.is_cap > 0 and a.mismatch != "none":
        out.append("algo.is_cap: the older name of algo.mismatch = 'tis' with that cap; set "
                   "algo.mismatch and algo.mismatch_cap only")
    out.extend(distill_problems(cfg))
    if cfg.train.warmup_steps >= cfg.train.steps and cfg.train.lr_schedule != "constant":
        out.append(f"train.warmup_steps: {cfg.train.warmup_steps} leaves no step of the "
                   f"{cfg.train.lr_schedule} schedule (train.steps = {cfg.train.steps})")
    return out


def _scalar_model_checks(cfg: JobConfig) -> list[str]:
    """A reward model or critic from a directory: the text task's, a sequence classifier
    with one label (its tokenizer and head are checked when the text task loads)."""
    out = []
    if cfg.critic.path and not resolve(cfg.algo).has_critic:
        out.append(f"critic.path: {cfg.algo.name} trains no critic; it is for algo.name = "
                   f"{' or '.join(map(repr, with_critic()))}")
    for key, path, what in (("reward_model.path", cfg.reward_model.path, "reward model"),
                            ("critic.path", cfg.critic.path, "critic")):
        if path:
            out += _scalar_model_problems(cfg, key, path, what)
    return out


def _scalar_model_problems(cfg: JobConfig, key: str, path: str, what: str) -> list[str]:
    if cfg.task.name != "text":
        return [f"{key}: the built-in task trains its own reward model (which starts the "
                f"critic); a trained {what} from a directory needs task.name = 'text'"]
    if problems := model_dir_problems(key, path):
        return problems
    if not (Path(path) / "config.json").exists():
        return [f"{key}: no config.json in {path!r}"]
    hf = json.loads((Path(path) / "config.json").read_text())
    labels = hf.get("num_labels", len(hf.get("id2label") or {}) or 2)
    if labels != 1:
        return [f"{key}: {path!r} has num_labels = {labels}; a {what} gives one score "
                "per sequence (AutoModelForSequenceClassification with num_labels = 1)"]
    return []


def model_dir_problems(key: str, path: str) -> list[str]:
    """A Hugging Face model directory a job will load: its config.json a JSON object, each
    safetensors file whole (its header read, the data it declares present), so a damaged
    copy is one config error before anything starts, not a traceback in a node."""
    d = Path(path)
    if not d.is_dir():
        return [f"{key}: {path!r} is not a directory"]
    if not (d / "config.json").exists():  # named when it loads: this may be a hub id's
        return []
    try:
        hf = json.loads((d / "config.json").read_text())
    except OSError as e:
        return [f"{key}: config.json in {path!r} cannot be read ({e.strerror})"]
    except ValueError as e:
        return [f"{key}: {path!r}: config.json is not JSON ({e})"]
    if not isinstance(hf, dict):
        return [f"{key}: {path!r}: config.json is not a JSON object"]
    out = []
    for f in sorted(d.glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt"):
                pass
        except (OSError, SafetensorError) as e:
            out.append(f"{key}: {f} is damaged (truncated, or not safetensors): {e}")
    return out


def distill_problems(cfg: JobConfig) -> list[str]:
    """A distillation term needs its teacher (whose vocabulary `task/rewards/teacher.py` checks)."""
    a, out = cfg.algo, []
    if distills(a) and not cfg.teacher.path:
        why = "algo.name = 'distill'" if a.name == "distill" else "algo.distill_coef > 0"
        out.append(f"teacher.path: {why} needs a teacher: a causal LM directory or a cached "
                   "hub id on the student's tokenizer")
    elif cfg.teacher.path:
        out.extend(model_dir_problems("teacher.path", cfg.teacher.path))
    return out
