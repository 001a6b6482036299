"""The `[task]` section: what the job trains on (a built-in task, or the user's prompts,
reward and environment), and the built-in tasks' own defaults."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rlhf_async.config.fields import opt

# an environment adapter's name: '<prefix>:<argument>' (task.env, task.prompts); which
# prefixes exist only task/adapters/ knows (this layer cannot import it)
_ADAPTER = re.compile(r"[A-Za-z_]\w*:")


def adapter_syntax(value: str) -> bool:
    """Whether `value` is written as an adapter's '<prefix>:<argument>' (also the shape of
    a 'module:Class' without dots: the adapter registry tells them apart)."""
    return _ADAPTER.match(value) is not None


# A built-in task's own defaults, used where the config file and the overrides leave a key
# unset (the reference file shows the general ones): the calculator's episodes are short,
# and its tool use is learned in a few dozen steps, so its default run fits in minutes.
TASK_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "calculator": {"train": {"steps": 20}, "generation": {"max_episode_tokens": 20}},
}


@dataclass
class TaskConfig:
    name: str = opt("sort_digits", "sort_digits = the built-in task (SFT + reward model); "
                    "calculator = the built-in multi-turn task (SFT, then episodes with a "
                    "calc(...) tool; its own defaults: TASK_DEFAULTS in config/schema.py); "
                    "text = your prompts + your reward function (needs model.path)",
                    choices=("sort_digits", "calculator", "text"))
    min_len: int = opt(3, "shortest prompt (digits; sort_digits)", ge=2)
    max_len: int = opt(6, "longest prompt (digits; sort_digits)", ge=2)
    num_digits: int = opt(10, "digit alphabet size (sort_digits)", ge=2, le=10)
    long_fraction: float = opt(0.0, "sort_digits: share of prompts drawn from a long tail "
                               "(their length uniform in (task.short_len, task.max_len], the "
                               "others' in [task.min_len, task.short_len]; the answer is as "
                               "long as its prompt); 0 = every length uniform in "
                               "[task.min_len, task.max_len]", ge=0.0, le=1.0)
    short_len: int = opt(0, "sort_digits with task.long_fraction > 0: the longest short "
                         "prompt (digits), task.min_len <= short_len < task.max_len", ge=0)
    prompts: str = opt("", "text: your prompts: a .jsonl/.json/.parquet/.arrow/.csv file, a "
                       ".txt file (one per line), a directory (save_to_disk, or data files) "
                       "or a dataset id in the local HF cache; ~1 in 8 held out for "
                       "evaluation")
    split: str = opt("train", "text: the split of task.prompts to use, when it has splits")
    prompt_key: str = opt("prompt", "text: the prompt column (a string)")
    messages_key: str = opt("messages", "text: the chat column used when a row has no "
                            "prompt_key: a list of {role, content}; a last assistant turn "
                            "is dropped")
    reward: str = opt("", "rule reward 'module.path:function' or 'file.py:function', "
                      "called as f(prompt: str, response: str, **columns) -> float (the "
                      "row's other columns are passed by name when f takes them), or a "
                      "reward server 'http://HOST:PORT/PATH' (`rlhf-async serve-reward`); "
                      "sort_digits: replaces its built-in rule, on the texts of "
                      "sort_digits:rule")
    reward_batched: bool = opt(False, "call task.reward (a function) once per batch as "
                               "f(prompts: list, responses: list, **columns: list) -> "
                               "list[float] (TRL's convention)")
    reward_weight: float = opt(0.0, "with a reward model (sort_digits', or text's "
                               "reward_model.path): weight of the rule's score added to the "
                               "learned reward; 0 = the rule is only reported "
                               "(hidden_score)", ge=0.0)
    chat_template: bool = opt(True, "text: wrap each prompt in the tokenizer's chat template "
                              "(with the generation prompt)")
    max_prompt_tokens: int = opt(0, "text: longest prompt accepted (tokens, template "
                                 "included); 0 = the longest prompt in task.prompts; with "
                                 "task.agent or a verifiers task.env also the room for the "
                                 "prompt the agent renders (its system turn, examples)",
                                 ge=0)
    reward_timeout_s: float = opt(60.0, "longest one call of task.reward may take (s; a "
                                  "server: each try of one request); past it the run "
                                  "stops with an error", gt=0.0)
    reward_retries: int = opt(2, "task.reward server: tries after the first of a request "
                              "that cannot connect, times out or is answered 408, 429, "
                              "502, 503 or 504; then the run stops with an error", ge=0)
    reward_backoff_s: float = opt(0.5, "task.reward server: wait before the first retry "
                                  "(s), doubled before each next one", ge=0.0)
    reward_max_in_flight: int = opt(4, "task.reward server: requests one process has "
                                    "waiting for an answer at once, at most", ge=1)
    reward_request_rows: int = opt(64, "task.reward server: responses per request at most "
                                   "(a larger batch is split; 0 = one request per batch)",
                                   ge=0)
    env: str = opt("", "text: an environment for multi-turn episodes: an installed verifiers "
                   "environment 'verifiers:<taskset id>' (its tasks are the prompts, its "
                   "harness plays each episode through the policy's OpenAI-compatible "
                   "endpoint, its rubric is the reward; see task.verifiers), an OpenEnv "
                   "server 'openenv:<module:app or URL>', 'file.py:Class' or "
                   "'module.path:Class' (async reset(row) -> observation, async "
                   "step(action) -> (observation, reward, done)) or a built-in name "
                   "(calculator); its rewards are the episode's rule reward. calculator: "
                   "its own")
    agent: str = opt("", "text: an agent, 'file.py:run' or 'module.path:run': async "
                     "run(base_url, row) -> reward (a number, or a dict with 'reward'), "
                     "called once per episode with the row (its 'prompt' text, 'seed' and "
                     "columns); it talks to the policy through any OpenAI-compatible client "
                     "at base_url (/chat/completions with tools, /completions, /models), "
                     "at most task.max_turns calls; what the policy generated is trained "
                     "on. Not beside task.env. calculator: the agent plays the built-in "
                     "task's episodes (row {'prompt': '23*47', 'answer': ...}; the task's "
                     "chat format, calc results as tool turns)")
    agent_timeout_s: float = opt(300.0, "longest one agent episode (task.agent) may take "
                                 "(s); past it the episode is cancelled and counted "
                                 "(episodes/timeout), and the run goes on", gt=0.0)
    reasoning_gym: dict[str, Any] = opt({}, "text with task.prompts = "  # noqa: RUF009
                                        "'reasoning_gym:<dataset>': the dataset's config "
                                        "(e.g. {size = 500, seed = 1, ...its difficulty "
                                        "knobs}); held-out prompts come from seed + 1; "
                                        "system_prompt = one of reasoning-gym's by name "
                                        "(default, direct, ...)", adapter="prompts")
    verifiers: dict[str, Any] = opt({}, "text with task.env = "  # noqa: RUF009
                                    "'verifiers:<taskset id>': the rest of verifiers' [env] "
                                    "block (e.g. {taskset = {...its knobs}, agent = "
                                    "{timeout = {rollout = 60}}}; a role without a runtime "
                                    "runs in verifiers' subprocess runtime) and select = "
                                    "{limit = N, shuffle = true, ...}: which tasks are read",
                                    adapter="env")
    max_turns: int = opt(3, "policy turns per episode (with an environment)", ge=1)
    env_timeout_s: float = opt(30.0, "longest one environment reset/step may take (s); past "
                               "it the episode ends there", gt=0.0)
