//! /metrics (Prometheus text), /healthz and /readyz.
use crate::metrics::Metrics;
use axum::Router;
use axum::http::header;
use axum::routing::get;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

pub async fn serve(
    addr: &str,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move {
                    (
                        [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
                        metrics.encode(),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| anyhow::anyhow!("binding {addr}: {e}"))?;
    Ok(tokio::spawn(async move {
        let _ = axum::serve(listener, app).with_graceful_shutdown(async move { shutdown.cancelled().await }).await;
    }))
}
