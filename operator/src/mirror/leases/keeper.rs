//! The origin-heartbeat: a task that keeps every lease of the mirror alive on the peer at the
//! keepalive interval, feeds the failure detector and the health, and reports leases that are
//! gone. Dropping it stops the keepalives; nothing is ever revoked.
use crate::mirror::shared::Shared;
use crate::mirror::{EtcdTarget, MirrorConfig};
use anyhow::anyhow;
use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper};
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::mpsc;
use tracing::{Instrument, debug};

/// What the keepalive task tells the worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeeperSignal {
    /// The lease is gone, and its keys with it.
    LeaseLost(i64),
    /// The peer answers with another cluster id: restored from a backup or replaced.
    PeerChanged { from: u64, to: u64 },
}

pub fn is_lease_not_found(e: &etcd_client::Error) -> bool {
    e.to_string().contains("lease not found")
}

pub struct Keeper {
    /// The leases kept alive, sorted: a keeper is replaced only when this set changes.
    pub leases: Vec<i64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Keeper {
    /// Starts keeping `leases` alive. A lease found gone is sent on `lost` once, unless it is
    /// one of `retiring` (an earlier layout's lease, expected to empty and lapse).
    pub(in crate::mirror) fn spawn(
        peer: EtcdTarget,
        mut leases: Vec<i64>,
        config: MirrorConfig,
        shared: Arc<Shared>,
        lost: mpsc::Sender<KeeperSignal>,
        retiring: Vec<i64>,
    ) -> Keeper {
        leases.sort_unstable();
        leases.dedup();
        let ids = leases.clone();
        let task = tokio::spawn(
            async move {
                let mut stream: Option<(LeaseKeeper, LeaseKeepAliveStream)> = None;
                let mut client: Option<Client> = None;
                let mut reported_lost: Vec<i64> = Vec::new();
                let mut cluster: Option<u64> = None;
                // A round must end before the next is due, or a slow peer would stretch the
                // keepalive interval past the TTL.
                let round_timeout = config.rpc_timeout.min(config.keepalive_interval).max(Duration::from_millis(500));
                loop {
                    let started = tokio::time::Instant::now();
                    if client.is_none() {
                        client = tokio::time::timeout(round_timeout, peer.connect()).await.ok().and_then(Result::ok);
                    }
                    let results: Vec<Result<(i64, u64), String>> = match client.as_ref() {
                        None => vec![Err("cannot connect to the peer".to_string())],
                        // No lease yet: a round trip all the same, so that health is measured.
                        Some(c) if ids.is_empty() => {
                            let mut c = c.clone();
                            match tokio::time::timeout(round_timeout, c.status()).await {
                                Ok(Ok(s)) => vec![Ok((1, s.header().map_or(0, |h| h.cluster_id())))],
                                Ok(Err(e)) => vec![Err(e.to_string())],
                                Err(_) => vec![Err("status timed out".to_string())],
                            }
                        }
                        Some(c) => match keep_alive_round(&mut c.clone(), &mut stream, &ids, round_timeout).await {
                            Ok(answers) => ids
                                .iter()
                                .map(|id| answers.get(id).copied().ok_or_else(|| format!("lease {id}: no answer")))
                                .collect(),
                            Err(e) => vec![Err(e)],
                        },
                    };
                    let mut min_ttl: Option<i64> = None;
                    let mut failed = false;
                    if let Some(to) = results.iter().find_map(|r| r.as_ref().ok().map(|r| r.1).filter(|c| *c != 0)) {
                        match cluster.replace(to) {
                            Some(from) if from != to => {
                                let _ = lost.try_send(KeeperSignal::PeerChanged { from, to });
                            }
                            _ => {}
                        }
                    }
                    for (i, result) in results.iter().enumerate() {
                        match result {
                            Ok((ttl, _)) if ids.is_empty() || *ttl > 0 => {
                                if !ids.is_empty() {
                                    min_ttl = Some(min_ttl.map_or(*ttl, |m: i64| m.min(*ttl)));
                                }
                            }
                            Ok(_) => {
                                let id = ids[i];
                                // Never wait on the worker (it may be syncing): the other
                                // leases must be renewed this round all the same. Unsent, it is
                                // reported again next round.
                                if !reported_lost.contains(&id)
                                    && !retiring.contains(&id)
                                    && lost.try_send(KeeperSignal::LeaseLost(id)).is_ok()
                                {
                                    reported_lost.push(id);
                                }
                            }
                            Err(e) => {
                                debug!(error = %e, "keepalive failed");
                                failed = true;
                            }
                        }
                    }
                    if failed {
                        // Reconnect next round: the members that answer may have changed.
                        client = None;
                        stream = None;
                        shared.update(|h| h.keepalive_failures += 1);
                        shared.detector_evaluate();
                    } else {
                        let rtt = started.elapsed();
                        shared.update(|h| {
                            h.record_keepalive_rtt(rtt);
                            h.keepalive_failures = 0;
                            h.keepalive_last_success = Some(SystemTime::now());
                            h.lease_ttl_reported = min_ttl;
                        });
                        shared.detector_success();
                    }
                    // Keep the interval from the start of the round, so slow answers do not
                    // stretch it; evaluate reachability at least once a second meanwhile.
                    let next = started + config.keepalive_interval;
                    while tokio::time::Instant::now() < next {
                        tokio::time::sleep_until(next.min(tokio::time::Instant::now() + Duration::from_secs(1))).await;
                        shared.detector_evaluate();
                    }
                }
            }
            .in_current_span(),
        );
        Keeper { leases, task }
    }
}

/// A keepalive request of the stream's own type (etcd-client does not name it): the protocol
/// carries any lease id on one stream, so one stream keeps every lease of the mirror alive.
fn request_for<T: Default>(_: &tokio::sync::mpsc::Sender<T>) -> T {
    T::default()
}

/// One keepalive round for every lease over one multiplexed stream: (ttl, cluster id) per lease
/// id answered (a TTL of 0 or less means the lease is gone). A failed round drops the stream.
async fn keep_alive_round(
    client: &mut Client,
    stream: &mut Option<(LeaseKeeper, LeaseKeepAliveStream)>,
    ids: &[i64],
    timeout: Duration,
) -> Result<HashMap<i64, (i64, u64)>, String> {
    let round = async {
        let mut answers: HashMap<i64, (i64, u64)> = HashMap::new();
        // Opening the stream sends a first keepalive for one lease; a lease found gone there is
        // an error, so the next one opens it.
        if stream.is_none() {
            for id in ids {
                match client.lease_keep_alive(*id).await {
                    Ok(pair) => {
                        *stream = Some(pair);
                        break;
                    }
                    Err(e) if is_lease_not_found(&e) => {
                        answers.insert(*id, (0, 0));
                    }
                    Err(e) => return Err(e.to_string()),
                }
            }
        }
        let Some((keeper, responses)) = stream.as_mut() else { return Ok(answers) };
        let wanted: Vec<i64> = ids.iter().copied().filter(|id| !answers.contains_key(id)).collect();
        let send = async {
            for id in &wanted {
                let mut request = request_for(&keeper.sender);
                request.id = *id;
                keeper.sender.send(request).await.map_err(|e| format!("keepalive stream closed: {e}"))?;
            }
            Ok::<(), String>(())
        };
        // Read while sending: thousands of answers must not wait behind flow control.
        let receive = async {
            let mut answered = 0;
            while answered < wanted.len() {
                match responses.message().await {
                    Ok(Some(resp)) => {
                        if answers.insert(resp.id(), (resp.ttl(), cluster_of(&resp))).is_none() {
                            answered += 1;
                        }
                    }
                    Ok(None) => return Err("keepalive stream closed".to_string()),
                    Err(e) => return Err(e.to_string()),
                }
            }
            Ok(())
        };
        futures::future::try_join(send, receive).await?;
        Ok(answers)
    };
    match tokio::time::timeout(timeout, round).await {
        Ok(Ok(answers)) => Ok(answers),
        Ok(Err(e)) => {
            *stream = None;
            Err(e)
        }
        Err(_) => {
            *stream = None;
            Err(format!("keepalive timed out after {timeout:?}"))
        }
    }
}

fn cluster_of(resp: &etcd_client::LeaseKeepAliveResponse) -> u64 {
    resp.header().map_or(0, |h| h.cluster_id())
}

/// Lease checks in flight at once.
const LEASE_CHECKS_IN_FLIGHT: usize = 64;

/// Whether each lease is alive, checked in parallel (0 is never alive).
pub async fn leases_alive(peer: &Client, ids: &[i64], timeout: Duration) -> anyhow::Result<Vec<bool>> {
    let checks = futures::stream::iter(ids.iter().copied())
        .map(|id| {
            let mut peer = peer.clone();
            async move {
                if id == 0 {
                    return Ok(false);
                }
                match tokio::time::timeout(timeout, peer.lease_time_to_live(id, None)).await {
                    Err(_) => Err(anyhow!("lease time-to-live: timed out after {:?}", timeout)),
                    Ok(Ok(resp)) => Ok(resp.ttl() > 0),
                    Ok(Err(e)) if is_lease_not_found(&e) => Ok(false),
                    Ok(Err(e)) => Err(anyhow!(e).context("lease time-to-live")),
                }
            }
        })
        .buffered(LEASE_CHECKS_IN_FLIGHT);
    checks.collect::<Vec<_>>().await.into_iter().collect()
}
