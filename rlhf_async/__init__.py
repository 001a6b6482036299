"""rlhf-async: RLHF training with strategy-based placement and an async actor pipeline.

    import rlhf_async
    sft = rlhf_async.sft("job.toml", ["sft.data=demos.jsonl", "run.name=sft"])
    rm = rlhf_async.reward_model("job.toml", [f"model.path={sft['model']}", "run.name=rm"])
    summary = rlhf_async.train("job.toml", [f"model.path={sft['model']}",
                                            f"reward_model.path={rm['model']}"])

Each takes what its CLI command takes (a TOML file and/or key=value overrides, or a
`JobConfig`) and returns the summary; `train` works from inside a running event loop
(Jupyter) too.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf_async.config import JobConfig

__version__ = "0.1.0"
__all__ = ["__version__", "reward_model", "sft", "train"]


def _config(config: JobConfig | str | Path | None, overrides: list[str] | None) -> JobConfig:
    # here, not at the top: every `import rlhf_async.X` runs this file first
    from rlhf_async.config import JobConfig, config_from_dict, load_config, to_dict

    if isinstance(config, JobConfig):
        if overrides:
            raise TypeError("a JobConfig with overrides: give overrides with a TOML path "
                            "(or None), or set them on the JobConfig")
        return config_from_dict(to_dict(config))  # a hand-built one gets the checks too
    return load_config(config, overrides or [])


def sft(config: JobConfig | str | Path | None = None, overrides: list[str] | None = None,
        ) -> dict[str, Any]:
    """`rlhf-async sft`: fine-tune model.path on sft.data; returns the summary, whose
    "model" is the saved directory (the next stage's model.path)."""
    from rlhf_async.job import sft_stage  # torch: not on `import rlhf_async`

    return sft_stage(_config(config, overrides))


def reward_model(config: JobConfig | str | Path | None = None,
                 overrides: list[str] | None = None) -> dict[str, Any]:
    """`rlhf-async rm`: a reward model from model.path on reward_model.data; returns the
    summary, whose "model" is the saved directory (reward_model.path for `train`)."""
    from rlhf_async.job import reward_model_stage  # torch: not on `import rlhf_async`

    return reward_model_stage(_config(config, overrides))


def train(config: JobConfig | str | Path | None = None, overrides: list[str] | None = None,
          ) -> dict[str, Any]:
    """SFT -> reward model -> RL (or RL on your model and reward, task.name = "text") as
    the config says; returns the summary (also RUN_DIR/summary.json). A bad config is a
    ConfigError listing every problem; nothing has started then."""
    # torch and transformers load here, not on `import rlhf_async` (seconds)
    from rlhf_async.job import run

    return run(_config(config, overrides))
