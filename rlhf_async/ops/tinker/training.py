"""One training client's model: a causal LM, LoRA adapters (peft, the trainer's own
`engines.lora`) or every weight trained, gradients summed over `forward_backward` calls
until `optim_step` applies AdamW with that request's hyperparameters.

Runs only on the API's model thread (`futures.Worker`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from rlhf_async.config import ConfigError, LoraConfig
from rlhf_async.engines.extras import MissingExtraError
from rlhf_async.engines.lora import add_adapters, merged_weights, trainable_names
from rlhf_async.ops.tinker import losses
from rlhf_async.ops.tinker.base_models import BaseModel
from rlhf_async.ops.tinker.futures import UserError
from rlhf_async.ops.tinker.proto import Datum
from rlhf_async.weight_sync import load_into_module

MAX_BATCH_TOKENS = 16384  # padded tokens one forward takes (a long request: several)
LORA_ALPHA = 32  # adapters add B @ A * alpha / rank


@dataclass(frozen=True)
class Lora:
    rank: int  # 0: every weight trains
    seed: int
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


def _target_modules(model: nn.Module, lora: Lora) -> list[str]:
    """Full names of the linear layers LoRA goes on: attention, MLP, the unembedding, as
    the request's train_* flags say (GPT-2's Conv1D layers count as linear)."""
    from transformers.pytorch_utils import Conv1D

    out = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear | Conv1D):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "lm_head":
            kind = lora.train_unembed
        elif "attn" in name or "attention" in name:
            kind = lora.train_attn
        else:
            kind = lora.train_mlp
        if kind:
            out.append(name)
    return out


class TrainedModel:
    def __init__(self, base: BaseModel, lora: Lora, device: torch.device) -> None:
        self.base, self.lora, self.device = base, lora, device
        model = AutoModelForCausalLM.from_pretrained(base.path, local_files_only=True)
        model = model.float()
        if lora.rank > 0:
            targets = _target_modules(model, lora)
            if not targets:
                raise UserError(f"{base.name}: no layer matches the LoRA config's train_* "
                                "flags")
            cfg = LoraConfig(rank=lora.rank, alpha=LORA_ALPHA, target_modules=targets)
            try:
                with warnings.catch_warnings():
                    # an adapter on a tied lm_head changes the output side only; samplers
                    # untie before loading merged weights (sampling.py), so peft's caution
                    # about tied layers does not apply
                    warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
                    add_adapters(model, cfg, lora.seed)
            except (ConfigError, MissingExtraError) as e:
                raise UserError(f"LoRA on {base.name}: {e}") from None
        self.model = model.to(device).train()
        for m in self.model.modules():  # a train step is deterministic, as sampling expects
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer: torch.optim.AdamW | None = None
        self.steps = 0
        self.vocab = int(self.model.get_input_embeddings().weight.shape[0])

    # ---- forward / backward ------------------------------------------------------------
    def forward_backward(self, data: list[Datum], loss_fn: str,
                         config: dict[str, float | str], forward_only: bool,
                         ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        loss, full = losses.resolve(loss_fn, config)
        if not data:
            raise UserError("forward_backward got no data")
        rows = [self._row(d, i, loss_fn, loss) for i, d in enumerate(data)]
        outputs: list[dict[str, np.ndarray]] = []
        total = 0.0
        for batch in _batches(rows):
            with torch.set_grad_enabled(not forward_only):
                lps = self._target_logprobs([r[0] for r in batch], [r[1] for r in batch])
                sums = [loss.fn(lp, inputs, full).sum() for lp, (_, _, inputs) in
                        zip(lps, batch, strict=True)]
                batch_loss = torch.stack(sums).sum()
                if not forward_only:
                    if not torch.isfinite(batch_loss):
                        raise UserError(f"{loss_fn}: the loss is {batch_loss.item()} (not "
                                        "finite); no gradient was added")
                    batch_loss.backward()
            total += float(batch_loss.detach())
            outputs += [{"logprobs": lp.detach().float().cpu().numpy()} for lp in lps]
        return outputs, {"loss:sum": total}

    def _row(self, d: Datum, i: int, name: str, loss: losses.Loss,
             ) -> tuple[list[int], Tensor, dict[str, Tensor]]:
        n = len(d.tokens)
        if n == 0:
            raise UserError(f"datum {i}: model_input has no tokens")
        if self.base.max_length and n > self.base.max_length:
            raise UserError(f"datum {i}: {n} tokens; {self.base.name} takes at most "
                            f"{self.base.max_length}")
        if min(d.tokens) < 0 or max(d.tokens) >= self.vocab:
            raise UserError(f"datum {i}: model_input has a token id outside the vocabulary "
                            f"(0..{self.vocab - 1})")
        if "target_tokens" not in d.inputs:
            raise UserError(f"datum {i}: loss_fn_inputs needs 'target_tokens' ([N] ints, the "
                            "token each position predicts)")
        targets = torch.from_numpy(np.array(d.inputs["target_tokens"])).reshape(-1)
        if targets.numel() != n or targets.dtype.is_floating_point:
            raise UserError(f"datum {i}: target_tokens must be {n} ints (one per model_input "
                            f"token), got {targets.numel()} of {targets.dtype}")
        if (targets < 0).any() or (targets >= self.vocab).any():
            raise UserError(f"datum {i}: target_tokens has an id outside the vocabulary "
                            f"(0..{self.vocab - 1})")
        arrays = {k: torch.from_numpy(np.array(v)) for k, v in d.inputs.items()}
        inputs = losses.datum_inputs(name, loss, arrays, n, i)
        return d.tokens, targets.long(), {k: v.to(self.device) for k, v in inputs.items()}

    def _target_logprobs(self, tokens: list[list[int]], targets: list[Tensor]) -> list[Tensor]:
        """Each row's log-probs of its targets, [n_i], from one right-padded forward."""
        width = max(len(t) for t in tokens)
        ids = torch.zeros(len(tokens), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, t in enumerate(tokens):
            ids[b, :len(t)] = torch.tensor(t)
            mask[b, :len(t)] = 1
        logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                            use_cache=False).logits.float()
        out = []
        for b, tgt in enumerate(targets):
            n = len(tokens[b])
            lp = torch.log_softmax(logits[b, :n], dim=-1)
            out.append(lp.gather(-1, tgt.to(self.device)[:, None]).squeeze(-1))
        return out

    # ---- optimizer -------------------------------------------------------------------
    def optim_step(self, lr: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, grad_clip_norm: float) -> dict[str, float]:
        for name, value in (("learning_rate", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if not math.isfinite(value) or value < 0:
                raise UserError(f"optim_step: {name} must be a finite number >= 0, got {value}")
        for name, value in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= value < 1.0:
                raise UserError(f"optim_step: {name} must be in [0, 1), got {value}")
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=(beta1, beta2),
                                               eps=eps, weight_decay=weight_decay)
        for group in self.optimizer.param_groups:
            group.update(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
        if grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grad_norm_(self.params, grad_clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm:mean": norm, "learning_rate:mean": lr}

    # ---- checkpoints (save_weights / load_weights) -------------------------------------
    def state(self) -> dict[str, Any]:
        """What `save_weights` keeps: the trained tensors (the adapters, or every weight)
        and AdamW's state (None before the first step)."""
        names = trainable_names(self.model)
        model = {k: v.detach().clone() for k, v in self.model.state_dict().items()
                 if k in names}
        opt = self.optimizer.state_dict() if self.optimizer is not None else None
        return {"model": model, "optimizer": opt}

    def load_state(self, state: dict[str, Any], with_optimizer: bool) -> None:
        """Load a checkpoint's trained tensors (all of them, by name and shape); AdamW's
        state too when asked, else the optimizer starts afresh."""
        tensors = state.get("model", {})
        names = trainable_names(self.model)
        if set(tensors) != names:
            raise UserError(f"the checkpoint trains {len(tensors)} tensors, this model "
                            f"{len(names)}: a different base model or LoRA setting")
        try:
            load_into_module(self.model, tensors, strict=False)
        except (ValueError, RuntimeError) as e:
            raise UserError(f"the checkpoint does not fit this model: {e}") from None
        for p in self.params:
            p.grad = None
        self.optimizer = None
        if with_optimizer:
            if state.get("optimizer") is None:
                raise UserError("the checkpoint holds no optimizer state (saved before the "
                                "first optim_step); load it without the optimizer")
            self.optimizer = torch.optim.AdamW(self.params)
            self.optimizer.load_state_dict(state["optimizer"])

    # ---- weights ---------------------------------------------------------------------
    def weights(self) -> dict[str, Tensor]:
        """The model as its base architecture names it, adapters merged (what a sampler
        loads), copied off the training tensors."""
        return {k: v.detach().clone() for k, v in merged_weights(self.model).items()}

    @property
    def has_gradients(self) -> bool:
        """forward_backward added gradients that no optim_step has applied yet."""
        return any(p.grad is not None for p in self.params)

    @property
    def trainable(self) -> int:
        return sum(p.numel() for p in self.params)


def _batches(rows: list[Any]) -> list[list[Any]]:
    """Rows in order, grouped so that rows x longest row stays under MAX_BATCH_TOKENS."""
    out: list[list[Any]] = []
    cur: list[Any] = []
    width = 0
    for r in rows:
        w = max(width, len(r[0]))
        if cur and w * (len(cur) + 1) > MAX_BATCH_TOKENS:
            out.append(cur)
            cur, w = [], len(r[0])
        cur.append(r)
        width = w
    if cur:
        out.append(cur)
    return out
