"""The JSON requests of the Tinker API (SDK 0.38.0's `tinker/types/*_request.py`), as typed
structs: a body that does not fit is one error naming the field (`decode`). Fields the
server does not use are accepted and ignored, so a newer client's additions do not break
it."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from rlhf_async.ops.tinker.futures import ApiError

T = TypeVar("T")


class CreateSession(msgspec.Struct):
    sdk_version: str = ""
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    project_id: str | None = None
    display_name: str | None = None


class SessionRef(msgspec.Struct):
    session_id: str


class LoraConfig(msgspec.Struct):
    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(msgspec.Struct, frozen=True):
    type: str = "adamw"


class CreateModel(msgspec.Struct):
    session_id: str
    model_seq_id: int
    base_model: str
    lora_config: LoraConfig | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: OptimizerConfig = OptimizerConfig()


class ModelRef(msgspec.Struct):
    model_id: str


class AdamParams(msgspec.Struct):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStep(msgspec.Struct):
    model_id: str
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None
    seq_id: int | None = None


class RetrieveFuture(msgspec.Struct):
    request_id: str
    allow_metadata_only: bool = False


class CreateSamplingSession(msgspec.Struct):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class SaveWeightsForSampler(msgspec.Struct):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    seq_id: int | None = None
    kind: str = "snapshot"


class SaveWeights(msgspec.Struct):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    overwrite: bool = False


class LoadWeights(msgspec.Struct):
    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None


class SamplingParams(msgspec.Struct):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str | int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class Chunk(msgspec.Struct):
    type: str = "encoded_text"
    tokens: list[int] = []


class ModelInput(msgspec.Struct):
    chunks: list[Chunk]


class Sample(msgspec.Struct):
    prompt: ModelInput
    sampling_params: SamplingParams
    num_samples: int = 1
    sampling_session_id: str | None = None
    seq_id: int | None = None
    base_model: str | None = None
    model_path: str | None = None
    prompt_logprobs: bool | None = None
    prompt_logprobs_last_n: int | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0


def decode(body: bytes, kind: type[T], what: str) -> T:
    try:
        return msgspec.json.decode(body or b"{}", type=kind)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"{what}: {e}") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"{what}: the body is not JSON ({e})") from None
