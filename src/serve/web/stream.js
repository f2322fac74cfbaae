// The page's protocol side, apart from the DOM: reading an OpenAI chat-completions SSE stream,
// folding its deltas into one reply, and turning the server's error objects into sentences.

/**
 * Splits a server-sent-events body into the `data` of each event, fed in pieces of any size
 * (a line, an event or a CRLF may be split across pieces). Comments (`: keep-alive`) and the
 * fields other than `data` are skipped; several `data` lines of one event join with `\n`.
 */
export class SseParser {
  constructor() {
    this.buf = '';
    this.data = [];
  }

  /** Feeds decoded text; returns the data of the events it completed. */
  push(text) {
    this.buf += text;
    const out = [];
    let start = 0;
    for (let i = 0; i < this.buf.length; i++) {
      const c = this.buf[i];
      if (c !== '\n' && c !== '\r') continue;
      // A CR at the end may be the first half of a CRLF: wait for the next piece.
      if (c === '\r' && i + 1 === this.buf.length) break;
      this.line(this.buf.slice(start, i), out);
      if (c === '\r' && this.buf[i + 1] === '\n') i++;
      start = i + 1;
    }
    this.buf = this.buf.slice(start);
    return out;
  }

  /** The body ended: completes a last event that lacked its blank line. */
  end() {
    const out = [];
    if (this.buf) this.line(this.buf.replace(/\r$/, ''), out);
    this.buf = '';
    this.line('', out);
    return out;
  }

  line(line, out) {
    if (line === '') {
      if (this.data.length) out.push(this.data.join('\n'));
      this.data = [];
      return;
    }
    if (line[0] === ':') return;
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? '' : line.slice(colon + 1);
    if (value[0] === ' ') value = value.slice(1);
    if (field === 'data') this.data.push(value);
  }
}

/**
 * One assistant reply built from `chat.completion.chunk` objects (choice 0): the answer, the
 * reasoning (`delta.reasoning_content`, or `delta.reasoning` from servers that send only that
 * one; when both come they carry the same text, so one is taken), tool calls whose name and
 * arguments arrive in pieces keyed by `index`, the finish reason, the usage of the last chunk
 * (`stream_options.include_usage`), an error object sent inside the stream, and the times
 * (ms, the clock passed in) of the first and last chunk that carried generated text.
 */
export class ReplyBuilder {
  constructor() {
    this.content = '';
    this.reasoning = '';
    this.toolCalls = [];
    this.finish = null;
    this.usage = null;
    this.error = null;
    this.chunks = 0;
    this.firstAt = null;
    this.lastAt = null;
  }

  /** Folds one parsed chunk in, at time `t`; returns whether anything shown changed. */
  apply(chunk, t) {
    if (!chunk || typeof chunk !== 'object') return false;
    if (chunk.error) {
      this.error = chunk.error;
      return true;
    }
    if (chunk.usage && typeof chunk.usage === 'object') this.usage = chunk.usage;
    let generated = false;
    let changed = false;
    for (const choice of Array.isArray(chunk.choices) ? chunk.choices : []) {
      if ((choice.index ?? 0) !== 0) continue;
      const d = choice.delta || {};
      if (typeof d.content === 'string' && d.content) {
        this.content += d.content;
        generated = true;
      }
      const r = typeof d.reasoning_content === 'string' ? d.reasoning_content : typeof d.reasoning === 'string' ? d.reasoning : '';
      if (r) {
        this.reasoning += r;
        generated = true;
      }
      if (Array.isArray(d.tool_calls)) {
        d.tool_calls.forEach((tc, k) => {
          const at = Number.isInteger(tc.index) ? tc.index : k;
          const slot = (this.toolCalls[at] ||= { id: '', type: 'function', function: { name: '', arguments: '' } });
          if (typeof tc.id === 'string' && tc.id) slot.id = tc.id;
          if (typeof tc.type === 'string' && tc.type) slot.type = tc.type;
          const f = tc.function || {};
          if (typeof f.name === 'string') slot.function.name += f.name;
          if (typeof f.arguments === 'string') slot.function.arguments += f.arguments;
          else if (f.arguments && typeof f.arguments === 'object') slot.function.arguments += JSON.stringify(f.arguments);
          generated = true;
        });
      }
      if (choice.finish_reason) {
        this.finish = choice.finish_reason;
        changed = true;
      }
    }
    if (generated) {
      this.chunks++;
      if (this.firstAt === null) this.firstAt = t;
      this.lastAt = t;
    }
    return generated || changed;
  }

  /** The tool calls received, in index order. */
  calls() {
    return this.toolCalls.filter(Boolean);
  }

  /**
   * Figures for the reply sent at `sentAt`: tokens (the usage's count, or else the chunks
   * counted, marked `estimated`), time to first token and decode speed (tokens after the first
   * over the time from the first to the last), in ms and tokens per second.
   */
  stats(sentAt) {
    const u = this.usage;
    const tokens = u && Number.isFinite(u.completion_tokens) ? u.completion_tokens : this.chunks;
    const s = { tokens, estimated: !(u && Number.isFinite(u.completion_tokens)) };
    if (u && Number.isFinite(u.prompt_tokens)) s.prompt = u.prompt_tokens;
    if (this.firstAt !== null) s.ttftMs = this.firstAt - sentAt;
    if (this.firstAt !== null && this.lastAt > this.firstAt && tokens > 1) s.tokensPerSecond = ((tokens - 1) * 1000) / (this.lastAt - this.firstAt);
    return s;
  }
}

/** `{message, code, type, param}` of an OpenAI error body (text), or nulls. */
export function parseErrorBody(text) {
  try {
    const v = JSON.parse(text);
    const e = v && typeof v === 'object' ? (v.error && typeof v.error === 'object' ? v.error : v) : null;
    if (e && typeof e.message === 'string') return { message: e.message, code: e.code ?? null, type: e.type ?? null, param: e.param ?? null };
  } catch {
    // not JSON: the text itself is the message
  }
  return { message: String(text || '').trim().slice(0, 500), code: null, type: null, param: null };
}

/**
 * A readable error for an HTTP failure: `{kind, title, detail}`, `kind` one of `auth`,
 * `context`, `busy`, `request`, `server`. `status` 0 with `body` the exception text: the
 * server could not be reached. `retryAfter`: the Retry-After header, if any.
 */
export function describeError(status, body, retryAfter) {
  if (status === 0) return { kind: 'network', title: 'Could not reach the server', detail: (body ? body + '. ' : '') + 'Is tensorfold serve still running?' };
  const e = parseErrorBody(body);
  const msg = e.message;
  if (status === 401 || status === 403) {
    return { kind: 'auth', title: 'The API key was refused', detail: (msg ? msg + '. ' : '') + 'Enter the key the server was started with (--api-key).' };
  }
  if (e.code === 'context_length_exceeded') {
    return {
      kind: 'context',
      title: 'The conversation is too long for the model’s context',
      detail: msg + '. Start a new conversation, shorten the last message (Edit), or lower Max tokens in Settings.',
    };
  }
  if (status === 503 && e.code === 'shutting_down') return { kind: 'busy', title: 'The server is shutting down', detail: msg };
  if (status === 503 || status === 429) {
    const wait = Number.parseInt(retryAfter, 10);
    const when = Number.isFinite(wait) ? `Try again in ${wait} s.` : 'Try again shortly.';
    return { kind: 'busy', title: 'The server is busy: its queue is full', detail: (msg ? msg + '. ' : '') + when };
  }
  if (status === 413) return { kind: 'request', title: 'The conversation is too large to send', detail: msg || 'The request body is over the server’s limit (--max-body-bytes).' };
  if (status >= 400 && status < 500) {
    const field = e.param ? ` (field ${e.param})` : '';
    return { kind: 'request', title: 'The server refused the request' + field, detail: msg || `HTTP ${status}` };
  }
  return { kind: 'server', title: `The server failed (HTTP ${status})`, detail: msg || 'No details were given.' };
}
