// The chat page of `tensorfold serve` in a real headless Chromium (Debian's package), driven by
// playwright-core. Run by tests/web.rs, which starts the servers and sets:
//   TF_BASE          http://127.0.0.1:PORT of a default server on the vocab fixture (random
//                    weights: the text is gibberish, but every token is really generated)
//   TF_LIMITED_BASE  a server started with --api-key TF_KEY --max-model-len 64
//   TF_KEY           that key
//   TF_CHROMIUM      the browser (default /usr/bin/chromium)
//   TF_SHOTS         optional: a folder to write the README's screenshots to
//   TF_WEB_DIR       optional, for working on the page: serve / and /assets/* from this folder
//                    (src/serve/web) instead of the binary, so no rebuild is needed
// Replies the fixture cannot write (Markdown, reasoning, tool calls, errors) are scripted: a
// page-level hook answers /v1/chat/completions with a crafted SSE stream, cut into small byte
// pieces that arrive over time, and everything else still goes to the real server.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { chromium } from 'playwright-core';

const BASE = process.env.TF_BASE;
const LIMITED = process.env.TF_LIMITED_BASE;
const KEY = process.env.TF_KEY;
const SHOTS = process.env.TF_SHOTS;
const WEB_DIR = process.env.TF_WEB_DIR;
const MODEL = 'mlx-q4';
if (!BASE || !LIMITED || !KEY) throw new Error('TF_BASE, TF_LIMITED_BASE and TF_KEY must be set (tests/web.rs sets them)');

let browser;

before(async () => {
  browser = await chromium.launch({
    executablePath: process.env.TF_CHROMIUM || '/usr/bin/chromium',
    headless: true,
    // The network here is closed: nothing that phones home, no sandbox (root in CI).
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
});

after(async () => {
  await browser?.close();
});

const TYPES = { '.html': 'text/html', '.js': 'text/javascript', '.css': 'text/css', '.svg': 'image/svg+xml' };

/** A fresh browser context (its own local storage) and page on `base`, with the SSE hook. */
async function open(base, opts = {}) {
  const context = await browser.newContext({ colorScheme: 'light', viewport: opts.viewport || { width: 1200, height: 800 }, deviceScaleFactor: opts.scale || 1 });
  await context.grantPermissions(['clipboard-read', 'clipboard-write'], { origin: base });
  if (WEB_DIR) {
    await context.route(
      (u) => u.pathname === '/' || u.pathname.startsWith('/assets/'),
      (route) => {
        const p = new URL(route.request().url()).pathname;
        const file = p === '/' ? 'index.html' : p.slice('/assets/'.length);
        route.fulfill({ status: 200, contentType: TYPES[path.extname(file)], body: fs.readFileSync(path.join(WEB_DIR, file)) });
      },
    );
  }
  await context.addInitScript(() => {
    // Test hook: while window.__scripted is set, /v1/chat/completions answers with its status,
    // headers and body pieces ([delay ms, byte values]; each piece is one read of the body),
    // and the request bodies are kept.
    const realFetch = window.fetch.bind(window);
    window.__requests = [];
    window.__scripted = null;
    window.fetch = async (input, init = {}) => {
      const url = typeof input === 'string' ? input : input.url;
      if (url.endsWith('/v1/chat/completions')) window.__requests.push({ body: JSON.parse(init.body), headers: init.headers });
      const s = window.__scripted;
      if (!s || !url.endsWith('/v1/chat/completions')) return realFetch(input, init);
      const body = new ReadableStream({
        async start(ctrl) {
          for (const [delay, bytes] of s.pieces) {
            if (delay) await new Promise((r) => setTimeout(r, delay));
            ctrl.enqueue(new Uint8Array(bytes));
          }
          ctrl.close();
        },
      });
      return new Response(body, { status: s.status, headers: s.headers });
    };
  });
  const page = await context.newPage();
  page.setDefaultTimeout(20000);
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  // The binary's page comes with a Content-Security-Policy: nothing it does may break it.
  page.on('console', (m) => /Content Security Policy/i.test(m.text()) && errors.push(m.text()));
  await page.goto(base + '/');
  return { context, page, errors };
}

/** Scripts the next replies: `events` (objects or strings) as SSE, in pieces of `piece` bytes. */
async function script(page, events, { status = 200, headers = { 'content-type': 'text/event-stream' }, piece = 7, delay = 0, raw } = {}) {
  const text = raw ?? events.map((e) => 'data: ' + (typeof e === 'string' ? e : JSON.stringify(e)) + '\n\n').join('');
  const bytes = [...Buffer.from(text, 'utf8')];
  const pieces = [];
  for (let i = 0; i < bytes.length; i += piece) pieces.push([delay, bytes.slice(i, i + piece)]);
  await page.evaluate((s) => (window.__scripted = s), { status, headers, pieces });
}

function chunk(delta, finish = null, extra = {}) {
  return { id: 'chatcmpl-test', object: 'chat.completion.chunk', created: 1, model: MODEL, choices: [{ index: 0, delta, logprobs: null, finish_reason: finish }], ...extra };
}

async function metric(base, name) {
  const text = await (await fetch(base + '/metrics')).text();
  const m = text.match(new RegExp('^' + name.replace(/[{}"=:]/g, (c) => '\\' + c) + '(\\{[^}]*\\})? (\\S+)$', 'm'));
  assert.ok(m, `${name} is not in /metrics`);
  return Number(m[2]);
}

async function until(what, fn, timeout = 15000) {
  const t0 = Date.now();
  for (;;) {
    const v = await fn();
    if (v) return v;
    if (Date.now() - t0 > timeout) throw new Error('timed out waiting for ' + what);
    await new Promise((r) => setTimeout(r, 40));
  }
}

/** Sets fields of the settings dialog through its form, then saves. */
async function settings(page, fields) {
  await page.click('#open-settings');
  for (const [k, v] of Object.entries(fields)) {
    const sel = `#settings-form [name="${k}"]`;
    if (k === 'thinking') await page.selectOption(sel, v);
    else await page.fill(sel, v);
  }
  await page.click('#settings-save');
  await page.waitForSelector('#settings', { state: 'hidden' });
}

async function say(page, text) {
  await page.fill('#input', text);
  await page.press('#input', 'Enter');
}

const lastReply = (page) => page.locator('article.msg.assistant').last();

async function waitDone(page) {
  await page.waitForSelector('article.msg.assistant:last-of-type:not([data-state="streaming"])');
  return lastReply(page);
}

// ------------------------------------------------------------------------ against the real server

test('a message streams a reply from the server, equal to the same request answered whole', async () => {
  const { context, page, errors } = await open(BASE);
  await page.waitForFunction(() => document.querySelector('#model-name').textContent === 'mlx-q4');
  assert.equal(await page.textContent('#model-ctx'), 'context 262,144 tokens');
  await settings(page, { max_tokens: '12', seed: '7', temperature: '0.8' });
  // The message box grows with its text (and Shift+Enter adds a line rather than sending).
  const h0 = await page.$eval('#input', (e) => e.clientHeight);
  await page.fill('#input', 'one');
  await page.press('#input', 'Shift+Enter');
  await page.keyboard.insertText('two\nthree\nfour');
  assert.equal(await page.inputValue('#input'), 'one\ntwo\nthree\nfour');
  assert.ok((await page.$eval('#input', (e) => e.clientHeight)) > h0 * 1.5, 'the message box did not grow');
  await say(page, 'Hello there');
  // The reply grows while it streams: several distinct lengths are seen before it ends.
  const seen = new Set();
  await page.waitForSelector('article.msg.assistant[data-state="streaming"]');
  assert.equal(await page.isVisible('#stop'), true, 'the stop button shows while streaming');
  while ((await lastReply(page).getAttribute('data-state')) === 'streaming') {
    seen.add((await lastReply(page).locator('.content').textContent()).length);
    await new Promise((r) => setTimeout(r, 25));
  }
  const reply = await waitDone(page);
  seen.delete(0);
  assert.ok(seen.size >= 3, `the reply did not stream (lengths seen: ${[...seen]})`);
  const shown = await reply.locator('.content').innerText();
  const stats = await reply.locator('.stats').textContent();
  assert.match(stats, /^12 tokens · TTFT \d+ ms · [\d.]+ tok\/s · cut at the token limit$/);
  // What the page asked for, and that its text is the server's for that request.
  const sent = await page.evaluate(() => window.__requests.at(-1).body);
  assert.equal(sent.model, MODEL);
  assert.equal(sent.stream, true);
  assert.deepEqual(sent.stream_options, { include_usage: true });
  assert.deepEqual([sent.max_tokens, sent.seed, sent.temperature], [12, 7, 0.8]);
  assert.deepEqual(sent.messages, [{ role: 'user', content: 'Hello there' }]);
  const whole = await (await fetch(BASE + '/v1/chat/completions', { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ ...sent, stream: false, stream_options: undefined }) })).json();
  const text = whole.choices[0].message.content;
  assert.equal(whole.usage.completion_tokens, 12);
  const expected = await page.evaluate(async (t) => {
    const { renderMarkdown } = await import('/assets/markdown.js');
    const d = document.createElement('div');
    d.className = 'md';
    d.append(renderMarkdown(t));
    document.body.append(d);
    const s = d.innerText;
    d.remove();
    return s;
  }, text);
  assert.equal(shown, expected, 'the streamed text differs from the whole response');
  assert.match(await page.textContent('#ctx-used'), /^\d+ \/ 262,144 tokens$/);
  assert.equal(await page.isVisible('#send'), true);
  // Regenerate with the same seed writes the same reply again.
  await reply.locator('button[data-action="regenerate"]').click();
  const again = await waitDone(page);
  assert.equal(await page.locator('article.msg').count(), 2);
  assert.equal(await again.locator('.content').innerText(), shown);
  // Edit the last user message: the conversation is cut there and the new text is sent.
  await page.locator('article.msg.user button[data-action="edit"]').click();
  await page.fill('article.msg.user textarea.edit-box', 'Hello again');
  await page.press('article.msg.user textarea.edit-box', 'Enter');
  await waitDone(page);
  assert.equal(await page.locator('article.msg').count(), 2);
  assert.equal(await page.textContent('article.msg.user .bubble'), 'Hello again');
  assert.deepEqual((await page.evaluate(() => window.__requests.at(-1).body)).messages, [{ role: 'user', content: 'Hello again' }]);
  assert.deepEqual(errors, []);
  await context.close();
});

test('stop ends the generation on the server; a reload finds the conversations', async () => {
  const { context, page, errors } = await open(BASE);
  await settings(page, { max_tokens: '6', seed: '3' });
  await say(page, 'First conversation');
  await waitDone(page);
  await page.click('#new-chat');
  // Long enough (about 20 tokens a second here) to be stopped well before its end.
  await settings(page, { max_tokens: '4000' });
  assert.equal(await page.locator('article.msg').count(), 0);
  const aborted = await metric(BASE, 'tensorfold:request_success_total{model_name="mlx-q4",finished_reason="abort"}');
  await say(page, 'Tell me a long story');
  await until('tokens of the long reply', async () => (await lastReply(page).locator('.content').textContent()).length > 20);
  assert.equal(await metric(BASE, 'tensorfold:num_requests_running'), 1);
  await page.click('#stop');
  const reply = await waitDone(page);
  assert.equal(await reply.getAttribute('data-state'), 'stopped');
  assert.match(await reply.locator('.stats').textContent(), /^~\d+ tokens · TTFT \d+ ms · [\d.]+ tok\/s · stopped$/);
  // The server saw the client go and freed the slot.
  await until('running sequences to drop to 0', async () => (await metric(BASE, 'tensorfold:num_requests_running')) === 0, 5000);
  assert.equal(await metric(BASE, 'tensorfold:request_success_total{model_name="mlx-q4",finished_reason="abort"}'), aborted + 1);
  assert.equal(await page.isVisible('#send'), true);
  const partial = await reply.locator('.content').innerText();
  assert.ok(partial.length > 0);
  await page.reload();
  await page.waitForSelector('#conversations .conv');
  const titles = await page.locator('#conversations .conv-title').allTextContents();
  assert.deepEqual(titles, ['Tell me a long story', 'First conversation']);
  assert.equal(await page.textContent('article.msg.user .bubble'), 'Tell me a long story');
  assert.equal(await lastReply(page).locator('.content').innerText(), partial);
  assert.equal(await lastReply(page).getAttribute('data-state'), 'stopped');
  await page.locator('#conversations .conv-title', { hasText: 'First conversation' }).click();
  assert.equal(await page.textContent('article.msg.user .bubble'), 'First conversation');
  assert.equal(await page.locator('#conversations .conv.current .conv-title').textContent(), 'First conversation');
  // Delete it: gone from the list, and after a reload too.
  await page.locator('#conversations .conv.current button[data-action="delete"]').click();
  await page.reload();
  await page.waitForSelector('#conversations .conv');
  assert.deepEqual(await page.locator('#conversations .conv-title').allTextContents(), ['Tell me a long story']);
  assert.deepEqual(errors, []);
  await context.close();
});

test('the key is asked for, kept and sent; an over-long prompt is a readable error', async () => {
  const { context, page, errors } = await open(LIMITED);
  await page.waitForSelector('#key-dialog[open]');
  assert.equal(await page.textContent('#model-name'), 'API key needed');
  await page.fill('#key-form [name="key"]', 'wrong-key');
  await page.click('#key-form button[value="save"]');
  await page.waitForFunction(() => document.querySelector('#key-reason').textContent.includes('refused the saved API key'));
  assert.equal(await page.isVisible('#key-dialog'), true);
  await page.fill('#key-form [name="key"]', KEY);
  await page.click('#key-form button[value="save"]');
  await page.waitForFunction(() => document.querySelector('#model-name').textContent === 'mlx-q4');
  assert.equal(await page.textContent('#model-ctx'), 'context 64 tokens');
  assert.equal(await page.evaluate(() => localStorage.getItem('tensorfold.chat.apiKey')), KEY);
  // A short message gets a reply, sent with the key.
  await settings(page, { max_tokens: '4' });
  await say(page, 'Hi');
  let reply = await waitDone(page);
  assert.equal(await reply.getAttribute('data-state'), 'done');
  assert.match(await reply.locator('.stats').textContent(), /^4 tokens/);
  assert.equal((await page.evaluate(() => window.__requests.at(-1).headers)).Authorization, 'Bearer ' + KEY);
  // Too long for the 64-token context: the server's numbers, said plainly.
  await page.click('#new-chat');
  await say(page, 'word '.repeat(100).trim());
  reply = await waitDone(page);
  assert.equal(await reply.getAttribute('data-state'), 'error');
  assert.equal(await reply.locator('.error-title').textContent(), 'The conversation is too long for the model’s context');
  assert.match(await reply.locator('.error-detail').textContent(), /maximum context length is 64 tokens, and the prompt holds \d+ tokens/);
  assert.equal(await reply.locator('button[data-action="regenerate"]').textContent(), 'Retry');
  // The key survives a reload; a wrong key in the settings is refused by the server and asked for again.
  await page.reload();
  await page.waitForFunction(() => document.querySelector('#model-name').textContent === 'mlx-q4');
  await settings(page, { api_key: 'not-it' });
  await page.waitForSelector('#key-dialog[open]');
  await page.click('#key-form button[value="cancel"]');
  await page.click('#new-chat');
  await say(page, 'Hi');
  reply = await waitDone(page);
  assert.equal(await reply.locator('.error-title').textContent(), 'The API key was refused');
  await page.waitForSelector('#key-dialog[open]');
  assert.deepEqual(errors, []);
  await context.close();
});

// ------------------------------------------------------------------------ scripted streams

test('the renderer: Markdown, code with a copy button, and model output that stays text', async () => {
  const { context, page, errors } = await open(BASE);
  const cases = await page.evaluate(async () => {
    const { renderMarkdown } = await import('/assets/markdown.js');
    const html = (t) => {
      const d = document.createElement('div');
      d.append(renderMarkdown(t));
      return d.innerHTML;
    };
    const A = (href, text, title) => `<a href="${href}" target="_blank" rel="noopener noreferrer"${title ? ` title="${title}"` : ''}>${text}</a>`;
    const copy = '<button class="copy-code" type="button" title="Copy the code">Copy</button>';
    return [
      ['Hello *world*', '<p>Hello <em>world</em></p>'],
      ['**bold** and __strong__ and _em_ and ~~gone~~', '<p><strong>bold</strong> and <strong>strong</strong> and <em>em</em> and <del>gone</del></p>'],
      ['snake_case_name and 2 * 3 * 4 and ~5', '<p>snake_case_name and 2 * 3 * 4 and ~5</p>'],
      ['***both*** and **a *b* c**', '<p><strong><em>both</em></strong> and <strong>a <em>b</em> c</strong></p>'],
      ['**open and `tick', '<p>**open and `tick</p>'],
      ['# Title\n## Sub ##\ntext', '<h1>Title</h1><h2>Sub</h2><p>text</p>'],
      ['one\ntwo', '<p>one<br>two</p>'],
      ['- a\n- b\n  - c\n\n1. x\n2. y', '<ul><li>a</li><li>b<ul><li>c</li></ul></li></ul><ol><li>x</li><li>y</li></ol>'],
      ['- a\n\n- b', '<ul><li><p>a</p></li><li><p>b</p></li></ul>'],
      ['3. c\n4. d', '<ol start="3"><li>c</li><li>d</li></ol>'],
      ['- [x] done\n- [ ] todo', '<ul><li class="task"><input type="checkbox" disabled="" checked="">done</li><li class="task"><input type="checkbox" disabled="">todo</li></ul>'],
      ['```py\nprint("<b>")\n```\nafter', `<div class="code-block"><div class="code-head"><span class="code-lang">py</span>${copy}</div><pre><code class="language-py">print("&lt;b&gt;")</code></pre></div><p>after</p>`],
      ['```\nstill going', `<div class="code-block"><div class="code-head"><span class="code-lang">text</span>${copy}</div><pre><code>still going</code></pre></div>`],
      ['> quoted `x*y*`\n\n---\nafter\\*', '<blockquote><p>quoted <code>x*y*</code></p></blockquote><hr><p>after*</p>'],
      ['| a | b |\n|:--|--:|\n| 1 | **2** |', '<div class="table-wrap"><table><thead><tr><th class="align-left">a</th><th class="align-right">b</th></tr></thead><tbody><tr><td class="align-left">1</td><td class="align-right"><strong>2</strong></td></tr></tbody></table></div>'],
      ['<script>alert(1)</script><img src=x onerror=alert(2)>', '<p>&lt;script&gt;alert(1)&lt;/script&gt;&lt;img src=x onerror=alert(2)&gt;</p>'],
      [
        '[ok](https://example.com "T") [bad](javascript:alert(1)) <https://a.b/c> see https://x.org/p.',
        `<p>${A('https://example.com', 'ok', 'T')} <span class="link-unsafe">bad (javascript:alert(1))</span> ${A('https://a.b/c', 'https://a.b/c')} see ${A('https://x.org/p', 'https://x.org/p')}.</p>`,
      ],
      ['![cat](https://e.com/c.png) ![x](data:image/png;base64,AAAA)', '<p><a class="image-link" href="https://e.com/c.png" target="_blank" rel="noopener noreferrer">[image: cat]</a> <span class="link-unsafe">x (data:image/png;base64,AAAA)</span></p>'],
    ].map(([src, want]) => ({ src, want, got: html(src) }));
  });
  for (const c of cases) assert.equal(c.got, c.want, 'rendering ' + JSON.stringify(c.src));

  // A scripted reply with Markdown, a code block and markup that must stay text.
  const content = '## Result\n\nSome **bold** text <script>window.__xss = 1</script> and <img src=x onerror="window.__xss = 2">.\n\n```js\nconst s = "<b>é</b>";\n```\n\n[click](javascript:window.__xss=3)';
  const pieces = content.match(/[\s\S]{1,5}/g);
  await script(page, [chunk({ role: 'assistant', content: '' }), ...pieces.map((p) => chunk({ content: p })), chunk({}, 'stop'), { ...chunk({}), choices: [], usage: { prompt_tokens: 5, completion_tokens: 40, total_tokens: 45 } }, '[DONE]']);
  await say(page, 'Show me');
  const reply = await waitDone(page);
  assert.equal(await reply.getAttribute('data-state'), 'done');
  assert.equal(await reply.locator('.content h2').textContent(), 'Result');
  assert.equal(await reply.locator('.content strong').textContent(), 'bold');
  assert.equal(await page.locator('.content script, .content img, #messages [onerror]').count(), 0);
  assert.equal(await page.evaluate(() => window.__xss), undefined);
  assert.match(await reply.locator('.content p').first().textContent(), /<script>window.__xss = 1<\/script> and <img src=x onerror="window.__xss = 2">/);
  assert.equal(await page.locator('.content a').count(), 0);
  assert.equal(await reply.locator('.code-lang').textContent(), 'js');
  assert.equal(await reply.locator('pre code').textContent(), 'const s = "<b>é</b>";');
  assert.match(await reply.locator('.stats').textContent(), /^40 tokens · TTFT \d+ ms · [\d.]+ tok\/s$/);
  assert.equal(await page.textContent('#ctx-used'), '45 / 262,144 tokens');
  await reply.locator('.copy-code').click();
  await until('the copy button to answer', async () => (await reply.locator('.copy-code').textContent()) === 'Copied', 3000);
  assert.equal(await page.evaluate(() => navigator.clipboard.readText()), 'const s = "<b>é</b>";');
  await reply.locator('button[data-action="copy-msg"]').click();
  await until('the message copy', async () => (await page.evaluate(() => navigator.clipboard.readText())) === content, 3000);
  assert.deepEqual(errors, []);
  await context.close();
});

test('the SSE reader takes a stream cut anywhere', async () => {
  const { context, page } = await open(BASE);
  const r = await page.evaluate(async () => {
    const { SseParser } = await import('/assets/stream.js');
    const text = ': keep-alive\r\n\r\ndata: {"a":"é✓"}\r\n\r\ndata: line1\ndata:line2\n\nevent: x\nid: 3\ndata: [DONE]\n\ndata: tail';
    const run = (parts) => {
      const p = new SseParser();
      return [...parts.flatMap((s) => p.push(s)), ...p.end()];
    };
    const whole = run([text]);
    const bad = [];
    for (let k = 0; k <= text.length; k++) {
      const got = run([text.slice(0, k), text.slice(k)]);
      if (JSON.stringify(got) !== JSON.stringify(whole)) bad.push(k);
    }
    const single = run([...text]);
    return { whole, bad, single };
  });
  assert.deepEqual(r.whole, ['{"a":"é✓"}', 'line1\nline2', '[DONE]', 'tail']);
  assert.deepEqual(r.bad, []);
  assert.deepEqual(r.single, r.whole);
  await context.close();
});

test('reasoning shows collapsed apart from the answer; tool calls arriving in pieces show as calls', async () => {
  const { context, page, errors } = await open(BASE);
  await script(page, [
    chunk({ role: 'assistant', content: '' }),
    chunk({ reasoning_content: 'The user wants ' }),
    // A server may send both fields with the same text: it is shown once.
    chunk({ reasoning_content: 'the weather in ', reasoning: 'the weather in ' }),
    chunk({ reasoning: 'Paris — “météo”.' }),
    chunk({ content: 'Let me check.' }),
    chunk({ tool_calls: [{ index: 0, id: 'call_1', type: 'function', function: { name: 'get_', arguments: '' } }] }),
    chunk({ tool_calls: [{ index: 0, function: { name: 'weather', arguments: '{"city": ' } }] }),
    chunk({ tool_calls: [{ index: 0, function: { arguments: '"Paris", "days": 2}' } }] }),
    chunk({ tool_calls: [{ index: 1, id: 'call_2', type: 'function', function: { name: 'clock', arguments: '{}' } }] }),
    chunk({}, 'tool_calls'),
    { ...chunk({}), choices: [], usage: { prompt_tokens: 12, completion_tokens: 31, total_tokens: 43 } },
    '[DONE]',
  ], { piece: 3 });
  await settings(page, { thinking: 'on', tools: '[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]' });
  await say(page, 'Weather in Paris?');
  const reply = await waitDone(page);
  const details = reply.locator('details.reasoning');
  assert.equal(await details.getAttribute('open'), null, 'the reasoning starts collapsed');
  assert.equal(await details.locator('.reasoning-state').textContent(), '9 words');
  assert.equal(await details.locator('.reasoning-body').textContent(), 'The user wants the weather in Paris — “météo”.');
  assert.equal(await details.locator('.reasoning-body').isVisible(), false);
  await details.locator('summary').click();
  assert.equal(await details.locator('.reasoning-body').isVisible(), true);
  assert.equal(await reply.locator('.content').textContent(), 'Let me check.');
  const calls = reply.locator('.tool-call');
  assert.equal(await calls.count(), 2);
  assert.deepEqual(await calls.locator('.tool-name').allTextContents(), ['get_weather', 'clock']);
  assert.deepEqual(await calls.locator('.tool-id').allTextContents(), ['call_1', 'call_2']);
  assert.equal(await calls.first().locator('.tool-args').textContent(), '{\n  "city": "Paris",\n  "days": 2\n}');
  assert.equal(await page.locator('#messages').innerText().then((t) => t.includes('<tool_call>')), false);
  assert.equal(await reply.locator('.stats').textContent().then((t) => t.replace(/TTFT \d+ ms · [\d.]+ tok\/s/, 'T')), '31 tokens · T · ended with tool calls');
  const first = await page.evaluate(() => window.__requests.at(-1).body);
  assert.deepEqual(first.chat_template_kwargs, { enable_thinking: true });
  assert.equal(first.tools[0].function.name, 'get_weather');
  // The next turn sends the calls and the reasoning back in the history.
  await script(page, [chunk({ content: 'Sunny.' }), chunk({}, 'stop'), '[DONE]']);
  await say(page, 'Thanks');
  await waitDone(page);
  const next = await page.evaluate(() => window.__requests.at(-1).body);
  assert.deepEqual(next.messages[1], {
    role: 'assistant',
    content: 'Let me check.',
    tool_calls: [
      { id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city": "Paris", "days": 2}' } },
      { id: 'call_2', type: 'function', function: { name: 'clock', arguments: '{}' } },
    ],
    reasoning_content: 'The user wants the weather in Paris — “météo”.',
  });
  assert.deepEqual(errors, []);
  await context.close();
});

test('server errors are readable: a full queue, an error inside the stream, no server', async () => {
  const { context, page, errors } = await open(BASE);
  await script(page, null, { status: 503, headers: { 'content-type': 'application/json', 'retry-after': '2' }, raw: JSON.stringify({ error: { message: 'the server is busy: 256 requests are waiting (--max-waiting 256)', type: 'server_error', param: null, code: 'queue_full' } }) });
  await say(page, 'Hi');
  let reply = await waitDone(page);
  assert.equal(await reply.locator('.error-title').textContent(), 'The server is busy: its queue is full');
  assert.equal(await reply.locator('.error-detail').textContent(), 'the server is busy: 256 requests are waiting (--max-waiting 256). Try again in 2 s.');
  await script(page, [chunk({ content: 'partial ' }), { error: { message: 'generation of choice 0 failed: out of memory', type: 'server_error', param: null, code: null } }, '[DONE]']);
  await reply.locator('button[data-action="regenerate"]').click();
  reply = await waitDone(page);
  assert.equal(await reply.locator('.content').textContent(), 'partial');
  assert.equal(await reply.locator('.error-title').textContent(), 'Generation failed');
  assert.equal(await reply.locator('.error-detail').textContent(), 'generation of choice 0 failed: out of memory');
  await script(page, null, { status: 400, headers: { 'content-type': 'application/json' }, raw: JSON.stringify({ error: { message: '`top_p` = 0 is invalid: it must be in (0, 1]', type: 'invalid_request_error', param: 'top_p', code: null } }) });
  await reply.locator('button[data-action="regenerate"]').click();
  reply = await waitDone(page);
  assert.equal(await reply.locator('.error-title').textContent(), 'The server refused the request (field top_p)');
  await page.evaluate(() => (window.__scripted = null));
  await page.route('**/v1/chat/completions', (route) => route.abort('connectionrefused'));
  await reply.locator('button[data-action="regenerate"]').click();
  reply = await waitDone(page);
  assert.equal(await reply.locator('.error-title').textContent(), 'Could not reach the server');
  // Settings refuse values the server would refuse, naming them.
  await page.click('#open-settings');
  await page.fill('#settings-form [name="top_p"]', '1.5');
  await page.click('#settings-save');
  assert.equal(await page.textContent('#settings-error'), 'Top-p must be in (0, 1].');
  await page.fill('#settings-form [name="top_p"]', '');
  await page.fill('#settings-form [name="tools"]', '{"not": "an array"}');
  await page.click('#settings-save');
  assert.equal(await page.textContent('#settings-error'), 'Tools must be a JSON array of tool objects.');
  assert.deepEqual(errors, []);
  await context.close();
});

// ------------------------------------------------------------------------ screenshots for the README

const DEMO_REASONING = 'The user wants to read a file line by line. BufReader over File, then lines(); errors go up with `?`.';
const DEMO = `Wrap the file in a \`BufReader\` and iterate over \`lines()\`; each item is an \`io::Result<String>\`:

\`\`\`rust
use std::fs::File;
use std::io::{self, BufRead, BufReader};

fn main() -> io::Result<()> {
    let file = File::open("notes.txt")?;
    for (n, line) in BufReader::new(file).lines().enumerate() {
        println!("{:>4}  {}", n + 1, line?);
    }
    Ok(())
}
\`\`\`

- **Buffered**: one read per 8 KiB, not one per line.
- Lines come without their \`\\n\` (and \`\\r\\n\`).
- For non-UTF-8 input use \`read_until(b'\\n', &mut buf)\`.`;

test('screenshots of the page, wide and narrow (TF_SHOTS)', { skip: !SHOTS && 'TF_SHOTS is not set' }, async () => {
  fs.mkdirSync(SHOTS, { recursive: true });
  const { context, page, errors } = await open(BASE, { viewport: { width: 1280, height: 800 } });
  await page.waitForFunction(() => document.querySelector('#model-name').textContent === 'mlx-q4');
  // One real exchange with the fixture (gibberish), kept in the list behind the demo one.
  await settings(page, { max_tokens: '12', seed: '1' });
  await say(page, 'Say something');
  await waitDone(page);
  await page.click('#new-chat');
  // The demo reply is scripted (tokens a few ms apart), since the fixture's weights are random.
  const tokens = DEMO.match(/\s*\S{1,4}|\s+/g);
  const events = [chunk({ role: 'assistant', content: '' }), ...DEMO_REASONING.match(/\s*\S+/g).map((t) => chunk({ reasoning_content: t })), ...tokens.map((t) => chunk({ content: t })), chunk({}, 'stop')];
  const n = events.length - 2;
  events.push({ ...chunk({}), choices: [], usage: { prompt_tokens: 31, completion_tokens: n, total_tokens: 31 + n } }, '[DONE]');
  await script(page, events, { piece: 180, delay: 18 });
  await say(page, 'How do I read a file line by line in Rust?');
  await waitDone(page);
  await page.mouse.move(0, 0);
  await page.screenshot({ path: path.join(SHOTS, 'webchat-wide.png') });
  await page.setViewportSize({ width: 390, height: 800 });
  // The conversation list slides away when the window narrows: wait for it to be gone.
  await page.waitForFunction(() => document.querySelector('#sidebar').getBoundingClientRect().right <= 0);
  await page.evaluate(() => (document.querySelector('#messages').scrollTop = 0));
  await page.screenshot({ path: path.join(SHOTS, 'webchat-narrow.png') });
  assert.deepEqual(errors, []);
  await context.close();
});
