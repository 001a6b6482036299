"""Node runtime: one OS process, one asyncio loop, one node program `async def main(node)`.

Start a node with `python -m rlhf_async.runtime --spec SPEC.json` (the coordinator does).
"""

from rlhf_async.runtime.loop import run_loop
from rlhf_async.runtime.node import Node
from rlhf_async.runtime.spec import NodeSpec, SpecError

__all__ = ["Node", "NodeSpec", "SpecError", "run_loop"]
