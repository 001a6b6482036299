"""What a simulated device stands for: the model shape, the GPU, the step's work, and the
time scale (`SimSpec`, from a `placement.device = "sim"` job's config), and the prices of
each phase in simulated seconds, from the cost model's own arithmetic
(`modeling/roofline.py`).

A node process of a simulated job activates its spec once (`simulate`, from the node's
context); the simulated engines read it there (`active`), as a real engine finds the GPU it
runs on from its process.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import torch

from rlhf_async.config import JobConfig
from rlhf_async.modeling.roofline import (
    DEVICES,
    LLAMA,
    Calibration,
    DeviceSpec,
    ModelShape,
    decode_step_s,
    forward_s,
    kv_bytes_per_token,
    prefill_s,
    train_step_s,
)

LONG_TAIL_SIGMA = 1.0  # log-normal spread of `lengths = long_tail`
LONG_TAIL_CAP = 8  # responses cut at this many times the mean
MEMORY_RESERVED = 0.1  # of a GPU's memory, as the cost model keeps it free
ZERO3_AT = 0.75  # ZeRO-3 when the training states fill this much of the rest (cost model)


@dataclass(frozen=True)
class SimSpec:
    shape: ModelShape
    device: DeviceSpec
    cal: Calibration
    time_scale: float  # real seconds per simulated second
    devices: int  # GPUs in the job: one node's NVLink, or the NIC across nodes
    prompt_tokens: int
    response_tokens: int  # the mean
    lengths: str  # "fixed" | "long_tail"
    samples: int  # sequences per step
    epochs: int
    minibatches: int
    dbytes: int = 2  # bf16 weights and KV cache

    @classmethod
    def of(cls, cfg: JobConfig) -> SimSpec:
        s = cfg.sim
        return cls(LLAMA[s.model], DEVICES[cfg.placement.gpu], Calibration(), s.time_scale,
                   cfg.placement.devices, s.prompt_tokens, s.response_tokens, s.lengths,
                   cfg.train.prompts_per_step * cfg.algo.group_size, cfg.train.epochs,
                   cfg.train.minibatches)

    # --- time --------------------------------------------------------------------------

    def sleep(self, sim_s: float, spent: float = 0.0) -> None:
        """Block this thread for `sim_s` simulated seconds (a training step's thread), less
        the real seconds `spent` (as `pause`)."""
        time.sleep(max(0.0, sim_s * self.time_scale - spent))

    async def pause(self, sim_s: float, spent: float = 0.0) -> None:
        """Wait `sim_s` simulated seconds on the event loop (the node stays responsive),
        less the real seconds `spent` on the stand-in model's math meanwhile: that math is
        what the simulated GPU does in this time, not more work after it."""
        await asyncio.sleep(max(0.0, sim_s * self.time_scale - spent))

    # --- generation ----------------------------------------------------------------------

    @property
    def max_response(self) -> int:
        """The longest simulated response."""
        return self.response_tokens * (LONG_TAIL_CAP if self.lengths == "long_tail" else 1)

    def response_length(self, seed: int) -> int:
        """A request's simulated response length, keyed by its seed (so a chunk sent again
        takes as long as the first time)."""
        if self.lengths == "fixed":
            return self.response_tokens
        g = torch.Generator().manual_seed(seed % (1 << 63))
        mu = math.log(self.response_tokens) - LONG_TAIL_SIGMA**2 / 2  # mean = response_tokens
        n = math.exp(mu + LONG_TAIL_SIGMA * float(torch.randn((), generator=g)))
        return max(1, min(self.max_response, round(n)))

    @property
    def weight_bytes(self) -> float:
        return self.dbytes * self.shape.params

    @property
    def kv_per_token(self) -> float:
        return kv_bytes_per_token(self.shape, self.dbytes)

    @property
    def max_rows(self) -> int:
        """Rows a generator decodes at once: the full sequences' KV cache that fits beside
        the weights (the cost model's bound)."""
        free = (1 - MEMORY_RESERVED) * self.device.memory - self.weight_bytes
        row = self.kv_per_token * (self.prompt_tokens + self.max_response)
        return max(1, int(free // row))

    def prefill_s(self, rows: int) -> float:
        """Prefilling `rows` prompts (one batched pass)."""
        return prefill_s(self.shape, rows, self.prompt_tokens, 1, self.weight_bytes,
                         self.device, self.cal) + self.shape.layers * self.cal.gen_call_s

    def decode_s(self, rows: int, context: int) -> float:
        """One decode step of `rows` rows holding `context` tokens of KV cache in all."""
        return decode_step_s(self.shape, rows, context * self.kv_per_token, 1,
                             self.weight_bytes, self.device, self.cal) + \
            self.shape.layers * self.cal.gen_call_s

    # --- scoring, training, weight sync ---------------------------------------------------

    def forward_s(self, tokens: float) -> float:
        """A frozen model's forward over `tokens` tokens (a scorer's reward or reference)."""
        return forward_s(2 * self.shape.params * tokens, self.shape.layers,
                         self.cal.score_call_s, self.cal.score_eff, self.device)

    def bandwidth(self, ranks: int) -> float:
        """Effective collective bandwidth of `ranks` devices: NVLink inside one node, the
        NIC across nodes (the cost model's `_bw` for contiguous devices)."""
        one_node = ranks <= self.device.per_node
        return (self.device.link_bw if one_node else self.device.net_bw) * self.cal.link_eff

    def zero3(self, ranks: int) -> bool:
        """Whether the training copies (actor and critic) are ZeRO-3 sharded over `ranks`,
        as the cost model decides it."""
        states = 2 * 16 * self.shape.params
        return ranks > 1 and states > ZERO3_AT * (1 - MEMORY_RESERVED) * self.device.memory

    def train_step_s(self, ranks: int) -> float:
        """One trained model's RL step on each of `ranks` data-parallel ranks."""
        rows = math.ceil(self.samples / ranks)
        seq = self.prompt_tokens + self.response_tokens
        return train_step_s(self.shape, rows, seq, self.epochs, self.minibatches, 1, ranks,
                            self.zero3(ranks), self.dbytes, self.bandwidth(ranks),
                            self.device, self.cal)

    def broadcast_s(self) -> float:
        """The real model's bf16 weights from trainer rank 0 to the generators."""
        return self.weight_bytes / self.bandwidth(self.devices) + self.cal.collective_s

    def sim_tokens(self, real: int, real_max: int) -> float:
        """Simulated response tokens for `real` tokens of a real response of at most
        `real_max` (the engine maps lengths in proportion)."""
        return real * self.max_response / max(1, real_max)


_ACTIVE: list[SimSpec] = []  # this process's, once its node activates it


def simulate(cfg: JobConfig) -> SimSpec | None:
    """Activate the simulated devices of a `placement.device = "sim"` job in this process
    (a node's first act); None for a real job."""
    if cfg.placement.device != "sim":
        return None
    _ACTIVE[:] = [SimSpec.of(cfg)]
    return _ACTIVE[0]


def active() -> SimSpec:
    """This process's simulated devices; a clear error outside a simulated job's node."""
    if not _ACTIVE:
        raise RuntimeError("the sim engines run in the nodes of a placement.device = 'sim' "
                           "job only (none is active in this process)")
    return _ACTIVE[0]


def current() -> SimSpec | None:
    """This process's simulated devices, or None in a real job."""
    return _ACTIVE[0] if _ACTIVE else None
