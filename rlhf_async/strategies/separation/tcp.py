"""Separation's single-host node specs re-addressed for several hosts (`tcp_specs`): every
bound ipc endpoint gets a tcp address on its node's host, every connect follows it. The
Ray launch (`on_ray.py`) gives each host's ports from what is free there; CURVE keys then
secure every tcp endpoint."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from rlhf_async.runtime import NodeSpec


def tcp_specs(specs: list[NodeSpec], prompts: str, where: dict[str, tuple[str, str]],
              coordinator: str, next_port: Callable[[str], int],
              known: dict[str, str] | None = None) -> tuple[list[NodeSpec], str]:
    """Give every bound ipc endpoint a tcp address on its node's host (`where`: node id ->
    (host address, device there); the prompts queue on the coordinator's), point every
    connect at it, and set each node's device. Ports come from `next_port(host address)`;
    an address in `known` (ipc -> tcp: a running node's, when a scale adds nodes) keeps
    its tcp address."""
    moved: dict[str, str] = dict(known or {})

    def tcp(address: str, host_address: str) -> str:
        if address not in moved:
            moved[address] = f"tcp://{host_address}:{next_port(host_address)}"
        return moved[address]

    new_prompts = tcp(prompts, coordinator)
    for spec in specs:
        for ep in spec.endpoints.values():
            if ep.bind:
                tcp(ep.address, where[spec.node_id][0])
    out = [replace(spec.readdressed(moved), device=where[spec.node_id][1]) for spec in specs]
    return out, new_prompts
