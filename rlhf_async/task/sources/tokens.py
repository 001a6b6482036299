"""Text to token ids, the same way in every stage that reads the user's data (RL prompts,
SFT demonstrations, preference pairs).

A prompt is a string or a chat (a list of {"role", "content"}). A string goes through the
tokenizer's chat template as one user turn (unless `task.chat_template = false`); a chat
always goes through it; both end with the template's generation prompt, which is where the
policy's response starts. A response is its text's tokens (no special tokens added) and
EOS, the token generation stops at.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from rlhf_async.config import ConfigError

Prompt = str | list[dict[str, Any]]
ROLES = ("system", "user", "assistant", "tool")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """model.path's tokenizer; one error when it has none or no EOS."""
    from transformers import AutoTokenizer

    msg = f"model.path: no usable tokenizer in {path!r} (the user's data needs one"
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError([f"{msg}) ({e})"]) from None
    if not tok("a b c 1 2 3")["input_ids"]:  # no tokenizer files: transformers builds an
        # empty one from the model's config silently, and every prompt becomes no tokens
        raise ConfigError([f"{msg}: tokenizer.json or the vocabulary files of its "
                           "tokenizer class; it has none)"])
    if tok.eos_token_id is None:
        raise ConfigError([(f"model.path: the tokenizer in {path!r} has no EOS token "
                            "(generation needs one to stop)")])
    return tok


def check_chat(value: Any, where: str) -> list[dict[str, Any]]:
    """`value` as a chat: a non-empty list of {"role": one of ROLES, "content": str}."""
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
        for m in value)
    if not ok:
        raise ConfigError([f"{where}: expected a chat, a non-empty list of {{\"role\": "
                           f"{' | '.join(ROLES)}, \"content\": \"...\"}}, got "
                           f"{str(value)[:120]!r}"])
    return list(value)


def split_chat(chat: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str | None]:
    """(the turns before a last assistant turn, that turn's text); (chat, None) when the
    chat does not end with the assistant."""
    if chat[-1]["role"] == "assistant":
        return chat[:-1], str(chat[-1]["content"])
    return chat, None


def prompt_text(prompt: Prompt) -> str:
    """What a rule reward sees as the prompt: the string, or a chat's last user turn."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m["role"] == "user"]
    return str(users[-1] if users else prompt[-1]["content"])


def encode_prompt(tok: PreTrainedTokenizerBase, prompt: Prompt, chat_template: bool,
                  tools: list[Any] | None = None) -> list[int]:
    """A prompt's token ids, ending where the response starts (`tools`: the tool schemas
    the chat template renders, as OpenAI's `tools=`)."""
    if isinstance(prompt, str) and not chat_template:
        return list(tok(prompt).input_ids)
    if not getattr(tok, "chat_template", None):
        raise ConfigError([("task.chat_template: the tokenizer in model.path has no chat "
                            "template; set task.chat_template = false (prompts given as "
                            "chats need one)")])
    chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tok.apply_chat_template(chat, tools=tools, tokenize=False,
                                   add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False).input_ids)


def encode_response(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    """A response's token ids, EOS last."""
    return [*tok(text, add_special_tokens=False).input_ids, int(tok.eos_token_id)]
