"""One agent episode's token history, as the OpenAI-compatible endpoint serves it.

Token in, token out: a call's messages are matched against the messages this session has
recorded (the agent's so far, and each reply as the policy generated it). When they extend
them, only the new messages are rendered, as the chat template's delta after the policy's
turn (`chat_delta`, the one `task.env` uses); the recorded tokens are never re-tokenised,
so the ids trained on are the ids sampled and read. When they do not (the agent edited,
dropped or summarised its history), the call opens a new segment: its whole conversation
rendered at once, counted (`episodes/new_segments`). Every segment is trained: the last
is the episode's row, each earlier one a row of its own with the episode's reward and
advantage (`episode_batch`).

Tools: the request's `tools` go to the template; a reply holding Hermes/Qwen-style
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks is answered as
`tool_calls`, and the agent's `role: tool` messages after it are environment tokens like
any other message it adds.

Sampling is the run's (`generation.*`): the behaviour log-probs trained on are that
sampler's, and the trainer recomputes them at its temperature. A request asking for
another distribution (`temperature`, `top_p`, `top_k`, `min_p`, penalties, `logit_bias`)
is refused (400, naming the run's value) rather than silently sampled otherwise; one that
names the run's values, or leaves them out, is served. `max_tokens` and `stop` cut the
reply (what is kept is a prefix of what was sampled, so its log-probs stand); `seed` is
not needed: the run's sampling is keyed by episode and call, reproducible as it is.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from rlhf_async.modeling.episodes import Episode, after_turn, warn
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.modeling.rollout import ENV, POLICY
from rlhf_async.task.agents.environment import chat_delta
from rlhf_async.task.sources.tokens import encode_prompt

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
ROLES = ("system", "developer", "user", "assistant", "tool")

# (call index, the segment as an episode) -> (new tokens, their log-probs, ended at a stop)
Policy = Callable[[int, Episode], Awaitable[tuple[list[int], list[float], bool]]]


class RequestError(ValueError):
    """A request the endpoint refuses (answered 400 with this message)."""


class PolicyFailed(RuntimeError):
    """The policy's generation failed (the run stops with it; the call is answered 500)."""


class _NoEnv:
    """An agent's episode has no `Env`: the agent is its environment."""

    async def reset(self, row: dict[str, Any]) -> str:
        raise RuntimeError("an agent's episode has no environment")

    async def step(self, action: str) -> tuple[str, float, bool]:
        raise RuntimeError("an agent's episode has no environment")


NO_ENV = _NoEnv()


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"{where}.content: expected a string or a list of "
                       f"{{'type': 'text', 'text': ...}} parts, got {str(content)[:80]!r}")


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    """A tool call's arguments as a dict (OpenAI sends a JSON string; templates read dicts)."""
    if isinstance(raw, dict):
        return raw
    try:
        out = json.loads(raw) if isinstance(raw, str) else None
    except json.JSONDecodeError:
        out = None
    if not isinstance(out, dict):
        raise RequestError(f"{where}.function.arguments: expected a JSON object, got "
                           f"{str(raw)[:80]!r}")
    return out


def normal(messages: Any) -> list[dict[str, Any]]:
    """The request's messages in one form, compared against the record and given to the
    template: role, content text, tool calls with dict arguments, a tool message's id."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: expected a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"{where}: expected {{role, content}} with role one of "
                               f"{', '.join(ROLES)}, got {str(m)[:80]!r}")
        one: dict[str, Any] = {"role": m["role"], "content": _text(m.get("content"), where)}
        calls = m.get("tool_calls") or []
        if calls:
            one["tool_calls"] = [
                {"type": "function", "function": {
                    "name": str((c.get("function") or {}).get("name", "")),
                    "arguments": _arguments((c.get("function") or {}).get("arguments"),
                                            f"{where}.tool_calls[{j}]")}}
                for j, c in enumerate(calls)]
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                one[key] = m[key]
        out.append(one)
    return out


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(the text outside the `<tool_call>` blocks, the calls as OpenAI `tool_calls`). A
    block that is not {"name": str, "arguments": object} JSON stays in the text."""
    calls, kept, at = [], [], 0
    for m in TOOL_CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments", {}), dict)):
            continue
        kept.append(text[at:m.start()])
        at = m.end()
        calls.append({"type": "function", "function": {
            "name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
    kept.append(text[at:])
    return "".join(kept).strip(), calls


def sampling_problem(body: dict[str, Any], params: SamplingParams) -> str | None:
    """Why the request's sampling is not the run's (None: it is, or it names none)."""
    run = {"temperature": (params.temperature, "generation.temperature"),
           "top_p": (params.top_p, "generation.top_p"),
           "top_k": (params.top_k, "generation.top_k"), "min_p": (0.0, None),
           "frequency_penalty": (0.0, None), "presence_penalty": (0.0, None),
           "repetition_penalty": (1.0, None)}
    for key, (value, knob) in run.items():
        got = body.get(key)
        if got is None or (key == "top_k" and got in (-1, 0) and value == 0):
            continue
        if not isinstance(got, int | float) or not math.isclose(got, value, rel_tol=1e-6):
            where = f"{knob} = {value}" if knob else f"{value} (not configurable)"
            return (f"{key}: this run samples with {where}, and trains on that sampler's "
                    f"log-probs; send {key} = {value} or leave it out (got {got!r})")
    if body.get("logit_bias"):
        return "logit_bias: this run samples from the policy as it is; leave logit_bias out"
    return None


def stop_strings(stop: Any) -> list[str]:
    """A request's `stop`: None, a string or a list of strings."""
    if stop is None or isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise RequestError(f"stop: expected a string or a list of strings, got {str(stop)[:80]!r}")


@dataclass
class Segment:
    """One token history: an `Episode` (its first render's tokens, at most the batch's
    prompt width, as the prompt; the rest after it) and what it was matched on."""

    episode: Episode
    messages: list[dict[str, Any]] | None = None  # chat: the conversation so far
    tools: Any = None
    text: str | None = None  # completions: the prompt text so far
    full: bool = False  # messages found no room in the episode's tokens: nothing more fits


@dataclass
class Session:
    """One episode's calls (see the module). `width`: the batch's prompt width;
    `max_tokens`: an episode's tokens after its prompt; `max_calls`: policy calls."""

    tok: PreTrainedTokenizerBase
    policy: Policy
    decode: Callable[[list[int]], str]
    params: SamplingParams  # the run's sampler
    width: int
    max_tokens: int
    max_calls: int
    chat: bool = True  # the tokenizer has a chat template (else /completions only)
    name: str = "task.agent"  # the agent (or verifiers environment), for warnings
    segments: list[Segment] = field(default_factory=list)
    calls: int = 0
    truncated: bool = False  # a reply ran out of tokens, or a call found no room left

    def _open(self, tokens: list[int], **match: Any) -> Segment:
        """A new segment over `tokens` (a whole conversation rendered once); what does not
        fit the batch's prompt width is context in the response, said once per run."""
        if len(tokens) > self.width and not self.segments:
            warn("agent prompt over task.max_prompt_tokens", self.name,
                 prompt_tokens=len(tokens), width=self.width,
                 hint=f"its last {len(tokens) - self.width} tokens count in "
                      f"generation.max_episode_tokens = {self.max_tokens}; set "
                      f"task.max_prompt_tokens = {len(tokens)} or more to hold it")
        seg = Segment(Episode(tokens[:self.width], NO_ENV), **match)
        self._extend(seg, tokens[self.width:])
        self.segments.append(seg)
        return seg

    def _extend(self, seg: Segment, new: list[int]) -> None:
        """Append the agent's tokens, or, as an environment's observation that does not
        fit, none: with no room for them and a reply the episode's tokens are spent (every
        later call on the segment is answered `length`, the episode truncated)."""
        new = after_turn(seg.episode, new, self.params.stops)
        if seg.full or len(seg.episode.tokens) + len(new) >= self.max_tokens:
            seg.full = bool(new) or seg.full
            return
        seg.episode.add(new, ENV)

    def check(self, body: dict[str, Any]) -> list[str]:
        """The request's stop strings; a request for another sampler (see the module) or
        a malformed `stop` refused before anything is recorded."""
        problem = sampling_problem(body, self.params)
        if problem is not None:
            raise RequestError(problem)
        return stop_strings(body.get("stop"))

    async def _reply(self, seg: Segment, stops: list[str], limit: Any,
                     ) -> tuple[list[int], str, str]:
        """The policy's next turn on `seg`: (its tokens, their text, finish reason)."""
        if self.calls >= self.max_calls:
            raise RequestError(f"this episode has made its task.max_turns = {self.max_calls} "
                               "policy calls")
        ep = seg.episode
        if seg.full or len(ep.tokens) >= self.max_tokens:
            self.truncated = True  # generation.max_episode_tokens spent
            return [], "", "length"
        self.calls += 1
        try:
            toks, lps, ended = await self.policy(self.calls - 1, ep)
        except Exception as e:  # the engine's, not the agent's: reported by the driver
            raise PolicyFailed(f"{type(e).__name__}: {e}") from e
        # a turn that ran out of generation.max_new_tokens or the episode's tokens is
        # truncated as an environment's episode's is (the agent's max_tokens or stop is not)
        ran_out = not ended
        if isinstance(limit, int) and 0 < limit < len(toks):
            toks, lps, ended, ran_out = toks[:limit], lps[:limit], False, False
        text = self.decode(toks)
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            at, stop = min(hits)
            keep = next(i for i in range(1, len(toks) + 1)
                        if len(self.decode(toks[:i])) >= at + len(stop))
            toks, lps, ended, ran_out, text = toks[:keep], lps[:keep], True, False, text[:at]
        self.truncated = self.truncated or ran_out
        ep.add(toks, POLICY, lps)
        return toks, text, "stop" if ended else "length"

    async def chat_completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """/chat/completions: the reply as a `chat.completion` message."""
        if not self.chat:
            raise RequestError("the policy's tokenizer has no chat template: use "
                               "/completions")
        stops = self.check(body)
        msgs, tools = normal(body.get("messages")), body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise RequestError("tools: expected a list of {type: function, function: ...}")
        seg = self.segments[-1] if self.segments else None
        if seg is not None and seg.messages is not None and seg.tools == tools \
                and len(msgs) > len(seg.messages) and msgs[:len(seg.messages)] == seg.messages:
            self._extend(seg, chat_delta(self.tok, tools, "task.agent")(
                msgs[len(seg.messages):]))
        else:
            seg = self._open(encode_prompt(self.tok, msgs, True, tools), tools=tools)
        toks, text, finish = await self._reply(seg, stops, body.get(
            "max_completion_tokens", body.get("max_tokens")))
        content, calls = parse_tool_calls(text) if tools else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"id": f"call_{self.calls}_{i}", **c}
                                     for i, c in enumerate(calls)]
            finish = "tool_calls" if finish == "stop" else finish
        seg.messages = [*msgs, *normal([message])]
        return {"object": "chat.completion", "usage": self._usage(seg, toks),
                "choices": [{"index": 0, "message": message, "finish_reason": finish,
                             "logprobs": None}]}

    async def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """/completions: a text (or token ids) prompt continued."""
        stops = self.check(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        seg = self.segments[-1] if self.segments else None
        if isinstance(prompt, str):
            if seg is not None and seg.text is not None and prompt.startswith(seg.text):
                self._extend(seg, list(self.tok(prompt[len(seg.text):],
                                                 add_special_tokens=False).input_ids))
            else:
                seg = self._open(encode_prompt(self.tok, prompt, False), text="")
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            have = seg.episode.prompt + seg.episode.tokens if seg is not None else []
            if seg is not None and seg.text is None and seg.messages is None \
                    and prompt[:len(have)] == have:
                self._extend(seg, prompt[len(have):])
            else:
                seg = self._open(list(prompt))
        else:
            raise RequestError("prompt: expected a string or a list of token ids")
        toks, text, finish = await self._reply(seg, stops, body.get("max_tokens"))
        if seg.text is not None:
            seg.text = prompt + text  # type: ignore[operator]  # a str prompt here
        return {"object": "text_completion", "usage": self._usage(seg, toks),
                "choices": [{"index": 0, "text": text, "finish_reason": finish,
                             "logprobs": None}]}

    def _usage(self, seg: Segment, toks: list[int]) -> dict[str, int]:
        total = len(seg.episode.prompt) + len(seg.episode.tokens)
        return {"prompt_tokens": total - len(toks), "completion_tokens": len(toks),
                "total_tokens": total}
