"""The built-in task (digit sorting) and its SFT / reward-model stages."""

from rlhf_async.task.sort_digits import EOS, PAD, VOCAB_SIZE, SortDigitsTask

__all__ = ["EOS", "PAD", "VOCAB_SIZE", "SortDigitsTask"]
