//! Trying a configuration before a worker runs on it. A changed RegionPeering or Secret is tried
//! beside the worker that runs now, which keeps renewing and mirroring until the trial verified
//! the new configuration: the way a Deployment keeps its old ReplicaSet until the new one is
//! ready, or Envoy NACKs an xDS update it cannot apply. What is checked, with nothing written:
//!
//! - the local etcd answers and is this region's origin: it holds no copy of this region mirrored
//!   in from elsewhere (`/aether/v1/federation/<region>/owner` is what a peer holding the copy
//!   has), and the regions it is the origin of, as far as the credentials may list them, include
//!   this one;
//! - the peer answers, accepts the credentials, and lets them write the copy and its records;
//! - the peer is not the origin itself, is not this object's other peer under a second name, is
//!   not mirrored into by another live claim on the region, and is the etcd of the region it is
//!   named for (as far as the credentials may list its regions).
//!
//! A verdict is `Verified`, `Refused` (the configuration cannot be right: credentials, identity,
//! permissions), or `Unverified` (nothing answered: tried again, and what runs keeps running).
//! The findings are gathered by thin IO (`gather`); the verdict is `judge` (pure).
use super::leases::keeper::{most_ttl_left, same_etcd};
use super::problem::{Classified, Problem};
use super::records::resume::{Claimant, OwnerDecision, Ownership, decide_ownership};
use super::records::store::read_records;
use super::{EtcdTarget, MirrorConfig};
use crate::keys;
use etcd_client::{Client, Compare, CompareOp, GetOptions, Txn, TxnOp, TxnOpResponse};
use std::future::Future;
use std::time::Duration;

/// What a trial concluded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Everything checked: the worker may run on it.
    Verified,
    /// The configuration cannot be right: (reason, what was found and what to do).
    Refused { reason: String, message: String },
    /// Nothing answered in time, or the etcd failed: not known yet.
    Unverified { reason: String, message: String },
}

impl Verdict {
    fn refused(reason: &str, message: String) -> Verdict {
        Verdict::Refused { reason: reason.into(), message }
    }

    /// A failure talking to an etcd: refused when it is the configuration's (certificates,
    /// credentials, permissions), not known yet when the etcd did not answer.
    fn of_failure(side: &str, classified: Classified) -> Verdict {
        let message = format!("{side}: {}", classified.message);
        let reason = classified.problem.reason().to_string();
        match classified.problem {
            Problem::Unreachable | Problem::NoSpace | Problem::Other => Verdict::Unverified { reason, message },
            _ => Verdict::Refused { reason, message },
        }
    }
}

/// The most regions a trial lists in one etcd.
const MAX_REGIONS_LISTED: usize = 64;

/// What the trial found in the local etcd.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalFindings {
    pub cluster_id: u64,
    /// The owner record of this region's copy, if the local etcd holds one: it is a peer's etcd.
    pub holds_copy_of_region: Option<String>,
    /// The regions this etcd is the origin of (keys under `regions/<r>/`, no copy record), when
    /// the credentials may list them.
    pub own_regions: Option<Vec<String>>,
}

/// What the trial found in the peer's etcd.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerFindings {
    pub cluster_id: u64,
    /// Whether the peer is the local etcd itself; asked only when their cluster ids are equal.
    pub is_the_origin: Option<bool>,
    /// What the peer's owner record of this region's copy decides for a new worker of this object.
    pub ownership: Option<OwnerDecision>,
    /// Whether the contested claim's leases still live (None: none recorded, or no answer).
    pub contested_alive: Option<bool>,
    /// The user may not write the copy and its records.
    pub write_denied: bool,
    pub own_regions: Option<Vec<String>>,
}

/// The verdict on the local etcd alone, without IO: None when nothing is wrong with it.
pub fn judge_local(config: &MirrorConfig, local: &LocalFindings) -> Option<Verdict> {
    let origin = &config.origin;
    if let Some(owner) = &local.holds_copy_of_region {
        return Some(Verdict::refused(
            "LocalEtcdHoldsCopy",
            format!(
                "spec.localEtcd reaches an etcd (cluster {:x}) that holds a copy of region {origin} mirrored in from elsewhere (recorded by {owner}): it is a peer's etcd, not region {origin}'s. Nothing was read or written; point spec.localEtcd back at region {origin}'s own etcd",
                local.cluster_id
            ),
        ));
    }
    if let Some(own) = local.own_regions.as_ref().filter(|own| !own.is_empty() && !own.contains(origin)) {
        return Some(Verdict::refused(
            "LocalEtcdOfAnotherRegion",
            format!(
                "spec.localEtcd reaches an etcd (cluster {:x}) that is the origin of region(s) {} and not of {origin}: it is another region's etcd. Nothing was read or written; point spec.localEtcd back at region {origin}'s own etcd",
                local.cluster_id,
                own.join(", ")
            ),
        ));
    }
    None
}

/// The verdict from the findings, without IO.
pub fn judge(config: &MirrorConfig, local: &LocalFindings, peer: &PeerFindings) -> Verdict {
    if let Some(refused) = judge_local(config, local) {
        return refused;
    }
    let (origin, name) = (&config.origin, &config.peer);
    if peer.cluster_id == local.cluster_id && peer.is_the_origin != Some(false) {
        return Verdict::refused(
            "PeerIsOrigin",
            format!(
                "spec.peers[{name}] reaches region {origin}'s own etcd (cluster {:x}, the one spec.localEtcd reaches): a region never mirrors into itself. Point spec.peers[{name}].endpoints at region {name}'s etcd",
                peer.cluster_id
            ),
        );
    }
    if peer.write_denied {
        return Verdict::refused(
            "PermissionDenied",
            format!(
                "spec.peers[{name}]: the etcd user may not write {} and {} on the peer (cluster {:x}); grant it read-write on both prefixes (hack/etcd-mirror-role.sh {origin} <endpoint>)",
                keys::region_prefix(origin),
                keys::federation_prefix(origin),
                peer.cluster_id
            ),
        );
    }
    match &peer.ownership {
        Some(OwnerDecision::Contested { contest, .. }) => {
            let live = match contest {
                super::records::resume::Contest::DuplicatePeer { .. } => true,
                super::records::resume::Contest::DuplicateOrigin { .. } => peer.contested_alive != Some(false),
            };
            if let (true, super::records::resume::Contest::DuplicatePeer { other_peer }) = (live, contest) {
                // Whether the edit or the list is wrong, the peer named here is the one to fix.
                return Verdict::refused(
                    "DuplicatePeer",
                    format!(
                        "spec.peers[{name}] reaches the etcd (cluster {:x}) region {origin} already mirrors into as peer {other_peer}: one etcd is never mirrored into under two names, and nothing is written as {name}. Point spec.peers[{name}].endpoints at region {name}'s etcd",
                        peer.cluster_id
                    ),
                );
            }
            if live {
                let claimant = Claimant { owner_id: &config.owner_id, object: config.object.as_ref(), peer: name };
                let refusal = contest.refusal(&claimant, origin, peer.cluster_id, config.lease_ttl_seconds);
                return Verdict::refused(refusal.reason, refusal.message);
            }
        }
        Some(OwnerDecision::Take { .. } | OwnerDecision::Fenced { .. } | OwnerDecision::Retired { .. }) | None => {}
    }
    if let Some(own) = peer.own_regions.as_ref().filter(|own| !own.is_empty() && !own.contains(name)) {
        return Verdict::refused(
            "PeerOfAnotherRegion",
            format!(
                "spec.peers[{name}] reaches an etcd (cluster {:x}) that is the origin of region(s) {} and not of {name}: it is another region's etcd. Point spec.peers[{name}].endpoints at region {name}'s etcd",
                peer.cluster_id,
                own.join(", ")
            ),
        );
    }
    Verdict::Verified
}

/// Tries `config` on `local` and `peer`, writing nothing (a lease granted on the peer to tell it
/// from the origin is revoked at once). Every call is bounded by the RPC deadline.
pub async fn try_configuration(config: &MirrorConfig, local: &EtcdTarget, peer: &EtcdTarget) -> Verdict {
    let timeout = config.rpc_timeout;
    let local_client = match bounded(timeout, local.connect()).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return Verdict::of_failure("spec.localEtcd", e.classified()),
        Err(()) => return unanswered("spec.localEtcd", timeout),
    };
    let local_findings = match gather_local(&local_client, &config.origin, timeout).await {
        Ok(f) => f,
        Err(e) => return Verdict::of_failure("spec.localEtcd", local.classify(e.as_ref(), None)),
    };
    // The local etcd first: a wrong one is refused before the peer is asked anything.
    if let Some(refused) = judge_local(config, &local_findings) {
        return refused;
    }
    let side = format!("spec.peers[{}]", config.peer);
    let peer_client = match bounded(timeout, peer.connect()).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return Verdict::of_failure(&side, e.classified()),
        Err(()) => return unanswered(&side, timeout),
    };
    match gather_peer(config, &local_client, &peer_client, local_findings.cluster_id, timeout).await {
        Ok(peer_findings) => judge(config, &local_findings, &peer_findings),
        Err(e) => Verdict::of_failure(&side, peer.classify(e.as_ref(), None)),
    }
}

fn unanswered(side: &str, timeout: Duration) -> Verdict {
    Verdict::Unverified {
        reason: Problem::Unreachable.reason().into(),
        message: format!("{side}: no answer within {timeout:?}"),
    }
}

async fn bounded<T>(timeout: Duration, f: impl Future<Output = T>) -> Result<T, ()> {
    tokio::time::timeout(timeout, f).await.map_err(|_| ())
}

/// A call bounded by the RPC deadline, as an error the classification reads.
async fn call<T>(
    what: &str,
    timeout: Duration,
    f: impl Future<Output = Result<T, etcd_client::Error>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(timeout, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(anyhow::Error::new(e).context(what.to_string())),
        Err(_) => anyhow::bail!("{what}: no answer within {timeout:?}"),
    }
}

fn permission_denied(e: &etcd_client::Error) -> bool {
    e.to_string().contains("permission denied")
}

async fn gather_local(client: &Client, origin: &str, timeout: Duration) -> anyhow::Result<LocalFindings> {
    let owner = keys::owner_key(origin);
    let read = call("read the local etcd", timeout, crate::mirror::target::kv(client).get(owner.as_str(), None)).await;
    let (cluster_id, holds_copy_of_region) = match read {
        Ok(resp) => {
            let holder = resp.kvs().first().map(|kv| {
                crate::mirror::records::checkpoint::Owner::decode(kv.value())
                    .map(|o| o.object.as_ref().map_or(o.owner.clone(), |obj| obj.describe()))
                    .unwrap_or_else(|| "an owner record".to_string())
            });
            (resp.header().map_or(0, |h| h.cluster_id()), holder)
        }
        // A user that may not read the federation's records cannot tell: the worker's own check
        // of the same record (session) then cannot either, and nothing is refused on a guess.
        Err(e) if e.chain().any(|c| c.downcast_ref::<etcd_client::Error>().is_some_and(permission_denied)) => {
            let status = call("local etcd status", timeout, client.clone().status()).await?;
            (status.header().map_or(0, |h| h.cluster_id()), None)
        }
        Err(e) => return Err(e),
    };
    let own_regions = own_regions(client, timeout).await;
    Ok(LocalFindings { cluster_id, holds_copy_of_region: holds_copy_of_region.map(truncate), own_regions })
}

async fn gather_peer(
    config: &MirrorConfig,
    local: &Client,
    peer: &Client,
    local_cluster: u64,
    timeout: Duration,
) -> anyhow::Result<PeerFindings> {
    let records = call("read the mirror's records", timeout, read_records(peer, &config.origin)).await?;
    let mut findings = PeerFindings { cluster_id: records.cluster_id, ..Default::default() };
    if records.cluster_id == local_cluster {
        findings.is_the_origin = same_etcd(local, peer, timeout).await;
        if findings.is_the_origin != Some(false) {
            return Ok(findings);
        }
    }
    // Writes nothing: the compare never holds, but etcd checks the permissions of every op.
    let probe = format!("{}trial-probe", keys::federation_prefix(&config.origin));
    let never = Compare::version(probe.as_str(), CompareOp::Less, 0);
    let copy_key = format!("{}trial-probe", keys::region_prefix(&config.origin));
    let txn = Txn::new().when([never]).and_then([TxnOp::put(probe.as_str(), "", None), TxnOp::put(copy_key, "", None)]);
    match tokio::time::timeout(timeout, crate::mirror::target::kv(peer).txn(txn)).await {
        Ok(Err(e)) if permission_denied(&e) => findings.write_denied = true,
        Ok(Err(e)) => return Err(anyhow::Error::new(e).context("probing the peer's permissions")),
        Err(_) => anyhow::bail!("probing the peer's permissions: no answer within {timeout:?}"),
        Ok(Ok(_)) => {}
    }
    let claimant = Claimant { owner_id: &config.owner_id, object: config.object.as_ref(), peer: &config.peer };
    let decision = decide_ownership(&claimant, &Ownership::default(), records.owner.as_ref());
    if let OwnerDecision::Contested { .. } = &decision {
        let leases: Vec<i64> =
            records.checkpoint.iter().flat_map(|c| c.leases.iter().chain(&c.retiring)).copied().collect();
        if !leases.is_empty() {
            findings.contested_alive = most_ttl_left(peer, &leases, timeout).await.map(|ttl| ttl > 0);
        }
    }
    findings.ownership = Some(decision);
    findings.own_regions = own_regions(peer, timeout).await;
    Ok(findings)
}

/// The regions an etcd is the origin of: those with keys under `/aether/v1/regions/<r>/` and no
/// copy record (`/aether/v1/federation/<r>/owner`). One keys-only read per region found, then one
/// Txn; None when the credentials may not list them (a least-privilege mirror user) or the etcd
/// does not answer.
async fn own_regions(client: &Client, timeout: Duration) -> Option<Vec<String>> {
    let mut local = client.clone();
    let listing = super::inbound::names_under(&mut local, keys::V1_REGIONS_ROOT, MAX_REGIONS_LISTED);
    let found = tokio::time::timeout(timeout, listing).await.ok()?.ok()?;
    if found.is_empty() {
        return Some(found);
    }
    let reads = found.iter().map(|r| TxnOp::get(keys::owner_key(r), Some(GetOptions::new().with_count_only())));
    let txn = Txn::new().and_then(reads.collect::<Vec<_>>());
    let resp = tokio::time::timeout(timeout, crate::mirror::target::kv(client).txn(txn)).await.ok()?.ok()?;
    let copies: Vec<bool> =
        resp.op_responses().into_iter().map(|r| matches!(r, TxnOpResponse::Get(g) if g.count() > 0)).collect();
    Some(found.into_iter().zip(copies).filter(|(_, copy)| !copy).map(|(r, _)| r).collect())
}

/// Strings read from an etcd reach conditions and events bounded.
fn truncate(mut s: String) -> String {
    const MAX: usize = 200;
    if s.len() > MAX {
        let mut cut = MAX;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mirror::records::checkpoint::{Owner, OwningObject};
    use crate::mirror::records::resume::Contest;

    fn config() -> MirrorConfig {
        let mut c = MirrorConfig::new("a", "b", "trial");
        c.object =
            Some(OwningObject { namespace: "fed".into(), name: "a".into(), uid: "u1".into(), cluster: String::new() });
        c
    }

    fn local() -> LocalFindings {
        LocalFindings { cluster_id: 1, holds_copy_of_region: None, own_regions: Some(vec!["a".into()]) }
    }

    fn peer() -> PeerFindings {
        PeerFindings {
            cluster_id: 2,
            ownership: Some(OwnerDecision::Take { generation: 1, restored: false }),
            own_regions: Some(vec!["b".into()]),
            ..Default::default()
        }
    }

    fn reason(v: Verdict) -> String {
        match v {
            Verdict::Refused { reason, .. } => reason,
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn the_right_etcds_verify() {
        assert_eq!(judge(&config(), &local(), &peer()), Verdict::Verified);
        // Regions not listable (a least-privilege user), or an empty etcd: nothing to say.
        let unknown = LocalFindings { own_regions: None, ..local() };
        let empty = PeerFindings { own_regions: Some(vec![]), ..peer() };
        assert_eq!(judge(&config(), &unknown, &empty), Verdict::Verified);
        // A peer bootstrapped like the origin (same cluster id) but another etcd.
        let twin = PeerFindings { cluster_id: 1, is_the_origin: Some(false), ..peer() };
        assert_eq!(judge(&config(), &local(), &twin), Verdict::Verified);
    }

    #[test]
    fn a_local_etcd_holding_the_regions_copy_or_another_regions_subtree_is_refused() {
        let copy = LocalFindings { holds_copy_of_region: Some("RegionPeering fed/a".into()), ..local() };
        let v = judge(&config(), &copy, &peer());
        assert_eq!(reason(v.clone()), "LocalEtcdHoldsCopy");
        let Verdict::Refused { message, .. } = v else { unreachable!() };
        assert!(message.contains("spec.localEtcd") && message.contains("point spec.localEtcd back"), "{message}");
        let other = LocalFindings { own_regions: Some(vec!["c".into()]), ..local() };
        assert_eq!(reason(judge(&config(), &other, &peer())), "LocalEtcdOfAnotherRegion");
    }

    #[test]
    fn a_peer_that_is_the_origin_another_region_or_a_second_name_is_refused() {
        let itself = PeerFindings { cluster_id: 1, is_the_origin: Some(true), ..peer() };
        assert_eq!(reason(judge(&config(), &local(), &itself)), "PeerIsOrigin");
        let unanswered = PeerFindings { cluster_id: 1, is_the_origin: None, ..peer() };
        assert_eq!(reason(judge(&config(), &local(), &unanswered)), "PeerIsOrigin", "refusing is safe");
        let c = PeerFindings { own_regions: Some(vec!["c".into()]), ..peer() };
        let v = judge(&config(), &local(), &c);
        assert!(matches!(&v, Verdict::Refused { message, .. } if message.contains("origin of region(s) c")), "{v:?}");
        let twice = PeerFindings {
            ownership: Some(OwnerDecision::Contested {
                contest: Contest::DuplicatePeer { other_peer: "c".into() },
                generation: 2,
            }),
            ..peer()
        };
        assert_eq!(reason(judge(&config(), &local(), &twice)), "DuplicatePeer");
        let denied = PeerFindings { write_denied: true, ..peer() };
        assert_eq!(reason(judge(&config(), &local(), &denied)), "PermissionDenied");
    }

    #[test]
    fn another_claim_is_refused_while_its_leases_live() {
        let owner = Owner { owner: "x".into(), ..Default::default() };
        let contested = |alive| PeerFindings {
            ownership: Some(OwnerDecision::Contested {
                contest: Contest::DuplicateOrigin { owner: owner.clone() },
                generation: 2,
            }),
            contested_alive: alive,
            ..peer()
        };
        assert_eq!(reason(judge(&config(), &local(), &contested(Some(true)))), "DuplicateOrigin");
        assert_eq!(reason(judge(&config(), &local(), &contested(None))), "DuplicateOrigin", "not known: alive");
        assert_eq!(judge(&config(), &local(), &contested(Some(false))), Verdict::Verified);
    }

    #[test]
    fn failures_of_the_configuration_are_refused_and_silence_is_not() {
        let c = |problem| Classified { problem, message: "m".into() };
        assert!(matches!(Verdict::of_failure("x", c(Problem::TlsUntrusted)), Verdict::Refused { .. }));
        assert!(matches!(Verdict::of_failure("x", c(Problem::AuthenticationFailed)), Verdict::Refused { .. }));
        assert!(matches!(Verdict::of_failure("x", c(Problem::Unreachable)), Verdict::Unverified { .. }));
        assert!(matches!(Verdict::of_failure("x", c(Problem::NoSpace)), Verdict::Unverified { .. }));
    }

    #[test]
    fn strings_read_from_an_etcd_are_bounded() {
        assert_eq!(truncate("short".into()), "short");
        let long = truncate("é".repeat(300));
        assert!(long.len() <= 204 && long.ends_with('…'), "{}", long.len());
    }
}
