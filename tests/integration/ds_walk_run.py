"""Two DeepSpeed ZeRO-3 trainer ranks broadcast their actor to one receiver, group by group
(`run` spawns the two rank processes for test_deepspeed.py: DeepSpeed owns a process group
for its lifetime). Rank 0 records, at every gather, how many bytes of sharded parameters
are whole at that moment and how many bytes it has broadcast so far; the receiver's
tensors are compared with a whole-model gather afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from typing import Any

import deepspeed
import torch
import torch.multiprocessing as mp

from nodes.trainer.group import Op, TrainerGroup
from rlhf_async.config import AlgoConfig, ModelConfig, TrainConfig
from rlhf_async.engines.process_group import exit_rank, free_port
from rlhf_async.modeling.models import load_actor
from rlhf_async.rl.learner import Learner
from rlhf_async.task.sort_digits import EOS, PAD, VOCAB_SIZE
from rlhf_async.weight_sync import (
    GroupSpec,
    TorchBroadcastReceiver,
    TorchBroadcastSender,
    WeightSyncError,
)
from rlhf_async.weight_sync.group import BroadcastGroup


def _whole_shard_bytes(module: torch.nn.Module) -> int:
    """Bytes of ZeRO-3 partitioned (not persistent) parameters that are gathered now."""
    return sum(p.ds_numel * p.element_size() for p in module.parameters()
               if not p.ds_persist and p.data.numel() == p.ds_numel)


def _instrument(module: torch.nn.Module, record: list[tuple[int, int]]) -> list[int]:
    """At every gather, append (whole shard bytes, bytes rank 0 broadcast so far)."""
    sent = [0]
    real_broadcast, real_enter = BroadcastGroup.broadcast, deepspeed.zero.GatheredParameters.__enter__

    def broadcast(self: BroadcastGroup, buf: torch.Tensor) -> Any:
        sent[0] += buf.numel() if self.rank == 0 else 0
        return real_broadcast(self, buf)

    def enter(self: Any) -> Any:
        out = real_enter(self)
        record.append((_whole_shard_bytes(module), sent[0]))
        return out

    BroadcastGroup.broadcast = broadcast  # type: ignore[method-assign]
    deepspeed.zero.GatheredParameters.__enter__ = enter  # type: ignore[method-assign]
    return sent


def rank_main(rank: int, port: int, hidden: int, bucket_kb: int, out_path: str) -> None:
    torch.set_num_threads(1)
    group = TrainerGroup(rank, 2, 2)
    group.join("gloo", "127.0.0.1", port, 60.0)
    actor = load_actor(ModelConfig(hidden=hidden, heads=2, layers=1), VOCAB_SIZE,
                       (PAD, 1, EOS), seed=0)
    learner = Learner(actor, None, AlgoConfig(name="grpo", group_size=2),
                      TrainConfig(backend="deepspeed", zero_stage=3), seed=0)
    if rank == 1:
        group.follow(learner, torch.device("cpu"))
        learner.close()
        exit_rank()  # no interpreter finalization with DeepSpeed's group alive (it can abort)
    record: list[tuple[int, int]] = []
    sender = TorchBroadcastSender("gloo", bucket_mb=bucket_kb / 1024)
    spec = sender.prepare(GroupSpec("gloo", "127.0.0.1", 0, 2, timeout_s=60))
    rx = TorchBroadcastReceiver("gloo")
    joined = threading.Thread(target=rx.connect, args=(spec, 1))
    joined.start()
    sender.connect(spec)
    joined.join()
    plan = sender.plan(learner.weight_layout(), 1)
    got: dict[str, Any] = {}
    receiving = threading.Thread(target=lambda: got.update(w=rx.receive(plan)))
    receiving.start()
    sent = _instrument(learner.actor, record)
    group.walk_weights(learner, sender.bucket_bytes, lambda groups: sender.send(groups, plan))
    receiving.join()
    walk, total_sent = list(record), sent[0]

    def fail_after_one(groups: Any) -> None:  # a broadcast that dies after one group
        next(groups)
        raise WeightSyncError("generator gone")
    with contextlib.suppress(WeightSyncError):
        group.walk_weights(learner, sender.bucket_bytes, fail_after_one)
    group.lead(Op.FINISH)  # the follower is still in step: both gather the whole model
    with learner.actor_backend.gathered():
        whole = {k: v.clone() for k, v in learner.actor.state_dict().items()}
        peak_whole = _whole_shard_bytes(learner.actor)
    received = got["w"].tensors
    layout = sender._layout
    assert layout is not None
    biggest = max(s.nbytes for s in layout.slots)
    with open(out_path, "w") as f:
        json.dump({
            "names": list(received), "state_dict_names": list(whole),
            "identical": all(received[k].dtype == v.dtype and torch.equal(received[k], v)
                             for k, v in whole.items()),
            "tied": torch.equal(received["lm_head.weight"], received["transformer.wte.weight"]),
            "walk": walk, "sent": total_sent, "total_bytes": layout.total_bytes,
            "bucket_bytes": sender.bucket_bytes, "largest_tensor_bytes": biggest,
            "largest_group_bytes": sender.largest_group_bytes, "model_shard_bytes": peak_whole,
        }, f)
    sender.close()
    rx.close()
    learner.close()
    exit_rank()


def run(hidden: int, bucket_kb: int, tmp_dir: str) -> dict[str, Any]:
    """What rank 0 saw (see `rank_main`); DS_ACCELERATOR=cpu must be set in the caller's env."""
    out = os.path.join(tmp_dir, "walk.json")
    mp.spawn(rank_main, args=(free_port(), hidden, bucket_kb, out), nprocs=2, join=True)
    with open(out) as f:
        result: dict[str, Any] = json.load(f)
    return result
