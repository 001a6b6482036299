#!/usr/bin/env bash
# The job's driver on the Ray head, for deploy/launch.sh and deploy/slurm/ray.sbatch:
# check the job first (`rlhf-async run --dry-run`, which also names its run directory),
# wait until the Ray cluster at RAY_ADDRESS has NODES nodes (`ray status`), check the
# cluster (`rlhf-async doctor`: placement, versions, shared directories, reachability),
# then run it with `placement.launcher=ray`, or continue RUN_DIR (`rlhf-async resume`).
#
#   deploy/ray/job.sh NODES CONFIG [key=value ...]     a new run
#   deploy/ray/job.sh NODES RUN_DIR                    continue RUN_DIR from its checkpoint
#
# Environment (defaults):
#   RAY_ADDRESS      the Ray head, HOST:PORT                  (required)
#   RLHF_PYTHON      python with rlhf-async[ray] installed    (python3)
#   RLHF_RAY         ray command                              (ray)
#   RLHF_RAY_WAIT_S  longest wait for the NODES nodes (s)     (300)
set -euo pipefail

usage() { echo "usage: $0 NODES CONFIG [key=value ...] | $0 NODES RUN_DIR" >&2; exit 2; }
[[ $# -ge 2 && $1 =~ ^[0-9]+$ ]] || usage
NODES=$1; CONFIG=$2; shift 2
: "${RAY_ADDRESS:?job.sh: set RAY_ADDRESS to the Ray head (HOST:PORT)}"
PY=${RLHF_PYTHON:-python3}
RAY=${RLHF_RAY:-ray}
WAIT_S=${RLHF_RAY_WAIT_S:-300}

if [[ -f $CONFIG/config.json ]]; then  # a run directory: it continues with its own config
    [[ $# -eq 0 ]] || { echo "job.sh: $CONFIG continues with its config.json; no key=value" >&2; exit 2; }
    RUN_DIR=$(realpath "$CONFIG")
    JOB=("$PY" -m rlhf_async resume "$RUN_DIR")
    DOCTOR=("$PY" -m rlhf_async doctor "$RUN_DIR")
else
    [[ $CONFIG == *=* || -r $CONFIG ]] || { echo "job.sh: cannot read config $CONFIG" >&2; exit 2; }
    # ray.address=auto: the cluster RAY_ADDRESS names, so that the run's config.json does
    # not pin one head and a resume on another cluster finds its own
    ARGS=("$CONFIG" "$@" placement.launcher=ray ray.address=auto)
    # every check the run makes, before the cluster is used; the run directory it names
    # (a timestamp when run.name is unset) is pinned, so that a resume can find it
    RUN_DIR=$("$PY" -m rlhf_async run "${ARGS[@]}" --dry-run | sed -n 's/^run directory: //p')
    [[ -n $RUN_DIR ]] || { echo "job.sh: the dry run named no run directory" >&2; exit 1; }
    RUN_DIR=$(realpath -m "$RUN_DIR")
    JOB=("$PY" -m rlhf_async run "${ARGS[@]}" "run.name=${RUN_DIR##*/}")
    DOCTOR=("$PY" -m rlhf_async doctor "${ARGS[@]}")
fi

for ((waited = 0; ; waited += 5)); do
    # one ` 1 node_<id>` line per live node under "Active:"
    up=$("$RAY" status --address="$RAY_ADDRESS" 2>/dev/null | grep -c '^ *1 node_' || true)
    [[ $up -lt $NODES ]] || break
    if [[ $waited -ge $WAIT_S ]]; then
        echo "job.sh: $up of $NODES Ray nodes up after $waited s; see" \
             "\`ray status --address=$RAY_ADDRESS\` and each host's /tmp/ray/session_latest/logs" >&2
        exit 1
    fi
    sleep 5
done
echo "job.sh: $up Ray nodes up at $RAY_ADDRESS; run directory $RUN_DIR"
"${DOCTOR[@]}" || { echo "job.sh: the Ray cluster is not ready for the job (above)" >&2; exit 1; }

rc=0
"${JOB[@]}" || rc=$?
if [[ $rc -ne 0 && -f $RUN_DIR/config.json ]]; then
    echo "job.sh: the job stopped (exit $rc); continue it from its newest checkpoint with the" \
         "same launch, $RUN_DIR in place of CONFIG" >&2
fi
exit $rc
