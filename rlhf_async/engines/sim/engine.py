"""The simulated generation engine (`generation.backend = sim`, on `placement.device =
sim`): the request-level interface of `engines/interface.py` over a `VirtualBatch` whose
prefills and decode steps take the cost model's time for the simulated model on the
simulated GPU, dilated by `sim.time_scale`.

The engine sleeps once per scheduling boundary, never once per token: until the next
running request ends, or until something changes the batch (a request, an abort, a pause,
a commit), then brings the batch up to the time that really passed. A hundred of these on
two cores stay idle while they "compute".

What a request returns is real data the rest of the job trains on: response lengths drawn
from `sim.lengths` (keyed by the request's seed) and mapped in proportion onto the real
response length the task allows; token ids keyed by the seed; behaviour log-probs computed
by the small real policy this engine holds (the task's model, which the trainer's weight
broadcast keeps up to date), so the trainer's recomputed log-probs match them. The
log-probs are computed once, when a request ends, under the weights served then.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from rlhf_async.engines.interface import Capabilities, Completion, Finish, Prefill, Request
from rlhf_async.engines.sim.batch import Row, VirtualBatch
from rlhf_async.engines.sim.spec import SimSpec, active
from rlhf_async.modeling.generation import SamplingParams, scaled_logprobs
from rlhf_async.modeling.models import response_logits
from rlhf_async.weight_sync import GroupSpec, load_into_module, make_receiver

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SimEngine:
    name = "sim"
    capabilities = Capabilities(keep_on_update=True, stop_strings=False, prefix_cache=False,
                                tensor_parallel=False, devices=("sim",))

    def __init__(self, model_dir: str, params: SamplingParams, *, dtype: str = "float32",
                 tensor_parallel: int = 1, sync_backend: str = "gloo",
                 device: torch.device | str = "cpu", module: nn.Module | None = None,
                 spec: SimSpec | None = None, clock: Callable[[], float] | None = None,
                 ) -> None:
        if tensor_parallel != 1:
            raise ValueError("the sim engine simulates one GPU per generator (tensor_parallel "
                             f"1, got {tensor_parallel})")
        self.spec = spec or active()
        self.device = torch.device(device)
        if module is None:
            module = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
            module = module.to(self.device, DTYPES[dtype])  # type: ignore[arg-type]  # HF's .to
        self.module = module.eval()
        self.params = dataclasses.replace(params, episode=None)
        self.receiver = make_receiver(sync_backend, device=self.device)
        self.batch = VirtualBatch(self.spec)
        self._version = 0
        self._paused = False
        self._requests: dict[str, tuple[Request, asyncio.Future[Completion]]] = {}
        self._clock = clock or time.monotonic  # real seconds (a test's own clock)
        self._since = 0.0  # the clock's time the batch was last brought up to
        self._wake: asyncio.Event | None = None
        self._runner: asyncio.Task[None] | None = None

    # --- the interface --------------------------------------------------------------------

    async def generate(self, request: Request) -> Completion:
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already running")
        if request.max_new_tokens > self.params.max_new_tokens:
            raise ValueError(f"request {request.request_id}: max_new_tokens "
                             f"{request.max_new_tokens} > the engine's "
                             f"{self.params.max_new_tokens}")
        self._catch_up()
        total = self.spec.response_length(request.seed)
        # a shorter token budget (a resubmitted remainder) caps the simulated length too
        total = min(total, math.ceil(self.spec.max_response * request.max_new_tokens
                                     / self.params.max_new_tokens))
        fut: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._requests[request.request_id] = (request, fut)
        self.batch.add(Row(request.request_id, max(1, total)))
        self._poke()
        try:
            return await fut
        except asyncio.CancelledError:
            self._catch_up()
            self._requests.pop(request.request_id, None)
            self.batch.remove(request.request_id)
            raise

    async def abort(self, request_id: str) -> None:
        self._catch_up()
        row = self.batch.remove(request_id)
        if row is not None:
            self._deliver([row], "abort")
        self._poke()

    async def pause(self) -> None:
        self._catch_up()
        self._paused = True
        self._poke()

    async def resume(self) -> None:
        self._catch_up()
        self._paused = False
        self._poke()

    def connect(self, spec: GroupSpec, rank: int) -> None:
        self.receiver.connect(spec, rank)

    def stage(self, plan: Mapping[str, Any]) -> tuple[int, dict[str, Tensor]]:
        got = self.receiver.receive(plan)
        return got.version, {k: v.clone() for k, v in got.tensors.items()}

    def stage_tensors(self, tensors: Mapping[str, Tensor], version: int,
                      ) -> tuple[int, dict[str, Tensor]]:
        return version, {k: v.detach().clone() for k, v in tensors.items()}

    async def commit(self, staged: tuple[int, dict[str, Tensor]]) -> int:
        """At the boundary now: the tokens so far were the old version's, the rest the
        new one's (running requests keep their state)."""
        self._catch_up()
        version, tensors = staged
        load_into_module(self.module, tensors)
        self._version = version
        self._poke()
        return version

    async def sleep(self) -> None:
        """Nothing held to free: the simulated KV cache is arithmetic."""

    async def wake(self) -> None:
        """(see `sleep`)"""

    @property
    def version(self) -> int:
        return self._version

    async def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
        for _, fut in self._requests.values():
            if not fut.done():
                fut.set_exception(RuntimeError("the sim engine closed"))
        self.receiver.close()

    # --- simulated time ---------------------------------------------------------------------

    def _poke(self) -> None:
        """The batch changed: the runner plans its next boundary again."""
        if self._runner is None:
            self._wake = asyncio.Event()
            self._since = self._clock()
            self._runner = asyncio.ensure_future(self._run())
        assert self._wake is not None
        self._wake.set()

    def _catch_up(self) -> None:
        """Advance the batch by the simulated time that passed since it was last brought
        up to date, and hand back the requests that ended meanwhile."""
        if self._runner is None:
            return
        now = self._clock()
        passed, self._since = (now - self._since) / self.spec.time_scale, now
        if not self._paused:
            ended = self.batch.advance(passed, self._version)
            if ended:
                self._deliver(ended, None)

    async def _run(self) -> None:
        """Sleep until the next request ends or the batch changes; never per token."""
        assert self._wake is not None
        while True:
            self._wake.clear()
            wait = math.inf if self._paused else self.batch.until_next_end()
            if math.isinf(wait):
                await self._wake.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait * self.spec.time_scale)
            self._catch_up()

    # --- what a request returns ------------------------------------------------------------

    def _deliver(self, rows: list[Row], finish: Finish | None) -> None:
        """Completions for `rows` (ended, or cut short with `finish`), their log-probs from
        one forward of the real policy."""
        out: list[tuple[Row, Request, asyncio.Future[Completion], list[int], Finish]] = []
        for row in rows:
            got = self._requests.pop(row.rid, None)
            if got is None:
                continue
            req, fut = got
            how = finish or ("stop" if row.total < self.spec.max_response else "length")
            out.append((row, req, fut, self._tokens(row, req, how), how))
        logprobs = self._logprobs([(req, ids) for _, req, _, ids, _ in out])
        for (row, req, fut, ids, how), lps in zip(out, logprobs, strict=True):
            versions = [row.version_at((i + 0.5) / len(ids)) for i in range(len(ids))]
            if not fut.done():
                fut.set_result(Completion(req.request_id, ids, lps, versions, how,
                                          Prefill.of(len(req.prompt_ids), 0)))

    def _tokens(self, row: Row, req: Request, finish: Finish) -> list[int]:
        """The real response: its length in proportion to the simulated one, ids keyed by
        the request's seed (no stop token inside; EOS last when it stopped)."""
        limit = req.max_new_tokens
        n = min(limit, math.ceil(row.done * self.params.max_new_tokens / self.spec.max_response))
        if n <= 0:
            return []
        vocab = int(getattr(self.module.config, "vocab_size", 2))
        special = {*self.params.stops, self.params.pad_id}
        plain = next(i for i in range(vocab + len(special)) if i not in special)
        g = torch.Generator().manual_seed(req.seed % (1 << 63))
        ids = [i if i not in special else plain
               for i in torch.randint(0, vocab, (n,), generator=g).tolist()]
        if finish == "stop":
            ids[-1] = self.params.eos_id
        return ids

    @torch.no_grad()
    def _logprobs(self, done: list[tuple[Request, list[int]]]) -> list[list[float]]:
        """Each response's behaviour log-probs under the weights served now (one batched
        forward of the small real policy, prompts left-padded, responses right-padded)."""
        if not any(ids for _, ids in done):
            return [[] for _ in done]
        P = max(len(r.prompt_ids) for r, _ in done)
        R = max(1, max(len(ids) for _, ids in done))
        pad = self.params.pad_id
        prompt = torch.full((len(done), P), pad, dtype=torch.long)
        pmask = torch.zeros((len(done), P), dtype=torch.long)
        resp = torch.full((len(done), R), pad, dtype=torch.long)
        rmask = torch.zeros((len(done), R), dtype=torch.long)
        for i, (r, ids) in enumerate(done):
            if r.prompt_ids:
                prompt[i, P - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
                pmask[i, P - len(r.prompt_ids):] = 1
            if ids:
                resp[i, :len(ids)] = torch.tensor(ids)
                rmask[i, :len(ids)] = 1
        dev = self.device
        logits = response_logits(self.module, prompt.to(dev), pmask.to(dev), resp.to(dev),
                                 rmask.to(dev))  # [B, R, V]
        lps = scaled_logprobs(logits.reshape(-1, logits.shape[-1]), self.params)
        picked = lps.gather(-1, resp.to(dev).reshape(-1, 1)).reshape(len(done), R)
        return [picked[i, :len(ids)].tolist() for i, (_, ids) in enumerate(done)]
