"""What each Tinker API call does, apart from HTTP: sessions, training models and their
ordered requests, futures. A handler returns the JSON reply (or a request id whose result
comes through `retrieve_future`) or raises `ApiError`; model work goes to the one model
thread (`futures.Worker`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf_async.log import get_logger
from rlhf_async.ops.tinker import proto, schema
from rlhf_async.ops.tinker.base_models import BUILTIN, BaseModel, resolve
from rlhf_async.ops.tinker.futures import ApiError, Futures, Sequencer, UserError, Worker
from rlhf_async.ops.tinker.training import Lora, TrainedModel

log = get_logger(component="tinker_api")
LONG_POLL_S = 20.0  # a retrieve_future waits this long for its result (the client: 45 s)


def client_config() -> dict[str, Any]:
    """The feature flags the SDK asks for before anything else: plain API keys (no JWT
    exchange), httpx, uncompressed protobuf forward_backward, one retrieve_future per
    request, custom losses on the client."""
    return {"pjwt_auth_enabled": False, "credential_default_source": "api_key",
            "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
            "parallel_fwdbwd_chunks": True, "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False, "sample_join_sampling_session": False}


@dataclass
class Session:
    id: str
    sdk_version: str
    created: float
    last_seen: float
    finished: bool = False


@dataclass
class ModelEntry:
    id: str
    session_id: str
    base_name: str
    lora: Lora
    seq: Sequencer
    create_rid: str
    base: BaseModel | None = None
    trained: TrainedModel | None = None
    error: str | None = None
    created: float = field(default_factory=time.time)


class TinkerService:
    def __init__(self, state_dir: Path, device: str | None = None) -> None:
        self.root = Path(state_dir) / "tinker"
        self.models_dir = self.root / "models"
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.futures = Futures()
        self.worker = Worker(self.futures)
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, ModelEntry] = {}

    def close(self) -> None:
        self.worker.shutdown()

    # ---- sessions ----------------------------------------------------------------------
    def create_session(self, req: schema.CreateSession) -> dict[str, Any]:
        sid = f"session-{uuid.uuid4().hex[:16]}"
        now = time.time()
        self.sessions[sid] = Session(sid, req.sdk_version, now, now)
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
        self.session(sid).finished = True
        log.info("session finished", session=sid)
        return {}

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
        entry = ModelEntry(model_id, req.session_id, req.base_model, lora,
                           Sequencer(self.worker), rid)
        self.models[model_id] = entry

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

    def entry(self, model_id: str) -> ModelEntry:
        e = self.models.get(model_id)
        if e is None:
            raise ApiError(404, f"unknown model {model_id!r} (never created here, or the "
                                "server restarted since)")
        return e

    def _trained(self, entry: ModelEntry) -> TrainedModel:
        """On the model thread: the model, which its create_model loaded before."""
        if entry.trained is None:
            raise UserError(f"model {entry.id} could not be created: {entry.error}")
        return entry.trained

    def get_info(self, req: schema.ModelRef) -> dict[str, Any]:
        e = self.entry(req.model_id)
        if e.error is not None:
            raise ApiError(400, f"model {e.id} could not be created: {e.error}")
        if e.base is None or e.trained is None:
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
            outputs, metrics = self._trained(entry).forward_backward(
                req.data, req.loss_fn, req.loss_fn_config, req.forward_only)
            return proto.forward_backward_output(outputs, metrics), "proto"

        rid = entry.seq.submit(req.seq_id or None, job, what)
        return {"request_id": rid, "model_id": entry.id}

    def optim_step(self, req: schema.OptimStep) -> dict[str, Any]:
        e = self.entry(req.model_id)
        if req.adam_params is None:
            raise ApiError(400, "optim_step: this server runs AdamW; send adam_params")
        p = req.adam_params

        def job() -> tuple[dict[str, Any], str]:
            metrics = self._trained(e).optim_step(p.learning_rate, p.beta1, p.beta2, p.eps,
                                                  p.weight_decay, p.grad_clip_norm)
            return {"type": "optim_step", "metrics": metrics}, "json"

        rid = e.seq.submit(req.seq_id, job, "optim_step")
        return {"request_id": rid, "model_id": e.id}

    # ---- futures -----------------------------------------------------------------------
    async def retrieve(self, req: schema.RetrieveFuture) -> tuple[str, Any]:
        """("json", dict) or ("proto", bytes): the result, a failure, or try-again."""
        if not self.futures.known(req.request_id):
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
