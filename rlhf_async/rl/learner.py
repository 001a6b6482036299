"""The trainer's role: training copies of actor (+ critic) and one update per global batch
(`algo.name`'s recipe, config/presets.py; `Learner.train_step`). The other roles
(`modeling.generation.generate`, `rl.scoring.score`) also take and return plain data
(`RolloutBatch`). Under torch.distributed the batch is this rank's shard of a
global one: normalisers and statistics are global, gradients summed over ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_async.config import AlgoConfig, LoraConfig, TrainConfig
from rlhf_async.config.presets import distill_weight, resolve
from rlhf_async.engines import TrainingBackend, make_training_backend
from rlhf_async.engines.lora import add_adapters, merged_weights
from rlhf_async.modeling.collectives import all_reduce_sum
from rlhf_async.modeling.determinism import key_seed
from rlhf_async.modeling.flops import FlopShape, shape_or_none, train_flops, train_passes
from rlhf_async.modeling.models import ScalarHeadModel, checkpoint_activations, disable_dropout
from rlhf_async.modeling.packing import ResponseView
from rlhf_async.modeling.precision import FP32, Precision
from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.rl import algorithms as A
from rlhf_async.rl.distill import distill_advantages, reverse_kl_per_token
from rlhf_async.rl.guards import require_finite
from rlhf_async.rl.microbatches import MicroBatcher, minibatch_rows
from rlhf_async.rl.objective import Forward, Objective
from rlhf_async.rl.registry import ADVANTAGE_ESTIMATORS, AdvantageInputs, name_problems
from rlhf_async.rl.step_stats import global_stats, mismatch_stats


@dataclass
class OldPolicy:
    """The batch's old (pre-update) policy, [B, R] each: its log-probs (None: each loss
    forward's own, detached, while the policy is still the old one), the critic's values
    (None without a critic), and the whole batch's loss forward when it already ran."""

    logprobs: Tensor | None
    values: Tensor | None
    forward: Forward | None


class Learner:
    """Training copies of actor (+ critic for PPO), each owned by a training backend
    (`train.backend`: torch AdamW, or DeepSpeed ZeRO) that holds its optimizer. Master
    weights stay fp32; forwards compute in each model's `precision` (bf16: autocast).
    With `lora.rank` > 0 only LoRA adapters train (the critic's too, with `lora.critic`),
    in place on the given models; what is published stays the merged actor."""

    def __init__(self, actor: nn.Module, critic: ScalarHeadModel | None, algo: AlgoConfig,
                 train: TrainConfig, seed: int, temperature: float = 1.0,
                 precision: Precision = FP32, lora: LoraConfig | None = None) -> None:
        self.recipe = resolve(algo)
        if name_problems(self.recipe):
            raise ValueError("; ".join(name_problems(self.recipe)))
        if self.recipe.has_critic and critic is None:
            raise ValueError("PPO needs a critic")
        self.algo, self.train, self.seed, self.temperature = algo, train, seed, temperature
        self.precision = precision
        precision.prepare("actor", actor)
        if critic is not None:
            precision.prepare("critic", critic)
        self.device = next(actor.parameters()).device
        self.lora = lora if lora is not None else LoraConfig()
        self.adapted = self._add_adapters(actor, critic if self.recipe.has_critic else None)
        if train.disable_dropout:  # un-keyed noise: a step would depend on the placement
            disable_dropout(actor)
            if critic is not None:
                disable_dropout(critic)
        if train.gradient_checkpointing:  # activations recomputed in backward, not kept
            checkpoint_activations(actor)
            if critic is not None:
                checkpoint_activations(critic.trunk)
        self.shapes: tuple[FlopShape, FlopShape | None] = (  # before an engine wraps them
            FlopShape.of_module(actor), shape_or_none(critic if self.recipe.has_critic else None))
        self.version = 0
        self.last_advantages: Tensor | None = None  # [B, R] of the last train_step's shard
        self.kl_coef = algo.kl_coef  # moved by the adaptive controller when kl_target > 0
        self.actor_backend = self._backend(actor, train.lr)
        self.actor = self.actor_backend.module
        self.critic_backend: TrainingBackend | None = None
        self.critic: ScalarHeadModel | None = None
        if self.recipe.has_critic and critic is not None:
            self.critic_backend = self._backend(critic, train.critic_lr)
            self.critic = critic
        self.micro = MicroBatcher.for_models(train, [self.actor] + (
            [] if self.critic is None else [self.critic]))

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

    def _actor_logits(self, view: ResponseView) -> Tensor:
        with self.precision.compute("actor", self.device):
            return view.logits(self.actor_backend.model).float()

    def _critic_values(self, view: ResponseView) -> Tensor:
        assert self.critic_backend is not None
        critic_fwd: Any = self.critic_backend.model  # the engine wraps a ScalarHeadModel
        with self.precision.compute("critic", self.device):
            return view.values(critic_fwd).float()

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
        t = self.train
        return (t.epochs == 1 and t.minibatches == 1 and not self.recipe.has_critic
                and self.recipe.kl_mode != "reward")

    def _reuses_forward(self) -> bool:
        """One optimizer step per batch in one micro-batch, and advantages that need the
        old log-probs (PPO; the KL penalty in the reward): the policy and critic are still
        the old ones at the loss forward, so it runs first, its detached log-probs and
        values are the old ones the advantages are computed from, and the separate
        no-grad forwards of actor and critic are skipped. The plain-torch engine only (a
        ZeRO engine's forward and backward are its own to order), without a token budget
        (whose point is not to run the whole batch at once)."""
        t = self.train
        return (t.epochs == 1 and t.minibatches == 1 and t.grad_accum == 1
                and not t.max_tokens_per_microbatch and t.backend == "torch"
                and (self.recipe.has_critic or self.recipe.kl_mode == "reward"))

    def _old_policy(self, b: RolloutBatch) -> OldPolicy:
        """The batch's old log-probs and values, before any update: from the loss forward
        itself when it is the only one (`_reuses_forward`), left to each loss forward
        (`_reuses_logprobs`), else from no-grad forwards of actor and critic."""
        m = b.loss_mask
        if self._reuses_forward() and len(b):
            self.actor.train()
            fwd = self._forward(b)
            values = None if fwd.values is None else fwd.values.detach() * m
            return OldPolicy(fwd.logprobs.detach() * m, values, fwd)
        if self._reuses_logprobs():  # no critic: not PPO
            return OldPolicy(None, None, None)
        lp, values = m.new_zeros(m.shape), None if self.critic_backend is None else \
            m.new_zeros(m.shape)
        with torch.no_grad():
            for i in self.micro.whole(b):  # [B, R] each, filled a micro-batch at a time
                view = self.micro.view(b.select(i))
                lp[i] = view.restore(A.gather_logprobs(self._actor_logits(view), view.targets,
                                                       self.temperature))
                if values is not None:
                    values[i] = view.restore(self._critic_values(view))
        return OldPolicy(lp * m, None if values is None else values * m, None)

    @torch.no_grad()
    def _advantages(self, b: RolloutBatch, old_lp: Tensor | None,
                    values: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """-> advantages [B, R], returns [B, R] (PPO only), per-token KL [B, R] (None
        without `old_lp`: then the rewards alone decide, `_reuses_logprobs`)."""
        algo, rc, m = self.algo, self.recipe, b.loss_mask
        assert b.rewards is not None and b.ref_logprobs is not None  # checked by train_step
        kl = None if old_lp is None else A.kl_per_token(
            old_lp, b.ref_logprobs, rc.kl_estimator) * m
        kl_r = self.kl_coef if rc.kl_mode == "reward" and kl is not None else 0.0
        adv, ret = ADVANTAGE_ESTIMATORS[rc.baseline](AdvantageInputs(
            b.rewards, m, kl, kl_r, values, b.group_ids, b.sample_ids, b.episode_segments,
            rc.adv_norm == "group", algo.gamma, algo.lam))
        if rc.adv_norm == "batch":
            adv = A.whiten(adv, m, all_reduce_sum)
        if distill_weight(algo):  # after normalising, as the term is already per token
            assert b.teacher_logprobs is not None  # checked by train_step
            adv = adv + distill_advantages(b.teacher_logprobs, b.behaviour_logprobs, m,
                                           distill_weight(algo))
        require_finite("an advantage", adv, b.step, "a reward or value out of range?",
                       b.sample_ids)
        return adv, ret, kl

    def _forward(self, mb: RolloutBatch) -> Forward:
        """The actor's log-probs and entropy and the critic's values on `mb` (with graphs)."""
        view = self.micro.view(mb)  # padded, or packed: results restored to [b, R]
        logits = self._actor_logits(view)  # [b, R', V], or [1, n, V] packed
        lp = A.gather_logprobs(logits, view.targets, self.temperature)
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.algo.entropy_coef > 0):
            # only a bonus needs its gradient (a softmax backward over the whole vocabulary)
            ent = A.entropy_from_logits(logits / self.temperature)
        v = None if self.critic_backend is None else view.restore(self._critic_values(view))
        return Forward(view.restore(lp), view.restore(ent), v)

    def _objective(self) -> Objective:
        """The loss as this step sets it (`kl_coef` moves between steps)."""
        return Objective(self.recipe, self.algo, self.kl_coef, self.train.publish_every)

    def _optimizer_step(self, step: int) -> dict[str, float]:
        """One update of each model; a non-finite gradient norm stops the step (the plain
        engine has not applied it)."""
        norms = {f"{name}_grad_norm": b.step() for name, b in self.backends().items()}
        for key, norm in norms.items():
            require_finite(f"the {key.removesuffix('_grad_norm')} gradient norm", norm, step,
                           "train.lr too high?")
        return norms

    def lrs(self) -> dict[str, float]:
        """The learning rates of the next step (`train.lr_schedule` at step `version`)."""
        t = self.train
        f = A.lr_factor(self.version, t.steps, t.warmup_steps, t.lr_schedule)
        return {"actor_lr": t.lr * f, **({"critic_lr": t.critic_lr * f}
                                         if self.critic_backend is not None else {})}

    def _backward(self, b: RolloutBatch, idx: Tensor, adv: Tensor, ret: Tensor | None,
                  old: OldPolicy, n_tokens: Tensor,
                  n_seqs: Tensor) -> tuple[dict[str, Tensor], list[Tensor]]:
        """Gradients of one minibatch, in micro-batches (rl/microbatches.py; losses are
        normalised by the minibatch's global token count, so micro-gradients add up).
        -> stats, and the detached log-probs of `idx`'s rows when they are the old ones."""
        micro = self.micro.split(b, idx)
        # the forward ran on the whole batch in order: it must be this one micro-batch
        assert old.forward is None or (len(micro) == 1 and torch.equal(
            idx, torch.arange(len(b), device=idx.device)))
        stats: dict[str, Tensor] = {}
        own: list[Tensor] = []
        objective = self._objective()
        for j, i in enumerate(micro):
            mb = b.select(i)
            fwd = old.forward if old.forward is not None else self._forward(mb)
            if old.logprobs is None:  # the policy is still the old one: ratio 1
                own.append(fwd.logprobs.detach() * mb.loss_mask)
            old_lp = own[-1] if old.logprobs is None else old.logprobs[i]
            old_v = None if old.values is None else old.values[i]
            actor_loss, critic_loss, st = objective.loss(
                mb, fwd, adv[i], None if ret is None else ret[i], old_lp, old_v, n_tokens,
                n_seqs)
            last = j == len(micro) - 1
            # separate graphs (values never depend on the actor): each engine owns its backward
            self.actor_backend.backward(actor_loss, last=last)
            if self.critic_backend is not None and critic_loss is not None:
                self.critic_backend.backward(critic_loss, last=last)
            for k, v in st.items():  # every stat is a share of a minibatch-global mean
                stats[k] = stats.get(k, v.new_zeros(())) + v
        if own:  # back in `idx`'s row order (a token budget sorts rows by length)
            own = [torch.cat(own)[torch.cat(micro).argsort()]]
        return stats, own

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One update (`algo.name`'s recipe) on a scored batch (this rank's shard): old log-probs ->
        advantages -> per minibatch (forward, loss, backward, optimizer step). Returns global
        metrics (identical on every rank)."""
        if batch.rewards is None or batch.ref_logprobs is None:
            raise ValueError("train_step needs a scored batch (rewards and ref_logprobs)")
        if distill_weight(self.algo) and batch.teacher_logprobs is None:
            raise ValueError("distillation needs the teacher's log-probs (teacher.path)")
        b, m = batch, batch.loss_mask
        lrs = self.lrs()
        for name, backend in self.backends().items():
            backend.set_lr(lrs[f"{name}_lr"])
        old = self._old_policy(b)
        adv, ret, kl = self._advantages(b, old.logprobs, old.values)
        self.last_advantages = adv.detach()  # [B, R] this step's (samples.jsonl shows them)
        sums: dict[str, Tensor] = {}
        grad_norms: dict[str, float] = {}
        own: list[Tensor] = []  # the loss forwards' log-probs, when they are the old ones
        n_updates = 0
        self.actor.train()
        for epoch in range(self.train.epochs):
            for idx in minibatch_rows(b, self.seed, epoch, self.train.minibatches):
                counts = all_reduce_sum(torch.stack([m[idx].sum(), m.new_tensor(len(idx))]))
                n_tokens, n_seqs = counts.clamp(min=1.0).unbind()
                if len(idx):
                    stats, mine = self._backward(b, idx, adv, ret, old, n_tokens, n_seqs)
                    own += mine
                else:  # this rank holds none of the minibatch; it still joins the all-reduce
                    stats = {k: m.new_zeros(()) for k in self._objective().stat_names(
                        self.critic_backend is not None)}
                grad_norms = self._optimizer_step(b.step)
                for k, v in stats.items():
                    sums[k] = sums.get(k, m.new_zeros(())) + v.float()
                n_updates += 1
        self.actor.eval()
        self.version += 1
        old_lp = old.logprobs
        if old_lp is None:  # one minibatch of every row, in order: the loss forwards' own
            old_lp = torch.cat(own) if own else m.new_zeros(m.shape)
        if kl is None:
            assert b.ref_logprobs is not None  # a scored batch (validated by train_step)
            kl = A.kl_per_token(old_lp, b.ref_logprobs, self.recipe.kl_estimator) * m
        out: dict[str, float] = {**global_stats(b, kl, adv, sums, n_updates),
                                 **mismatch_stats(b, old_lp, self.recipe.ratio_level,
                                                 self.recipe.mismatch_cap), **grad_norms, **lrs,
                                 "version": self.version, "kl_coef": self.kl_coef}
        passes = train_passes(self.train.epochs, not (self._reuses_forward()
                              or self._reuses_logprobs()), self.train.gradient_checkpointing)
        out["flops/train"] = train_flops(*self.shapes, passes, out)  # model FLOPs (flops.py)
        if b.teacher_logprobs is not None:
            out["teacher_reverse_kl"] = reverse_kl_per_token(b)
        if self.algo.kl_target > 0:  # from the global KL: every rank moves it alike
            self.kl_coef = A.adaptive_kl_coef(self.kl_coef, out["kl"], self.algo.kl_target,
                                              self.algo.kl_horizon, floor=self.algo.kl_coef)
        return out

