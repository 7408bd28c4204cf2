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
[[ -r "$HOSTFILE" ]] || die "hostfile '$HOSTFILE' cannot be read: fix its permissions"

# Every line of the hostfile is checked here, before anything starts: DeepSpeed's own parser
# takes "slots=0" and "slots=8x" (the digits it finds), and its refusals of the rest come as a
# traceback once the launch began. One line per bad hostfile line: its number, what is wrong,
# the fix. Format: "<host> slots=<N>" per node (N >= 1, each host once); blank lines and
# "#" comments (a whole line, or after an entry) are fine.
hostfile_error() {  # LINE_NO "TEXT" "WHAT IS WRONG AND THE FIX"
  echo "multinode.sh: error: hostfile '$HOSTFILE' line $1: '$2': $3" >&2
  bad=$((bad + 1))
}
bad=0; nnodes=0; min_slots=0; hosts=(); host_lines=(); host_texts=()
declare -A seen_at=()
lineno=0
while IFS= read -r raw || [[ -n "$raw" ]]; do
  lineno=$((lineno + 1))
  line="${raw%$'\r'}"                              # a file written on Windows
  line="${line#"${line%%[![:space:]]*}"}"; line="${line%"${line##*[![:space:]]}"}"
  [[ -z "$line" || "$line" == \#* ]] && continue
  if [[ "$line" =~ ^([^[:space:]#=]+)[[:space:]]+slots=([^[:space:]#]*)[[:space:]]*(#.*)?$ ]]; then
    host="${BASH_REMATCH[1]}"; slots="${BASH_REMATCH[2]}"
    if ! [[ "$slots" =~ ^[0-9]{1,6}$ ]] || (( 10#$slots < 1 )); then
      hostfile_error "$lineno" "$line" "slots=$slots is not a positive whole number: give the ranks to start on $host (usually its GPU count), e.g. '$host slots=8'"
    elif [[ -n "${seen_at[$host]:-}" ]]; then
      hostfile_error "$lineno" "$line" "host $host is already on line ${seen_at[$host]}: each host once (DeepSpeed refuses duplicates); remove one line, or put all its ranks in one slots=N"
    else
      seen_at[$host]=$lineno; hosts+=("$host"); host_lines+=("$lineno"); host_texts+=("$line")
      nnodes=$((nnodes + 1))
      (( min_slots == 0 || 10#$slots < min_slots )) && min_slots=$((10#$slots))
    fi
  elif [[ "$line" =~ ^slots= ]]; then
    hostfile_error "$lineno" "$line" "no host name before slots=: write '<host> ${line%%[[:space:]#]*}'"
  elif [[ "$line" =~ ^([^[:space:]#]+)[[:space:]]*slots[[:space:]]*=[[:space:]]*([^[:space:]#]+)[[:space:]]*(#.*)?$ ]]; then
    hostfile_error "$lineno" "$line" "write '${BASH_REMATCH[1]} slots=${BASH_REMATCH[2]}': the host, a space, then slots=N with no spaces around '='"
  elif [[ "$line" =~ ^([^[:space:]#:=]+):([0-9]+)$ ]]; then
    hostfile_error "$lineno" "$line" "host:N is MPI's format; DeepSpeed's is '${BASH_REMATCH[1]} slots=${BASH_REMATCH[2]}'"
  elif [[ "$line" =~ ^[^[:space:]#=]+$ ]]; then
    hostfile_error "$lineno" "$line" "no slots=N: write '$line slots=<ranks on it, usually its GPU count>'"
  else
    hostfile_error "$lineno" "$line" "not '<host> slots=<N>' (one node per line; '#' starts a comment): see launch/hostfile.example"
  fi
done < "$HOSTFILE"
(( bad == 0 )) || exit 2
[[ "$nnodes" -ge 1 ]] || die "hostfile '$HOSTFILE' has no '<host> slots=<N>' line (only blank lines or comments): add one per node (launch/hostfile.example)"

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
if [[ -n "${NUM_GPUS:-}" ]]; then
  [[ "$NUM_GPUS" =~ ^[0-9]{1,6}$ ]] && (( 10#$NUM_GPUS >= 1 && 10#$NUM_GPUS <= min_slots )) \
    || die "NUM_GPUS=$NUM_GPUS must be a whole number from 1 to $min_slots (the fewest slots of a host in '$HOSTFILE')"
  launcher+=(--num_gpus "$NUM_GPUS")
fi
[[ "$MASTER_PORT" =~ ^[0-9]{1,5}$ ]] && (( 10#$MASTER_PORT >= 1 && 10#$MASTER_PORT <= 65535 )) \
  || die "MASTER_PORT=$MASTER_PORT is not a TCP port (1-65535): set MASTER_PORT or --master-port"

# ssh mode reaches every host by its name (through ~/.ssh/config, then the resolver): a name
# this machine cannot resolve fails here, naming its line, instead of in pdsh after the start.
# No-ssh mode uses the names as labels only; a dry run only prints the command.
if [[ -z "$NO_SSH" && -z "${DRY_RUN:-}" ]] && command -v getent >/dev/null; then
  for i in "${!hosts[@]}"; do
    host="${hosts[$i]}"; name="${host#*@}"
    if command -v ssh >/dev/null; then
      via="$(ssh -G "$host" 2>/dev/null | awk '$1 == "hostname" { print $2; exit }')" || true
      [[ -n "$via" ]] && name="$via"
    fi
    getent ahosts "$name" >/dev/null 2>&1 || hostfile_error "${host_lines[$i]}" "${host_texts[$i]}" \
      "host $name does not resolve on $(hostname) (getent ahosts $name): ssh mode reaches each host by name; fix the name, add it to /etc/hosts or ~/.ssh/config, or launch in no-ssh mode (NODE_RANK=...), where names are labels only"
  done
  (( bad == 0 )) || exit 2
fi
# shellcheck disable=SC2206  # word splitting of these two is intended
launcher+=(${DS_LAUNCHER_ARGS:-} $ENTRY)

cmd=("${launcher[@]}" "$@")
echo "+ ${cmd[*]}" >&2
[[ -n "${DRY_RUN:-}" ]] && exit 0
exec "${cmd[@]}"
