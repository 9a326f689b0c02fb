//! Load a scenario runs beside a change on kind: a writer putting endpoint keys into a region at a
//! steady rate, and a reader of a peer's copy that reports the first key it finds missing.
use crate::substrate::{KindFederation, Substrate, subtree_through};
use etcd_client::{Txn, TxnOp};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a writer did.
#[derive(Clone, Debug)]
pub struct Tally {
    pub puts: u64,
    /// Transactions that failed, and the last error.
    pub failed: u64,
    pub last_error: String,
    /// The slowest transaction.
    pub slowest: Duration,
    pub started: Instant,
    /// How long it ran, once stopped.
    pub ran: Option<Duration>,
}

impl Tally {
    /// Puts a second while it ran (until now, while it runs).
    pub fn rate(&self) -> f64 {
        self.puts as f64 / self.ran.unwrap_or_else(|| self.started.elapsed()).as_secs_f64().max(1e-3)
    }
}

/// Puts `rate` keys a second into `region`'s subtree under `cluster`, `batch` puts to a
/// transaction, over a pool of `pool` keys (created, then updated), until stopped.
pub struct Writer {
    tally: Arc<Mutex<Tally>>,
    task: tokio::task::JoinHandle<()>,
}

impl Writer {
    pub fn start(kind: KindFederation, region: &str, cluster: &str, rate: u32, batch: u32, pool: u32) -> Writer {
        let tally = Arc::new(Mutex::new(Tally {
            puts: 0,
            failed: 0,
            last_error: String::new(),
            slowest: Duration::ZERO,
            started: Instant::now(),
            ran: None,
        }));
        let prefix = format!(
            "{}clusters/{cluster}/services/echo/protocols/http/endpoints/",
            aether_operator::keys::region_prefix(region)
        );
        let (region, cluster, counting) = (region.to_string(), cluster.to_string(), tally.clone());
        let batch = batch.max(1);
        let task = tokio::spawn(async move {
            let mut client = None;
            let mut tick = tokio::time::interval(Duration::from_secs(1) * batch / rate.max(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut seq = 0u64;
            loop {
                tick.tick().await;
                if client.is_none() {
                    client = kind.registry(&region).await.ok();
                }
                let Some(c) = client.as_mut() else { continue };
                let puts: Vec<TxnOp> = (seq..seq + u64::from(batch))
                    .map(|j| {
                        let n = j % u64::from(pool.max(1));
                        let key = format!("{prefix}10.7.{}.{}", n / 250, n % 250 + 1);
                        TxnOp::put(key, format!(r#"{{"clusterName":"{cluster}","port":8080,"seq":{j}}}"#), None)
                    })
                    .collect();
                seq += u64::from(batch);
                let asked = Instant::now();
                let result = c.txn(Txn::new().and_then(puts)).await;
                let mut t = counting.lock().unwrap();
                t.slowest = t.slowest.max(asked.elapsed());
                match result {
                    Ok(_) => t.puts += u64::from(batch),
                    Err(e) => {
                        t.failed += 1;
                        t.last_error = e.to_string();
                        client = None;
                    }
                }
            }
        });
        Writer { tally, task }
    }

    pub fn tally(&self) -> Tally {
        self.tally.lock().unwrap().clone()
    }

    /// Stops the writer; what it did.
    pub fn stop(self) -> Tally {
        self.task.abort();
        let mut tally = self.tally();
        tally.ran = Some(tally.started.elapsed());
        tally
    }
}

/// Reads `peer`'s copy of `origin` about three times a second until a key of `before` is missing,
/// and says which (at most five named). A read that fails reconnects; it is no verdict.
pub async fn first_key_missing(
    kind: KindFederation,
    origin: String,
    peer: String,
    before: BTreeMap<Vec<u8>, Vec<u8>>,
) -> String {
    let mut client = None;
    let start = Instant::now();
    loop {
        if client.is_none() {
            client = kind.registry(&peer).await.ok();
        }
        let read = match client.as_mut() {
            Some(c) => subtree_through(c, &origin).await,
            None => Err(anyhow::anyhow!("{peer}'s etcd not reachable")),
        };
        if read.is_err() {
            client = None;
        }
        if let Ok(now) = read {
            let missing: Vec<_> = before
                .keys()
                .filter(|k| !now.contains_key(*k))
                .take(5)
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .collect();
            if !missing.is_empty() {
                return format!(
                    "{:.1} s in, keys of {origin} missing on {peer}: {missing:?}",
                    start.elapsed().as_secs_f64()
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}
