"""Builds this example's data from SmolLM2's own samples, judged by a known rule.

    python examples/smollm2_rlhf/make_data.py [MODEL_DIR]  # runs/models/smollm2-135m-instruct

For each prompt of examples/text/prompts.jsonl the model samples SAMPLES responses; the
hidden rule (examples/text/reward.py: short, finished answers) scores them. Written here:
- demos.jsonl: one middling response per prompt ({"messages": [user, assistant]}): SFT
  demonstrations of ordinary quality, as human ones are, which leaves RL room to improve;
- pairs.jsonl: {"prompt", "chosen", "rejected"} for every two responses of a prompt whose
  rule scores differ by more than MARGIN: the reward model learns the rule from these only.
Because the truth is a rule, the run's `hidden_score` (task.reward, reported, not trained
on: task.reward_weight = 0) shows whether SFT -> RM -> PPO found it. The files are
committed; this script is how they were made (seeded: the same model gives the same files).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rlhf_async.config import load_config
from rlhf_async.modeling.generation import generate
from rlhf_async.modeling.rollout import PromptBatch
from rlhf_async.task import make_task, sampling_params
from rlhf_async.task.artefacts import load_sft
from rlhf_async.task.text import TextTask

HERE = Path(__file__).parent
CONFIG = HERE.parents[1] / "deploy" / "configs" / "smollm2_rlhf.toml"
SAMPLES, MARGIN, BATCH_PROMPTS = 6, 0.3, 8


def main(model_dir: str = "runs/models/smollm2-135m-instruct") -> None:
    torch.set_num_threads(2)
    cfg = load_config(CONFIG, [f"model.path={model_dir}", "generation.temperature=0.8",
                               "generation.max_new_tokens=32"])
    task = make_task(cfg)
    assert isinstance(task, TextTask) and task.rule is not None
    actor, params = load_sft(Path(model_dir)), sampling_params(cfg, task)
    demos, pairs = [], []
    for start in range(0, len(task.prompts), BATCH_PROMPTS):
        idx = list(range(start, min(start + BATCH_PROMPTS, len(task.prompts))))
        rows = [i for i in idx for _ in range(SAMPLES)]
        ids, mask = task.encode_prompts(rows)
        sample_ids = torch.arange(start * SAMPLES, start * SAMPLES + len(rows))
        out = generate(actor, PromptBatch(ids, mask, sample_ids, sample_ids // SAMPLES),
                       params, cfg.run.seed, 0, 0)
        texts = [task.response_text(r, m) for r, m in zip(out.response_ids,
                                                             out.response_mask, strict=True)]
        for k, i in enumerate(idx):
            prompt = str(task.prompts[i])
            got = texts[k * SAMPLES:(k + 1) * SAMPLES]
            scores = task.rule([prompt] * SAMPLES, got, [{}] * SAMPLES, [i] * SAMPLES)
            ranked = sorted(zip(scores, got, strict=True), key=lambda x: x[0])
            demos.append({"messages": [{"role": "user", "content": prompt},
                                       {"role": "assistant",
                                        "content": ranked[SAMPLES // 2 - 1][1]}]})
            pairs += [{"prompt": prompt, "chosen": hi, "rejected": lo}
                      for a, (s_lo, lo) in enumerate(ranked) for s_hi, hi in ranked[a + 1:]
                      if s_hi - s_lo > MARGIN and hi.strip() and lo.strip()]
        print(f"{idx[-1] + 1}/{len(task.prompts)} prompts, {len(pairs)} pairs", flush=True)
    (HERE / "demos.jsonl").write_text("".join(json.dumps(d) + "\n" for d in demos))
    (HERE / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))


if __name__ == "__main__":
    main(*sys.argv[1:])
