"""The Tinker API's own cost on the built-in tiny model: what the real `tinker` client gets
through `rlhf-async serve --api` (a separate process) against the same work done in this
process without HTTP, taking turns round by round.

    python -m bench.tinker_api [--rounds 5] [--threads 1] [--batch 8] [--seq 64]
                               [--requests 8] [--samples 4] [--max-tokens 64]

- train: one `forward_backward` (cross_entropy, `--batch` sequences of `--seq` tokens) +
  `optim_step` on a LoRA rank-8 model, both submitted before waiting (as the client's
  docs advise), against `TrainedModel.forward_backward` + `optim_step` called directly.
- sample: `--requests` concurrent `sample` calls of `--samples` sequences of
  `--max-tokens` tokens each (no stop, temperature 1) on the base model, against the same
  requests on our torch engine (`TorchEngine.serving`, set up as the server's sampler
  sets it up) called directly: generated tokens per second.

The server and the direct runs use `--threads` torch threads. Prints a table and writes
bench/results/tinker_api.json, with the load average before and after. On Linux it also
counts the CPU time each side spends on a sample round (from /proc): the server's event
loop (its main thread), the server's other threads (the engine's decode thread), the
client process (the SDK), and the direct run: unlike the wall times, these hardly move
with the load other work puts on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from bench.output import write_json
from rlhf_async.engines.interface import Request
from rlhf_async.engines.torch.engine import TorchEngine
from rlhf_async.modeling.cpu_attention import cpu_attention
from rlhf_async.modeling.determinism import key_seed
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.ops.tinker.base_models import BUILTIN, BaseModel, resolve
from rlhf_async.ops.tinker.proto import Datum
from rlhf_async.ops.tinker.training import Lora, TrainedModel
from rlhf_async.wire.local import free_tcp_port

KEY = "tml-bench-0123456789"
ROOT = Path(__file__).resolve().parents[1]


def start_server(state: Path, port: int, threads: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "RLHF_ASYNC_API_KEY": KEY, "OMP_NUM_THREADS": str(threads),
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    log = (state / "serve.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_async", "serve", "--state-dir",
                             str(state), "--api", f"127.0.0.1:{port}", "--log-level",
                             "warning"], env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {(state / 'serve.log').read_text()[-2000:]}")
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/healthz",
                                         headers={"X-API-Key": KEY})
            urllib.request.urlopen(req, timeout=2).read()
            return proc
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit("the server did not come up in 180 s") from None
            time.sleep(0.2)


def cpu_s(pid: int, tid: int | None = None) -> float | None:
    """CPU seconds (user + system) process `pid`, or its thread `tid`, has used; None
    without /proc (not Linux)."""
    path = Path(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
    try:
        fields = path.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuCounts:
    """CPU time per side over the sample rounds: `take` before and after each."""

    SIDES = ("server_event_loop", "server_engine", "client", "direct")

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.total = dict.fromkeys(self.SIDES, 0.0)
        self.rounds = 0
        self.available = cpu_s(server_pid, server_pid) is not None

    def take(self) -> dict[str, float]:
        if not self.available:
            return {}
        pid = self.server_pid
        loop, server, me = cpu_s(pid, pid), cpu_s(pid), cpu_s(os.getpid())
        if loop is None or server is None or me is None:  # the server went away
            self.available = False
            return {}
        return {"loop": loop, "server": server, "me": me}

    def add(self, before: dict[str, float], api_done: dict[str, float],
            after: dict[str, float]) -> None:
        """One round: `before` the API's sample, `api_done` after it, `after` the direct."""
        if not (before and api_done and after):
            return
        self.total["server_event_loop"] += api_done["loop"] - before["loop"]
        # the rest of the server's process: two clock-tick counters read one after the
        # other, so a tick the loop takes between the reads can make it -1 tick when the
        # engine used none (seen under load)
        self.total["server_engine"] += max(0.0, (api_done["server"] - before["server"])
                                           - (api_done["loop"] - before["loop"]))
        self.total["client"] += api_done["me"] - before["me"]
        self.total["direct"] += after["me"] - api_done["me"]
        self.rounds += 1

    def per_round_ms(self) -> dict[str, float] | None:
        if not self.rounds:
            return None
        return {k: 1000 * v / self.rounds for k, v in self.total.items()}


def token_rows(batch: int, seq: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 250, (batch, seq + 1), generator=g).tolist()


class Api:
    """The real client on the server."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        import tinker
        from tinker import types

        self.types = types
        self.service = tinker.ServiceClient(base_url=url, api_key=KEY)
        self.training = self.service.create_lora_training_client(base_model=BUILTIN, rank=8,
                                                                 seed=0).result()
        self.data = [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]),
                                 loss_fn_inputs={"target_tokens": r[1:]})
                     for r in token_rows(args.batch, args.seq)]
        self.sampler = self.service.create_sampling_client(base_model=BUILTIN).result()
        self.args = args

    def train(self) -> float:
        t = time.perf_counter()
        fb = self.training.forward_backward(self.data, "cross_entropy")
        opt = self.training.optim_step(self.types.AdamParams(learning_rate=1e-4))
        fb.result()
        opt.result()
        return time.perf_counter() - t

    def sample(self, round_: int) -> tuple[float, int]:
        a, types = self.args, self.types
        params = types.SamplingParams(max_tokens=a.max_tokens, temperature=1.0, stop=[])
        prompts = [types.ModelInput.from_ints(r[:8]) for r in token_rows(a.requests, 8)]
        t = time.perf_counter()
        futures = [self.sampler.sample(p, a.samples, params.model_copy(
            update={"seed": 1000 * round_ + i})) for i, p in enumerate(prompts)]
        tokens = sum(len(s.tokens) for f in futures for s in f.result().sequences)
        return time.perf_counter() - t, tokens


class Direct:
    """The same work in this process: the trainer's model and our engine, no HTTP."""

    def __init__(self, base: BaseModel, args: argparse.Namespace) -> None:
        self.model = TrainedModel(base, Lora(8, 0), torch.device("cpu"))
        self.data = [Datum(r[:-1], {"target_tokens": torch.tensor(r[1:]).numpy()})
                     for r in token_rows(args.batch, args.seq)]
        module = AutoModelForCausalLM.from_pretrained(base.path, local_files_only=True)
        module = module.float().eval()
        cpu_attention(module)
        # sized for these requests, as a caller of the engine sizes it; no EOS (stop=[])
        params = SamplingParams(max_new_tokens=args.max_tokens, eos_id=-1, pad_id=0,
                                temperature=1.0, top_k=0, top_p=1.0)
        self.engine = TorchEngine.serving(module, params, prefix_cache_mb=0)
        self.loop = asyncio.new_event_loop()
        self.args = args

    def train(self) -> float:
        t = time.perf_counter()
        self.model.forward_backward(self.data, "cross_entropy", {}, forward_only=False)
        self.model.optim_step(1e-4, 0.9, 0.95, 1e-12, 0.0, 0.0)
        return time.perf_counter() - t

    def sample(self, round_: int) -> tuple[float, int]:
        a = self.args
        prompts = [tuple(r[:8]) for r in token_rows(a.requests, 8)]
        reqs = [Request(f"{round_}-{i}-{j}", p, a.max_tokens,
                        key_seed(1000 * round_ + i, "tinker-sample", j))
                for i, p in enumerate(prompts) for j in range(a.samples)]

        async def go() -> int:
            done = await asyncio.gather(*(self.engine.generate(r) for r in reqs))
            return sum(len(c.token_ids) for c in done)

        t = time.perf_counter()
        tokens = self.loop.run_until_complete(go())
        return time.perf_counter() - t, tokens

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.close())
        self.loop.close()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    state = Path(tempfile.mkdtemp(prefix="bench-tinker-"))
    port = free_tcp_port()
    proc = start_server(state, port, args.threads)
    try:
        api = Api(f"http://127.0.0.1:{port}", args)
        direct = Direct(resolve(BUILTIN, state / "tinker" / "models"), args)
        for _ in range(2):  # warm-up: engines, allocators, the client's connections
            api.train(), direct.train(), api.sample(0), direct.sample(0)
        times: dict[str, list[float]] = {k: [] for k in
                                         ("api_train", "direct_train", "api_tps", "direct_tps")}
        cpu = CpuCounts(proc.pid)
        for r in range(1, args.rounds + 1):
            times["api_train"].append(api.train())
            times["direct_train"].append(direct.train())
            before = cpu.take()
            s, n = api.sample(r)
            times["api_tps"].append(n / s)
            api_done = cpu.take()
            s, n = direct.sample(r)
            times["direct_tps"].append(n / s)
            cpu.add(before, api_done, cpu.take())
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in times.items()),
                  file=sys.stderr)
        direct.close()
        api.service.close("success").result()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    med = {k: statistics.median(v) for k, v in times.items()}
    paired = [a / d for a, d in zip(times["api_tps"], times["direct_tps"], strict=True)]
    return {"rounds": times, "median": med,
            "train_overhead_ms": 1000 * (med["api_train"] - med["direct_train"]),
            "sample_ratio": med["api_tps"] / med["direct_tps"],
            # each round's API run beside its own direct run: less moved by load drifting
            "sample_ratio_paired": statistics.median(paired),
            "sample_cpu_ms_per_round": cpu.per_round_ms()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("bench/results/tinker_api.json"))
    args = p.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    load_before = os.getloadavg()
    result = measure(args)
    result.update(config=vars(args) | {"out": str(args.out)}, load_before=load_before,
                  load_after=os.getloadavg(), time_utc=time.strftime("%Y-%m-%d %H:%M",
                                                                     time.gmtime()))
    write_json(args.out, result)
    m = result["median"]
    print(f"train round trip  API {1000 * m['api_train']:.1f} ms   direct "
          f"{1000 * m['direct_train']:.1f} ms   overhead {result['train_overhead_ms']:.1f} ms")
    print(f"sampling tokens/s API {m['api_tps']:.0f}   direct {m['direct_tps']:.0f}   "
          f"ratio {result['sample_ratio']:.2f}x (round by round {result['sample_ratio_paired']:.2f}x)")
    if (c := result["sample_cpu_ms_per_round"]) is not None:
        print(f"CPU ms a sample round: server event loop {c['server_event_loop']:.1f}, server "
              f"engine {c['server_engine']:.1f}, client {c['client']:.1f}; direct "
              f"{c['direct']:.1f}")
    print(f"load {load_before[0]:.2f} -> {result['load_after'][0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
