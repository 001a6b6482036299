"""A prompt that repeats in a batch runs through the model once.

GRPO and RLOO sample a group of responses per prompt, so a batch holds each prompt
`group_size` times. A causal model's states over the prompt do not depend on what follows
it, so the prompt's forward can run once per distinct prompt and its keys and values be
shared by the group's rows (an index copy of the KV cache; under autograd that copy's
backward sums the rows' gradients into the one prompt pass). The numbers are the full
forward's, up to float rounding. With a chat template's ~40-token prompt and 24-token
responses in groups of 4, as in bench/README.md's SmolLM2 row, this removes ~half of the
training and scoring forward.

A second model call costs a fixed overhead (one more walk of the module tree, forward and
backward), so the saving has to outweigh it: for tiny models with 8-token prompts the full
forward is as fast or faster (measured in bench/README.md, "Shared prompts"). The rule
below shares when it saves at least `MIN_SAVED_MACS` multiply-adds per call on the model's
device kind: on CPU the break-even measured was ~1e9 (a 6-layer, 384-wide GPT-2, 112 fewer
tokens per call), so 4e9 keeps a margin; a GPU does ~100x the arithmetic in the same
dispatch time, so its bar is 100x higher (an estimate, not yet measured on one).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

MIN_SAVED_MACS = {"cpu": 4e9}
MIN_SAVED_MACS_ACCELERATOR = 4e11  # any other device kind (see the module)


class PromptGroups(NamedTuple):
    first: Tensor  # [U] long: one row of the batch for each distinct prompt
    inverse: Tensor  # [B] long: the distinct prompt (index into `first`) of each row


def macs_per_token(model: nn.Module) -> float:
    """Multiply-adds one token costs in the model's transformer layers (12 * layers *
    hidden^2: attention projections and a 4x MLP); 0 for a model without such a config."""
    inner = getattr(model, "module", model)  # a DeepSpeed engine's model
    config = getattr(inner, "config", None)
    if config is None:
        return 0.0
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    hidden = getattr(config, "hidden_size", 0) or 0
    layers = getattr(config, "num_hidden_layers", 0) or 0
    return 12.0 * layers * hidden * hidden


def prompt_groups(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor) -> PromptGroups | None:
    """The batch's distinct prompts, when running each once saves enough arithmetic to pay
    for the extra model call (see the module); else None: run every row in full."""
    B, P = prompt_ids.shape
    kind = prompt_ids.device.type
    bar = MIN_SAVED_MACS.get(kind, MIN_SAVED_MACS_ACCELERATOR)
    per_token = macs_per_token(model)
    if B < 2 or (B - 1) * P * per_token < bar:  # even one prompt for all rows would not pay
        return None
    distinct, inverse = torch.unique(torch.cat([prompt_ids, prompt_mask.long()], dim=1),
                                     dim=0, return_inverse=True)
    U = distinct.shape[0]
    if (B - U) * P * per_token < bar:
        return None
    rows = torch.arange(B, device=prompt_ids.device)
    first = torch.full((U,), B, dtype=torch.long, device=prompt_ids.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    return PromptGroups(first, inverse)
