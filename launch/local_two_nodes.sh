#!/usr/bin/env bash
# Simulate a two-node job on one machine: two DeepSpeed launchers in no-ssh mode (node ranks 0
# and 1, master 127.0.0.1) sharing one two-host hostfile, each starting NPROC_PER_NODE ranks.
# It runs the exact per-node command a real cluster runs (launch/multinode.sh), so a job that
# passes here exercises the multi-node rendezvous, global ranks and CROSS_RANK/CROSS_SIZE.
#
#   DS_ACCELERATOR=cpu launch/local_two_nodes.sh trainer.output_dir=/tmp/run deepspeed.zero_stage=2
#   DS_ACCELERATOR=cpu ENTRY=tests/workers/comm_worker.py launch/local_two_nodes.sh --expect-nodes 2
#
# Settings: NPROC_PER_NODE (default 1), MASTER_PORT (default: a free port), ENTRY (default
# "--module llama_train.train"), PYTHON / DEEPSPEED as in multinode.sh. Program arguments follow.
# The host names node0/node1 need not resolve: in no-ssh mode they only label hostfile lines.
# With GPUs (DS_ACCELERATOR unset or cuda), node k gets GPUs k*N..k*N+N-1 through --include,
# so the two simulated nodes never share a device. Exit status: 0 only if both nodes succeed.
set -euo pipefail
set -m  # each node gets its own process group, so a failure can take down the other node's tree

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
N="${NPROC_PER_NODE:-1}"
[[ "$N" =~ ^[1-9][0-9]*$ ]] || { echo "local_two_nodes.sh: NPROC_PER_NODE=$N must be a positive integer" >&2; exit 2; }
py="${PYTHON:-python3}"
# a free port below the kernel's range for outgoing connections (llama_train.proc.free_port);
# any free port where $py cannot import llama_train
port="${MASTER_PORT:-$("$py" -c 'from llama_train.proc import free_port; print(free_port())' 2>/dev/null \
  || "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"

hostfile="$(mktemp "${TMPDIR:-/tmp}/two_nodes_hostfile.XXXXXX")"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
  rm -f "$hostfile"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

include=""
if [[ "${DS_ACCELERATOR:-cuda}" != "cpu" ]] && command -v nvidia-smi >/dev/null 2>&1; then
  ngpu="$(nvidia-smi -L | grep -c '^GPU' || true)"
  [[ "$ngpu" -ge $((2 * N)) ]] || {
    echo "local_two_nodes.sh: need $((2 * N)) GPUs for 2 x NPROC_PER_NODE=$N, found $ngpu; lower NPROC_PER_NODE or set DS_ACCELERATOR=cpu" >&2
    exit 2; }
  slots=$((2 * N))
  include="--include node0:$(seq -s, 0 $((N - 1)))@node1:$(seq -s, "$N" $((2 * N - 1)))"
else
  slots="$N"
fi
printf 'node0 slots=%s\nnode1 slots=%s\n' "$slots" "$slots" > "$hostfile"

unset NUM_GPUS NO_SSH
for r in 0 1; do
  HOSTFILE="$hostfile" NODE_RANK="$r" MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
    DS_LAUNCHER_ARGS="${DS_LAUNCHER_ARGS:-} $include" "$here/multinode.sh" "$@" &
  pids+=("$!")
done

status=0
for _ in 0 1; do
  if ! wait -n; then  # first failure: stop the other node instead of letting it hang
    status=1
    for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
  fi
done
exit "$status"
