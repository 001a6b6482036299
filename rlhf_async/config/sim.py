"""The `[sim]` section: simulated devices (`placement.device = "sim"`). Every node process
runs its real program; the model math of the GPUs it stands for is replaced by the time the
cost model gives for `sim.model` on `placement.gpu`, slept at `sim.time_scale`
(engines/sim/). The names here are checked against the shapes the cost model knows
(`modeling/roofline.py`) where the job is prepared."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_async.config.fields import opt

# the model shapes of `modeling.roofline.LLAMA` (the config layer sits below it; a test
# keeps the two equal)
SIM_MODELS = ("7B", "13B", "33B", "65B")


@dataclass
class SimConfig:
    model: str = opt("7B", "placement.device = sim: the model shape whose math the "
                     "simulated GPUs time (LLaMA-1 shapes of the cost model); actor, critic, "
                     "reward and reference all of it", choices=SIM_MODELS)
    time_scale: float = opt(0.1, "real seconds per simulated second (0.01: a simulated "
                            "minute runs in 0.6 s); metrics.jsonl is in simulated seconds",
                            gt=0.0, le=1000.0)
    prompt_tokens: int = opt(512, "simulated prompt length (tokens)", ge=1)
    response_tokens: int = opt(480, "simulated mean response length (tokens; the paper's "
                               "480)", ge=1)
    lengths: str = opt("fixed", "response lengths: fixed = every response "
                       "sim.response_tokens long (the paper's setting); long_tail = "
                       "log-normal with that mean, cut at 8x it", choices=("fixed", "long_tail"))
