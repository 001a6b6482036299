"""The DeepSpeed ZeRO training engine (stage 1/2/3), optional extra `[deepspeed]`.

Choices that matter:
- The optimizer is torch's AdamW handed to `deepspeed.initialize` (ZeRO partitions its
  state); DeepSpeed's fused Adam would need a compiled op, so it is never requested.
- DeepSpeed averages gradients over data-parallel ranks; our losses are normalised by the
  GLOBAL token count and expect a SUM (like the torch engine), so the loss is scaled by the
  world size before backward.
- Micro-batches use DeepSpeed's own accumulation, with the boundary set by the caller
  (`set_gradient_accumulation_boundary`), so a minibatch may hold any number of them.
- Without a launcher, a one-rank gloo (CPU) / nccl (GPU) default group is created here from
  RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT defaults and destroyed by `close()`.
- Under ZeRO-3 the parameters are shards: full weights are gathered one group at a time
  (`deepspeed.zero.GatheredParameters`), never the whole model at once.
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlhf_async.engines.process_group import free_port
from rlhf_async.log import get_logger

log = get_logger(component="deepspeed")


def skip_shm_op_on_cpu() -> bool:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op on first use:
    20-50 s on a 2-core box, again in every fresh environment (the build is keyed by the
    venv's torch headers), and it fails without a C++ compiler. At the model sizes a CPU
    trains, that costs more than the op's faster all-reduce saves, so on CPU gloo does the
    collectives, as for the torch engine (same results). True when skipped."""
    if torch.cuda.is_available():
        return False
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    log.debug("deepspeed_shm_op_skipped", reason="cpu", effect="collectives go through gloo")
    return True


def init_distributed() -> bool:
    """Make sure a default process group exists; True when this call created it."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    import deepspeed

    skip_shm_op_on_cpu()
    if dist.is_initialized():  # e.g. Flattening's ranks: DeepSpeed still reads the env
        rank = dist.get_rank()
        local = torch.cuda.current_device() if torch.cuda.is_available() else rank
        for key, value in (("RANK", rank), ("LOCAL_RANK", local),
                           ("WORLD_SIZE", dist.get_world_size())):
            os.environ.setdefault(key, str(value))
        return False
    for name, text in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, text)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    return True


def ds_config(zero_stage: int, grad_clip: float, grad_accum: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,  # nominal: batches are shaped by the Learner
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,  # torch AdamW: no compiled op needed
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _plain(obj: Any, where: str) -> Any:
    """`obj` with DeepSpeed's enums turned into their values, so that our checkpoints load
    with `weights_only=True` (no arbitrary pickle); anything else unexpected is an error."""
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {k: _plain(v, f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_plain(v, f"{where}[{i}]") for i, v in enumerate(obj))
    if obj is None or isinstance(obj, Tensor | str | int | float | bool | torch.dtype):
        return obj
    raise TypeError(f"{where}: {type(obj).__name__} cannot go into a weights-only checkpoint")


def _full_shape(t: Tensor) -> tuple[int, ...]:
    """A tensor's whole shape, also when it is a ZeRO-3 shard (`ds_shape`)."""
    return tuple(getattr(t, "ds_shape", t.shape))


def _cut(entries: list[tuple[str, Tensor]], max_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Consecutive runs of `entries` of at most ~max_bytes of full weights each (a tensor
    larger than that is a run of its own)."""
    group: list[tuple[str, Tensor]] = []
    size = 0
    for name, t in entries:
        n = int(getattr(t, "ds_numel", t.numel())) * t.element_size()
        if group and size + n > max_bytes:
            yield group
            group, size = [], 0
        group.append((name, t))
        size += n
    if group:
        yield group


class DeepSpeedTrainBackend:
    name = "deepspeed"

    def __init__(self, module: nn.Module, *, lr: float, weight_decay: float, grad_clip: float,
                 zero_stage: int = 2, grad_accum: int = 1) -> None:
        if zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage {zero_stage!r}: accepted 1, 2, 3")
        self._owns_group = init_distributed()
        import deepspeed

        self.zero_stage, self.world = zero_stage, dist.get_world_size()
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, config=ds_config(zero_stage, grad_clip,
                                                                grad_accum))
        self.module: nn.Module = self.engine.module
        self.model: nn.Module = self.engine
        self._micro = 0
        log.info("deepspeed_engine", zero_stage=zero_stage, world=self.world,
                 params=sum(int(getattr(p, "ds_numel", p.numel())) for p in params))

    def backward(self, loss: Tensor, *, last: bool = True) -> None:
        self.engine.set_gradient_accumulation_boundary(last)
        # our loss is a share of a global SUM; DeepSpeed averages over ranks
        self.engine.backward(loss * self.world, scale_wrt_gas=False)
        self._micro += 1

    def step(self) -> float:
        if self._micro == 0:
            raise RuntimeError("deepspeed backend: step() without a backward(); every rank "
                               "needs rows of every minibatch (raise prompts_per_step)")
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        self._micro = 0
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next step (ZeRO's param groups are the wrapped AdamW's)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def weight_layout(self) -> dict[str, Tensor]:
        """The state dict's entries as meta tensors (names, aliases, dtypes, full shapes),
        in the order `iter_weight_groups` yields them; nothing is gathered."""
        return {name: torch.empty(_full_shape(t), dtype=t.dtype, device="meta")
                for name, t in self._entries()}

    def iter_weight_groups(self, max_bytes: int) -> Iterator[dict[str, Tensor]]:
        """Full weights in state_dict order (every alias of a tied weight, persistent
        buffers), one group of at most ~max_bytes at a time. Under ZeRO-3 each group is
        gathered for the duration of its iteration only, and gathering is collective: every
        rank walks all groups with the same max_bytes, and uses (copies or sends) a group's
        tensors before asking for the next."""
        import deepspeed

        for group in _cut(self._entries(), max_bytes):
            params = list({id(t): t for _, t in group if hasattr(t, "ds_id")}.values())
            with deepspeed.zero.GatheredParameters(params, enabled=self.zero_stage == 3):
                yield {name: t.detach() for name, t in group}

    def _entries(self) -> list[tuple[str, Tensor]]:
        """(name, parameter or buffer) of every state_dict entry; a tied weight once per
        name (e.g. lm_head = wte), since receivers expect every name."""
        return [(n, t) for n, t in self.module.state_dict(keep_vars=True).items()
                if isinstance(t, Tensor)]

    def state_dict(self) -> dict[str, Tensor]:
        """Full weights on CPU, in the module's state_dict order (gathered per group); the
        aliases of a tied weight share one copy."""
        first: dict[int, str] = {}  # id(parameter) -> its first name
        entries = dict(self._entries())
        out: dict[str, Tensor] = {}
        for group in self.iter_weight_groups(256 * 2**20):
            for name, t in group.items():
                src = first.setdefault(id(entries[name]), name)
                out[name] = out[src] if src != name else t.to("cpu", copy=True)
        return out

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        import deepspeed

        names = dict(self.module.named_parameters())
        missing = [n for n in names if n not in state]
        if missing:
            raise KeyError(f"load_state_dict: missing {missing[:5]}")
        for group in _cut(list(names.items()), 256 * 2**20):
            params = [p for _, p in group]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0,
                                                   enabled=self.zero_stage == 3), torch.no_grad():
                for name, p in group:
                    p.copy_(state[name].to(p.device, p.dtype))
        with torch.no_grad():
            for name, b in self.module.named_buffers():
                if name in state:
                    b.copy_(state[name])
        # ZeRO keeps fp32 master partitions: they must follow the loaded weights
        self.optimizer.refresh_fp32_params()

    def optimizer_state_dict(self) -> dict[str, Any]:
        """Every rank's ZeRO optimizer partition (collective under data parallelism)."""
        # objects a weights_only load refuses: the fp32 loss scaler (a static 1, as a fresh
        # engine has) and the slice maps of DeepSpeed's universal checkpoints (rebuilt)
        mine = _plain({k: v for k, v in self.optimizer.state_dict().items()
                       if k not in ("loss_scaler", "param_slice_mappings")}, "optimizer")
        ranks: list[Any] = [mine]
        if self.world > 1:
            ranks = [None] * self.world
            dist.all_gather_object(ranks, mine)
        return {"zero_stage": self.zero_stage, "world_size": self.world, "ranks": ranks}

    def load_optimizer_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("zero_stage") != self.zero_stage or state.get("world_size") != self.world:
            raise ValueError(f"optimizer state was saved with zero_stage="
                             f"{state.get('zero_stage')}, world_size={state.get('world_size')}; "
                             f"this run has zero_stage={self.zero_stage}, world_size={self.world}")
        scaler = getattr(self.optimizer, "loss_scaler", None)  # dropped on save (fp32: 1)
        ranks = [{"loss_scaler": scaler, **r} for r in state["ranks"]]
        self.optimizer.load_state_dict(ranks, load_optimizer_states=True,
                                       load_from_fp32_weights=True)

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        """All parameters whole for the duration (ZeRO-3; a no-op otherwise). Collective:
        every rank enters it. For saving a final policy, not for the per-step broadcast."""
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.module.parameters()),
                                                 enabled=self.zero_stage == 3)

    def close(self) -> None:
        if hasattr(self.engine, "destroy"):
            self.engine.destroy()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
