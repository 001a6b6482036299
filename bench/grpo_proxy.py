"""One GRPO step of deploy/configs/smollm2.toml's RL phase, in this process, for benchmarks
that need weights moving the way a real RL run moves them (bench/bench_weight_delta.py).

Why not the random-token cross-entropy step: how many bf16 values change per update
depends on the gradient's shape and on Adam's normalised step after the first, and a
supervised loss on random tokens is neither. Here, as in the config: 4 prompts of
examples/text/prompts.jsonl in the chat template, 4 samples each (<= 24 new tokens,
temperature 0.7), the rule reward of examples/text/reward.py, GRPO advantages, the policy
loss at ratio 1 (one epoch, one minibatch: on-policy), k3 KL to the pretrained model in
the loss (coef 0.05), AdamW (no weight decay) with the gradient norm clipped at 1.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from examples.text.reward import reward
from rlhf_async.rl.algorithms import gather_logprobs, grpo_advantages, kl_per_token

PROMPTS = Path(__file__).resolve().parent.parent / "examples" / "text" / "prompts.jsonl"


class GrpoProxy:
    """The policy, its frozen reference and AdamW; `step()` runs one RL step."""

    def __init__(self, model_path: str, lr: float, device: str, seed: int = 0,
                 prompts_per_step: int = 4, group: int = 4, new_tokens: int = 24,
                 kl_coef: float = 0.05) -> None:
        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.tok.padding_side = "left"
        load = dict(dtype=torch.float32)
        self.model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(model_path, **load).to(device)
        self.ref: PreTrainedModel = AutoModelForCausalLM.from_pretrained(model_path, **load).to(device)
        self.ref.requires_grad_(False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()
                        if line.strip()]
        self.rng = random.Random(seed)
        self.device, self.group, self.new_tokens = device, group, new_tokens
        self.per_step, self.kl_coef = prompts_per_step, kl_coef

    def _rollout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(sequences [B, T], response mask [B, T], scores [B], prompt width)."""
        prompts = self.rng.sample(self.prompts, self.per_step)
        texts = [self.tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True)
                 for p in prompts for _ in range(self.group)]
        enc = self.tok(texts, return_tensors="pt", padding=True).to(self.device)
        with torch.no_grad():
            seq = self.model.generate(**enc, do_sample=True, temperature=0.7, top_k=0,
                                      max_new_tokens=self.new_tokens,
                                      pad_token_id=self.tok.pad_token_id or 0)
        width = enc["input_ids"].shape[1]
        resp = seq[:, width:]
        eos = self.tok.eos_token_id
        ended = (resp == eos).int().cumsum(1)
        mask = (ended == 0) | ((resp == eos) & (ended == 1))  # up to and incl. the first eos
        scores = torch.tensor([reward(p, self.tok.decode(r[m.bool()], skip_special_tokens=True))
                               for p, r, m in zip([p for p in prompts for _ in range(self.group)],
                                                  resp, mask, strict=True)])
        full_mask = torch.cat([enc["attention_mask"], mask.long()], 1)
        return seq, full_mask, scores, width

    def step(self) -> float:
        """One RL step; returns the mean reward of its samples."""
        seq, attn, scores, width = self._rollout()
        groups = torch.arange(len(scores)) // self.group
        adv = grpo_advantages(scores, groups).to(self.device)
        tokens = seq[:, width:]
        mask = attn[:, width:].float()
        logits = self.model(input_ids=seq, attention_mask=attn).logits[:, width - 1 : -1]
        logp = gather_logprobs(logits, tokens, 0.7)
        with torch.no_grad():
            ref_logits = self.ref(input_ids=seq, attention_mask=attn).logits[:, width - 1 : -1]
            ref_logp = gather_logprobs(ref_logits, tokens, 0.7)
        ratio = torch.exp(logp - logp.detach())  # 1, with the policy gradient's grad
        per_token = -adv[:, None] * ratio + self.kl_coef * kl_per_token(logp, ref_logp, "k3")
        loss = (per_token * mask).sum() / mask.sum().clamp_min(1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(scores.mean())
