"""Cross-field checks of the `[task]` section: what a task, its environment or agent, its
prompts and its reward need of each other and of the rest of the config (called by
`checks.cross_checks`; each line names its key)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from urllib.parse import urlsplit

from rlhf_async.config.presets import distills
from rlhf_async.config.schema import JobConfig, TaskConfig
from rlhf_async.config.task import adapter_syntax


def has_env(cfg: JobConfig) -> bool:
    """Whether the job's rollouts are multi-turn episodes with an environment or agent."""
    return cfg.task.name == "calculator" or bool(cfg.task.env) or bool(cfg.task.agent)


def episode_checks(cfg: JobConfig) -> list[str]:
    """An environment: a task that has text for it (every generation engine runs episodes:
    each policy turn is a request)."""
    t, out = cfg.task, []
    if t.env and t.name == "sort_digits":
        out.append(f"task.env: {t.env!r}: task.name = 'sort_digits' has no environment; "
                   "accepted: task.name = 'text' (your environment) or 'calculator'")
    if t.name == "calculator" and t.env not in ("", "calculator"):
        out.append(f"task.env: task.name = 'calculator' runs its own environment; got "
                   f"{t.env!r} (accepted: '' or 'calculator'; your own needs task.name = "
                   "'text')")
    if t.agent and t.name == "sort_digits":
        out.append(f"task.agent: {t.agent!r}: task.name = 'sort_digits' has no episodes; "
                   "accepted: task.name = 'text' (your prompts) or 'calculator'")
    if t.agent and t.env:
        out.append(f"task.agent: {t.agent!r} beside task.env = {t.env!r}: an episode is run "
                   "by one of them (the agent talks to the policy itself); set only one")
    if t.agent and t.agent_timeout_s >= cfg.runtime.step_deadline_s:
        out.append(f"task.agent_timeout_s: {t.agent_timeout_s:g} must be under "
                   f"runtime.step_deadline_s = {cfg.runtime.step_deadline_s:g}: a chunk of "
                   "episodes waits for its slowest agent, and a generator past the step "
                   "deadline is restarted as hung")
    return out


def reward_spec_problems(reward: str) -> list[str]:
    """task.reward: a function ('module.path:function', 'file.py:function') or a reward
    server's URL (rlhf_async.task.rewards.remote_reward)."""
    if not reward:
        return []
    if reward.startswith(("http://", "https://")):
        try:
            parts = urlsplit(reward)
            host, _ = parts.hostname, parts.port  # a bad port raises here
        except ValueError as e:
            return [f"task.reward: {reward!r} is not a usable URL ({e})"]
        return [] if host else [f"task.reward: {reward!r} names no host; expected "
                                "'http://HOST:PORT/PATH'"]
    if ":" not in reward:
        return [f"task.reward: {reward!r} is neither 'module.path:function', "
                "'path/to/file.py:function' nor a reward server 'http://HOST:PORT/PATH'"]
    return []


def text_task_checks(cfg: JobConfig) -> list[str]:
    """What the text task needs before its files are read (rlhf_async.task.text)."""
    t, out = cfg.task, []
    if not cfg.model.path:
        out.append("model.path: task.name = 'text' needs a local Hugging Face model "
                   "directory with a tokenizer")
    # an adapter's name ('<prefix>:...') is checked by the adapter registry (task/adapters/,
    # before anything starts): it knows whether its rows are the prompts, its score the reward
    named_env, named_prompts = adapter_syntax(t.env), adapter_syntax(t.prompts)
    if not t.prompts and not named_env:
        out.append("task.prompts: task.name = 'text' needs prompts: a data file (.jsonl, "
                   ".json, .parquet, .arrow, .csv, .txt), a directory or a cached dataset id "
                   "(or an environment adapter's task.env = '<prefix>:...' whose rows are the "
                   "prompts)")
    elif t.prompts and not Path(t.prompts).exists() and not named_prompts:
        out.append(f"task.prompts: {t.prompts!r} is neither a file nor a directory (nor an "
                   "adapter's '<prefix>:<argument>')")
    out += adapter_table_checks(t)
    if not (t.reward or cfg.reward_model.path or t.env or t.agent or named_prompts
            or distills(cfg.algo)):
        out.append("task.reward: task.name = 'text' needs 'module.path:function', "
                   "'path/to/file.py:function' or a reward server 'http://HOST:PORT/PATH' "
                   "(or a reward_model.path, or a task.env whose steps give the reward, or "
                   "a task.agent that returns it)")
    if t.reward and t.env:
        out.append(f"task.reward: {t.reward!r} would never be called: with task.env the "
                   "episode's reward is the sum of its environment's step rewards; remove "
                   "task.reward (score the response inside the environment's step)")
    if t.reward and t.agent:
        out.append(f"task.reward: {t.reward!r} would never be called: with task.agent the "
                   "episode's reward is what the agent returns; remove task.reward")
    if t.reward_weight and not (t.reward and cfg.reward_model.path):
        out.append("task.reward_weight: adds task.reward's score to reward_model.path's; "
                   "it needs both (without a reward model the rule is the whole reward)")
    return out


def adapter_table_checks(t: TaskConfig) -> list[str]:
    """An adapter's knobs (`task.<prefix>`, a field marked `adapter=`) without the adapter
    named in its key: they would be ignored."""
    out = []
    for f in fields(TaskConfig):
        key = f.metadata.get("adapter")
        if key and getattr(t, f.name) and not getattr(t, key).startswith(f"{f.name}:"):
            out.append(f"task.{f.name}: configures the '{f.name}:' adapter; task.{key} is "
                       f"{getattr(t, key)!r}, not '{f.name}:...'")
    return out
