//! The chat page at `/` (its files in `src/serve/web/`, built into the binary): plain
//! HTML, CSS and JavaScript modules that speak the server's own OpenAI API, so it works offline
//! and needs no build step. Served without the API key: the page asks for the key and sends it
//! as `Authorization: Bearer` on the API calls it makes.
//!
//! Every file is sent with `Cache-Control: no-cache` and an `ETag` (xxh3-64 of its bytes): a
//! browser revalidates each load (a `304` when unchanged), so a new binary's page is never
//! mixed with an old one's cached scripts. The page gets a Content-Security-Policy that allows
//! only this origin's scripts and styles (a second line of defence behind the Markdown
//! renderer, which never turns model output into markup).

use std::sync::LazyLock;

use axum::extract::Path;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use xxhash_rust::xxh3::xxh3_64;

/// One built-in file: the name it is served under `/assets/` by, its type, its bytes.
struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: &'static [u8],
}

const INDEX: Asset = Asset { name: "index.html", content_type: "text/html; charset=utf-8", body: include_bytes!("web/index.html") };

const ASSETS: &[Asset] = &[
    Asset { name: "app.js", content_type: "text/javascript; charset=utf-8", body: include_bytes!("web/app.js") },
    Asset { name: "markdown.js", content_type: "text/javascript; charset=utf-8", body: include_bytes!("web/markdown.js") },
    Asset { name: "stream.js", content_type: "text/javascript; charset=utf-8", body: include_bytes!("web/stream.js") },
    Asset { name: "style.css", content_type: "text/css; charset=utf-8", body: include_bytes!("web/style.css") },
    Asset { name: "icon.svg", content_type: "image/svg+xml", body: include_bytes!("web/icon.svg") },
];

/// The page's policy: its own scripts, styles, icon and API calls; no frames, no plugins.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// ETags of `INDEX` then `ASSETS`, in order, computed once.
static ETAGS: LazyLock<Vec<HeaderValue>> = LazyLock::new(|| {
    std::iter::once(&INDEX).chain(ASSETS).map(|a| HeaderValue::from_str(&format!("\"{:016x}\"", xxh3_64(a.body))).expect("hex digits are a valid header value")).collect()
});

/// `GET /` and `GET /assets/{name}` (HEAD too), for any router state.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new().route("/", get(index)).route("/assets/{name}", get(asset))
}

async fn index(headers: HeaderMap) -> Response {
    let mut r = send(&INDEX, &ETAGS[0], &headers);
    let h = r.headers_mut();
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    r
}

async fn asset(Path(name): Path<String>, headers: HeaderMap) -> Response {
    match ASSETS.iter().position(|a| a.name == name) {
        Some(i) => send(&ASSETS[i], &ETAGS[i + 1], &headers),
        None => (StatusCode::NOT_FOUND, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], format!("no asset named {name}\n")).into_response(),
    }
}

/// The file, or `304 Not Modified` when `If-None-Match` names its ETag.
fn send(a: &Asset, etag: &HeaderValue, req: &HeaderMap) -> Response {
    let fresh = req.get_all(header::IF_NONE_MATCH).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(',')).any(|t| {
        let t = t.trim();
        t == "*" || t.trim_start_matches("W/").as_bytes() == etag.as_bytes()
    });
    let common =
        [(header::ETAG, etag.clone()), (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")), (header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"))];
    if fresh {
        return (StatusCode::NOT_MODIFIED, common).into_response();
    }
    (common, [(header::CONTENT_TYPE, HeaderValue::from_static(a.content_type))], a.body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::{to_bytes, Body};
    use axum::http::Request;
    use tower::ServiceExt;

    async fn get(path: &str, if_none_match: Option<&str>) -> Response {
        let mut req = Request::get(path);
        if let Some(t) = if_none_match {
            req = req.header(header::IF_NONE_MATCH, t);
        }
        routes::<()>().oneshot(req.body(Body::empty()).unwrap()).await.unwrap()
    }

    #[tokio::test]
    async fn the_page_and_its_assets_come_with_their_types_and_etags() {
        let r = get("/", None).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "text/html; charset=utf-8");
        assert_eq!(r.headers()[header::CACHE_CONTROL], "no-cache");
        assert!(r.headers()[header::CONTENT_SECURITY_POLICY].to_str().unwrap().contains("script-src 'self'"));
        let body = to_bytes(r.into_body(), 1 << 20).await.unwrap();
        assert!(body.starts_with(b"<!doctype html>"));
        // Every asset the page names is served, with the type its extension says.
        for (name, ty) in
            [("app.js", "text/javascript"), ("markdown.js", "text/javascript"), ("stream.js", "text/javascript"), ("style.css", "text/css"), ("icon.svg", "image/svg+xml")]
        {
            let r = get(&format!("/assets/{name}"), None).await;
            assert_eq!(r.status(), StatusCode::OK, "{name}");
            assert!(r.headers()[header::CONTENT_TYPE].to_str().unwrap().starts_with(ty), "{name}");
            assert_eq!(r.headers()[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
            let etag = r.headers()[header::ETAG].to_str().unwrap().to_string();
            let body = to_bytes(r.into_body(), 1 << 20).await.unwrap();
            assert_eq!(etag, format!("\"{:016x}\"", xxh3_64(&body)), "{name}");
        }
        assert_eq!(get("/assets/nope.js", None).await.status(), StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn a_matching_if_none_match_is_a_304_without_a_body() {
        let etag = get("/assets/app.js", None).await.headers()[header::ETAG].to_str().unwrap().to_string();
        let r = get("/assets/app.js", Some(&format!("\"0000000000000000\", W/{etag}"))).await;
        assert_eq!(r.status(), StatusCode::NOT_MODIFIED);
        assert!(to_bytes(r.into_body(), 1 << 20).await.unwrap().is_empty());
        assert_eq!(get("/assets/app.js", Some("\"0000000000000000\"")).await.status(), StatusCode::OK);
    }

    #[test]
    fn every_asset_the_page_loads_is_built_in() {
        let page = std::str::from_utf8(INDEX.body).unwrap();
        let app = std::str::from_utf8(ASSETS[0].body).unwrap();
        for src in page.split("/assets/").skip(1).chain(app.split("from './").skip(1)) {
            let name = &src[..src.find(['"', '\'']).unwrap()];
            assert!(ASSETS.iter().any(|a| a.name == name), "{name} is referenced but not served");
        }
    }
}
