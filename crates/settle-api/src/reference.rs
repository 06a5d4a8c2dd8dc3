//! The API reference at `/docs`: Redoc (vendored, embedded in the binary: no CDN) rendering the
//! same `/openapi.json` the server serves.

use axum::Router;
use axum::http::header;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;

const REDOC_JS: &[u8] = include_bytes!("../assets/redoc/redoc.standalone.js");

const PAGE: &str = r#"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Settle API reference</title>
<style>body { margin: 0; } .back { font: 14px system-ui, sans-serif; padding: 8px 16px; background: #f4f4f2; } .back a { color: #1d4ed8; }</style>
</head>
<body>
<div class="back"><a href="/console">← Settle console</a> · <a href="/openapi.json">openapi.json</a></div>
<div id="reference"></div>
<script src="/docs/redoc.standalone.js"></script>
<script src="/docs/init.js"></script>
</body>
</html>
"#;

const INIT_JS: &str = r#"Redoc.init("/openapi.json", { hideDownloadButton: false, expandResponses: "200,201" }, document.getElementById("reference"));
"#;

/// The page and its two scripts. Scripts are files (not inline), so the page runs under a policy
/// that allows only this server's scripts; Redoc's search runs in a worker made from a blob.
const POLICY: &str = "default-src 'self'; script-src 'self'; worker-src 'self' blob:; style-src 'self' 'unsafe-inline'; \
     img-src 'self' data:; font-src 'self' data:; connect-src 'self'; frame-ancestors 'none'";

pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/docs", get(page))
        .route("/docs/redoc.standalone.js", get(|| async { script(REDOC_JS) }))
        .route("/docs/init.js", get(|| async { script(INIT_JS.as_bytes()) }))
}

async fn page() -> Response {
    ([(header::CONTENT_SECURITY_POLICY, POLICY)], Html(PAGE)).into_response()
}

fn script(body: &'static [u8]) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "public, max-age=3600"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response()
}
