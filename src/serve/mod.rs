//! `tensorfold serve`: an OpenAI-compatible HTTP server (axum on tokio) in front of the batched
//! [`Runtime`]. Each request becomes one runtime [`crate::runtime::Request`] per choice; its
//! events become the response (one JSON body, or SSE chunks as they come). Dropping the
//! response (the client went away) drops the runtime handles, which cancels the sequences.
//!
//! Routes: `/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/messages`,
//! `/v1/messages/count_tokens`, `/v1/models`, `/tokenize`, `/detokenize` (behind `--api-key`
//! when given), `/health` and `/metrics` (always open, as in vLLM). Requests are read and
//! checked by [`crate::server`]'s types; chat output is split into reasoning, content and tool
//! calls by its parser.
//! `/` and `/assets/*`: the chat page ([`web`]), open too (it asks for the key itself).

pub mod anthropic;
mod generate;
pub mod metrics;
pub mod openai;
pub mod responses;
pub mod web;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Request as HttpRequest, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use xxhash_rust::xxh3::Xxh3;

use crate::runtime::Runtime;
use crate::sampling::SamplingParams;
use crate::session::ModelIdentity;
use crate::tokenizer::Tokenizer;

/// Part of every `system_fingerprint`: bump it when a change alters the bits any request's
/// logits or sampled ids come out with (kernels, sampling, numerics), so that clients caching
/// on the fingerprint see the change.
pub const NUMERICS_VERSION: u32 = 1;

/// What the server is configured with.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// The id clients name the model by (the model directory's name, or the first
    /// `--served-model-name`).
    pub model_id: String,
    /// Other names requests may give for the model (the further `--served-model-name`s).
    pub aliases: Vec<String>,
    /// Checked against `Authorization: Bearer KEY` or `x-api-key: KEY`; `None`: open.
    pub api_key: Option<String>,
    /// Prompt plus completion tokens of one sequence at most.
    pub max_model_len: usize,
    /// Sampling settings for what a request leaves out (the checkpoint's defaults).
    pub defaults: SamplingParams,
    /// Largest `n` (choices per request).
    pub max_n: usize,
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// [`fingerprint`] of the model served.
    pub fingerprint: String,
    /// How often an SSE stream with nothing to send sends a keep-alive comment.
    pub keep_alive: Duration,
}

impl ServeConfig {
    /// Whether requests naming `model` are served.
    pub fn serves(&self, model: &str) -> bool {
        model == self.model_id || self.aliases.iter().any(|a| a == model)
    }
}

/// What every handler sees.
pub struct AppState {
    pub runtime: Runtime,
    pub tokenizer: Arc<Tokenizer>,
    pub config: ServeConfig,
    pub metrics: metrics::Metrics,
    /// Set once a shutdown began: new generations are refused (503), `/health` answers 503.
    pub draining: AtomicBool,
    /// The token table of constrained decoding, built on first use ([`AppState::vocabulary`];
    /// the server builds it at start).
    vocabulary: std::sync::OnceLock<Result<Arc<crate::grammar::Vocabulary>, crate::grammar::GrammarError>>,
    next_id: AtomicU64,
    /// Mixed into ids and random seeds so they differ across server runs.
    started_nanos: u64,
}

impl AppState {
    /// State for a started runtime.
    pub fn new(runtime: Runtime, tokenizer: Arc<Tokenizer>, config: ServeConfig) -> Self {
        let started_nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        Self {
            runtime,
            tokenizer,
            config,
            metrics: metrics::Metrics::default(),
            draining: AtomicBool::new(false),
            vocabulary: std::sync::OnceLock::new(),
            next_id: AtomicU64::new(1),
            started_nanos,
        }
    }

    /// The tokenizer's token table for constrained decoding (built once, then shared).
    ///
    /// # Errors
    /// Why the tokenizer has none ([`crate::grammar::GrammarError::Vocabulary`]).
    pub fn vocabulary(&self) -> Result<&Arc<crate::grammar::Vocabulary>, &crate::grammar::GrammarError> {
        self.vocabulary.get_or_init(|| crate::grammar::Vocabulary::of(&self.tokenizer).map(Arc::new)).as_ref()
    }

    /// A fresh number, unique in this server run, and a 64-bit value derived from it that
    /// differs across runs (for ids and seeds).
    fn fresh(&self) -> (u64, u64) {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut h = Xxh3::new();
        h.update(&self.started_nanos.to_le_bytes());
        h.update(&n.to_le_bytes());
        (n, h.digest())
    }
}

/// An OpenAI error response: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `server_error`.
    pub kind: &'static str,
    /// The request field at fault, as a JSON path (`messages[0].role`).
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (503s).
    pub retry_after: Option<u64>,
    /// Answer in Anthropic's error shape (`/v1/messages`).
    pub anthropic: bool,
}

impl From<crate::server::error::RequestError> for ApiError {
    fn from(e: crate::server::error::RequestError) -> Self {
        let field = e.field().map(str::to_string);
        ApiError { param: field, code: Some(e.code()), ..ApiError::invalid(e.to_string(), None) }
    }
}

impl ApiError {
    /// A 400 naming `param`.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
            retry_after: None,
            anthropic: false,
        }
    }

    /// The same error with an OpenAI `code`.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// A 500: the server failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self { status: StatusCode::INTERNAL_SERVER_ERROR, message: message.into(), kind: "server_error", param: None, code: None, retry_after: None, anthropic: false }
    }

    /// A 503 with a `Retry-After`.
    pub fn unavailable(message: impl Into<String>, code: &'static str) -> Self {
        Self { status: StatusCode::SERVICE_UNAVAILABLE, message: message.into(), kind: "server_error", param: None, code: Some(code), retry_after: Some(1), anthropic: false }
    }

    /// The same error in Anthropic's shape.
    pub fn anthropic(mut self) -> Self {
        self.anthropic = true;
        self
    }

    /// The JSON body: OpenAI's `{"error": {...}}`, or Anthropic's `{"type": "error", ...}`.
    pub fn body(&self) -> serde_json::Value {
        if self.anthropic {
            return serde_json::json!({"type": "error", "error": {"type": anthropic::anthropic_kind(self), "message": self.message}});
        }
        serde_json::json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

/// `system_fingerprint`: `fp_` and 16 hex digits of xxh3-64 over the weights' identity
/// ([`ModelIdentity::of_dir`]: config.json and every shard), the tokenizer and chat template
/// files, [`NUMERICS_VERSION`], and the arithmetic of the products the server runs (`products`:
/// the integer-exact form gives other bits): equal fingerprints mean the same ids for the same
/// request.
///
/// # Errors
/// A file that exists but cannot be read, or a checkpoint that cannot be hashed.
pub fn fingerprint(dir: &Path, products: crate::backend::Products) -> Result<String, String> {
    let id = ModelIdentity::of_dir(dir).map_err(|e| e.to_string())?;
    let mut h = Xxh3::new();
    h.update(b"tensorfold system fingerprint\0");
    h.update(&id.0.to_le_bytes());
    for name in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json", "generation_config.json"] {
        let p = dir.join(name);
        // Lengths before contents (a missing file hashes as u64::MAX), so boundaries cannot shift.
        match std::fs::read(&p) {
            Ok(bytes) => {
                h.update(&(bytes.len() as u64).to_le_bytes());
                h.update(&bytes);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => h.update(&u64::MAX.to_le_bytes()),
            Err(e) => return Err(format!("{}: {e}", p.display())),
        }
    }
    h.update(&NUMERICS_VERSION.to_le_bytes());
    // The integer-exact products give other bits (numerics §2.2).
    if products == crate::backend::Products::Int {
        h.update(b"integer products");
    }
    Ok(format!("fp_{:016x}", h.digest()))
}

/// The server's routes over `state`, with the body limit and (when configured) the key check.
pub fn router(state: Arc<AppState>) -> Router {
    let guarded = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/models", get(openai::models))
        .route("/tokenize", post(openai::tokenize))
        .route("/detokenize", post(openai::detokenize))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .merge(guarded)
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .merge(web::routes())
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(state.config.max_body_bytes))
        .with_state(state)
}

/// Refuses a request without the configured key (401 with an error object).
async fn auth(State(st): State<Arc<AppState>>, req: HttpRequest, next: Next) -> Response {
    if let Some(key) = &st.config.api_key {
        if !key_matches(req.headers(), key) {
            st.metrics.errors.fetch_add(1, Ordering::Relaxed);
            let given = req.headers().contains_key(header::AUTHORIZATION) || req.headers().contains_key("x-api-key");
            let message = if given { "the API key is not valid" } else { "an API key is required: send `Authorization: Bearer KEY` or `x-api-key: KEY`" };
            tracing::info!(target: "tensorfold::serve", path = %req.uri().path(), status = 401, "refused: {message}");
            return ApiError {
                status: StatusCode::UNAUTHORIZED,
                message: message.into(),
                kind: "authentication_error",
                param: None,
                code: Some("invalid_api_key"),
                retry_after: None,
                anthropic: req.uri().path().starts_with("/v1/messages"),
            }
            .into_response();
        }
    }
    next.run(req).await
}

/// Whether `Authorization: Bearer KEY` or `x-api-key: KEY` carries `key` (compared in time
/// independent of where they differ).
fn key_matches(h: &HeaderMap, key: &str) -> bool {
    let eq = |given: &[u8]| given.len() == key.len() && given.iter().zip(key.as_bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
    let bearer = h.get_all(header::AUTHORIZATION).iter().any(|v| {
        let v = v.as_bytes();
        v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer ") && eq(v[7..].trim_ascii())
    });
    bearer || h.get_all("x-api-key").iter().any(|v| eq(v.as_bytes().trim_ascii()))
}

/// `GET /health`: 200 while serving (the model is loaded before the port opens), 503 while
/// draining.
async fn health(State(st): State<Arc<AppState>>) -> Response {
    if st.draining.load(Ordering::Relaxed) {
        (StatusCode::SERVICE_UNAVAILABLE, axum::Json(serde_json::json!({"status": "draining"}))).into_response()
    } else {
        axum::Json(serde_json::json!({"status": "ok"})).into_response()
    }
}

/// `GET /metrics`: Prometheus text.
async fn metrics_text(State(st): State<Arc<AppState>>) -> Response {
    let body = st.metrics.render(&st.runtime.stats(), &st.config.model_id);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], body).into_response()
}

async fn not_found(req: HttpRequest) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("no route for {} {}", req.method(), req.uri().path()),
        kind: "invalid_request_error",
        param: None,
        code: Some("not_found"),
        retry_after: None,
        anthropic: false,
    }
}

/// Serves `state` on `listener` until Ctrl-C or SIGTERM; then stops accepting, lets running
/// requests finish for up to `drain`, and returns.
///
/// # Errors
/// The listener failing.
pub async fn run(listener: tokio::net::TcpListener, state: Arc<AppState>, drain: Duration) -> std::io::Result<()> {
    let (tx, mut rx) = tokio::sync::watch::channel(false);
    let st = state.clone();
    let signal = async move {
        shutdown_signal().await;
        st.draining.store(true, Ordering::Relaxed);
        let s = st.runtime.stats();
        tracing::info!(target: "tensorfold::serve", running = s.running, waiting = s.waiting, "shutting down: draining running requests for up to {} s", drain.as_secs_f64());
        let _ = tx.send(true);
    };
    // TCP_NODELAY: a stream's events are small writes, and with Nagle's algorithm each one after
    // the first waits for the client's ACK of the last, which a client on a kept-alive
    // connection delays (40 ms on Linux): every token would come late.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!(target: "tensorfold::serve", "could not set TCP_NODELAY on a connection: {e}");
        }
    });
    let server = axum::serve(listener, router(state.clone())).with_graceful_shutdown(signal);
    let deadline = async move {
        while !*rx.borrow() {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        tokio::time::sleep(drain).await;
    };
    tokio::select! {
        r = server => r,
        () = deadline => {
            let s = state.runtime.stats();
            tracing::warn!(target: "tensorfold::serve", running = s.running, waiting = s.waiting, "drain deadline passed; exiting with requests still running");
            Ok(())
        }
    }
}

/// Ctrl-C, or SIGTERM on Unix.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

/// Seconds since the Unix epoch (OpenAI's `created`).
fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_read_from_bearer_or_x_api_key_only_when_equal() {
        let mut h = HeaderMap::new();
        assert!(!key_matches(&h, "k1"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k2"));
        assert!(!key_matches(&h, "k1"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("bearer  k1 "));
        assert!(key_matches(&h, "k1"));
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("k1"));
        assert!(key_matches(&h, "k1"));
        assert!(!key_matches(&h, "k10"));
    }

    #[test]
    fn the_fingerprint_differs_between_products_modes() {
        use crate::backend::Products;
        let dir = crate::testutil::shared("fixtures/tiny/mlx-q4");
        let f32 = fingerprint(&dir, Products::F32).unwrap();
        assert_eq!(f32, fingerprint(&dir, Products::F32).unwrap());
        assert_ne!(f32, fingerprint(&dir, Products::Int).unwrap());
    }

    #[test]
    fn errors_carry_openai_shape_and_retry_after() {
        let e = ApiError::invalid("bad", Some("messages[0].role")).with_code("x");
        assert_eq!(e.body(), serde_json::json!({"error": {"message": "bad", "type": "invalid_request_error", "param": "messages[0].role", "code": "x"}}));
        let r = ApiError::unavailable("full", "queue_full").into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers().get(header::RETRY_AFTER).unwrap(), "1");
    }
}
