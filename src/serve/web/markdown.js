// A small Markdown renderer for model output, written for this page.
//
// Blocks: ATX headings, paragraphs (a newline inside one is a line break, as chat pages show
// it), fenced code (``` or ~~~, unclosed fences run to the end, which is what a stream in progress
// looks like), block quotes, bullet and ordered lists (nested, tight or loose, task boxes), GFM
// tables, thematic breaks. Inlines: code spans, emphasis (* and _, with CommonMark's flanking
// rules), ~~strike~~, links and images (as links), <autolinks>, bare http(s) URLs, backslash
// escapes.
//
// Safety: the output is DOM built with createElement and text nodes only; no string is ever
// parsed as HTML, so whatever the model writes (`<script>`, `<img onerror>`) stays text. Link
// targets are kept only for http, https and mailto; images are never loaded (they become links).

const SAFE_URL = /^(?:https?:|mailto:)/i;
const FENCE = /^( {0,3})(`{3,}|~{3,})(.*)$/;
const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/;
const RULE = /^ {0,3}(?:(?:-[ \t]*){3,}|(?:\*[ \t]*){3,}|(?:_[ \t]*){3,})$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const LIST_ITEM = /^( {0,3})([-*+]|\d{1,9}[.)])(?:([ \t]+)(.*))?$/;
const TABLE_DELIM_CELL = /^:?-+:?$/;
const ASCII_PUNCT = /[!-/:-@[-`{-~]/;
const BARE_URL = /^https?:\/\/[^\s<>"'`]+/;

function el(doc, tag, cls) {
  const e = doc.createElement(tag);
  if (cls) e.className = cls;
  return e;
}

const isBlank = (l) => /^[ \t]*$/.test(l);
const indentOf = (l) => l.match(/^ */)[0].length;

/** Tabs in a line's leading whitespace become spaces (to the next multiple of 4). */
function expandTabs(line) {
  const m = line.match(/^[ \t]+/);
  if (!m || !m[0].includes('\t')) return line;
  let col = 0;
  for (const c of m[0]) col = c === '\t' ? col + 4 - (col % 4) : col + 1;
  return ' '.repeat(col) + line.slice(m[0].length);
}

/** Cells of a table row: outer pipes dropped, split at pipes not escaped by a backslash. */
function splitRow(line) {
  let s = line.trim();
  if (s.startsWith('|')) s = s.slice(1);
  if (s.endsWith('|') && !s.endsWith('\\|')) s = s.slice(0, -1);
  const cells = [];
  let cur = '';
  for (let i = 0; i < s.length; i++) {
    if (s[i] === '\\' && s[i + 1] === '|') {
      cur += '|';
      i++;
    } else if (s[i] === '|') {
      cells.push(cur.trim());
      cur = '';
    } else {
      cur += s[i];
    }
  }
  cells.push(cur.trim());
  return cells;
}

function isTableStart(lines, i) {
  if (i + 1 >= lines.length || !lines[i].includes('|') || !lines[i + 1].includes('-')) return false;
  const delim = splitRow(lines[i + 1]);
  return delim.every((c) => TABLE_DELIM_CELL.test(c)) && splitRow(lines[i]).length === delim.length;
}

/** Whether `lines[i]` starts a block that ends a paragraph. */
function interruptsParagraph(lines, i) {
  const l = lines[i];
  return FENCE.test(l) || HEADING.test(l) || RULE.test(l) || QUOTE.test(l) || LIST_ITEM.test(l) || isTableStart(lines, i);
}

class Renderer {
  constructor(doc) {
    this.doc = doc;
  }

  /** Renders `lines` (tabs expanded) as blocks appended to `parent`. */
  blocks(lines, parent) {
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (isBlank(line)) {
        i++;
      } else if ((m = FENCE.exec(line)) && !(m[2][0] === '`' && m[3].includes('`'))) {
        i = this.fence(lines, i, m, parent);
      } else if ((m = HEADING.exec(line))) {
        const h = el(this.doc, 'h' + m[1].length);
        this.inline(m[2] || '', h);
        parent.append(h);
        i++;
      } else if (RULE.test(line)) {
        parent.append(el(this.doc, 'hr'));
        i++;
      } else if (QUOTE.test(line)) {
        i = this.quote(lines, i, parent);
      } else if (LIST_ITEM.test(line)) {
        i = this.list(lines, i, parent);
      } else if (isTableStart(lines, i)) {
        i = this.table(lines, i, parent);
      } else {
        const para = [line.trim()];
        i++;
        while (i < lines.length && !isBlank(lines[i]) && !interruptsParagraph(lines, i)) para.push(lines[i++].trim());
        const p = el(this.doc, 'p');
        this.inline(para.join('\n'), p);
        parent.append(p);
      }
    }
  }

  fence(lines, i, m, parent) {
    const [, indent, marker, info] = m;
    const close = new RegExp('^ {0,3}' + (marker[0] === '`' ? '`' : '~') + '{' + marker.length + ',}[ \\t]*$');
    const body = [];
    i++;
    while (i < lines.length && !close.test(lines[i])) {
      const l = lines[i++];
      body.push(l.slice(Math.min(indent.length, indentOf(l))));
    }
    const closed = i < lines.length;
    const lang = (info.trim().split(/\s+/)[0] || '').replace(/[^\w+#.-]/g, '');
    const box = el(this.doc, 'div', 'code-block');
    const head = el(this.doc, 'div', 'code-head');
    const label = el(this.doc, 'span', 'code-lang');
    label.textContent = lang || 'text';
    const copy = el(this.doc, 'button', 'copy-code');
    copy.type = 'button';
    copy.textContent = 'Copy';
    copy.title = 'Copy the code';
    head.append(label, copy);
    const pre = el(this.doc, 'pre');
    const code = el(this.doc, 'code');
    if (lang) code.className = 'language-' + lang;
    code.textContent = body.join('\n');
    pre.append(code);
    box.append(head, pre);
    parent.append(box);
    return closed ? i + 1 : i;
  }

  quote(lines, i, parent) {
    const inner = [];
    while (i < lines.length) {
      const m = QUOTE.exec(lines[i]);
      if (m) {
        inner.push(m[1]);
      } else if (!isBlank(lines[i]) && inner.length && !isBlank(inner[inner.length - 1]) && !interruptsParagraph(lines, i)) {
        inner.push(lines[i]); // a lazy continuation of the quoted paragraph
      } else {
        break;
      }
      i++;
    }
    const q = el(this.doc, 'blockquote');
    this.blocks(inner, q);
    parent.append(q);
    return i;
  }

  list(lines, i, parent) {
    const kind = (m) => (/\d/.test(m[2]) ? 'ol' + m[2].slice(-1) : 'ul' + m[2]);
    const first = LIST_ITEM.exec(lines[i]);
    const k = kind(first);
    const list = el(this.doc, k.slice(0, 2));
    if (k.startsWith('ol')) {
      const start = parseInt(first[2], 10);
      if (start !== 1) list.start = start;
    }
    let loose = false;
    const items = [];
    while (i < lines.length) {
      const m = LIST_ITEM.exec(lines[i]);
      if (!m || kind(m) !== k) break;
      const markerIndent = m[1].length;
      const gap = m[3] ? m[3].length : 1;
      const contentIndent = markerIndent + m[2].length + (gap > 4 ? 1 : gap);
      const body = [gap > 4 ? ' '.repeat(gap - 1) + (m[4] || '') : m[4] || ''];
      i++;
      while (i < lines.length) {
        const l = lines[i];
        if (isBlank(l)) {
          let j = i;
          while (j < lines.length && isBlank(lines[j])) j++;
          if (j < lines.length && indentOf(lines[j]) >= contentIndent) {
            for (; i < j; i++) body.push('');
            continue;
          }
          break;
        }
        const ind = indentOf(l);
        if (ind >= contentIndent) {
          body.push(l.slice(contentIndent));
        } else if (LIST_ITEM.test(l) && ind > markerIndent) {
          body.push(l.slice(ind)); // a nested list indented less than the content (lenient)
        } else if (!interruptsParagraph(lines, i) && !isBlank(body[body.length - 1])) {
          body.push(l.trim()); // a lazy continuation of the item's paragraph
        } else {
          break;
        }
        i++;
      }
      if (body.some((l, n) => isBlank(l) && n > 0 && n < body.length - 1)) loose = true;
      items.push(body);
      // Blank lines between two items of this list make it loose.
      let j = i;
      while (j < lines.length && isBlank(lines[j])) j++;
      if (j > i && j < lines.length) {
        const next = LIST_ITEM.exec(lines[j]);
        if (next && kind(next) === k) {
          loose = true;
          i = j;
        }
      }
    }
    for (const body of items) {
      const li = el(this.doc, 'li');
      const task = /^\[([ xX])\][ \t]+/.exec(body[0]);
      if (task) {
        body[0] = body[0].slice(task[0].length);
        const box = el(this.doc, 'input');
        box.type = 'checkbox';
        box.setAttribute('disabled', '');
        if (task[1] !== ' ') box.setAttribute('checked', '');
        li.className = 'task';
        li.append(box);
      }
      this.blocks(body, li);
      if (!loose) {
        for (const p of [...li.children]) if (p.tagName === 'P') p.replaceWith(...p.childNodes);
      }
      list.append(li);
    }
    parent.append(list);
    return i;
  }

  table(lines, i, parent) {
    const head = splitRow(lines[i]);
    const align = splitRow(lines[i + 1]).map((c) => (c.startsWith(':') && c.endsWith(':') ? 'center' : c.endsWith(':') ? 'right' : c.startsWith(':') ? 'left' : ''));
    const wrap = el(this.doc, 'div', 'table-wrap');
    const table = el(this.doc, 'table');
    const row = (cells, tag) => {
      const tr = el(this.doc, 'tr');
      for (let c = 0; c < head.length; c++) {
        const cell = el(this.doc, tag, align[c] ? 'align-' + align[c] : '');
        this.inline(cells[c] || '', cell);
        tr.append(cell);
      }
      return tr;
    };
    const thead = el(this.doc, 'thead');
    thead.append(row(head, 'th'));
    table.append(thead);
    i += 2;
    const tbody = el(this.doc, 'tbody');
    while (i < lines.length && lines[i].includes('|') && !isBlank(lines[i]) && !FENCE.test(lines[i]) && !QUOTE.test(lines[i])) tbody.append(row(splitRow(lines[i++]), 'td'));
    if (tbody.children.length) table.append(tbody);
    wrap.append(table);
    parent.append(wrap);
    return i;
  }

  /** Renders inline Markdown `s` into `parent`; `inLink`: no links inside (a link's text). */
  inline(s, parent, inLink = false) {
    let buf = '';
    const flush = () => {
      if (buf) parent.append(this.doc.createTextNode(buf));
      buf = '';
    };
    let i = 0;
    while (i < s.length) {
      const c = s[i];
      if (c === '\\' && i + 1 < s.length && ASCII_PUNCT.test(s[i + 1])) {
        buf += s[i + 1];
        i += 2;
        continue;
      }
      if (c === '\n' || (c === '\\' && s[i + 1] === '\n')) {
        flush();
        parent.append(el(this.doc, 'br'));
        i += c === '\n' ? 1 : 2;
        continue;
      }
      if (c === '`') {
        const n = runLength(s, i);
        const end = findCodeClose(s, i + n, n);
        if (end >= 0) {
          flush();
          let text = s.slice(i + n, end).replace(/\n/g, ' ');
          if (text.length > 2 && text[0] === ' ' && text[text.length - 1] === ' ' && text.trim()) text = text.slice(1, -1);
          const code = el(this.doc, 'code');
          code.textContent = text;
          parent.append(code);
          i = end + n;
        } else {
          buf += s.slice(i, i + n);
          i += n;
        }
        continue;
      }
      if (!inLink && (c === '[' || (c === '!' && s[i + 1] === '['))) {
        const image = c === '!';
        const link = parseLink(s, image ? i + 1 : i);
        if (link) {
          flush();
          this.link(link, image, parent);
          i = link.end;
          continue;
        }
      }
      if (!inLink && c === '<') {
        const m = /^<((?:https?:\/\/|mailto:)[^\s<>]*)>/i.exec(s.slice(i));
        if (m) {
          flush();
          this.link({ text: null, url: m[1] }, false, parent);
          i += m[0].length;
          continue;
        }
      }
      if (!inLink && (c === 'h' || c === 'H') && !/[\p{L}\p{N}]/u.test(s[i - 1] || '')) {
        const m = BARE_URL.exec(s.slice(i));
        if (m) {
          const url = trimUrl(m[0]);
          if (url.length > 8) {
            flush();
            this.link({ text: null, url }, false, parent);
            i += url.length;
            continue;
          }
        }
      }
      if (c === '*' || c === '_' || (c === '~' && s[i + 1] === '~')) {
        const n = runLength(s, i);
        const want = c === '~' ? 2 : n;
        if (want <= 3 && (c !== '~' || n === 2) && canOpen(s, i, n, c)) {
          const close = findEmphasisClose(s, i + n, c, want);
          if (close > i + n) {
            flush();
            const tag = c === '~' ? ['del'] : want === 1 ? ['em'] : want === 2 ? ['strong'] : ['strong', 'em'];
            const outer = el(this.doc, tag[0]);
            let target = outer;
            if (tag[1]) {
              target = el(this.doc, tag[1]);
              outer.append(target);
            }
            this.inline(s.slice(i + n, close), target, inLink);
            parent.append(outer);
            i = close + want;
            continue;
          }
        }
        buf += s.slice(i, i + n);
        i += n;
        continue;
      }
      buf += c;
      i++;
    }
    flush();
  }

  link(link, image, parent) {
    const url = link.url.trim();
    if (!SAFE_URL.test(url)) {
      // Unsafe or relative target: the text stays, the target is shown as text, nothing links.
      const span = el(this.doc, 'span', 'link-unsafe');
      this.inline(link.text ?? url, span, true);
      if (link.text !== null && url) span.append(this.doc.createTextNode(' (' + url + ')'));
      parent.append(span);
      return;
    }
    const a = el(this.doc, 'a', image ? 'image-link' : '');
    a.href = url;
    a.target = '_blank';
    a.rel = 'noopener noreferrer';
    if (link.title) a.title = link.title;
    if (link.text === null) a.textContent = url;
    else if (image) a.textContent = '[image: ' + (link.text || url) + ']';
    else this.inline(link.text, a, true);
    parent.append(a);
  }
}

function runLength(s, i) {
  let j = i;
  while (s[j] === s[i]) j++;
  return j - i;
}

/** The index of the closing backtick run of exactly `n` after `from`, or -1. */
function findCodeClose(s, from, n) {
  let j = from;
  while (j < s.length) {
    if (s[j] === '`') {
      const m = runLength(s, j);
      if (m === n) return j;
      j += m;
    } else {
      j++;
    }
  }
  return -1;
}

const isSpace = (ch) => ch === undefined || /\s/u.test(ch);
const isPunct = (ch) => ch !== undefined && /[\p{P}\p{S}]/u.test(ch);

function leftFlanking(s, i, n) {
  const prev = s[i - 1];
  const next = s[i + n];
  return !isSpace(next) && (!isPunct(next) || isSpace(prev) || isPunct(prev));
}

function rightFlanking(s, i, n) {
  const prev = s[i - 1];
  const next = s[i + n];
  return !isSpace(prev) && (!isPunct(prev) || isSpace(next) || isPunct(next));
}

function canOpen(s, i, n, c) {
  if (!leftFlanking(s, i, n)) return false;
  return c !== '_' || !rightFlanking(s, i, n) || isPunct(s[i - 1]);
}

function canClose(s, i, n, c) {
  if (!rightFlanking(s, i, n)) return false;
  return c !== '_' || !leftFlanking(s, i, n) || isPunct(s[i + n]);
}

/** The index of a run of exactly `n` `c` after `from` that can close, skipping code spans. */
function findEmphasisClose(s, from, c, n) {
  let j = from;
  while (j < s.length) {
    const ch = s[j];
    if (ch === '\\') {
      j += 2;
    } else if (ch === '`') {
      const m = runLength(s, j);
      const end = findCodeClose(s, j + m, m);
      j = end >= 0 ? end + m : j + m;
    } else if (ch === c) {
      const m = runLength(s, j);
      if (m === n && canClose(s, j, m, c)) return j;
      j += m;
    } else {
      j++;
    }
  }
  return -1;
}

/** `[text](url "title")` at `i` (s[i] === '['): {text, url, title, end} or null. */
function parseLink(s, i) {
  let depth = 0;
  let j = i;
  for (; j < s.length; j++) {
    const ch = s[j];
    if (ch === '\\') j++;
    else if (ch === '`') {
      const m = runLength(s, j);
      const end = findCodeClose(s, j + m, m);
      j = (end >= 0 ? end + m : j + m) - 1;
    } else if (ch === '[') depth++;
    else if (ch === ']' && --depth === 0) break;
  }
  if (j >= s.length || s[j + 1] !== '(') return null;
  const text = s.slice(i + 1, j);
  let k = j + 2;
  while (s[k] === ' ') k++;
  let url = '';
  if (s[k] === '<') {
    const end = s.indexOf('>', k);
    if (end < 0 || s.slice(k, end).includes('\n')) return null;
    url = s.slice(k + 1, end);
    k = end + 1;
  } else {
    let parens = 0;
    const start = k;
    for (; k < s.length; k++) {
      const ch = s[k];
      if (/\s/.test(ch)) break;
      if (ch === '\\' && ASCII_PUNCT.test(s[k + 1] || '')) k++;
      else if (ch === '(') parens++;
      else if (ch === ')') {
        if (parens === 0) break;
        parens--;
      }
    }
    url = s.slice(start, k).replace(/\\([!-/:-@[-`{-~])/g, '$1');
  }
  while (s[k] === ' ') k++;
  let title = '';
  const q = s[k];
  if (q === '"' || q === "'" || q === '(') {
    const closeCh = q === '(' ? ')' : q;
    const end = s.indexOf(closeCh, k + 1);
    if (end < 0) return null;
    title = s.slice(k + 1, end);
    k = end + 1;
    while (s[k] === ' ') k++;
  }
  if (s[k] !== ')') return null;
  return { text, url, title, end: k + 1 };
}

/** A bare URL without the punctuation that usually follows one in prose. */
function trimUrl(url) {
  for (;;) {
    const last = url[url.length - 1];
    if ('.,;:!?\'"*_~'.includes(last)) url = url.slice(0, -1);
    else if (last === ')' && (url.match(/\)/g) || []).length > (url.match(/\(/g) || []).length) url = url.slice(0, -1);
    else return url;
  }
}

/**
 * Renders Markdown `text` as a DocumentFragment of `doc` (default: the page's document).
 * Never throws on any input; never creates markup from the text's characters.
 */
export function renderMarkdown(text, doc = document) {
  const frag = doc.createDocumentFragment();
  const lines = String(text ?? '')
    .replace(/\r\n?/g, '\n')
    .split('\n')
    .map(expandTabs);
  new Renderer(doc).blocks(lines, frag);
  return frag;
}
