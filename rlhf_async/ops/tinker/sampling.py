"""Sampling sessions of the Tinker API on our torch generation engine
(`engines/torch/engine.py`, behind `engines/interface.py`).

A sampler holds one frozen copy of a policy: a base model, a training model's weights at
`save_weights_for_sampler` (adapters merged), or weights saved under a `tinker://` path.
The engine fixes temperature, top-k, top-p, the stops and the longest response for its
life, while a Tinker request brings its own; so a sampler keeps one engine per distinct
setting and response-length class (a power of two from 64 up: an engine sized for the
model's whole context copies that much KV at every admission), at most `ENGINES_KEPT`,
the oldest closed, all decoding over the sampler's one module. Each of a
request's `num_samples` sequences is one engine request keyed by (seed, sample index).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_async.engines.interface import Request
from rlhf_async.engines.torch.engine import TorchEngine
from rlhf_async.modeling.cpu_attention import cpu_attention
from rlhf_async.modeling.determinism import key_seed
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.ops.tinker import proto, schema
from rlhf_async.ops.tinker.base_models import BaseModel
from rlhf_async.ops.tinker.futures import UserError
from rlhf_async.weight_sync import load_into_module

ENGINES_KEPT = 6
MIN_ROOM = 64  # the smallest response-length class of an engine
MAX_SAMPLES = 256  # num_samples of one request
WEIGHTS_FILE, META_FILE = "weights.safetensors", "checkpoint.json"


@dataclass(frozen=True)
class Setting:
    """What an engine fixes: the request's sampling settings that are not per request."""

    temperature: float
    top_k: int
    top_p: float
    stop_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]
    eos: bool  # stop at EOS (`stop = []` turns it off)


def setting(p: schema.SamplingParams) -> Setting:
    """The request's settings, checked; temperature 0 is greedy (top-k 1)."""
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise UserError(f"sampling_params.temperature must be >= 0, got {p.temperature}")
    if not 0.0 < p.top_p <= 1.0:
        raise UserError(f"sampling_params.top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < -1 or p.top_k == 0:
        raise UserError(f"sampling_params.top_k must be -1 (no limit) or >= 1, got {p.top_k}")
    stop = p.stop
    strings = (stop,) if isinstance(stop, str) else tuple(s for s in stop or [] if
                                                            isinstance(s, str))
    ids = tuple(s for s in stop or [] if isinstance(s, int)) if not isinstance(stop, str) \
        else ()
    if any(not s for s in strings):
        raise UserError("sampling_params.stop: an empty stop string")
    top_k = 1 if p.temperature == 0 else max(p.top_k, 0)
    return Setting(p.temperature or 1.0, top_k, p.top_p, ids, strings, stop != [])


def read_sampler_base(path: Path) -> str:
    """The base model a saved sampler checkpoint goes on."""
    return str(json.loads((path / META_FILE).read_text())["base_model"])


def save_sampler_weights(out: Path, weights: dict[str, Tensor], base_model: str) -> None:
    """A sampler checkpoint: merged weights + the base model they go on."""
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / WEIGHTS_FILE))
    (out / META_FILE).write_text(json.dumps({"base_model": base_model}))


class Sampler:
    def __init__(self, sid: str, base: BaseModel, model_path: str | None,
                 weights: dict[str, Tensor] | Path | None, device: torch.device) -> None:
        self.id, self.base, self.model_path = sid, base, model_path
        self._weights, self.device = weights, device
        self._module: Any = None  # the HF causal LM, once loaded
        self._tok: Any = None
        self._engines: OrderedDict[tuple[Setting, int], TorchEngine] = OrderedDict()
        self._lock = asyncio.Lock()

    def describe(self) -> dict[str, Any]:
        return {"sampler_id": self.id, "base_model": self.base.name,
                "model_path": self.model_path}

    def _load(self) -> tuple[nn.Module, Any]:
        module = AutoModelForCausalLM.from_pretrained(self.base.path, local_files_only=True)
        weights = self._weights
        if isinstance(weights, Path):
            weights = load_file(str(weights / WEIGHTS_FILE))
        if weights is not None:
            _untie(module)
            load_into_module(module, weights)
        module = module.float().to(self.device).eval()
        cpu_attention(module)
        self._weights = None  # in the module now
        tok = AutoTokenizer.from_pretrained(self.base.path, local_files_only=True)
        return module, tok

    async def _engine(self, s: Setting, room: int) -> TorchEngine:
        """The engine for setting `s` whose responses take up to `room` tokens."""
        key = (s, room)
        async with self._lock:
            if self._module is None:
                self._module, self._tok = await asyncio.to_thread(self._load)
            if key in self._engines:
                self._engines.move_to_end(key)
                return self._engines[key]
            eos = self._tok.eos_token_id if s.eos else -1  # -1: never sampled
            params = SamplingParams(max_new_tokens=room, eos_id=eos,
                                    pad_id=self._tok.pad_token_id or 0,
                                    temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                    stop_ids=s.stop_ids, stop_strings=s.stop_strings,
                                    decode=self._tok.decode if s.stop_strings else None)
            engine = TorchEngine.serving(self._module, params, prefix_cache_mb=0)
            self._engines[key] = engine
            if len(self._engines) > ENGINES_KEPT:
                _, old = self._engines.popitem(last=False)
                await old.close()
            return engine

    async def sample(self, rid: str, req: schema.Sample) -> bytes:
        prompt = prompt_tokens(req)
        limit = self.base.max_length or 4096
        if not prompt:
            raise UserError("asample: the prompt has no tokens")
        if len(prompt) >= limit:
            raise UserError(f"asample: the prompt has {len(prompt)} tokens; {self.base.name} "
                            f"takes at most {limit} in all")
        max_tokens = req.sampling_params.max_tokens
        max_tokens = limit - len(prompt) if max_tokens is None else max_tokens
        if not 1 <= max_tokens <= limit - len(prompt):
            raise UserError(f"asample: max_tokens {max_tokens} with a {len(prompt)}-token "
                            f"prompt; {self.base.name} takes {limit} tokens in all")
        if not 1 <= req.num_samples <= MAX_SAMPLES:
            raise UserError(f"asample: num_samples must be 1..{MAX_SAMPLES}, got "
                            f"{req.num_samples}")
        if req.topk_prompt_logprobs or req.topk_sample_logprobs or req.prompt_alt_tokens_k \
                or req.target_prompt_logprobs is not None:
            raise UserError("asample: top-k log-probs, target prompt log-probs and alternative "
                            "prompt tokens are not served by this server")
        last_n = req.prompt_logprobs_last_n
        if last_n is not None and not 1 <= last_n <= len(prompt) - 1:
            raise UserError(f"asample: prompt_logprobs_last_n must be 1..{len(prompt) - 1}, "
                            f"got {last_n}")
        engine = await self._engine(setting(req.sampling_params),
                                    length_class(max_tokens, limit))
        assert self._module is not None
        vocab = int(self._module.get_input_embeddings().weight.shape[0])
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise UserError(f"asample: the prompt has a token id outside the vocabulary "
                            f"(0..{vocab - 1})")
        seed = req.sampling_params.seed
        seed = random.getrandbits(62) if seed is None else seed
        done = await asyncio.gather(*(engine.generate(Request(
            f"{rid}-{i}", tuple(prompt), max_tokens, key_seed(seed, "tinker-sample", i)))
            for i in range(req.num_samples)))
        seqs = [proto.Sequence(c.token_ids, c.logprobs, c.finish == "stop") for c in done]
        prompt_lp = await asyncio.to_thread(self._prompt_logprobs, prompt) \
            if req.prompt_logprobs else None
        if prompt_lp is not None and last_n is not None:  # the earlier ones: not scored
            prompt_lp[:len(prompt) - last_n] = [math.nan] * (len(prompt) - last_n)
        return proto.sample_response(seqs, prompt_lp)

    @torch.no_grad()
    def _prompt_logprobs(self, prompt: list[int]) -> list[float]:
        """log p(prompt[i] | prompt[:i]); the first has no context (NaN, as the API has it)."""
        assert self._module is not None
        ids = torch.tensor([prompt], device=self.device)
        logits = self._module(input_ids=ids, use_cache=False).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        return [math.nan, *lp.tolist()]

    async def close(self) -> None:
        for engine in self._engines.values():
            await engine.close()
        self._engines.clear()


def length_class(max_tokens: int, limit: int) -> int:
    """The engine size a response of up to `max_tokens` goes to: the power of two at or
    above it (at least MIN_ROOM), at most the model's context `limit`."""
    room = MIN_ROOM
    while room < max_tokens:
        room *= 2
    return min(room, limit)


def _untie(module: Any) -> None:
    """Give the unembedding its own tensor where the model ties it to the embedding: a
    LoRA adapter on the unembedding (train_unembed) changes only the output side, so the
    merged weights hold two different tensors for the one the base model shares."""
    out, inp = module.get_output_embeddings(), module.get_input_embeddings()
    if out is not None and out.weight is inp.weight:
        out.weight = nn.Parameter(out.weight.detach().clone())
        module.config.tie_word_embeddings = False


def prompt_tokens(req: schema.Sample) -> list[int]:
    out: list[int] = []
    for chunk in req.prompt.chunks:
        if chunk.type != "encoded_text":
            raise UserError(f"asample: {chunk.type} chunks are not served (token chunks only)")
        out += chunk.tokens
    return out
