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
# torchrun next to this Python, else the one on PATH). See docs/launch.md and docs/checkpoints.md.
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
if [ -z "${TORCHRUN:-}" ]; then
  TORCHRUN="$(dirname "$(command -v "$PYTHON")")/torchrun"
  [ -x "$TORCHRUN" ] || TORCHRUN=torchrun
fi
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  [ "$NPROC_PER_NODE" -gt 0 ] || NPROC_PER_NODE=2
fi
NNODES=${NNODES:-1}
if [ "$NNODES" = 1 ]; then
  exec "$TORCHRUN" --standalone --nnodes=1 --nproc-per-node="$NPROC_PER_NODE" --max-restarts="$MAX_RESTARTS" \
    -m embshard.cli train "$@"
fi
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port of the first host for a multi-host run}"
exec "$TORCHRUN" --nnodes="$NNODES" --node-rank="${NODE_RANK:-0}" --nproc-per-node="$NPROC_PER_NODE" \
  --max-restarts="$MAX_RESTARTS" --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-embshard}" \
  -m embshard.cli train "$@"
