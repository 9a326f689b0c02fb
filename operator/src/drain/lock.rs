//! One drain per legacy prefix per etcd: a lock key on a lease, kept alive while the drain runs,
//! and a compare on its mod revision in every write the drain makes. A second RegistrySchema, the
//! CLI, or a deposed leader's drain can then never interleave writes with the holder's: their
//! Txns fail the compare and they stop.
use crate::keys;
use anyhow::{Context, anyhow};
use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};
use std::time::Duration;
use tracing::{debug, info};

/// How long a lock outlives a drain that died without releasing it, by default.
pub const LOCK_TTL_SECONDS: i64 = 15;

/// The lock is held by someone else.
#[derive(Debug, thiserror::Error)]
#[error("another drain holds the legacy prefix {prefix}: {holder}")]
pub struct Held {
    pub prefix: String,
    pub holder: String,
}

pub struct DrainLock {
    key: String,
    lease: i64,
    /// The lock key's mod revision: the fencing epoch every drain write compares.
    epoch: i64,
    keeper: tokio::task::JoinHandle<()>,
}

impl Drop for DrainLock {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

impl DrainLock {
    /// Takes the lock of `prefix` for `holder` (a description a person can act on), or says who
    /// holds it.
    pub async fn acquire(client: &Client, prefix: &str, holder: &str, ttl_seconds: i64) -> anyhow::Result<DrainLock> {
        let key = keys::drain_lock_key(prefix);
        let mut c = client.clone();
        let lease = c.lease_grant(ttl_seconds, None).await.context("grant the drain lock's lease")?.id();
        let value = serde_json::json!({"holder": holder, "since": k8s_openapi::jiff::Timestamp::now().to_string()});
        let txn = Txn::new()
            .when([Compare::version(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.as_str(), value.to_string(), Some(PutOptions::new().with_lease(lease)))])
            .or_else([TxnOp::get(key.as_str(), None)]);
        let resp = c.txn(txn).await.context("take the drain lock")?;
        if !resp.succeeded() {
            let _ = c.lease_revoke(lease).await;
            let holder = resp
                .op_responses()
                .into_iter()
                .find_map(|r| match r {
                    TxnOpResponse::Get(g) => g.kvs().first().map(|kv| {
                        serde_json::from_slice::<serde_json::Value>(kv.value())
                            .ok()
                            .and_then(|v| v["holder"].as_str().map(str::to_string))
                            .unwrap_or_else(|| String::from_utf8_lossy(kv.value()).into_owned())
                    }),
                    _ => None,
                })
                .unwrap_or_else(|| "unknown".to_string());
            return Err(Held { prefix: prefix.to_string(), holder }.into());
        }
        let epoch = resp.header().map(|h| h.revision()).ok_or_else(|| anyhow!("txn response without header"))?;
        info!(prefix, epoch, "took the drain lock");
        let keeper = tokio::spawn(keep_alive(client.clone(), lease, ttl_seconds));
        Ok(DrainLock { key, lease, epoch, keeper })
    }

    /// The compare every drain write carries.
    pub fn compare(&self) -> Compare {
        Compare::mod_revision(self.key.as_str(), CompareOp::Equal, self.epoch)
    }

    /// Gives the lock up (the lease goes, and the lock key with it).
    pub async fn release(self, client: &Client) {
        self.keeper.abort();
        let mut c = client.clone();
        if let Err(error) = c.lease_revoke(self.lease).await {
            debug!(%error, "releasing the drain lock; it lapses with its lease instead");
        }
    }
}

async fn keep_alive(client: Client, lease: i64, ttl_seconds: i64) {
    let interval = Duration::from_millis((ttl_seconds * 1000 / 3).max(300) as u64);
    let mut client = client;
    loop {
        if let Ok((mut keeper, mut stream)) = client.lease_keep_alive(lease).await {
            loop {
                if keeper.keep_alive().await.is_err() {
                    break;
                }
                match tokio::time::timeout(interval, stream.message()).await {
                    Ok(Ok(Some(resp))) if resp.ttl() > 0 => {}
                    // The lease is gone: the drain's next write fails its compare and it stops.
                    Ok(Ok(Some(_))) => return,
                    _ => break,
                }
                tokio::time::sleep(interval).await;
            }
        }
        tokio::time::sleep(interval).await;
    }
}
