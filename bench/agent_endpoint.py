"""An agent through the OpenAI-compatible endpoint (`task.agent`) against the same episodes
in-process (`task.env`): episodes/s and the endpoint's cost per policy call.

The same conversation both ways on a tiny GPT-2 with a ChatML byte-level BPE tokenizer
(built in code): a prompt, then `TURNS` policy turns with a user message "continue"
between them. The environment's episode (`play`'s reset/step loop) and the agent's (three
`openai`-client calls, each adding that message) sample with the same keys, so their
recorded token ids must be equal, and are checked to be. Variants run in turns, round by
round; medians reported.

    python bench/agent_endpoint.py [--episodes 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import httpx
import torch
from openai import AsyncOpenAI
from transformers import GPT2Config, GPT2LMHeadModel

from rlhf_async.modeling.environment import EpisodeSpec
from rlhf_async.modeling.episodes import ENDS, rollout
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch
from rlhf_async.task.agents.agent import AgentEpisodes
from rlhf_async.task.agents.environment import template_delta
from rlhf_async.task.sources.tokens import encode_prompt
from tests.chat_tokenizers import chatml_tokenizer

TURNS = 3
PROMPTS = ["what is two plus three", "and what about four times six", "six",
           "thanks , one more : seven minus one"]


class Continue:
    """The environment side of the conversation: "continue" after each turn."""

    async def reset(self, row: dict[str, Any]) -> str:
        self.turns = 0
        return ""

    async def step(self, action: str) -> tuple[str, float, bool]:
        self.turns += 1
        return "continue", 0.0, self.turns >= TURNS


_HTTP: list[httpx.AsyncClient] = []  # one for every episode: see `agent`


async def agent(base_url: str, row: dict[str, Any]) -> float:
    """The same conversation from an `openai`-client agent. Its clients share one HTTP
    client (they all run on the agent loop): a new `AsyncOpenAI` builds its own, with an
    SSL context, ~0.1 s of CPU that would be counted here as the endpoint's."""
    if not _HTTP:
        _HTTP.append(httpx.AsyncClient())
    msgs = [{"role": "user", "content": row["prompt"]}]
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                         http_client=_HTTP[0])
    for turn in range(TURNS):
        r = await client.chat.completions.create(model="policy", messages=msgs)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        if turn < TURNS - 1:
            msgs.append({"role": "user", "content": "continue"})
    return 0.0


class Setup:
    """The model, tokenizer and a batch of `episodes` prompts."""

    def __init__(self, episodes: int, max_new_tokens: int = 16) -> None:
        self.tok = tok = chatml_tokenizer()
        cfg = GPT2Config(vocab_size=len(tok), n_positions=256, n_embd=64, n_layer=2,
                         n_head=2, eos_token_id=tok.eos_token_id, bos_token_id=None,
                         pad_token_id=tok.pad_token_id)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.model = GPT2LMHeadModel(cfg).eval()
        rows = [encode_prompt(tok, PROMPTS[i % len(PROMPTS)], True) for i in range(episodes)]
        self.text = {tuple(r): PROMPTS[i % len(PROMPTS)] for i, r in enumerate(rows)}
        P = max(len(r) for r in rows)
        ids = torch.full((episodes, P), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, P - len(r):], mask[i, P - len(r):] = torch.tensor(r), 1
        self.prompts = PromptBatch(ids, mask, torch.arange(episodes), torch.arange(episodes))
        # turns end at any of the upper half of the vocabulary: a few tokens each
        self.stops = tuple(range(len(tok) // 2, len(tok)))
        self.max_new_tokens = max_new_tokens

    def spec(self, kind: str) -> EpisodeSpec:
        decode = lambda t: self.tok.decode(t, skip_special_tokens=True)  # noqa: E731
        row = lambda t: {"prompt": self.text[tuple(t)]}  # noqa: E731
        if kind == "env":
            return EpisodeSpec(Continue, row, template_delta(self.tok, "user"), decode, TURNS,
                               160, 60.0, "continue")
        return EpisodeSpec(Continue, row, lambda _: [], decode, TURNS, 160, 60.0,
                           "agent", AgentEpisodes(agent, self.tok, True))

    def run(self, kind: str, seed: int = 0) -> RolloutBatch:
        params = SamplingParams(self.max_new_tokens, self.tok.eos_token_id,
                                self.tok.pad_token_id, stop_ids=self.stops,
                                episode=self.spec(kind))
        with torch.no_grad():
            return rollout(self.model, self.prompts, params, seed, 0, 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    s = Setup(args.episodes)
    s.run("agent")  # warm: the server, the client's imports
    times: dict[str, list[float]] = {"env": [], "agent": []}
    compared = 0
    for r in range(args.rounds):
        out = {}
        for kind in ("env", "agent"):
            t0 = time.perf_counter()
            out[kind] = s.run(kind, seed=r)
            times[kind].append(time.perf_counter() - t0)
        # a turn cut at max_new_tokens ends the environment's episode (`truncated`) while
        # the agent goes on: those rows are not the same conversation
        done = out["env"].episode_ends == ENDS.index("done")  # type: ignore[operator]
        compared += int(done.sum())
        if not torch.equal(out["env"].response_ids[done], out["agent"].response_ids[done]):
            raise SystemExit("the agent's tokens differ from the environment's")
    env, ag = (statistics.median(times[k]) for k in ("env", "agent"))
    calls = args.episodes * TURNS
    print(json.dumps({"episodes": args.episodes, "turns": TURNS, "rounds": args.rounds,
                      "env_episodes_per_s": round(args.episodes / env, 2),
                      "agent_episodes_per_s": round(args.episodes / ag, 2),
                      "overhead_ms_per_call": round(1000 * (ag - env) / calls, 2),
                      "same_tokens_episodes": compared, "load": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
