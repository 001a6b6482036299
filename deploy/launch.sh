#!/usr/bin/env bash
# Multi-host run on bare metal: start `rlhf-async agent` on every host over ssh, check
# them with `rlhf-async doctor`, run the job's coordinator here, stop the agents at the end.
#
#   deploy/launch.sh HOSTS CONFIG [key=value ...]
#
# HOSTS: hosts file, one `name address[:port] devices` per line (see rlhf_async/runtime/hosts.py);
# `name` is the ssh destination. Run this on the host whose address is RLHF_ADDRESS
# (default: the first host's). The keys directory and run.cache_dir/run.output_dir must be
# on a filesystem every host sees at the same path.
#
# Environment (defaults):
#   RLHF_PYTHON   python with rlhf-async installed, on every host   (python3)
#   RLHF_KEYS     CURVE keys directory (`rlhf-async keys DIR`)      (./keys, made if absent)
#   RLHF_WORK     agents work in RLHF_WORK/NAME (node logs, pid)    (/tmp/rlhf-async-agent)
#   RLHF_SSH      ssh command                                       (ssh -o BatchMode=yes)
#   RLHF_ADDRESS  this host's address as the others reach it        (first host's address)
set -euo pipefail

usage() { echo "usage: $0 HOSTS CONFIG [key=value ...]" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
HOSTS=$1; CONFIG=$2; shift 2
[[ -r $HOSTS ]] || { echo "launch.sh: cannot read hosts file $HOSTS" >&2; exit 2; }
[[ $CONFIG == *=* || -r $CONFIG ]] || { echo "launch.sh: cannot read config $CONFIG" >&2; exit 2; }
PY=${RLHF_PYTHON:-python3}
KEYS=$(realpath -m "${RLHF_KEYS:-keys}")
WORK=${RLHF_WORK:-/tmp/rlhf-async-agent}
read -r -a SSH <<< "${RLHF_SSH:-ssh -o BatchMode=yes}"
HOSTS=$(realpath "$HOSTS")

# name address port, one line per host (comments and blank lines dropped)
mapfile -t ROWS < <(sed -e 's/#.*//' "$HOSTS" | awk 'NF == 3 {
    n = split($2, a, ":"); port = (n > 1) ? a[n] : 7100; addr = a[1]
    print $1, addr, port }')
[[ ${#ROWS[@]} -gt 0 ]] || { echo "launch.sh: no hosts in $HOSTS" >&2; exit 2; }
ADDRESS=${RLHF_ADDRESS:-$(awk '{print $2}' <<< "${ROWS[0]}")}

[[ -d $KEYS ]] || "$PY" -m rlhf_async keys "$KEYS"

stop_agents() {
    for row in "${ROWS[@]}"; do
        read -r name _ _ <<< "$row"
        "${SSH[@]}" "$name" "kill \$(cat $WORK/$name/agent.pid) 2>/dev/null; true" || true
    done
}
trap stop_agents EXIT

for row in "${ROWS[@]}"; do
    read -r name addr port <<< "$row"
    echo "launch.sh: starting the agent on $name (tcp://$addr:$port)"
    dir=$WORK/$name
    "${SSH[@]}" "$name" "mkdir -p $dir || exit 1; cd $dir; nohup $PY -m rlhf_async agent \
        --bind tcp://$addr:$port --keys $KEYS --work-dir $dir >> $dir/agent.log 2>&1 \
        < /dev/null & echo \$! > $dir/agent.pid"
done

for try in $(seq 1 30); do
    if "$PY" -m rlhf_async doctor "$HOSTS" --keys "$KEYS" > /tmp/rlhf-doctor.$$ 2>&1; then
        cat /tmp/rlhf-doctor.$$; break
    fi
    [[ $try -lt 30 ]] || { cat /tmp/rlhf-doctor.$$ >&2; echo "launch.sh: hosts not ready" >&2; exit 1; }
    sleep 2
done
rm -f /tmp/rlhf-doctor.$$

ARGS=("$CONFIG" "$@")
echo "launch.sh: coordinator on $ADDRESS"
"$PY" -m rlhf_async.cli.multihost --hosts "$HOSTS" --keys "$KEYS" --address "$ADDRESS" "${ARGS[@]}"
