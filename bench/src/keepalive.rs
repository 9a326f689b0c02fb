//! The keepalive row: how fast the leases of one origin are renewed on a three-member peer, at 1k,
//! 8k and 32k leases, next door and 150 ms away, on one stream that happens to reach a follower
//! (what a single stream gets two times in three) against the keeper's design (the leader when a
//! probe sees it, streams sized from the measured rate). The target: 32k leases renewed within a
//! third of the default TTL (10 s) at 150 ms.
use crate::table::Table;
use aether_harness::{EtcdCluster, FaultProxy};
use aether_operator::mirror::EtcdTarget;
use aether_operator::mirror::leases::keeper::{RoundMeasure, measure_round};
use aether_operator::mirror::leases::renewal::{Measured, streams_for};
use futures::StreamExt;
use std::time::Duration;

const LEASE_COUNTS: [usize; 3] = [1_000, 8_000, 32_000];
/// A third of the CRD's default TTL of 30 s.
const TARGET: Duration = Duration::from_secs(10);
/// The keeper aims for a sixth of the TTL.
const KEEPER_TARGET: Duration = Duration::from_secs(5);

pub async fn bench_keepalive(table: &mut Table) -> anyhow::Result<()> {
    let peer = EtcdCluster::start("keepalive", 3).await?;
    let mut admin = etcd_client::Client::connect(peer.endpoints(), None).await?;
    let most = *LEASE_COUNTS.iter().max().unwrap_or(&0);
    let granted = Duration::from_secs(600);
    let leases: Vec<i64> = futures::stream::iter(0..most)
        .map(|_| {
            let mut admin = admin.clone();
            async move { admin.lease_grant(granted.as_secs() as i64, None).await.map(|r| r.id()) }
        })
        .buffer_unordered(256)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;
    let leader = peer.leader().await?;
    let follower = (leader + 1) % 3;
    for rtt in [Duration::ZERO, Duration::from_millis(150)] {
        let mut proxies = Vec::new();
        let endpoints: Vec<String> = if rtt.is_zero() {
            peer.endpoints()
        } else {
            for member in peer.members() {
                let proxy = FaultProxy::start(member.client_addr()).await?;
                proxy.set_rtt(rtt);
                proxies.push(proxy);
            }
            proxies.iter().map(|p| p.endpoint("http")).collect()
        };
        let at = if rtt.is_zero() { "next door".to_string() } else { format!("{} ms away", rtt.as_millis()) };
        for n in LEASE_COUNTS {
            let some = &leases[..n];
            let one = measure_round(&EtcdTarget::plain([endpoints[follower].clone()]), some, 1, false, granted).await?;
            row(table, &at, n, "one stream, on a follower", &one);
            // The keeper's sizing: a first round at one stream per 2,048 leases, then as many as
            // the measured rate needs for a sixth of the TTL; the second round is the steady one.
            let all = EtcdTarget::plain(endpoints.clone());
            let first_streams = streams_for(n, 1, None, KEEPER_TARGET);
            let first = measure_round(&all, some, first_streams, true, granted).await?;
            let measured = Measured { answered: first.answered, elapsed: first.elapsed, streams: first.streams };
            let streams = streams_for(n, first_streams, Some(measured), KEEPER_TARGET);
            let steady = measure_round(&all, some, streams, true, granted).await?;
            row(table, &at, n, "this keeper", &steady);
        }
    }
    let _ = admin.status().await;
    Ok(())
}

fn row(table: &mut Table, at: &str, leases: usize, subject: &str, m: &RoundMeasure) {
    let per_second = m.answered as f64 / m.elapsed.as_secs_f64().max(1e-9);
    let within = m.answered == leases && m.elapsed <= TARGET;
    table.row_with(
        &format!("keepalive: {leases} leases, {at}"),
        subject,
        format!("round {:.2} s, {per_second:.0} renewals/s", m.elapsed.as_secs_f64()),
        format!(
            "{} stream(s) to {}; {}/{leases} answered; {} the 10 s target (a third of the default TTL)",
            m.streams,
            if m.on_leader { "the leader" } else { "a follower or any member" },
            m.answered,
            if within { "within" } else { "MISSES" },
        ),
        serde_json::json!({
            "leases": leases, "answered": m.answered, "round_seconds": m.elapsed.as_secs_f64(),
            "renewals_per_second": per_second, "streams": m.streams, "on_leader": m.on_leader,
            "endpoints": m.endpoints, "within_target": within,
        }),
    );
}
