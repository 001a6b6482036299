"""The four RLHF models over Hugging Face transformers: actor, critic, reward, reference.

Actor and reference are causal LMs. Critic and reward model are an LM trunk (AutoModel)
plus a linear head: per-token values for the critic, one score per sequence (read at the
last valid token) for the reward model. A user's model loads from a local directory
(`model.path`); the built-in one is a tiny GPT-2 or Llama built from config in code.
Nothing is fetched from a hub.
"""

from __future__ import annotations

import copy
import inspect
import json
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.utils import logging as hf_logging

from rlhf_async.config import ConfigError, ModelConfig
from rlhf_async.modeling.rollout import attention_mask
from rlhf_async.modeling.shared_prompts import PromptGroups, prompt_groups

HEAD_FILE = "value_head.safetensors"
M = TypeVar("M", bound=nn.Module)


def tiny_config(cfg: ModelConfig, vocab_size: int, pad_id: int, bos_id: int,
                eos_id: int) -> PretrainedConfig:
    """The built-in model's HF config (no hub access)."""
    special: dict[str, Any] = {"pad_token_id": pad_id, "bos_token_id": bos_id,
                               "eos_token_id": eos_id}
    if cfg.arch == "llama":
        return LlamaConfig(vocab_size=vocab_size, hidden_size=cfg.hidden,
                           intermediate_size=cfg.hidden * 4, num_hidden_layers=cfg.layers,
                           num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
                           max_position_embeddings=cfg.max_positions,
                           attention_dropout=cfg.dropout, **special)
    # GPT-2's tanh GELU as torch's one kernel ("gelu_pytorch_tanh"), not the eight-operator
    # Python formula of "gelu_new": the same function to float rounding, 13% less CPU per
    # forward + backward of the 10.7M-parameter model (bench/README.md)
    return GPT2Config(vocab_size=vocab_size, n_positions=cfg.max_positions, n_embd=cfg.hidden,
                      n_layer=cfg.layers, n_head=cfg.heads, resid_pdrop=cfg.dropout,
                      embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
                      activation_function="gelu_pytorch_tanh", **special)


def load_actor(cfg: ModelConfig, vocab_size: int, special: tuple[int, int, int],
               seed: int) -> PreTrainedModel:
    """The initial actor: from `cfg.path` if set, else a fresh tiny model seeded by `seed`."""
    if cfg.path:
        try:
            model = AutoModelForCausalLM.from_pretrained(cfg.path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError([f"model.path: cannot load a causal LM from {cfg.path!r} ({e})"]) \
                from None
        if model.config.vocab_size < vocab_size:
            raise ConfigError([(f"model.path: vocabulary of {model.config.vocab_size} tokens "
                                f"is smaller than the task's {vocab_size}")])
        return model.float()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(tiny_config(cfg, vocab_size, *special))


class ScalarHeadModel(nn.Module):
    """LM trunk + linear head -> one scalar per position. Used as critic and reward model.
    `head`: a trained one (a sequence classifier's); default a fresh Linear(hidden, 1)."""

    def __init__(self, trunk: PreTrainedModel, head: nn.Linear | None = None) -> None:
        super().__init__()
        self.trunk = trunk
        if head is None:
            head = nn.Linear(trunk.config.hidden_size, 1)
            nn.init.zeros_(head.bias)
            nn.init.normal_(head.weight, std=1.0 / (trunk.config.hidden_size + 1) ** 0.5)
        self.head = head

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None,
                position_ids: Tensor) -> Tensor:
        """-> [B, T]. attention_mask None: no padding (packed rows: modeling/packing.py)."""
        # no KV cache: nothing reads one, and HF reads packed rows only without it
        out = self.trunk(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, use_cache=False)
        return self.head(out.last_hidden_state).squeeze(-1)  # [B, T]

    def save(self, path: str | Path) -> None:
        path = Path(path)
        self.trunk.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in self.head.state_dict().items()},
                  str(path / HEAD_FILE))

    @classmethod
    def load(cls, path: str | Path) -> ScalarHeadModel:
        model = cls(AutoModel.from_pretrained(str(path), local_files_only=True).float())
        model.head.load_state_dict(load_file(str(Path(path) / HEAD_FILE)))
        return model


def load_scalar_model(path: str | Path, key: str = "reward_model.path") -> ScalarHeadModel:
    """A reward model from a directory: ours (trunk + value_head.safetensors), or a
    Hugging Face sequence classifier with one label whose head is a linear `score` on the
    trunk's hidden states (Llama, Qwen2, Mistral, GPT-2, ... as TRL, OpenRLHF and
    DeepSpeed-Chat save them). Its score is read at each sequence's last real token."""
    if (Path(path) / HEAD_FILE).exists():
        return ScalarHeadModel.load(path)
    return as_scalar_model(load_classifier(path, key), f"{key}: {str(path)!r}")


def load_classifier(path: str | Path, key: str, num_labels: int | None = None,
                    ) -> PreTrainedModel:
    """An AutoModelForSequenceClassification from `path`; with `num_labels`, a causal LM's
    directory too (its trunk, and a new head of that many labels)."""
    from transformers import AutoModelForSequenceClassification

    kwargs: dict[str, Any] = {} if num_labels is None else {"num_labels": num_labels}
    try:
        return AutoModelForSequenceClassification.from_pretrained(
            str(path), local_files_only=True, **kwargs)
    except (OSError, ValueError) as e:
        raise ConfigError([f"{key}: {str(path)!r} is not a sequence-classification model "
                           f"({e})"]) from None


def as_scalar_model(model: PreTrainedModel, key: str) -> ScalarHeadModel:
    """A sequence classifier's trunk and `score` head as a ScalarHeadModel (sharing their
    modules: training one trains the other); one error for a head it cannot use."""
    head = getattr(model, "score", None)
    trunk = getattr(model, model.base_model_prefix, None)
    if model.config.num_labels != 1:
        raise ConfigError([f"{key} has num_labels = {model.config.num_labels}; a reward model "
                           "gives one score (num_labels = 1)"])
    if not isinstance(head, nn.Linear) or not isinstance(trunk, PreTrainedModel):
        raise ConfigError([f"{key}: a {type(model).__name__} has no linear `score` head on "
                           "its trunk; accepted: decoder classifiers (LlamaFor..., "
                           "Qwen2For..., GPT2ForSequenceClassification, ...)"])
    return ScalarHeadModel(trunk, head).float()


def scalar_model_from_actor(actor: PreTrainedModel, seed: int) -> ScalarHeadModel:
    """A fresh trunk with the actor's architecture and weights (the LM head dropped)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        trunk = AutoModel.from_config(copy.deepcopy(actor.config))
        state = {k.split(".", 1)[1]: v for k, v in actor.state_dict().items()
                 if k.split(".", 1)[0] == actor.base_model_prefix}
        trunk.load_state_dict(state, strict=False)
        return ScalarHeadModel(trunk)


def disable_dropout(model: M) -> M:
    """Every dropout of `model` set to 0, in place: nn.Dropout modules and the attention
    dropout rates HF attention layers read from themselves (Llama, Qwen2, ...)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0  # type: ignore[assignment]  # a float, not a module
    return model


def checkpoint_activations(model: nn.Module) -> None:
    """`train.gradient_checkpointing` for an HF model (non-reentrant: works with frozen
    inputs and under autocast). transformers 5 renamed it activation checkpointing."""
    kwargs = {"use_reentrant": False}
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"train.gradient_checkpointing: {type(model).__name__} does not "
                         "support it; set train.gradient_checkpointing = false")
    new = getattr(model, "activation_checkpointing_enable", None)
    if new is not None:
        new(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(  # type: ignore[operator]  # HF's, checked above
            gradient_checkpointing_kwargs=kwargs)


def freeze(model: M) -> M:
    """`model` in eval mode without gradients, in place (for one loaded to be frozen)."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def frozen_copy(model: M) -> M:
    """A frozen copy, for a model that goes on training (the reference beside the actor)."""
    return freeze(copy.deepcopy(model))


def sequence_inputs(prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                    response_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Concatenate left-padded prompts [B, P] and right-padded responses [B, R].

    Returns input_ids, attention_mask, position_ids, each [B, P + R]; positions count only
    real tokens, so a sample's numbers do not depend on how much padding its batch has. An
    episode's environment tokens are real tokens here (read, not trained on).
    """
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    mask = torch.cat([prompt_mask, attention_mask(response_mask)], dim=1).long()
    pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return ids, mask, pos


def response_logits(actor: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                    response_ids: Tensor, response_mask: Tensor) -> Tensor:
    """Logits that predict each response token. -> [B, R, V]. A prompt that repeats in the
    batch runs once where that pays (shared_prompts)."""
    ids, mask, pos = sequence_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    P, R = prompt_ids.shape[1], response_ids.shape[1]
    # the size rule first: it is arithmetic, `_caches` walks the module tree
    groups = prompt_groups(actor, prompt_ids, prompt_mask)
    if groups is not None and _caches(actor):
        shared = _shared_prompt_logits(actor, ids, mask, pos, P, groups)
        if shared is not None:
            return shared
    keep = keep_logits(actor, R + 1)  # the LM head skips the prompt positions
    logits = actor(input_ids=ids, attention_mask=mask, position_ids=pos, **keep).logits
    start = P - 1 - (ids.shape[1] - logits.shape[1])
    return logits[:, start: start + R]


def _caches(model: nn.Module) -> bool:
    """Whether a forward of `model` hands back a KV cache whose rows can be re-indexed: not
    under activation checkpointing while training (HF then turns the cache off)."""
    inner = getattr(model, "module", model)  # a DeepSpeed engine's model
    if not (model.training and torch.is_grad_enabled()):
        return True
    flag = getattr(inner, "is_activation_checkpointing", None)
    if flag is None:  # transformers < 5
        flag = getattr(inner, "is_gradient_checkpointing", False)
    return not flag


def _shared_prompt_logits(actor: nn.Module, ids: Tensor, mask: Tensor, pos: Tensor, P: int,
                          groups: PromptGroups) -> Tensor | None:
    """`response_logits` with each distinct prompt run once: its KV cache is copied to the
    rows that share it (under autograd the copy's backward sums their gradients), then the
    responses run on it. ids, mask, pos: [B, P + R] from `sequence_inputs`. None: the
    model's cache cannot be re-indexed (transformers without cache objects)."""
    first, inverse = groups
    out = actor(input_ids=ids[first, :P], attention_mask=mask[first, :P],
                position_ids=pos[first, :P], use_cache=True, **keep_logits(actor, 1))
    head = out.logits[:, -1:][inverse]  # [B, 1, V] predicts response token 0
    if ids.shape[1] == P + 1:
        return head
    cache: Any = output_cache(out)
    if not hasattr(cache, "batch_select_indices"):
        return None
    cache.batch_select_indices(inverse)  # [U, ...] -> [B, ...]
    rest = actor(input_ids=ids[:, P:-1], attention_mask=mask[:, :-1],
                 position_ids=pos[:, P:-1], use_cache=True,
                 **{cache_keyword(actor): cache}).logits  # [B, R - 1, V]
    return torch.cat([head, rest], dim=1)


def output_cache(out: object) -> object:
    """The KV cache of a model call's output (`cache` in transformers >= 5.x)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def response_values(critic: ScalarHeadModel, prompt_ids: Tensor, prompt_mask: Tensor,
                    response_ids: Tensor, response_mask: Tensor) -> Tensor:
    """V(state before each response token). -> [B, R]."""
    ids, mask, pos = sequence_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    P, R = prompt_ids.shape[1], response_ids.shape[1]
    return critic(ids, mask, pos)[:, P - 1: P + R - 1]


def sequence_scores(reward_model: ScalarHeadModel, prompt_ids: Tensor, prompt_mask: Tensor,
                    response_ids: Tensor, response_mask: Tensor) -> Tensor:
    """One score per sequence, read at its last real token. -> [B]."""
    ids, mask, pos = sequence_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    per_pos = reward_model(ids, mask, pos)  # [B, P + R]
    P = prompt_ids.shape[1]
    last = P + attention_mask(response_mask).sum(dim=1) - 1
    return per_pos.gather(1, last.unsqueeze(1)).squeeze(1)


_CACHE_KW: dict[type, str] = {}


def cache_keyword(model: nn.Module) -> str:
    """Name of the KV-cache argument: 'cache' in transformers >= 5.x, else 'past_key_values'."""
    cls = type(model)
    if cls not in _CACHE_KW:
        params = inspect.signature(model.forward).parameters
        _CACHE_KW[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KW[cls]


_KEEP_LOGITS: dict[type, bool] = {}


def keep_logits(model: nn.Module, n: int) -> dict[str, int]:
    """`{"logits_to_keep": n}` when the model's forward can compute logits for the last n
    positions only (HF causal LMs in transformers >= 4.50), else `{}`. With a vocabulary of
    tens of thousands the LM head over prompt positions is a large share of a forward."""
    inner = getattr(model, "module", model)  # a DeepSpeed engine forwards **kwargs to it
    cls = type(inner)
    if cls not in _KEEP_LOGITS:
        _KEEP_LOGITS[cls] = "logits_to_keep" in inspect.signature(inner.forward).parameters
    return {"logits_to_keep": n} if _KEEP_LOGITS[cls] else {}


def save_policy(actor: PreTrainedModel, path: str | Path, extra: dict | None = None,
                weights: dict[str, Tensor] | None = None) -> None:
    """save_pretrained (safetensors + config.json) plus our own metadata file. `weights`:
    what to save instead of the actor's own state (LoRA: the merged model, named as the
    base model is, so the directory loads with AutoModelForCausalLM.from_pretrained)."""
    path = Path(path)
    actor.save_pretrained(path, safe_serialization=True, state_dict=weights)
    if extra:
        (path / "rlhf_async.json").write_text(json.dumps(extra, indent=2))


def warm_loading() -> None:
    """Pay once what a process's first `from_pretrained` costs beyond reading the files
    (~0.3 s under transformers 5: it compiles its checkpoint-conversion patterns; and the
    GPT-2 module's import), on a four-parameter-wide GPT-2 in a temporary directory: the
    fork server does this, and every node and rank forked from it loads its models at once.
    One thread, so that no OpenMP pool exists in a process that will fork."""
    threads, bar = torch.get_num_threads(), hf_logging.is_progress_bar_enabled()
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()  # "Loading weights" of a model nobody asked for
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = GPT2Config(vocab_size=4, n_positions=4, n_embd=4, n_layer=1, n_head=1,
                             bos_token_id=0, eos_token_id=0, pad_token_id=0)
            model = AutoModelForCausalLM.from_config(cfg)
            cfg.save_pretrained(tmp)
            # not save_pretrained: it imports accelerate and DeepSpeed where they are installed
            save_file({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"},
                      str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
            AutoModelForCausalLM.from_pretrained(tmp, local_files_only=True)
    finally:
        torch.set_num_threads(threads)
        if bar:
            hf_logging.enable_progress_bar()


def load_model_config(path: str | Path) -> PretrainedConfig:
    return AutoConfig.from_pretrained(str(path), local_files_only=True)
