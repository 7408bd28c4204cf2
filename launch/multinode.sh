#!/usr/bin/env bash
# Multi-node llama_train through the DeepSpeed launcher. Two modes:
#
#  ssh mode (default) -- run ONCE, on the first host of the hostfile. The launcher reaches every
#  host over passwordless ssh (pdsh) and starts its ranks there; the repo and the Python
#  environment must sit at the same path on every host (shared filesystem or the Docker image).
#      HOSTFILE=launch/hostfile launch/multinode.sh trainer.output_dir=/shared/run1 deepspeed.zero_stage=2
#
#  no-ssh mode -- run ONCE PER NODE (SLURM, Kubernetes, by hand); each node starts only its own
#  ranks. Chosen by setting NODE_RANK (or --no-ssh). All nodes need the same hostfile (it
#  defines the world: node order and ranks per node) and the same MASTER_ADDR/MASTER_PORT.
#      node 0:  NODE_RANK=0 MASTER_ADDR=10.0.0.1 launch/multinode.sh trainer.output_dir=/shared/run1
#      node 1:  NODE_RANK=1 MASTER_ADDR=10.0.0.1 launch/multinode.sh trainer.output_dir=/shared/run1
#
# Settings (environment variable, or the flag in brackets placed before the program arguments):
#   HOSTFILE     [--hostfile F]     DeepSpeed hostfile, one "host slots=N" line per node
#                                   (default: launch/hostfile next to this script)
#   NODE_RANK    [--node-rank R]    this node's index in the hostfile; selects no-ssh mode
#   MASTER_ADDR  [--master-addr A]  address of the hostfile's first host, reachable from all nodes
#                                   (required in no-ssh mode; ssh mode asks that host itself)
#   MASTER_PORT  [--master-port P]  TCP port for the rendezvous (default 29500)
#   NUM_GPUS     [--num-gpus N]     ranks per node, when fewer than the hostfile's slots
#   ENTRY        [--entry "..."]    the program (default "--module llama_train.train"; a script
#                                   path such as tests/workers/comm_worker.py also works)
#   DEEPSPEED                       launcher command (default: `deepspeed` next to $PYTHON, else on PATH)
#   PYTHON                          interpreter to find the launcher next to (default: python3)
#   DS_LAUNCHER_ARGS                extra launcher flags, e.g. "--ssh_port 2222" or "--launcher openmpi"
#   DRY_RUN=1                       print the launcher command instead of running it
# Everything else (after an optional "--") goes to the program: Hydra overrides for training.
#
# Variables the remote ranks need in ssh mode (WANDB_API_KEY, HF_HOME, ...) go into a
# ".deepspeed_env" file (KEY=VALUE lines) in $HOME or the launch directory; NCCL_* and PYTHON*
# variables are forwarded automatically. See docs/launch.md.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
HOSTFILE="${HOSTFILE:-$here/hostfile}"
MASTER_PORT="${MASTER_PORT:-29500}"
ENTRY="${ENTRY:---module llama_train.train}"
NO_SSH="${NO_SSH:-}"
[[ -n "${NODE_RANK:-}" ]] && NO_SSH=1

die() { echo "multinode.sh: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --hostfile)    HOSTFILE="$2"; shift 2 ;;
    --node-rank)   NODE_RANK="$2"; NO_SSH=1; shift 2 ;;
    --no-ssh)      NO_SSH=1; shift ;;
    --master-addr) MASTER_ADDR="$2"; shift 2 ;;
    --master-port) MASTER_PORT="$2"; shift 2 ;;
    --num-gpus)    NUM_GPUS="$2"; shift 2 ;;
    --entry)       ENTRY="$2"; shift 2 ;;
    --)            shift; break ;;
    *)             break ;;
  esac
done

[[ -f "$HOSTFILE" ]] || die "hostfile '$HOSTFILE' not found: set HOSTFILE=... or --hostfile (format: launch/hostfile.example)"
nnodes="$(grep -cE '^[^#[:space:]]+[[:space:]]+slots=[0-9]+' "$HOSTFILE" || true)"
[[ "$nnodes" -ge 1 ]] || die "hostfile '$HOSTFILE' has no 'host slots=N' lines"

if [[ -z "${DEEPSPEED:-}" ]]; then
  py="$(command -v "${PYTHON:-python3}" || true)"
  if [[ -n "$py" && -x "$(dirname "$py")/deepspeed" ]]; then DEEPSPEED="$(dirname "$py")/deepspeed"
  elif command -v deepspeed >/dev/null; then DEEPSPEED=deepspeed
  else die "no 'deepspeed' launcher found: activate the environment or set DEEPSPEED=/path/to/deepspeed"; fi
fi

launcher=("$DEEPSPEED" --hostfile "$HOSTFILE" --master_port "$MASTER_PORT")
if [[ -n "$NO_SSH" ]]; then
  [[ -n "${NODE_RANK:-}" ]] || die "no-ssh mode needs NODE_RANK (0..$((nnodes - 1))), this node's line in the hostfile"
  [[ "$NODE_RANK" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$nnodes" ]] \
    || die "NODE_RANK=$NODE_RANK is not in 0..$((nnodes - 1)) (the hostfile has $nnodes nodes)"
  [[ -n "${MASTER_ADDR:-}" ]] || die "no-ssh mode needs MASTER_ADDR, the address of the hostfile's first host"
  launcher+=(--no_ssh --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR")
else
  [[ -n "${MASTER_ADDR:-}" ]] && launcher+=(--master_addr "$MASTER_ADDR")
fi
[[ -n "${NUM_GPUS:-}" ]] && launcher+=(--num_gpus "$NUM_GPUS")
# shellcheck disable=SC2206  # word splitting of these two is intended
launcher+=(${DS_LAUNCHER_ARGS:-} $ENTRY)

cmd=("${launcher[@]}" "$@")
echo "+ ${cmd[*]}" >&2
[[ -n "${DRY_RUN:-}" ]] && exit 0
exec "${cmd[@]}"
