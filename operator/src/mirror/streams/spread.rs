//! The connections to the peer a session spreads its Txns over. An etcd's gRPC server opens each
//! connection's flow-control window at 64 KiB and widens it about once a round trip, so across
//! distance a burst of Txns over one fresh connection trickles out for the first second or so.
//! The session's own connection comes first; more are opened when the Txns in flight outgrow
//! them (`plan::watch_connections`: never next door), and kept while Txns flow, so that the
//! next burst finds them open and their windows wide. Unused for `IDLE_CLOSE`, they close: an
//! idle region holds one connection to each peer.
use crate::mirror::EtcdTarget;
use etcd_client::Client;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tracing::debug;

/// How long the connections beyond the session's stay open unused. Below the 5 minutes after
/// which etcd expires a simple auth token nobody used: a connection kept for the next burst
/// never meets its token expired.
pub const IDLE_CLOSE: Duration = Duration::from_secs(60);

pub(in crate::mirror) struct Spread {
    clients: Vec<Client>,
    next: usize,
    last_used: Instant,
    /// More connections being opened beside the session's work.
    opening: Option<JoinHandle<Vec<Client>>>,
    /// Opening more failed lately: not again before this (a peer refusing connections, or one
    /// that rejects the password, is not asked again at every batch).
    retry_after: Option<Instant>,
    failures: u32,
}

/// How long the spread waits before opening more connections after an attempt that opened
/// none: doubling from a second, at most a minute.
pub fn retry_wait(failures: u32) -> Duration {
    Duration::from_secs(1u64 << failures.saturating_sub(1).min(6)).min(Duration::from_secs(60))
}

impl Spread {
    pub fn new(session: Client) -> Self {
        Spread {
            clients: vec![session],
            next: 0,
            last_used: Instant::now(),
            opening: None,
            retry_after: None,
            failures: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.clients.len()
    }

    /// The connection for the next Txn, in turn.
    pub fn next(&mut self) -> &Client {
        self.last_used = Instant::now();
        self.next = (self.next + 1) % self.clients.len();
        &self.clients[self.next]
    }

    fn add(&mut self, more: Vec<Client>) {
        self.last_used = Instant::now();
        self.clients.extend(more);
    }

    /// Closes the connections beyond the session's once none was used for `IDLE_CLOSE`. Returns
    /// whether it closed any.
    pub fn close_idle(&mut self) -> bool {
        if self.clients.len() == 1 || self.opening.is_some() || self.last_used.elapsed() < IDLE_CLOSE {
            return false;
        }
        self.clients.truncate(1);
        self.next = 0;
        true
    }

    /// Txns in flight the open connections are given while more are being opened: a fresh
    /// connection's window trickles a burst out (see the module's note), so the burst waits for
    /// the others, all but the first Txns, which leave at once. Any number once none are opening.
    pub fn carries(&self) -> usize {
        match self.opening {
            Some(_) => self.clients.len() * crate::mirror::plan::TXNS_PER_CONNECTION,
            None => usize::MAX,
        }
    }

    pub fn opening(&self) -> bool {
        self.opening.is_some()
    }

    /// Starts opening connections up to `wanted` in the background, unless that many are open or
    /// some are being opened already.
    pub fn want(&mut self, wanted: usize, target: &EtcdTarget, timeout: Duration) {
        let waiting = self.retry_after.is_some_and(|at| Instant::now() < at);
        if self.opening.is_none() && wanted > self.clients.len() && !waiting {
            self.opening = Some(tokio::spawn(open(target.clone(), wanted - self.clients.len(), timeout)));
        }
    }

    /// Waits for the connections being opened, if any, and takes them. Cancel-safe: dropped
    /// before they are open, it leaves them opening.
    pub async fn opened(&mut self) {
        let Some(task) = self.opening.as_mut() else { return };
        let more = task.await.unwrap_or_default();
        self.opening = None;
        if more.is_empty() {
            self.failures = self.failures.saturating_add(1);
            self.retry_after = Some(Instant::now() + retry_wait(self.failures));
        } else {
            (self.failures, self.retry_after) = (0, None);
        }
        self.add(more);
    }
}

impl Drop for Spread {
    fn drop(&mut self) {
        if let Some(task) = self.opening.take() {
            task.abort();
        }
    }
}

/// `n` more clients of the peer, each over its own connections; none when they cannot be opened
/// within `timeout`: the Txns then go over those already open, only slower.
async fn open(target: EtcdTarget, n: usize, timeout: Duration) -> Vec<Client> {
    if n == 0 {
        return Vec::new();
    }
    match tokio::time::timeout(timeout, target.connect_many(n)).await {
        Ok(Ok(clients)) => clients,
        Ok(Err(e)) => {
            debug!(error = %e, "no more connections to the peer: Txns go over those open");
            Vec::new()
        }
        Err(_) => {
            debug!("no more connections to the peer: opening them took too long");
            Vec::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn after_a_failed_opening_more_are_asked_for_later_and_later() {
        assert_eq!(retry_wait(1), Duration::from_secs(1));
        assert_eq!(retry_wait(2), Duration::from_secs(2));
        assert_eq!(retry_wait(6), Duration::from_secs(32));
        assert_eq!(retry_wait(40), Duration::from_secs(60));
    }
}
