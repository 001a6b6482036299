"""Delta vs full weight updates on SmolLM2-135M-Instruct in GRPO (bf16 shadows).

Why: a delta update is worth it only if it is much smaller and not slower end to end, and
how much changes per update depends on the real weights and the RL step, so both are
real here: the pretrained model (`rlhf-async prepare-smollm2`) and one GRPO step of
deploy/configs/smollm2.toml between updates (bench/grpo_proxy.py, lr 3e-5). After each
step the bf16 shadows (tied weights once) are measured two ways:

- the codec alone, bucket by bucket (100 MB, as the sender cuts them) on `--device`:
  bytes as % of the full update, encode and decode seconds, the result bit-identical to
  the new bytes; `--baseline FILE` measures another codec module beside it (e.g. the one
  before this change: `git show 228a6f1:rlhf_async/weight_sync/delta.py > /tmp/old.py`);
- end to end on the CPU: two gloo groups in this process (sender and receiver threads),
  one sending full updates, one deltas; seconds from the start of the send until the
  receiver holds every byte, bytes on the wire, both receivers holding the same bytes.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_weight_delta.py --updates 7 \\
        --baseline /tmp/old.py [--device cuda]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from bench.grpo_proxy import GrpoProxy
from rlhf_async.weight_sync import (
    DEFAULT_BUCKET_MB,
    GroupSpec,
    TorchBroadcastReceiver,
    TorchBroadcastSender,
    delta,
)
from rlhf_async.weight_sync.encoded import HEADER_BYTES
from rlhf_async.weight_sync.plan import tied_names


def _pair(delta_on: bool) -> tuple[TorchBroadcastSender, TorchBroadcastReceiver]:
    sender = TorchBroadcastSender("gloo", delta=delta_on)
    spec = sender.prepare(GroupSpec("gloo", "127.0.0.1", 0, 2, timeout_s=300))
    rx = TorchBroadcastReceiver("gloo")
    t = threading.Thread(target=rx.connect, args=(spec, 1))
    t.start()
    sender.connect(spec)
    t.join()
    return sender, rx


def _update(sender: TorchBroadcastSender, rx: TorchBroadcastReceiver,
            shadow: dict[str, torch.Tensor], tied: dict[str, str], version: int) -> Any:
    plan = sender.plan(shadow, version, tied)
    got: list[Any] = [None]
    t0 = time.perf_counter()
    t = threading.Thread(target=lambda: got.__setitem__(0, rx.receive(plan)))
    t.start()
    sender.send(shadow, plan)
    t.join()
    return time.perf_counter() - t0, sender.last_sent_bytes, got[0]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _codec(codec: ModuleType, prev: torch.Tensor, new: torch.Tensor,
           bucket: int) -> dict[str, Any]:
    """Bytes (headers included), encode and decode seconds of `codec` over `new`'s buckets
    against `prev`, and whether the decoded bytes equal `new`."""
    held = prev.clone()
    nbytes, enc, dec = 0, 0.0, 0.0
    for lo in range(0, new.numel(), bucket):
        _sync(new.device)
        t0 = time.perf_counter()
        kind, payload = codec.encode(prev[lo : lo + bucket], new[lo : lo + bucket])
        payload = payload.to(new.device)  # a received payload lands on the device
        _sync(new.device)
        t1 = time.perf_counter()
        codec.decode(kind, payload, held[lo : lo + bucket])
        _sync(new.device)
        enc, dec = enc + t1 - t0, dec + time.perf_counter() - t1
        nbytes += HEADER_BYTES + payload.numel()
    return {"pct": 100 * nbytes / new.numel(), "enc_s": enc, "dec_s": dec,
            "exact": torch.equal(held, new)}


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("baseline_codec", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(version: int, reward: float, prev: torch.Tensor | None, flat: torch.Tensor,
         codecs: dict[str, ModuleType], bucket: int) -> dict[str, Any]:
    row: dict[str, Any] = {"version": version, "reward": reward}
    if prev is None:
        return row
    w_old, w_new = delta.words(prev), delta.words(flat)
    row["changed"] = int(torch.count_nonzero(w_old != w_new)) / w_new.numel()
    for name, codec in codecs.items():
        for key, value in _codec(codec, prev, flat, bucket).items():
            row[f"{name}_{key}"] = value
    return row


def _summary(rows: list[dict[str, Any]], full_mb: float) -> str:
    later = rows[1:]
    keys = [k for k in later[0] if k not in ("version", "reward") and not k.endswith("exact")
            and k != "identical"]
    med = {k: statistics.median(r[k] for r in later) for k in keys}
    exact = all(v for r in later for k, v in r.items() if k.endswith("exact") or k == "identical")
    return (f"full update {full_mb:.1f} MB; medians over updates 2-{len(rows)}: "
            + " ".join(f"{k}={v:.4g}" for k, v in med.items()) + f"; all bit-identical {exact}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/models/smollm2-135m-instruct",
                    help="a prepared SmolLM2 directory (rlhf-async prepare-smollm2)")
    ap.add_argument("--updates", type=int, default=7, help="the first is a full update")
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model trains and the codec runs (the wire is gloo)")
    ap.add_argument("--baseline", help="a codec module (encode/decode) to measure beside")
    args = ap.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no prepared model there; run "
                         "`rlhf-async prepare-smollm2 DIR` first (README.md)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (accepted: cpu, cuda)")
    if args.updates < 2:
        raise SystemExit(f"--updates {args.updates}: need at least 2 (the first is full)")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"load average at start {os.getloadavg()}", flush=True)
    proxy = GrpoProxy(args.model, args.lr, args.device)
    tied = tied_names(proxy.model)
    codecs = {"new": delta} | ({"old": _load(args.baseline)} if args.baseline else {})
    bucket = int(DEFAULT_BUCKET_MB * 2**20)
    pairs = {"full": _pair(False), "delta": _pair(True)}
    rows, prev = [], None
    for version in range(args.updates):
        reward = proxy.step() if version else float("nan")
        shadow = {k: v.detach().to(torch.bfloat16) for k, v in proxy.model.state_dict().items()}
        flat = torch.cat([v.reshape(-1).view(torch.uint8) for k, v in shadow.items()
                          if k not in tied])  # [full bytes], tied weights once
        row = _row(version, reward, prev, flat, codecs, bucket)
        on_cpu = {k: v.cpu() for k, v in shadow.items()}
        received = {}
        for mode, (sender, rx) in pairs.items():
            seconds, nbytes, got = _update(sender, rx, on_cpu, tied, version)
            row[f"{mode}_s"], row[f"{mode}_mb"] = seconds, nbytes / 1e6
            received[mode] = got.tensors
        row["identical"] = all(torch.equal(received["full"][k].view(torch.int16),
                                           received["delta"][k].view(torch.int16))
                               for k in on_cpu)
        rows.append(row)
        prev = flat
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items()), flush=True)
    print(_summary(rows, rows[0]["full_mb"]))
    print(f"load average at end {os.getloadavg()}")
    for sender, rx in pairs.values():
        sender.close()
        rx.close()


if __name__ == "__main__":
    main()
