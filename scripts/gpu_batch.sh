#!/usr/bin/env bash
# gpu_batch: the GPU measurements still owed (benchmarks/README.md, docs/kernels.md), as one job
# that outlives a 10-minute command: start it, then poll it until it ends.
#
#   FASTTOMO_COMMIT=<hash> bash scripts/gpu_batch.sh start [STEP ...]  # in the background; returns
#   bash scripts/gpu_batch.sh poll SECONDS   # wait for the end (or SECONDS), copy the folder to $OUT
#   FASTTOMO_COMMIT=<hash> bash scripts/gpu_batch.sh run [STEP ...]    # in the foreground
#
# Steps, in this order unless named: kernels (bench_kernels, flagship: the bf16-plane rows among
# them), step (bench_step, flagship and small128, triton bf16 and fp32, fp32 planes then
# precision.planes=bf16), run (bench_default_run --repeat 2 --profile: empty and warm Triton
# cache, then one more warm run under cProfile), camera (bench_scale camera2k, field-default,
# the kernels loaded from the cache: its step time), quality (bench_quality, fp32 planes against
# bf16 planes on three specimens), suite (the GPU-marked tests, recorded as
# gpu_tests-all-gpu-marked-<device>-<commit>.json), imports (bench_import_overlap: import torch
# in a thread beside the config's composition, against one after the other). Named only: camera16 (camera2k as camera does,
# and again with precision.planes=bf16: the bf16 planes at camera scale, time and quality), runpyc
# (run's measurement with one primed Python bytecode cache for every process: bench_default_run
# --bytecode cached), smem (probe_smem_scatter: a plane-gradient scatter through shared memory,
# compiled by NVRTC, against global atomics; probe_smem_backward: a coarse scale's whole backward
# that way against the Triton texel runs, at scales 50 and 100), camerastep (bench_step camera2k,
# bf16 and fp32, with its kernels profiled), fusedmlp (probe_fused_mlp at camera2k's shape with the
# backward's sweep), knockout (probe_bwd_knockout: the texel-run backward's knockouts and candidates),
# knockcam (the same at the camera2k step's shape, with launch settings for its 8 channels), knockrows
# (at that shape the shipped rows per scale against 8 and 16 rows everywhere), camerabf16
# (bench_step camera2k, bf16 only, unprofiled: a quick A/B with base-camerabf16), fusionab (the camera2k
# bf16 step with kernels.step_fusion off and on, the second profiled, and the fusions' GPU tests),
# decoder (the fused decoder's GPU tests: tests/kernels/test_kernels_gpu.py, test_compile_ahead.py
# and tests/train/test_cuda_graph.py), decoderab (kernels.gpu_decoder cublas against fused, both named: the
# camera2k step, the fused one profiled, and bench_quality on three specimens), ncu (Nsight Compute's
# counters of the interpolation's forward and texel-run backward at the camera2k and flagship shapes,
# ncu-<case>-<kernel>.csv), flagstep (bench_step flagship, bf16 and fp32), cameraprof (bench_step
# camera2k, bf16, its kernels profiled), camerapatch (camera2k as camera does, with pixels, 2 x 2 and
# 4 x 4 patches: sampler.patch_size's locality at camera scale, time and quality), knockregs (the
# texel-run backward at camera2k's shape with rows and register caps for more warps an SM, and at
# the flagship's, shipped only), kernelgpu (tests/kernels/test_kernels_gpu.py, recorded as
# gpu_tests-kernels-<device>-<commit>.json), planetv (bench_plane_tv: the plane TV's kernels at
# the camera2k and flagship layouts, and GPU_BATCH_BASE's beside them when it is set), mlpstages
# (probe_fused_mlp's backward at 32 and 64 points a block, 4 and 8 programs an SM, with 1-4
# software-pipeline stages beside Triton's default), flagprof (bench_step flagship, bf16 and fp32, its
# kernels profiled: where the fp32 step's time goes), flagcublas (bench_step flagship, bf16, its decoder
# on cuBLAS: the A side of the fused decoder after cuBLAS's first product), decodertests (the
# decoder's GPU tests, recorded as gpu_tests-decoder-kernels-<device>-<commit>.json), decoderwide
# (bench_quality's field-best, experiment=quality: 192 features, the fused decoder after cuBLAS's
# first product, against the same recipe with its decoder on cuBLAS, on three specimens), fwdregs
# (probe_bwd_knockout --fwd-maxnreg: the interpolation's forward under register caps, for more warps
# an SM, at the flagship and camera2k shapes), fwdfloor (probe_bwd_knockout --floor: the forward without
# its feature store, the gathers' own time, beside the shipped forward and backward, fp32 and bf16
# planes, at both shapes), planes16 (bench_step camera2k and flagship, bf16, with
# precision.planes=bf16: the A side is camerabf16 and flagstep in the same job), parity (bench_step
# flagship, 200 steps of the torch twin, triton fp32 and triton bf16 at runtime.seed 0, 1 and 2: the
# mean loss of the last 50 steps of each, against the seeds' spread), parityfused (the same, triton
# fp32 and bf16 only).
#
# An A/B against another commit in the same job, on the same machine: GPU_BATCH_BASE names a folder
# holding that commit's tree (git archive <commit> | tar -x -C <folder>, carried along) and
# GPU_BATCH_BASE_COMMIT its hash; a step named base-STEP runs STEP there (its records under base/,
# marked with that commit), e.g. `start camerastep base-camerastep`.
#
# Everything goes to $GPU_BATCH_DIR (default /root/gpu_batch): the records, a log per step and
# batch.log, one line per step ("STEP name rc=N Ss") and "DONE" at the end. Where the tree has no
# .git (a copy on a lent machine) FASTTOMO_COMMIT names the commit the records carry. Where a .whl
# folder is present (hydra-core, omegaconf, antlr4, mrcfile wheels for an image without them) they
# are installed into /tmp/site first.
set -uo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$SELF")/.."
DIR=${GPU_BATCH_DIR:-/root/gpu_batch}
mode=${1:-run}
[ $# -gt 0 ] && shift

case $mode in
  poll)
    limit=${1:-540}
    waited=0
    while [ $waited -lt "$limit" ] && ! grep -qx DONE "$DIR/batch.log" 2>/dev/null; do
      sleep 10
      waited=$((waited + 10))
    done
    cat "$DIR/batch.log" 2>/dev/null
    if [ -n "${OUT:-}" ] && [ -d "$DIR" ]; then
      if [ "$(find "$DIR" -type f | wc -l)" -le 8 ]; then
        cp -r "$DIR/." "$OUT/"
      else  # a lent machine sends back 8 files at most: the log, the records in one archive, the rest in another
        cp "$DIR/batch.log" "$OUT/" 2>/dev/null
        (cd "$DIR" && find . -type f -name '*.json' | tar -czf "$OUT/records.tgz" -T -)
        (cd "$DIR" && find . -type f ! -name '*.json' ! -path ./batch.log | tar -czf "$OUT/logs.tgz" -T -)
        ls -l "$OUT/records.tgz" "$OUT/logs.tgz"
      fi
    fi
    exit 0 ;;
  start)
    mkdir -p "$DIR"
    [ -f "$DIR/batch.log" ] && mv "$DIR/batch.log" "$DIR/batch-$(date +%s).log"  # poll waits for this one
    setsid nohup bash "$SELF" run "$@" > "$DIR/launch.log" 2>&1 < /dev/null &
    echo "started: $DIR/batch.log"
    exit 0 ;;
  run) ;;
  *) echo "gpu_batch: unknown mode '$mode' (start, poll or run)" >&2; exit 2 ;;
esac

mkdir -p "$DIR"
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_batch: installing the wheels in .whl failed" >> "$DIR/batch.log"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}  # absolute: the benches run children elsewhere
fi
if [ -z "${FASTTOMO_COMMIT:-}" ] && ! git rev-parse --short HEAD > /dev/null 2>&1; then
  echo "gpu_batch: no .git here; set FASTTOMO_COMMIT to the commit this tree is" >> "$DIR/batch.log"
  exit 2
fi
export OUT=$DIR  # the bench scripts copy their records here

step() {  # step NAME COMMAND...: run it, log it, one line in batch.log
  local name=$1 t0=$SECONDS rc
  shift
  "$@" > "$DIR/$name.log" 2>&1
  rc=$?
  echo "STEP $name rc=$rc $((SECONDS - t0))s" >> "$DIR/batch.log"
}

suite() {  # suite [NAME CASE PATH...]: GPU-marked tests (default: all, as "suite") and their record
  local name=${1:-suite} case=${2:-all-gpu-marked} t0=$SECONDS rc
  [ $# -gt 2 ] && shift 2 || set -- tests
  python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts='' "$@" > "$DIR/$name.log" 2>&1
  rc=$?
  python3 - "$DIR/$name.log" "$((SECONDS - t0))" "$rc" "$name" "$case" "$*" <<'EOF'
import json, re, sys
sys.path.insert(0, "scripts")
import torch
from benchlib import commit, device_name, write_result
log, seconds, rc, name, case, paths = open(sys.argv[1]).read(), float(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7]
counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", log.splitlines()[-1] if log else "")}
device = device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
write_result("gpu_tests", case, device,
             [{"variant": f"{'all' if paths == 'tests' else paths} -m gpu ({commit()})", "passed": counts.get("passed", 0),
               "failed": counts.get("failed", 0), "skipped": counts.get("skipped", 0),
               "errors": counts.get("error", 0) + counts.get("errors", 0), "pytest_rc": rc, "seconds": seconds}],
             command=f"python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts='' {paths}",
             note=f"scripts/gpu_batch.sh {name}", out_dir=__import__("pathlib").Path(sys.argv[1]).parent)
EOF
  echo "STEP $name rc=$rc $((SECONDS - t0))s" >> "$DIR/batch.log"
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(kernels step run camera quality suite imports)
echo "BEGIN $(date -u +%FT%TZ) commit=${FASTTOMO_COMMIT:-$(git rev-parse --short HEAD)} steps=${steps[*]}" >> "$DIR/batch.log"
base() {  # base STEP: STEP in the tree of GPU_BATCH_BASE (another commit), records under $DIR/base
  if [ -z "${GPU_BATCH_BASE:-}" ] || [ -z "${GPU_BATCH_BASE_COMMIT:-}" ] || [ ! -f "$GPU_BATCH_BASE/scripts/gpu_batch.sh" ]; then
    echo "STEP base-$1 needs GPU_BATCH_BASE (a tree of another commit) and GPU_BATCH_BASE_COMMIT" >> "$DIR/batch.log"
    return
  fi
  local seen rc
  seen=$(cat "$DIR/base/batch.log" 2>/dev/null | wc -l)
  (cd "$GPU_BATCH_BASE" && GPU_BATCH_DIR="$DIR/base" FASTTOMO_COMMIT="$GPU_BATCH_BASE_COMMIT" \
     PYTHONPATH="$PWD/src:$PYTHONPATH" bash scripts/gpu_batch.sh run "$1")
  rc=$?
  # every STEP line this run added (a step may write several), or why there is none
  tail -n +$((seen + 1)) "$DIR/base/batch.log" 2>/dev/null | grep '^STEP' | sed 's/^STEP /STEP base-/' >> "$DIR/batch.log" \
    || echo "STEP base-$1 rc=$rc (no step line: see base/batch.log)" >> "$DIR/batch.log"
}

for s in "${steps[@]}"; do
  case $s in
    base-*) base "${s#base-}" ;;
    kernels) step kernels python3 scripts/bench_kernels.py --case flagship ;;
    step)
      for case in flagship small128; do
        step "step-$case-fp32planes" python3 scripts/bench_step.py --case "$case" \
          --variants triton-bf16 triton-fp32 --label fp32planes
        step "step-$case-bf16planes" python3 scripts/bench_step.py --case "$case" \
          --variants triton-bf16 triton-fp32 --extra precision.planes=bf16 --label bf16planes
      done ;;
    run) step default-run python3 scripts/bench_default_run.py --repeat 2 --profile --out-dir "$DIR" ;;
    runpyc) step default-run-pyc python3 scripts/bench_default_run.py --repeat 2 --bytecode cached --profile \
              --out-dir "$DIR" ;;
    camera) step camera python3 scripts/bench_scale.py --cases camera2k --methods field-default --warmup \
              --out-dir "$DIR" ;;
    camera16) step camera16 python3 scripts/bench_scale.py --cases camera2k --methods field-default --warmup \
                --variant planes16="precision.planes=bf16" --out-dir "$DIR" ;;
    quality) step quality python3 scripts/bench_quality.py --cases clean128 cell128_d20 catalyst128_d200 \
               --methods field-default --variant planes16="precision.planes=bf16" --out-dir "$DIR" ;;
    suite) suite ;;
    imports) step imports python3 scripts/bench_import_overlap.py --repeat 5 --out-dir "$DIR" ;;
    smem)
      step smem-scatter python3 scripts/probe_smem_scatter.py --out-dir "$DIR"
      step smem-backward-50 python3 scripts/probe_smem_backward.py --scale 50 --chunk 4 --out-dir "$DIR"
      step smem-backward-100 python3 scripts/probe_smem_backward.py --scale 100 --chunk 1 --out-dir "$DIR" ;;
    camerastep) step camerastep python3 scripts/bench_step.py --case camera2k --variants triton-bf16 triton-fp32 \
                  --profile 3 ;;
    fusedmlp) step fused-mlp python3 scripts/probe_fused_mlp.py --case camera2k --sweep --out-dir "$DIR" ;;
    knockout) step knockout python3 scripts/probe_bwd_knockout.py --out-dir "$DIR" ;;
    camerabf16) step camerabf16 python3 scripts/bench_step.py --case camera2k --variants triton-bf16 ;;
    knockcam) step knockcam python3 scripts/probe_bwd_knockout.py --case camera2k --repeat 10 \
                --variants shipped stores no_run_flushes no_pick one_tap unroll2_nocap rows16 rows32 rows32_w2 \
                rows16_len32 len32 --fwd-block-n 64 128 --out-dir "$DIR" ;;
    decoder) step decoder python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts='' \
               tests/kernels/test_kernels_gpu.py tests/kernels/test_compile_ahead.py tests/train/test_cuda_graph.py ;;
    decoderab)
      step step-camera2k-cublas python3 scripts/bench_step.py --case camera2k --variants triton-bf16 \
        --extra kernels.gpu_decoder=cublas --label cublas
      step step-camera2k-fused python3 scripts/bench_step.py --case camera2k --variants triton-bf16 --profile 3 \
        --extra kernels.gpu_decoder=fused --label fused
      step quality-decoder python3 scripts/bench_quality.py --cases clean128 cell128_d20 catalyst128_d200 \
        --methods field-default --variant cublas=kernels.gpu_decoder=cublas --variant fused=kernels.gpu_decoder=fused \
        --out-dir "$DIR" ;;
    knockrows) step knockrows python3 scripts/probe_bwd_knockout.py --case camera2k --repeat 10 \
                 --variants shipped rows8 rows16 rows16_nocap unroll2_nocap --out-dir "$DIR" ;;
    fusionab)
      step step-camera2k-fusion-off python3 scripts/bench_step.py --case camera2k --variants triton-bf16 \
        --extra kernels.step_fusion=false --label fusionoff
      step step-camera2k-fusion-on python3 scripts/bench_step.py --case camera2k --variants triton-bf16 --profile 3 \
        --extra kernels.step_fusion=true --label fusionon
      step fusion-tests python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts='' \
        tests/kernels/test_kernels_gpu.py -k "ray or kplanes_tv" ;;
    ncu)  # hardware counters of the interpolation's kernels at both shapes (Nsight Compute, clocks as found)
      ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)
      for case in camera2k flagship; do
        for kern in bwd_runs fwd; do
          step "ncu-$case-$kern" "$ncu_bin" --clock-control none -k "regex:kplanes_${kern}_kernel" --launch-count 3 \
            --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
            --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis \
            --metrics "lts__t_sectors_op_red.sum,lts__t_requests_op_red.sum,l1tex__t_requests_pipe_lsu_mem_global_op_red.sum,dram__bytes.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
            --csv --page details --log-file "$DIR/ncu-$case-$kern.csv" \
            python3 scripts/probe_bwd_knockout.py --case "$case" --repeat 1 --variants shipped --fwd-block-n 32
        done
      done ;;
    camerapatch) step camerapatch python3 scripts/bench_scale.py --cases camera2k --methods field-default --warmup \
                   --variant patch2="sampler.patch_size=2" --variant patch4="sampler.patch_size=4" --out-dir "$DIR" ;;
    knockregs)
      step knockregs python3 scripts/probe_bwd_knockout.py --case camera2k --repeat 10 \
        --variants shipped rows8 rows16 rows8_r128 rows4_r96 --out-dir "$DIR"
      step knockflag python3 scripts/probe_bwd_knockout.py --case flagship --repeat 10 --variants shipped \
        --out-dir "$DIR" ;;
    kernelgpu) suite kernelgpu kernels tests/kernels/test_kernels_gpu.py ;;
    mlpstages) step mlpstages python3 scripts/probe_fused_mlp.py --sweep --sweep-blocks 32 64 --sweep-warps 4 \
      --sweep-programs 4 8 --sweep-stages 1 2 3 4 --out-dir "$DIR" ;;
    planetv) step planetv python3 scripts/bench_plane_tv.py --out-dir "$DIR" --shapes 16x512 8x512 16x256 \
      ${GPU_BATCH_BASE:+--base-src "$GPU_BATCH_BASE/src" --base-commit "${GPU_BATCH_BASE_COMMIT:-base}"} ;;
    flagstep) step flagstep python3 scripts/bench_step.py --case flagship --variants triton-bf16 triton-fp32 ;;
    cameraprof) step cameraprof python3 scripts/bench_step.py --case camera2k --variants triton-bf16 --profile 3 ;;
    flagcublas) step flagcublas python3 scripts/bench_step.py --case flagship --variants triton-bf16 \
      --extra kernels.gpu_decoder=cublas --label cublas ;;
    decoderwide) step quality-decoder-wide python3 scripts/bench_quality.py --cases clean128 cell128_d20 catalyst128_d200 \
      --methods field-best --variant best-cublas="experiment=quality kernels.gpu_decoder=cublas" --jobs 3 \
      --out-dir "$DIR" ;;
    fwdregs)
      step fwdregs-flagship python3 scripts/probe_bwd_knockout.py --case flagship --variants shipped --repeat 10 \
        --fwd-maxnreg 32 40 48 --out-dir "$DIR"
      step fwdregs-camera2k python3 scripts/probe_bwd_knockout.py --case camera2k --variants shipped --repeat 10 \
        --fwd-maxnreg 24 40 --out-dir "$DIR" ;;
    decodertests) suite decodertests decoder-kernels -k decoder tests/kernels/test_kernels_gpu.py ;;
    flagprof) step flagprof python3 scripts/bench_step.py --case flagship --variants triton-bf16 triton-fp32 --profile 3 \
      --label prof ;;
    fwdfloor)
      step fwdfloor-flagship python3 scripts/probe_bwd_knockout.py --case flagship --variants shipped --repeat 10 \
        --floor --out-dir "$DIR"
      step fwdfloor-camera2k python3 scripts/probe_bwd_knockout.py --case camera2k --variants shipped --repeat 10 \
        --floor --out-dir "$DIR" ;;
    planes16)
      step planes16-camera2k python3 scripts/bench_step.py --case camera2k --variants triton-bf16 \
        --extra precision.planes=bf16 --label planes16
      step planes16-flagship python3 scripts/bench_step.py --case flagship --variants triton-bf16 \
        --extra precision.planes=bf16 --label planes16 ;;
    parity)
      for seed in 0 1 2; do
        step parity-seed$seed python3 scripts/bench_step.py --case flagship --variants torch-fp32-eager \
          triton-fp32 triton-bf16 --steps 195 --warmup 5 --phase-steps 0 --loss-tail 50 \
          --extra runtime.seed=$seed --label parity-seed$seed
      done ;;
    parityfused)
      for seed in 0 1 2; do
        step parityfused-seed$seed python3 scripts/bench_step.py --case flagship --variants triton-fp32 triton-bf16 \
          --steps 195 --warmup 5 --phase-steps 0 --loss-tail 50 --extra runtime.seed=$seed \
          --label parityfused-seed$seed
      done ;;
    *) echo "STEP $s unknown (kernels, step, run, runpyc, camera, camera16, quality, suite, imports, smem," \
         "camerastep, fusedmlp, knockout, knockcam, knockrows, camerabf16, decoder, decoderab, fusionab, ncu, flagstep, cameraprof, camerapatch, knockregs, kernelgpu, planetv, mlpstages, flagprof, flagcublas, decodertests, decoderwide, fwdregs, fwdfloor, planes16, parity, parityfused; base-STEP)" >> "$DIR/batch.log" ;;
  esac
done
echo DONE >> "$DIR/batch.log"
