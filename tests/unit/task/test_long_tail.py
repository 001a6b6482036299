"""sort_digits with a long tail of prompt (and so answer) lengths: task.long_fraction."""

import random

import pytest

from rlhf_async.config import ConfigError, TaskConfig, load_config
from rlhf_async.modeling.determinism import key_seed
from rlhf_async.task.sort_digits import EOS, FIRST_DIGIT, SortDigitsTask

TAIL = TaskConfig(min_len=3, short_len=4, max_len=32, long_fraction=0.1)


def test_without_a_tail_the_prompts_are_the_uniform_draw_they_always_were():
    cfg = TaskConfig()
    got = SortDigitsTask(cfg).prompts(7, "train", 3, 50)
    # the draw before task.long_fraction existed: one randint per length, then the digits
    rng = random.Random(key_seed(7, "prompts", "train", 3))
    want = []
    while len(want) < 50:
        n = rng.randint(cfg.min_len, cfg.max_len)
        d = [rng.randrange(cfg.num_digits) for _ in range(n)]
        if key_seed(0, "heldout", *d) % 8 != 0:
            want.append(d)
    assert got == want


@pytest.mark.parametrize("purpose", ["train", "eval", "sft"])
def test_one_prompt_in_ten_is_long_and_up_to_eight_times_longer(purpose):
    task = SortDigitsTask(TAIL)
    lengths = [len(p) for s in range(40) for p in task.prompts(0, purpose, s, 100)]
    long = [n for n in lengths if n > 4]
    assert all(3 <= n <= 32 for n in lengths)
    assert 0.08 < len(long) / len(lengths) < 0.12  # 4,000 draws: ~0.1 +- 0.005
    assert max(long) == 32 and min(long) == 5
    assert {n for n in lengths if n <= 4} == {3, 4}
    # the tail is heavy: the longest 10% of answers hold ~a third of all answer tokens
    tokens = sorted((n + 1 for n in lengths), reverse=True)
    assert sum(tokens[: len(tokens) // 10]) / sum(tokens) > 0.3


def test_the_longest_answer_fits_the_task_widths_and_the_score_needs_all_of_it():
    task = SortDigitsTask(TAIL)
    prompt = next(p for s in range(10) for p in task.prompts(0, "train", s, 100) if len(p) > 20)
    ids, mask = task.encode_prompts([prompt])
    assert ids.shape[1] == 34 and int(mask.sum()) == len(prompt) + 2
    full = SortDigitsTask.answer_tokens(sorted(prompt))
    assert len(full) <= task.response_len == 33
    short = SortDigitsTask.answer_tokens(sorted(prompt)[:4])  # stopping at a short length
    shuffled = SortDigitsTask.answer_tokens(sorted(prompt)[::-1])
    score = SortDigitsTask.hidden_score_tokens
    assert score(prompt, full) == 1.0
    assert score(prompt, short) == pytest.approx(4 / len(prompt))
    assert score(prompt, shuffled) < score(prompt, full)
    r_ids, r_mask = task.encode_responses([full], task.response_len)
    assert float(task.hidden_scores(ids, r_ids, r_mask)[0]) == 1.0


def test_demonstrations_and_preference_pairs_cover_the_tail():
    task = SortDigitsTask(TAIL)
    prompts, demos = task.demonstrations(0, 0, 400)
    assert any(len(p) > 4 for p in prompts)
    for p, d in zip(prompts, demos, strict=True):
        assert d[-1] == EOS and sorted(t - FIRST_DIGIT for t in d[:-1]) == sorted(p)
    prompts, chosen, rejected = task.preference_pairs(0, "rm", 0, 400, noise=0.1)
    assert any(len(p) > 20 for p in prompts)
    assert all(len(c) <= task.response_len for c in chosen + rejected)


def test_bad_tail_settings_are_one_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"task\.short_len: 6 must lie in \[task\.min_len"):
        load_config(None, ["task.long_fraction=0.1", "task.short_len=6"])  # max_len 6
    with pytest.raises(ConfigError, match=r"task\.long_fraction: 1.5 is above the maximum 1.0"):
        load_config(None, ["task.long_fraction=1.5", "task.short_len=4"])
    with pytest.raises(ConfigError, match=r"task\.long_fraction: shapes the prompt lengths "
                                          r"of sort_digits only"):
        load_config(None, ["task.name=calculator", "task.long_fraction=0.1"])
    cfg = load_config(None, ["task.long_fraction=0.1", "task.short_len=4", "task.max_len=32",
                             "generation.max_new_tokens=33", "model.max_positions=80"])
    assert cfg.task.long_fraction == 0.1
