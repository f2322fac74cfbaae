#!/usr/bin/env python3
"""What the HTTP server costs: `tensorfold bench --concurrency`'s measurement, made through
`tensorfold serve` instead of the runtime's own channels.

For each level C: a warm-up of C short requests, then C streamed `/v1/completions` requests sent
at once, each a prompt of --prompt distinct random token ids (no prefix is shared, as in the
bench), greedy, `ignore_eos`, --gen tokens. Every SSE chunk's arrival is stamped on the client.
The figures are the bench's (src/bench.rs `concurrent`), counted in tokens (a chunk whose token
ends inside a UTF-8 character carries no text and comes with the next token):
  decode t/s: tokens that arrived after the last stream's first token, over the time from then
              to the last token (every stream decoding, no prompt in the window);
  TTFT:       from the first request's sending to a stream's first token (median, p99), as the
              bench counts from one submission of all its sequences;
  ITL:        gaps between consecutive tokens of one stream (median, p99).
The client is one asyncio loop over plain HTTP/1.1 connections (standard library only), opened
and warmed before the clock starts and kept alive, that writes the C requests back to back
(the send spread is reported), stamps each chunk and parses only the last: on a 2-core machine
it shares the cores with the server, so its own cost must stay small. Prints a table and, with
--json, writes the figures.

  python3 bench/serve_bar.py --url http://127.0.0.1:8080 --concurrency 1,8 --prompt 128 --gen 64
"""
import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import urllib.parse
import urllib.request


def quantile(xs, q):
    """The bench's quantile: the sorted value at round(q * (n - 1))."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def request(host, port, model, ids, gen):
    """The bytes of one streamed /v1/completions request on a kept-alive connection."""
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": gen, "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    return f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


async def response(reader, t0):
    """Reads one response off a kept-alive connection (the SSE stream comes chunked). Kept lean on
    purpose: the client shares the machine's cores with the server, so a chunk is only stamped
    and classified by a substring; only the last data chunk (usage) is parsed."""
    status = await reader.readline()
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    if b" 200 " not in status:
        return {"error": f"{status.decode().strip()}: {(await reader.read(300))!r}"}
    if headers.get("transfer-encoding", "").lower() != "chunked":
        return {"error": f"a streamed response without chunked transfer encoding: {headers}"}
    times, last, finish, buf = [], None, None, b""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()  # the CRLF that ends the body (no trailers)
            break
        data = await reader.readexactly(size + 2)
        buf += data[:-2]
        now = time.perf_counter() - t0
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue  # a keep-alive comment, or the end (the body's last chunk follows)
            if b'"finish_reason":null' in event:
                times.append(now)
            elif b'"usage":{' in event:
                last = event
            else:
                finish = event
    usage = json.loads(last[6:])["usage"] if last else None
    fin = json.loads(finish[6:])["choices"][0] if finish else {}
    if fin.get("text"):
        times.append(now)
    return {"times": times, "usage": usage, "finish": fin.get("finish_reason")}


async def wave(conns, reqs):
    """Writes every request, one per connection, back to back (as the bench submits its
    sequences all at once), then reads the responses. Returns them, the seconds from the first
    write to the last response, and the seconds the writes took (the send spread)."""
    t0 = time.perf_counter()
    for (_, writer), r in zip(conns, reqs):
        writer.write(r)
    spread = time.perf_counter() - t0
    await asyncio.gather(*(w.drain() for _, w in conns))
    out = await asyncio.gather(*(response(rd, t0) for rd, _ in conns))
    return out, time.perf_counter() - t0, spread


async def level_async(host, port, model, c, prompt, gen, vocab, rng):
    prompts = [[rng.randrange(vocab) for _ in range(prompt)] for _ in range(c)]
    # Connections opened before the clock starts and kept alive, as clients' pools keep them.
    conns = [await asyncio.open_connection(host, port) for _ in range(c)]
    # Warm-up on the same connections: the runtime at this batch size once.
    warm, _, _ = await wave(conns, [request(host, port, model, [rng.randrange(vocab) for _ in range(16)], 4) for _ in range(c)])
    errors = [o["error"] for o in warm if "error" in o]
    if errors:
        raise SystemExit(f"level {c} warm-up: {errors[0]}")
    out, seconds, spread = await wave(conns, [request(host, port, model, ids, gen) for ids in prompts])
    for _, w in conns:
        w.close()
    return out, seconds, spread


def level(url, model, c, prompt, gen, vocab, rng):
    u = urllib.parse.urlsplit(url)
    out, seconds, spread = asyncio.run(level_async(u.hostname, u.port or 80, model, c, prompt, gen, vocab, rng))
    errors = [o["error"] for o in out if "error" in o]
    if errors:
        raise SystemExit(f"level {c}: {errors[0]}")
    times = [o["times"] for o in out]
    for o in out:
        u = o["usage"] or {}
        if u.get("completion_tokens") != gen or not 0 < len(o["times"]) <= gen or o["finish"] != "length":
            raise SystemExit(f"level {c}: a stream gave {len(o['times'])} chunks, usage {u}, finish {o['finish']} (wanted {gen} tokens, length)")
    # A token whose text is incomplete (part of a UTF-8 character) arrives with the next one, so a
    # stream can have fewer chunks than tokens: each chunk counts for tokens / chunks of its stream.
    weight = [gen / len(t) for t in times]
    all_started = max(t[0] for t in times)
    end = max(t[-1] for t in times)
    in_window = sum(w for t, w in zip(times, weight) for x in t if x > all_started)
    ttft = [t[0] for t in times]
    itl = [b - a for t in times for a, b in zip(t, t[1:])]
    return {
        "concurrency": c,
        "prompt_tokens": prompt,
        "generated_tokens": gen,
        "decode_tokens_per_second": in_window / (end - all_started) if end > all_started else float("nan"),
        "total_tokens_per_second": c * (prompt + gen) / seconds,
        "ttft_median": statistics.median(ttft),
        "ttft_p99": quantile(ttft, 0.99),
        "itl_median": quantile(itl, 0.5),
        "itl_p99": quantile(itl, 0.99),
        "seconds": seconds,
        "send_spread_seconds": spread,
        "chunks_per_token": sum(len(t) for t in times) / (gen * c),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=248000, help="token ids are drawn below this")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = a.model or json.load(urllib.request.urlopen(a.url + "/v1/models", timeout=30))["data"][0]["id"]
    rng = random.Random(a.seed)
    rows = []
    print(f"server {a.url} model {model}")
    print(f"{'conc':>5} {'prompt':>7} {'gen':>5} {'decode t/s':>12} {'total t/s':>12} {'ttft med':>10} {'ttft p99':>10} {'itl med':>10} {'itl p99':>10} {'sent in':>9}")
    for c in [int(x) for x in a.concurrency.split(",")]:
        r = level(a.url, model, c, a.prompt, a.gen, a.vocab, rng)
        rows.append(r)
        print(
            f"{c:>5} {a.prompt:>7} {a.gen:>5} {r['decode_tokens_per_second']:>12.1f} {r['total_tokens_per_second']:>12.1f} {r['ttft_median']*1e3:>8.1f}ms {r['ttft_p99']*1e3:>8.1f}ms {r['itl_median']*1e3:>8.2f}ms {r['itl_p99']*1e3:>8.2f}ms {r['send_spread_seconds']*1e3:>7.2f}ms",
            flush=True,
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tool": "bench/serve_bar.py", "url": a.url, "model": model, "levels": rows}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
