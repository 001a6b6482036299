"""What each Tinker API call does, apart from HTTP: sessions, training models and their
ordered requests, futures. A handler returns the JSON reply (or a request id whose result
comes through `retrieve_future`) or raises `ApiError`; model work goes to the one model
thread (`futures.Worker`).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import torch

from rlhf_async.log import get_logger
from rlhf_async.ops.tinker import proto, schema
from rlhf_async.ops.tinker.base_models import BUILTIN, resolve
from rlhf_async.ops.tinker.futures import ApiError, Futures, Sequencer, UserError, Worker
from rlhf_async.ops.tinker.samplers import SAMPLE_PREFIX, SamplingSessions
from rlhf_async.ops.tinker.sampling import Sampler, save_sampler_weights
from rlhf_async.ops.tinker.state import (
    ModelEntry,
    ModelRecord,
    Session,
    Store,
    checkpoint_dir,
    lost_message,
    read_checkpoint,
    reload,
)
from rlhf_async.ops.tinker.training import Lora, TrainedModel

log = get_logger(component="tinker_api")
LONG_POLL_S = 20.0  # a retrieve_future waits this long for its result (the client: 45 s)
SESSION_IDLE_S = 1800.0  # a session not heard from this long ends (the client beats every 10 s)
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a checkpoint's name


def client_config() -> dict[str, Any]:
    """The feature flags the SDK asks for before anything else: plain API keys (no JWT
    exchange), httpx, uncompressed protobuf forward_backward, one retrieve_future per
    request, custom losses on the client."""
    return {"pjwt_auth_enabled": False, "credential_default_source": "api_key",
            "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
            "parallel_fwdbwd_chunks": True, "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False, "sample_join_sampling_session": False}


class TinkerService:
    def __init__(self, state_dir: Path, device: str | None = None) -> None:
        self.root = Path(state_dir) / "tinker"
        self.models_dir = self.root / "models"
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.futures = Futures()
        self.worker = Worker(self.futures)
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, ModelEntry] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.store = Store(self.root)
        self.sampling = SamplingSessions(self)
        self.restore()

    def restore(self) -> None:
        """Sessions, models and sampling sessions as a previous server left them (state.py):
        models load on first use, as their last checkpoint; one that had trained past it
        fails its requests with what was lost until the client loads a checkpoint."""
        for s in self.store.sessions():
            s.last_seen = time.time()  # its client gets SESSION_IDLE_S to come back
            self.sessions[s.id] = s
        for rec in self.store.models():
            session = self.sessions.get(rec.session_id)
            if session is None or session.finished:  # its checkpoints stay loadable
                continue
            try:
                lora = Lora(**rec.lora)
            except TypeError:
                log.warning("tinker model record skipped: bad lora", model=rec.id)
                continue
            rid = self.futures.new()
            entry = ModelEntry(rec.id, rec.session_id, rec.base_model, lora,
                               self._sequencer(rec, self.store.next_seq(rec)), rid,
                               created=rec.created,
                               record=rec, restored=True)
            self.futures.done(rid, {"type": "create_model", "model_id": rec.id})
            if rec.changed:
                entry.lost = lost_message(rec)
            self.models[rec.id] = entry
        self.sampling.saved = self.store.samplers()
        if self.sessions or self.models:
            log.info("tinker state restored", sessions=len(self.sessions),
                     models=len(self.models), samplers=len(self.sampling.saved))

    def _sequencer(self, rec: ModelRecord, next_seq: int = 1) -> Sequencer:
        def accepted(nxt: int) -> None:
            rec.next_seq = nxt
            self.store.append_seq(rec.id, nxt)
        return Sequencer(self.worker, next_seq, on_accept=accepted)

    def note(self, entry: ModelEntry, **changes: Any) -> None:
        """Update a model's persisted record (from any thread) where it changes."""
        rec = entry.record
        if rec is not None and any(getattr(rec, k) != v for k, v in changes.items()):
            for k, v in changes.items():
                setattr(rec, k, v)
            self.store.save_model(rec)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.sampling.aclose()
        await asyncio.to_thread(self.worker.shutdown)
        self.store.close()

    def run_id(self, model_id: str) -> str:
        """A model's training run id in `tinker://` paths (its id, ':' -> '_')."""
        return model_id.replace(":", "_")

    def checkpoint_dir(self, path: str, kind: str) -> Path:
        return checkpoint_dir(self.root, path, kind)

    def read_checkpoint(self, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        return read_checkpoint(self.root, path)

    # ---- sessions ----------------------------------------------------------------------
    def create_session(self, req: schema.CreateSession) -> dict[str, Any]:
        sid = f"session-{uuid.uuid4().hex[:16]}"
        now = time.time()
        self.sessions[sid] = Session(sid, req.sdk_version, now, now)
        self.store.save_session(self.sessions[sid])
        log.info("session created", session=sid, sdk=req.sdk_version)
        return {"type": "create_session", "session_id": sid}

    def session(self, sid: str) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            raise ApiError(404, f"unknown session {sid!r} (never created here, or the server "
                                "restarted since)")
        if s.finished:
            raise ApiError(410, f"session {sid!r} has finished")
        return s

    def heartbeat(self, req: schema.SessionRef) -> dict[str, Any]:
        self.session(req.session_id).last_seen = time.time()
        return {"type": "session_heartbeat"}

    def finish_session(self, sid: str) -> dict[str, Any]:
        s = self.session(sid)
        s.finished = True
        self.store.save_session(s)
        self._release_session(sid, f"its session {sid} has finished")
        log.info("session finished", session=sid)
        return {}

    def start_reaper(self, every_s: float = 60.0) -> None:
        """End idle sessions (`expire_idle`) every `every_s` seconds while serving."""
        async def reap() -> None:
            while True:
                await asyncio.sleep(every_s)
                self.expire_idle(time.time())

        self.spawn(reap())

    def expire_idle(self, now: float) -> list[str]:
        """End the sessions not heard from in SESSION_IDLE_S (a client that died without
        closing), their models and samplers released; their ids."""
        idle = [s for s in self.sessions.values()
                if not s.finished and now - s.last_seen > SESSION_IDLE_S]
        for s in idle:
            s.finished = True
            self.store.save_session(s)
            self._release_session(s.id, f"its session {s.id} ended: no heartbeat for "
                                        f"{SESSION_IDLE_S / 60:.0f} min")
            log.warning("idle session ended", session=s.id, idle_s=round(now - s.last_seen))
        return [s.id for s in idle]

    def _release_session(self, sid: str, why: str) -> None:
        """A finished session's models and samplers let their memory go (a long-running
        server sees many sessions); their checkpoints stay, loadable from any session."""
        for e in [e for e in self.models.values() if e.session_id == sid]:
            e.closed = (f"{why}; go on from a checkpoint (create_training_client_from_state) "
                        "in a new session")

            def free(e: ModelEntry = e) -> tuple[dict[str, Any], str]:
                e.trained = None  # on the model thread: no request of it is running
                return {}, "json"

            self.worker.submit(self.futures.new(), free, "release")  # type: ignore[arg-type]
        self.sampling.release_session(sid)

    # ---- training models ---------------------------------------------------------------
    def create_model(self, req: schema.CreateModel) -> dict[str, Any]:
        self.session(req.session_id)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        if model_id in self.models:  # a retry
            return {"request_id": self.models[model_id].create_rid, "model_id": model_id}
        cfg = req.lora_config or schema.LoraConfig(rank=0)
        if cfg.rank < 0:
            raise ApiError(400, f"create_model: lora_config.rank must be >= 0 (0: train every "
                                f"weight), got {cfg.rank}")
        if req.optimizer_config.type != "adamw":
            raise ApiError(400, f"create_model: optimizer {req.optimizer_config.type!r} is not "
                                "served; this server trains with adamw")
        seed = cfg.seed if cfg.seed is not None else int(uuid.uuid4().int % (1 << 31))
        lora = Lora(cfg.rank, seed, cfg.train_mlp, cfg.train_attn, cfg.train_unembed)
        rid = self.futures.new()
        entry = self.new_entry(model_id, req.session_id, req.base_model, lora, rid, None)

        def load() -> tuple[dict[str, Any], str]:
            try:
                entry.base = resolve(req.base_model, self.models_dir)
                entry.trained = TrainedModel(entry.base, lora, self.device)
            except Exception as e:
                entry.error = str(e)
                raise
            log.info("model created", model=model_id, base=req.base_model, lora_rank=lora.rank,
                     trainable=entry.trained.trainable)
            return {"type": "create_model", "model_id": model_id}, "json"

        self.worker.submit(rid, load, "create_model")  # type: ignore[arg-type]
        return {"request_id": rid, "model_id": model_id}

    def new_entry(self, model_id: str, session_id: str, base_model: str, lora: Lora,
                  rid: str, origin: str | None, optimizer: bool = False) -> ModelEntry:
        """A new training model, registered and persisted (its weights load on the model
        thread)."""
        entry = ModelEntry(model_id, session_id, base_model, lora, Sequencer(self.worker),
                           rid)
        rec = entry.make_record()
        rec.origin, rec.origin_optimizer = origin, optimizer
        entry.seq = self._sequencer(rec)
        self.store.save_model(rec)
        self.models[model_id] = entry
        return entry

    def entry(self, model_id: str) -> ModelEntry:
        e = self.models.get(model_id)
        if e is None:
            raise ApiError(404, f"unknown model {model_id!r} (never created here, or the "
                                "server restarted since)")
        return e

    def trained(self, entry: ModelEntry, replacing: bool = False) -> TrainedModel:
        """On the model thread: the model, which its create_model loaded before (a restored
        one loads now). `replacing`: the request loads a checkpoint into it (allowed after
        a restart lost its training)."""
        if entry.closed is not None:
            raise UserError(f"model {entry.id}: {entry.closed}")
        if entry.trained is None and entry.restored and entry.error is None:
            reload(entry, self.root, self.models_dir, self.device)
        if entry.trained is None:
            raise UserError(f"model {entry.id} could not be created: {entry.error}")
        if entry.lost is not None and not replacing:
            raise UserError(entry.lost)
        return entry.trained

    def get_info(self, req: schema.ModelRef) -> dict[str, Any]:
        e = self.entry(req.model_id)
        if e.closed is not None:
            raise ApiError(410, f"model {e.id}: {e.closed}")
        if e.error is not None:
            raise ApiError(400, f"model {e.id} could not be created: {e.error}")
        if e.base is None and e.restored:
            try:
                e.base = resolve(e.base_name, self.models_dir)
            except UserError as err:
                raise ApiError(400, f"model {e.id}: {err}") from None
        if e.base is None or (e.trained is None and not e.restored):
            raise ApiError(409, f"model {e.id} is still loading")
        return {"type": "get_info", "model_id": e.id, "model_name": e.base.name,
                "model_data": {"arch": e.base.arch, "model_name": e.base.name,
                               "tokenizer_id": e.base.tokenizer_id},
                "is_lora": e.lora.rank > 0, "lora_rank": e.lora.rank or None,
                "optimizer_config": {"type": "adamw"}}

    def forward_backward(self, body: bytes) -> dict[str, Any]:
        try:
            req = proto.parse_forward_backward(body)
        except ValueError as e:
            raise ApiError(400, f"forward_backward: not a ForwardBackwardRequest ({e})") \
                from None
        entry = self.entry(req.model_id)
        what = "forward" if req.forward_only else "forward_backward"

        def job() -> tuple[bytes, str]:
            if req.problem:
                raise UserError(f"{what}: {req.problem}")
            outputs, metrics = self.trained(entry).forward_backward(
                req.data, req.loss_fn, req.loss_fn_config, req.forward_only)
            if not req.forward_only:
                self.note(entry, changed=True)
            return proto.forward_backward_output(outputs, metrics), "proto"

        rid = entry.seq.submit(req.seq_id or None, job, what)
        return {"request_id": rid, "model_id": entry.id}

    def optim_step(self, req: schema.OptimStep) -> dict[str, Any]:
        e = self.entry(req.model_id)
        if req.adam_params is None:
            raise ApiError(400, "optim_step: this server runs AdamW; send adam_params")
        p = req.adam_params

        def job() -> tuple[dict[str, Any], str]:
            metrics = self.trained(e).optim_step(p.learning_rate, p.beta1, p.beta2, p.eps,
                                                  p.weight_decay, p.grad_clip_norm)
            self.note(e, changed=True)
            return {"type": "optim_step", "metrics": metrics}, "json"

        rid = e.seq.submit(req.seq_id, job, "optim_step")
        return {"request_id": rid, "model_id": e.id}

    # ---- sampling ----------------------------------------------------------------------
    def save_weights_for_sampler(self, req: schema.SaveWeightsForSampler) -> dict[str, Any]:
        e = self.entry(req.model_id)
        if (req.path is None) == (req.sampling_session_seq_id is None):
            raise ApiError(400, "save_weights_for_sampler takes a path (a name) or a "
                                "sampling_session_seq_id, one of the two")
        if req.path is not None and not NAME.match(req.path):
            raise ApiError(400, f"save_weights_for_sampler: name {req.path!r} must be letters, "
                                "digits, '.', '_' or '-' (at most 128)")
        loop = asyncio.get_running_loop()

        def job() -> tuple[dict[str, Any], str]:
            weights = self.trained(e).weights()
            assert e.base is not None
            if req.path is not None:
                run = self.run_id(e.id)
                save_sampler_weights(self.root / "runs" / run / "sampler_weights" / req.path,
                                     weights, e.base_name)
                return {"type": "save_weights_for_sampler",
                        "path": f"tinker://{run}/sampler_weights/{req.path}"}, "json"
            sid = f"{e.session_id}:sample:{req.sampling_session_seq_id}"
            sampler = Sampler(sid, e.base, None, weights, self.device)
            # registered on the loop before the result is: the client asks for it next
            loop.call_soon_threadsafe(self.sampling.keep, e, sampler)
            return {"type": "save_weights_for_sampler", "sampling_session_id": sid}, "json"

        rid = e.seq.submit(req.seq_id, job, "save_weights_for_sampler")
        return {"request_id": rid, "model_id": e.id}

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` as a task the service cancels when it closes."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- futures -----------------------------------------------------------------------
    async def retrieve(self, req: schema.RetrieveFuture) -> tuple[str, Any]:
        """("json", dict) or ("proto", bytes): the result, a failure, or try-again."""
        if not self.futures.known(req.request_id):
            if req.request_id.startswith(SAMPLE_PREFIX):  # the client sends the sample again
                raise ApiError(410, f"sample request {req.request_id!r} is gone (the server "
                                    "restarted since it was made); send it again")
            raise ApiError(404, f"unknown request id {req.request_id!r} (too old, or the "
                                "server restarted since it was made)")
        result = await self.futures.wait(req.request_id, LONG_POLL_S)
        if result is None:
            return "json", {"type": "try_again", "request_id": req.request_id,
                            "queue_state": "active"}
        if result.kind == "error":
            message, category = result.value
            return "json", {"error": message, "category": category}
        return result.kind, result.value

    # ---- capabilities --------------------------------------------------------------------
    def capabilities(self) -> dict[str, Any]:
        return {"supported_models": [{"model_name": BUILTIN, "trainable": True,
                                      "sampleable": True}]}
