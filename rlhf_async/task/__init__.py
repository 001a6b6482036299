"""Tasks: where prompts come from and how responses are judged.

`sort_digits` is the built-in task (with its own SFT and reward-model stages); `calculator`
the built-in multi-turn tool-use task (SFT, then episodes with a `calc` tool); `text` takes
the user's prompts file and rule reward function (and, with `task.env`, the user's
environment). `make_task(cfg)` builds the configured one.

Their parts, one subpackage each: where rows come from (`sources/`), what plays an
episode (`agents/`), how a response is judged beside a reward model (`rewards/`), and
outside packages' environments and datasets behind one registry of prefixes
(`adapters/`, asked here for what they reach and preload).
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from rlhf_async.config import JobConfig
from rlhf_async.config.presets import distills, overlong_buffer, resolve
from rlhf_async.modeling.environment import EpisodeSpec
from rlhf_async.modeling.generation import Decode, SamplingParams
from rlhf_async.modeling.rollout import PromptBatch
from rlhf_async.rl.scoring import RewardMix
from rlhf_async.task import adapters
from rlhf_async.task.agents import agent_episodes
from rlhf_async.task.calculator import CalculatorTask, CalculatorTokenizer
from rlhf_async.task.rewards.remote_reward import is_url
from rlhf_async.task.sort_digits import EOS, PAD, VOCAB_SIZE, SortDigitsTask
from rlhf_async.task.text import TextTask

__all__ = ["EOS", "PAD", "VOCAB_SIZE", "CalculatorTask", "SortDigitsTask", "Task",
           "check_reachable", "make_task", "reward_mix", "sampling_params", "task_preload"]


class Task(Protocol):
    eos_id: int
    pad_id: int
    rule_reward: bool  # True: hidden_scores IS the reward (no reward model at all)
    has_rule: bool  # False: no hidden_scores (a text task judged by reward_model.path only)
    stop_ids: tuple[int, ...]  # the task's own stop tokens (a tool call's end), beside EOS

    @property  # token ids -> text; None: the task has no text (no generation.stop_strings)
    def decode(self) -> Decode | None: ...

    def prompt_batch(self, seed: int, purpose: str, step: int, count: int,
                     group_size: int) -> PromptBatch: ...

    def hidden_scores(self, prompt_ids: Tensor, response_ids: Tensor,
                      response_mask: Tensor) -> Tensor: ...

    def episode_spec(self) -> EpisodeSpec | None: ...  # None: one response per prompt


def make_task(cfg: JobConfig) -> Task:
    """The task `cfg.task.name` names (the text task reads its files and imports the reward
    function here; problems are a ConfigError)."""
    if cfg.task.name == "text":
        return TextTask(cfg)
    if cfg.task.name == "calculator":  # with task.agent, the agent plays its episodes
        return CalculatorTask(cfg, agent_episodes(cfg.task.agent, CalculatorTokenizer())
                              if cfg.task.agent else None)
    return SortDigitsTask(cfg.task)


def check_reachable(cfg: JobConfig) -> None:
    """What the task reaches outside this process, checked once before anything starts
    (`run`'s checks and --dry-run; not again in every node or rank, where it would cost
    each seconds): the environment adapters' (an OpenEnv server's `module:app` imports,
    its URL answers). Problems are a ConfigError."""
    adapters.check_reachable(cfg.task)


def task_preload(cfg: JobConfig) -> tuple[str, ...]:
    """Modules the task imports as it loads that take long enough to stall a node's first
    heartbeats (a verifiers environment: seconds): the fork server imports them once."""
    return adapters.preload(cfg.task)


def reward_mix(cfg: JobConfig, task: Task) -> RewardMix:
    """How this job makes a sample's reward from its reward model and the task's rule (a
    reward server's requests overlap the scorer's forwards)."""
    g = cfg.generation
    return RewardMix(task.hidden_scores if task.has_rule else None, cfg.reward_model.weight,
                     cfg.task.reward_weight, overlap=is_url(cfg.task.reward),
                     overlong_penalty=resolve(cfg.algo).overlong_penalty,
                     overlong_buffer=overlong_buffer(cfg.algo, g.max_new_tokens),
                     max_new_tokens=g.max_new_tokens, unrewarded=distills(cfg.algo))


def sampling_params(cfg: JobConfig, task: Task) -> SamplingParams:
    """How the policy samples for this job: the generation settings and the task's tokens
    (and its decoder, which matches the stop strings; its episodes, when it has an
    environment)."""
    g = cfg.generation
    stops = (*g.stop_token_ids, *(s for s in task.stop_ids if s not in g.stop_token_ids))
    return SamplingParams(g.max_new_tokens, task.eos_id, task.pad_id, g.temperature, g.top_k,
                          g.top_p, stops, g.min_new_tokens, tuple(g.stop_strings), task.decode,
                          task.episode_spec())
