#!/usr/bin/env python3
"""Two `tensorfold serve` replicas behind SGLang's router (`sglang-router`, a maintained Rust
router from PyPI) on loopback: requests spread across both, and a conversation's next turn
lands on the replica that holds its prefix (a prefix cache hit) under the cache-aware policy.

Starts the replicas and the router on free loopback ports, runs, prints PASS/FAIL, stops them.
Standard library only (the router is a separate program).

  python3 -m venv /tmp/router && /tmp/router/bin/pip install sglang-router==0.3.2
  python3 bench/router.py --router /tmp/router/bin/sglang-router -m ../shared/fixtures/vocab/mlx-q4

Phases:
  spread: --conversations distinct conversations, first turn each, 4 at a time: each replica
          must serve at least a quarter of them (read from each replica's /metrics);
  sticky: each conversation's second turn (its first turn's history, the reply, a new user
          message), one at a time, the serving replica found from the /metrics counters that
          moved: every second turn must land on its first turn's replica and report
          `cached_tokens` > 0 (the replica resumed the history from its prefix snapshot).
With --policy round_robin (or random) the same run shows what the cache-aware policy buys: the
sticky check then fails for the turns sent to the other replica.
"""
import argparse
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def post(url, body, timeout=600):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def served(url):
    """Finished sequences (all reasons) and prefix-cache hit tokens of one replica."""
    _, text = get(url + "/metrics")
    n = sum(float(v) for v in re.findall(r"^tensorfold:request_success_total\{[^}]*\} (\S+)$", text, re.M))
    hits = float(re.search(r"^tensorfold:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M).group(1))
    return n, hits


def wait_health(url, proc, seconds=300):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: process exited with {proc.returncode}")
        try:
            if get(url + "/health", timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url}: not healthy within {seconds} s")


def conversation(i):
    topics = ["rivers", "bridges", "compilers", "tides", "orchards", "glaciers", "printing", "bees", "lighthouses", "railways", "volcanoes", "paper"]
    t = topics[i % len(topics)]
    return [
        {"role": "system", "content": f"You are a patient tutor. Conversation {i}."},
        {"role": "user", "content": f"Tell me about {t}, conversation {i}. " + " ".join(f"Point {k} about {t}." for k in range(8 + i % 5))},
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default="target/release/tensorfold")
    ap.add_argument("-m", "--model", default="../shared/fixtures/vocab/mlx-q4")
    ap.add_argument("--router", default="sglang-router", help="the sglang-router program")
    ap.add_argument("--policy", default="cache_aware")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--log-dir", default=None, help="write the replicas' and router's logs here")
    a = ap.parse_args()

    procs, logs = [], []

    def spawn(name, cmd):
        log = open(f"{a.log_dir}/{name}.log", "w") if a.log_dir else subprocess.DEVNULL
        logs.append(log)
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    ok_all = []

    def check(name, ok, detail):
        ok_all.append(ok)
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)

    try:
        reps = []
        for k in range(2):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            p = spawn(f"replica{k}", [a.binary, "serve", "-m", a.model, "--device", "cpu", "--port", str(port)])
            reps.append((url, p))
        for url, p in reps:
            wait_health(url, p)
        rport = free_port()
        router = f"http://127.0.0.1:{rport}"
        rp = spawn("router", [a.router, "launch", "--host", "127.0.0.1", "--port", str(rport), "--policy", a.policy, "--worker-urls", *[u for u, _ in reps], "--log-level", "warn"])
        wait_health(router, rp)
        model = json.loads(get(reps[0][0] + "/v1/models")[1])["data"][0]["id"]
        print(f"replicas {', '.join(u for u, _ in reps)}; router {router} (--policy {a.policy}); model {model}", flush=True)

        # spread: first turns, a few at a time.
        before = [served(u)[0] for u, _ in reps]
        first = {}
        lock = threading.Lock()
        todo = list(range(a.conversations))

        def worker():
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop(0)
                r = post(router + "/v1/chat/completions", {"model": model, "messages": conversation(i), "max_tokens": a.max_tokens, "temperature": 0})
                with lock:
                    first[i] = r

        ts = [threading.Thread(target=worker) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        counts = [served(u)[0] - b for (u, _), b in zip(reps, before)]
        check("spread", sum(counts) == a.conversations and min(counts) >= a.conversations / 4, f"first turns per replica {counts[0]:.0f} and {counts[1]:.0f} of {a.conversations}")

        # sticky: where does each first turn live? Resend each first turn alone (its reply is
        # cached as a snapshot on the replica that serves it), then the second turn.
        same, hit, n = 0, 0, 0
        moved = []
        for i in range(a.conversations):
            msgs = conversation(i)
            where = []
            for turn in range(2):
                if turn == 1:
                    msgs = msgs + [{"role": "assistant", "content": r["choices"][0]["message"]["content"] or ""}, {"role": "user", "content": "Go on, in one sentence."}]
                b = [served(u) for u, _ in reps]
                r = post(router + "/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": a.max_tokens, "temperature": 0})
                after = [served(u) for u, _ in reps]
                which = [k for k in range(2) if after[k][0] > b[k][0]]
                where.append(which[0] if len(which) == 1 else None)
            cached = r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
            n += 1
            same += where[0] is not None and where[0] == where[1]
            hit += cached > 0
            if where[0] != where[1] or cached == 0:
                moved.append((i, where, cached, r["usage"]["prompt_tokens"]))
        check("sticky", same == n, f"{same} of {n} second turns on their first turn's replica")
        check("prefix hits", hit == n, f"{hit} of {n} second turns resumed from a prefix snapshot (cached_tokens > 0)" + (f"; not: {moved[:4]} (conversation, replicas, cached, prompt)" if moved else ""))
        totals = [served(u) for u, _ in reps]
        print(f"replica totals: requests {totals[0][0]:.0f} / {totals[1][0]:.0f}, prefix cache hit tokens {totals[0][1]:.0f} / {totals[1][1]:.0f}")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in logs:
            if log is not subprocess.DEVNULL:
                log.close()
    print(f"{sum(ok_all)} passed, {len(ok_all) - sum(ok_all)} failed")
    return 0 if all(ok_all) else 1


if __name__ == "__main__":
    sys.exit(main())
