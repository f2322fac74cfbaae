//! Text ⇄ token ids, chat templates, stop ids and streaming detokenization.
//!
//! Everything here follows what Hugging Face `transformers` does with the same files, so a prompt
//! built by tensorfold has the same ids as one built by `tokenizer.apply_chat_template(...)` in
//! Python:
//!
//! - `tokenizer.json` is loaded by the `tokenizers` crate (the Rust core of the Python library),
//!   with its pure-Rust `fancy-regex` backend (equivalence checked in `docs/rust-notes.md` §4).
//! - Chat templates are rendered by `minijinja` configured as `transformers`'
//!   `utils/chat_template_utils.py::_compile_jinja_template` configures Jinja2: `trim_blocks`,
//!   `lstrip_blocks`, loop controls, the globals `raise_exception` and `strftime_now`, and a
//!   `tojson` filter that is Python's `json.dumps(x, ensure_ascii=False, ...)`.
//! - Stop ids are the union of every EOS id the model directory declares and of the
//!   vocabulary's end-of-generation special tokens (as llama.cpp finds them, by their text).
//!
//! The rayon thread pool of the `tokenizers` crate is switched off on load (see
//! [`Tokenizer::from_dir`]) so tokenization never competes with the engine for cores.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Rest, ValueKind, ValueOrKwargs};
use minijinja::{AutoEscape, Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

/// Everything that can go wrong loading a tokenizer, encoding, decoding or rendering a chat
/// template. Messages name the file, field, template or id at fault.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A required file does not exist (only `tokenizer.json` is required).
    #[error("{}: not found (a model directory needs tokenizer.json)", path.display())]
    MissingFile { path: PathBuf },
    /// A file exists but cannot be read.
    #[error("{}: cannot read: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file does not parse.
    #[error("{}: invalid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// `tokenizer.json` parses as JSON but the `tokenizers` crate rejects it.
    #[error("{}: cannot build the tokenizer: {message}", path.display())]
    Load { path: PathBuf, message: String },
    /// A field of a config file has the wrong type or an impossible value.
    #[error("{}: field `{field}`: {message}", path.display())]
    Config { path: PathBuf, field: String, message: String },
    /// The `tokenizers` crate failed to encode a text.
    #[error("cannot encode text: {message}")]
    Encode { message: String },
    /// The `tokenizers` crate failed to decode ids.
    #[error("cannot decode ids: {message}")]
    Decode { message: String },
    /// An id outside the tokenizer's vocabulary was given to `decode` or a stream.
    #[error("unknown token id {id}: the tokenizer knows {vocab_size} ids")]
    UnknownTokenId { id: u32, vocab_size: usize },
    /// A chat template does not compile (Jinja syntax).
    #[error("chat template {origin}: {message}")]
    TemplateSyntax { origin: String, message: String },
    /// A chat template called `raise_exception(message)` (e.g. for an unsupported role order).
    #[error("chat template {origin} raised an exception: {message}")]
    TemplateException { origin: String, message: String },
    /// Rendering a chat template failed for another reason (bad data, unknown filter, ...).
    #[error("chat template {origin}: cannot render: {message}")]
    TemplateRender { origin: String, message: String },
}

type Result<T, E = TokenizerError> = std::result::Result<T, E>;

/// Texts of special tokens that end a generation in the chat formats of common model
/// families, whatever the configs say: a special added token of `tokenizer.json` with one of
/// these texts is a stop id. Modelled on llama.cpp's end-of-generation detection
/// (`llama_vocab::impl::load`, `special_eog_ids`); kept to the markers that only ever end a
/// turn or a document.
///
/// - `<|endoftext|>`: end of a document (Qwen, GPT-2 family); Qwen3.5 emits it after base-model
///   text.
/// - `<|im_end|>`: end of a ChatML turn (Qwen).
/// - `<|eot_id|>`, `<|eom_id|>`, `<|end_of_text|>`: Llama 3 end of turn, of a tool-call message,
///   of a document.
/// - `<|end|>`: Phi-3 end of turn.
/// - `<|return|>`: gpt-oss (harmony) end of the final answer.
/// - `<end_of_turn>`: Gemma end of turn.
pub const END_OF_GENERATION_TOKENS: &[&str] = &["<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>", "<|return|>", "<end_of_turn>"];

/// One chat message as chat templates see it (`{"role": ..., "content": ...}`).
///
/// Messages with more fields (`tool_calls`, `reasoning_content`, `name`, ...) go through
/// [`ChatTemplate::render_json`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool` for Qwen templates.
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

/// A Hugging Face tokenizer with the model directory's chat template and stop ids.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    vocab_size: usize,
    eos_ids: Vec<u32>,
    chat_template: Option<ChatTemplate>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab_size", &self.vocab_size).field("eos_ids", &self.eos_ids).field("chat_template", &self.chat_template).finish_non_exhaustive()
    }
}

/// What one id stands for ([`Tokenizer::token_bytes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenBytes {
    /// Text: these bytes (a piece of a UTF-8 character for some byte-level tokens).
    Text(Vec<u8>),
    /// A special added token (`<|im_end|>`): its text, which the id never spells in output.
    Special(String),
    /// No token has this id.
    None,
}

/// GPT-2's byte-level table, character → byte: the printable bytes `!..~`, `¡..¬`, `®..ÿ`
/// stand for themselves, the other 68 bytes take the characters from U+0100 on, in byte
/// order (`bytes_to_unicode` of GPT-2's encoder, which byte-level BPE vocabularies are spelled in).
fn byte_level_decoder() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (char::from(b), b)
            } else {
                let c = char::from_u32(next).expect("U+0100..U+0143 are characters");
                next += 1;
                (c, b)
            }
        })
        .collect()
}

/// Reads a file that may be absent: `Ok(None)` when it does not exist.
fn read_optional(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Io { path: path.to_path_buf(), source }),
    }
}

/// Parses an optional JSON file: `Ok(None)` when it does not exist.
fn read_optional_json(path: &Path) -> Result<Option<Json>> {
    match read_optional(path)? {
        None => Ok(None),
        Some(text) => serde_json::from_str(&text).map(Some).map_err(|source| TokenizerError::Json { path: path.to_path_buf(), source }),
    }
}

fn config_error(path: &Path, field: &str, message: impl Into<String>) -> TokenizerError {
    TokenizerError::Config { path: path.to_path_buf(), field: field.to_string(), message: message.into() }
}

/// `eos_token_id` as Hugging Face configs write it: absent/null, one integer, or a list of them.
fn parse_id_list(value: Option<&Json>, path: &Path, field: &str) -> Result<Vec<u32>> {
    let as_id = |v: &Json| -> Result<u32> { v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| config_error(path, field, format!("expected a token id, found {v}"))) };
    match value {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::Array(items)) => items.iter().map(as_id).collect(),
        Some(v) => Ok(vec![as_id(v)?]),
    }
}

/// A special token as `tokenizer_config.json` writes it: a string, an `AddedToken` object
/// (`{"content": ..., ...}`), or null.
fn parse_token_string(value: Option<&Json>, path: &Path, field: &str) -> Result<Option<String>> {
    match value {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Object(o)) => match o.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(config_error(path, field, "object without a string `content`")),
        },
        Some(v) => Err(config_error(path, field, format!("expected a token string, found {v}"))),
    }
}

impl Tokenizer {
    /// Loads a tokenizer from a Hugging Face / MLX model directory.
    ///
    /// Files (all in `dir`):
    /// - `tokenizer.json` (required): vocabulary, merges, normalizer, pre-tokenizer, added tokens.
    /// - `tokenizer_config.json` (optional): `chat_template` (a string, or a list of
    ///   `{"name", "template"}`), `bos_token`/`eos_token`/`unk_token`/`pad_token` (strings or
    ///   `AddedToken` objects; passed to the template as variables, `eos_token` also gives a
    ///   stop id), and `added_tokens_decoder` (tokens missing from `tokenizer.json` are added at
    ///   their ids).
    /// - `chat_template.jinja` (optional): the default template; takes precedence over
    ///   `tokenizer_config.json` as in `transformers`. `additional_chat_templates/NAME.jinja`
    ///   adds named templates (e.g. `tool_use`). `chat_template.json` (`{"chat_template": ...}`,
    ///   the processor file of multimodal repos) is used only when neither of the above has one.
    /// - `generation_config.json` (optional): `eos_token_id`, an integer or a list.
    /// - `config.json` (optional): `eos_token_id` at the top level and/or under `text_config`.
    ///
    /// [`eos_ids`](Self::eos_ids) is the sorted, deduplicated union of all EOS ids found and of
    /// the special added tokens whose text is in [`END_OF_GENERATION_TOKENS`].
    ///
    /// Calls `tokenizers::utils::parallelism::set_parallelism(false)`, a process-wide switch,
    /// so the `tokenizers` crate never starts rayon workers that compete with the engine.
    ///
    /// Errors: a missing `tokenizer.json`, unreadable files, invalid JSON, fields of the wrong
    /// type, an `eos_token` that is not in the vocabulary, conflicting added tokens, and chat
    /// templates that do not compile (naming the template's file).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        tokenizers::utils::parallelism::set_parallelism(false);

        let tokenizer_path = dir.join("tokenizer.json");
        let bytes = match std::fs::read(&tokenizer_path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(TokenizerError::MissingFile { path: tokenizer_path }),
            Err(source) => return Err(TokenizerError::Io { path: tokenizer_path, source }),
        };
        let mut inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| TokenizerError::Load { path: tokenizer_path.clone(), message: e.to_string() })?;

        let config_path = dir.join("tokenizer_config.json");
        let tokenizer_config = read_optional_json(&config_path)?;
        let tcfg = |key: &str| tokenizer_config.as_ref().and_then(|c| c.get(key));
        if let Some(c) = &tokenizer_config {
            if !c.is_object() {
                return Err(config_error(&config_path, "(root)", "expected a JSON object"));
            }
        }

        if let Some(decoder) = tcfg("added_tokens_decoder") {
            add_config_tokens(&mut inner, decoder, &config_path)?;
        }

        // Special-token strings the template sees as variables (transformers passes its
        // special_tokens_map into the render call).
        let mut special_tokens = serde_json::Map::new();
        for name in ["bos_token", "eos_token", "unk_token", "pad_token"] {
            if let Some(s) = parse_token_string(tcfg(name), &config_path, name)? {
                special_tokens.insert(name.to_string(), Json::String(s));
            }
        }

        // EOS ids: generation_config.json, tokenizer_config.json eos_token, config.json.
        let mut eos_ids = Vec::new();
        let gen_path = dir.join("generation_config.json");
        if let Some(gen) = read_optional_json(&gen_path)? {
            eos_ids.extend(parse_id_list(gen.get("eos_token_id"), &gen_path, "eos_token_id")?);
        }
        if let Some(Json::String(eos)) = special_tokens.get("eos_token") {
            let id = inner.token_to_id(eos).ok_or_else(|| config_error(&config_path, "eos_token", format!("{eos:?} is not a token of tokenizer.json")))?;
            eos_ids.push(id);
        }
        let model_config_path = dir.join("config.json");
        if let Some(cfg) = read_optional_json(&model_config_path)? {
            eos_ids.extend(parse_id_list(cfg.get("eos_token_id"), &model_config_path, "eos_token_id")?);
            eos_ids.extend(parse_id_list(cfg.get("text_config").and_then(|t| t.get("eos_token_id")), &model_config_path, "text_config.eos_token_id")?);
        }
        // Checkpoints whose configs name no EOS id (some mlx-community conversions) still
        // end turns and documents with these markers: llama.cpp stops on them by their text.
        eos_ids.extend(inner.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special && END_OF_GENERATION_TOKENS.contains(&t.content.as_str())).map(|(id, _)| id));
        eos_ids.sort_unstable();
        eos_ids.dedup();

        let chat_template = load_chat_templates(dir, tcfg("chat_template"), &config_path)?.map(|t| t.with_special_tokens(special_tokens));

        let vocab_size = inner.get_vocab_size(true);
        Ok(Self { inner, vocab_size, eos_ids, chat_template })
    }

    /// Token ids of `text`, as `transformers`' `tokenizer.encode(text)` (add_special_tokens =
    /// true: the `tokenizer.json` post-processor runs; Qwen's adds nothing, so no BOS).
    ///
    /// Special and added tokens written in the text (`<|im_start|>`, `<think>`, ...) become
    /// their single ids. The text is NFC-normalized first when `tokenizer.json` says so (Qwen).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, true)
    }

    /// Token ids of `text`, choosing whether the `tokenizer.json` post-processor adds its
    /// special tokens (BOS/EOS for tokenizers that have them). `transformers` renders a chat
    /// template and then encodes it with `add_special_tokens = false`, since templates write
    /// their own BOS; use `false` for rendered chat prompts.
    pub fn encode_with(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self.inner.encode_fast(text, add_special_tokens).map_err(|e| TokenizerError::Encode { message: e.to_string() })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens included (skip_special_tokens = false). Byte sequences that
    /// are not valid UTF-8 (ids ending mid-character) become U+FFFD, as in Python.
    ///
    /// Errors: [`TokenizerError::UnknownTokenId`] for an id the tokenizer does not know (the
    /// `tokenizers` crate would silently drop it).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        for &id in ids {
            self.check_id(id)?;
        }
        self.decode_unchecked(ids)
    }

    fn decode_unchecked(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| TokenizerError::Decode { message: e.to_string() })
    }

    fn check_id(&self, id: u32) -> Result<()> {
        if self.inner.id_to_token(id).is_some() {
            Ok(())
        } else {
            Err(TokenizerError::UnknownTokenId { id, vocab_size: self.vocab_size })
        }
    }

    /// Number of ids the tokenizer knows: base vocabulary plus added tokens (248,077 for
    /// Qwen3.5). The model's logits are usually wider (248,320, padded); ids past this count
    /// never decode.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Stop ids: the union of `generation_config.json` `eos_token_id`, the id of
    /// `tokenizer_config.json` `eos_token`, `config.json` `eos_token_id` (top level and
    /// `text_config`), and the special tokens of the vocabulary that are end-of-generation
    /// markers by their text ([`END_OF_GENERATION_TOKENS`]). Sorted ascending, no duplicates;
    /// empty when no file names one and the vocabulary has no such marker.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether `id` is one of [`eos_ids`](Self::eos_ids).
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.binary_search(&id).is_ok()
    }

    /// The model directory's chat template, if it has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The id of a token string (`"<|im_end|>"`), if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id (byte-level form, e.g. `Ġthe`), if the id is known.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The bytes every id stands for, by id (`0..vocab_size`), for constrained decoding's
    /// token table ([`crate::grammar::Vocabulary`]).
    ///
    /// Byte-level BPE tokens (Qwen, GPT-2: `decoder.type` ByteLevel) map their characters back
    /// through GPT-2's byte ⇄ character table; other vocabularies read SentencePiece's `<0xNN>`
    /// byte tokens as that byte and `▁` as a space. Added tokens are their text, special ones
    /// marked [`TokenBytes::Special`] (they never spell text: only a grammar that names them
    /// allows them). Ids without a token (holes in the id range) are [`TokenBytes::None`].
    pub fn token_bytes(&self) -> Vec<TokenBytes> {
        let byte_level = matches!(self.inner.get_decoder(), Some(tokenizers::DecoderWrapper::ByteLevel(_)));
        let unbyte = byte_level.then(byte_level_decoder);
        let added = self.inner.get_added_tokens_decoder();
        (0..self.vocab_size as u32)
            .map(|id| {
                if let Some(t) = added.get(&id) {
                    return if t.special { TokenBytes::Special(t.content.clone()) } else { TokenBytes::Text(t.content.clone().into_bytes()) };
                }
                let Some(piece) = self.inner.id_to_token(id) else {
                    return TokenBytes::None;
                };
                match &unbyte {
                    // A character outside the table cannot come from the byte-level encoder:
                    // its UTF-8 stands for itself.
                    Some(table) => TokenBytes::Text(piece.chars().flat_map(|c| table.get(&c).map_or_else(|| c.to_string().into_bytes(), |&b| vec![b])).collect()),
                    None => match piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')).and_then(|h| u8::from_str_radix(h, 16).ok()) {
                        Some(b) if piece.len() == 6 => TokenBytes::Text(vec![b]),
                        _ => TokenBytes::Text(piece.replace('\u{2581}', " ").into_bytes()),
                    },
                }
            })
            .collect()
    }

    /// An incremental detokenizer for generated ids (see [`TokenStream`]).
    pub fn stream(&self) -> TokenStream<'_> {
        TokenStream { tokenizer: TokenizerRef::Borrowed(self), ids: Vec::new(), read_offset: 0, prefix: String::new() }
    }

    /// [`Tokenizer::stream`] holding a shared handle, so the stream can live apart from any
    /// borrow (one per running sequence of the batched runtime).
    pub fn stream_shared(self: &std::sync::Arc<Self>) -> TokenStream<'static> {
        TokenStream { tokenizer: TokenizerRef::Shared(self.clone()), ids: Vec::new(), read_offset: 0, prefix: String::new() }
    }
}

/// Adds the tokens of `tokenizer_config.json` `added_tokens_decoder` that `tokenizer.json`
/// lacks, at their declared ids, as `transformers` does when it loads both files.
fn add_config_tokens(inner: &mut tokenizers::Tokenizer, decoder: &Json, path: &Path) -> Result<()> {
    const FIELD: &str = "added_tokens_decoder";
    let map = decoder.as_object().ok_or_else(|| config_error(path, FIELD, "expected an object of id -> token"))?;
    let mut entries = Vec::with_capacity(map.len());
    for (key, value) in map {
        let id: u32 = key.parse().map_err(|_| config_error(path, FIELD, format!("key {key:?} is not a token id")))?;
        let content = value.get("content").and_then(Json::as_str).ok_or_else(|| config_error(path, FIELD, format!("entry {id} has no string `content`")))?;
        let flag = |name: &str, default: bool| value.get(name).and_then(Json::as_bool).unwrap_or(default);
        let special = flag("special", false);
        let token = tokenizers::AddedToken::from(content.to_string(), special)
            .single_word(flag("single_word", false))
            .lstrip(flag("lstrip", false))
            .rstrip(flag("rstrip", false))
            .normalized(flag("normalized", !special));
        entries.push((id, token));
    }
    entries.sort_by_key(|(id, _)| *id);
    for (id, token) in entries {
        match inner.token_to_id(&token.content) {
            Some(existing) if existing == id => continue,
            Some(existing) => return Err(config_error(path, FIELD, format!("{:?} has id {id} here but {existing} in tokenizer.json", token.content))),
            None => {}
        }
        if let Some(other) = inner.id_to_token(id) {
            return Err(config_error(path, FIELD, format!("id {id} is {:?} here but {other:?} in tokenizer.json", token.content)));
        }
        let next = inner.get_vocab_size(true) as u32;
        if id != next {
            return Err(config_error(path, FIELD, format!("cannot add {:?} at id {id}: the next free id is {next}", token.content)));
        }
        let content = token.content.clone();
        let added = if token.special { inner.add_special_tokens([token]) } else { inner.add_tokens([token]) };
        added.map_err(|e| config_error(path, FIELD, format!("cannot add {content:?}: {e}")))?;
        if inner.token_to_id(&content) != Some(id) {
            return Err(config_error(path, FIELD, format!("adding {content:?} did not give it id {id}")));
        }
    }
    Ok(())
}

/// Collects the chat templates of a model directory (see [`Tokenizer::from_dir`] for the
/// precedence) and compiles them.
fn load_chat_templates(dir: &Path, config_template: Option<&Json>, config_path: &Path) -> Result<Option<ChatTemplate>> {
    // (name, source, origin); name "default" is the one used unless another is asked for.
    let mut sources: Vec<(String, String, String)> = Vec::new();
    match config_template {
        None | Some(Json::Null) => {}
        Some(Json::String(s)) => sources.push((DEFAULT_TEMPLATE.to_string(), s.clone(), format!("{} (chat_template)", config_path.display()))),
        Some(Json::Array(items)) => {
            for item in items {
                let name = item.get("name").and_then(Json::as_str);
                let template = item.get("template").and_then(Json::as_str);
                let (Some(name), Some(template)) = (name, template) else {
                    return Err(config_error(config_path, "chat_template", "list entries need string `name` and `template`"));
                };
                sources.push((name.to_string(), template.to_string(), format!("{} (chat_template {name:?})", config_path.display())));
            }
        }
        Some(v) => return Err(config_error(config_path, "chat_template", format!("expected a string or a list, found {v}"))),
    }

    let mut set = |name: &str, source: String, origin: String| {
        sources.retain(|(n, _, _)| n != name);
        sources.push((name.to_string(), source, origin));
    };
    let jinja_path = dir.join("chat_template.jinja");
    if let Some(source) = read_optional(&jinja_path)? {
        set(DEFAULT_TEMPLATE, source, jinja_path.display().to_string());
    }
    let extra_dir = dir.join("additional_chat_templates");
    if let Ok(entries) = std::fs::read_dir(&extra_dir) {
        let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for path in paths {
            if path.extension().and_then(|e| e.to_str()) != Some("jinja") {
                continue;
            }
            let Some(name) = path.file_stem().and_then(|s| s.to_str()) else {
                continue;
            };
            let source = std::fs::read_to_string(&path).map_err(|source| TokenizerError::Io { path: path.clone(), source })?;
            let name = name.to_string();
            set(&name, source, path.display().to_string());
        }
    }
    if !sources.iter().any(|(n, _, _)| n == DEFAULT_TEMPLATE) {
        let json_path = dir.join("chat_template.json");
        if let Some(v) = read_optional_json(&json_path)? {
            match v.get("chat_template") {
                Some(Json::String(s)) => {
                    sources.push((DEFAULT_TEMPLATE.to_string(), s.clone(), format!("{} (chat_template)", json_path.display())));
                }
                None | Some(Json::Null) => {}
                Some(_) => return Err(config_error(&json_path, "chat_template", "expected a string")),
            }
        }
    }
    if sources.is_empty() {
        return Ok(None);
    }
    ChatTemplate::from_named(sources).map(Some)
}

const DEFAULT_TEMPLATE: &str = "default";
const TOOL_USE_TEMPLATE: &str = "tool_use";

/// A compiled chat template (Jinja), rendered as `transformers`' `apply_chat_template(...,
/// tokenize=False)` renders it.
///
/// A model may have several named templates (`tokenizer_config.json` lists, or
/// `additional_chat_templates/`); `default` is used, or `tool_use` when one exists and a
/// non-null `tools` kwarg is given, as in `transformers`.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// (name, origin, source) of each template; the name is also the minijinja template name.
    templates: Vec<(String, String, String)>,
    special_tokens: serde_json::Map<String, Json>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<(&str, &str)> = self.templates.iter().map(|(n, o, _)| (n.as_str(), o.as_str())).collect();
        f.debug_struct("ChatTemplate").field("templates", &names).field("special_tokens", &self.special_tokens).finish()
    }
}

/// Marks an error raised by the template's own `raise_exception(message)` call.
#[derive(Debug)]
struct RaisedException(String);

impl std::fmt::Display for RaisedException {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

impl ChatTemplate {
    /// Compiles one template. `origin` names where it came from (a file path) in errors.
    ///
    /// Errors: [`TokenizerError::TemplateSyntax`] with the origin and line.
    pub fn new(source: impl Into<String>, origin: impl Into<String>) -> Result<Self> {
        Self::from_named(vec![(DEFAULT_TEMPLATE.to_string(), source.into(), origin.into())])
    }

    /// Compiles named templates: `(name, source, origin)`.
    fn from_named(sources: Vec<(String, String, String)>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| TokenizerError::TemplateSyntax { origin: "(syntax configuration)".to_string(), message: describe_error(&e) })?,
        );
        // Jinja2 as transformers uses it never auto-escapes; minijinja would pick HTML or JSON
        // escaping from a template name ending in .html or .json.
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_filter("string", string_filter);

        let mut templates = Vec::with_capacity(sources.len());
        for (name, source, origin) in sources {
            env.add_template_owned(name.clone(), source.clone()).map_err(|e| TokenizerError::TemplateSyntax { origin: origin.clone(), message: describe_error(&e) })?;
            templates.push((name, origin, source));
        }
        Ok(Self { env, templates, special_tokens: serde_json::Map::new() })
    }

    /// Sets the variables `bos_token`, `eos_token`, ... that templates read (strings), as
    /// `transformers` passes its special-tokens map. Render kwargs override them.
    pub fn with_special_tokens(mut self, tokens: serde_json::Map<String, Json>) -> Self {
        self.special_tokens = tokens;
        self
    }

    /// Where the default template came from (a file path, or a path and a JSON field).
    pub fn origin(&self) -> &str {
        self.pick(false).map(|(_, o, _)| o.as_str()).unwrap_or("")
    }

    /// The default template's Jinja source.
    pub fn source(&self) -> &str {
        self.pick(false).map(|(_, _, s)| s.as_str()).unwrap_or("")
    }

    /// Names of all templates (`default`, `tool_use`, ...).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.templates.iter().map(|(n, _, _)| n.as_str())
    }

    fn pick(&self, with_tools: bool) -> Option<&(String, String, String)> {
        let find = |name: &str| self.templates.iter().find(|(n, _, _)| n == name);
        if self.templates.len() == 1 {
            return self.templates.first();
        }
        if with_tools {
            if let Some(t) = find(TOOL_USE_TEMPLATE) {
                return Some(t);
            }
        }
        find(DEFAULT_TEMPLATE)
    }

    /// Renders `messages` into the prompt text.
    ///
    /// As `apply_chat_template(messages, tokenize=False, add_generation_prompt=...,
    /// **kwargs)`: the template sees `messages` (role/content maps), `add_generation_prompt`,
    /// `tools` and `documents` (none unless given in `kwargs`), the special-token strings, and
    /// every entry of `kwargs` (e.g. `enable_thinking: false`, `tools: [...]`). Encode the
    /// result with [`Tokenizer::encode_with`]`(text, false)` as `transformers` does.
    ///
    /// Errors: [`TokenizerError::TemplateException`] with the template's own message when it
    /// calls `raise_exception`, [`TokenizerError::TemplateRender`] otherwise.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool, kwargs: &serde_json::Map<String, Json>) -> Result<String> {
        let messages: Vec<Json> = messages
            .iter()
            .map(|m| {
                let mut o = serde_json::Map::new();
                o.insert("role".into(), Json::String(m.role.clone()));
                o.insert("content".into(), Json::String(m.content.clone()));
                Json::Object(o)
            })
            .collect();
        self.render_json(&messages, add_generation_prompt, kwargs)
    }

    /// [`render`](Self::render) for messages given as JSON objects, so they can carry
    /// `tool_calls`, `reasoning_content`, `name`, list-valued `content`, ... as OpenAI-style
    /// requests do.
    pub fn render_json(&self, messages: &[Json], add_generation_prompt: bool, kwargs: &serde_json::Map<String, Json>) -> Result<String> {
        let with_tools = kwargs.get("tools").is_some_and(|t| !t.is_null());
        let Some((name, origin, _)) = self.pick(with_tools) else {
            let names: Vec<&str> = self.names().collect();
            return Err(TokenizerError::TemplateRender {
                origin: self.templates.first().map(|(_, o, _)| o.clone()).unwrap_or_default(),
                message: format!("several chat templates ({names:?}) and none named \"default\""),
            });
        };
        // Same precedence as transformers: special tokens, then kwargs, then the explicit
        // arguments (which Python would reject as duplicates in kwargs).
        let mut ctx = serde_json::Map::new();
        ctx.insert("tools".into(), Json::Null);
        ctx.insert("documents".into(), Json::Null);
        for (k, v) in &self.special_tokens {
            ctx.insert(k.clone(), v.clone());
        }
        for (k, v) in kwargs {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), Json::Array(messages.to_vec()));
        ctx.insert("add_generation_prompt".into(), Json::Bool(add_generation_prompt));

        let template = self.env.get_template(name).map_err(|e| TokenizerError::TemplateRender { origin: origin.clone(), message: describe_error(&e) })?;
        template.render(Value::from(minijinja::value::Serde(&ctx))).map_err(|e| match raised_message(&e) {
            Some(message) => TokenizerError::TemplateException { origin: origin.clone(), message },
            None => TokenizerError::TemplateRender { origin: origin.clone(), message: describe_error(&e) },
        })
    }
}

/// The message of a `raise_exception` call anywhere in an error's source chain.
fn raised_message(err: &minijinja::Error) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(r) = e.downcast_ref::<RaisedException>() {
            return Some(r.0.clone());
        }
        cur = e.source();
    }
    None
}

/// A one-line description of a minijinja error: kind, detail, line, and its causes.
fn describe_error(err: &minijinja::Error) -> String {
    let mut msg = err.kind().to_string();
    if let Some(detail) = err.detail() {
        let _ = write!(msg, ": {detail}");
    }
    if let Some(line) = err.line() {
        let _ = write!(msg, " (line {line})");
    }
    let mut cur = std::error::Error::source(err);
    while let Some(e) = cur {
        let _ = write!(msg, ": {e}");
        cur = e.source();
    }
    msg
}

/// Prints values as Jinja2 in Python does where minijinja differs: `None`, `True`, `False`.
fn python_formatter(out: &mut minijinja::Output, state: &mut minijinja::State, value: &Value) -> std::result::Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::None => out.write_str("None").map_err(minijinja::Error::from),
        ValueKind::Bool => out.write_str(if value.is_true() { "True" } else { "False" }).map_err(minijinja::Error::from),
        _ => match python_float(value) {
            Some(f) => out.write_str(&python_str_float(f)).map_err(minijinja::Error::from),
            None => minijinja::escape_formatter(out, state, value),
        },
    }
}

/// The value of a float (not an integer) number.
fn python_float(value: &Value) -> Option<f64> {
    if value.kind() == ValueKind::Number && !value.is_integer() {
        f64::try_from(value.clone()).ok()
    } else {
        None
    }
}

/// Python's `str(float)`, which Jinja2 prints and `|string` returns (`1e+16`, `1e-05`, `2.0`,
/// `nan`, `inf`), where minijinja writes Rust's digits (`10000000000000000.0`, `0.00001`).
fn python_str_float(f: f64) -> String {
    if f.is_nan() {
        "nan".to_string()
    } else if f.is_infinite() {
        if f > 0.0 { "inf" } else { "-inf" }.to_string()
    } else {
        python_float_repr(f)
    }
}

/// `|string` as in Jinja2 (Python's `str()`): floats as Python writes them (Qwen3.5's template
/// writes tool-call arguments that are not containers with `| string`); other values as
/// minijinja's built-in filter, whose `None`/`True`/`False` already match.
fn string_filter(state: &minijinja::State, value: &Value) -> std::result::Result<Value, minijinja::Error> {
    match python_float(value) {
        Some(f) => Ok(Value::from(python_str_float(f))),
        None => minijinja::filters::string(state, value),
    }
}

/// `raise_exception(message)`: aborts rendering with the template's message
/// (transformers raises `jinja2.exceptions.TemplateError(message)`).
fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(RaisedException(message)))
}

/// `strftime_now(format)`: the local time formatted as Python's
/// `datetime.now().strftime(format)` (strftime directives via jiff).
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    let now = jiff::ZonedDateTime::now();
    jiff::fmt::strtime::format(&format, &now).map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("strftime_now({format:?}): {e}")))
}

/// Options of Python's `json.dumps` that transformers' `tojson` exposes.
struct JsonOptions {
    ensure_ascii: bool,
    /// `None`: one line; `Some(unit)`: newline and `unit` repeated per nesting level.
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

/// The `tojson` filter of transformers:
/// `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)` =
/// `json.dumps(...)` with the same arguments, positional or keyword. Unlike minijinja's and
/// Jinja2's built-in filter it does not HTML-escape `<`, `>`, `&`, `'`, and it uses Python's
/// separators (`", "`, `": "`), number formatting (`1e-06`, `1.0`) and string escaping.
fn tojson(value: &Value, args: Rest<ValueOrKwargs>) -> std::result::Result<Value, minijinja::Error> {
    let mut positional: Vec<Value> = args.into_values();
    let kwargs = match positional.last() {
        Some(last) if last.is_kwargs() => Some(Kwargs::try_from(positional.pop().unwrap_or_default())?),
        _ => None,
    };
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if positional.len() > NAMES.len() {
        return Err(minijinja::Error::new(ErrorKind::TooManyArguments, "tojson takes at most 4 arguments (ensure_ascii, indent, separators, sort_keys)"));
    }
    let arg = |i: usize| -> std::result::Result<Option<Value>, minijinja::Error> {
        let from_kw = match &kwargs {
            Some(kw) if kw.has(NAMES[i]) => Some(kw.get::<Value>(NAMES[i])?),
            _ => None,
        };
        match (positional.get(i).cloned(), from_kw) {
            (Some(_), Some(_)) => Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson got multiple values for argument '{}'", NAMES[i]))),
            (a, b) => Ok(a.or(b)),
        }
    };
    let ensure_ascii = arg(0)?.is_some_and(|v| v.is_true());
    let indent = match arg(1)? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_string()),
        Some(v) if v.is_integer() => {
            let n = v.as_i64().unwrap_or(0).max(0) as usize;
            Some(" ".repeat(n))
        }
        Some(v) => return Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson indent must be an integer or a string, not {}", v.kind()))),
    };
    let (item_separator, key_separator) = match arg(2)? {
        Some(v) if !v.is_none() && !v.is_undefined() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => (a.as_str().unwrap_or_default().to_string(), b.as_str().unwrap_or_default().to_string()),
                _ => return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "tojson separators must be a pair of strings")),
            }
        }
        // Python: (', ', ': ') without indent, (',', ': ') with it.
        _ => (if indent.is_some() { "," } else { ", " }.to_string(), ": ".to_string()),
    };
    let sort_keys = arg(3)?.is_some_and(|v| v.is_true());
    if let Some(kw) = &kwargs {
        kw.assert_all_used()?;
    }
    let options = JsonOptions { ensure_ascii, indent, item_separator, key_separator, sort_keys };
    let mut out = String::new();
    write_python_json(value, &options, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn not_serializable(kind: impl std::fmt::Display) -> minijinja::Error {
    minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: object of type {kind} is not JSON serializable"))
}

/// Writes `value` as Python's `json.dumps` does (json/encoder.py), with `options`.
fn write_python_json(value: &Value, options: &JsonOptions, level: usize, out: &mut String) -> std::result::Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&python_number(value)?),
        ValueKind::String => write_python_string(value.as_str().unwrap_or_default(), options.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, options, level, '[', ']', items.len(), |i, out| write_python_json(&items[i], options, level + 1, out))?;
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((key, item));
            }
            if options.sort_keys {
                sort_python_keys(&mut entries)?;
            }
            write_container(out, options, level, '{', '}', entries.len(), |i, out| {
                let (key, item) = &entries[i];
                let key = python_key(key)?;
                write_python_string(&key, options.ensure_ascii, out);
                out.push_str(&options.key_separator);
                write_python_json(item, options, level + 1, out)
            })?;
        }
        other => return Err(not_serializable(other)),
    }
    Ok(())
}

/// Brackets, separators and indentation of a list or object with `len` entries.
fn write_container(
    out: &mut String,
    options: &JsonOptions,
    level: usize,
    open: char,
    close: char,
    len: usize,
    mut entry: impl FnMut(usize, &mut String) -> std::result::Result<(), minijinja::Error>,
) -> std::result::Result<(), minijinja::Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, depth: usize| {
        if let Some(unit) = &options.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(unit);
            }
        }
    };
    for i in 0..len {
        if i > 0 {
            out.push_str(&options.item_separator);
        }
        newline(out, level + 1);
        entry(i, out)?;
    }
    newline(out, level);
    out.push(close);
    Ok(())
}

/// Python's `json.dumps` key conversion: str as is, numbers, bools and None as their JSON text.
fn python_key(key: &Value) -> std::result::Result<String, minijinja::Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::Number => python_number(key),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_string()),
        ValueKind::None => Ok("null".to_string()),
        other => Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: keys must be str, int, float, bool or None, not {other}"))),
    }
}

/// `sort_keys=True`: Python sorts keys of one type (all strings, or all numbers) and raises
/// on a mix.
fn sort_python_keys(entries: &mut [(Value, Value)]) -> std::result::Result<(), minijinja::Error> {
    let all = |k: ValueKind| entries.iter().all(|(key, _)| key.kind() == k);
    if all(ValueKind::String) {
        // Rust orders str by UTF-8 bytes, which is code-point order, as Python compares str.
        entries.sort_by(|a, b| a.0.as_str().cmp(&b.0.as_str()));
        Ok(())
    } else if entries.iter().all(|(k, _)| matches!(k.kind(), ValueKind::Number | ValueKind::Bool)) {
        let num = |v: &Value| f64::try_from(v.clone()).unwrap_or(if v.is_true() { 1.0 } else { 0.0 });
        entries.sort_by(|a, b| num(&a.0).total_cmp(&num(&b.0)));
        Ok(())
    } else {
        Err(minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: sort_keys needs keys of one type"))
    }
}

/// A number as Python's `json.dumps` writes it: integers in full, floats as `float.__repr__`.
fn python_number(value: &Value) -> std::result::Result<String, minijinja::Error> {
    if value.is_integer() {
        return Ok(value.to_string());
    }
    let f = f64::try_from(value.clone())?;
    Ok(python_float_repr(f))
}

/// `float.__repr__` (and json's `NaN`/`Infinity`): the shortest digits that round-trip, in
/// fixed notation when the decimal exponent is in [-4, 16), else `d.ddde±XX`.
fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_string();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    // Rust's `{:e}` gives the shortest round-trip digits, like Python's repr.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (negative, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let n = digits.len() as i32;
    let decpt = exp + 1; // position of the decimal point relative to the first digit
    let mut out = String::new();
    if negative {
        out.push('-');
    }
    if -4 < decpt && decpt <= 16 {
        if decpt <= 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-decpt) as usize));
            out.push_str(&digits);
        } else if decpt >= n {
            out.push_str(&digits);
            out.extend(std::iter::repeat_n('0', (decpt - n) as usize));
            out.push_str(".0");
        } else {
            out.push_str(&digits[..decpt as usize]);
            out.push('.');
            out.push_str(&digits[decpt as usize..]);
        }
    } else {
        out.push_str(&digits[..1]);
        if n > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    out
}

/// A JSON string as Python writes it: `ensure_ascii=False` escapes only `"`, `\` and control
/// characters; `ensure_ascii=True` also writes everything outside ' '..='~' as `\uXXXX`
/// (UTF-16, lowercase hex).
fn write_python_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Incremental detokenizer: feed generated ids one at a time, get the new text as soon as it
/// is complete UTF-8.
///
/// Byte-level BPE splits multi-byte characters (emoji, CJK) across tokens; decoding each token
/// alone would print U+FFFD. This keeps the ids of the last emitted chunk as context, decodes
/// context + pending ids, and emits the difference only when it does not end in U+FFFD (the
/// algorithm of `tokenizers`' `DecodeStream` and TGI). `DecodeStream` itself is not used
/// because it cannot flush a held-back tail at the end of generation, which
/// [`finish`](Self::finish) does.
pub struct TokenStream<'a> {
    tokenizer: TokenizerRef<'a>,
    /// Ids of the last emitted chunk (context), then ids not yet emitted.
    ids: Vec<u32>,
    /// `ids[..read_offset]` is the context.
    read_offset: usize,
    /// Decoded text of the context.
    prefix: String,
}

/// The tokenizer a [`TokenStream`] decodes with: borrowed, or shared.
enum TokenizerRef<'a> {
    Borrowed(&'a Tokenizer),
    Shared(std::sync::Arc<Tokenizer>),
}

impl std::ops::Deref for TokenizerRef<'_> {
    type Target = Tokenizer;
    fn deref(&self) -> &Tokenizer {
        match self {
            TokenizerRef::Borrowed(t) => t,
            TokenizerRef::Shared(t) => t,
        }
    }
}

impl std::fmt::Debug for TokenStream<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenStream").field("ids", &self.ids).field("read_offset", &self.read_offset).field("prefix", &self.prefix).finish()
    }
}

impl TokenStream<'_> {
    /// Feeds one id. Returns the text that became complete, or `None` while a multi-byte
    /// character is still split across tokens (or the id added no text). The concatenation of
    /// everything returned, plus [`finish`](Self::finish), equals `decode(all ids)`.
    ///
    /// Errors: [`TokenizerError::UnknownTokenId`]; the stream is unchanged then.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.tokenizer.check_id(id)?;
        self.ids.push(id);
        let text = self.tokenizer.decode_unchecked(&self.ids)?;
        if text.len() <= self.prefix.len() || text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let Some(new) = text.strip_prefix(self.prefix.as_str()) else {
            // Decoding the longer sequence changed text already emitted (not possible with
            // byte-level BPE); wait for more ids, finish() reconciles.
            return Ok(None);
        };
        let new = new.to_string();
        // The just-emitted ids become the context for the next chunk.
        self.ids.drain(..self.read_offset);
        self.read_offset = self.ids.len();
        self.prefix = self.tokenizer.decode_unchecked(&self.ids)?;
        Ok(Some(new))
    }

    /// The text of ids not yet emitted: non-empty when the ids ended mid-character (then it
    /// holds U+FFFD, as `decode` would) or on a token that decodes to U+FFFD itself.
    pub fn finish(self) -> String {
        if self.ids.len() == self.read_offset {
            return String::new();
        }
        let Ok(text) = self.tokenizer.decode_unchecked(&self.ids) else {
            return String::new();
        };
        match text.strip_prefix(self.prefix.as_str()) {
            Some(rest) => rest.to_string(),
            None => {
                // Emit from the first character where the texts differ.
                let common = text.char_indices().zip(self.prefix.chars()).take_while(|((_, a), b)| a == b).last().map_or(0, |((i, a), _)| i + a.len_utf8());
                text[common..].to_string()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::shared;
    use std::sync::OnceLock;

    /// The full Qwen3.5 tokenizer, loaded once (16 MB of JSON).
    fn qwen() -> &'static Tokenizer {
        static TOK: OnceLock<Tokenizer> = OnceLock::new();
        TOK.get_or_init(|| Tokenizer::from_dir(&shared("tokenizers/qwen3.5")).unwrap())
    }

    #[derive(Deserialize)]
    struct Case {
        text: String,
        ids: Vec<u32>,
    }

    fn check_encode_cases(tok: &Tokenizer, file: &Path) {
        let cases: Vec<Case> = serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
        assert!(cases.len() >= 20, "{}: too few cases", file.display());
        for case in &cases {
            let ids = tok.encode(&case.text).unwrap();
            assert_eq!(ids, case.ids, "encode({:?}) in {}", case.text, file.display());
            // The tokenizer NFC-normalizes; the only case that NFC changes is a combining
            // acute accent, which composes to U+00E9.
            let nfc = case.text.replace("e\u{301}", "\u{e9}");
            assert_eq!(tok.decode(&ids).unwrap(), nfc, "decode(encode({:?}))", case.text);
        }
    }

    #[test]
    fn qwen35_encode_cases() {
        let tok = qwen();
        assert_eq!(tok.vocab_size(), 248_077);
        check_encode_cases(tok, &shared("tokenizers/qwen3.5/encode_cases.json"));
    }

    #[test]
    fn qwen35_v2048_encode_cases() {
        let tok = Tokenizer::from_dir(&shared("tokenizers/qwen3.5-v2048")).unwrap();
        assert_eq!(tok.vocab_size(), 2048);
        check_encode_cases(&tok, &shared("tokenizers/qwen3.5-v2048/encode_cases.json"));
    }

    #[test]
    fn long_whitespace_round_trips() {
        // fancy-regex's find_iter stops silently on a runtime error (fancy-regex#138); long
        // runs that the look-ahead rule `\s+(?!\S)` scans are the risky input.
        let text = format!("{}x{}y", " ".repeat(20_000), "\n \t".repeat(5_000));
        let ids = qwen().encode(&text).unwrap();
        assert_eq!(qwen().decode(&ids).unwrap(), text);
    }

    #[test]
    fn special_tokens_in_text_and_no_bos() {
        let tok = qwen();
        // Ids from the added_tokens list of tokenizer.json (shared/fixtures/README.md).
        let ids = tok.encode("<think></think><|im_end|>").unwrap();
        assert_eq!(ids, vec![248_068, 248_069, 248_046]);
        assert_eq!(tok.encode_with("<|im_start|>", false).unwrap(), vec![248_045]);
        assert_eq!(tok.decode(&ids).unwrap(), "<think></think><|im_end|>");
    }

    #[test]
    fn unknown_ids_are_errors() {
        let tok = qwen();
        let err = tok.decode(&[9419, 248_077]).unwrap_err();
        assert!(matches!(err, TokenizerError::UnknownTokenId { id: 248_077, vocab_size: 248_077 }), "{err}");
        let mut stream = tok.stream();
        assert!(stream.push(300_000).is_err());
        assert_eq!(stream.push(9419).unwrap().as_deref(), Some("Hello"));
    }

    /// Reads tensor `ids` (i32) of a reference file; MLX-written files may be unaligned.
    fn reference_ids(path: &Path) -> Vec<u32> {
        let bytes = std::fs::read(path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let view = st.tensor("ids").unwrap();
        assert_eq!(view.dtype(), safetensors::Dtype::I32);
        view.data().chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32).collect()
    }

    #[test]
    fn vocab_fixture_chat_prompt_matches_reference_ids() {
        let fixture = shared("fixtures/vocab");
        let tok = Tokenizer::from_dir(&fixture.join("mlx-q4")).unwrap();
        let template = tok.chat_template().expect("the fixture ships chat_template.jinja");
        assert!(template.origin().ends_with("chat_template.jinja"));
        let prompt = template.render(&[ChatMessage::new("user", "Write a haiku about the sea, please.")], true, &serde_json::Map::new()).unwrap();
        let ids = tok.encode_with(&prompt, false).unwrap();
        let reference = reference_ids(&fixture.join("reference.safetensors"));
        assert_eq!(ids.len(), 18);
        assert_eq!(ids, reference[..18]);
        // The generated continuation decodes without unknown ids.
        tok.decode(&reference[18..]).unwrap();
    }

    #[test]
    fn eos_ids_from_all_config_files() {
        let vocab = Tokenizer::from_dir(&shared("fixtures/vocab/mlx-q4")).unwrap();
        assert_eq!(vocab.eos_ids(), &[248_044, 248_046]);
        assert!(vocab.is_eos(248_046) && !vocab.is_eos(248_045));
        let demo = Tokenizer::from_dir(&shared("models/tensorfold-demo-py28m/mlx-q4")).unwrap();
        // <|endoftext|> from the configs, <|im_end|> (8191) as an end-of-generation marker.
        assert_eq!(demo.eos_ids(), &[8189, 8191]);
        assert!(demo.chat_template().is_none());

        // tiny/hf keeps its template inside tokenizer_config.json, tiny/mlx-q4 in a .jinja
        // file; both are the same ChatML template (shared/fixtures/README.md).
        let hf = Tokenizer::from_dir(&shared("fixtures/tiny/hf")).unwrap();
        let mlx = Tokenizer::from_dir(&shared("fixtures/tiny/mlx-q4")).unwrap();
        assert_eq!(hf.eos_ids(), &[2015, 2017]);
        assert_eq!(mlx.eos_ids(), &[2015, 2017]);
        let (hf_t, mlx_t) = (hf.chat_template().unwrap(), mlx.chat_template().unwrap());
        assert!(hf_t.origin().contains("tokenizer_config.json"), "{}", hf_t.origin());
        let msgs = [ChatMessage::new("system", "s"), ChatMessage::new("user", "u")];
        let none = serde_json::Map::new();
        let rendered = hf_t.render(&msgs, true, &none).unwrap();
        assert_eq!(rendered, mlx_t.render(&msgs, true, &none).unwrap());
        assert_eq!(rendered, "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn end_of_generation_markers_stop_when_no_config_names_them() {
        // Issue 21: configs without any eos_token_id (as some mlx-community conversions ship)
        // left <|endoftext|> out of the stop set; Qwen3.5 ends on it and on <|im_end|>.
        let tmp = crate::testutil::TempDir::new("tokenizer-no-eos");
        let src = shared("fixtures/vocab/mlx-q4");
        // Copied by content: the shared files are read-only, and copies would keep that mode.
        for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"] {
            std::fs::write(tmp.path().join(f), std::fs::read(src.join(f)).unwrap()).unwrap();
        }
        for f in ["config.json", "generation_config.json"] {
            let mut v: Json = serde_json::from_str(&std::fs::read_to_string(src.join(f)).unwrap()).unwrap();
            let had = v.as_object_mut().unwrap().remove("eos_token_id").is_some();
            let nested = v.get_mut("text_config").and_then(Json::as_object_mut).and_then(|t| t.remove("eos_token_id")).is_some();
            assert!(had || nested, "{f} named an EOS id");
            let text = serde_json::to_string_pretty(&v).unwrap();
            assert!(!text.contains("eos_token_id"), "{f}");
            std::fs::write(tmp.path().join(f), text).unwrap();
        }
        let tok = Tokenizer::from_dir(tmp.path()).unwrap();
        assert_eq!(tok.eos_ids(), &[248_044, 248_046]);
        assert!(tok.is_eos(248_044) && tok.is_eos(248_046) && !tok.is_eos(248_045));

        // Without tokenizer_config's eos_token either: the vocabulary's markers alone.
        let cfg_path = tmp.path().join("tokenizer_config.json");
        let mut cfg: Json = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
        assert!(cfg.as_object_mut().unwrap().remove("eos_token").is_some());
        std::fs::write(&cfg_path, cfg.to_string()).unwrap();
        assert_eq!(Tokenizer::from_dir(tmp.path()).unwrap().eos_ids(), &[248_044, 248_046]);
    }

    #[test]
    fn only_special_tokens_are_end_of_generation_markers() {
        // A plain added token with a marker's text is ordinary text; a special one stops.
        let dir = scratch_dir(
            "eog-special",
            &[(
                "tokenizer_config.json",
                r#"{"added_tokens_decoder": {
                    "2048": {"content": "<|eot_id|>", "special": false},
                    "2049": {"content": "<end_of_turn>", "special": true},
                    "2050": {"content": "<|not_an_end|>", "special": true}}}"#,
            )],
        );
        let tok = Tokenizer::from_dir(&dir).unwrap();
        assert_eq!(tok.token_to_id("<|eot_id|>"), Some(2048));
        // 2015 <|endoftext|> and 2017 <|im_end|> of the 2,048-id vocabulary, then 2049.
        assert_eq!(tok.eos_ids(), &[2015, 2017, 2049]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A scratch model directory holding the 2,048-id tokenizer plus the given files.
    fn scratch_dir(tag: &str, files: &[(&str, &str)]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tensorfold-tokenizer-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(shared("tokenizers/qwen3.5-v2048/tokenizer.json"), dir.join("tokenizer.json")).unwrap();
        for (name, text) in files {
            let path = dir.join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        dir
    }

    #[test]
    fn config_sources_and_precedence() {
        // eos from config.json (top level int + text_config list) and eos_token as an
        // AddedToken object; the .jinja file wins over tokenizer_config's template.
        let dir = scratch_dir(
            "precedence",
            &[
                (
                    "tokenizer_config.json",
                    r#"{"eos_token": {"content": "<|endoftext|>", "special": true},
                        "bos_token": "<|im_start|>",
                        "chat_template": "from config"}"#,
                ),
                ("config.json", r#"{"eos_token_id": 7, "text_config": {"eos_token_id": [2017, 9]}}"#),
                ("chat_template.jinja", "{{ bos_token }}|{{ eos_token }}|{{ messages[0].content }}\n"),
            ],
        );
        let tok = Tokenizer::from_dir(&dir).unwrap();
        // <|endoftext|> is id 2015 in the 2,048-id vocabulary (2,015 ranks, then the specials).
        assert_eq!(tok.eos_ids(), &[7, 9, 2015, 2017]);
        let t = tok.chat_template().unwrap();
        assert!(t.origin().ends_with("chat_template.jinja"), "{}", t.origin());
        let out = t.render(&[ChatMessage::new("user", "hi")], false, &serde_json::Map::new()).unwrap();
        // minijinja, like Jinja2 by default, drops one trailing newline.
        assert_eq!(out, "<|im_start|>|<|endoftext|>|hi");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn load_errors_name_the_file() {
        let empty = std::env::temp_dir().join(format!("tensorfold-tokenizer-empty-{}", std::process::id()));
        std::fs::create_dir_all(&empty).unwrap();
        let err = Tokenizer::from_dir(&empty).unwrap_err();
        assert!(matches!(err, TokenizerError::MissingFile { .. }));
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
        std::fs::remove_dir_all(&empty).unwrap();

        let dir = scratch_dir("badjson", &[("generation_config.json", "{\"eos_token_id\": [1,")]);
        let err = Tokenizer::from_dir(&dir).unwrap_err();
        assert!(matches!(err, TokenizerError::Json { .. }), "{err}");
        assert!(err.to_string().contains("generation_config.json"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();

        let dir = scratch_dir("badfield", &[("config.json", r#"{"eos_token_id": "x"}"#)]);
        let err = Tokenizer::from_dir(&dir).unwrap_err();
        assert!(err.to_string().contains("config.json") && err.to_string().contains("eos_token_id"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();

        let dir = scratch_dir("badeos", &[("tokenizer_config.json", r#"{"eos_token": "<nope>"}"#)]);
        let err = Tokenizer::from_dir(&dir).unwrap_err();
        assert!(err.to_string().contains("<nope>"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();

        let dir = scratch_dir("badtemplate", &[("chat_template.jinja", "line one\n{% if x %}unclosed")]);
        let err = Tokenizer::from_dir(&dir).unwrap_err();
        assert!(matches!(err, TokenizerError::TemplateSyntax { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains("chat_template.jinja") && msg.contains("line 2"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn added_tokens_from_tokenizer_config() {
        // A token only tokenizer_config.json declares, at the next free id (2048), is added.
        let dir = scratch_dir(
            "added",
            &[(
                "tokenizer_config.json",
                r#"{"added_tokens_decoder": {
                    "2017": {"content": "<|im_end|>", "special": true},
                    "2048": {"content": "<|extra|>", "special": true}}}"#,
            )],
        );
        let tok = Tokenizer::from_dir(&dir).unwrap();
        assert_eq!(tok.vocab_size(), 2049);
        assert_eq!(tok.encode("a<|extra|>").unwrap().last(), Some(&2048));
        std::fs::remove_dir_all(&dir).unwrap();
        // A conflicting id is an error naming the field.
        let dir = scratch_dir("added-bad", &[("tokenizer_config.json", r#"{"added_tokens_decoder": {"2016": {"content": "<|im_end|>", "special": true}}}"#)]);
        let err = Tokenizer::from_dir(&dir).unwrap_err();
        assert!(err.to_string().contains("added_tokens_decoder"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn stream_holds_back_split_characters() {
        let tok = qwen();
        let text = "emoji 😀👍🏽 family 👨‍👩‍👧‍👦, 中文测试 Tōkyō 🇯🇵 done";
        let ids = tok.encode(text).unwrap();
        // The test only means something if some token is part of a character.
        let split = ids.iter().filter(|&&id| tok.decode(&[id]).unwrap().contains('\u{FFFD}')).count();
        assert!(split >= 2, "no token of the test text splits a character");

        let mut stream = tok.stream();
        let mut out = String::new();
        let mut held = 0;
        for &id in &ids {
            match stream.push(id).unwrap() {
                Some(chunk) => {
                    assert!(!chunk.contains('\u{FFFD}'), "chunk {chunk:?}");
                    out.push_str(&chunk);
                }
                None => held += 1,
            }
        }
        assert!(held >= 1);
        assert_eq!(stream.finish(), "");
        assert_eq!(out, tok.decode(&ids).unwrap());
        assert_eq!(out, text);
    }

    #[test]
    fn stream_finish_flushes_the_tail() {
        let tok = qwen();
        // Find a character that byte-level BPE splits, and a token boundary inside it:
        // decoding up to there ends in U+FFFD.
        let (ids, cut) = ["ok 😀", "ok 🦩", "ok 𝔘", "ok 𓀀"]
            .iter()
            .find_map(|text| {
                let ids = tok.encode(text).unwrap();
                let cut = (1..ids.len()).find(|&k| tok.decode(&ids[..k]).unwrap().ends_with('\u{FFFD}'))?;
                Some((ids, cut))
            })
            .expect("one of the characters spans several tokens");
        let mut stream = tok.stream();
        let mut out = String::new();
        for &id in &ids[..cut] {
            out.extend(stream.push(id).unwrap());
        }
        out.push_str(&stream.finish());
        assert_eq!(out, tok.decode(&ids[..cut]).unwrap());
        assert!(out.starts_with("ok ") && out.ends_with('\u{FFFD}'), "{out:?}");

        // A real U+FFFD in the text is held only until the next token or the end.
        let ids = tok.encode("a\u{FFFD}").unwrap();
        let mut stream = tok.stream();
        let mut out = String::new();
        for &id in &ids {
            out.extend(stream.push(id).unwrap());
        }
        out.push_str(&stream.finish());
        assert_eq!(out, "a\u{FFFD}");
    }

    /// A Qwen3.5-style template written for this test (not copied from a model repo): system +
    /// tools with `tojson`, `namespace()`, `messages[::-1]` with `break`, `continue`, string
    /// methods, reasoning stripped from history, tool calls with XML parameters, merged tool
    /// responses, `raise_exception`, and the `enable_thinking` switch.
    const QWEN_STYLE: &str = r#"{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>' }}
    {%- if messages[0].role == 'system' %}
        {{- '\n\n' + messages[0].content | trim }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content | trim + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == 'user' and message.content is string and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.last_query_index = index %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
        {%- continue %}
    {%- endif %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
                {{- '\n<tool_call>\n<function=' + call.name + '>\n' }}
                {%- for name, value in call.arguments.items() %}
                    {{- '<parameter=' + name + '>\n' }}
                    {{- value if value is string else value | tojson }}
                    {{- '\n</parameter>\n' }}
                {%- endfor %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"#;

    fn json_map(v: Json) -> serde_json::Map<String, Json> {
        match v {
            Json::Object(m) => m,
            _ => panic!("not an object"),
        }
    }

    fn json_list(v: Json) -> Vec<Json> {
        match v {
            Json::Array(a) => a,
            _ => panic!("not an array"),
        }
    }

    // Expected strings below were rendered by Jinja2 3.1.6 set up as transformers'
    // _compile_jinja_template (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
    // loopcontrols, json.dumps tojson, raise_exception), an implementation independent of
    // minijinja.
    const TOOLS_PREFIX: &str = "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get <current> weather – any city\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}, \"unit\": {\"type\": \"string\", \"enum\": [\"celsius\", \"fahrenheit\"]}, \"days\": {\"type\": \"integer\"}}, \"required\": [\"city\"]}}}\n</tools>\n\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{\"temp\": 18}\n</tool_response>\n<tool_response>\n{\"sky\": \"clear\"}\n</tool_response><|im_end|>\n<|im_start|>assistant\nIt is 18 °C and clear in Paris.<|im_end|>\n<|im_start|>user\nThanks! And in Tōkyō <tomorrow>?<|im_end|>\n<|im_start|>assistant\n";

    fn conversation() -> (Vec<Json>, Json) {
        let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather",
            "description": "Get <current> weather – any city", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string",
            "enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer"}}, "required": ["city"]}}}]);
        let messages = json_list(serde_json::json!([
            {"role": "system", "content": "You are a helpful assistant.\n"},
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "<think>\nNeed the weather tool.\n</think>\n\n",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                "arguments": {"city": "Paris", "unit": "celsius", "days": 2}}}]},
            {"role": "tool", "content": "{\"temp\": 18}"},
            {"role": "tool", "content": "{\"sky\": \"clear\"}"},
            {"role": "assistant", "content": "It is 18 °C and clear in Paris."},
            {"role": "user", "content": "Thanks! And in Tōkyō <tomorrow>?"}
        ]));
        (messages, tools)
    }

    #[test]
    fn qwen_style_template_tools_thinking_multi_turn() {
        let t = ChatTemplate::new(QWEN_STYLE, "test:qwen_style").unwrap();
        let (messages, tools) = conversation();

        let off = json_map(serde_json::json!({"tools": tools, "enable_thinking": false}));
        let out = t.render_json(&messages, true, &off).unwrap();
        assert_eq!(out, format!("{TOOLS_PREFIX}<think>\n\n</think>\n\n"));

        let on = json_map(serde_json::json!({"tools": tools}));
        let out = t.render_json(&messages, true, &on).unwrap();
        assert_eq!(out, format!("{TOOLS_PREFIX}<think>\n"));

        // Multi-step: the last message is a tool result, so the assistant turn after the last
        // user query keeps its reasoning.
        let step = json_list(serde_json::json!([
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                "arguments": {"city": "Oslo", "days": [1, 2.5]}}}]},
            {"role": "tool", "content": "rain"}
        ]));
        let out = t.render_json(&step, false, &serde_json::Map::new()).unwrap();
        assert_eq!(out, "<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n<think>\nCall the tool.\n</think>\n\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n[1, 2.5]\n</parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nrain\n</tool_response><|im_end|>\n");

        // The rendered prompt tokenizes with the template's special tokens as single ids.
        let ids = qwen().encode_with(&out, false).unwrap();
        assert_eq!(ids[0], 248_045);
        assert!(ids.contains(&248_068) && ids.contains(&248_058) && ids.contains(&248_066));
    }

    #[test]
    fn template_exceptions_carry_the_message() {
        let t = ChatTemplate::new(QWEN_STYLE, "test:qwen_style").unwrap();
        let err = t.render(&[], true, &serde_json::Map::new()).unwrap_err();
        match &err {
            TokenizerError::TemplateException { origin, message } => {
                assert_eq!(origin, "test:qwen_style");
                assert_eq!(message, "No messages provided.");
            }
            other => panic!("expected a template exception, got {other}"),
        }
        let late_system = [ChatMessage::new("user", "a"), ChatMessage::new("system", "b")];
        let err = t.render(&late_system, true, &serde_json::Map::new()).unwrap_err();
        assert!(err.to_string().contains("System message must be at the beginning."), "{err}");

        let t = ChatTemplate::new("{{ raise_exception('x') }}", "inline").unwrap();
        let err = t.render(&[], false, &serde_json::Map::new()).unwrap_err();
        assert!(matches!(&err, TokenizerError::TemplateException { message, .. } if message == "x"));
        assert!(err.to_string().contains('x'));

        // Other failures are render errors naming the template.
        let t = ChatTemplate::new("{{ messages[0].content.nope.deeper }}", "inline2").unwrap();
        let err = t.render(&[ChatMessage::new("user", "u")], false, &serde_json::Map::new()).unwrap_err();
        assert!(matches!(err, TokenizerError::TemplateRender { .. }), "{err}");
        assert!(err.to_string().contains("inline2"), "{err}");
    }

    fn render_with_data(src: &str) -> String {
        let data = serde_json::from_str::<Json>(
            r#"{"b": "<x> & ü\n\"q\"\u0001\u007f😀", "a": [1, 2.5, null, true, 1e-06, 1e16, 0.0001, 1.0, 1.2345678901234568e17, -0.0, 5e-324, 18446744073709551615], "e": {}, "l": []}"#,
        )
        .unwrap();
        let t = ChatTemplate::new(src, "tojson-test").unwrap();
        t.render(&[], false, &json_map(serde_json::json!({ "data": data }))).unwrap()
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        // Expected values: Python 3 json.dumps through transformers' tojson (see above).
        let a = "[1, 2.5, null, true, 1e-06, 1e+16, 0.0001, 1.0, 1.2345678901234568e+17, -0.0, 5e-324, 18446744073709551615]";
        assert_eq!(render_with_data("{{ data | tojson }}"), format!("{{\"b\": \"<x> & ü\\n\\\"q\\\"\\u0001\u{7f}😀\", \"a\": {a}, \"e\": {{}}, \"l\": []}}"));
        assert_eq!(render_with_data("{{ data | tojson(sort_keys=true) }}"), format!("{{\"a\": {a}, \"b\": \"<x> & ü\\n\\\"q\\\"\\u0001\u{7f}😀\", \"e\": {{}}, \"l\": []}}"));
        assert_eq!(
            render_with_data("{{ data | tojson(ensure_ascii=true) }}"),
            format!("{{\"b\": \"<x> & \\u00fc\\n\\\"q\\\"\\u0001\\u007f\\ud83d\\ude00\", \"a\": {a}, \"e\": {{}}, \"l\": []}}")
        );
        assert_eq!(
            render_with_data("{{ data | tojson(separators=(',', ':')) }}"),
            "{\"b\":\"<x> & ü\\n\\\"q\\\"\\u0001\u{7f}😀\",\"a\":[1,2.5,null,true,1e-06,1e+16,0.0001,1.0,1.2345678901234568e+17,-0.0,5e-324,18446744073709551615],\"e\":{},\"l\":[]}"
        );
        assert_eq!(
            render_with_data("{{ data | tojson(indent=2) }}"),
            "{\n  \"b\": \"<x> & ü\\n\\\"q\\\"\\u0001\u{7f}😀\",\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true,\n    1e-06,\n    1e+16,\n    0.0001,\n    1.0,\n    1.2345678901234568e+17,\n    -0.0,\n    5e-324,\n    18446744073709551615\n  ],\n  \"e\": {},\n  \"l\": []\n}"
        );
        // Positional arguments are (ensure_ascii, indent, ...), as in transformers.
        assert_eq!(render_with_data("{{ data.a[:3] | tojson(true, '\t') }}"), "[\n\t1,\n\t2.5,\n\tnull\n]");
        assert_eq!(render_with_data("{{ {'k': 'v', 2: 'two'} | tojson }}"), "{\"k\": \"v\", \"2\": \"two\"}");
        // Jinja2 prints Python's None/True/False; undefined prints nothing.
        assert_eq!(render_with_data("{{ none }}|{{ true }}|{{ false }}|{{ undefined_thing }}|{{ 1.0 }}"), "None|True|False||1.0");
    }

    #[test]
    fn python_float_repr_rules() {
        // Values of Python 3 repr(float).
        for (f, want) in [
            (0.1, "0.1"),
            (100.0, "100.0"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e-5, "1.5e-05"),
            (0.00012, "0.00012"),
            (-2.5e300, "-2.5e+300"),
            (f64::INFINITY, "Infinity"),
            (f64::NAN, "NaN"),
        ] {
            assert_eq!(python_float_repr(f), want);
        }
    }

    #[test]
    fn floats_print_and_stringify_as_python_str() {
        // Jinja2 3.1.6 renders this to the expected string, with data from json.loads.
        let t = ChatTemplate::new("{% for x in data %}{{ x }}|{{ x | string }}|{{ (x | string) ~ '!' }} {% endfor %}", "inline").unwrap();
        let data = serde_json::json!({"data": [1e16, 0.00001, 2.0, -0.0, 0.25, 7, true, null, "s"]});
        assert_eq!(
            t.render(&[], false, &json_map(data)).unwrap(),
            "1e+16|1e+16|1e+16! 1e-05|1e-05|1e-05! 2.0|2.0|2.0! -0.0|-0.0|-0.0! 0.25|0.25|0.25! \
             7|7|7! True|True|True! None|None|None! s|s|s! "
        );
    }

    #[test]
    fn template_kwargs_special_tokens_and_pycompat() {
        let mut tokens = serde_json::Map::new();
        tokens.insert("bos_token".into(), Json::String("<s>".into()));
        tokens.insert("eos_token".into(), Json::String("</s>".into()));
        let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}{{ m.role.upper() }}:{{ m.content.strip().split(',')|join('+') }}{{ eos_token }}{% endfor %}\
             {% if add_generation_prompt %}[{{ custom }}|{{ tools }}]{% endif %}",
            "inline",
        )
        .unwrap()
        .with_special_tokens(tokens);
        let kwargs = json_map(serde_json::json!({"custom": "c", "eos_token": "<E>"}));
        let out = t.render(&[ChatMessage::new("user", " a,b ")], true, &kwargs).unwrap();
        // kwargs override the special tokens; tools defaults to None.
        assert_eq!(out, "<s>USER:a+b<E>[c|None]");
    }

    #[test]
    fn strftime_now_is_the_current_time() {
        let t = ChatTemplate::new("{{ strftime_now('%s') }}", "inline").unwrap();
        let rendered: i64 = t.render(&[], false, &serde_json::Map::new()).unwrap().parse().unwrap();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
        assert!((rendered - now).abs() < 600, "{rendered} vs {now}");
    }

    #[test]
    fn named_templates_pick_tool_use_with_tools() {
        let dir = scratch_dir("named", &[("tokenizer_config.json", r#"{"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]}"#)]);
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let t = tok.chat_template().unwrap();
        let none = serde_json::Map::new();
        assert_eq!(t.render(&[], false, &none).unwrap(), "D");
        let tools = json_map(serde_json::json!({"tools": [{"type": "function"}]}));
        assert_eq!(t.render(&[], false, &tools).unwrap(), "T");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
