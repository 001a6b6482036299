"""rlhf-async: RLHF training with strategy-based placement and an async actor pipeline.

    import rlhf_async
    summary = rlhf_async.train("configs/my_job.toml", ["train.steps=50"])

`train` takes what the CLI takes (a TOML file and/or key=value overrides, or a `JobConfig`)
and returns the run's summary; it works from inside a running event loop (Jupyter) too.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf_async.config import JobConfig

__version__ = "0.1.0"
__all__ = ["__version__", "train"]


def train(config: JobConfig | str | Path | None = None, overrides: list[str] | None = None,
          ) -> dict[str, Any]:
    """SFT -> reward model -> RL (or RL on your model and reward, task.name = "text") as
    the config says; returns the summary (also RUN_DIR/summary.json). A bad config is a
    ConfigError listing every problem; nothing has started then."""
    # torch and transformers load here, not on `import rlhf_async` (seconds)
    from rlhf_async.config import JobConfig, load_config, to_dict
    from rlhf_async.config.load import config_from_dict
    from rlhf_async.job import run

    if isinstance(config, JobConfig):
        if overrides:
            raise TypeError("train(JobConfig, overrides): give overrides with a TOML path "
                            "(or None), or set them on the JobConfig")
        cfg = config_from_dict(to_dict(config))  # a hand-built one gets the checks too
    else:
        cfg = load_config(config, overrides or [])
    return run(cfg)
