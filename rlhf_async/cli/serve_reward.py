"""`rlhf-async serve-reward path.py:fn --port N`: serve a reward function over HTTP for
`task.reward = "http://HOST:PORT/PATH"` (`ops/reward_server.py`). It runs until Ctrl-C or
SIGTERM. (The CLI may print; this module is the CLI's.)"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from rlhf_async.cli.errors import UserError
from rlhf_async.log import configure_logging

EXTRA = "remote-reward"


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535; 0 = any free one)")
    return port


def _path(text: str) -> str:
    if not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"{text!r} must start with '/'")
    return text


def add_command(sub: Any) -> None:
    p = sub.add_parser("serve-reward", help="serve a reward function over HTTP for task.reward "
                       "= 'http://HOST:PORT/PATH' (needs the remote-reward extra)")
    p.add_argument("reward", metavar="path.py:fn", help="the function, as task.reward names "
                   "one: 'path/to/file.py:function' or 'module.path:function'")
    p.add_argument("--port", type=_port, required=True, help="TCP port (0: any free one; "
                   "the URL is printed)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                   "127.0.0.1: this machine only; 0.0.0.0 exposes it to the network)")
    p.add_argument("--path", type=_path, default="/reward", help="URL path that scores "
                   "(default /reward)")
    p.add_argument("--batched", action="store_true", help="call it once per request as "
                   "f(prompts, responses, **columns) -> list (as task.reward_batched)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="longest one call may take "
                   "(s; as task.reward_timeout_s); past it the request is answered 500")
    p.add_argument("--log-level", default="warning",
                   choices=("debug", "info", "warning", "error"))


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        from rlhf_async.ops.reward_server import serve
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "aiohttp":
            raise
        raise UserError(f"serve-reward needs aiohttp: pip install 'rlhf-async[{EXTRA}]'") \
            from None
    from rlhf_async.task.rewards.reward_fn import RuleReward  # torch: only this command loads it

    if args.timeout_s <= 0:
        raise UserError(f"--timeout-s: {args.timeout_s:g} must be > 0")
    rule = RuleReward.load(args.reward, args.batched, args.timeout_s, rows="the request")

    def ready(url: str) -> None:
        print(f"serving {args.reward} at {url} (use task.reward = \"{url}\"; Ctrl-C stops)",
              flush=True)

    try:
        asyncio.run(serve(rule, args.host, args.port, args.path, ready))
    except OSError as e:  # the port is taken, the address is not this machine's
        raise UserError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") \
            from None
    return 0
