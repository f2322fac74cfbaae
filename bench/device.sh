#!/usr/bin/env bash
# Runs on the GPU machine (the `device` tool), from the repository root, with the folder .device/
# carried: .device/tensorfold.xz (a release build made on the build machine) and
# .device/shared.tar.xz (the parts of ../shared the checks need). Writes logs to $OUT.
#
#   bash bench/device.sh verify            # bit-exactness of every fixture, CPU vs GPU
#   bash bench/device.sh synth-verify      # synthetic 0.8b/2b checkpoints, CPU vs GPU
#   bash bench/device.sh bench             # GPU decode/prefill figures
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
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }

verify_fixtures() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/summary.txt"
  log "kernels --check"
  $TF kernels --check --arch sm_90 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
  for m in fixtures/tiny/mlx-q4 fixtures/tiny/hf fixtures/heads/mlx-q4 fixtures/vocab/mlx-q4; do
    for p in "" "--random-prompt 300"; do
      log "verify $m $p"
      $TF verify -m $TENSORFOLD_SHARED/$m --steps 200 $p 2>&1 | tail -4 | tee -a "$OUT/summary.txt"
    done
  done
  log "verify demo model"
  $TF verify --steps 200 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
  log "run on the GPU"
  $TF run --device cuda -p "def fibonacci(n):" -n 64 --temp 0 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
}

case "${1:-all}" in
  verify) verify_fixtures ;;
  all) verify_fixtures ;;
  *) echo "unknown step $1"; exit 2 ;;
esac
