//! The admin console: the static files of `web/` (plain ES modules and CSS, no build step),
//! copied into the binary at compile time and served under `/console/`. The files hold no
//! secret and are served to anyone; every call they make to `/api` carries the admin token the
//! operator typed at the login page, and the API checks it.

use axum::extract::Path;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;

/// Every file of the console: path under `/console/`, content type, contents.
const FILES: &[(&str, &str, &str)] = &[
    ("index.html", "text/html; charset=utf-8", include_str!("../../../web/index.html")),
    ("console.css", "text/css; charset=utf-8", include_str!("../../../web/console.css")),
    ("api.js", JS, include_str!("../../../web/api.js")),
    ("app.js", JS, include_str!("../../../web/app.js")),
    ("dom.js", JS, include_str!("../../../web/dom.js")),
    ("chart.js", JS, include_str!("../../../web/chart.js")),
    ("history.js", JS, include_str!("../../../web/history.js")),
    ("report.js", JS, include_str!("../../../web/report.js")),
    ("pages/fleet.js", JS, include_str!("../../../web/pages/fleet.js")),
    ("pages/slo.js", JS, include_str!("../../../web/pages/slo.js")),
    ("pages/cache.js", JS, include_str!("../../../web/pages/cache.js")),
    ("pages/scaling.js", JS, include_str!("../../../web/pages/scaling.js")),
    ("pages/policies.js", JS, include_str!("../../../web/pages/policies.js")),
    ("pages/whatif.js", JS, include_str!("../../../web/pages/whatif.js")),
    ("pages/runs.js", JS, include_str!("../../../web/pages/runs.js")),
];

const JS: &str = "text/javascript; charset=utf-8";

pub fn routes<S: Clone + Send + Sync + 'static>() -> axum::Router<S> {
    axum::Router::new()
        .route("/", get(|| async { Redirect::to("/console/") }))
        .route("/console", get(|| async { Redirect::to("/console/") }))
        .route("/console/", get(|| async { file("index.html") }))
        .route("/console/{*path}", get(|Path(path): Path<String>| async move { file(&path) }))
}

fn file(path: &str) -> Response {
    match FILES.iter().find(|(p, _, _)| *p == path) {
        Some((_, content_type, body)) => (
            [
                (header::CONTENT_TYPE, *content_type),
                // The files change with the binary: a browser revalidates rather than run a
                // console older than the API it talks to.
                (header::CACHE_CONTROL, "no-cache"),
                (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            ],
            *body,
        )
            .into_response(),
        None => (StatusCode::NOT_FOUND, format!("no console file `{path}`")).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::FILES;

    #[test]
    fn every_file_in_web_is_served_and_every_served_file_exists() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../web");
        let mut on_disk = Vec::new();
        let mut dirs = vec![root.clone()];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let path = entry.path();
                if path.is_dir() {
                    dirs.push(path);
                } else if let Ok(rel) = path.strip_prefix(&root) {
                    on_disk.push(rel.to_string_lossy().replace('\\', "/"));
                }
            }
        }
        on_disk.sort();
        let mut served: Vec<String> = FILES.iter().map(|(p, _, _)| p.to_string()).collect();
        served.sort();
        assert_eq!(on_disk, served);
    }
}
