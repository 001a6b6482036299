"""Our torch generation engine: continuous batching and keyed sampling behind the
request-level interface (`engines.interface`).

One decode thread runs a `continuous.ContinuousBatch` for the engine's life: each
request is a row, admitted into a free slot as it comes, handed back as soon as it ends.
Its noise is the uniform stream keyed by its own `seed`, so its tokens do not depend on
which requests decode beside it (a request keyed `request_seed(seed, step, sample id)`
samples what `generation.generate` samples for that row).

The decode thread is the only one that touches the weights and the batch: everything the
caller asks (a request, an abort, a pause, a commit) is queued to it and done between two
decode steps. A commit copies staged weights into the module there (`load_into_module`),
and the running rows go on under them from their KV cache as it is (the tokens before came
from the older weights, as in PipelineRL and AReaL); each token records the version that
sampled it and keeps the log-prob it was sampled with.

Weights are received by `weight_sync`'s receiver in `stage`, on the caller's thread while
requests decode.

A finished request's KV is kept by its `cache_salt` (`prefix_kv`, at most
`prefix_cache_mb`): a later request with that salt whose prompt starts with its tokens (a
multi-turn episode's next turn) prefills only the rest, as long as the weights that
computed that KV are still the ones served; a commit drops what it kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from rlhf_async.engines.interface import Capabilities, Completion, Finish, Prefill, Request
from rlhf_async.engines.torch.continuous import ContinuousBatch
from rlhf_async.engines.torch.prefix_kv import PrefixStore
from rlhf_async.log import get_logger
from rlhf_async.modeling.cpu_attention import cpu_attention
from rlhf_async.modeling.determinism import seeded_uniform
from rlhf_async.modeling.generation import (
    Generated,
    SamplingParams,
    completes_stop_string,
    stop_window,
)
from rlhf_async.modeling.rollout import PromptBatch
from rlhf_async.weight_sync import GroupSpec, load_into_module, make_receiver

log = get_logger(component="torch_engine")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Call:
    """Something for the decode thread, answered through `fut` on the caller's loop."""

    what: str  # "add" | "abort" | "pause" | "resume" | "commit" | "stop"
    arg: Any
    loop: asyncio.AbstractEventLoop | None = None
    fut: asyncio.Future[Any] | None = None

    def answer(self, value: Any = None, error: BaseException | None = None) -> None:
        if self.loop is None or self.fut is None:
            return
        fut = self.fut

        def set_() -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)
        self.loop.call_soon_threadsafe(set_)


class TorchEngine:
    """The torch engine over a causal LM (GPT-2, Llama, Qwen2, Mistral with plain
    parameters: our functional decode step). `slots`: rows decoding at once, 0 = every
    request submitted (the caller caps)."""

    name = "torch"
    capabilities = Capabilities(keep_on_update=True, stop_strings=True, prefix_cache=True,
                                tensor_parallel=False)

    def __init__(self, model_dir: str, params: SamplingParams, *, dtype: str = "float32",
                 tensor_parallel: int = 1, sync_backend: str = "gloo",
                 device: torch.device | str = "cpu", module: nn.Module | None = None,
                 slots: int = 0, prefix_cache_mb: int = 512) -> None:
        if tensor_parallel != 1:
            raise ValueError("the torch generation engine keeps a whole copy (tensor_parallel "
                             f"1, got {tensor_parallel}); use an engine with tensor_parallel")
        if dtype not in DTYPES:
            raise ValueError(f"torch engine dtype {dtype!r}: accepted {', '.join(DTYPES)}")
        self.device = torch.device(device)
        if module is None:
            # as an nn.Module: the same call (HF's own .to), torch's signature
            loaded: nn.Module = AutoModelForCausalLM.from_pretrained(model_dir,
                                                                     local_files_only=True)
            module = loaded.to(self.device, DTYPES[dtype])
            cpu_attention(module)
        self.module = module.eval()
        self.params = dataclasses.replace(params, episode=None)  # one response a request
        self.receiver = make_receiver(sync_backend, device=self.device)
        self._version = 0
        self._batch = ContinuousBatch(self.module, self.params, slots or None)
        self.prefixes = PrefixStore(prefix_cache_mb << 20)  # the decode thread's
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._outbox: list[_Call] = []  # the caller loop's, until its next iteration
        self._live: dict[str, _Call] = {}  # request id -> its "add" call (decode thread's)
        self._prefill: dict[str, Prefill] = {}  # request id -> its prompt's prefill (same)
        self._error: BaseException | None = None
        self._paused = False
        self._threads = torch.get_num_threads()  # the process's share of the cores
        self._thread = threading.Thread(target=self._run, name="torch-engine", daemon=True)
        self._thread.start()

    @classmethod
    def serving(cls, module: nn.Module, params: SamplingParams, *, sync_backend: str = "gloo",
                slots: int = 0, prefix_cache_mb: int = 512) -> TorchEngine:
        """An engine over an already loaded `module` (held in its dtype)."""
        device = next(module.parameters()).device
        return cls("", params, sync_backend=sync_backend, device=device, module=module,
                   slots=slots, prefix_cache_mb=prefix_cache_mb)

    # --- the interface (the caller's loop) ------------------------------------------------

    async def generate(self, request: Request) -> Completion:
        if request.max_new_tokens > self.params.max_new_tokens:
            raise ValueError(f"request {request.request_id}: max_new_tokens "
                             f"{request.max_new_tokens} > the engine's "
                             f"{self.params.max_new_tokens}")
        if tuple(request.stop_ids) not in ((), self.params.stop_ids) or \
                tuple(request.stop_strings) not in ((), self.params.stop_strings):
            raise ValueError("the torch engine ends responses at its SamplingParams' stop ids "
                             "and strings; a request cannot bring others")
        return await self._ask("add", request)

    async def abort(self, request_id: str) -> None:
        await self._ask("abort", request_id)

    async def pause(self) -> None:
        await self._ask("pause", None)

    async def resume(self) -> None:
        await self._ask("resume", None)

    def connect(self, spec: GroupSpec, rank: int) -> None:
        self.receiver.connect(spec, rank)

    def stage(self, plan: Mapping[str, Any]) -> tuple[int, dict[str, Tensor]]:
        """Receive an update beside decoding; copied out of the receiver's staging buffer
        so the next update can land while this one waits for its commit."""
        got = self.receiver.receive(plan)
        return got.version, {k: v.clone() for k, v in got.tensors.items()}

    def stage_tensors(self, tensors: Mapping[str, Tensor], version: int,
                      ) -> tuple[int, dict[str, Tensor]]:
        return version, {k: v.detach().clone() for k, v in tensors.items()}

    async def commit(self, staged: tuple[int, dict[str, Tensor]]) -> int:
        return int(await self._ask("commit", staged))

    async def sleep(self) -> None:
        """Nothing to free: the lock-step strategies generate with the rank's own model, not
        this engine, and KV kept for later turns goes at the next commit anyway."""

    async def wake(self) -> None:
        """(see `sleep`)"""

    @property
    def version(self) -> int:
        return self._version

    async def close(self) -> None:
        if self._thread.is_alive():
            self._calls.put(_Call("stop", None))
            await asyncio.to_thread(self._thread.join)
        self.receiver.close()
        kept = self.prefixes
        log.info("kept_kv", turns_reusing=kept.hits, turns_prefilled_whole=kept.misses,
                 tokens_not_prefilled=kept.reused_tokens, budget_mb=kept.budget >> 20)

    async def _ask(self, what: str, arg: Any) -> Any:
        if self._error is not None:
            raise RuntimeError("the torch engine's decode thread failed") from self._error
        loop = asyncio.get_running_loop()
        call = _Call(what, arg, loop, loop.create_future())
        self._send(loop, call)
        assert call.fut is not None
        try:
            return await call.fut
        except asyncio.CancelledError:
            if what == "add":  # nobody waits for it: free its row
                self._send(loop, _Call("abort", arg.request_id))
            raise

    def _send(self, loop: asyncio.AbstractEventLoop, call: _Call) -> None:
        """What this loop iteration asks goes to the thread together, in order (a chunk's
        requests share one prefill)."""
        if not self._outbox:
            loop.call_soon(self._flush)
        self._outbox.append(call)

    def _flush(self) -> None:
        calls, self._outbox = self._outbox, []
        self._calls.put(_Call("calls", calls))

    # --- the decode thread ----------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self._threads)  # a new thread's OpenMP team is all the cores
        try:
            self._loop()
        except BaseException as e:  # every caller waiting learns it; later ones too
            self._error = e
            for call in self._live.values():
                call.answer(error=RuntimeError(f"the torch engine failed: {e!r}"))
            for call in self._take(block=False):
                call.answer(error=RuntimeError(f"the torch engine failed: {e!r}"))
            raise

    def _loop(self) -> None:
        batch = self._batch
        handlers: dict[str, Callable[[_Call], None]] = {
            "add": self._add, "abort": self._abort, "pause": self._pause,
            "resume": self._resume, "commit": self._commit}
        while True:
            for call in self._take(block=self._paused or not batch.busy):
                if call.what == "stop":
                    return
                handlers[call.what](call)
            if self._paused or not batch.busy:
                continue
            for rid, g in batch.step(self._version):
                self._hand_back(rid, g, None)

    def _take(self, block: bool) -> list[_Call]:
        """The calls queued since the last step (waiting for one when `block`)."""
        got = [self._calls.get()] if block else []
        while True:
            try:
                got.append(self._calls.get_nowait())
            except queue.Empty:
                return [c for g in got for c in (g.arg if g.what == "calls" else [g])]

    def _add(self, call: _Call) -> None:
        req: Request = call.arg
        if req.request_id in self._live:
            call.answer(error=ValueError(f"request {req.request_id!r} is already running"))
            return
        ids = torch.tensor([req.prompt_ids], dtype=torch.long, device=self.device)
        one = torch.zeros(1, dtype=torch.long, device=self.device)
        prompts = PromptBatch(ids, torch.ones_like(ids), one, one)
        u = seeded_uniform(req.seed, (self.params.max_new_tokens,))[None]
        salt = req.cache_salt
        past = None if salt is None else self.prefixes.take(salt, req.prompt_ids,
                                                            self._version)
        rid, n = req.request_id, len(req.prompt_ids)

        def admitted(_: int, reused: int) -> None:  # the kept KV its prefill really used
            self._prefill[rid] = Prefill.of(n, reused)
        self._batch.add(rid, prompts, u, torch.tensor([req.max_new_tokens]),
                        torch.tensor([req.min_new_tokens]), [past],
                        None if salt is None or not self.prefixes.budget else
                        lambda _, kept: self.prefixes.put(salt, kept), admitted)
        self._live[req.request_id] = call

    def _abort(self, call: _Call) -> None:
        rid = call.arg
        g = self._batch.cancel(rid)
        if g is not None:
            self._hand_back(rid, g, "abort")
        call.answer()

    def _pause(self, call: _Call) -> None:
        self._paused = True
        call.answer()

    def _resume(self, call: _Call) -> None:
        self._paused = False
        call.answer()

    def _commit(self, call: _Call) -> None:
        """Copy staged weights in (no forward runs now); a failed copy leaves the weights
        as they were (`load_into_module` checks before it copies)."""
        version, tensors = call.arg
        try:
            load_into_module(self.module, tensors)
        except Exception as e:
            call.answer(error=e)
            return
        self._version = version
        self._batch.reload()
        self.prefixes.drop_other_versions(version)
        call.answer(version)

    def _hand_back(self, rid: str, g: Generated, finish: Finish | None) -> None:
        call = self._live.pop(rid, None)
        prefill = self._prefill.pop(rid, Prefill())
        if call is None:
            return
        n = int(g.response_mask[0].sum())
        ids = g.response_ids[0, :n].tolist()
        call.answer(Completion(rid, ids, g.logprobs[0, :n].tolist(),
                               g.token_versions[0, :n].tolist(),
                               finish or self._finish(ids, call.arg.max_new_tokens),
                               prefill))

    def _finish(self, ids: list[int], limit: int) -> Finish:
        """Why a handed-back response ended: a stop, or its token limit."""
        p = self.params
        if ids and (ids[-1] in p.stops or len(ids) < limit):
            return "stop"
        if ids and p.stop_strings and p.decode is not None and \
                completes_stop_string(ids[-stop_window(p.stop_strings):], p.stop_strings,
                                      p.decode):
            return "stop"
        return "length"

