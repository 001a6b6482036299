"""Where a run's peak FLOP/s (placement.peak_flops, what mfu/* divides by) comes from."""

from __future__ import annotations

import json

import torch

from rlhf_async.config import load_config
from rlhf_async.planning.calibrate import device_peaks
from rlhf_async.planning.machine import device_peak


def test_peak_from_the_setting_the_data_sheet_or_the_calibration(tmp_path, monkeypatch):
    given = load_config(None, ["placement.peak_flops=1e12"])
    assert device_peak(given, "fp32") == (1e12, "placement.peak_flops")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # placement.gpu's sheet
    gpu = load_config(None, ["placement.device=cuda", "placement.gpu=H200"])
    assert device_peak(gpu, "bf16")[0] == 989e12 and device_peak(gpu, "fp32")[0] == 67e12
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"measured": {"peak_flops": {"threads": 2, "fp32": 1.5e11,
                                                           "bf16": 6e11}}}))
    two = load_config(None, [f"placement.calibration={cal}", "placement.cpu_threads=2"])
    assert device_peak(two, "bf16")[0] == 6e11
    # measured at another thread count: not this device's; measured now instead
    one = load_config(None, [f"placement.calibration={cal}", "placement.cpu_threads=1"])
    peak, source = device_peak(one, "fp32")
    assert peak > 0 and source.startswith("measured now")


def test_calibration_measures_each_dtype_at_the_slot_threads():
    threads = torch.get_num_threads()
    peaks = device_peaks(1, seconds=0.05)
    assert peaks["threads"] == 1 and peaks["fp32"] > 0 and peaks["bf16"] > 0
    assert torch.get_num_threads() == threads  # restored
