//! Serving the metrics port's connections with every cost bounded, plain or over TLS: anyone who
//! can reach the port can open connections, so
//!
//! - at most [`MAX_CONNECTIONS`] are served at once, TLS handshakes included, and at most
//!   [`MAX_CONNECTIONS_PER_PEER`] from one address, so one client cannot take the slots the
//!   kubelet's probes and the scraper need; one more is closed at once;
//! - a TLS handshake has [`HANDSHAKE_TIMEOUT`] to finish;
//! - a request's head must arrive within [`HEADER_TIMEOUT`] of the connection waiting for it (an
//!   idle keep-alive connection is closed after as long) and fit in [`MAX_HEAD_BYTES`] (a larger
//!   one is refused with 431);
//! - a connection lives [`MAX_CONNECTION_LIFETIME`] at most.
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::debug;

pub const MAX_CONNECTIONS: usize = 512;
pub const MAX_CONNECTIONS_PER_PEER: usize = 32;
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(20);
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
pub const MAX_CONNECTION_LIFETIME: Duration = Duration::from_secs(600);

/// The connections open, by the address they come from.
#[derive(Default)]
struct Slots {
    by_peer: Mutex<HashMap<IpAddr, usize>>,
}

/// One connection's slot, given back when it ends.
struct Slot {
    slots: Arc<Slots>,
    peer: IpAddr,
}

impl Slots {
    /// A slot for a connection from `peer`, unless the bounds are reached.
    fn take(self: &Arc<Self>, peer: IpAddr) -> Option<Slot> {
        let mut by_peer = self.by_peer.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let total: usize = by_peer.values().sum();
        let mine = by_peer.entry(peer).or_default();
        if total >= MAX_CONNECTIONS || *mine >= MAX_CONNECTIONS_PER_PEER {
            if *mine == 0 {
                by_peer.remove(&peer);
            }
            return None;
        }
        *mine += 1;
        Some(Slot { slots: self.clone(), peer })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut by_peer = self.slots.by_peer.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = by_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                by_peer.remove(&self.peer);
            }
        }
    }
}

/// Accepts and serves connections until `shutdown`.
pub async fn serve(listener: TcpListener, tls: Option<TlsAcceptor>, app: Router, shutdown: CancellationToken) {
    let slots = Arc::new(Slots::default());
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                debug!(error = %e, "accepting a metrics connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(slot) = slots.take(peer.ip()) else {
            debug!(%peer, "metrics connections at their bound; closing the new one");
            continue;
        };
        let (tls, app, shutdown) = (tls.clone(), app.clone(), shutdown.clone());
        tokio::spawn(async move {
            let _slot = slot;
            match tls {
                None => serve_one(stream, app, shutdown).await,
                Some(acceptor) => match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(tls)) => serve_one(tls, app, shutdown).await,
                    Ok(Err(e)) => debug!(%peer, error = %e, "metrics TLS handshake failed"),
                    Err(_) => debug!(%peer, "metrics TLS handshake timed out"),
                },
            }
        });
    }
}

/// Serves one connection's requests, bounded in head size, head time and lifetime.
async fn serve_one<I>(io: I, app: Router, shutdown: CancellationToken)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(HEADER_TIMEOUT).max_buf_size(MAX_HEAD_BYTES).keep_alive(true);
    let connection = http.serve_connection(TokioIo::new(io), TowerToHyperService::new(app));
    tokio::pin!(connection);
    let lifetime = tokio::time::sleep(MAX_CONNECTION_LIFETIME);
    tokio::pin!(lifetime);
    tokio::select! {
        _ = &mut connection => return,
        _ = shutdown.cancelled() => {}
        _ = &mut lifetime => {}
    }
    connection.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(Duration::from_secs(5), connection).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_address_cannot_take_every_slot_and_slots_come_back() {
        let slots = Arc::new(Slots::default());
        let attacker: IpAddr = "10.0.0.66".parse().unwrap();
        let held: Vec<Slot> = std::iter::from_fn(|| slots.take(attacker)).take(1000).collect();
        assert_eq!(held.len(), MAX_CONNECTIONS_PER_PEER);
        let kubelet: IpAddr = "10.0.0.1".parse().unwrap();
        assert!(slots.take(kubelet).is_some(), "another address still gets a slot");
        drop(held);
        assert!(slots.by_peer.lock().unwrap().is_empty(), "every slot came back");
        // The total bound holds over many addresses.
        let many: Vec<Slot> = (0..=255u8)
            .flat_map(|a| (0..4u8).map(move |b| IpAddr::from([10, 1, a, b])))
            .filter_map(|ip| slots.take(ip))
            .collect();
        assert_eq!(many.len(), MAX_CONNECTIONS);
    }
}
