"""The taskset: "repeat this word" prompts, one per word, scored by a `@vf.reward`
rubric."""

from __future__ import annotations

import random

import verifiers.v1 as vf
from pydantic import Field

WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle", "rocket",
         "garden", "silver", "window", "forest", "pencil", "orange", "bridge", "castle",
         "dragon", "flower", "guitar", "island", "jacket", "kitten", "ladder", "magnet",
         "needle", "oyster", "pepper", "rabbit", "saddle", "tunnel", "violin")


class RepeatData(vf.TaskData):
    """One row: the word the reply must repeat."""

    answer: str = ""


class RepeatTask(vf.Task[RepeatData]):
    @vf.reward(weight=1.0)
    async def repeated(self, trace: vf.Trace) -> float:
        """1 for a reply that is the word, 0.5 for one that contains it, else 0."""
        reply = trace.last_reply.strip().strip(".!\"'").lower()
        if reply == self.data.answer:
            return 1.0
        return 0.5 if self.data.answer in reply else 0.0


class RepeatConfig(vf.TasksetConfig):
    words: list[str] = Field(default_factory=lambda: list(WORDS))
    """The words, one task each."""
    seed: int = 0
    """The order the tasks come in."""


class RepeatTaskset(vf.Taskset[RepeatTask, RepeatConfig]):
    def load(self) -> list[RepeatTask]:
        words = list(self.config.words)
        random.Random(self.config.seed).shuffle(words)
        return [RepeatTask(RepeatData(prompt=f"Repeat this word and nothing else: {w}",
                                      system_prompt="Answer with one word.", answer=w),
                           self.config.task)
                for w in words]
