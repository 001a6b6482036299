"""Stages 1 and 2 of the InstructGPT pipeline, cached: SFT, then a Bradley-Terry reward model.

Artefacts live under `run.cache_dir/<stage>-<hash of the config that shapes them>/` and are
written to a temporary directory first, then renamed, so a crash never leaves a half
artefact that a later run would trust.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlhf_async.config import JobConfig
from rlhf_async.config.presets import resolve
from rlhf_async.log import get_logger
from rlhf_async.modeling.models import (
    ScalarHeadModel,
    load_actor,
    load_scalar_model,
    scalar_model_from_actor,
)
from rlhf_async.progress import announce
from rlhf_async.task import Task
from rlhf_async.task.calculator import VOCAB_SIZE as CALC_VOCAB
from rlhf_async.task.calculator import CalculatorTask
from rlhf_async.task.sort_digits import VOCAB_SIZE, SortDigitsTask
from rlhf_async.task.supervised import (
    Batch,
    bradley_terry_loss,
    fit,
    pair_scores,
    sft_loss,
)

log = get_logger(component="artefacts")
ARTEFACT_VERSION = 2
# The artefacts depend on this code too: any change to it gives new cache keys.
_CODE_FILES = (Path(__file__), Path(__file__).with_name("sort_digits.py"),
               Path(__file__).with_name("calculator.py"),
               Path(__file__).with_name("supervised.py"),
               Path(__file__).parents[1] / "modeling" / "models.py")


def _code_hash() -> str:
    h = hashlib.sha256()
    for f in _CODE_FILES:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


@dataclass
class Artefacts:
    sft_dir: Path  # the initial policy (and reference); for the text task, model.path
    rm_dir: Path | None  # None: the task's rule reward replaces a reward model
    sft_stats: dict
    rm_stats: dict


def _model_identity(cfg: JobConfig) -> dict:
    ident: dict = dataclasses.asdict(cfg.model)
    if cfg.model.path:
        files = sorted(Path(cfg.model.path).iterdir())
        ident["files"] = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return ident


# task.* keys that shape how an RL episode runs or how it is rewarded, never the SFT's
# demonstrations nor the reward model's pairs: an agent run reuses the same SFT. A key not
# named here is in the cache key (a new one retrains rather than reuses a stale artefact).
RL_ONLY_TASK_KEYS = frozenset({
    "agent", "agent_timeout_s", "env", "env_timeout_s", "max_turns", "verifiers",
    "reward_weight", "reward_timeout_s", "reward_retries", "reward_backoff_s",
    "reward_max_in_flight", "reward_request_rows"})
# the rule reward labels the reward model's pairs (sort_digits), not the SFT's data
RM_ONLY_TASK_KEYS = frozenset({"reward", "reward_batched"})


def stage_key(cfg: JobConfig, stage: str) -> str:
    """The cache directory of `stage` ("sft" or "rm"): a hash of what shapes it."""
    skip = RL_ONLY_TASK_KEYS if stage == "rm" else RL_ONLY_TASK_KEYS | RM_ONLY_TASK_KEYS
    task = {k: v for k, v in dataclasses.asdict(cfg.task).items() if k not in skip}
    parts = {"v": ARTEFACT_VERSION, "code": _code_hash(), "seed": cfg.run.seed,
             "model": _model_identity(cfg), "task": task, "sft": dataclasses.asdict(cfg.sft),
             # the calculator's demonstrations are cut to an episode's width
             "episode_tokens": cfg.generation.max_episode_tokens}
    if stage == "rm":
        parts["rm"] = dataclasses.asdict(cfg.reward_model)
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return f"{stage}-{hashlib.sha256(blob).hexdigest()[:16]}"


def atomic_dir(final: Path, write: Callable[[Path], None]) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write(tmp)
        os.rename(tmp, final)
    except OSError:
        if final.exists():  # a concurrent run finished the same artefact first
            shutil.rmtree(tmp, ignore_errors=True)
            return
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def train_sft(task: SortDigitsTask | CalculatorTask, actor: PreTrainedModel,
              cfg: JobConfig) -> dict:
    """Cross-entropy on synthetic demonstrations' tokens only (an episode's: the policy's)."""
    def batch(step: int) -> Batch:
        if isinstance(task, CalculatorTask):
            return task.demonstrations(cfg.run.seed, step, cfg.sft.batch_size)
        prompts, demos = task.demonstrations(cfg.run.seed, step, cfg.sft.batch_size)
        return (*task.encode_prompts(prompts), *task.encode_responses(demos, task.response_len))

    loss = fit(actor, sft_loss, batch, cfg.sft.steps, cfg.sft.lr, "sft", cfg.run.progress)
    return {"sft_final_loss": loss}


def _pairs(task: SortDigitsTask, prompts: list, chosen: list, rejected: list) -> Batch:
    return (*task.encode_prompts(prompts + prompts),
            *task.encode_responses(chosen + rejected, task.response_len))


def train_reward_model(task: SortDigitsTask, rm: ScalarHeadModel, cfg: JobConfig) -> dict:
    """Bradley-Terry on noisy synthetic labels."""
    rcfg = cfg.reward_model

    def batch(step: int) -> Batch:
        return _pairs(task, *task.preference_pairs(cfg.run.seed, "rm", step, rcfg.batch_size,
                                                   rcfg.label_noise))

    loss = fit(rm, bradley_terry_loss, batch, rcfg.steps, rcfg.lr, "reward model",
               cfg.run.progress)
    return {"rm_final_loss": loss, **reward_model_accuracy(task, rm, cfg)}


@torch.no_grad()
def reward_model_accuracy(task: SortDigitsTask, rm: ScalarHeadModel, cfg: JobConfig) -> dict:
    """Held-out pairs (disjoint prompts): agreement with noisy labels and with the hidden
    score's own ordering (pairs with equal hidden scores excluded)."""
    prompts, ch, rj = task.preference_pairs(cfg.run.seed, "eval", 0,
                                            cfg.reward_model.heldout_pairs,
                                            cfg.reward_model.label_noise)
    sc, sr = pair_scores(rm, _pairs(task, prompts, ch, rj))
    enc = task.encode_responses
    p_ids, _ = task.encode_prompts(prompts)
    hc = task.hidden_scores(p_ids, *enc(ch, task.response_len))
    hr = task.hidden_scores(p_ids, *enc(rj, task.response_len))
    decided = hc != hr
    true_order = (hc > hr) == (sc > sr)
    return {"rm_label_accuracy": float((sc > sr).float().mean()),
            "rm_accuracy": float(true_order[decided].float().mean())}


def _new_actor(cfg: JobConfig, task: SortDigitsTask | CalculatorTask) -> PreTrainedModel:
    vocab = CALC_VOCAB if isinstance(task, CalculatorTask) else VOCAB_SIZE
    return load_actor(cfg.model, vocab, task.special, cfg.run.seed)


def prepare_artefacts(cfg: JobConfig, task: Task) -> Artefacts:
    """Train (or reuse from the cache) the SFT policy and the reward model; the text task
    starts RL from model.path directly, with reward_model.path's model or its rule."""
    if isinstance(task, CalculatorTask):  # its environment rewards: no reward model
        sft_dir = _sft(cfg, task)
        return Artefacts(sft_dir, None, json.loads((sft_dir / "stats.json").read_text()), {})
    if not isinstance(task, SortDigitsTask):
        given = cfg.reward_model.path
        log.info("no SFT and no reward-model training here; the policy starts from "
                 "model.path and sft.* / reward_model.steps etc. are ignored",
                 task=cfg.task.name, reward=given or cfg.task.reward, model=cfg.model.path)
        return Artefacts(Path(cfg.model.path), Path(given) if given else None, {}, {})
    cache = Path(cfg.run.cache_dir)
    sft_dir, rm_dir = cache / stage_key(cfg, "sft"), cache / stage_key(cfg, "rm")
    if (sft_dir / "stats.json").exists() and (rm_dir / "stats.json").exists():
        announce("sft + reward model", f"cached in {cache} (same config and code): skipped",
                 enabled=cfg.run.progress)
    _sft(cfg, task)
    if not (rm_dir / "stats.json").exists():
        t0 = time.perf_counter()
        rm = scalar_model_from_actor(load_sft(sft_dir), cfg.run.seed)
        stats = train_reward_model(task, rm, cfg)
        stats["rm_seconds"] = time.perf_counter() - t0

        def write_rm(d: Path) -> None:
            rm.save(d)
            (d / "stats.json").write_text(json.dumps(stats))

        atomic_dir(rm_dir, write_rm)
        log.info("reward model trained", **stats, dir=str(rm_dir))
    return Artefacts(sft_dir, rm_dir, json.loads((sft_dir / "stats.json").read_text()),
                     json.loads((rm_dir / "stats.json").read_text()))


def _sft(cfg: JobConfig, task: SortDigitsTask | CalculatorTask) -> Path:
    """The SFT policy's directory, trained into the cache unless it is there."""
    sft_dir = Path(cfg.run.cache_dir) / stage_key(cfg, "sft")
    if not (sft_dir / "stats.json").exists():
        t0 = time.perf_counter()
        actor = _new_actor(cfg, task)
        stats = train_sft(task, actor, cfg)
        stats["sft_seconds"] = time.perf_counter() - t0

        def write_sft(d: Path) -> None:
            actor.save_pretrained(d, safe_serialization=True)
            (d / "stats.json").write_text(json.dumps(stats))

        atomic_dir(sft_dir, write_sft)
        log.info("sft trained", **stats, dir=str(sft_dir))
    return sft_dir


def load_sft(path: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).float().eval()


def load_reward_model(path: Path) -> ScalarHeadModel:
    return load_scalar_model(path).eval()


def load_reward(art: Artefacts) -> ScalarHeadModel | None:
    """The trained reward model, or None when the task's rule reward replaces it."""
    return None if art.rm_dir is None else load_reward_model(art.rm_dir)


def load_critic(cfg: JobConfig, art: Artefacts) -> ScalarHeadModel | None:
    """PPO's initial critic: `critic.path` when given, else the reward model (InstructGPT;
    the DeepSpeed-Chat / OpenRLHF convention), or for a rule-reward task the policy's own
    trunk with a fresh scalar head; None for critic-free algorithms."""
    if not resolve(cfg.algo).has_critic:
        return None
    if cfg.critic.path:
        return load_scalar_model(cfg.critic.path, "critic.path").eval()
    if art.rm_dir is None:
        return scalar_model_from_actor(load_sft(art.sft_dir), cfg.run.seed)
    return load_reward_model(art.rm_dir)
