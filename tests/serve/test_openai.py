"""`tensorfold serve` driven by the official openai client (run by tests/serve.rs).

Environment: TF_BASE (http://127.0.0.1:PORT of the server under test), TF_KEY (its --api-key,
for the `Limited` class). `Main` runs against a default server; `Limited` against one started
with --max-seqs 1 --max-waiting 1 --max-model-len 64 --api-key TF_KEY.
"""

import concurrent.futures
import http.client
import json
import os
import re
import sys
import time
import unittest
import urllib.error
import urllib.request
from urllib.parse import urlparse

import openai

BASE = os.environ.get("TF_BASE", "http://127.0.0.1:8080")
KEY = os.environ.get("TF_KEY", "unused")
MODEL = "mlx-q4"
CHAT = [{"role": "user", "content": "Write one sentence about rivers."}]


def client(key=KEY):
    return openai.OpenAI(base_url=BASE + "/v1", api_key=key, max_retries=0, timeout=120)


def raw(method, path, body=None, headers=None):
    """(status, headers, parsed JSON or text) of one plain HTTP request."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(BASE + path, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, hdrs, text = r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        status, hdrs, text = e.code, dict(e.headers), e.read().decode()
    try:
        return status, hdrs, json.loads(text)
    except ValueError:
        return status, hdrs, text


def metric(name):
    """The value of one tensorfold: metric line (first match) in /metrics."""
    _, _, text = raw("GET", "/metrics")
    m = re.search(r"^" + re.escape(name) + r"(\{[^}]*\})? (\S+)$", text, re.M)
    if m is None:
        raise AssertionError(f"{name} not in /metrics:\n{text}")
    return float(m.group(2))


def wait_metric(name, want, timeout=10.0):
    deadline = time.time() + timeout
    while True:
        v = metric(name)
        if v == want or time.time() > deadline:
            return v
        time.sleep(0.05)


def chat(**kw):
    kw.setdefault("messages", CHAT)
    kw.setdefault("max_tokens", 8)
    return client().chat.completions.create(model=MODEL, **kw)


def stream_chat(**kw):
    """(content, finish_reason, usage) of a streamed chat completion."""
    kw.setdefault("messages", CHAT)
    kw.setdefault("max_tokens", 8)
    text, finish, usage = "", None, None
    for chunk in client().chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish, usage


class Main(unittest.TestCase):
    def test_models_and_health(self):
        models = client().models.list()
        self.assertEqual([m.id for m in models.data], [MODEL])
        status, _, body = raw("GET", "/health")
        self.assertEqual((status, body), (200, {"status": "ok"}))

    def test_chat_counts_the_rendered_prompt_and_the_completion(self):
        r = chat(max_tokens=6, extra_body={"ignore_eos": True})
        _, _, tok = raw("POST", "/tokenize", {"messages": CHAT})
        self.assertEqual(r.usage.prompt_tokens, tok["count"])
        self.assertEqual(r.usage.completion_tokens, 6)
        self.assertEqual(r.usage.total_tokens, tok["count"] + 6)
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.choices[0].message.role, "assistant")
        self.assertTrue(r.choices[0].message.content)
        self.assertRegex(r.system_fingerprint, r"^fp_[0-9a-f]{16}$")
        self.assertTrue(r.id.startswith("chatcmpl-"))

    def test_completions_text_and_token_ids_agree(self):
        _, _, tok = raw("POST", "/tokenize", {"prompt": "The river runs"})
        a = client().completions.create(model=MODEL, prompt="The river runs", max_tokens=6)
        b = client().completions.create(model=MODEL, prompt=tok["tokens"], max_tokens=6)
        self.assertEqual(a.choices[0].text, b.choices[0].text)
        self.assertEqual(a.usage.prompt_tokens, len(tok["tokens"]))
        self.assertEqual(a.object, "text_completion")

    def test_streaming_equals_whole_and_seed_repeats(self):
        kw = dict(temperature=1.0, seed=1234, max_tokens=10, extra_body={"ignore_eos": True})
        whole = chat(**kw)
        again = chat(**kw)
        text, finish, usage = stream_chat(**kw)
        self.assertEqual(whole.choices[0].message.content, again.choices[0].message.content)
        self.assertEqual(text, whole.choices[0].message.content)
        self.assertEqual(finish, whole.choices[0].finish_reason)
        self.assertEqual(usage.completion_tokens, whole.usage.completion_tokens)
        self.assertEqual(usage.prompt_tokens, whole.usage.prompt_tokens)
        other = chat(**{**kw, "seed": 99})
        self.assertNotEqual(other.choices[0].message.content, whole.choices[0].message.content)

    def test_streamed_completions_equal_whole(self):
        kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0.9, seed=3)
        whole = client().completions.create(**kw)
        text = "".join(c.choices[0].text for c in client().completions.create(stream=True, **kw) if c.choices)
        self.assertEqual(text, whole.choices[0].text)

    def test_repeated_prompt_reuses_cached_tokens(self):
        msgs = [{"role": "system", "content": "You are a careful assistant who answers briefly. " * 4}, {"role": "user", "content": "Name a colour."}]
        first = chat(messages=msgs, max_tokens=2)
        second = chat(messages=msgs, max_tokens=2)
        self.assertGreater(second.usage.prompt_tokens_details.cached_tokens, 0)
        self.assertLess(second.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens)
        self.assertEqual(first.choices[0].message.content, second.choices[0].message.content)

    def test_stop_string_cuts_the_output_before_it(self):
        full = client().completions.create(model=MODEL, prompt="Numbers:", max_tokens=12, extra_body={"ignore_eos": True}).choices[0].text
        k = len(full) // 2
        stop = full[k : k + 2]
        self.assertEqual(len(stop), 2, full)
        r = client().completions.create(model=MODEL, prompt="Numbers:", max_tokens=12, stop=[stop, "\u2603never"], extra_body={"ignore_eos": True})
        self.assertEqual(r.choices[0].text, full[: full.index(stop)])
        self.assertEqual(r.choices[0].finish_reason, "stop")
        streamed = "".join(c.choices[0].text for c in client().completions.create(model=MODEL, prompt="Numbers:", max_tokens=12, stop=stop, stream=True, extra_body={"ignore_eos": True}) if c.choices)
        self.assertEqual(streamed, r.choices[0].text)

    def test_n_choices_use_consecutive_seeds(self):
        kw = dict(temperature=1.0, max_tokens=6, extra_body={"ignore_eos": True})
        r = chat(n=2, seed=500, **kw)
        self.assertEqual([c.index for c in r.choices], [0, 1])
        solo0 = chat(seed=500, **kw).choices[0].message.content
        solo1 = chat(seed=501, **kw).choices[0].message.content
        self.assertEqual([c.message.content for c in r.choices], [solo0, solo1])
        self.assertEqual(r.usage.completion_tokens, 12)

    def test_logprobs_are_sorted_and_greedy_picks_the_top(self):
        r = chat(max_tokens=4, logprobs=True, top_logprobs=3, temperature=0, extra_body={"ignore_eos": True})
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), 4)
        # The tokens are the raw text; the content is the answer trimmed at its edges, as the
        # chat template trims it when the turn is rendered back.
        self.assertEqual("".join(t.token for t in content).strip(), r.choices[0].message.content)
        for t in content:
            tops = [x.logprob for x in t.top_logprobs]
            self.assertEqual(len(tops), 3)
            self.assertEqual(tops, sorted(tops, reverse=True))
            self.assertLessEqual(tops[0], 0.0)
            self.assertEqual((t.token, t.logprob), (t.top_logprobs[0].token, t.top_logprobs[0].logprob))
        c = client().completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=2, temperature=0)
        lp = c.choices[0].logprobs
        self.assertEqual(len(lp.tokens), 3)
        self.assertEqual(lp.text_offset[0], 0)
        self.assertEqual(lp.text_offset[1], len(lp.tokens[0]))
        self.assertEqual(max(lp.top_logprobs[0].values()), lp.token_logprobs[0])

    def test_max_tokens_ends_with_length(self):
        r = chat(max_completion_tokens=3, extra_body={"ignore_eos": True})
        self.assertEqual((r.choices[0].finish_reason, r.usage.completion_tokens), ("length", 3))

    def test_sixteen_concurrent_requests_equal_their_solo_runs(self):
        cases = []
        for i in range(16):
            kw = dict(messages=[{"role": "user", "content": f"Request {i}: " + "word " * (i % 5)}], max_tokens=5 + i % 3, extra_body={"ignore_eos": True})
            kw.update(temperature=0) if i % 2 == 0 else kw.update(temperature=1.0, seed=i)
            cases.append(kw)
        solo = [chat(**kw).choices[0].message.content for kw in cases]
        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            together = list(ex.map(lambda kw: chat(**kw).choices[0].message.content, cases))
        self.assertEqual(together, solo)

    def test_disconnect_cancels_the_generation(self):
        aborted = metric('tensorfold:request_success_total{model_name="mlx-q4",finished_reason="abort"}')
        u = urlparse(BASE)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        body = json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 100000, "stream": True, "ignore_eos": True})
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        self.assertEqual(resp.status, 200)
        seen = 0
        while seen < 3:
            line = resp.readline()
            if line.startswith(b"data: "):
                seen += 1
        self.assertEqual(metric("tensorfold:num_requests_running"), 1)
        conn.sock.close()
        conn.close()
        self.assertEqual(wait_metric("tensorfold:num_requests_running", 0), 0)
        self.assertEqual(metric('tensorfold:request_success_total{model_name="mlx-q4",finished_reason="abort"}'), aborted + 1)

    def test_bad_requests_are_400s_naming_the_field(self):
        status, _, body = raw("POST", "/v1/chat/completions", b'{"messages": [')
        self.assertEqual((status, body["error"]["type"], body["error"]["code"]), (400, "invalid_request_error", "invalid_json"))
        status, _, body = raw("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": "ten"})
        self.assertEqual((status, body["error"]["param"]), (400, "max_tokens"))
        status, _, body = raw("POST", "/v1/chat/completions", {"messages": [{"content": "no role"}]})
        self.assertEqual((status, body["error"]["param"]), (400, "messages[0].role"))
        with self.assertRaises(openai.BadRequestError) as e:
            client().chat.completions.create(model="gpt-4o", messages=CHAT)
        self.assertEqual(e.exception.body["param"], "model")
        with self.assertRaises(openai.BadRequestError) as e:
            chat(n=1000)
        self.assertEqual(e.exception.body["param"], "n")
        with self.assertRaises(openai.BadRequestError) as e:
            chat(max_tokens=300000)
        self.assertEqual(e.exception.body["code"], "context_length_exceeded")
        self.assertIn("262144", e.exception.body["message"])
        with self.assertRaises(openai.BadRequestError) as e:
            chat(temperature=-1)
        self.assertEqual(e.exception.body["param"], "temperature")
        status, _, body = raw("POST", "/v1/completions", {"prompt": [1, -2]})
        self.assertEqual((status, body["error"]["param"]), (400, "prompt"))

    def test_tokenize_and_detokenize_round_trip(self):
        status, _, tok = raw("POST", "/tokenize", {"prompt": "hello world"})
        self.assertEqual(status, 200)
        self.assertEqual(tok["count"], len(tok["tokens"]))
        self.assertEqual(tok["max_model_len"], 262144)
        status, _, back = raw("POST", "/detokenize", {"tokens": tok["tokens"]})
        self.assertEqual((status, back), (200, {"prompt": "hello world"}))
        status, _, body = raw("POST", "/detokenize", {"tokens": [999999999]})
        self.assertEqual((status, body["error"]["param"]), (400, "tokens"))

    def test_metrics_count_tokens_and_latencies(self):
        before = metric("tensorfold:generation_tokens_total")
        chat(max_tokens=4, extra_body={"ignore_eos": True})
        self.assertEqual(metric("tensorfold:generation_tokens_total"), before + 4)
        self.assertGreater(metric("tensorfold:time_to_first_token_seconds_count"), 0)
        self.assertGreater(metric("tensorfold:inter_token_latency_seconds_count"), 0)
        self.assertGreater(metric("tensorfold:prefix_cache_queries_total"), 0)
        self.assertEqual(metric("tensorfold:num_requests_waiting"), 0)


class Limited(unittest.TestCase):
    def test_api_key_is_required_except_on_health(self):
        with self.assertRaises(openai.AuthenticationError) as e:
            client(key="wrong").models.list()
        self.assertEqual(e.exception.status_code, 401)
        status, _, body = raw("GET", "/v1/models")
        self.assertEqual((status, body["error"]["type"]), (401, "authentication_error"))
        self.assertEqual([m.id for m in client().models.list().data], [MODEL])
        status, _, _ = raw("GET", "/v1/models", headers={"x-api-key": KEY})
        self.assertEqual(status, 200)
        status, _, _ = raw("GET", "/health")
        self.assertEqual(status, 200)

    def test_full_queue_answers_503_with_retry_after(self):
        def open_stream():
            u = urlparse(BASE)
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
            body = json.dumps({"model": MODEL, "prompt": "Go", "max_tokens": 50, "stream": True, "ignore_eos": True})
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
            resp = conn.getresponse()
            self.assertEqual(resp.status, 200)
            return conn

        running = open_stream()
        self.assertEqual(wait_metric("tensorfold:num_requests_running", 1), 1)
        waiting = open_stream()
        self.assertEqual(wait_metric("tensorfold:num_requests_waiting", 1), 1)
        with self.assertRaises(openai.APIStatusError) as e:
            client().completions.create(model=MODEL, prompt="Go", max_tokens=2)
        self.assertEqual(e.exception.status_code, 503)
        self.assertEqual(e.exception.response.headers.get("retry-after"), "1")
        self.assertEqual(e.exception.body["code"], "queue_full")
        for c in (waiting, running):
            c.sock.close()
            c.close()
        self.assertEqual(wait_metric("tensorfold:num_requests_running", 0), 0)
        self.assertEqual(wait_metric("tensorfold:num_requests_waiting", 0), 0)

    def test_over_long_prompt_is_a_400_naming_the_numbers(self):
        def count(text):
            return raw("POST", "/tokenize", {"prompt": text}, headers={"Authorization": f"Bearer {KEY}"})[2]["count"]

        long, short = "word " * 100, "word " * 30
        with self.assertRaises(openai.BadRequestError) as e:
            client().completions.create(model=MODEL, prompt=long, max_tokens=2)
        self.assertEqual(e.exception.body["code"], "context_length_exceeded")
        self.assertEqual(e.exception.body["param"], "prompt")
        self.assertIn("maximum context length is 64 tokens", e.exception.body["message"])
        self.assertIn(f"the prompt holds {count(long)} tokens", e.exception.body["message"])
        with self.assertRaises(openai.BadRequestError) as e:
            client().completions.create(model=MODEL, prompt=short, max_tokens=40)
        self.assertEqual(e.exception.body["param"], "max_tokens")
        n = count(short)
        self.assertIn(f"asks for {n + 40} ({n} in the prompt, 40 in the completion", e.exception.body["message"])


if __name__ == "__main__":
    unittest.main(argv=sys.argv, verbosity=2)
