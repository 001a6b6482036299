"""The text task's environment: `task.env` loaded, and its replies rendered as tokens.

`task.env` is 'file.py:Class', 'module.path:Class' (imported like `task.reward`), a
built-in name (`BUILTIN`); an environment adapter's ('<prefix>:...', an OpenEnv server)
comes from `task/adapters/` instead.
The class is made with no arguments, once per episode; its
`reset` and `step` must be coroutine functions (the `Env` protocol).

An observation becomes tokens as a chat-template delta: the text the template adds after
the policy's turn for one more message of `role` (the assistant turn's closing markup, the
message, the next generation prompt), found by rendering a placeholder conversation with
and without it. Only that text is tokenised; the episode's earlier tokens never are, so
they cannot drift. It matches the whole conversation's tokenisation when the template
closes a turn with a special token (every common chat template does): tokenisers never
merge across one.

A tokenizer without a chat template (a base model, `task.chat_template = false`) gets plain
text turns: an observation is "\n" + observation + "\n", tokenised on its own and appended
after the policy's turn; the policy reads it as text continuing the document.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase

from rlhf_async.config import ConfigError
from rlhf_async.modeling.environment import Env
from rlhf_async.task.calculator import CalculatorEnv
from rlhf_async.task.rewards.reward_fn import RewardFunctionError, load_reward_fn

BUILTIN: dict[str, Callable[[], Env]] = {"calculator": CalculatorEnv}
_USER, _BOT = "\x00user\x00", "\x00assistant\x00"  # placeholders no template alters


def load_env(spec: str) -> Callable[[], Env]:
    """The environment class `spec` names; one ConfigError naming what is wrong."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise ConfigError([f"task.env: {spec!r} is neither a built-in environment "
                           f"({', '.join(sorted(BUILTIN))}) nor 'file.py:Class' / "
                           "'module.path:Class'"])
    cls = load_named(spec, "task.env")
    missing = [m for m in ("reset", "step")
               if not inspect.iscoroutinefunction(getattr(cls, m, None))]
    if not inspect.isclass(cls) or missing:
        raise ConfigError([f"task.env: {spec!r} must be a class with async reset(row) -> "
                           "observation and async step(action) -> (observation, reward, "
                           f"done); {'it is not a class' if not inspect.isclass(cls) else ''}"
                           f"{'missing or not async: ' + ', '.join(missing) if missing else ''}"])
    return cls  # type: ignore[return-value]  # checked above: an Env class


def load_named(spec: str, key: str) -> Any:
    """What 'file.py:name' / 'module.path:name' names (imported as `task.reward` is); its
    problems as one ConfigError under `key`."""
    try:
        return load_reward_fn(spec)
    except RewardFunctionError as e:
        raise ConfigError([p.replace("task.reward:", f"{key}:", 1) for p in e.problems]) \
            from None


def template_delta(tok: PreTrainedTokenizerBase, role: str = "tool", *, chat: bool = True,
                   ) -> Callable[[str], list[int]]:
    """observation -> the tokens the chat template adds for it after a policy turn (plain
    text between newlines without a template, or with `chat` off: task.chat_template)."""
    if not chat or not getattr(tok, "chat_template", None):
        return lambda observation: list(tok(f"\n{observation}\n",
                                            add_special_tokens=False).input_ids)
    delta = chat_delta(tok)
    return lambda observation: delta([{"role": role, "content": observation}])


def chat_delta(tok: PreTrainedTokenizerBase, tools: list[Any] | None = None,
               key: str = "task.env") -> Callable[[list[dict[str, Any]]], list[int]]:
    """messages -> the tokens the chat template adds for them after a policy turn (the
    turn's closing markup, the messages, the next generation prompt), with `tools` given
    to the template as a whole conversation's would be; `key` names the config key in the
    error of a template that drops the assistant's turn."""

    def render(chat: list[dict[str, Any]], generation: bool) -> str:
        return str(tok.apply_chat_template(chat, tools=tools, tokenize=False,
                                           add_generation_prompt=generation))

    base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _BOT}]
    before = render(base, False)
    if _BOT not in before:
        raise ConfigError([f"{key}: the chat template drops the assistant's turn, so what "
                           "follows a policy turn cannot be placed after it"])

    def delta(messages: list[dict[str, Any]]) -> list[int]:
        text = render([*base, *messages], True)
        cut = text.index(_BOT) + len(_BOT)
        return list(tok(text[cut:], add_special_tokens=False).input_ids)

    return delta
