//! Scenario steps written once, run on every substrate: the local processes (`make e2e`,
//! e2e/tests/e2e.rs) and the kind clusters (`make e2e-kind`, e2e/tests/kind.rs, which
//! hack/kind/e2e.sh runs by name).
use crate::substrate::{Substrate, wait_copy_whole};
use aether_operator::keys;
use etcd_client::GetOptions;
use std::time::{Duration, Instant};

/// What the data path took.
#[derive(Debug)]
pub struct DataPath {
    /// From the first put to every key visible on the peer.
    pub first_put_to_visible: Duration,
    /// From the last put to every key visible on the peer.
    pub last_put_to_visible: Duration,
    /// From the last delete to every deleted key gone from the peer.
    pub last_delete_to_gone: Duration,
}

/// The key of endpoint `i` of `cluster` in `origin`'s subtree (the v1 layout).
fn data_path_key(origin: &str, cluster: &str, i: usize) -> String {
    format!(
        "{}clusters/{cluster}/services/echo/protocols/http/endpoints/10.99.{}.{}",
        keys::region_prefix(origin),
        i / 250,
        i % 250 + 1
    )
}

/// `n` endpoints of `cluster` put into `origin` appear on `peer` verbatim (the peer's copy of the
/// subtree equal to the origin's, keys and values); `deletes` of them deleted in the origin
/// disappear from it; the other `n - deletes` stay. Each wait polls until `deadline`.
pub async fn data_path(
    sub: &impl Substrate,
    origin: &str,
    peer: &str,
    cluster: &str,
    n: usize,
    deletes: usize,
    deadline: Duration,
) -> anyhow::Result<DataPath> {
    anyhow::ensure!(deletes < n, "{deletes} deletes of {n} keys");
    let mut client = sub.registry(origin).await?;
    let prefix = format!("{}clusters/{cluster}/", keys::region_prefix(origin));
    // A clean start: a rerun on kept clusters finds the last run's keys.
    client.delete(prefix.as_str(), Some(etcd_client::DeleteOptions::new().with_prefix())).await?;
    let start = Instant::now();
    for i in 0..n {
        let value = format!(r#"{{"clusterName":"{cluster}","region":"{origin}","port":8080,"i":{i}}}"#);
        client.put(data_path_key(origin, cluster, i), value, None).await?;
    }
    let last_put = Instant::now();
    let held = client.get(prefix.as_str(), Some(GetOptions::new().with_prefix().with_count_only())).await?.count();
    anyhow::ensure!(held == n as i64, "{origin} holds {held} of the {n} keys just put");
    wait_copy_whole(sub, origin, peer, deadline).await?;
    let (first_put_to_visible, last_put_to_visible) = (start.elapsed(), last_put.elapsed());
    for i in 0..deletes {
        client.delete(data_path_key(origin, cluster, i * n / deletes), None).await?;
    }
    let last_delete = Instant::now();
    wait_copy_whole(sub, origin, peer, deadline).await?;
    Ok(DataPath { first_put_to_visible, last_put_to_visible, last_delete_to_gone: last_delete.elapsed() })
}
