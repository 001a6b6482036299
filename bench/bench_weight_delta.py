"""Delta vs full weight updates on SmolLM2-135M's shape (random init, bf16 shadows).

Why: a delta update is worth it only if it is much smaller and not slower end to end. Here
a real AdamW step (lr 3e-5) runs between updates; after each, the bf16 shadow weights go
through two gloo groups in this process (sender and receiver threads): one sending full
updates, one sending deltas. Reported per update: bytes on the wire, the fraction of bf16
values that changed, seconds from the start of the send until the receiver holds every
byte (encode + send + decode), and that both receivers hold the same bytes.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_weight_delta.py --updates 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from typing import Any

import torch
from transformers import LlamaForCausalLM

from bench.bench_decode import model_config
from rlhf_async.weight_sync import GroupSpec, TorchBroadcastReceiver, TorchBroadcastSender
from rlhf_async.weight_sync.plan import tied_names


def _pair(delta: bool) -> tuple[TorchBroadcastSender, TorchBroadcastReceiver]:
    sender = TorchBroadcastSender("gloo", delta=delta)
    spec = sender.prepare(GroupSpec("gloo", "127.0.0.1", 0, 2, timeout_s=120))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=6)
    ap.add_argument("--lr", type=float, default=3e-5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"load average at start {os.getloadavg()}")
    model = LlamaForCausalLM(model_config("smollm2", 30, 576, 9))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    tied = tied_names(model)
    pairs = {"full": _pair(False), "delta": _pair(True)}
    rows = []
    prev: dict[str, torch.Tensor] | None = None
    for version in range(args.updates):
        if version:
            ids = torch.randint(3, 49152, (2, 32))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        shadow = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
        changed = total = 0
        if prev is not None:
            for k, v in shadow.items():
                if k not in tied:
                    changed += int((v.view(torch.int16) != prev[k].view(torch.int16)).sum())
                    total += v.numel()
        row: dict[str, Any] = {"version": version,
                               "changed": changed / total if total else float("nan")}
        received = {}
        for mode, (sender, rx) in pairs.items():
            seconds, nbytes, got = _update(sender, rx, shadow, tied, version)
            row[f"{mode}_s"], row[f"{mode}_mb"] = seconds, nbytes / 1e6
            received[mode] = got.tensors
        row["identical"] = all(torch.equal(received["full"][k].view(torch.int16),
                                           received["delta"][k].view(torch.int16))
                               for k in shadow)
        rows.append(row)
        prev = shadow
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items()), flush=True)
    later = rows[1:]
    ratio = statistics.median(r["delta_mb"] / r["full_mb"] for r in later)
    print(f"full {rows[0]['full_mb']:.1f} MB; delta median {statistics.median(r['delta_mb'] for r in later):.1f} MB"
          f" = {100 * ratio:.1f}% of full; changed median "
          f"{100 * statistics.median(r['changed'] for r in later):.1f}%; seconds full "
          f"{statistics.median(r['full_s'] for r in later):.2f} delta "
          f"{statistics.median(r['delta_s'] for r in later):.2f}; identical "
          f"{all(r['identical'] for r in rows)}")
    print(f"load average at end {os.getloadavg()}")
    for sender, rx in pairs.values():
        sender.close()
        rx.close()


if __name__ == "__main__":
    main()
