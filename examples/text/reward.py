"""A rule reward for examples/text/prompts.jsonl: short, finished answers.

Called once per sampled response as reward(prompt, response) -> float, where `response` is
the decoded text up to (not including) the end-of-turn token. Responses cut off by
generation.max_new_tokens rarely end with a full stop, so the bonus asks the model to
finish within the budget; the brevity term gives every group of samples a spread of
rewards, so GRPO has a signal from the first step.
"""

MAX_WORDS = 20


def reward(prompt: str, response: str) -> float:
    words = response.split()
    if not words:
        return 0.0
    brevity = max(0.0, 1.0 - len(words) / MAX_WORDS)  # 1 word -> 0.95, 20+ words -> 0
    finished = response.rstrip().endswith((".", "!", "?"))
    return brevity + (1.0 if finished else 0.0)
