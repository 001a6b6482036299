import pytest
import torch

from rlhf_async.config import TaskConfig
from rlhf_async.task.sort_digits import EOS, FIRST_DIGIT, PAD, SortDigitsTask


def toks(digits, eos=True):
    return [FIRST_DIGIT + d for d in digits] + ([EOS] if eos else [])


@pytest.mark.parametrize("prompt, resp, eos, want", [
    ([3, 1, 2], [1, 2, 3], True, 1.0),
    ([3, 1, 2], [3, 2, 1], True, 0.0),
    ([3, 1, 2], [1, 3, 2], True, 0.5),
    ([3, 1, 2], [1, 2, 9], True, 2 / 3),  # one digit wrong: content 2/3, sorted
    ([3, 1, 2], [1, 2], True, 2 / 3),  # one digit missing
    ([3, 1, 2], [1, 2, 3, 4], True, 0.75),  # one extra digit
    ([3, 1, 2], [1, 2, 3], False, 0.0),  # no EOS
    ([5, 5, 1], [1, 5, 5], True, 1.0),  # duplicates, non-decreasing counts as sorted
])
def test_hidden_score_hand_values(prompt, resp, eos, want):
    assert SortDigitsTask.hidden_score_tokens(prompt, toks(resp, eos)) == pytest.approx(want)


def test_prompts_are_keyed_and_heldout_disjoint():
    task = SortDigitsTask(TaskConfig())
    a = task.prompts(0, "train", 5, 64)
    assert a == task.prompts(0, "train", 5, 64) and a != task.prompts(0, "train", 6, 64)
    train = {tuple(p) for s in range(20) for p in task.prompts(0, "train", s, 64)}
    heldout = {tuple(p) for p in task.prompts(0, "eval", 0, 512)}
    assert not train & heldout
    assert all(3 <= len(p) <= 6 for p in heldout)


def test_encoding_and_prompt_batch():
    task = SortDigitsTask(TaskConfig())
    ids, mask = task.encode_prompts([[1, 2, 3], [4, 5, 6, 7, 8, 9]])
    assert ids.shape == (2, 8) and ids[0, :3].tolist() == [PAD] * 3
    assert mask.sum(1).tolist() == [5, 8]
    assert task.decode_prompt(ids[0]) == [1, 2, 3]
    r, rm = task.encode_responses([toks([1, 2])], 7)
    assert r[0].tolist() == [5, 6, EOS, 0, 0, 0, 0] and rm[0].tolist() == [1, 1, 1, 0, 0, 0, 0]
    pb = task.prompt_batch(0, "train", 2, 3, 4)
    assert len(pb) == 12 and pb.sample_ids.tolist() == list(range(24, 36))
    assert pb.group_ids.tolist() == [6] * 4 + [7] * 4 + [8] * 4
    assert torch.equal(pb.prompt_ids[0], pb.prompt_ids[3])
    h = task.hidden_scores(*task.encode_prompts([[3, 1, 2]])[:1], *task.encode_responses(
        [toks([1, 2, 3])], 7))
    assert h.tolist() == [1.0]


def test_preference_labels_follow_hidden_score():
    task = SortDigitsTask(TaskConfig())
    prompts, ch, rj = task.preference_pairs(0, "rm", 0, 400, noise=0.05)
    h = [(task.hidden_score_tokens(p, c), task.hidden_score_tokens(p, r))
         for p, c, r in zip(prompts, ch, rj, strict=False)]
    decided = [(a, b) for a, b in h if abs(a - b) > 0.2]
    assert sum(a > b for a, b in decided) / len(decided) > 0.95
    _, demos = task.demonstrations(0, 0, 50)
    assert all(d[-1] == EOS for d in demos)


def test_cache_keys_follow_the_config_that_shapes_each_stage():
    from rlhf_async.config import load_config
    from rlhf_async.task.artefacts import stage_key

    base = load_config(None, [])
    rm_changed = load_config(None, ["reward_model.steps=7"])
    sft_changed = load_config(None, ["sft.lr=0.1"])
    rl_changed = load_config(None, ["train.lr=0.1", "algo.name=grpo"])
    assert stage_key(base, "sft") == stage_key(rm_changed, "sft") == stage_key(rl_changed, "sft")
    assert stage_key(base, "rm") != stage_key(rm_changed, "rm")
    assert stage_key(base, "sft") != stage_key(sft_changed, "sft")
    assert stage_key(base, "rm") != stage_key(sft_changed, "rm")
    assert stage_key(base, "rm") == stage_key(rl_changed, "rm")


def test_an_agent_or_environment_run_reuses_the_sft_and_reward_model():
    from rlhf_async.config import load_config
    from rlhf_async.task.artefacts import stage_key

    calc = ["task.name=calculator"]
    base = load_config(None, calc)
    agent = load_config(None, [*calc, "task.agent=examples/calculator_agent/builtin.py:run",
                               "task.agent_timeout_s=9", "task.max_turns=2"])
    assert stage_key(base, "sft") == stage_key(agent, "sft")
    wider = load_config(None, [*calc, "generation.max_episode_tokens=40"])
    assert stage_key(base, "sft") != stage_key(wider, "sft")  # demonstrations cut to width
    digits = load_config(None, [])
    for rl_only in (["task.env_timeout_s=5"], ["task.reward_weight=0.5"],
                    ["task.reward_retries=5"]):
        assert stage_key(digits, "sft") == stage_key(load_config(None, rl_only), "sft")
        assert stage_key(digits, "rm") == stage_key(load_config(None, rl_only), "rm")
    rule = load_config(None, ["task.reward=tests/unit/task/rewards.py:length"])
    assert stage_key(digits, "sft") == stage_key(rule, "sft")
    assert stage_key(digits, "rm") != stage_key(rule, "rm")  # the rule labels its pairs
    longer = load_config(None, ["task.max_len=7"])
    assert stage_key(digits, "sft") != stage_key(longer, "sft")
    assert stage_key(base, "sft") != stage_key(digits, "sft")


def test_preference_pairs_cover_what_a_drifting_policy_says():
    """The reward model sees empty and one-digit answers (hidden score 0) beside the rest:
    one that never saw them scored an empty answer highest, and PPO on seed 5 learned to
    answer nothing (final hidden score 0.47 after a peak of 0.61)."""
    task = SortDigitsTask(TaskConfig())
    _, chosen, rejected = task.preference_pairs(5, "rm", 0, 2000, 0.05)
    lengths = [r.index(EOS) if EOS in r else -1 for r in chosen + rejected]
    short = sum(n in (0, 1) for n in lengths) / len(lengths)
    assert 0.03 < short < 0.10, short
    assert 0.03 < lengths.count(-1) / len(lengths) < 0.12  # no EOS: runs on
    # a short answer loses to a full one far more often than not
    wins = [len(c) > len(r) for c, r in zip(chosen, rejected, strict=True)
            if min(c.index(EOS) if EOS in c else 9, r.index(EOS) if EOS in r else 9) <= 1
            and EOS in c and EOS in r]
    assert sum(wins) / len(wins) > 0.8


def test_the_digits_tasks_samples_are_its_texts():
    from rlhf_async.modeling.rollout import POLICY, RolloutBatch
    from rlhf_async.task.samples import sample_rows
    from rlhf_async.task.sort_digits import TOKEN_CHARS, SortDigitsTask

    task = SortDigitsTask.__new__(SortDigitsTask)  # only eos_id and decode are read
    one = torch.ones(1, dtype=torch.long)
    b = RolloutBatch(torch.tensor([[5, 4, 7]]), torch.tensor([[0, 1, 1]]),
                     torch.tensor([[4, 7, 3]]), torch.full((1, 3), POLICY), torch.zeros(1, 3),
                     one, one, rewards=torch.ones(1))
    row = sample_rows(b, None, task, 1)[0]
    assert TOKEN_CHARS[4] + TOKEN_CHARS[7] == "03"
    assert (row["prompt"], row["response"]) == ("03", "03")  # up to EOS ($), as the rule reads
