//! Retiring an origin's mirror from one peer when its RegionPeering is deleted (its worker is
//! stopped first). Fenced on the owner record as read, so a successor that took the mirror over
//! meanwhile is never touched.
//!
//! - `Lapse`: nothing is deleted now. The bookkeeping records (checkpoint, progress, canary) are
//!   attached to one of the mirror's leases, so they lapse with the mirrored keys within the TTL
//!   instead of staying on the peer forever.
//! - `Delete`: the mirrored subtree and the bookkeeping are deleted at once.
//!
//! Either way the owner record becomes a tombstone that stays: a worker that owned the mirror
//! and still runs somewhere (a deposed leader standing by) sees it and never takes the mirror
//! back; only a new RegionPeering's worker may.
//!
//! Only what the deleted object owns is retired: a record naming another object (the live
//! owner of a region whose duplicate was refused and is now deleted), or none (a record of an
//! earlier version), is left alone, and so is everything it owns.
use crate::keys;
use crate::mirror::EtcdTarget;
use crate::mirror::records::checkpoint::{Checkpoint, Owner, OwningObject};
use anyhow::Context;
use etcd_client::{Compare, CompareOp, DeleteOptions, PutOptions, Txn, TxnOp, TxnOpResponse};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetirePolicy {
    Lapse,
    Delete,
}

/// What retiring did on one peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Retired {
    /// The bookkeeping now lapses with the mirror (on this lease).
    Leased(i64),
    /// No lease of the mirror was alive: the bookkeeping was deleted.
    BookkeepingDeleted,
    /// The subtree and the bookkeeping were deleted.
    Deleted { keys: i64 },
    /// Another worker owns the mirror now: left alone.
    OwnedByAnother,
    /// The mirror is another object's (or its owner record names none): left alone.
    NotOurs { owner: String },
}

/// Retires `object`'s mirror of `origin` from one peer. Another worker of the same object may
/// take the mirror over between the read and the write (a deposed leader standing by, seeing its
/// successor stop): the owner record is then read again, a few times.
pub async fn retire(
    peer: &EtcdTarget,
    origin: &str,
    policy: RetirePolicy,
    object: &OwningObject,
) -> anyhow::Result<Retired> {
    let mut client = peer.connect().await.context("connecting to the peer")?;
    let mut outcome = Retired::OwnedByAnother;
    for _ in 0..3 {
        outcome = retire_once(&mut client, origin, policy, object).await?;
        if outcome != Retired::OwnedByAnother {
            break;
        }
    }
    Ok(outcome)
}

async fn retire_once(
    client: &mut etcd_client::Client,
    origin: &str,
    policy: RetirePolicy,
    object: &OwningObject,
) -> anyhow::Result<Retired> {
    let owner_key = keys::owner_key(origin);
    let read = client
        .txn(
            Txn::new().and_then([TxnOp::get(owner_key.as_str(), None), TxnOp::get(keys::checkpoint_key(origin), None)]),
        )
        .await
        .context("reading the mirror's records")?;
    let mut gets = read.op_responses().into_iter().map(|r| match r {
        TxnOpResponse::Get(g) => g.kvs().first().map(|kv| (kv.mod_revision(), kv.value().to_vec())),
        _ => None,
    });
    let (owner, checkpoint) = (gets.next().flatten(), gets.next().flatten());
    drop(gets);
    let recorded = owner.as_ref().and_then(|(_, v)| Owner::decode(v));
    if let Some(not_ours) = whose(owner.is_some(), recorded.as_ref(), object) {
        return Ok(not_ours);
    }
    let fence = match &owner {
        Some((mod_revision, _)) => Compare::mod_revision(owner_key.as_str(), CompareOp::Equal, *mod_revision),
        None => Compare::version(owner_key.as_str(), CompareOp::Equal, 0),
    };
    let generation = recorded.map_or(0, |o| o.generation);
    let tombstone = Owner {
        owner: "retired".into(),
        acquired_at: k8s_openapi::jiff::Timestamp::now().to_string(),
        generation: generation + 1,
        retired: true,
        object: Some(object.clone()),
        ..Default::default()
    };
    let (mut ops, lapse_lease) = match policy {
        RetirePolicy::Delete => {
            let mut ops = vec![TxnOp::delete(keys::region_prefix(origin), Some(DeleteOptions::new().with_prefix()))];
            ops.extend(bookkeeping_but_owner(origin));
            (ops, None)
        }
        RetirePolicy::Lapse => {
            let checkpoint = checkpoint.as_ref().and_then(|(_, v)| Checkpoint::decode(v));
            let revision = read.header().map_or(0, |h| h.revision());
            lapse_ops(client, origin, checkpoint, revision).await?
        }
    };
    ops.push(TxnOp::put(owner_key.as_str(), tombstone.encode(), None));
    let resp = client.txn(Txn::new().when([fence]).and_then(ops)).await.context("retiring the mirror")?;
    if !resp.succeeded() {
        return Ok(Retired::OwnedByAnother);
    }
    Ok(match policy {
        RetirePolicy::Delete => {
            let keys = resp
                .op_responses()
                .into_iter()
                .find_map(|r| match r {
                    TxnOpResponse::Delete(d) => Some(d.deleted()),
                    _ => None,
                })
                .unwrap_or(0);
            Retired::Deleted { keys }
        }
        RetirePolicy::Lapse => lapse_lease.map_or(Retired::BookkeepingDeleted, Retired::Leased),
    })
}

/// Whose the records are: None when they name `object`, else who else owns them (pure). Only
/// records that name the object retiring are retired.
fn whose(owner_found: bool, recorded: Option<&Owner>, object: &OwningObject) -> Option<Retired> {
    match recorded.and_then(|o| o.object.as_ref()) {
        Some(o) if o.uid == object.uid => None,
        Some(other) => Some(Retired::NotOurs { owner: other.describe() }),
        None if !owner_found => Some(Retired::NotOurs { owner: "nobody".into() }),
        None => {
            let name = recorded.map_or_else(|| "an unreadable owner record".to_string(), |o| o.owner.clone());
            Some(Retired::NotOurs { owner: format!("{name} (a record that names no object)") })
        }
    }
}

/// Deletes everything of the bookkeeping but the owner record, which becomes the tombstone.
fn bookkeeping_but_owner(origin: &str) -> Vec<TxnOp> {
    let owner_key = keys::owner_key(origin);
    let federation = keys::federation_prefix(origin);
    let federation_end = keys::prefix_range_end(federation.as_bytes());
    let mut after_owner = owner_key.clone().into_bytes();
    after_owner.push(0);
    vec![
        TxnOp::delete(federation.as_str(), Some(DeleteOptions::new().with_range(owner_key.as_str()))),
        TxnOp::delete(after_owner, Some(DeleteOptions::new().with_range(federation_end))),
    ]
}

/// The ops that let the copy lapse: the bookkeeping moved onto a lease still alive (so that it
/// lapses with the keys), or deleted when none is. Returns the lease, if one is alive.
async fn lapse_ops(
    client: &mut etcd_client::Client,
    origin: &str,
    checkpoint: Option<Checkpoint>,
    revision: i64,
) -> anyhow::Result<(Vec<TxnOp>, Option<i64>)> {
    let (checkpoint, _) =
        crate::mirror::records::store::complete(&mut crate::mirror::target::kv(client), origin, checkpoint, revision)
            .await
            .context("reading the checkpoint's parts")?;
    let leases = checkpoint.map(|c| c.leases).unwrap_or_default();
    let mut alive = None;
    for id in leases.into_iter().filter(|id| *id != 0) {
        if client.lease_time_to_live(id, None).await.is_ok_and(|r| r.ttl() > 0) {
            alive = Some(id);
            break;
        }
    }
    let Some(lease) = alive else { return Ok((bookkeeping_but_owner(origin), None)) };
    let federation = keys::federation_prefix(origin);
    let owner_key = keys::owner_key(origin);
    let records = client
        .get(federation.as_str(), Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .context("reading the bookkeeping")?;
    // The checkpoint's parts go now: the record naming them lapses with the rest, and there may
    // be more of them than one Txn takes.
    let parts = keys::checkpoint_parts_prefix(origin);
    let mut ops: Vec<TxnOp> = records
        .kvs()
        .iter()
        .filter(|kv| !kv.key().starts_with(parts.as_bytes()) && kv.key() != owner_key.as_bytes())
        .map(|kv| TxnOp::put(kv.key(), kv.value(), Some(PutOptions::new().with_lease(lease))))
        .collect();
    ops.push(TxnOp::delete(parts.as_str(), Some(DeleteOptions::new().with_prefix())));
    Ok((ops, Some(lease)))
}
