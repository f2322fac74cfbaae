#!/usr/bin/env bash
# Load test of `tensorfold serve`, loopback only, every run bounded in requests and seconds:
#  1. the bar (issue 20): `tensorfold bench --concurrency $BAR` (the runtime's own figures), then
#     the same measurement through HTTP and SSE (bench/serve_bar.py against `tensorfold serve` on
#     the same model with the bench's scheduling settings), $REPS times in turn, so that other
#     load on the machine falls on both alike; then the ratios: aggregate decode tokens/s at the
#     largest $BAR level through the server over the bench's (the bar: >= 90%) and time to first
#     token (the bar: within 10%);
#  2. guidellm (a maintained serving-benchmark client) at $LEVELS concurrent streaming requests
#     (synthetic prompts of $PROMPT tokens, $GEN output tokens, ignore_eos): TTFT, inter-token
#     latency, output tokens/s per level.
# Writes $OUT/: uptime.txt (before and after), bench-N.json, serve-bar-N.json, guidellm.json,
# guidellm.txt, guidellm-table.txt, bar.txt, server logs. GUIDELLM=0: the bar only. SERVE_ARGS:
# more `tensorfold serve` flags (e.g. `--snapshot-device-budget 0` to compare snapshot tiers).
# URL=http://HOST:PORT: guidellm alone against a server already running there (a peer such as
# llama.cpp's llama-server; MODEL then only gives the tokenizer), no bar. TICK_LOGS=1: both sides
# of the bar write the runtime's tick log (TENSORFOLD_TICK_LOG) to ticks-{bench,serve}-N.txt, and
# bar.txt adds each side's median step, host time and tick interval over its full-batch ticks.
#
#   python3 -m venv /tmp/load && /tmp/load/bin/pip install guidellm==0.8.1
#   PY=/tmp/load/bin/python3 bash bench/load.sh ../shared/fixtures/tiny/mlx-q4
#   (on the GPU: bench/device-serve.sh sets DEVICE=cuda BAR=64 and the synthetic 2b)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-../shared/fixtures/tiny/mlx-q4}
TF=${TF:-target/release/tensorfold}
PY=${PY:-python3}
DEVICE=${DEVICE:-cpu}
LEVELS=${LEVELS:-1,8,32,64}
BAR=${BAR:-1,8}
PROMPT=${PROMPT:-128}
GEN=${GEN:-64}
REPS=${REPS:-2}
# guidellm: requests per level (a list, one per level) and a time limit per level (seconds).
REQUESTS=${REQUESTS:-8,32,96,192}
SECONDS_PER_LEVEL=${SECONDS_PER_LEVEL:-120}
OUT=${OUT:-/tmp/tensorfold-load}
PORT=${PORT:-$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
mkdir -p "$OUT"
# Prompt ids are drawn below the vocabulary that both the weights and the tokenizer have.
VOCAB=$($PY -c '
import json, sys
c = json.load(open(sys.argv[1] + "/config.json"))
v = c.get("text_config", c).get("vocab_size") or c["vocab_size"]
t = json.load(open(sys.argv[1] + "/tokenizer.json"))
ids = list(t["model"]["vocab"].values()) + [a["id"] for a in t.get("added_tokens", [])]
print(min(v, max(ids) + 1))' "$MODEL")
max_level=$(echo "$LEVELS,$BAR" | tr ',' '\n' | sort -n | tail -1)
# The bench's runtime settings (src/cli/bench.rs): max_seqs = the largest level, a step holds
# max(chunk, level) tokens with the default 256-token chunk.
batch_tokens=$(( max_level > 256 ? max_level : 256 ))
{ echo "commit $(git rev-parse --short HEAD 2>/dev/null || cat .device/commit 2>/dev/null)"; echo "model $MODEL, device $DEVICE, $(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"; uptime; } | tee "$OUT/uptime.txt"

# `env` arguments: the runtime's tick log in $OUT/ticks-$1.txt when TICK_LOGS=1, else none.
tick_env() {
  if [ "${TICK_LOGS:-0}" = 1 ]; then echo "TENSORFOLD_TICK_LOG=$OUT/ticks-$1.txt"; else echo "-u TENSORFOLD_TICK_LOG"; fi
}

server_pid=
start_server() {
  env $(tick_env "serve-$1") "$TF" serve -m "$MODEL" --device "$DEVICE" --port "$PORT" --max-seqs "$max_level" --max-waiting 1024 --max-batch-tokens "$batch_tokens" ${SERVE_ARGS:-} > "$OUT/server-$1.log" 2>&1 &
  server_pid=$!
  $PY - "$PORT" "$server_pid" <<'EOF'
import sys, time, urllib.request, os
port, pid = sys.argv[1], int(sys.argv[2])
for _ in range(1200):
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the server exited before it was healthy")
    time.sleep(0.25)
sys.exit("the server was not healthy within 300 s")
EOF
}
stop_server() {
  [ -n "$server_pid" ] && kill -TERM "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null || true
  server_pid=
}
trap stop_server EXIT

[ -n "${URL:-}" ] && REPS=0
for r in $(seq 1 "$REPS"); do
  echo "== rep $r: tensorfold bench --device $DEVICE --concurrency $BAR -p $PROMPT -n $GEN"
  env $(tick_env "bench-$r") "$TF" bench -m "$MODEL" --device "$DEVICE" --concurrency "$BAR" -p "$PROMPT" -n "$GEN" --json "$OUT/bench-$r.json" 2>&1 | tail -n +2
  echo "== rep $r: the same through tensorfold serve (bench/serve_bar.py)"
  start_server "bar-$r"
  $PY bench/serve_bar.py --url "http://127.0.0.1:$PORT" --concurrency "$BAR" --prompt "$PROMPT" --gen "$GEN" --vocab "$VOCAB" --json "$OUT/serve-bar-$r.json"
  stop_server
done

[ "$REPS" -gt 0 ] && $PY - "$OUT" "$REPS" "$BAR" <<'EOF' | tee "$OUT/bar.txt"
import json, sys, statistics
out, reps, levels = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
print("level  rep   bench t/s   serve t/s   ratio | bench ttft   serve ttft   ratio | bench itl  serve itl")
ratios = {c: ([], []) for c in levels}
for r in range(1, reps + 1):
    # serve_bar.py's decode window runs to the last token, as the bench's tail_inclusive one does.
    b = {row["runtime"]["concurrency"]: dict(row["runtime"], decode_tokens_per_second=row["runtime"].get("tail_inclusive_tokens_per_second", row["runtime"]["decode_tokens_per_second"])) for row in json.load(open(f"{out}/bench-{r}.json"))["levels"]}
    s = {row["concurrency"]: row for row in json.load(open(f"{out}/serve-bar-{r}.json"))["levels"]}
    for c in levels:
        tp = s[c]["decode_tokens_per_second"] / b[c]["decode_tokens_per_second"]
        tt = s[c]["ttft_median"] / b[c]["ttft_median"]
        ratios[c][0].append(tp)
        ratios[c][1].append(tt)
        print(f"{c:>5} {r:>4} {b[c]['decode_tokens_per_second']:>11.1f} {s[c]['decode_tokens_per_second']:>11.1f} {tp:>7.1%} | {b[c]['ttft_median']*1e3:>8.1f}ms {s[c]['ttft_median']*1e3:>10.1f}ms {tt:>7.1%} | {b[c]['itl_median']*1e3:>7.2f}ms {s[c]['itl_median']*1e3:>8.2f}ms")
c = max(levels)
tp, tt = statistics.median(ratios[c][0]), statistics.median(ratios[c][1])
print(f"bar at {c} streams (median of {reps}): decode tokens/s through the server {tp:.1%} of the bench ({'PASS' if tp >= 0.9 else 'FAIL'}, >= 90%); TTFT {tt:.1%} of the bench ({'PASS' if tt <= 1.1 else 'FAIL'}, within 110%)")
# Tick logs (TICK_LOGS=1): lines `tick t_us rows decode seqs step_us host_us [admit_us events_us snapshots_us]`; the ticks where all
# c sequences decode (one row each), and the interval from the previous tick's end.
import os
for r in range(1, reps + 1):
    for side, name in (("bench", f"bench-{r}"), ("serve", f"serve-bar-{r}")):
        path = f"{out}/ticks-{name}.txt"
        if not os.path.exists(path):
            continue
        rows = [list(map(int, l.split())) for l in open(path) if l.strip() and not l.startswith("#")]
        full = [(t[1] - p[1], t[5], t[6]) for p, t in zip(rows, rows[1:]) if t[3] == c and t[2] == c and p[3] == c]
        if full:
            med = lambda i: statistics.median(x[i] for x in full) / 1e3
            print(f"ticks rep {r} {side}: {len(full)} full-batch ticks of {c} rows: interval {med(0):.2f} ms, step {med(1):.2f} ms, host {med(2):.3f} ms (medians)")
        # Ticks that carry prompt rows, where the time to first token goes: step and host time
        # summed, and of the host time admission and events, then the snapshots' host time (taken
        # while the step runs from 02ca0ef, so inside the step time).
        prompt = [t for t in rows if t[2] > t[3]]
        if prompt:
            line = f"ticks rep {r} {side}: {len(prompt)} prompt ticks: step {sum(t[5] for t in prompt) / 1e3:.1f} ms, host {sum(t[6] for t in prompt) / 1e3:.1f} ms"
            if len(prompt[0]) >= 10:
                line += f" (admission {sum(t[7] for t in prompt) / 1e3:.1f}, events {sum(t[8] for t in prompt) / 1e3:.1f}), snapshots {sum(t[9] for t in prompt) / 1e3:.1f} ms (inside the step from 02ca0ef)"
            print(line + " in all")
EOF

[ "${GUIDELLM:-1}" = 0 ] && exit 0
echo "== guidellm at $LEVELS concurrent streams${URL:+ against $URL}"
if [ -n "${URL:-}" ]; then TARGET=$URL; else start_server guidellm; TARGET=http://127.0.0.1:$PORT; fi
model_name=$($PY -c "import json,urllib.request; print(json.load(urllib.request.urlopen('$TARGET/v1/models'))['data'][0]['id'])")
model_abs=$(cd "$MODEL" && pwd)
$PY - "$OUT/guidellm-scenario.json" <<EOF
import json, sys
levels = [int(x) for x in "$LEVELS".split(",")]
requests = [int(x) for x in "$REQUESTS".split(",")]
spec = {"spec": {
    "backend": {"kind": "openai_http", "target": "$TARGET", "model": "$model_name", "request_format": "/v1/completions"},
    "profile": {"kind": "concurrent", "streams": levels},
    "tokenizer": {"kind": "huggingface_auto", "model": "$model_abs"},
    "data": [{"kind": "synthetic_text", "prompt_tokens": $PROMPT, "output_tokens": $GEN}],
    "constraints": [{"kind": "max_requests", "count": requests}, {"kind": "max_duration", "seconds": $SECONDS_PER_LEVEL}],
    "outputs": [{"kind": "json", "path": "$OUT/guidellm.json"}]}}
json.dump(spec, open(sys.argv[1], "w"), indent=1)
EOF
HF_HUB_OFFLINE=1 $PY -m guidellm run -c "$OUT/guidellm-scenario.json" --disable-progress > "$OUT/guidellm.txt" 2>&1 || { tail -30 "$OUT/guidellm.txt"; exit 1; }
stop_server
$PY bench/guidellm_table.py "$OUT/guidellm.json" | tee "$OUT/guidellm-table.txt"
uptime | tee -a "$OUT/uptime.txt"
