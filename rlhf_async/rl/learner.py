"""The trainer's role: training copies of actor (+ critic) and one PPO/GRPO/RLOO update per
global batch (`Learner.train_step`).

The other two roles are `modeling.generation.generate` and `rl.scoring.score`; all three
take and return plain data (`RolloutBatch`), so any of them can sit behind a queue. When
torch.distributed is initialised, `Learner` treats its batch as this rank's shard of a
global batch: every normaliser and statistic is global, gradients are summed over ranks,
so N ranks produce the same update as one rank holding the whole batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_async.config import AlgoConfig, LoraConfig, TrainConfig
from rlhf_async.engines import TrainingBackend, make_training_backend
from rlhf_async.engines.lora import add_adapters, merged_weights
from rlhf_async.modeling.determinism import all_gather_1d, all_reduce_sum, key_seed, keyed_order
from rlhf_async.modeling.models import (
    ScalarHeadModel,
    disable_dropout,
    response_logits,
    response_values,
)
from rlhf_async.modeling.precision import FP32, Precision
from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.rl import algorithms as A


@dataclass
class Forward:
    """One forward pass over a minibatch: the actor's log-probs of the response tokens,
    its entropy (a graph only for an entropy bonus) and the critic's values (None without
    a critic), each [b, R]."""

    logprobs: Tensor
    entropy: Tensor
    values: Tensor | None


class Learner:
    """Training copies of actor (+ critic for PPO), each owned by a training backend
    (`train.backend`: torch AdamW, or DeepSpeed ZeRO) that holds its optimizer. Master
    weights stay fp32; forwards compute in each model's `precision` (bf16: autocast).
    With `lora.rank` > 0 only LoRA adapters train (the critic's too, with `lora.critic`),
    in place on the given models; what is published stays the merged actor."""

    def __init__(self, actor: nn.Module, critic: ScalarHeadModel | None, algo: AlgoConfig,
                 train: TrainConfig, seed: int, temperature: float = 1.0,
                 precision: Precision = FP32, lora: LoraConfig | None = None) -> None:
        if algo.name == "ppo" and critic is None:
            raise ValueError("PPO needs a critic")
        self.algo, self.train, self.seed, self.temperature = algo, train, seed, temperature
        self.precision = precision
        precision.prepare("actor", actor)
        if critic is not None:
            precision.prepare("critic", critic)
        self.device = next(actor.parameters()).device
        self.lora = lora if lora is not None else LoraConfig()
        self.adapted = self._add_adapters(actor, critic if algo.name == "ppo" else None)
        if train.disable_dropout:  # un-keyed noise: a step would depend on the placement
            disable_dropout(actor)
            if critic is not None:
                disable_dropout(critic)
        if train.gradient_checkpointing:  # activations recomputed in backward, not kept
            _checkpoint_activations(actor)
            if critic is not None:
                _checkpoint_activations(critic.trunk)
        self.version = 0
        self.last_advantages: Tensor | None = None  # [B, R] of the last train_step's shard
        self.kl_coef = algo.kl_coef  # moved by the adaptive controller when kl_target > 0
        self.actor_backend = self._backend(actor, train.lr)
        self.actor = self.actor_backend.module
        self.critic_backend: TrainingBackend | None = None
        self.critic: ScalarHeadModel | None = None
        if algo.name == "ppo" and critic is not None:
            self.critic_backend = self._backend(critic, train.critic_lr)
            self.critic = critic

    def _add_adapters(self, actor: nn.Module, critic: ScalarHeadModel | None) -> set[str]:
        """LoRA adapters on the actor (and the critic's trunk): the names of the models
        that got them. Before dropout is disabled, so that it zeroes theirs too."""
        if not self.lora.rank:
            return set()
        if self.train.backend != "torch":
            raise ValueError(f"lora.rank: LoRA trains with train.backend = 'torch' only, "
                             f"not {self.train.backend!r}")
        add_adapters(actor, self.lora, key_seed(self.seed, "lora", "actor"))
        if critic is None or not self.lora.critic:
            return {"actor"}
        add_adapters(critic.trunk, self.lora, key_seed(self.seed, "lora", "critic"))
        return {"actor", "critic"}

    def _backend(self, module: nn.Module, lr: float) -> TrainingBackend:
        t = self.train
        return make_training_backend(t.backend, module, lr=lr, weight_decay=t.weight_decay,
                                     grad_clip=t.grad_clip, zero_stage=t.zero_stage,
                                     grad_accum=t.grad_accum)

    def _actor_logits(self, *args: Tensor) -> Tensor:
        with self.precision.compute("actor", self.device):
            return response_logits(self.actor_backend.model, *args).float()

    def _critic_values(self, *args: Tensor) -> Tensor:
        assert self.critic_backend is not None
        critic_fwd: Any = self.critic_backend.model  # the engine wraps a ScalarHeadModel
        with self.precision.compute("critic", self.device):
            return response_values(critic_fwd, *args).float()

    def backends(self) -> dict[str, TrainingBackend]:
        out = {"actor": self.actor_backend}
        if self.critic_backend is not None:
            out["critic"] = self.critic_backend
        return out

    def state_dict(self) -> dict[str, Tensor]:
        """Full actor weights to publish to generators (gathered when sharded), under the
        base model's names: with LoRA, the adapters merged into their layers."""
        if "actor" in self.adapted:
            return merged_weights(self.actor)
        return self.actor_backend.state_dict()

    def weight_layout(self) -> dict[str, Tensor]:
        """`weight_groups`' names, dtypes and shapes as meta tensors (nothing gathered)."""
        if "actor" in self.adapted:
            return {k: v.to("meta") for k, v in merged_weights(self.actor).items()}
        return self.actor_backend.weight_layout()

    def weight_groups(self, max_bytes: int) -> Iterator[dict[str, Tensor]]:
        """`state_dict` ~max_bytes at a time, for a broadcast (under ZeRO-3 each group is
        gathered while it is used: collective, every rank walks every group)."""
        if "actor" in self.adapted:
            return iter([merged_weights(self.actor)])
        return self.actor_backend.iter_weight_groups(max_bytes)

    def policy_weights(self) -> dict[str, Tensor] | None:
        """What the final policy saves instead of the actor module's own state: the merged
        weights under LoRA; None = the module as it is (gathered by the caller)."""
        return self.state_dict() if "actor" in self.adapted else None

    def optimizer_state(self) -> dict:
        out = {name: b.optimizer_state_dict() for name, b in self.backends().items()}
        return {**out, "version": self.version}

    def close(self) -> None:
        """Release the engines (DeepSpeed's process group, when it made one)."""
        for b in reversed(list(self.backends().values())):
            b.close()

    def _reuses_logprobs(self) -> bool:
        """One optimizer step per batch, and advantages that need no log-probs: the policy
        is still the batch's "old" policy when the loss is computed, so the old log-probs are
        the loss forward's own (detached) and the separate forward pass is skipped."""
        a, t = self.algo, self.train
        return t.epochs == 1 and t.minibatches == 1 and a.name != "ppo" and a.kl_mode == "loss"

    def _reuses_forward(self) -> bool:
        """One optimizer step per batch in one micro-batch, and advantages that need the
        old log-probs (PPO; the KL penalty in the reward): the policy and critic are still
        the old ones at the loss forward, so it runs first, its detached log-probs and
        values are the old ones the advantages are computed from, and the separate
        no-grad forwards of actor and critic are skipped. The plain-torch engine only (a
        ZeRO engine's forward and backward are its own to order)."""
        a, t = self.algo, self.train
        return (t.epochs == 1 and t.minibatches == 1 and t.grad_accum == 1
                and t.backend == "torch" and (a.name == "ppo" or a.kl_mode == "reward"))

    @torch.no_grad()
    def _advantages(self, b: RolloutBatch, old_lp: Tensor | None,
                    values: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """-> advantages [B, R], returns [B, R] (PPO only), per-token KL [B, R] (None
        without `old_lp`)."""
        algo, m = self.algo, b.response_mask.float()
        assert b.rewards is not None and b.ref_logprobs is not None  # checked by train_step
        if old_lp is None:  # _reuses_logprobs: rewards alone decide the advantages
            fn = A.grpo_advantages if algo.name == "grpo" else A.rloo_advantages
            return fn(b.rewards, b.group_ids)[:, None] * m, None, None
        kl = A.kl_per_token(old_lp, b.ref_logprobs, algo.kl_estimator) * m
        kl_r = self.kl_coef if algo.kl_mode == "reward" else 0.0
        if algo.name == "ppo":
            r = A.token_rewards(b.rewards, kl, m, kl_r)
            assert values is not None  # PPO always has a critic
            adv, ret = A.gae(r, values, m, algo.gamma, algo.lam)
            if algo.whiten_advantages:
                adv = A.whiten(adv, m, all_reduce_sum)
            return adv, ret, kl
        seq = b.rewards - kl_r * kl.sum(dim=1)  # [B]
        fn = A.grpo_advantages if algo.name == "grpo" else A.rloo_advantages
        return fn(seq, b.group_ids)[:, None] * m, None, kl

    def _minibatches(self, b: RolloutBatch, epoch: int) -> list[Tensor]:
        """Local row indices of each minibatch; the split is over the GLOBAL batch, keyed by
        (seed, step, epoch), so it does not depend on how samples are spread over ranks.
        One minibatch holds every row: no collective (every rank skips it alike)."""
        if self.train.minibatches == 1:
            return [torch.arange(len(b), device=b.sample_ids.device)]
        all_ids = all_gather_1d(b.sample_ids).tolist()
        order = keyed_order(self.seed, ("minibatch", b.step, epoch), all_ids)
        M = self.train.minibatches
        mb_of = {sid: i * M // len(order) for i, sid in enumerate(order)}
        local = torch.tensor([mb_of[int(s)] for s in b.sample_ids], device=b.sample_ids.device)
        return [torch.nonzero(local == k).flatten() for k in range(M)]

    def _forward(self, mb: RolloutBatch) -> Forward:
        """The actor's log-probs and entropy and the critic's values on `mb` (with graphs)."""
        args = (mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask)
        logits = self._actor_logits(*args)  # [b, R, V]
        lp = A.gather_logprobs(logits, mb.response_ids, self.temperature)
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.algo.entropy_coef > 0):
            # only a bonus needs its gradient (a softmax backward over the whole vocabulary)
            ent = A.entropy_from_logits(logits / self.temperature)
        v = None if self.critic_backend is None else self._critic_values(*args)
        return Forward(lp, ent, v)

    def _loss(self, mb: RolloutBatch, fwd: Forward, idx: Tensor, adv: Tensor,
              ret: Tensor | None, old_lp: Tensor, old_v: Tensor | None, n_tokens: Tensor,
              fill_old: bool = False) -> tuple[Tensor, Tensor | None, dict]:
        """-> actor loss, critic loss (already scaled by vf_coef; PPO only), stats, of rows
        `idx` of the batch (`mb`, their forward `fwd`). With `fill_old`, this forward's
        detached log-probs are the old ones (written to old_lp)."""
        algo, lp = self.algo, fwd.logprobs
        m = mb.response_mask.float()
        if fill_old:
            old_lp[idx] = lp.detach() * m
        pg, st = A.ppo_policy_loss(lp, old_lp[idx], adv[idx], m, algo.clip_eps,
                                   mb.behaviour_logprobs, algo.is_cap, n_tokens)
        ent = A.masked_token_mean(fwd.entropy, m, n_tokens)
        loss = pg - algo.entropy_coef * ent if algo.entropy_coef > 0 else pg
        stats = {"policy_loss": pg.detach(), "entropy": ent.detach(), **st}
        if algo.kl_mode == "loss":
            assert mb.ref_logprobs is not None
            kl = A.kl_per_token(lp, mb.ref_logprobs, algo.kl_estimator)
            kl_loss = A.masked_token_mean(kl, m, n_tokens)
            loss = loss + self.kl_coef * kl_loss
            stats["kl_loss"] = kl_loss.detach()
        if fwd.values is not None:
            assert old_v is not None and ret is not None
            vl = A.value_loss(fwd.values, old_v[idx], ret[idx], m, algo.value_clip, n_tokens)
            stats["value_loss"] = vl.detach()
            return loss, algo.vf_coef * vl, stats
        return loss, None, stats

    def _stat_names(self) -> list[str]:
        names = ["policy_loss", "entropy", "clip_frac", "approx_kl"]
        names += ["kl_loss"] if self.algo.kl_mode == "loss" else []
        return names + (["value_loss"] if self.critic_backend is not None else [])

    def _optimizer_step(self) -> dict[str, float]:
        return {f"{name}_grad_norm": b.step() for name, b in self.backends().items()}

    def _backward(self, b: RolloutBatch, idx: Tensor, adv: Tensor, ret: Tensor | None,
                  old_lp: Tensor, old_v: Tensor | None, n_tokens: Tensor,
                  fill_old: bool = False, fwd: Forward | None = None) -> dict[str, Tensor]:
        """Gradients of one minibatch, in `train.grad_accum` micro-batches (losses are
        normalised by the minibatch's global token count, so micro-gradients add up).
        `fwd`: the whole minibatch's forward, already run (one micro-batch)."""
        micro = [i for i in idx.tensor_split(min(self.train.grad_accum, len(idx))) if len(i)]
        # the forward ran on the whole batch in order: it must be this one micro-batch
        assert fwd is None or (len(micro) == 1 and torch.equal(
            idx, torch.arange(len(b), device=idx.device)))
        stats: dict[str, Tensor] = {}
        for j, i in enumerate(micro):
            mb = b.select(i)
            actor_loss, critic_loss, st = self._loss(
                mb, fwd if fwd is not None else self._forward(mb), i, adv, ret, old_lp,
                old_v, n_tokens, fill_old)
            last = j == len(micro) - 1
            # separate graphs (values never depend on the actor): each engine owns its backward
            self.actor_backend.backward(actor_loss, last=last)
            if self.critic_backend is not None and critic_loss is not None:
                self.critic_backend.backward(critic_loss, last=last)
            for k, v in st.items():  # every stat is a share of a minibatch-global mean
                stats[k] = stats.get(k, v.new_zeros(())) + v
        return stats

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """PPO / GRPO / RLOO update on a scored batch (this rank's shard). Returns global
        metrics (identical on every rank)."""
        if batch.rewards is None or batch.ref_logprobs is None:
            raise ValueError("train_step needs a scored batch (rewards and ref_logprobs)")
        b, m = batch, batch.response_mask.float()
        args = (b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
        reuse = self._reuses_logprobs()
        first: Forward | None = None
        if self._reuses_forward() and len(b):  # the loss forward first; its outputs are old
            self.actor.train()
            first = self._forward(b)
            old_lp = first.logprobs.detach() * m
            old_v = None if first.values is None else first.values.detach() * m
        else:
            with torch.no_grad():
                old_lp = m.new_zeros(m.shape) if reuse else A.gather_logprobs(
                    self._actor_logits(*args), b.response_ids, self.temperature) * m
                old_v = None
                if self.critic_backend is not None:
                    old_v = self._critic_values(*args) * m
        adv, ret, kl = self._advantages(b, None if reuse else old_lp, old_v)
        self.last_advantages = adv.detach()  # [B, R] this step's (samples.jsonl shows them)
        sums: dict[str, Tensor] = {}
        grad_norms: dict[str, float] = {}
        n_updates = 0
        self.actor.train()
        for epoch in range(self.train.epochs):
            for idx in self._minibatches(b, epoch):
                n_tokens = all_reduce_sum(m[idx].sum()).clamp(min=1.0)
                if len(idx):
                    stats = self._backward(b, idx, adv, ret, old_lp, old_v, n_tokens, reuse,
                                           first)
                else:  # this rank holds none of the minibatch; it still joins the all-reduce
                    stats = {k: m.new_zeros(()) for k in self._stat_names()}
                grad_norms = self._optimizer_step()
                for k, v in stats.items():
                    sums[k] = sums.get(k, m.new_zeros(())) + v.float()
                n_updates += 1
        self.actor.eval()
        self.version += 1
        if kl is None:  # old_lp was filled by the loss forward
            assert b.ref_logprobs is not None  # a scored batch (validated by train_step)
            kl = A.kl_per_token(old_lp, b.ref_logprobs, self.algo.kl_estimator) * m
        out: dict[str, float] = {**self._global_stats(b, kl, adv, sums, n_updates),
                                 **grad_norms, "version": self.version,
                                 "kl_coef": self.kl_coef}
        if self.algo.kl_target > 0:  # from the global KL: every rank moves it alike
            self.kl_coef = A.adaptive_kl_coef(self.kl_coef, out["kl"], self.algo.kl_target,
                                              self.algo.kl_horizon, floor=self.algo.kl_coef)
        return out

    def _global_stats(self, b: RolloutBatch, kl: Tensor, adv: Tensor, sums: dict[str, Tensor],
                      n_updates: int) -> dict[str, float]:
        """One all-reduce for every metric: per-sample sums + counts, loss partial sums."""
        m = b.response_mask.float()
        assert b.rewards is not None
        per_sample = {"reward": b.rewards.float(), "kl": kl.sum(dim=1),
                      "response_length": m.sum(dim=1), "advantage_abs": (adv.abs() * m).sum(1)
                      / m.sum(1).clamp(min=1)}
        if b.hidden_scores is not None:
            per_sample["hidden_score"] = b.hidden_scores.float()
        vec = torch.stack([v.sum() for v in per_sample.values()] + list(sums.values())
                          + [m.new_tensor(float(len(b)))])
        vec = all_reduce_sum(vec.double())
        count = vec[-1].clamp(min=1.0)
        out = {k: float(vec[i] / count) for i, k in enumerate(per_sample)}
        out.update({k: float(vec[len(per_sample) + i] / n_updates)
                    for i, k in enumerate(sums)})
        out["samples"] = float(vec[-1])
        return out


def _checkpoint_activations(model: nn.Module) -> None:
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
