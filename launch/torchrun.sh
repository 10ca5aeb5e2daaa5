#!/usr/bin/env bash
# Launch `embshard train` with torchrun: one process per GPU (or NPROC_PER_NODE CPU processes), one or more hosts.
#
#   launch/torchrun.sh CONFIG [key.sub=value ...]                        # one host
#   NNODES=2 NODE_RANK=0 RDZV_ENDPOINT=host0:29500 launch/torchrun.sh CONFIG   # on host0
#   NNODES=2 NODE_RANK=1 RDZV_ENDPOINT=host0:29500 launch/torchrun.sh CONFIG   # on host1
#
# Environment: NPROC_PER_NODE (default: the number of GPUs, or 2 without GPUs), NNODES (1), NODE_RANK (0),
# RDZV_ENDPOINT (host:port of the first host, multi-host only), RDZV_ID (job id shared by all hosts; default
# embshard), MAX_RESTARTS (0: how often torchrun restarts every worker after one fails; with
# checkpoint.resume_from=latest the job goes on from its newest complete checkpoint), TORCHRUN (default: the
# torchrun next to $PYTHON, i.e. of the active environment; else this repository's .venv (make install); else the
# one on PATH), DRY_RUN=1 (print the torchrun command instead of running it). See docs/launch.md and
# docs/checkpoints.md.
set -euo pipefail
# Restarted workers must not find the failed attempt's process-group addresses in torchrun's shared store (seen
# with torch 2.13: a restarted rank connects to a dead peer); a store of their own per attempt avoids it.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
MAX_RESTARTS=${MAX_RESTARTS:-0}
if [ $# -lt 1 ]; then
  echo "usage: $0 CONFIG [key.sub=value ...]" >&2
  exit 2
fi
PYTHON=${PYTHON:-python3}
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${TORCHRUN:-}" ]; then
  python_bin="$(command -v "$PYTHON" || true)"
  for candidate in ${python_bin:+"$(dirname "$python_bin")/torchrun"} "$REPO/.venv/bin/torchrun" "$(command -v torchrun || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ]; then
      TORCHRUN=$candidate
      break
    fi
  done
  if [ -z "${TORCHRUN:-}" ]; then
    echo "$0: torchrun not found: not next to $PYTHON, not in $REPO/.venv/bin, not on PATH. Run \`make install\`" \
      "and \`source .venv/bin/activate\` (or set TORCHRUN=/path/to/torchrun of the environment with embshard)" >&2
    exit 127
  fi
fi
run() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "$@"
  else
    exec "$@"
  fi
}
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  [ "$NPROC_PER_NODE" -gt 0 ] || NPROC_PER_NODE=2
fi
NNODES=${NNODES:-1}
if [ "$NNODES" = 1 ]; then
  run "$TORCHRUN" --standalone --nnodes=1 --nproc-per-node="$NPROC_PER_NODE" --max-restarts="$MAX_RESTARTS" \
    -m embshard.cli train "$@"
  exit 0
fi
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port of the first host for a multi-host run}"
run "$TORCHRUN" --nnodes="$NNODES" --node-rank="${NODE_RANK:-0}" --nproc-per-node="$NPROC_PER_NODE" \
  --max-restarts="$MAX_RESTARTS" --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-embshard}" \
  -m embshard.cli train "$@"
