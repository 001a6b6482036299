"""Trains a tiny Learner for a few steps with one training backend and prints JSON (run as a
subprocess by test_deepspeed.py: DeepSpeed owns a process group and env for its lifetime).

    python -m tests.integration.ds_learner_run BACKEND ZERO_STAGE GRAD_ACCUM ALGO CKPT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch

from rlhf_async.config import AlgoConfig, ModelConfig, TaskConfig, TrainConfig
from rlhf_async.modeling.generation import SamplingParams, generate
from rlhf_async.modeling.models import frozen_copy, load_actor, scalar_model_from_actor
from rlhf_async.rl.checkpoint import learner_state, load_latest, restore_learner, save_checkpoint
from rlhf_async.rl.learner import Learner
from rlhf_async.rl.scoring import RewardMix, score
from rlhf_async.task.sort_digits import EOS, PAD, VOCAB_SIZE, SortDigitsTask


def main(backend: str, zero_stage: int, grad_accum: int, algo: str, ckpt: str) -> None:
    torch.set_num_threads(1)
    task = SortDigitsTask(TaskConfig())
    sp = SamplingParams(max_new_tokens=7, eos_id=EOS, pad_id=PAD)
    # on a GPU (tests/gpu) the models live there before DeepSpeed wraps them, as in a job
    device = "cuda" if os.environ.get("DS_ACCELERATOR") == "cuda" else "cpu"
    actor = load_actor(ModelConfig(hidden=32, heads=2, layers=1), VOCAB_SIZE, task.special,
                       seed=0).to(device)
    ref = frozen_copy(actor)
    rm = frozen_copy(scalar_model_from_actor(actor, seed=1).to(device))
    critic = scalar_model_from_actor(actor, seed=2).to(device) if algo == "ppo" else None
    # a learning rate that changes every step: each engine must take it
    train = TrainConfig(backend=backend, zero_stage=zero_stage, grad_accum=grad_accum,
                        epochs=2, minibatches=2, steps=4, lr_schedule="cosine",
                        warmup_steps=1)
    learner = Learner(actor, critic, AlgoConfig(name=algo, group_size=2), train, seed=0)
    out = []

    def step(s: int) -> None:
        pb = task.prompt_batch(0, "train", s, 4, 2).to(device)
        b = score(rm, ref, generate(learner.actor, pb, sp, 0, s, learner.version), 1.0,
                  RewardMix(task.hidden_scores))
        out.append(learner.train_step(b))

    for s in range(2):
        step(s)
    save_checkpoint(ckpt, 2, learner_state(learner), {})
    step(2)
    after_three = {k: v.clone() for k, v in learner.state_dict().items()}
    ck = load_latest(ckpt)
    assert ck is not None
    restore_learner(learner, ck.state)  # back to step 2: step 3 again must repeat exactly
    step(2)
    repeat = learner.state_dict()
    weights = {k: v.double().sum().item() for k, v in after_three.items()}
    print(json.dumps({"metrics": out[:3], "repeat_metrics": out[3], "weights": weights,
                      "resume_max_diff": max(float((repeat[k] - v).abs().max())
                                             for k, v in after_three.items())}))
    learner.close()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], int(a[1]), int(a[2]), a[3], a[4])
