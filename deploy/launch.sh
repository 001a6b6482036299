#!/usr/bin/env bash
# Multi-host run on a Ray cluster made for it over ssh: `ray start --head` here (the first
# host of HOSTS), `ray start --address=HEAD:PORT` on the others, the job's driver here
# (deploy/ray/job.sh: `rlhf-async run CONFIG placement.launcher=ray`), `ray stop` on every
# host at the end.
#
#   deploy/launch.sh HOSTS CONFIG [key=value ...]    a new run
#   deploy/launch.sh HOSTS RUN_DIR                    continue RUN_DIR after a failure
#
# HOSTS: one `name [address]` a line (deploy/examples/hosts.txt); `name` is the ssh
# destination, `address` (default: name) the one the other hosts reach it at. Ray finds
# each host's CPUs and GPUs (RLHF_RAY_ARGS to say otherwise). Run this on the first host, from a directory every host sees at the
# same path (checked), as run.output_dir and run.cache_dir must be: the nodes read the
# SFT/RM artefacts and the CURVE keys the job makes in RUN_DIR/keys there.
#
# Environment (defaults):
#   RLHF_PYTHON     python with rlhf-async[ray] installed, on every host   (python3)
#   RLHF_RAY        ray command, on every host                              (ray)
#   RLHF_RAY_PORT   the head's port                                         (6379)
#   RLHF_RAY_ARGS   more `ray start` arguments, e.g. "--num-gpus=8"         ()
#   RLHF_RAY_TOKEN  Ray's auth token file, copied to every host              (~/.ray/auth_token, made if absent)
#   RLHF_SSH        ssh command                                             (ssh -o BatchMode=yes)
set -euo pipefail

usage() { echo "usage: $0 HOSTS CONFIG [key=value ...] | $0 HOSTS RUN_DIR" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
HOSTS=$1; shift
[[ -r $HOSTS ]] || { echo "launch.sh: cannot read hosts file $HOSTS" >&2; exit 2; }
RAY=${RLHF_RAY:-ray}
PORT=${RLHF_RAY_PORT:-6379}
TOKEN=${RLHF_RAY_TOKEN:-$HOME/.ray/auth_token}
read -r -a SSH <<< "${RLHF_SSH:-ssh -o BatchMode=yes}"
HERE=$(dirname "$(realpath "$0")")

# name address, one line per host (comments and blank lines dropped)
mapfile -t ROWS < <(sed -e 's/#.*//' "$HOSTS" | awk 'NF >= 1 {
    addr = (NF > 1) ? $2 : $1; sub(/:[0-9]+$/, "", addr); print $1, addr }')
[[ ${#ROWS[@]} -gt 0 ]] || { echo "launch.sh: no hosts in $HOSTS" >&2; exit 2; }
read -r _ HEAD <<< "${ROWS[0]}"
export RAY_ADDRESS=$HEAD:$PORT RAY_AUTH_MODE=token  # for job.sh and every ray command here
if timeout 5 bash -c "exec 3<> /dev/tcp/$HEAD/$PORT" 2> /dev/null; then
    echo "launch.sh: something already listens on $RAY_ADDRESS; stop it or set RLHF_RAY_PORT" >&2
    exit 1
fi

# Ray's token: every Ray process of the cluster presents it (RAY_AUTH_MODE=token)
if [[ ! -s $TOKEN ]]; then
    [[ -z ${RLHF_RAY_TOKEN:-} ]] || { echo "launch.sh: cannot read RLHF_RAY_TOKEN $TOKEN" >&2; exit 2; }
    "$RAY" get-auth-token --generate > /dev/null  # writes ~/.ray/auth_token
fi
export RAY_AUTH_TOKEN_PATH=$TOKEN
MARK=$PWD/.rlhf-async-shared.$$
touch "$MARK"
QDIR=$(printf %q "$PWD")

stop_ray() {
    rm -f "$MARK"
    for row in "${ROWS[@]:1}"; do
        read -r name _ <<< "$row"
        "${SSH[@]}" "$name" "$RAY stop" > /dev/null 2>&1 || true
    done
    "$RAY" stop > /dev/null 2>&1 || true
}
trap stop_ray EXIT

echo "launch.sh: Ray head on $HEAD:$PORT"
# shellcheck disable=SC2086  # RLHF_RAY_ARGS is split on purpose
"$RAY" start --head --port="$PORT" --node-ip-address="$HEAD" --disable-usage-stats \
    ${RLHF_RAY_ARGS:-} > /dev/null
for row in "${ROWS[@]:1}"; do
    read -r name addr <<< "$row"
    "${SSH[@]}" "$name" "test -e $(printf %q "$MARK")" || {
        echo "launch.sh: $name does not see $PWD (no shared filesystem there)" >&2; exit 1; }
    echo "launch.sh: Ray worker on $name ($addr)"
    # the token over ssh's stdin (never on a command line), 0600 on the host
    "${SSH[@]}" "$name" "umask 077; mkdir -p ~/.ray && cat > ~/.ray/rlhf-async-token" < "$TOKEN"
    "${SSH[@]}" "$name" "cd $QDIR && RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=~/.ray/rlhf-async-token \
        $RAY start --address=$HEAD:$PORT --node-ip-address=$addr --disable-usage-stats \
        ${RLHF_RAY_ARGS:-} > /dev/null"
done

"$HERE/ray/job.sh" "${#ROWS[@]}" "$@"
