#!/usr/bin/env bash
# Multi-process (DDP) reconstruction on one machine: all ranks share ONE Hydra run folder.
#
#   scripts/launch_ddp.sh NPROC [overrides...]
#   scripts/launch_ddp.sh 8 experiment=flagship   # the flagship phantom (its recipe sets the phantom's size)
#   scripts/launch_ddp.sh 8 data=mrc data.path=tilts.mrc data.angles=tilts.rawtlt
#   scripts/launch_ddp.sh 2 resume=outputs/2026-01-01/10-00-00-ddp/checkpoints/last.pt optim.steps=4000
#
# Runs `torchrun --standalone --nproc-per-node=NPROC -m fasttomo.cli.reconstruct [overrides...]` (as
# `$PYTHON -m torch.distributed.run`, PYTHON defaults to python3, so the active environment's torch
# is used). Hydra would otherwise pick a time-stamped folder per rank; this script adds
# hydra.run.dir=outputs/<date>/<time>-ddp (relative to the current folder) unless the overrides
# already set hydra.run.dir. Only rank 0 writes into it, and says an error once; the script exits
# with the run's own exit code. NCCL on GPUs, gloo on CPUs (runtime=cpu).
# Multicast (NVLS / symmetric-memory multicast) stays off: our GPU host requires it; set the two
# variables below yourself only if you know your host supports multicast.
set -euo pipefail

usage() { echo "usage: $0 NPROC [hydra overrides...]   (NPROC: processes = GPUs to use)" >&2; exit 2; }
[[ $# -ge 1 ]] || usage
NPROC=$1; shift
[[ $NPROC =~ ^[1-9][0-9]*$ ]] || usage

export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1

has_dir=0
for arg in "$@"; do
  case "$arg" in hydra.run.dir=*|+hydra.run.dir=*|++hydra.run.dir=*) has_dir=1 ;; esac
done
if [[ $has_dir -eq 0 ]]; then
  set -- "$@" "hydra.run.dir=outputs/$(date +%Y-%m-%d/%H-%M-%S)-ddp"
fi

# rank 0 writes the run's exit code here (0, 2 for refused input, 3 diverged, ...): torchrun exits
# 1 whenever a rank fails, so the script exits with the run's own code
FASTTOMO_EXIT_FILE=$(mktemp "${TMPDIR:-/tmp}/fasttomo-exit.XXXXXX")
export FASTTOMO_EXIT_FILE
trap 'rm -f "$FASTTOMO_EXIT_FILE"' EXIT
rc=0
"${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node="$NPROC" \
  -m fasttomo.cli.reconstruct "$@" || rc=$?
if [[ -s $FASTTOMO_EXIT_FILE ]]; then
  rc=$(<"$FASTTOMO_EXIT_FILE")
  if [[ $rc != 0 && $rc != 1 ]]; then  # rank 0 said why in one line; torchrun then reports the exit code
    echo "launch_ddp.sh: the run ended with exit code $rc; its own message is the [ERROR] or [WARNING] line" \
         "above torchrun's report (ChildFailedError / SignalException), which only says that a rank exited" >&2
  fi
fi
exit "$rc"
