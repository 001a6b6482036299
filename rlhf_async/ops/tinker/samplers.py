"""The Tinker API's sampling sessions: samplers by id (a base model, `tinker://` sampler
weights, or a training model's snapshot from `save_weights_for_sampler`), `asample` on
them, and what a restart or a finished session left of them. Part of `TinkerService`
(`service.sampling`), which owns the futures, the store and the sessions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Protocol

import torch

from rlhf_async.log import get_logger
from rlhf_async.ops.tinker import schema
from rlhf_async.ops.tinker.base_models import resolve
from rlhf_async.ops.tinker.futures import ApiError, Futures, UserError
from rlhf_async.ops.tinker.sampling import Sampler, read_sampler_base
from rlhf_async.ops.tinker.state import ModelEntry, Session, Store

log = get_logger(component="tinker_api")
SAMPLERS_KEPT = 4  # a training model's newest samplers from save_weights_for_sampler
SAMPLE_PREFIX = "s-"  # a sampling request's id: lost in a restart, the client resends it


class Service(Protocol):
    """What the sampling sessions use of the service that holds them (`TinkerService`)."""

    device: torch.device
    futures: Futures
    models_dir: Path
    sessions: dict[str, Session]
    store: Store

    def checkpoint_dir(self, path: str, kind: str) -> Path: ...

    def session(self, sid: str) -> Session: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...


class SamplingSessions:
    def __init__(self, svc: Service) -> None:
        self.svc = svc
        self.samplers: dict[str, Sampler] = {}
        self._released: set[str] = set()  # snapshot samplers let go (SAMPLERS_KEPT)
        self.saved: dict[str, dict[str, Any]] = {}  # made from saved weights: restorable

    async def aclose(self) -> None:
        for sampler in self.samplers.values():
            await sampler.close()

    def release_session(self, sid: str) -> None:
        """A finished session's samplers close (each holds a copy of a model)."""
        for key in [k for k in self.samplers if k.split(":", 1)[0] == sid]:
            self.svc.spawn(self.samplers.pop(key).close())

    def keep(self, e: ModelEntry, sampler: Sampler) -> None:
        """Register a snapshot sampler; a model's older ones beyond SAMPLERS_KEPT go (an RL
        loop makes one a step; each holds a copy of the model)."""
        self.samplers[sampler.id] = sampler
        e.samplers.append(sampler.id)
        while len(e.samplers) > SAMPLERS_KEPT:
            old = self.samplers.pop(e.samplers.pop(0), None)
            if old is not None:
                self._released.add(old.id)
                self.svc.spawn(old.close())

    async def create(self, req: schema.CreateSamplingSession) -> dict[str, Any]:
        self.svc.session(req.session_id)
        sid = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        if sid not in self.samplers:
            self.samplers[sid] = await self._new_sampler(sid, req.base_model, req.model_path)
            self.svc.store.save_sampler(sid, req.base_model, req.model_path)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    async def _known_sampler(self, sid: str) -> Sampler | None:
        """A sampler by id; one a previous server made from saved weights, made again."""
        if sid not in self.samplers and sid in self.saved:
            rec = self.saved.pop(sid)
            self.samplers[sid] = await self._new_sampler(sid, rec.get("base_model"),
                                                         rec.get("model_path"))
        return self.samplers.get(sid)

    async def _new_sampler(self, sid: str, base_model: str | None,
                           model_path: str | None) -> Sampler:
        try:
            weights = None
            if model_path is not None:
                weights = self.svc.checkpoint_dir(model_path, "sampler_weights")
                base_model = read_sampler_base(weights)
            if base_model is None:
                raise UserError("a sampler needs a base_model or a model_path")
            base = await asyncio.to_thread(resolve, base_model, self.svc.models_dir)
        except UserError as e:
            raise ApiError(400, str(e)) from None
        return Sampler(sid, base, model_path, weights, self.svc.device)

    async def get(self, sid: str) -> dict[str, Any]:
        sampler = await self._known_sampler(sid)
        if sampler is None:
            raise ApiError(404, f"unknown sampler {sid!r}{self._why_unknown(sid)}")
        return sampler.describe()

    async def asample(self, req: schema.Sample) -> dict[str, Any]:
        if req.sampling_session_id is not None:
            sampler = await self._known_sampler(req.sampling_session_id)
            if sampler is None and req.sampling_session_id in self._released:
                raise ApiError(404, f"sampling session {req.sampling_session_id!r} was "
                                    f"released: a training model keeps its {SAMPLERS_KEPT} "
                                    "newest samplers; save the weights again")
            if sampler is None:
                raise ApiError(404, f"unknown sampling session {req.sampling_session_id!r}"
                                    f"{self._why_unknown(req.sampling_session_id)}")
        else:  # sampling without a session: one sampler per model named
            sid = f"direct:{req.model_path or req.base_model}"
            if sid not in self.samplers:
                self.samplers[sid] = await self._new_sampler(sid, req.base_model,
                                                             req.model_path)
            sampler = self.samplers[sid]
        rid = self.svc.futures.new(SAMPLE_PREFIX)
        self.svc.spawn(self._sample(rid, sampler, req))
        return {"request_id": rid,
                "sample_sequence_ids": [f"{rid}:{i}" for i in range(max(req.num_samples, 0))]}

    def _why_unknown(self, sid: str) -> str:
        session = self.svc.sessions.get(sid.split(":", 1)[0])
        if session is not None and session.finished:
            return f": its session {session.id} has finished"
        if session is not None and ":sample:" in sid:
            return (": its session outlived a server restart, but a sampler made by "
                    "save_weights_and_get_sampling_client held its weights in memory only; "
                    "save the weights for the sampler again")
        return ""

    async def _sample(self, rid: str, sampler: Sampler, req: schema.Sample) -> None:
        try:
            value = await sampler.sample(rid, req)
        except UserError as e:
            self.svc.futures.fail(rid, str(e), "user")
        except Exception as e:
            log.exception("sampling failed", sampler=sampler.id, request_id=rid)
            self.svc.futures.fail(rid, f"server error in asample: {type(e).__name__}: {e}",
                              "server")
        else:
            self.svc.futures.done(rid, value, "proto")
