#!/usr/bin/env bash
# Runs on the GPU machine (the `device` tool), from the repository root, with the folder .device/
# carried: .device/tensorfold.xz (a release build made on the build machine) and
# .device/shared.tar.xz (the parts of ../shared the checks need). Writes logs to $OUT.
#
#   bash bench/device.sh verify            # bit-exactness of every fixture, CPU vs GPU
#   bash bench/device.sh synth-verify      # synthetic 0.8b/2b checkpoints, CPU vs GPU
#   bash bench/device.sh bench             # GPU decode/prefill figures
#   bash bench/device.sh iterate           # quick exactness checks + 2b decode, PDL on/off
#   bash bench/device.sh checkpoint        # exactness, 32k context, every bench, sanitizer
#   bash bench/device.sh verify-bench      # every fixture and synthetic 0.8b/2b, then 2b decode
#   bash bench/device.sh verify-all-bench  # every fixture and synthetic 0.8b/2b, then every bench
#   bash bench/device.sh nsys              # per-kernel device time inside the 2b decode graph (nsys)
#   bash bench/device.sh exact             # every exactness check and compute-sanitizer (final without bench)
#   bash bench/device.sh probe             # 2b decode with kernel families skipped (attribution)
#   bash bench/device.sh timeline          # per-kernel time inside the decode graph (TF_PROBE_TIMELINE)
#   SWEEP='A=1;A=2 B=3' bash bench/device.sh sweep   # 2b decode under each environment setting
#   SWEEP='BIN=base;X=0' bash bench/device.sh sweep   # ... and A/B against .device/base.xz
#   bash bench/device.sh all
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/tf
cd "$(dirname "$0")/.."
if [ ! -x /tmp/tf/tensorfold ]; then
  xz -dc .device/tensorfold.xz > /tmp/tf/tensorfold && chmod +x /tmp/tf/tensorfold
  [ -f .device/shared.tar.xz ] && tar -C /tmp/tf -xJf .device/shared.tar.xz
fi
TF=/tmp/tf/tensorfold
export TENSORFOLD_SHARED=/tmp/tf/shared TENSORFOLD_CACHE=/tmp/tf/cache
# Kernels compiled on the build machine (`TENSORFOLD_CACHE=DIR tensorfold kernels --check --cache
# --arch sm_90`, then `tar -C DIR -cJf .device/cache.tar.xz .`): a cubin is used only when its
# source, options, NVRTC version and architecture match, so a stale one is merely ignored.
if [ -f .device/cache.tar.xz ]; then mkdir -p /tmp/tf/cache && tar -C /tmp/tf/cache -xJf .device/cache.tar.xz; fi
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }

verify_fixtures() {
  $TF kernels --check --arch sm_90 2>&1 | head -1 | tee -a "$OUT/summary.txt"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/summary.txt"
  log "kernels --check"
  $TF kernels --check --arch sm_90 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
  for m in fixtures/tiny/mlx-q4 fixtures/tiny/hf fixtures/heads/mlx-q4 fixtures/vocab/mlx-q4; do
    for p in "" "--random-prompt 300"; do
      log "verify $m $p"
      $TF verify -m $TENSORFOLD_SHARED/$m --steps 200 $p 2>&1 | tail -4 | tee -a "$OUT/summary.txt"
    done
  done
  # 8-bit, group 32 and 128, and per-module mixed quantization (a one-token launch split by format).
  for m in tests/data/quant/*/; do
    log "verify $m (300-token prompt)"
    $TF verify -m $m --steps 200 --random-prompt 300 2>&1 | tail -4 | tee -a "$OUT/summary.txt"
  done
  log "verify demo model"
  $TF verify --steps 200 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
  log "run on the GPU"
  $TF run --device cuda -p "def fibonacci(n):" -n 64 --temp 0 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
}

ids() { python3 -c "import sys; n=int(sys.argv[1]); print(','.join(str((i*7919+13)%240000) for i in range(n)))" "$1"; }

synth_models() {
  mkdir -p /tmp/tf/models
  for p in ${PRESETS:-0.8b 2b 4b 9b}; do
    [ -d /tmp/tf/models/$p ] || $TF synth --preset qwen3.5-$p --tokenizer $TENSORFOLD_SHARED/tokenizers/qwen3.5/tokenizer.json /tmp/tf/models/$p 2>&1 | tail -1 | tee -a "$OUT/summary.txt"
  done
}

synth_verify() {
  synth_models
  for p in ${VERIFY_PRESETS:-0.8b 2b}; do
    log "verify synthetic $p (200 decode steps after a 300-token prompt)"
    $TF verify -m /tmp/tf/models/$p --steps 200 --random-prompt 300 2>&1 | tail -5 | tee -a "$OUT/summary.txt"
  done
}

long_context() {
  for m in fixtures/heads/mlx-q4; do
    log "verify $m at 32k context (32768-token prompt, 100 decode steps)"
    $TF verify -m $TENSORFOLD_SHARED/$m --steps 100 --random-prompt 32768 --chunk 1024 2>&1 | tail -4 | tee -a "$OUT/summary.txt"
  done
}

gpu_timing() {
  synth_models
  for p in ${PRESETS:-0.8b 2b 4b 9b}; do
    for ctx in 1 512 4096; do
      log "run $p: decode 256 tokens after a $ctx-token prompt"
      $TF run --device cuda -m /tmp/tf/models/$p --temp 0 -n 256 --prompt-ids $(ids $ctx) --print-ids 2>&1 >/dev/null | tail -1 | tee -a "$OUT/summary.txt"
    done
  done
}

gpu_bench() {
  synth_models
  mkdir -p "$OUT/bench"
  for p in ${PRESETS:-0.8b 2b 4b 9b}; do
    log "bench --device cuda $p"
    reps=2; [ "$p" = 2b ] && reps=3
    $TF bench --device cuda -m /tmp/tf/models/$p -p 512,4096 -c 0,512,4096 -n 128 -r $reps --json "$OUT/bench/$p.json" 2>&1 | grep -v "^  [a-z]" | grep -v "^- " | tee -a "$OUT/summary.txt"
  done
}

profile() {
  PRESETS="${PRESETS:-2b}" synth_models
  for p in ${PRESETS:-2b}; do
    log "bench --profile $p"
    $TF bench --device cuda -m /tmp/tf/models/$p -p 512 -c 512 -n 64 -r 2 --profile 2>&1 | grep -v "^  [a-z]" | grep -v "^- " | tee -a "$OUT/summary.txt"
  done
}

clocks() {
  PRESETS=2b synth_models
  log "SM clock while bench runs decode on 2b (sampled every 50 ms)"
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,utilization.gpu --format=csv,noheader -lms 50 > "$OUT/clocks.csv" &
  smi=$!
  $TF bench --device cuda -m /tmp/tf/models/2b -p 512 -c 0 -n 512 -r 2 2>&1 | grep -E "^tg|^pp" | tee -a "$OUT/summary.txt"
  kill $smi
  sort "$OUT/clocks.csv" | uniq -c | sort -rn | head -8 | tee -a "$OUT/summary.txt"
}

ncu_profile() {
  PRESETS=2b synth_models
  local secs="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats --section MemoryWorkloadAnalysis --section InstructionStats"
  # 2b after a 3-token prompt, eager: the prompt's LM head (the first one-row product, two rows
  # per warp), the first decode token's in_proj, gate/up, output and down projections, its
  # first GDN and attention kernels.
  # NCU_KERNELS: NAME:N items (the N+1-th launch of kernel NAME), space-separated.
  for k in ${NCU_KERNELS:-matmul_t1r2:0 matmul_t1r2:1 matmul_swiglu_t1:0 matmul_t1r1:0 matmul_t1r1:1 gdn_heads:18 attn_tiles:6}; do
    set -- ${k/:/ }
    log "ncu: $1 (launch $2 of the first decode token)"
    TENSORFOLD_CUDA_GRAPHS=0 ncu --clock-control none -k regex:"^$1\$" -s $2 -c 1 $secs \
      $TF run --device cuda -m /tmp/tf/models/2b --prompt-ids 1,2,3 -n 2 --temp 0 > "$OUT/ncu-$1-$2.txt" 2>&1
    grep -E "^  [a-z_]+ |Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|L1/TEX Cache Throughput|L2 Cache Throughput|Executed Instructions  |Issued Warp|Eligible Warps|Active Warps Per|Achieved Active|Warp Cycles Per Issued|Grid Size|Registers Per|Dynamic Shared|Block Limit|Executed Ipc A|stalled|Stall" "$OUT/ncu-$1-$2.txt" | head -40 | tee -a "$OUT/summary.txt"
  done
}

# Per-kernel device time inside the decode graph (nsys traces each graph node), and the gaps
# between consecutive kernels: what a token's 1.6 ms is made of.
nsys_trace() {
  PRESETS=2b synth_models
  local nsys; nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
  if [ -z "$nsys" ]; then log "nsys not found"; return; fi
  log "nsys: 2b, 3-token prompt, 64 greedy decode tokens through the graph"
  $nsys profile --cuda-graph-trace=node -t cuda -o /tmp/tf/trace --force-overwrite true \
    $TF run --device cuda -m /tmp/tf/models/${NSYS_MODEL:-2b} --prompt-ids 1,2,3 -n 64 --temp 0 > "$OUT/nsys-run.txt" 2>&1
  $nsys stats --report cuda_gpu_kern_sum --format csv -o "$OUT/nsys" /tmp/tf/trace.nsys-rep > /dev/null 2>&1
  $nsys stats --report cuda_gpu_trace --format csv -o "$OUT/nsys" /tmp/tf/trace.nsys-rep > /dev/null 2>&1
  xz -T0 "$OUT"/nsys_cuda_gpu_trace.csv 2>/dev/null
  ls -la "$OUT" | tee -a "$OUT/summary.txt"
}

quick_verify() {
  PRESETS="${PRESETS:-0.8b 2b}" synth_models
  # The quant variants (8-bit, groups 32/128, mixed) take the product kernels' other layouts.
  for m in $TENSORFOLD_SHARED/fixtures/tiny/mlx-q4 $TENSORFOLD_SHARED/fixtures/tiny/hf $TENSORFOLD_SHARED/fixtures/heads/mlx-q4 tests/data/quant/*/ /tmp/tf/models/0.8b /tmp/tf/models/2b; do
    log "verify $m (300-token prompt, 200 steps)"
    $TF verify -m $m --steps 200 --random-prompt 300 2>&1 | tail -4 | tee -a "$OUT/summary.txt"
  done
  log "verify demo"
  $TF verify --steps 200 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
}

# One call while optimising: the exactness checks of quick-verify, then 2b decode at three
# contexts, then the eager per-kernel profile.
iterate() {
  quick_verify
  PRESETS="${PRESETS:-0.8b 2b}" synth_models
  log "bench 2b"
  $TF bench --device cuda -m /tmp/tf/models/2b -p 512 -c 0,512,4096 -n 128 -r 3 2>&1 | grep -E "^(tg|pp)|kernels" | tee -a "$OUT/summary.txt"
  PRESETS=2b profile
}

iterate_bench() {
  PRESETS="${PRESETS:-0.8b 2b}" synth_models
  for pdl in 1 0; do
    log "bench 2b, TENSORFOLD_CUDA_PDL=$pdl"
    TENSORFOLD_CUDA_PDL=$pdl $TF bench --device cuda -m /tmp/tf/models/2b -p 512 -c 0,4096 -n 128 -r 3 2>&1 | grep -E "^(tg|pp)|kernels" | tee -a "$OUT/summary.txt"
  done
}

# The figures of a stopping point in one call: exactness (quick-verify, 32k context), every
# preset's bench, 2b without programmatic dependent launch, compute-sanitizer.
checkpoint() {
  quick_verify
  long_context
  gpu_bench
  log "bench 2b, TENSORFOLD_CUDA_PDL=0"
  TENSORFOLD_CUDA_PDL=0 $TF bench --device cuda -m /tmp/tf/models/2b -p 512 -c 0,4096 -n 128 -r 3 2>&1 | grep -E "^(tg|pp)|kernels" | tee -a "$OUT/summary.txt"
  sanitizer
}

sanitizer() {
  log "compute-sanitizer memcheck: a prompt chunk and decode steps on the demo model"
  compute-sanitizer --tool memcheck $TF run --device cuda -p "def fibonacci(n):" -n 4 --temp 0 2>&1 | tail -6 | tee -a "$OUT/summary.txt"
  log "compute-sanitizer racecheck"
  compute-sanitizer --tool racecheck $TF run --device cuda -p "def fibonacci(n):" -n 2 --temp 0 2>&1 | tail -4 | tee -a "$OUT/summary.txt"
}

# Which kernel families the 2b decode time goes to: the bench with each family compiled to
# return right after pdl_enter() (TF_PROBE_*, common.cuh; results wrong, timing only), and with
# the product's code-to-float subtraction removed; and the one-token products' speed of light:
# the same loads with the decode free (TF_PROBE_DECODE_FREE: one FMA per weight) or with one FMA
# per word of codes (TF_PROBE_LOADS_ONLY). Cubins for these defines can be carried in
# .device/cache.tar.xz (TENSORFOLD_CUDA_DEFINES=... tensorfold kernels --check --cache).
PROBES=("" "TF_PROBE_NO_FSUB" "TF_PROBE_DECODE_FREE" "TF_PROBE_LOADS_ONLY" "TF_PROBE_SKIP_GDN=1" "TF_PROBE_SKIP_NORM=1" "TF_PROBE_SKIP_ATTN=1" "TF_PROBE_SKIP_LMHEAD=1" "TF_PROBE_SKIP_T1=1"
        "TF_PROBE_SKIP_GDN=1 TF_PROBE_SKIP_NORM=1 TF_PROBE_SKIP_ATTN=1 TF_PROBE_SKIP_T1=1")
probe() {
  PRESETS=2b synth_models
  for d in "${PROBES[@]}"; do
    log "probe: TENSORFOLD_CUDA_DEFINES='$d'"
    TENSORFOLD_CUDA_DEFINES="$d" $TF bench --device cuda -m /tmp/tf/models/2b -p 16 -c 0,4096 -n 128 -r 3 2>&1 | grep -E "^(tg|pp)" | tee -a "$OUT/summary.txt"
  done
}

# Where a decode token's time goes, graph node by graph node: kernels built with
# TF_PROBE_TIMELINE record when block 0's wait on the previous kernel returned, the backend
# averages the gaps over the replayed tokens (backend/cuda/timeline.rs). Each model at context 0
# and 4096, plus the bench without the probe to show what the probe itself costs.
timeline() {
  local models=${TIMELINE_MODELS:-2b 9b}
  PRESETS="$models" synth_models
  for p in $models; do
    log "bench $p without the probe"
    $TF bench --device cuda -m /tmp/tf/models/$p -p 16 -c 0,4096 -n 128 -r 3 2>&1 | grep -E "^tg" | tee -a "$OUT/summary.txt"
    for c in 0 4096; do
      log "timeline $p @$c"
      TENSORFOLD_CUDA_DEFINES="TF_PROBE_TIMELINE=1" TENSORFOLD_TIMELINE="$OUT/timeline-$p-$c.txt" \
        $TF bench --device cuda -m /tmp/tf/models/$p -p 16 -c $c -n 256 -r 2 2>&1 | grep -E "^tg" | tee -a "$OUT/summary.txt"
      grep -A40 "by label" "$OUT/timeline-$p-$c.txt" | head -30 | tee -a "$OUT/summary.txt"
      head -1 "$OUT/timeline-$p-$c.txt" | tee -a "$OUT/summary.txt"
    done
  done
}

# Decode of SWEEP_MODELS (default 2b) under each setting of SWEEP (settings separated by ';', each
# a list of VAR=VALUE for the bench's environment), e.g. SWEEP='TENSORFOLD_CUDA_PREFETCH_MB=0;TENSORFOLD_CUDA_PREFETCH_MB=16'.
env_sweep() {
  local models=${SWEEP_MODELS:-2b}
  PRESETS="$models" synth_models
  IFS=';' read -ra settings <<< "${SWEEP:-}"
  # A/B of two builds in one call: with .device/base.xz carried (a second release binary), a
  # setting containing BIN=base runs that binary instead.
  if [ -f .device/base.xz ] && [ ! -x /tmp/tf/base ]; then xz -dc .device/base.xz > /tmp/tf/base && chmod +x /tmp/tf/base; fi
  for p in $models; do
    for e in "${settings[@]}"; do
      log "bench $p, $e"
      local bin=$TF
      case " $e " in *" BIN=base "*) bin=/tmp/tf/base; e=${e//BIN=base/} ;; esac
      env $e $bin bench --device cuda -m /tmp/tf/models/$p -p 16 -c ${SWEEP_CONTEXTS:-0,4096} -n 128 -r 3 2>&1 | grep -E "^tg" | tee -a "$OUT/summary.txt"
    done
  done
}

# The batched runtime: N requests together, each bit-identical to its solo CPU run, on every
# fixture and synthetic 2b; then aggregate decode, TTFT and inter-token latency at 1/8/32/64
# concurrent requests (128-token prompts, 128 generated) and batch-1 decode for comparison.
runtime_checks() {
  PRESETS=2b synth_models
  for m in ${RUNTIME_FIXTURES:-fixtures/tiny/mlx-q4 fixtures/heads/mlx-q4 fixtures/vocab/mlx-q4}; do
    log "verify --concurrency ${CONC:-64} $m"
    $TF verify -m $TENSORFOLD_SHARED/$m --device cuda --concurrency ${CONC:-64} --steps 32 2>&1 | tail -4 | tee -a "$OUT/summary.txt"
  done
  log "verify --concurrency ${CONC:-64} synthetic 2b (8 tokens each)"
  $TF verify -m /tmp/tf/models/2b --device cuda --concurrency ${CONC:-64} --steps 8 2>&1 | tail -4 | tee -a "$OUT/summary.txt"
  log "bench --concurrency 1,8,32,64 synthetic 2b"
  $TF bench -m /tmp/tf/models/2b --device cuda --concurrency ${LEVELS:-1,8,32,64} -p 128 -n 128 --json "$OUT/concurrency-2b.json" 2>&1 | tail -7 | tee -a "$OUT/summary.txt"
  log "bench batch-1 decode synthetic 2b (engine directly)"
  $TF bench -m /tmp/tf/models/2b --device cuda -p 128 -c 0 -n 128 -r 3 2>&1 | grep -E "tg|pp" | tail -3 | tee -a "$OUT/summary.txt"
}

case "${1:-all}" in
  verify) verify_fixtures ;;
  runtime) runtime_checks ;;
  synth-verify) synth_verify ;;
  long) long_context ;;
  timing) gpu_timing ;;
  sanitizer) sanitizer ;;
  bench) gpu_bench ;;
  profile) profile ;;
  ncu) ncu_profile ;;
  nsys) nsys_trace ;;
  clocks) clocks ;;
  quick-verify) quick_verify ;;
  iterate) iterate ;;
  probe) probe ;;
  sweep) env_sweep ;;
  timeline) timeline ;;
  checkpoint) checkpoint ;;
  verify-bench) verify_fixtures; PRESETS="0.8b 2b" synth_verify; iterate_bench ;;
  verify-all-bench) verify_fixtures; PRESETS="0.8b 2b" synth_verify; gpu_bench ;;
  all) verify_fixtures; synth_verify; long_context; gpu_timing; sanitizer ;;
  final) verify_fixtures; synth_verify; long_context; gpu_bench; sanitizer ;;
  exact) verify_fixtures; synth_verify; long_context; sanitizer ;;
  *) echo "unknown step $1"; exit 2 ;;
esac
