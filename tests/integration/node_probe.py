"""A node program for tests/integration/test_node_start.py: writes what its process looks like
(environment, working directory, threads, session, whether a worker thread flushes subnormal
floats) to the file in its params, then waits for the stop."""

import asyncio
import json
import os
import sys

import torch

from rlhf_async.runtime import Node
from rlhf_async.runtime.cpu import flushes_denormal


async def main(node: Node) -> None:
    facts = {"pid": os.getpid(), "sid": os.getsid(0), "cwd": os.getcwd(),
             "threads": torch.get_num_threads(), "probe": os.environ.get("PROBE"),
             "omp": os.environ.get("OMP_NUM_THREADS"),
             "site": getattr(sys, "site_mark", None),
             # where a node computes: the trainer's step and the engine run in threads
             "flushes": await asyncio.to_thread(flushes_denormal)}
    out = node.params["out"]
    with open(f"{out}.tmp", "w") as f:  # whole, or not there: the test polls for it
        json.dump(facts, f)
    os.replace(f"{out}.tmp", out)
    await node.wait_stop()
