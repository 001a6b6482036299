"""`rlhf-async sft` and `rlhf-async rm`: the supervised stages on the user's data.

Each is one run directory: `model/` (a Hugging Face model with its tokenizer, loadable
with `from_pretrained`), `metrics.jsonl` (the loss per step), `config.json` and
`summary.json` (held-out loss or accuracy before and after). One stage's output is the next
one's input:

    rlhf-async sft job.toml run.name=sft                          # runs/sft/model
    rlhf-async rm  job.toml run.name=rm model.path=runs/sft/model  # runs/rm/model
    rlhf-async run job.toml model.path=runs/sft/model reward_model.path=runs/rm/model

The data, the tokenizer and the model are read and checked before the run directory is
made: a bad input is one error and writes nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from rlhf_async.config import ConfigError, JobConfig, to_dict
from rlhf_async.config.checks import model_context
from rlhf_async.job.local import run_dir_of
from rlhf_async.job.lock import hold_run_dir
from rlhf_async.log import get_logger
from rlhf_async.metrics import MetricsWriter
from rlhf_async.modeling.models import as_scalar_model, load_actor, load_classifier
from rlhf_async.runtime.cpu import set_cpu_compute
from rlhf_async.task.artefacts import atomic_dir
from rlhf_async.task.sources.tokens import load_tokenizer
from rlhf_async.task.sources.user_data import Tokenised, demonstration, preference, tokenise
from rlhf_async.task.supervised import Batch, bradley_terry_loss, fit, pair_scores, sft_loss

log = get_logger(component="stages")


def _read(cfg: JobConfig, stage: str, key: str, section: Any, parse: Any,
          ) -> tuple[PreTrainedTokenizerBase, Tokenised]:
    """model.path's tokenizer and the stage's data, tokenised: every input problem before
    anything is written."""
    _needs(cfg, key, section.data, stage)
    hf_logging.disable_progress_bar()
    set_cpu_compute(cfg.placement.cpu_threads, cfg.placement.flush_denormal)
    tok = load_tokenizer(cfg.model.path)
    return tok, tokenise(key, section.data, section.split, parse, section, tok,
                         cfg.task.chat_template, _token_limit(cfg, section.max_tokens))


def _needs(cfg: JobConfig, key: str, value: str, stage: str) -> None:
    problems = []
    if not cfg.model.path:
        problems.append(f"model.path: `rlhf-async {stage}` trains a model of yours: a local "
                        "Hugging Face directory or a cached hub id (with its tokenizer)")
    if not value:
        problems.append(f"{key}: `rlhf-async {stage}` needs your data: a file (.jsonl, "
                        ".json, .parquet, .arrow, .csv), a directory or a cached dataset id")
    if problems:
        raise ConfigError(problems)


def _token_limit(cfg: JobConfig, asked: int) -> int:
    found = model_context(cfg)
    return asked if found is None else min(asked, found[0])


def _run_dir(cfg: JobConfig, stage: str) -> Path:
    target = run_dir_of(cfg)
    if (target / "summary.json").exists() or (target / "model").exists():
        raise ConfigError([f"run.name: {target} already holds a finished {stage} stage (or "
                           "a run); choose another run.name"])
    return target


@torch.no_grad()
def _mean_over(batches: list[Batch], value: Callable[[Batch], float]) -> float:
    return sum(value(b) for b in batches) / max(1, len(batches))


def _train(cfg: JobConfig, stage: str, model: nn.Module, data: Tokenised, steps: int,
           batch_size: int, lr: float, loss_fn: Any, evaluate: Callable[[], dict],
           save: Callable[[Path], None], out: IO[str] | None) -> dict:
    """The shared part: run directory, metrics, training, held-out numbers, the model."""
    target = _run_dir(cfg, stage)
    t0 = time.perf_counter()
    before = evaluate()
    with hold_run_dir(target) as run_dir:
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # an unfinished try's
        metrics = MetricsWriter(run_dir / "metrics.jsonl")
        torch.manual_seed(cfg.run.seed)  # dropout: the same run twice is the same run
        try:
            loss = fit(model, loss_fn,
                       lambda step: data.train_batch(cfg.run.seed, stage, step, batch_size),
                       steps, lr, stage, cfg.run.progress,
                       lambda step, loss: metrics.write({"step": step, "loss": loss}))
        finally:
            metrics.close()
        after = evaluate()
        atomic_dir(run_dir / "model", save)
        summary = {"stage": stage, "run_dir": str(run_dir), "model": str(run_dir / "model"),
                   "steps": steps, "final_loss": loss, **data.stats(),
                   **{f"{k}_before": v for k, v in before.items()},
                   **{f"{k}_after": v for k, v in after.items()},
                   "seconds": time.perf_counter() - t0}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info(f"{stage} trained", **summary)
    if out is not None:
        out.write(_format(summary))
        out.flush()
    return summary


def _format(s: dict) -> str:
    held = f"{s['heldout_rows']} held-out rows"
    if s["stage"] == "sft":
        numbers = f"  loss on {held}: {s['heldout_loss_before']:.4f} -> " \
                  f"{s['heldout_loss_after']:.4f}\n"
        use = f"model.path={s['model']}"
    else:
        numbers = (f"  accuracy on {held}: {s['heldout_accuracy_before']:.3f} -> "
                   f"{s['heldout_accuracy_after']:.3f} (margin "
                   f"{s['heldout_margin_after']:.4f})\n")
        use = f"reward_model.path={s['model']}"
    cut = f", {s['truncated_rows']} cut to the token limit" if s["truncated_rows"] else ""
    return (f"\n{s['stage']} {s['run_dir']}: {s['steps']} steps on {s['train_rows']} rows"
            f"{cut}, {s['seconds']:.1f}s\n{numbers}  model: {s['model']}\n"
            f"  next: {use}\n")


def sft_stage(cfg: JobConfig, out: IO[str] | None = None) -> dict:
    """Supervised fine-tuning of model.path on sft.data (the loss on responses only);
    returns the summary (also RUN_DIR/summary.json)."""
    s = cfg.sft
    tok, data = _read(cfg, "sft", "sft.data", s, demonstration)
    actor = load_actor(cfg.model, len(tok), (0, 0, 0), cfg.run.seed)
    evals = data.eval_batches(s.batch_size)

    def evaluate() -> dict:
        actor.eval()
        return {"heldout_loss": _mean_over(evals, lambda b: sft_loss(actor, b).item())}

    def save(d: Path) -> None:
        actor.save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)

    return _train(cfg, "sft", actor, data, s.steps, s.batch_size, s.lr, sft_loss, evaluate,
                  save, out)


def reward_model_stage(cfg: JobConfig, out: IO[str] | None = None) -> dict:
    """A Bradley-Terry reward model on reward_model.data, started from model.path (the
    SFT model, by convention) with a new one-label head; saved as an
    AutoModelForSequenceClassification that reward_model.path takes."""
    r = cfg.reward_model
    tok, data = _read(cfg, "rm", "reward_model.data", r, preference)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "newly initialized: ['score.weight']" is the point
    try:
        with torch.random.fork_rng():
            torch.manual_seed(cfg.run.seed)
            classifier = load_classifier(cfg.model.path, "model.path", num_labels=1)
    finally:
        hf_logging.set_verbosity(verbosity)
    classifier.config.pad_token_id = data.pad_id  # HF classifiers find the last token by it
    rm = as_scalar_model(classifier, f"model.path: {cfg.model.path!r}")
    evals = data.eval_batches(r.batch_size)

    @torch.no_grad()
    def evaluate() -> dict:
        rm.eval()
        margins = [sc - sr for sc, sr in (pair_scores(rm, b) for b in evals)]
        m = torch.cat(margins) if margins else torch.zeros(0)
        return {"heldout_accuracy": float((m > 0).float().mean()) if len(m) else float("nan"),
                "heldout_margin": float(m.mean()) if len(m) else float("nan")}

    def save(d: Path) -> None:
        classifier.save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)

    return _train(cfg, "rm", rm, data, r.steps, r.batch_size, r.lr, bradley_terry_loss,
                  evaluate, save, out)
