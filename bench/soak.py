#!/usr/bin/env python3
"""Soak test of `tensorfold serve`: many requests at a fixed concurrency, a fifth of them
cancelled midway by the client going away, streamed and whole, chat and text completions, mixed
prompt and output lengths. Starts the server itself (loopback, a free port), stops it at the end
(SIGTERM), and prints each check as PASS or FAIL with its numbers; exits 1 if any failed.

  python3 bench/soak.py --binary target/release/tensorfold -m ../shared/fixtures/vocab/mlx-q4 \
      --requests 2000 --concurrency 16

Checks:
  valid:    every request not cancelled ends with a valid response (200, JSON that parses,
            streams ending in `data: [DONE]` with a finish reason and usage), finish reason stop
            or length, usage within max_tokens, prompt tokens equal to what /tokenize counts;
  cancel:   every cancelled request was cut by the client before its end;
  repeat:   requests of the same prompt and settings (greedy, or sampled with a fixed seed) gave
            the same text every time, streamed or whole, whatever else was running;
  metrics:  /metrics `request_success_total` by finish reason equals the client's counts (stop,
            length; abort = the cancelled ones; error 0); `prompt_tokens_total` equals the prompt
            tokens of every request; `generation_tokens_total` minus the completed requests'
            completion tokens lies between the tokens the cancelled streams saw and their
            max_tokens; nothing left running or waiting;
  memory:   the server's resident memory (VmRSS, /proc) after the run is within --rss-tolerance
            (5%) of after the first hundred requests (--rss-after).
Prompts come from a fixed pool (a chat service's repeated system prompts and documents), and the
server's prefix snapshots get a budget (--snapshot-budget, 32 MiB) that the tiny fixture's
snapshots fill within the first hundred requests, so from there the cache holds its budget,
evicting as it takes new snapshots, rather than growing with what the cancelled streams reach
(the further they run past a 256-token stride before their cut, the more new snapshots: it
depends on the machine's speed, most at the end of the run when few streams share the steps):
the memory check then measures leaks, not the cache's budget (its bytes are printed beside it).
Before the server reused its freed sequence states and kept glibc's mmap threshold fixed, the
baseline had to wait for a 500-request warm-up: bench/results/2026-12-03-cpu-soak.md and
2026-12-03-cpu-soak-reuse.md.
"""
import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import http.client
import socket
import urllib.parse
import urllib.request

WORDS = "the of and to in is was for on that with as by at from his her an which or be are this had not but were have one all their they it has been its can more who some".split()


def pool(rng, n):
    """n chat conversations and n text prompts of lengths from a few to about a thousand tokens."""
    chats, texts = [], []
    for i in range(n):
        k = int(2 + (i / max(1, n - 1)) ** 2 * 400)
        body = " ".join(rng.choice(WORDS) for _ in range(k))
        msgs = [{"role": "system", "content": f"You are assistant number {i}."}, {"role": "user", "content": f"Summarise: {body}"}]
        if i % 3 == 1:
            msgs += [{"role": "assistant", "content": "Sure. " + " ".join(rng.choice(WORDS) for _ in range(12))}, {"role": "user", "content": "Shorter, please."}]
        chats.append(msgs)
        texts.append(f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(k)))
    return chats, texts


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def get_json(url, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def metrics(url):
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"tensorfold:(\w+)\{([^}]*)\} (\S+)$", line)
        if not m:
            continue
        name, labels, value = m.groups()
        r = re.search(r'finished_reason="(\w+)"', labels)
        out[name + (f"/{r.group(1)}" if r else "")] = float(value)
    return out


class Soak:
    def __init__(self, a):
        self.a = a
        self.rng = random.Random(a.seed)
        self.chats, self.texts = pool(self.rng, a.pool)
        self.lock = threading.Lock()
        self.results = []
        self.done = 0
        self.rss_at = {}
        self.snap_at = {}
        self.failures = []
        self.rss_after = max(1, min(a.rss_after, a.requests))

    # --- the server ---
    def start(self):
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "info"))
        self.log = open(self.a.log, "w") if self.a.log else subprocess.DEVNULL
        cmd = [self.a.binary, "serve", "-m", self.a.model, "--device", "cpu", "--port", "0", "--max-seqs", str(self.a.max_seqs)]
        if self.a.snapshot_budget is not None:
            cmd += ["--snapshot-budget", str(self.a.snapshot_budget)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        deadline = time.time() + 300
        self.url = None
        self.loglines = []
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise SystemExit("server exited before listening:\n" + "".join(self.loglines))
            self.loglines.append(line)
            m = re.search(r"listening on (http://[\d.:]+)", line)
            if m:
                self.url = m.group(1)
                break
        if not self.url:
            raise SystemExit("server did not listen within 300 s")
        # Keep draining the log so the server never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stdout:
            if self.log is not subprocess.DEVNULL:
                self.log.write(line)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        return self.proc.returncode

    # --- requests ---
    def plan(self, i):
        """The i-th request: deterministic from (seed, i)."""
        r = random.Random(self.a.seed * 1_000_003 + i)
        chat = r.random() < 0.6
        p = r.randrange(self.a.pool)
        cancel = i % 5 == 2
        stream = r.random() < 0.5
        if cancel:
            # Long enough that the cut always comes first: ignore EOS, many tokens.
            settings = {"max_tokens": 2048, "ignore_eos": True, "temperature": 0}
        else:
            # Each prompt of the pool has its own settings (a client's), so the prefix cache
            # holds a bounded set of finished sequences: greedy or sampled with a fixed seed,
            # 1 to 48 tokens, some with a stop string.
            k = random.Random(self.a.seed * 7919 + 2 * p + chat)
            settings = {"max_tokens": k.choice([1, 4, 16, 48]), "temperature": 0}
            if k.random() < 0.5:
                settings.update(temperature=0.8, top_p=0.95, seed=p)
            if k.random() < 0.3:
                settings["stop"] = ["e"]
        return {"i": i, "chat": chat, "pool": p, "cancel": cancel, "stream": stream, "settings": settings, "cut_after": r.randrange(1, 9), "cut_seconds": r.uniform(0.05, 0.5)}

    def body(self, q):
        b = dict(q["settings"])
        if q["chat"]:
            b["messages"] = self.chats[q["pool"]]
        else:
            b["prompt"] = self.texts[q["pool"]]
        if q["stream"]:
            b["stream"] = True
            b["stream_options"] = {"include_usage": True}
        b["model"] = self.model
        return b

    def send(self, q):
        """One request on its own connection (standard library only): closing the connection
        is how a client goes away."""
        path = "/v1/chat/completions" if q["chat"] else "/v1/completions"
        body = json.dumps(self.body(q)).encode()
        res = {"q": q, "ok": False}
        t0 = time.perf_counter()
        u = urllib.parse.urlsplit(self.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
        try:
            if q["cancel"] and not q["stream"]:
                # Whole response: the client gives up after cut_seconds (closing the connection).
                conn.timeout = q["cut_seconds"]
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            try:
                r = conn.getresponse()
            except (socket.timeout, TimeoutError):
                if q["cancel"] and not q["stream"]:
                    res.update(ok=True, cancelled=True, seen=0)
                    return res
                raise
            if q["cancel"] and not q["stream"]:
                res["error"] = "a cancelled request's whole response came back before the cut"
            elif r.status != 200:
                res["error"] = f"HTTP {r.status}: {r.read()[:200]!r}"
            elif q["stream"]:
                self._stream(r, q, res)
            else:
                self._whole(json.loads(r.read()), q, res)
        except Exception as e:  # noqa: BLE001 — any failure is a failed request, reported
            res["error"] = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
        res["seconds"] = time.perf_counter() - t0
        return res

    def _whole(self, j, q, res):
        c = j["choices"][0]
        if q["chat"]:
            text = (c["message"].get("content") or "", c["message"].get("reasoning_content") or "")
        else:
            text = (c["text"], "")
        self._finish(res, q, c["finish_reason"], j.get("usage"), text)

    def _stream(self, r, q, res):
        content, reasoning, finish, usage, tokens, done = [], [], None, None, 0, False
        while True:
            line = r.readline()
            if not line:
                break
            line = line.decode().rstrip("\r\n")
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                d = c.get("delta", {}) if q["chat"] else {"content": c.get("text")}
                if d.get("content"):
                    content.append(d["content"])
                    tokens += 1
                if d.get("reasoning_content"):
                    reasoning.append(d["reasoning_content"])
                    tokens += 1
                if c.get("finish_reason"):
                    finish = c["finish_reason"]
            if q["cancel"] and tokens >= q["cut_after"]:
                # The caller closes the connection mid-stream.
                res.update(ok=True, cancelled=True, seen=tokens)
                return
        if q["cancel"]:
            res["error"] = f"a cancelled stream ended by itself ({finish}) after {tokens} chunks"
            return
        if not done:
            res["error"] = "stream ended without data: [DONE]"
            return
        self._finish(res, q, finish, usage, ("".join(content), "".join(reasoning)))

    def _finish(self, res, q, finish, usage, text):
        mt = q["settings"]["max_tokens"]
        want_prompt = self.prompt_tokens[(q["chat"], q["pool"])]
        if finish not in ("stop", "length"):
            res["error"] = f"finish_reason {finish!r}"
        elif not usage or not (0 < usage["completion_tokens"] <= mt or (finish == "stop" and usage["completion_tokens"] <= mt)):
            res["error"] = f"usage {usage} for max_tokens {mt}"
        elif usage["prompt_tokens"] != want_prompt:
            res["error"] = f"prompt_tokens {usage['prompt_tokens']}, /tokenize says {want_prompt}"
        elif finish == "length" and usage["completion_tokens"] != mt:
            res["error"] = f"finish length after {usage['completion_tokens']} of {mt} tokens"
        else:
            res.update(ok=True, cancelled=False, finish=finish, usage=usage, text=text)

    def worker(self, queue):
        while True:
            with self.lock:
                if not queue:
                    return
                i = queue.pop(0)
            res = self.send(self.plan(i))
            with self.lock:
                self.results.append(res)
                self.done += 1
                n = self.done
            if n in self.marks:
                self.rss_at[n] = rss_kib(self.proc.pid)
                self.snap_at[n] = metrics(self.url).get("snapshot_memory_bytes", -1)
                print(f"  {n:>5} done  {time.perf_counter() - self.t0:7.1f} s  RSS {self.rss_at[n] / 1024:7.1f} MiB  snapshots {self.snap_at[n] / 2**20:6.1f} MiB", flush=True)

    def run(self):
        a = self.a
        self.start()
        try:
            self.model = get_json(self.url + "/v1/models")["data"][0]["id"]
            # Prompt lengths as the server counts them (chat: rendered with the generation prompt).
            self.prompt_tokens = {}
            for p in range(a.pool):
                t = get_json(self.url + "/tokenize", {"model": self.model, "messages": self.chats[p], "add_generation_prompt": True})
                self.prompt_tokens[(True, p)] = t["count"]
                t = get_json(self.url + "/tokenize", {"model": self.model, "prompt": self.texts[p]})
                self.prompt_tokens[(False, p)] = t["count"]
            self.marks = {100, self.rss_after} | set(range(0, a.requests + 1, max(1, a.requests // 8))) | {a.requests}
            queue = list(range(a.requests))
            print(f"server {self.url} (pid {self.proc.pid}), {a.requests} requests at {a.concurrency} concurrent; prompts {min(self.prompt_tokens.values())}..{max(self.prompt_tokens.values())} tokens", flush=True)
            self.t0 = time.perf_counter()
            ts = [threading.Thread(target=self.worker, args=(queue,)) for _ in range(a.concurrency)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            self.seconds = time.perf_counter() - self.t0
            # The runtime frees a cancelled slot at its next tick: give it a moment.
            for _ in range(100):
                m = metrics(self.url)
                if m.get("num_requests_running", 1) == 0 and m.get("num_requests_waiting", 1) == 0:
                    break
                time.sleep(0.1)
            self.m = m
            self.rss_end = rss_kib(self.proc.pid)
        finally:
            self.rc = self.stop()
        return self.report()

    def report(self):
        a, m, res = self.a, self.m, self.results
        checks = []

        def check(name, ok, detail):
            checks.append(ok)
            print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")

        bad = [r for r in res if not r["ok"]]
        done = [r for r in res if r["ok"] and not r["cancelled"]]
        cut = [r for r in res if r["ok"] and r["cancelled"]]
        n_stream = sum(1 for r in res if r["q"]["stream"])
        print(f"{len(res)} requests in {self.seconds:.1f} s: {len(done)} completed, {len(cut)} cancelled, {len(bad)} failed; {n_stream} streamed, {sum(1 for r in res if r['q']['chat'])} chat")
        check("count", len(res) == a.requests, f"{len(res)} of {a.requests} requests ended")
        check("valid", not bad, f"{len(done)} valid responses" + (f"; first failure: request {bad[0]['q']['i']}: {bad[0].get('error')}" if bad else ""))
        want_cut = sum(1 for i in range(a.requests) if self.plan(i)["cancel"])
        check("cancel", len(cut) == want_cut, f"{len(cut)} clean cancels of {want_cut} planned ({sum(1 for r in cut if r['q']['stream'])} streamed, cut after 1-8 chunks; the rest whole, cut after 0.05-0.5 s)")
        seen = {}
        diverged = []
        for r in done:
            q = r["q"]
            key = (q["chat"], q["pool"], json.dumps(q["settings"], sort_keys=True))
            if key in seen and seen[key] != r["text"]:
                diverged.append(q["i"])
            seen.setdefault(key, r["text"])
        repeats = len(done) - len(seen)
        check("repeat", not diverged, f"{repeats} repeats of {len(seen)} distinct requests gave their first text" + (f"; diverged: {diverged[:5]}" if diverged else ""))
        by = {"stop": sum(1 for r in done if r["finish"] == "stop"), "length": sum(1 for r in done if r["finish"] == "length")}
        got = {k: int(m.get(f"request_success_total/{k}", -1)) for k in ("stop", "length", "abort", "error")}
        check("metrics: finish reasons", got == {"stop": by["stop"], "length": by["length"], "abort": len(cut), "error": 0}, f"/metrics {got}, client stop {by['stop']} length {by['length']} cancelled {len(cut)}")
        prompt = sum(self.prompt_tokens[(r["q"]["chat"], r["q"]["pool"])] for r in res)
        check("metrics: prompt tokens", int(m.get("prompt_tokens_total", -1)) == prompt, f"/metrics {int(m.get('prompt_tokens_total', -1))}, client {prompt}")
        gen_done = sum(r["usage"]["completion_tokens"] for r in done)
        lo = gen_done + sum(r["seen"] for r in cut)
        hi = gen_done + sum(r["q"]["settings"]["max_tokens"] for r in cut)
        g = int(m.get("generation_tokens_total", -1))
        check("metrics: generation tokens", lo <= g <= hi, f"/metrics {g}; completed {gen_done} + cancelled between {lo - gen_done} (seen) and {hi - gen_done} (their max_tokens); the cancelled generated {g - gen_done}, {((g - gen_done) / max(1, len(cut))):.1f} each")
        idle = m.get("num_requests_running") == 0 and m.get("num_requests_waiting") == 0
        check("metrics: slots freed", idle, f"running {m.get('num_requests_running')}, waiting {m.get('num_requests_waiting')} after the run")
        w = self.rss_after
        r100, rw, rend = self.rss_at.get(100, -1), self.rss_at.get(w, -1), self.rss_end
        growth = (rend - rw) / rw if rw > 0 else float("inf")
        g100 = (rend - r100) / r100 if r100 > 0 else float("inf")
        detail = f"VmRSS after {w} requests {rw / 1024:.1f} MiB, after {len(res)} {rend / 1024:.1f} MiB ({growth * 100:+.2f}%, limit ±{a.rss_tolerance * 100:.0f}%)"
        if w != 100:
            detail += f"; after 100 {r100 / 1024:.1f} MiB ({g100 * 100:+.2f}% to the end)"
        detail += f"; prefix snapshots {self.snap_at.get(w, 0) / 2**20:.1f} → {m.get('snapshot_memory_bytes', 0) / 2**20:.1f} MiB"
        check("memory", abs(growth) <= a.rss_tolerance, detail)
        check("server exit", self.rc == 0, f"SIGTERM → exit {self.rc}")
        lat = sorted(r["seconds"] for r in done)
        if lat:
            print(f"latency of completed requests: median {lat[len(lat) // 2]:.2f} s, p99 {lat[min(len(lat) - 1, int(0.99 * len(lat)))]:.2f} s; generated {g} tokens, {g / self.seconds:.1f} tok/s")
        ok = all(checks)
        print(f"{sum(checks)} passed, {len(checks) - sum(checks)} failed")
        return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default="target/release/tensorfold")
    ap.add_argument("-m", "--model", default="../shared/fixtures/vocab/mlx-q4")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--pool", type=int, default=16, help="distinct prompts of each kind")
    ap.add_argument("--rss-tolerance", type=float, default=0.05)
    ap.add_argument("--rss-after", type=int, default=100, metavar="N",
                    help="requests before the memory baseline (at most --requests)")
    ap.add_argument("--snapshot-budget", type=int, default=32, metavar="MiB",
                    help="the server's prefix snapshot budget (the server's own default is 1024); one the cache fills within the first hundred requests makes the memory check measure leaks alone")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--log", default=None, help="write the server's log here")
    a = ap.parse_args()
    return Soak(a).run()


if __name__ == "__main__":
    sys.exit(main())
