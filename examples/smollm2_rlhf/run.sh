#!/usr/bin/env bash
# SFT -> reward model -> PPO on SmolLM2-135M-Instruct with this directory's data, on CPU.
# Run from the repository root after `rlhf-async prepare-smollm2` (see
# deploy/configs/smollm2_rlhf.toml). Extra arguments go to every stage, e.g.
# run.output_dir=/tmp/runs or placement.cpu_threads=2.
set -euo pipefail
cfg=deploy/configs/smollm2_rlhf.toml
out=$(python - "$@" <<'PY'
import sys
args = [a for a in sys.argv[1:] if a.startswith("run.output_dir=")]
print(args[-1].split("=", 1)[1] if args else "runs")
PY
)
rlhf-async sft "$cfg" run.name=smol-sft "$@"
rlhf-async rm "$cfg" run.name=smol-rm model.path="$out/smol-sft/model" "$@"
rlhf-async run "$cfg" run.name=smol-ppo model.path="$out/smol-sft/model" \
    reward_model.path="$out/smol-rm/model" "$@"
