// The chat page of `tensorfold serve`: one conversation view over the server's own
// OpenAI-compatible API (/v1/models, /v1/chat/completions streamed), conversations and settings
// in the browser's local storage. No framework: the view is rebuilt from the state when the
// conversation changes, and only the reply in progress is updated while it streams.

import { renderMarkdown } from './markdown.js';
import { SseParser, ReplyBuilder, describeError } from './stream.js';

const STORE = { convs: 'tensorfold.chat.conversations.v1', current: 'tensorfold.chat.current.v1', settings: 'tensorfold.chat.settings.v1', key: 'tensorfold.chat.apiKey' };
const NUMERIC = ['temperature', 'top_p', 'top_k', 'min_p', 'max_tokens', 'seed'];
const DEFAULT_SETTINGS = { system: '', temperature: '', top_p: '', top_k: '', min_p: '', max_tokens: '', seed: '', thinking: 'default', tools: '' };
/** How often a reply in progress is written to local storage (ms). */
const SAVE_EVERY_MS = 500;

const $ = (sel) => document.querySelector(sel);
const ui = {
  sidebar: $('#sidebar'),
  list: $('#conversations'),
  scrim: $('#scrim'),
  messages: $('#messages'),
  input: $('#input'),
  send: $('#send'),
  stop: $('#stop'),
  modelName: $('#model-name'),
  modelCtx: $('#model-ctx'),
  ctxUsed: $('#ctx-used'),
  toast: $('#toast'),
  settings: $('#settings'),
  settingsForm: $('#settings-form'),
  settingsError: $('#settings-error'),
  keyDialog: $('#key-dialog'),
  keyForm: $('#key-form'),
  keyReason: $('#key-reason'),
};

const state = {
  convs: [],
  currentId: null,
  settings: { ...DEFAULT_SETTINGS },
  /** {id, maxLen} from /v1/models, once read. */
  model: null,
  /** The generation in progress: {conv, reply, ctrl, el}. */
  live: null,
  lastSave: 0,
};

// ---------------------------------------------------------------- storage

function readJson(key, fallback) {
  try {
    const v = localStorage.getItem(key);
    return v === null ? fallback : JSON.parse(v);
  } catch {
    return fallback;
  }
}

function writeJson(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
    return true;
  } catch (e) {
    toast('Could not save to local storage (' + (e && e.name) + '): delete old conversations to make room.');
    return false;
  }
}

function saveConvs() {
  state.lastSave = performance.now();
  writeJson(STORE.convs, state.convs);
  writeJson(STORE.current, state.currentId);
}

function apiKey() {
  try {
    return localStorage.getItem(STORE.key) || '';
  } catch {
    return '';
  }
}

function setApiKey(k) {
  try {
    if (k) localStorage.setItem(STORE.key, k);
    else localStorage.removeItem(STORE.key);
  } catch {
    toast('Could not keep the API key in local storage.');
  }
}

function load() {
  const convs = readJson(STORE.convs, []);
  state.convs = Array.isArray(convs) ? convs.filter((c) => c && typeof c.id === 'string' && Array.isArray(c.messages)) : [];
  // A reply that was streaming when the page went away was cut there.
  for (const c of state.convs) {
    for (const m of c.messages) {
      if (m.pending) {
        m.pending = false;
        m.stopped = true;
      }
    }
  }
  const cur = readJson(STORE.current, null);
  state.currentId = state.convs.some((c) => c.id === cur) ? cur : null;
  const s = readJson(STORE.settings, {});
  state.settings = { ...DEFAULT_SETTINGS };
  for (const k of Object.keys(DEFAULT_SETTINGS)) if (s && typeof s[k] === 'string') state.settings[k] = s[k];
}

// ---------------------------------------------------------------- small helpers

function node(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function button(label, action, title) {
  const b = node('button', 'icon-button', label);
  b.type = 'button';
  b.dataset.action = action;
  if (title) b.title = title;
  return b;
}

let toastTimer = 0;
function toast(text) {
  ui.toast.textContent = text;
  ui.toast.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => (ui.toast.hidden = true), 4000);
}

function fmtMs(ms) {
  return ms < 1000 ? Math.round(ms) + ' ms' : (ms / 1000).toFixed(2) + ' s';
}

function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 10);
}

function current() {
  return state.convs.find((c) => c.id === state.currentId) || null;
}

function authHeaders() {
  const k = apiKey();
  return k ? { Authorization: 'Bearer ' + k } : {};
}

async function copyText(text) {
  try {
    if (navigator.clipboard && window.isSecureContext) {
      await navigator.clipboard.writeText(text);
      return true;
    }
  } catch {
    // fall back to the selection below
  }
  const ta = node('textarea', 'offscreen');
  ta.value = text;
  ta.setAttribute('readonly', '');
  document.body.append(ta);
  ta.select();
  let ok = false;
  try {
    ok = document.execCommand('copy');
  } catch {
    ok = false;
  }
  ta.remove();
  return ok;
}

// ---------------------------------------------------------------- the model

async function loadModel() {
  ui.modelName.textContent = 'connecting…';
  ui.modelCtx.textContent = '';
  let r;
  try {
    r = await fetch('/v1/models', { headers: authHeaders() });
  } catch (e) {
    ui.modelName.textContent = 'server unreachable';
    return;
  }
  if (r.status === 401 || r.status === 403) {
    ui.modelName.textContent = 'API key needed';
    openKeyDialog(apiKey() ? 'The server refused the saved API key. Enter the key it was started with (--api-key).' : 'This server needs an API key (it was started with --api-key).');
    return;
  }
  if (!r.ok) {
    ui.modelName.textContent = 'model list failed (HTTP ' + r.status + ')';
    return;
  }
  const v = await r.json().catch(() => null);
  const m = v && Array.isArray(v.data) ? v.data[0] : null;
  if (!m) {
    ui.modelName.textContent = 'no model served';
    return;
  }
  const maxLen = Number.isFinite(m.max_model_len) ? m.max_model_len : null;
  state.model = { id: String(m.id), maxLen };
  ui.modelName.textContent = state.model.id;
  ui.modelCtx.textContent = maxLen ? `context ${maxLen.toLocaleString('en-US')} tokens` : '';
  document.title = state.model.id + ' · tensorfold chat';
  renderContextUse();
}

// ---------------------------------------------------------------- rendering

function renderSidebar() {
  ui.list.replaceChildren();
  const convs = [...state.convs].sort((a, b) => (b.updated || 0) - (a.updated || 0));
  for (const c of convs) {
    const row = node('div', 'conv' + (c.id === state.currentId ? ' current' : ''));
    row.dataset.id = c.id;
    const open = node('button', 'conv-title', c.title || 'New chat');
    open.type = 'button';
    open.dataset.action = 'open';
    open.title = c.title || '';
    const del = button('×', 'delete', 'Delete this conversation');
    del.setAttribute('aria-label', 'Delete conversation ' + (c.title || ''));
    row.append(open, del);
    ui.list.append(row);
  }
  if (!convs.length) ui.list.append(node('p', 'empty-list', 'Conversations are kept in this browser.'));
}

function renderThread() {
  const conv = current();
  ui.messages.replaceChildren();
  if (!conv || !conv.messages.length) {
    const empty = node('div', 'empty-state');
    empty.append(node('h1', '', state.model ? state.model.id : 'tensorfold'), node('p', '', 'Send a message to start a conversation.'));
    ui.messages.append(empty);
  } else {
    const lastUser = conv.messages.map((m) => m.role).lastIndexOf('user');
    conv.messages.forEach((m, i) => {
      const last = i === conv.messages.length - 1;
      const el = m.role === 'user' ? userView(m, i === lastUser) : assistantView(m, last);
      el.dataset.index = String(i);
      ui.messages.append(el);
      if (state.live && state.live.reply === m) state.live.el = el;
    });
  }
  ui.messages.scrollTop = ui.messages.scrollHeight;
  renderContextUse();
}

function renderContextUse() {
  const conv = current();
  const last = conv ? [...conv.messages].reverse().find((m) => m.role === 'assistant' && m.stats && Number.isFinite(m.stats.prompt)) : null;
  if (!last) {
    ui.ctxUsed.textContent = '';
    return;
  }
  const used = last.stats.prompt + last.stats.tokens;
  ui.ctxUsed.textContent = state.model && state.model.maxLen ? `${used.toLocaleString('en-US')} / ${state.model.maxLen.toLocaleString('en-US')} tokens` : `${used.toLocaleString('en-US')} tokens`;
}

function userView(m, editable) {
  const el = node('article', 'msg user');
  el.append(node('div', 'bubble', m.content));
  if (editable && !state.live) {
    const foot = node('footer', 'meta');
    foot.append(button('Edit', 'edit', 'Edit this message and send it again'));
    el.append(foot);
  }
  return el;
}

function assistantView(m, last) {
  const el = node('article', 'msg assistant');
  updateAssistant(el, m, last);
  return el;
}

/** Fills `el` (an assistant article) from `m`, keeping the reasoning block's open state. */
function updateAssistant(el, m, last) {
  const live = state.live && state.live.reply === m;
  el.dataset.state = live ? 'streaming' : m.error ? 'error' : m.stopped ? 'stopped' : 'done';
  let details = el.querySelector(':scope > details.reasoning');
  if (m.reasoning) {
    if (!details) {
      details = node('details', 'reasoning');
      const summary = node('summary');
      summary.append(node('span', 'reasoning-label', 'Reasoning'), node('span', 'reasoning-state'));
      details.append(summary, node('div', 'md reasoning-body'));
      el.prepend(details);
    }
    const thinking = live && !m.content && !(m.tool_calls && m.tool_calls.length);
    const words = m.reasoning.trim().split(/\s+/).filter(Boolean).length;
    details.querySelector('.reasoning-state').textContent = thinking ? 'thinking…' : `${words} word${words === 1 ? '' : 's'}`;
    details.querySelector('.reasoning-body').replaceChildren(renderMarkdown(m.reasoning));
  } else if (details) {
    details.remove();
  }
  let content = el.querySelector(':scope > .content');
  if (!content) {
    content = node('div', 'md content');
    el.append(content);
  }
  content.replaceChildren(renderMarkdown(m.content || ''));
  content.classList.toggle('streaming', live);
  let calls = el.querySelector(':scope > .tool-calls');
  if (m.tool_calls && m.tool_calls.length) {
    if (!calls) {
      calls = node('div', 'tool-calls');
      content.after(calls);
    }
    calls.replaceChildren(...m.tool_calls.map(toolCallView));
  } else if (calls) {
    calls.remove();
  }
  el.querySelector(':scope > .error')?.remove();
  if (m.error) {
    const box = node('div', 'error');
    box.setAttribute('role', 'alert');
    box.append(node('strong', 'error-title', m.error.title), node('span', 'error-detail', m.error.detail || ''));
    el.append(box);
  }
  el.querySelector(':scope > footer')?.remove();
  const foot = node('footer', 'meta');
  foot.append(node('span', 'stats', live ? 'generating…' : statsText(m)));
  if (!live) {
    // The buttons wrap together below the figures when the window is narrow.
    const actions = node('span', 'actions');
    if (m.content) actions.append(button('Copy', 'copy-msg', 'Copy the answer as Markdown'));
    if (last && !state.live) actions.append(button(m.error ? 'Retry' : 'Regenerate', 'regenerate', 'Generate this reply again'));
    if (actions.children.length) foot.append(actions);
  }
  el.append(foot);
}

function toolCallView(tc) {
  const box = node('div', 'tool-call');
  const head = node('div', 'tool-head');
  head.append(node('span', 'tool-badge', 'tool call'), node('code', 'tool-name', (tc.function && tc.function.name) || '(unnamed)'));
  if (tc.id) head.append(node('span', 'tool-id', tc.id));
  const raw = (tc.function && tc.function.arguments) || '';
  let text = raw;
  try {
    text = raw.trim() ? JSON.stringify(JSON.parse(raw), null, 2) : '{}';
  } catch {
    // still arriving, or not JSON: shown as it came
  }
  box.append(head, node('pre', 'tool-args', text));
  return box;
}

function statsText(m) {
  const s = m.stats;
  const parts = [];
  if (s && (s.tokens > 0 || !(m.error || m.stopped))) {
    parts.push(`${s.estimated ? '~' : ''}${s.tokens} token${s.tokens === 1 ? '' : 's'}`);
    if (Number.isFinite(s.ttftMs)) parts.push('TTFT ' + fmtMs(s.ttftMs));
    if (Number.isFinite(s.tokensPerSecond)) parts.push(s.tokensPerSecond.toFixed(1) + ' tok/s');
  }
  if (m.stopped) parts.push('stopped');
  else if (m.finish === 'length') parts.push('cut at the token limit');
  else if (m.finish === 'tool_calls') parts.push('ended with tool calls');
  return parts.join(' · ');
}

function nearBottom() {
  const e = ui.messages;
  return e.scrollHeight - e.scrollTop - e.clientHeight < 80;
}

let frame = 0;
/** Redraws the reply in progress at the next frame (at most once a frame). */
function scheduleLiveRender() {
  if (frame) return;
  frame = requestAnimationFrame(() => {
    frame = 0;
    const live = state.live;
    if (!live || !live.el || !live.el.isConnected) return;
    const stick = nearBottom();
    updateAssistant(live.el, live.reply, true);
    if (stick) ui.messages.scrollTop = ui.messages.scrollHeight;
  });
}

function setBusy(busy) {
  document.body.dataset.busy = busy ? 'true' : 'false';
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
}

// ---------------------------------------------------------------- generation

function requestBody(history) {
  const s = state.settings;
  const messages = [];
  if (s.system.trim()) messages.push({ role: 'system', content: s.system });
  for (const m of history) {
    if (m.role === 'user') {
      messages.push({ role: 'user', content: m.content });
    } else if (m.role === 'assistant' && !m.error) {
      const calls = m.tool_calls || [];
      if (!m.content && !calls.length) continue;
      const out = { role: 'assistant', content: m.content || '' };
      if (calls.length) out.tool_calls = calls;
      if (m.reasoning) out.reasoning_content = m.reasoning;
      messages.push(out);
    }
  }
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (state.model) body.model = state.model.id;
  for (const k of NUMERIC) if (s[k] !== '') body[k] = Number(s[k]);
  if (s.thinking !== 'default') body.chat_template_kwargs = { enable_thinking: s.thinking === 'on' };
  if (s.tools.trim()) body.tools = JSON.parse(s.tools);
  return body;
}

/** Streams a reply to `conv`'s messages into a new assistant message at its end. */
async function generate(conv) {
  const reply = { role: 'assistant', content: '', reasoning: '', tool_calls: [], pending: true };
  const history = conv.messages.slice();
  conv.messages.push(reply);
  conv.updated = Date.now();
  const ctrl = new AbortController();
  state.live = { conv, reply, ctrl, el: null };
  setBusy(true);
  saveConvs();
  renderSidebar();
  if (conv.id === state.currentId) renderThread();

  const b = new ReplyBuilder();
  const sentAt = performance.now();
  const sync = () => {
    reply.content = b.content;
    reply.reasoning = b.reasoning;
    reply.tool_calls = b.calls();
    if (b.finish) reply.finish = b.finish;
  };
  try {
    let body;
    try {
      body = JSON.stringify(requestBody(history));
    } catch (e) {
      reply.error = { kind: 'request', title: 'The settings could not be sent', detail: String(e.message || e) };
      return;
    }
    const r = await fetch('/v1/chat/completions', { method: 'POST', headers: { 'Content-Type': 'application/json', ...authHeaders() }, body, signal: ctrl.signal });
    if (!r.ok) {
      reply.error = describeError(r.status, await r.text(), r.headers.get('Retry-After'));
      if (reply.error.kind === 'auth') openKeyDialog('The server refused the API key. Enter the key it was started with (--api-key), then press Retry.');
      return;
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    const sse = new SseParser();
    let done = false;
    const take = (events) => {
      for (const data of events) {
        if (data === '[DONE]') {
          done = true;
          continue;
        }
        let chunk;
        try {
          chunk = JSON.parse(data);
        } catch {
          reply.error = { kind: 'server', title: 'The server sent a chunk that is not JSON', detail: data.slice(0, 200) };
          continue;
        }
        if (b.apply(chunk, performance.now())) {
          sync();
          if (b.error) reply.error = { kind: 'server', title: 'Generation failed', detail: String(b.error.message || JSON.stringify(b.error)) };
          scheduleLiveRender();
        }
      }
      if (performance.now() - state.lastSave > SAVE_EVERY_MS) saveConvs();
    };
    for (;;) {
      const { value, done: eof } = await reader.read();
      if (eof) break;
      take(sse.push(decoder.decode(value, { stream: true })));
    }
    take(sse.push(decoder.decode()));
    take(sse.end());
    if (!done && !reply.error) reply.error = { kind: 'server', title: 'The stream ended early', detail: 'The connection closed before the reply was complete.' };
  } catch (e) {
    if (e && e.name === 'AbortError') reply.stopped = true;
    else reply.error = describeError(0, String((e && e.message) || e));
  } finally {
    sync();
    reply.pending = false;
    reply.stats = b.stats(sentAt);
    conv.updated = Date.now();
    state.live = null;
    setBusy(false);
    saveConvs();
    if (conv.id === state.currentId) renderThread();
  }
}

function titleOf(text) {
  const t = text.replace(/\s+/g, ' ').trim();
  return t.length > 48 ? t.slice(0, 47) + '…' : t;
}

function send(text) {
  if (state.live) return;
  let conv = current();
  if (!conv) {
    conv = { id: newId(), title: titleOf(text), created: Date.now(), updated: Date.now(), messages: [] };
    state.convs.push(conv);
    state.currentId = conv.id;
  }
  conv.messages.push({ role: 'user', content: text });
  generate(conv);
}

function stop() {
  if (state.live) state.live.ctrl.abort();
}

function regenerate() {
  const conv = current();
  if (!conv || state.live) return;
  while (conv.messages.length && conv.messages[conv.messages.length - 1].role === 'assistant') conv.messages.pop();
  if (conv.messages.length) generate(conv);
}

function startEdit(article) {
  const conv = current();
  const i = Number(article.dataset.index);
  const m = conv && conv.messages[i];
  if (!m || state.live) return;
  const box = node('div', 'edit');
  const ta = node('textarea', 'edit-box');
  ta.value = m.content;
  ta.rows = Math.min(12, m.content.split('\n').length + 1);
  const row = node('div', 'buttons');
  const cancel = node('button', '', 'Cancel');
  cancel.type = 'button';
  const save = node('button', 'primary', 'Send');
  save.type = 'button';
  row.append(node('span', 'spacer'), cancel, save);
  box.append(ta, row);
  article.replaceChildren(box);
  ta.focus();
  cancel.addEventListener('click', renderThread);
  const commit = () => {
    const text = ta.value.trim();
    if (!text) return;
    conv.messages = conv.messages.slice(0, i);
    if (i === 0) conv.title = titleOf(text);
    conv.messages.push({ role: 'user', content: text });
    generate(conv);
  };
  save.addEventListener('click', commit);
  ta.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      commit();
    } else if (e.key === 'Escape') {
      renderThread();
    }
  });
}

function openConversation(id) {
  state.currentId = id;
  writeJson(STORE.current, id);
  renderSidebar();
  renderThread();
  document.body.classList.remove('sidebar-open');
  ui.input.focus();
}

function deleteConversation(id) {
  if (state.live && state.live.conv.id === id) state.live.ctrl.abort();
  state.convs = state.convs.filter((c) => c.id !== id);
  if (state.currentId === id) state.currentId = null;
  saveConvs();
  renderSidebar();
  renderThread();
}

function newConversation() {
  state.currentId = null;
  writeJson(STORE.current, null);
  renderSidebar();
  renderThread();
  document.body.classList.remove('sidebar-open');
  ui.input.focus();
}

// ---------------------------------------------------------------- dialogs

function openKeyDialog(reason) {
  ui.keyReason.textContent = reason;
  ui.keyForm.elements.key.value = '';
  if (!ui.keyDialog.open) ui.keyDialog.showModal();
  ui.keyForm.elements.key.focus();
}

function openSettings() {
  const f = ui.settingsForm.elements;
  for (const k of Object.keys(DEFAULT_SETTINGS)) f[k].value = state.settings[k];
  f.api_key.value = apiKey();
  ui.settingsError.hidden = true;
  ui.settings.showModal();
}

/** The form's settings, or a sentence saying which one is wrong. */
function readSettings() {
  const f = ui.settingsForm.elements;
  const s = {};
  for (const k of Object.keys(DEFAULT_SETTINGS)) s[k] = String(f[k].value).trim();
  s.system = String(f.system.value);
  const num = (k, label, ok, want) => {
    if (s[k] === '') return null;
    const v = Number(s[k]);
    return Number.isFinite(v) && ok(v) ? null : `${label} must be ${want}.`;
  };
  const problem =
    num('temperature', 'Temperature', (v) => v >= 0, 'a number ≥ 0') ||
    num('top_p', 'Top-p', (v) => v > 0 && v <= 1, 'in (0, 1]') ||
    num('top_k', 'Top-k', (v) => Number.isInteger(v) && v >= -1, 'a whole number, -1 or 0 for off') ||
    num('min_p', 'Min-p', (v) => v >= 0 && v <= 1, 'in [0, 1]') ||
    num('max_tokens', 'Max tokens', (v) => Number.isInteger(v) && v >= 1, 'a whole number ≥ 1') ||
    num('seed', 'Seed', (v) => Number.isSafeInteger(v), 'a whole number');
  if (problem) return { problem };
  if (s.tools) {
    let tools;
    try {
      tools = JSON.parse(s.tools);
    } catch (e) {
      return { problem: 'Tools is not valid JSON: ' + e.message };
    }
    if (!Array.isArray(tools) || !tools.every((t) => t && typeof t === 'object' && !Array.isArray(t))) return { problem: 'Tools must be a JSON array of tool objects.' };
  }
  return { settings: s, key: String(f.api_key.value).trim() };
}

// ---------------------------------------------------------------- wiring

function autoGrow() {
  ui.input.style.height = 'auto';
  ui.input.style.height = Math.min(ui.input.scrollHeight, window.innerHeight * 0.4) + 'px';
}

function wire() {
  $('#composer').addEventListener('submit', (e) => {
    e.preventDefault();
    const text = ui.input.value.trim();
    if (!text || state.live) return;
    ui.input.value = '';
    autoGrow();
    send(text);
  });
  ui.input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $('#composer').requestSubmit();
    }
  });
  ui.input.addEventListener('input', autoGrow);
  ui.stop.addEventListener('click', stop);
  document.addEventListener('keydown', (e) => {
    if (e.key === 'Escape' && state.live && !ui.settings.open && !ui.keyDialog.open) stop();
  });
  $('#new-chat').addEventListener('click', newConversation);
  $('#open-settings').addEventListener('click', openSettings);
  $('#toggle-sidebar').addEventListener('click', () => document.body.classList.toggle('sidebar-open'));
  ui.scrim.addEventListener('click', () => document.body.classList.remove('sidebar-open'));

  ui.list.addEventListener('click', (e) => {
    const b = e.target.closest('button[data-action]');
    const row = e.target.closest('.conv');
    if (!b || !row) return;
    if (b.dataset.action === 'open') openConversation(row.dataset.id);
    else if (b.dataset.action === 'delete') deleteConversation(row.dataset.id);
  });

  ui.messages.addEventListener('click', async (e) => {
    const copyCode = e.target.closest('.copy-code');
    if (copyCode) {
      const code = copyCode.closest('.code-block').querySelector('code').textContent;
      const ok = await copyText(code);
      copyCode.textContent = ok ? 'Copied' : 'Copy failed';
      setTimeout(() => (copyCode.textContent = 'Copy'), 1500);
      return;
    }
    const b = e.target.closest('button[data-action]');
    const article = e.target.closest('article.msg');
    if (!b || !article) return;
    const conv = current();
    const m = conv && conv.messages[Number(article.dataset.index)];
    if (b.dataset.action === 'regenerate') regenerate();
    else if (b.dataset.action === 'edit') startEdit(article);
    else if (b.dataset.action === 'copy-msg' && m) {
      const ok = await copyText(m.content);
      b.textContent = ok ? 'Copied' : 'Copy failed';
      setTimeout(() => (b.textContent = 'Copy'), 1500);
    }
  });

  ui.settingsForm.addEventListener('submit', (e) => {
    e.preventDefault();
    if (!e.submitter || e.submitter.value !== 'save') {
      ui.settings.close();
      return;
    }
    const r = readSettings();
    if (r.problem) {
      ui.settingsError.textContent = r.problem;
      ui.settingsError.hidden = false;
      return;
    }
    state.settings = r.settings;
    writeJson(STORE.settings, state.settings);
    const keyChanged = r.key !== apiKey();
    setApiKey(r.key);
    ui.settings.close();
    if (keyChanged || !state.model) loadModel();
  });
  $('#settings-reset').addEventListener('click', () => {
    const f = ui.settingsForm.elements;
    for (const [k, v] of Object.entries(DEFAULT_SETTINGS)) f[k].value = v;
  });

  ui.keyForm.addEventListener('submit', (e) => {
    e.preventDefault();
    if (!e.submitter || e.submitter.value !== 'save') {
      ui.keyDialog.close();
      return;
    }
    const k = String(ui.keyForm.elements.key.value).trim();
    if (!k) return;
    setApiKey(k);
    ui.keyDialog.close();
    loadModel();
  });

  // Another tab changed the conversations: show them (unless this one is streaming).
  window.addEventListener('storage', (e) => {
    if (e.key !== STORE.convs || state.live) return;
    const keep = state.currentId;
    load();
    if (state.convs.some((c) => c.id === keep)) state.currentId = keep;
    renderSidebar();
    renderThread();
  });
}

load();
wire();
setBusy(false);
renderSidebar();
renderThread();
loadModel();
ui.input.focus();
