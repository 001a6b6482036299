"""A job's `Utilization` (modeling/flops.py): the shapes of the models each stage runs,
read from their directories, and the peak FLOP/s `prepare_run` wrote in the config
(`placement.peak_flops`). Built once by whoever writes the step records."""

from __future__ import annotations

from collections.abc import Mapping

from rlhf_async.config import JobConfig
from rlhf_async.modeling.flops import Utilization, shape_of_dir
from rlhf_async.task.artefacts import Artefacts

STAGE_OF = {"generator": "generate", "scorer": "score", "trainer": "train"}


def job_utilization(cfg: JobConfig, art: Artefacts, devices: int) -> Utilization:
    """The actor generates and the reference (a copy of the SFT policy) scores with the
    SFT policy's shape; the reward model scores when the job has one (a rule reward costs
    no model FLOPs), the teacher when `teacher.path` names one."""
    actor = shape_of_dir(art.sft_dir, lm=True)
    return Utilization(
        actor=actor, reward=None if art.rm_dir is None else shape_of_dir(art.rm_dir, lm=False),
        reference=actor,
        teacher=shape_of_dir(cfg.teacher.path, lm=True) if cfg.teacher.path else None,
        peak=cfg.placement.peak_flops, devices=devices)


def stage_busy(util: Mapping[str, float], roles: Mapping[str, str], dt: float,
               ) -> dict[str, float]:
    """Separation: each stage's busy device-seconds in a step of `dt` seconds, from the
    step record's `util/<node>` shares (one device a process; the trainer's ranks all busy
    while rank 0, which reports, is)."""
    ranks = sum(r == "trainer" for r in roles.values())
    out = dict.fromkeys(STAGE_OF.values(), 0.0)
    for key, share in util.items():
        role = roles.get(key.removeprefix("util/"), "")
        if role in STAGE_OF:
            out[STAGE_OF[role]] += share * dt * (ranks if role == "trainer" else 1)
    return out
