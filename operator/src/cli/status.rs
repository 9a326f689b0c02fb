//! `aether-operator status`: every region's RegionPeering, read through kubeconfig contexts (the
//! current one, those named, or all), as one origin x peer matrix; with `--etcd`, each peer's copy
//! checked directly: from here, and for an etcd this machine cannot reach (a region's local etcd
//! named by its in-cluster Service), by the region's leader in its pod (`from_leader`). A status
//! nobody refreshes any more (its operator stopped, no leader) is reported stale, not read as
//! healthy.
use crate::api::RegionPeering;
use crate::controllers::region_peering::resolve_connection;
use crate::keys;
use crate::mirror::records::checkpoint::Checkpoint;
use etcd_client::GetOptions;
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::time::Duration;

/// One mirror: an origin region into one peer, as its RegionPeering reports it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct MirrorRow {
    pub context: String,
    /// namespace/name of the RegionPeering.
    pub object: String,
    pub origin: String,
    pub peer: String,
    pub phase: String,
    pub reachable: bool,
    pub synced: bool,
    pub lag_seconds: Option<i64>,
    pub keys: i64,
    pub lease_ttl_remaining_seconds: Option<i64>,
    pub last_error: Option<String>,
    /// What `--etcd` found on the peer, when asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub etcd: Option<EtcdCheck>,
}

/// The peer's copy, read directly.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct EtcdCheck {
    /// Keys of the origin's subtree on the origin and on the peer.
    pub origin_keys: Option<i64>,
    pub peer_keys: Option<i64>,
    /// Values the operator leaves out because the peer cannot take them.
    pub oversized: i64,
    /// The canary says the peer holds a complete snapshot.
    pub canary_synced: Option<bool>,
    pub checkpoint_revision: Option<i64>,
    pub problems: Vec<String>,
    /// Where the check ran, when not here: the leader's pod ("namespace/name").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checked_from: Option<String>,
    /// An etcd of this check could not be reached from where it ran.
    #[serde(skip)]
    pub unreachable: bool,
}

/// Where the etcds are read from (`status --etcd-from`, `doctor --from`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EtcdFrom {
    /// From here, and from the region's leader for the etcds this machine cannot reach.
    Auto,
    /// From here only.
    Here,
    /// From the region's leader, in its pod (needs pods/exec on the operator's pods).
    Leader,
}

/// A region's RegionPeering as a whole.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct RegionRow {
    pub context: String,
    pub object: String,
    pub region: String,
    /// The Ready condition: status and reason.
    pub ready: String,
    pub reason: String,
    pub leader: Option<String>,
    /// When the leader last wrote the status.
    pub refreshed: Option<String>,
    /// Why the status cannot be trusted any more (nobody refreshes it), if so.
    pub stale: Option<String>,
    /// What the region runs with but should not (conditions that do not make it unready, such as a
    /// TTL too short to cover a handoff): "Type=False (Reason): message".
    pub warnings: Vec<String>,
}

/// A context that could not be read: which, its API server, and why.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Unreadable {
    pub context: String,
    pub server: Option<String>,
    pub error: String,
}

/// The leader Lease of a region, as read.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LeaderLease {
    pub holder: Option<String>,
    pub renewed: Option<k8s_openapi::jiff::Timestamp>,
    pub duration_seconds: i64,
}

/// Why a region's status is stale, or None while someone refreshes it (pure). The leader
/// rewrites the status at least every `refresh_seconds`; a Lease nobody holds or renews means no
/// operator leads the region; a status older than the refresh and the Lease's duration means its
/// leader no longer writes it.
pub fn staleness(
    now: k8s_openapi::jiff::Timestamp,
    refreshed: Option<k8s_openapi::jiff::Timestamp>,
    refresh_seconds: i64,
    lease: Option<&LeaderLease>,
) -> Option<String> {
    let age = |t: k8s_openapi::jiff::Timestamp| (now.as_second() - t.as_second()).max(0);
    let grace = refresh_seconds + lease.map_or(15, |l| l.duration_seconds) + 5;
    if let Some(lease) = lease {
        let expired = lease.renewed.is_none_or(|r| age(r) > lease.duration_seconds);
        if lease.holder.as_deref().is_none_or(str::is_empty) || expired {
            let renewed = lease
                .renewed
                .map_or_else(|| "was never renewed".to_string(), |r| format!("was last renewed {r} ({}s ago)", age(r)));
            return Some(format!("no operator leads the region: its leader Lease {renewed}"));
        }
    }
    match refreshed {
        None => Some("the operator has never written this status".into()),
        Some(t) if age(t) > grace => {
            let by =
                lease.and_then(|l| l.holder.clone()).map(|h| format!(" (the Lease names {h})")).unwrap_or_default();
            Some(format!(
                "the status was last refreshed {}s ago, longer than its refresh interval of {refresh_seconds}s{by}",
                age(t)
            ))
        }
        Some(_) => None,
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Federation {
    pub regions: Vec<RegionRow>,
    pub mirrors: Vec<MirrorRow>,
    /// Contexts that could not be read, with why.
    pub unreachable: Vec<Unreadable>,
}

/// The rows of one RegionPeering (pure).
pub fn rows(context: &str, rp: &RegionPeering) -> (RegionRow, Vec<MirrorRow>) {
    let object = format!("{}/{}", rp.namespace().unwrap_or_default(), rp.name_any());
    let status = rp.status.clone().unwrap_or_default();
    let ready = status.conditions.iter().find(|c| c.type_ == "Ready");
    let region = RegionRow {
        context: context.to_string(),
        object: object.clone(),
        region: rp.spec.region.clone(),
        ready: ready.map_or_else(|| "Unknown".to_string(), |c| c.status.clone()),
        reason: ready.map_or_else(|| "NoStatus".to_string(), |c| c.reason.clone()),
        leader: status.leader.clone(),
        refreshed: status.refreshed_time.as_ref().map(|t| t.0.to_string()),
        stale: None,
        warnings: status
            .conditions
            .iter()
            .filter(|c| WARNING_WHEN_FALSE.contains(&c.type_.as_str()) && c.status == "False")
            .map(|c| format!("{}=False ({}): {}", c.type_, c.reason, c.message))
            .collect(),
    };
    let mirrors = rp
        .spec
        .peers
        .iter()
        .map(|peer| {
            let reported = status.peers.iter().find(|p| p.region == peer.region);
            MirrorRow {
                context: context.to_string(),
                object: object.clone(),
                origin: rp.spec.region.clone(),
                peer: peer.region.clone(),
                phase: reported.map_or_else(|| "Unknown".to_string(), |p| p.phase.clone()),
                reachable: reported.is_some_and(|p| p.reachable),
                synced: reported.is_some_and(|p| p.replication.synced),
                lag_seconds: reported.and_then(|p| p.replication.lag_seconds),
                keys: reported.map_or(0, |p| p.replication.keys),
                lease_ttl_remaining_seconds: reported.and_then(|p| p.keepalive.ttl_remaining_seconds),
                last_error: reported.and_then(|p| p.last_error.clone()),
                etcd: None,
            }
        })
        .collect();
    (region, mirrors)
}

/// Conditions that leave a region Ready but say it runs with a risk when False.
const WARNING_WHEN_FALSE: &[&str] = &["HandoffCovered"];

/// What the regions run with but should not, whether healthy or not (pure).
pub fn warnings(f: &Federation) -> Vec<String> {
    f.regions.iter().flat_map(|r| r.warnings.iter().map(move |w| format!("{} ({}): {w}", r.region, r.object))).collect()
}

/// Why the federation is not healthy; empty when it is (pure).
pub fn problems(f: &Federation) -> Vec<String> {
    let mut out: Vec<String> = f.unreachable.iter().map(|u| format!("context {}: {}", u.context, u.error)).collect();
    if f.regions.is_empty() && f.unreachable.is_empty() {
        out.push("no RegionPeering found in any context".into());
    }
    for r in &f.regions {
        if let Some(why) = &r.stale {
            out.push(format!("{} ({}): stale: {why}", r.region, r.object));
        } else if r.ready != "True" {
            out.push(format!("{} ({}): Ready={} ({})", r.region, r.object, r.ready, r.reason));
        }
    }
    for m in &f.mirrors {
        let name = format!("{} -> {}", m.origin, m.peer);
        if m.phase != "Watching" {
            out.push(format!(
                "{name}: phase {}{}",
                m.phase,
                m.last_error.as_ref().map(|e| format!(": {e}")).unwrap_or_default()
            ));
        } else if !m.synced {
            out.push(format!("{name}: not synced"));
        } else if !m.reachable {
            out.push(format!("{name}: peer unreachable"));
        }
        if let Some(check) = &m.etcd {
            out.extend(check.problems.iter().map(|p| format!("{name}: {p}")));
        }
    }
    out
}

fn cell<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_string(), |v| v.to_string())
}

/// The matrix as a table (pure).
pub fn render_table(f: &Federation) -> String {
    let mut rows = vec![
        ["ORIGIN", "PEER", "PHASE", "SYNCED", "REACHABLE", "LAG", "KEYS", "TTL-LEFT", "ETCD", "CONTEXT"]
            .map(String::from),
    ];
    for m in &f.mirrors {
        let etcd = match &m.etcd {
            None => "-".to_string(),
            Some(c) if c.problems.is_empty() => format!(
                "ok {}/{}{}",
                cell(c.peer_keys),
                cell(c.origin_keys),
                if c.checked_from.is_some() { " (leader)" } else { "" }
            ),
            Some(c) => format!("{} problem(s)", c.problems.len()),
        };
        rows.push([
            m.origin.clone(),
            m.peer.clone(),
            m.phase.clone(),
            m.synced.to_string(),
            m.reachable.to_string(),
            cell(m.lag_seconds.map(|s| format!("{s}s"))),
            m.keys.to_string(),
            cell(m.lease_ttl_remaining_seconds.map(|s| format!("{s}s"))),
            etcd,
            m.context.clone(),
        ]);
    }
    let widths: Vec<usize> = (0..rows[0].len()).map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for r in &rows {
        let line: Vec<String> = r.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
    let _ = writeln!(out);
    for r in &f.regions {
        let _ = writeln!(
            out,
            "region {} ({} in context {}): Ready={} ({}), leader {}{}",
            r.region,
            r.object,
            r.context,
            r.ready,
            r.reason,
            r.leader.as_deref().unwrap_or("none"),
            r.stale.as_ref().map(|s| format!(", STALE: {s}")).unwrap_or_default()
        );
    }
    let problems = problems(f);
    if problems.is_empty() {
        let _ = writeln!(out, "\nhealthy: {} regions, {} mirrors", f.regions.len(), f.mirrors.len());
    } else {
        let _ = writeln!(out, "\nnot healthy:");
        for p in problems {
            let _ = writeln!(out, "  - {p}");
        }
    }
    let warnings = warnings(f);
    if !warnings.is_empty() {
        let _ = writeln!(out, "\nwarnings:");
        for w in warnings {
            let _ = writeln!(out, "  - {w}");
        }
    }
    out
}

/// Reads the RegionPeerings (all namespaces, or `namespace`) of every context at once, each
/// within `deadline`; with `etcd`, checks each peer's copy on the etcds from where it says.
pub async fn gather(
    kubeconfig: &kube::config::Kubeconfig,
    contexts: &[String],
    namespace: Option<&str>,
    etcd: Option<EtcdFrom>,
    deadline: Duration,
) -> Federation {
    let reads = contexts.iter().map(|context| async move {
        let read = tokio::time::timeout(deadline, read_context(kubeconfig, context, namespace, etcd, deadline)).await;
        match read {
            Ok(Ok(rows)) => Ok(rows),
            Ok(Err(e)) => Err(unreadable(kubeconfig, context, format!("{e:#}"))),
            Err(_) => Err(unreadable(kubeconfig, context, format!("no answer within {deadline:?}"))),
        }
    });
    let mut f = Federation::default();
    for read in futures::future::join_all(reads).await {
        match read {
            Ok((regions, mirrors)) => {
                f.regions.extend(regions);
                f.mirrors.extend(mirrors);
            }
            Err(u) => f.unreachable.push(u),
        }
    }
    f
}

/// The API server a context talks to, from the kubeconfig.
pub fn server_of(kubeconfig: &kube::config::Kubeconfig, context: &str) -> Option<String> {
    let cluster = kubeconfig.contexts.iter().find(|c| c.name == context)?.context.as_ref()?.cluster.clone();
    kubeconfig.clusters.iter().find(|c| c.name == cluster)?.cluster.as_ref()?.server.clone()
}

fn unreadable(kubeconfig: &kube::config::Kubeconfig, context: &str, error: String) -> Unreadable {
    let server = server_of(kubeconfig, context);
    let at = server.as_deref().map(|s| format!(" at {s}")).unwrap_or_default();
    Unreadable { context: context.to_string(), error: format!("the API server{at}: {error}"), server }
}

async fn read_context(
    kubeconfig: &kube::config::Kubeconfig,
    context: &str,
    namespace: Option<&str>,
    etcd: Option<EtcdFrom>,
    deadline: Duration,
) -> anyhow::Result<(Vec<RegionRow>, Vec<MirrorRow>)> {
    let client = super::client_for(kubeconfig, Some(context)).await?;
    let api: Api<RegionPeering> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let items =
        api.list(&ListParams::default()).await.map_err(|e| anyhow::anyhow!("listing RegionPeerings: {e}"))?.items;
    let (mut regions, mut all_mirrors) = (Vec::new(), Vec::new());
    for rp in items {
        let (mut region, mut mirrors) = rows(context, &rp);
        let status = rp.status.clone().unwrap_or_default();
        let lease = match status.leader_lease.as_deref().and_then(|l| l.split_once('/')) {
            Some((ns, name)) => leader_lease(&client, ns, name).await,
            None => None,
        };
        region.stale = staleness(
            k8s_openapi::jiff::Timestamp::now(),
            status.refreshed_time.as_ref().map(|t| t.0),
            status.refresh_interval_seconds.unwrap_or(60),
            lease.as_ref(),
        );
        if let Some(from) = etcd {
            if from != EtcdFrom::Leader {
                check_peers(&client, &rp, &mut mirrors).await;
            }
            if ask_leader(from, &mirrors) {
                let leader_deadline = deadline.saturating_sub(Duration::from_secs(10)).max(Duration::from_secs(5));
                let asked = super::from_leader::check(&client, &rp, leader_deadline).await;
                super::from_leader::merge(&mut mirrors, asked);
            }
        }
        regions.push(region);
        all_mirrors.extend(mirrors);
    }
    Ok((regions, all_mirrors))
}

/// Whether the region's leader checks the etcds (pure): when asked to, or, by default, when an etcd
/// of the RegionPeering cannot be reached from here.
pub fn ask_leader(from: EtcdFrom, mirrors: &[MirrorRow]) -> bool {
    match from {
        EtcdFrom::Here => false,
        EtcdFrom::Leader => !mirrors.is_empty(),
        EtcdFrom::Auto => mirrors.iter().any(|m| m.etcd.as_ref().is_some_and(|c| c.unreachable)),
    }
}

/// A region's leader Lease (None when it cannot be read: then only the status's age speaks).
async fn leader_lease(client: &kube::Client, namespace: &str, name: &str) -> Option<LeaderLease> {
    let api: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(client.clone(), namespace);
    let spec = api.get_opt(name).await.ok()??.spec.unwrap_or_default();
    Some(LeaderLease {
        holder: spec.holder_identity,
        renewed: spec.renew_time.map(|t| t.0),
        duration_seconds: spec.lease_duration_seconds.unwrap_or(15) as i64,
    })
}

/// Counts the origin's subtree on the origin and on each peer, and reads each peer's canary and
/// checkpoint, with the RegionPeering's own credentials.
async fn check_peers(client: &kube::Client, rp: &RegionPeering, mirrors: &mut [MirrorRow]) {
    let namespace = rp.namespace().unwrap_or_default();
    let origin = &rp.spec.region;
    let origin_keys = match count_subtree(client, &namespace, &rp.spec.local_etcd, origin).await {
        Ok(n) => Ok(n),
        Err(e) => Err((format!("cannot count the origin's keys on the local etcd: {e:#}"), is_unreachable(&e))),
    };
    let oversized = |peer: &str| {
        rp.status
            .as_ref()
            .and_then(|s| s.peers.iter().find(|p| p.region == peer))
            .map_or(0, |p| p.oversized_values.len() as i64)
    };
    for (row, peer) in mirrors.iter_mut().zip(&rp.spec.peers) {
        let mut check = EtcdCheck { oversized: oversized(&peer.region), ..Default::default() };
        match &origin_keys {
            Ok(n) => check.origin_keys = Some(*n),
            Err((e, unreachable)) => {
                check.problems.push(e.clone());
                check.unreachable |= unreachable;
            }
        }
        match read_peer(client, &namespace, &peer.connection(), origin).await {
            Err(e) => {
                check.problems.push(format!("cannot read the peer etcd: {e:#}"));
                check.unreachable |= is_unreachable(&e);
            }
            Ok((keys, canary, checkpoint)) => {
                check.peer_keys = Some(keys);
                check.canary_synced = canary;
                check.checkpoint_revision = checkpoint.as_ref().map(|c| c.revision);
                if canary != Some(true) {
                    check.problems.push("the canary does not say synced".into());
                }
                if checkpoint.is_none() {
                    check.problems.push("no checkpoint on the peer".into());
                }
                if let Some(expected) = check.origin_keys.map(|n| n - check.oversized)
                    && expected != keys
                {
                    check.problems.push(format!(
                        "the peer holds {keys} of the origin's keys, the origin {expected} (writes in flight show briefly)"
                    ));
                }
            }
        }
        row.etcd = Some(check);
    }
}

async fn connect(
    client: &kube::Client,
    namespace: &str,
    connection: &crate::api::EtcdConnection,
) -> anyhow::Result<etcd_client::Client> {
    let access = resolve_connection(client, namespace, connection).await?;
    match tokio::time::timeout(Duration::from_secs(10), access.target.connect()).await {
        Err(_) => Err(Unreachable("connecting timed out".into()).into()),
        Ok(Err(e)) if e.classified().problem == crate::mirror::problem::Problem::Unreachable => {
            Err(Unreachable(e.classified().message).into())
        }
        Ok(result) => result.map_err(Into::into),
    }
}

/// No member of an etcd answered from here.
#[derive(Debug)]
struct Unreachable(String);

impl std::fmt::Display for Unreachable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "unreachable from here: {}", self.0)
    }
}

impl std::error::Error for Unreachable {}

fn is_unreachable(e: &anyhow::Error) -> bool {
    e.downcast_ref::<Unreachable>().is_some()
}

async fn count_subtree(
    client: &kube::Client,
    namespace: &str,
    connection: &crate::api::EtcdConnection,
    origin: &str,
) -> anyhow::Result<i64> {
    let mut etcd = connect(client, namespace, connection).await?;
    let resp = etcd.get(keys::region_prefix(origin), Some(GetOptions::new().with_prefix().with_count_only())).await?;
    Ok(resp.count())
}

async fn read_peer(
    client: &kube::Client,
    namespace: &str,
    connection: &crate::api::EtcdConnection,
    origin: &str,
) -> anyhow::Result<(i64, Option<bool>, Option<Checkpoint>)> {
    let mut etcd = connect(client, namespace, connection).await?;
    let keys_on_peer =
        etcd.get(keys::region_prefix(origin), Some(GetOptions::new().with_prefix().with_count_only())).await?.count();
    let canary = etcd.get(keys::canary_key(origin), None).await?;
    let canary = canary
        .kvs()
        .first()
        .and_then(|kv| serde_json::from_slice::<serde_json::Value>(kv.value()).ok())
        .map(|v| v["synced"].as_bool() == Some(true));
    let checkpoint = crate::mirror::records::read_checkpoint(&etcd, origin).await?;
    Ok((keys_on_peer, canary, checkpoint))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{PeerStatus, RegionPeeringStatus};

    fn peering(peers: &[(&str, &str, bool)]) -> RegionPeering {
        let mut rp: RegionPeering = serde_json::from_value(serde_json::json!({
            "apiVersion": "federation.aether.dev/v1alpha1", "kind": "RegionPeering",
            "metadata": {"name": "a", "namespace": "fed"},
            "spec": {"region": "a", "localEtcd": {"endpoints": ["http://127.0.0.1:1"]},
                     "peers": peers.iter().map(|(r, _, _)| serde_json::json!({"region": r, "endpoints": ["http://127.0.0.1:2"]})).collect::<Vec<_>>()}
        }))
        .unwrap();
        let mut status = RegionPeeringStatus::default();
        status.conditions.push(k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
            type_: "Ready".into(),
            status: if peers.iter().all(|(_, p, s)| *p == "Watching" && *s) { "True" } else { "False" }.into(),
            reason: "X".into(),
            message: String::new(),
            last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()),
            observed_generation: None,
        });
        for (region, phase, synced) in peers {
            let mut p = PeerStatus {
                region: region.to_string(),
                phase: phase.to_string(),
                reachable: true,
                ..Default::default()
            };
            p.replication.synced = *synced;
            p.replication.keys = 7;
            status.peers.push(p);
        }
        rp.status = Some(status);
        rp
    }

    #[test]
    fn a_federation_is_healthy_only_when_every_mirror_watches_synced() {
        let (region, mirrors) = rows("ctx-a", &peering(&[("b", "Watching", true), ("c", "Watching", true)]));
        let healthy = Federation { regions: vec![region], mirrors, unreachable: vec![] };
        assert!(problems(&healthy).is_empty(), "{:?}", problems(&healthy));
        assert!(render_table(&healthy).contains("healthy: 1 regions, 2 mirrors"));

        let (region, mirrors) = rows("ctx-a", &peering(&[("b", "Watching", true), ("c", "Backoff", false)]));
        let degraded = Federation {
            regions: vec![region],
            mirrors,
            unreachable: vec![Unreadable { context: "ctx-c".into(), server: None, error: "down".into() }],
        };
        let found = problems(&degraded);
        assert!(found.iter().any(|p| p.contains("a -> c: phase Backoff")), "{found:?}");
        assert!(found.iter().any(|p| p.contains("Ready=False")), "{found:?}");
        assert!(found.iter().any(|p| p.contains("context ctx-c")), "{found:?}");
        let table = render_table(&degraded);
        assert!(
            table.contains("not healthy") && table.lines().any(|l| l.starts_with("a") && l.contains("Backoff")),
            "{table}"
        );
    }

    #[test]
    fn a_ttl_too_short_for_a_handoff_is_a_warning_of_a_healthy_federation() {
        let mut rp = peering(&[("b", "Watching", true)]);
        let mut covered = rp.status.as_ref().unwrap().conditions[0].clone();
        (covered.type_, covered.status, covered.reason) =
            ("HandoffCovered".into(), "False".into(), "TtlShorterThanHandoff".into());
        covered.message = "set lease.ttlSeconds to at least 23".into();
        rp.status.as_mut().unwrap().conditions.push(covered.clone());
        let (region, mirrors) = rows("ctx", &rp);
        let f = Federation { regions: vec![region], mirrors, unreachable: vec![] };
        assert!(problems(&f).is_empty(), "a warning is no problem: {:?}", problems(&f));
        assert_eq!(
            warnings(&f),
            ["a (fed/a): HandoffCovered=False (TtlShorterThanHandoff): set lease.ttlSeconds to at least 23"]
        );
        let table = render_table(&f);
        assert!(
            table.contains("healthy: 1 regions") && table.contains("warnings:\n  - a (fed/a): HandoffCovered=False"),
            "{table}"
        );
        // Covered: nothing to say.
        covered.status = "True".into();
        rp.status.as_mut().unwrap().conditions[1] = covered;
        let (region, mirrors) = rows("ctx", &rp);
        let f = Federation { regions: vec![region], mirrors, unreachable: vec![] };
        assert!(warnings(&f).is_empty() && !render_table(&f).contains("warnings"));
    }

    #[test]
    fn a_peer_named_in_spec_without_status_is_unknown_and_unhealthy() {
        let mut rp = peering(&[("b", "Watching", true)]);
        rp.spec.peers.push(
            serde_json::from_value(serde_json::json!({"region": "d", "endpoints": ["http://127.0.0.1:3"]})).unwrap(),
        );
        let (region, mirrors) = rows("ctx", &rp);
        assert_eq!(mirrors[1].phase, "Unknown");
        let f = Federation { regions: vec![region], mirrors, unreachable: vec![] };
        assert!(problems(&f).iter().any(|p| p.contains("a -> d")));
    }

    fn at(second: i64) -> k8s_openapi::jiff::Timestamp {
        k8s_openapi::jiff::Timestamp::from_second(second).unwrap()
    }

    #[test]
    fn a_status_nobody_refreshes_is_stale() {
        let now = at(1_800_000_000);
        let lease = |holder: Option<&str>, renewed: i64| LeaderLease {
            holder: holder.map(String::from),
            renewed: Some(at(renewed)),
            duration_seconds: 8,
        };
        let held = lease(Some("a-operator-0"), 1_800_000_000 - 2);
        assert_eq!(staleness(now, Some(at(1_800_000_000 - 30)), 60, Some(&held)), None, "refreshed within the minute");
        // The operator stopped: nobody renews the Lease.
        let expired = lease(Some("a-operator-0"), 1_800_000_000 - 20);
        let why = staleness(now, Some(at(1_800_000_000 - 20)), 60, Some(&expired)).expect("stale");
        assert!(why.contains("no operator leads the region") && why.contains("20s ago"), "{why}");
        assert!(staleness(now, Some(at(1_800_000_000 - 1)), 60, Some(&lease(None, 1_800_000_000 - 1))).is_some());
        // A leader that holds the Lease and writes nothing.
        let why = staleness(now, Some(at(1_800_000_000 - 200)), 60, Some(&held)).expect("stale");
        assert!(why.contains("200s ago") && why.contains("a-operator-0"), "{why}");
        // Without the Lease, the status's age alone.
        assert!(staleness(now, Some(at(1_800_000_000 - 100)), 60, None).is_some());
        assert!(staleness(now, None, 60, None).is_some());
        // A Lease that was never renewed says so.
        let never = LeaderLease { holder: None, renewed: None, duration_seconds: 8 };
        let why = staleness(now, Some(at(1_800_000_000 - 1)), 60, Some(&never)).expect("stale");
        assert!(why.ends_with("its leader Lease was never renewed"), "{why}");
    }

    #[test]
    fn a_stale_region_makes_the_federation_unhealthy_and_is_named() {
        let (mut region, mirrors) = rows("ctx-a", &peering(&[("b", "Watching", true)]));
        region.stale = Some("no operator leads the region".into());
        let f = Federation { regions: vec![region], mirrors, unreachable: vec![] };
        let found = problems(&f);
        assert!(found.iter().any(|p| p.starts_with("a (fed/a): stale:")), "{found:?}");
        assert!(render_table(&f).contains("STALE"), "{}", render_table(&f));
    }

    #[test]
    fn the_leader_is_asked_by_default_only_for_etcds_this_machine_cannot_reach() {
        let (_, mut mirrors) = rows("ctx", &peering(&[("b", "Watching", true)]));
        mirrors[0].etcd = Some(EtcdCheck::default());
        assert!(!ask_leader(EtcdFrom::Auto, &mirrors), "every etcd answered here");
        assert!(ask_leader(EtcdFrom::Leader, &mirrors));
        mirrors[0].etcd = Some(EtcdCheck { unreachable: true, ..Default::default() });
        assert!(ask_leader(EtcdFrom::Auto, &mirrors));
        assert!(!ask_leader(EtcdFrom::Here, &mirrors));
        assert!(!ask_leader(EtcdFrom::Leader, &[]), "nothing to check");
    }

    #[test]
    fn an_etcd_check_that_found_problems_makes_the_federation_unhealthy() {
        let (region, mut mirrors) = rows("ctx", &peering(&[("b", "Watching", true)]));
        mirrors[0].etcd = Some(EtcdCheck { problems: vec!["no checkpoint on the peer".into()], ..Default::default() });
        let f = Federation { regions: vec![region], mirrors, unreachable: vec![] };
        assert_eq!(problems(&f), vec!["a -> b: no checkpoint on the peer".to_string()]);
        assert!(Federation::default().regions.is_empty() && !problems(&Federation::default()).is_empty());
    }
}
