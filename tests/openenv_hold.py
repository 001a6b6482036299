"""An OpenEnv server for stop tests: the guessing game of examples/openenv_guess, whose
steps wait while the file $RLHF_TEST_HOLD/hold exists (touching $RLHF_TEST_HOLD/held
first), so a test can stop a run while its episodes are in flight at a step it chose.

Served by the run itself: task.env = "openenv:tests.openenv_hold:app"."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from openenv.core.env_server.http_server import create_app

from examples.openenv_guess.server import (
    GuessAction,
    GuessEnvironment,
    GuessObservation,
)

HOLD_S = 120.0  # longest a step waits: a test that never lifts the hold still ends


class HeldGuess(GuessEnvironment):
    def step(self, action: GuessAction, timeout_s: float | None = None,  # type: ignore[override]
             **kwargs: Any) -> GuessObservation:
        where = Path(os.environ["RLHF_TEST_HOLD"])
        if (where / "hold").exists():
            (where / "held").touch()
            deadline = time.monotonic() + HOLD_S
            while (where / "hold").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return super().step(action, timeout_s, **kwargs)


app = create_app(HeldGuess, GuessAction, GuessObservation, env_name="held_guess",
                 max_concurrent_envs=256)
