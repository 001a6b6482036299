"""RolloutBatch: the plain data that flows generator -> scorer -> trainer.

Named tensors plus two integers of metadata. `to_tensors()` / `from_tensors()` give a flat
{name: Tensor} dict and a small meta dict, so a pipeline can ship a batch as a msgpack
header plus one zero-copy frame per tensor, with no pickle.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

REQUIRED = ("prompt_ids", "prompt_mask", "response_ids", "response_mask",
            "behaviour_logprobs", "sample_ids", "group_ids")
OPTIONAL = ("rewards", "ref_logprobs", "hidden_scores", "env_rewards", "token_versions",
            "episode_ends", "teacher_logprobs", "episode_segments", "prefill_counts")
# prefill_counts' columns: a row's prompt tokens prefilled and those whose KV a prefix cache
# supplied, summed over its requests (an episode's turns), and how many of those requests
# reused some KV (hits) and how many none (misses); `engines.Prefill`'s fields
PREFILL_COUNTS = ("prefilled_tokens", "reused_tokens", "hits", "misses")
# response_mask values: a token the policy sampled (trained on), an environment's token of a
# multi-turn episode (context the policy reads, never trained on), padding
POLICY, ENV, PAD = 1, 2, 0


def loss_mask(response_mask: Tensor) -> Tensor:
    """[B, R] float: 1 on the policy's own tokens, 0 on environment tokens and padding."""
    return (response_mask == POLICY).float()


def attention_mask(response_mask: Tensor) -> Tensor:
    """[B, R] long: 1 on every real token (the policy's and the environment's)."""
    return (response_mask != PAD).long()


@dataclass
class PromptBatch:
    prompt_ids: Tensor  # [B, P] long, left-padded; one row per sample (prompts repeated)
    prompt_mask: Tensor  # [B, P]
    sample_ids: Tensor  # [B] long
    group_ids: Tensor  # [B] long

    def __len__(self) -> int:
        return int(self.prompt_ids.shape[0])

    def split(self, group_size: int, parts: int) -> list[PromptBatch]:
        """Contiguous parts of whole prompt groups: `parts` of them (fewer when there are
        fewer groups) whose sizes differ by at most one group. Every
        strategy cuts a step's prompts this way: Flattening and Interleaving one part per
        rank, Separation one per chunk."""
        bounds = split_bounds(len(self) // group_size, parts, group_size)
        return [PromptBatch(self.prompt_ids[lo:hi], self.prompt_mask[lo:hi],
                            self.sample_ids[lo:hi], self.group_ids[lo:hi])
                for lo, hi in itertools.pairwise(bounds)]

    def to(self, device: torch.device | str) -> PromptBatch:
        return PromptBatch(*(t.to(device) for t in (self.prompt_ids, self.prompt_mask,
                                                     self.sample_ids, self.group_ids)))


def split_bounds(groups: int, parts: int, group_size: int) -> list[int]:
    """Row boundaries of `PromptBatch.split`: part i holds rows bounds[i]..bounds[i+1]
    (every rank can compute another rank's share without a message)."""
    parts = max(1, min(parts, groups))
    return [group_size * (groups * i // parts) for i in range(parts + 1)]


class RolloutFormatError(ValueError):
    """A tensor dict that is not a valid RolloutBatch (missing names, bad shapes or dtypes)."""


@dataclass
class RolloutBatch:
    prompt_ids: Tensor  # [B, P] long, left-padded
    prompt_mask: Tensor  # [B, P] long, 1 = real token
    response_ids: Tensor  # [B, R] long, right-padded after EOS
    response_mask: Tensor  # [B, R] long: POLICY (EOS included), ENV (an episode's), PAD
    behaviour_logprobs: Tensor  # [B, R] float32, log mu(token) of the generating policy
    sample_ids: Tensor  # [B] long, globally unique per (prompt, response) sample
    group_ids: Tensor  # [B] long, samples of the same prompt share it
    version: int = 0  # weight version of the generating policy
    step: int = 0  # RL step whose keyed randomness produced the batch
    rewards: Tensor | None = None  # [B] float32 reward-model scores (scorer)
    ref_logprobs: Tensor | None = None  # [B, R] float32 reference log-probs (scorer)
    hidden_scores: Tensor | None = None  # [B] float32 task's true score (reported only)
    env_rewards: Tensor | None = None  # [B] float32 an episode's environment rewards, summed
    # [B, R] long: the weight version that sampled each token, -1 on padding (partial
    # rollouts: a generation that took new weights mid-way; `version` is then the oldest)
    token_versions: Tensor | None = None
    # [B] long: how each multi-turn episode ended, an index into `modeling.episodes.ENDS`
    episode_ends: Tensor | None = None
    teacher_logprobs: Tensor | None = None  # [B, R] float32 distillation's teacher (scorer)
    # [B] long: an agent's episode: the token histories it ran (>1: the agent rewrote its
    # history; the row holds the last one); 0: a row holding an earlier one of them, with
    # its episode's sample id, group and reward (`modeling.episodes.episode_batch`)
    episode_segments: Tensor | None = None
    # [B, 4] long: PREFILL_COUNTS of each row (a request-level engine's rollouts)
    prefill_counts: Tensor | None = None
    # the first failed episode's error (what, where in the user's code), '' when none;
    # read where the batch was generated, not sent on with it
    episode_error: str = ""

    @property
    def loss_mask(self) -> Tensor:
        """[B, R] float: 1 on the tokens the policy sampled (see `loss_mask`)."""
        return loss_mask(self.response_mask)

    def turns(self, decode: Callable[[list[int]], str]) -> list[list[dict[str, str]]]:
        """Each row as [{"role": "prompt" | "policy" | "environment", "text": ...}]: the
        prompt, then each run of the policy's and the environment's tokens, decoded."""
        out = []
        for p, pm, r, rm in zip(self.prompt_ids.tolist(), self.prompt_mask.tolist(),
                                self.response_ids.tolist(), self.response_mask.tolist(),
                                strict=True):
            turns = [{"role": "prompt", "text": decode([t for t, m in zip(p, pm, strict=True)
                                                        if m])}]
            for kind, run in itertools.groupby(zip(r, rm, strict=True), key=lambda x: x[1]):
                if kind != PAD:
                    role = "policy" if kind == POLICY else "environment"
                    turns.append({"role": role, "text": decode([t for t, _ in run])})
            out.append(turns)
        return out

    def __len__(self) -> int:
        return int(self.prompt_ids.shape[0])

    def to_tensors(self) -> dict[str, Tensor]:
        out = {k: getattr(self, k) for k in REQUIRED}
        out.update({k: getattr(self, k) for k in OPTIONAL if getattr(self, k) is not None})
        return {k: v.contiguous() for k, v in out.items()}

    def meta(self) -> dict[str, int]:
        return {"version": self.version, "step": self.step}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], meta: dict[str, int]) -> RolloutBatch:
        """Rebuild and validate; raises RolloutFormatError naming what is wrong."""
        problems = [f"missing tensor {k!r}" for k in REQUIRED if k not in tensors]
        unknown = set(tensors) - set(REQUIRED) - set(OPTIONAL)
        problems += [f"unknown tensor {k!r}" for k in sorted(unknown)]
        for k in ("version", "step"):
            if not isinstance(meta.get(k), int):
                problems.append(f"meta {k!r} must be an integer")
        if problems:
            raise RolloutFormatError("; ".join(problems))
        kwargs: dict[str, Any] = dict(tensors)
        batch = cls(**kwargs, version=meta["version"],
                    step=meta["step"])
        batch.validate()
        return batch

    def validate(self) -> None:
        B = len(self)
        P, R = self.prompt_ids.shape[-1], self.response_ids.shape[-1]
        want = {"prompt_ids": (B, P), "prompt_mask": (B, P), "response_ids": (B, R),
                "response_mask": (B, R), "behaviour_logprobs": (B, R), "sample_ids": (B,),
                "group_ids": (B,), "rewards": (B,), "ref_logprobs": (B, R),
                "hidden_scores": (B,), "env_rewards": (B,), "token_versions": (B, R),
                "episode_ends": (B,), "teacher_logprobs": (B, R), "episode_segments": (B,),
                "prefill_counts": (B, len(PREFILL_COUNTS))}
        problems = []
        for name, shape in want.items():
            t = getattr(self, name)
            if t is None:
                continue
            if tuple(t.shape) != shape:
                problems.append(f"{name}: shape {tuple(t.shape)}, expected {shape}")
            integer = name.endswith(("_ids", "_mask", "_versions", "_ends", "_segments",
                                     "_counts"))
            if integer != (not t.is_floating_point()):
                kind = "integer" if integer else "float"
                problems.append(f"{name}: dtype {t.dtype} is not {kind}")
        problems += self._token_version_problems()
        if problems:
            raise RolloutFormatError("; ".join(problems))

    def _token_version_problems(self) -> list[str]:
        """token_versions: >= 0 on every real token, -1 on padding, none older than
        `version` (what staleness admits on: the oldest token's, or older after a concat)."""
        tv = self.token_versions
        if tv is None or tv.is_floating_point() or tv.shape != self.response_ids.shape:
            return []  # no tensor, or its dtype/shape problem is reported already
        real = self.response_mask != PAD
        if bool((tv[real] < 0).any()) or bool((tv[~real] != -1).any()):
            return ["token_versions: must be >= 0 on real tokens and -1 on padding"]
        if bool(real.any()) and int(tv[real].min()) < self.version:
            return [f"token_versions: a token of version {int(tv[real].min())} is older "
                    f"than the batch's version {self.version}"]
        return []

    def select(self, index: Tensor) -> RolloutBatch:
        """Rows `index` (a long tensor) of every tensor field."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        kwargs: dict[str, Any] = {k: v[index] if isinstance(v, Tensor) else v
                                  for k, v in fields.items()}
        return RolloutBatch(**kwargs)

    def split(self, group_size: int, parts: int) -> list[RolloutBatch]:
        """Contiguous parts of whole groups, cut as `PromptBatch.split` cuts prompts (over
        the episodes' rows; an agent's earlier segments go with their group)."""
        main = self.episode_index()
        bounds = split_bounds(len(main) // group_size, parts, group_size)
        if len(main) == len(self):
            return [self.select(torch.arange(lo, hi)) for lo, hi in itertools.pairwise(bounds)]
        groups = self.group_ids[main].tolist()
        part = {g: k for k, (lo, hi) in enumerate(itertools.pairwise(bounds))
                for g in groups[lo:hi]}
        of = torch.tensor([part[g] for g in self.group_ids.tolist()])
        return [self.select(torch.nonzero(of == k).flatten()) for k in range(len(bounds) - 1)]

    def episode_index(self) -> Tensor:
        """Indices of the rows that are episodes (not an agent's earlier segments)."""
        if self.episode_segments is None:
            return torch.arange(len(self))
        return torch.nonzero(self.episode_segments.cpu() != 0).flatten()

    def to(self, device: torch.device | str) -> RolloutBatch:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        kwargs: dict[str, Any] = {k: v.to(device) if isinstance(v, Tensor) else v
                                  for k, v in fields.items()}
        return RolloutBatch(**kwargs)

    def replace(self, **changes: Any) -> RolloutBatch:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        """Stack batches of equal widths; version/step are the minimum (the oldest policy)."""
        first = batches[0]
        out: dict[str, Any] = {}
        for f in dataclasses.fields(first):
            vals = [getattr(b, f.name) for b in batches]
            if isinstance(vals[0], Tensor):
                out[f.name] = torch.cat(vals)
            elif vals[0] is None:
                out[f.name] = None
            elif isinstance(vals[0], str):  # episode_error: the first batch's that has one
                out[f.name] = next((v for v in vals if v), "")
            else:
                out[f.name] = min(vals)
        return RolloutBatch(**out)
