"""weight_sync.backend = auto on GPUs: NCCL where every rank of the sync group has a GPU of
its own, gloo through host memory where two share one (NCCL refuses that)."""

import torch

from rlhf_async.config import load_config
from rlhf_async.strategies.registry import build_placement
from rlhf_async.strategies.separation.runner import sync_backend
from rlhf_async.weight_sync import TorchBroadcastReceiver, TorchBroadcastSender


def _resolved(*over: str) -> str:
    cfg = load_config(None, ["placement.strategy=separation", *over])
    placement, problems = build_placement(cfg.placement, cfg.algo.name)
    assert placement is not None, problems
    return sync_backend(cfg, placement).weight_sync.backend


def test_one_gpu_shared_by_trainer_and_generator_syncs_through_gloo():
    assert _resolved("placement.device=cuda", "placement.devices=1") == "gloo"


def test_a_gpu_each_keeps_auto_and_cpu_is_untouched():
    assert _resolved("placement.device=cuda", "placement.devices=3") == "auto"
    assert _resolved("placement.devices=1") == "auto"
    assert _resolved("placement.device=cuda", "placement.devices=1",
                     "weight_sync.backend=nccl") == "nccl"  # the user's choice stands


def test_gloo_buffers_are_host_memory_whatever_device_the_model_is_on():
    assert TorchBroadcastSender("gloo", device="cuda:0").device == torch.device("cpu")
    assert TorchBroadcastReceiver("gloo", device="cuda:0").device == torch.device("cpu")
