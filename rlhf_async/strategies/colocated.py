"""A generation engine beside a lock-step rank's trainer (Flattening, Interleaving with
`generation.backend` other than our own engine, `engines.BUILTIN`).

The default generates with the keyed sampler on the rank's actor module itself. With
another engine each rank starts one over the SFT policy (one device, the rank's) and runs
its rollouts through the request-level interface (`engines/requests.py`, the code the
generator node schedules too); after each training step the engine takes the rank's
updated weights in process (`stage_tensors` + `commit`: no broadcast group), so every
rollout is sampled by the weights the step before trained. While the rank scores and
trains, the engine sleeps (on GPUs an engine that can frees its KV cache and offloads its
weights; on CPU it stays as it is, logged once).
"""

from __future__ import annotations

import torch

from rlhf_async.config import JobConfig, weight_sync_backend
from rlhf_async.engines import BUILTIN, GenerationEngine, generation_engine, make_engine
from rlhf_async.engines.requests import engine_rollout
from rlhf_async.log import get_logger
from rlhf_async.modeling.env_calls import env_loop
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.modeling.precision import Precision
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch
from rlhf_async.rl.learner import Learner
from rlhf_async.task.artefacts import Artefacts

log = get_logger(component="colocated")


class ColocatedEngine:
    """A rank's generation engine and the calls the rank loop makes on it (its own loop:
    the environment loop, where episodes' environment calls run too)."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine = engine
        self.asleep = False

    def rollout(self, prompts: PromptBatch, params: SamplingParams, seed: int,
                step: int) -> RolloutBatch:
        self.wake()
        return env_loop().run(engine_rollout(self.engine, prompts, params, seed, step))

    def update(self, learner: Learner) -> int:
        """The learner's actor weights (version `learner.version`) into the engine."""
        self.wake()
        staged = self.engine.stage_tensors(learner.state_dict(), learner.version)
        version = env_loop().run(self.engine.commit(staged))
        log.debug("colocated_weights_loaded", version=version)
        return version

    def sleep(self) -> None:
        if not self.asleep:
            env_loop().run(self.engine.sleep())
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            env_loop().run(self.engine.wake())
            self.asleep = False

    def close(self) -> None:
        env_loop().run(self.engine.close())


def colocated_engine(cfg: JobConfig, art: Artefacts, params: SamplingParams,
                     device: torch.device, generating: Precision) -> ColocatedEngine | None:
    """The rank's engine over the SFT policy (version 0) in the actor's generation dtype;
    None for our own engine (the keyed sampler on the actor itself)."""
    backend = generation_engine(cfg)
    if backend == BUILTIN:
        return None
    dtype = str(generating.dtype("actor")).removeprefix("torch.")
    engine = make_engine(backend, str(art.sft_dir), params, dtype=dtype,
                         tensor_parallel=1, sync_backend=weight_sync_backend(cfg),
                         device=device)
    log.info("colocated_engine", backend=backend, device=str(device),
             dtype=dtype)
    return ColocatedEngine(engine)
