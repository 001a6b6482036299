"""What every RLHF node reads from its spec: the job config, artefact paths and device,
and the task they build."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from rlhf_async.config import JobConfig, config_from_dict
from rlhf_async.engines import adopt_engine_lines
from rlhf_async.engines.sim import simulate
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.modeling.precision import Precision, check_device
from rlhf_async.pipeline.protocol import ChunkFormatError
from rlhf_async.runtime import Node
from rlhf_async.task import Task, make_task, sampling_params
from rlhf_async.task.adapters import adopt_adapter_lines
from rlhf_async.task.artefacts import Artefacts
from rlhf_async.wire.protocol import ProtocolError


@dataclass
class NodeContext:
    cfg: JobConfig
    art: Artefacts
    device: torch.device
    sampling: SamplingParams
    precision: Precision  # each model's dtype, from the placement
    task: Task


def _task(cfg: JobConfig) -> tuple[Task, SamplingParams]:
    task = make_task(cfg)
    return task, sampling_params(cfg, task)


async def load_context(node: Node) -> NodeContext:
    """The node's context. The task is built off the event loop: it imports the user's
    modules (an agent, a reward, a verifiers environment: seconds), and the loop must go
    on beating its heartbeats (`runtime.time_to_dead`) meanwhile."""
    hf_logging.disable_progress_bar()
    p = node.params
    # the lines the coordinator registered at run time (a test, a notebook)
    adopt_engine_lines(p.get("engines", {}))
    adopt_adapter_lines(p.get("adapters", {}))
    cfg = config_from_dict(p["config"])
    simulate(cfg)  # simulated devices (placement.device = sim): the engines time them
    art = Artefacts(Path(p["sft_dir"]), Path(p["rm_dir"]) if p["rm_dir"] else None, {}, {})
    device = torch.device(node.spec.device if node.spec.device.startswith("cuda") else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    precision = Precision(p.get("precision", {}))
    check_device(precision, device)
    task, sampling = await asyncio.to_thread(_task, cfg)
    return NodeContext(cfg, art, device, sampling, precision, task)


def message_errors() -> tuple[type[Exception], ...]:
    """Errors a data message from a peer can raise: rejected and counted, never fatal."""
    return (ChunkFormatError, ProtocolError)
