"""save_weights / load_weights of the Tinker API: a training checkpoint in our format
(`rl/checkpoint.py`: written atomically, checksummed) under the state directory's
`tinker/runs/RUN/weights/NAME/`, named `tinker://RUN/weights/NAME`; it holds the trained
tensors (the adapters, or every weight), AdamW's state, and which base model and LoRA
setting they go on. A checkpoint outlives the server: a restarted one loads it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from rlhf_async.ops.tinker import schema
from rlhf_async.ops.tinker.base_models import resolve
from rlhf_async.ops.tinker.futures import ApiError, UserError
from rlhf_async.ops.tinker.service import NAME, TinkerService
from rlhf_async.ops.tinker.training import Lora, TrainedModel
from rlhf_async.rl.checkpoint import CheckpointError, save_checkpoint


def save_weights(svc: TinkerService, req: schema.SaveWeights) -> dict[str, Any]:
    """A training checkpoint in our format (`rl/checkpoint.py`: atomic, checksummed):
    the trained tensors and AdamW's state, under tinker://RUN/weights/NAME."""
    e = svc.entry(req.model_id)
    name = req.path or f"step-{int(time.time())}"
    if not NAME.match(name):
        raise ApiError(400, f"save_weights: name {name!r} must be letters, digits, '.', "
                            "'_' or '-' (at most 128)")
    run = svc.run_id(e.id)
    root = svc.root / "runs" / run / "weights" / name

    def job() -> tuple[dict[str, Any], str]:
        trained = svc.trained(e)
        if root.exists() and not req.overwrite:
            raise UserError(f"save_weights: tinker://{run}/weights/{name} exists; pass "
                            "overwrite=True or another name")
        meta = {"base_model": e.base_name, "lora": dataclasses.asdict(e.lora),
                "model_id": e.id}
        state = trained.state()
        save_checkpoint(root, trained.steps, state, meta, keep=1)
        # a restarted server brings the model back as this checkpoint; gradients
        # accumulated before it are not in it
        svc.note(e, origin=f"tinker://{run}/weights/{name}",
                 origin_optimizer=state["optimizer"] is not None,
                 changed=trained.has_gradients)
        return {"type": "save_weights", "path": f"tinker://{run}/weights/{name}"}, "json"

    rid = e.seq.submit(req.seq_id, job, "save_weights")
    return {"request_id": rid, "model_id": e.id}


def load_weights(svc: TinkerService, req: schema.LoadWeights) -> dict[str, Any]:
    if req.model_id is not None:  # into a model this session made
        e = svc.entry(req.model_id)

        def load() -> tuple[dict[str, Any], str]:
            trained = svc.trained(e, replacing=True)
            state, meta = svc.read_checkpoint(req.path)
            if meta.get("base_model") != e.base_name:
                raise UserError(f"{req.path} was trained on {meta.get('base_model')!r}, "
                                f"this model is {e.base_name!r}")
            trained.load_state(state, req.optimizer)
            trained.steps = int(meta.get("step", 0))
            e.lost = None
            svc.note(e, origin=req.path, origin_optimizer=req.optimizer, changed=False)
            return {"type": "load_weights", "path": req.path, "model_id": e.id}, "json"

        rid = e.seq.submit(req.seq_id, load, "load_weights")
        return {"request_id": rid, "model_id": e.id}
    if req.session_id is None or req.model_seq_id is None:
        raise ApiError(400, "load_weights takes model_id and seq_id (into a model), or "
                            "session_id and model_seq_id (a new model from the checkpoint)")
    return _create_from(svc, req)


def _create_from(svc: TinkerService, req: schema.LoadWeights) -> dict[str, Any]:
    """A new training model from a checkpoint: its base model and LoRA setting."""
    assert req.session_id is not None
    svc.session(req.session_id)
    model_id = f"{req.session_id}:train:{req.model_seq_id}"
    if model_id in svc.models:
        return {"request_id": svc.models[model_id].create_rid, "model_id": model_id}
    try:
        _, meta = svc.read_checkpoint(req.path)
        lora = Lora(**meta["lora"])
    except (UserError, CheckpointError, KeyError, TypeError) as err:
        raise ApiError(400, f"load_weights: {req.path}: {err}") from None
    base_name = req.base_model or str(meta["base_model"])
    rid = svc.futures.new()
    entry = svc.new_entry(model_id, req.session_id, base_name, lora, rid, req.path,
                          req.optimizer)

    def load() -> tuple[dict[str, Any], str]:
        try:
            entry.base = resolve(base_name, svc.models_dir)
            trained = entry.trained = TrainedModel(entry.base, lora, svc.device)
            state, meta = svc.read_checkpoint(req.path)
            trained.load_state(state, req.optimizer)
            trained.steps = int(meta.get("step", 0))
        except Exception as e:
            entry.error = str(e)
            raise
        return {"type": "load_weights", "path": req.path, "model_id": model_id}, "json"

    svc.worker.submit(rid, load, "load_weights")  # type: ignore[arg-type]
    return {"request_id": rid, "model_id": model_id}
