#!/usr/bin/env bash
# Runs on the GPU machine (the `device` tool), from the repository root: the load test of
# `tensorfold serve --device cuda` on synthetic Qwen3.5-2b (bench/load.sh): `tensorfold bench
# --concurrency 1,8,32,64` and the same measurement through HTTP+SSE, $REPS times in turn, the
# bar at 64 streams (decode tokens/s through the server >= 90% of the bench, TTFT within 10%),
# then guidellm at 1/8/32/64 concurrent streaming requests. Carried:
#   .device/tensorfold.xz      a release build (`xz -T0 -c target/release/tensorfold`)
#   .device/shared.tar.xz      with shared/tokenizers/qwen3.5/tokenizer.json in it (as bench/device.sh uses)
#   .device/cache.tar.xz       optional: kernels compiled ahead (`tensorfold kernels --check --cache --arch sm_90`)
#   .whl/                      the wheels bench/serve-wheels.sh downloads (guidellm and what the image lacks)
# Writes $OUT/summary.txt, bar.txt, guidellm-table.txt, guidellm.json and load.tar.xz (every file
# bench/load.sh wrote: the bench and serve_bar JSON of each rep, the server logs, guidellm's
# console output), since at most 8 files come back.
#
#   bash bench/device-serve.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
WHL=${WHL:-.whl}
cd "$(dirname "$0")/.."
mkdir -p "$OUT" /tmp/tf/cache /tmp/tf/models
S=$OUT/summary.txt
log() { echo "== $*" | tee -a "$S"; }
xz -dc .device/tensorfold.xz > /tmp/tf/tensorfold && chmod +x /tmp/tf/tensorfold || { log "no .device/tensorfold.xz"; exit 2; }
tar -C /tmp/tf -xJf .device/shared.tar.xz || { log "no .device/shared.tar.xz"; exit 2; }
[ -f .device/cache.tar.xz ] && tar -C /tmp/tf/cache -xJf .device/cache.tar.xz
export TENSORFOLD_SHARED=/tmp/tf/shared TENSORFOLD_CACHE=/tmp/tf/cache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl > "$OUT/pip.log" 2>&1 || { log "wheel install failed"; tail -5 "$OUT/pip.log" | tee -a "$S"; exit 2; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import guidellm, pydantic, datasets, transformers, torch; print('guidellm', guidellm.__version__ if hasattr(guidellm, '__version__') else '?', 'pydantic', pydantic.VERSION, 'transformers', transformers.__version__, 'torch', torch.__version__)" 2>&1 | tee -a "$S"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$S"
log "$(date -u +%FT%TZ) commit $(cat .device/commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)"
M=/tmp/tf/models/2b
if [ ! -d $M ]; then
  log "synth qwen3.5-2b"
  /tmp/tf/tensorfold synth --preset qwen3.5-2b --tokenizer $TENSORFOLD_SHARED/tokenizers/qwen3.5/tokenizer.json $M 2>&1 | tail -1 | tee -a "$S"
fi
# Kernels compile once into the cache every later process reads.
timeout 200 /tmp/tf/tensorfold kernels --check --cache --arch sm_90 > "$OUT/kernels.log" 2>&1
log "load test (bench/load.sh)"
TF=/tmp/tf/tensorfold PY=python3 DEVICE=cuda BAR=${BAR:-1,8,32,64} LEVELS=${LEVELS:-1,8,32,64} PROMPT=${PROMPT:-128} GEN=${GEN:-128} \
  REPS=${REPS:-3} REQUESTS=${REQUESTS:-16,64,192,384} SECONDS_PER_LEVEL=${SECONDS_PER_LEVEL:-60} OUT=/tmp/tf/load \
  timeout ${LOAD_TIMEOUT:-420} bash bench/load.sh $M 2>&1 | tee -a "$S"
cp /tmp/tf/load/bar.txt /tmp/tf/load/guidellm-table.txt /tmp/tf/load/guidellm.json "$OUT"/ 2>/dev/null
tar -C /tmp/tf -cJf "$OUT/load.tar.xz" load "$OUT/kernels.log" "$OUT/pip.log" 2>/dev/null
log "done"
