"""A simulated job's step records in simulated seconds, and the control plane's own cost
in real seconds beside them: a hook on the Driver's records (`Driver.on_record`), in the
process that runs the coordinator, the driver and their transport."""

from __future__ import annotations

import time
from typing import Any

# a record's durations (real seconds as measured), and its rates (per real second)
DURATIONS = ("time_step", "weight_sync_s")
RATES = ("samples_per_s",)


class SimulatedTime:
    """Rescales each step record to simulated seconds (real / `time_scale`) and adds what
    the step cost for real: `real/time_step` (wall seconds), `control/real_s` (CPU seconds
    of this process: coordinator, driver, transport) and `control/share` (that against the
    simulated step: the control plane's overhead at the simulated scale)."""

    def __init__(self, time_scale: float) -> None:
        self.scale = time_scale
        self.cpu = time.process_time()

    def __call__(self, record: dict[str, Any]) -> None:
        cpu = time.process_time()
        used, self.cpu = cpu - self.cpu, cpu
        record["real/time_step"] = record["time_step"]
        for key in DURATIONS:
            if isinstance(record.get(key), int | float):
                record[key] = record[key] / self.scale
        for key in RATES:
            if isinstance(record.get(key), int | float):
                record[key] = record[key] * self.scale
        record["control/real_s"] = used
        record["control/share"] = used / max(record["time_step"], 1e-12)
