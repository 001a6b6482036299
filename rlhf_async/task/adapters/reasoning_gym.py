"""reasoning-gym datasets as the text task's prompts and reward:
`task.prompts = "reasoning_gym:<dataset>"`, its config in `task.reasoning_gym`.

The datasets are procedural (nothing is downloaded): `size` questions from `seed` train, and
`max(1, size // 8)` from `seed + 1` are held out, so no question's draw is shared between
the splits. Each prompt is the dataset's question after one of reasoning-gym's own system
prompts (`system_prompt`, a name from its SYSTEM_PROMPTS: "default" asks for step-by-step
reasoning, "direct" for the answer alone; a chat, or one string with
`task.chat_template = false`); a response is scored by the dataset's `score_answer` on
what it puts in <answer>...</answer> (the whole response when it has no such tags, so a
small model that answers plainly is still scored).
The package is an extra: `pip install 'rlhf-async[reasoning-gym]'`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlhf_async.config import ConfigError, TaskConfig
from rlhf_async.task.adapters.interface import Rows
from rlhf_async.task.sources.tokens import Prompt

EXTRA = "pip install 'rlhf-async[reasoning-gym]'"
DEFAULT_SIZE = 500
ADAPTER_KEYS = ("seed", "size", "system_prompt")  # task.reasoning_gym keys that are ours


def _package() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(["task.prompts: a reasoning-gym dataset needs the reasoning-gym "
                           f"package: {EXTRA}"]) from None
    return reasoning_gym


def datasets(name: str, t: TaskConfig) -> tuple[Any, Any]:
    """(training dataset, held-out dataset) `name`; one ConfigError naming an unknown
    dataset (with some accepted names) or a config the dataset refuses."""
    rg = _package()
    known = sorted(rg.factory.DATASETS)
    if name not in known:
        raise ConfigError([f"task.prompts: {name!r} is not a reasoning-gym dataset; "
                           f"accepted: {', '.join(known[:8])}, ... ({len(known)} in all: "
                           "python -c 'import reasoning_gym; print(sorted("
                           "reasoning_gym.factory.DATASETS))')"])
    conf = {k: v for k, v in t.reasoning_gym.items() if k not in ADAPTER_KEYS}
    seed, size = t.reasoning_gym.get("seed", 0), t.reasoning_gym.get("size", DEFAULT_SIZE)
    if not isinstance(seed, int) or not isinstance(size, int) or size < 2:
        raise ConfigError([f"task.reasoning_gym: seed must be an integer and size an integer "
                           f">= 2; got seed = {seed!r}, size = {size!r}"])
    try:
        return (rg.create_dataset(name, seed=seed, size=size, **conf),
                rg.create_dataset(name, seed=seed + 1, size=max(1, size // 8), **conf))
    except (TypeError, ValueError, AssertionError) as e:
        raise ConfigError([f"task.reasoning_gym: the {name!r} dataset refuses {conf}: "
                           f"{e}"]) from None


def system_prompt(t: TaskConfig) -> str:
    """The text of `task.reasoning_gym.system_prompt` (a reasoning-gym prompt name)."""
    known = _package().utils.SYSTEM_PROMPTS
    name = t.reasoning_gym.get("system_prompt", "default")
    if name not in known:
        raise ConfigError([f"task.reasoning_gym: system_prompt = {name!r} is not one of "
                           f"reasoning-gym's system prompts; accepted: {', '.join(known)}"])
    return str(known[name])


def read_gym(name: str, t: TaskConfig) -> Rows:
    """Each question as a prompt, its row's columns its dataset entry; held out: the
    second dataset's."""
    system = system_prompt(t)
    prompts: list[Prompt] = []
    columns: list[dict[str, Any]] = []
    for heldout, ds in enumerate(datasets(name, t)):
        for i in range(len(ds)):
            entry = ds[i]
            q = entry["question"]
            prompts.append([{"role": "system", "content": system},
                            {"role": "user", "content": q}] if t.chat_template
                           else f"{system}\n\n{q}")
            columns.append({"entry": entry, "heldout": bool(heldout)})
    return Rows(prompts, columns, [c["heldout"] for c in columns])


class GymScore:
    """The dataset's own scorer as the text task's rule (`TextTask.rule`)."""

    def __init__(self, name: str, t: TaskConfig) -> None:
        self.train, self.heldout = datasets(name, t)
        self.extract = _package().utils.extract_answer

    def answer(self, response: str) -> str:
        tagged = self.extract(response)
        return response.strip() if tagged is None else tagged

    def __call__(self, prompts: Sequence[str], responses: Sequence[str],
                 columns: Sequence[dict[str, Any]], indices: Sequence[int]) -> list[float]:
        out = []
        for r, c in zip(responses, columns, strict=True):
            entry = c.get("entry")
            if entry is None:  # a prompt that is not one of the dataset's: no answer known
                out.append(0.0)
                continue
            ds = self.heldout if c.get("heldout") else self.train
            out.append(float(ds.score_answer(answer=self.answer(r), entry=entry)))
        return out


class ReasoningGymAdapter:
    """`task.prompts = "reasoning_gym:<dataset>"`: its questions, scored by its scorer."""

    key, gives_prompts, gives_reward, preload = "prompts", True, True, ()

    def __init__(self, argument: str, task: TaskConfig) -> None:
        self.name, self.task = argument, task

    def problems(self) -> list[str]:
        # the dataset's name and knobs are checked where the package is imported (the
        # task's load, before anything starts): listing its datasets takes its import
        return [] if self.name else [f"task.prompts: {self.task.prompts!r} names no "
                                     "reasoning-gym dataset"]

    def check_reachable(self) -> None:
        pass  # procedural: nothing outside this process

    def rows(self) -> Rows:
        return read_gym(self.name, self.task)

    def rule(self) -> GymScore:
        return GymScore(self.name, self.task)

    def environment(self) -> None:
        return None

    def agent(self, tokenizer: Any) -> None:
        return None
