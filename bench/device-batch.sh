#!/usr/bin/env bash
# Runs on the GPU machine (the `device` tool) the checks of batched decode on CUDA, in one call:
# kernels compile, the GPU test tests/cuda_batch.rs, `tensorfold verify` on the fixtures (CPU vs
# GPU bit for bit), then compute-sanitizer memcheck on the GPU test (fewer N). Everything it needs
# is in the carried folder $D (default .device-cuda): tensorfold.xz (release build), cuda_batch.xz
# (the test binary, `cargo test --release --no-run`), shared.tar.xz (the fixtures),
# cache.tar.xz (kernels compiled here: `TENSORFOLD_CACHE=DIR tensorfold kernels --check --cache
# --arch sm_90`; used only where the NVRTC version matches), quant.tar.xz (tests/data/quant),
# commit (the commit built). Writes $OUT/summary.txt and the logs.
#
#   bash .device-cuda/device-batch.sh            # all of it
#   bash .device-cuda/device-batch.sh test       # the GPU test only
set -uo pipefail
OUT=${OUT:-/tmp/out}
D=${D:-.device-cuda}
mkdir -p "$OUT" /tmp/tf /tmp/tf/cache
xz -dc $D/tensorfold.xz > /tmp/tf/tensorfold && chmod +x /tmp/tf/tensorfold
xz -dc $D/cuda_batch.xz > /tmp/tf/cuda_batch && chmod +x /tmp/tf/cuda_batch
tar -C /tmp/tf -xJf $D/shared.tar.xz
[ -f $D/cache.tar.xz ] && tar -C /tmp/tf/cache -xJf $D/cache.tar.xz
[ -f $D/quant.tar.xz ] && mkdir -p /tmp/tf/quant && tar -C /tmp/tf/quant -xJf $D/quant.tar.xz
TF=/tmp/tf/tensorfold
export TENSORFOLD_SHARED=/tmp/tf/shared TENSORFOLD_CACHE=/tmp/tf/cache
S=$OUT/summary.txt
log() { echo "== $*" | tee -a "$S"; }
t0=$(date +%s)
el() { echo "($(( $(date +%s) - t0 )) s)"; }

log "$(date -u +%FT%TZ) commit $(cat $D/commit 2>/dev/null)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$S"

gpu_test() {
  log "GPU test cuda_batch $(el)"
  ( time timeout ${TEST_TIMEOUT:-200} /tmp/tf/cuda_batch --test-threads 1 --nocapture ) > "$OUT/cuda_batch.log" 2>&1
  echo "exit $?" >> "$OUT/cuda_batch.log"
  grep -E "^test |test result|N = |panicked|skipped|^real|^exit" "$OUT/cuda_batch.log" | tee -a "$S"
}

kernels() {
  # Also fills the kernel cache every later process reads.
  log "kernels --check --cache $(el)"
  timeout 150 $TF kernels --check --cache --arch sm_90 > "$OUT/kernels.log" 2>&1
  echo "exit $?" >> "$OUT/kernels.log"
  head -1 "$OUT/kernels.log" | tee -a "$S"
  tail -2 "$OUT/kernels.log" | tee -a "$S"
}

verify() {
  for m in fixtures/tiny/mlx-q4 fixtures/tiny/hf fixtures/heads/mlx-q4; do
    for p in "" "--random-prompt 300"; do
      log "verify $m $p $(el)"
      timeout 40 $TF verify -m $TENSORFOLD_SHARED/$m --steps 200 $p 2>&1 | tail -4 | tee -a "$S"
    done
  done
  for m in /tmp/tf/quant/*/; do
    log "verify $m (300-token prompt) $(el)"
    timeout 40 $TF verify -m $m --steps 100 --random-prompt 300 2>&1 | tail -1 | tee -a "$S"
  done
}

memcheck() {
  log "compute-sanitizer memcheck: cuda_batch, tiny fixture, N = 2, 63, 65 (and the copy and sampling tests) $(el)"
  CUDA_BATCH_NS=2,63,65 CUDA_BATCH_FIXTURES=1 timeout ${MEMCHECK_TIMEOUT:-90} compute-sanitizer --tool memcheck --error-exitcode 9 /tmp/tf/cuda_batch --test-threads 1 > "$OUT/memcheck.log" 2>&1
  echo "exit $?" >> "$OUT/memcheck.log"
  grep -E "ERROR SUMMARY|test result|^exit|Device not supported|error" "$OUT/memcheck.log" | head -12 | tee -a "$S"
}

case "${1:-all}" in
  test) gpu_test ;;
  all) kernels; gpu_test; verify; memcheck ;;
  *) echo "unknown step $1"; exit 2 ;;
esac
log "done $(el)"
