//! Reading and writing the checkpoint on a peer, whole or in parts (the plan is
//! `checkpoint::plan_write`; this is its thin IO).
use crate::keys;
use crate::mirror::records::checkpoint::{Checkpoint, Owner, Progress, RecordOp, Stored};
use crate::mirror::records::resume::OwnerRecord;
use anyhow::Context;
use etcd_client::{Client, DeleteOptions, GetOptions, KvClient, Txn, TxnOp, TxnOpResponse};

/// The peer's records for this origin, read together in one Txn.
pub struct Records {
    pub owner: Option<OwnerRecord>,
    pub checkpoint: Option<Checkpoint>,
    /// How the peer stores the checkpoint (whole or in parts).
    pub stored: Stored,
    pub progress: Option<Progress>,
    /// The peer's revision when they were read.
    pub revision: i64,
    /// The peer etcd's cluster id.
    pub cluster_id: u64,
    /// Whether the peer holds no key of the origin's copy: without a checkpoint, no lease a key
    /// sits on has to be looked for before anything else (a round trip less for a new mirror).
    pub copy_empty: bool,
    /// Where the last sync's origin pages ended (`keys::page_ends_key`); empty when unknown.
    pub page_ends: Vec<Vec<u8>>,
}

/// The owner, checkpoint and progress records, whether the peer holds any key of the origin's
/// copy, and the last sync's page ends, read at one revision.
pub async fn read_records(peer: &Client, origin: &str) -> Result<Records, etcd_client::Error> {
    let copy = keys::region_prefix(origin);
    let any_key = GetOptions::new().with_range(keys::prefix_range_end(copy.as_bytes())).with_keys_only().with_limit(1);
    let txn = Txn::new().and_then([
        TxnOp::get(keys::owner_key(origin), None),
        TxnOp::get(keys::checkpoint_key(origin), None),
        TxnOp::get(keys::progress_key(origin), None),
        TxnOp::get(copy, Some(any_key)),
        TxnOp::get(keys::page_ends_key(origin), None),
    ]);
    let mut kv = crate::mirror::target::kv(peer);
    let resp = kv.txn(txn).await?;
    let revision = resp.header().map_or(0, |h| h.revision());
    let cluster_id = resp.header().map_or(0, |h| h.cluster_id());
    let mut gets = resp.op_responses().into_iter().map(|r| match r {
        TxnOpResponse::Get(get) => get.kvs().first().map(|kv| (kv.mod_revision(), kv.value().to_vec())),
        _ => None,
    });
    let (owner, checkpoint, progress) = (gets.next().flatten(), gets.next().flatten(), gets.next().flatten());
    // A peer that answered without the fourth read counts as holding keys: they are looked for.
    let copy_empty = matches!(gets.next(), Some(None));
    let page_ends = gets.next().flatten().and_then(|(_, v)| crate::mirror::verify::decode_page_ends(&v));
    let header = checkpoint.and_then(|(_, v)| Checkpoint::decode(&v));
    let (checkpoint, stored) = complete(&mut kv, origin, header, revision).await?;
    Ok(Records {
        owner: owner.map(|(mod_revision, value)| OwnerRecord { mod_revision, owner: Owner::decode(&value) }),
        checkpoint,
        stored,
        progress: progress.and_then(|(_, v)| Progress::decode(&v)),
        revision,
        cluster_id,
        copy_empty,
        page_ends: page_ends.unwrap_or_default(),
    })
}

/// The peer's checkpoint for `origin`, with its parts; None when there is none or it is damaged.
pub async fn read_checkpoint(client: &Client, origin: &str) -> anyhow::Result<Option<Checkpoint>> {
    let mut kv = crate::mirror::target::kv(client);
    let resp = kv.get(keys::checkpoint_key(origin), None).await.context("reading the checkpoint")?;
    let revision = resp.header().map_or(0, |h| h.revision());
    let header = resp.kvs().first().and_then(|kv| Checkpoint::decode(kv.value()));
    Ok(complete(&mut kv, origin, header, revision).await.context("reading the checkpoint's parts")?.0)
}

/// Completes a checkpoint record read at `revision` with its parts, read at the same revision so
/// that they belong to that record. Also says how the peer stores it.
pub async fn complete(
    kv: &mut KvClient,
    origin: &str,
    header: Option<Checkpoint>,
    revision: i64,
) -> Result<(Option<Checkpoint>, Stored), etcd_client::Error> {
    let Some(header) = header else { return Ok((None, Stored::Unknown)) };
    let Some(parts) = header.parts else { return Ok((Some(header), Stored::Whole)) };
    let (from, to) = crate::mirror::records::checkpoint::parts_range(origin, parts);
    let resp = kv.get(from, Some(GetOptions::new().with_range(to).with_revision(revision))).await?;
    let values: Vec<&[u8]> = resp.kvs().iter().map(|kv| kv.value()).collect();
    let stored = Stored::read(Some(parts), &values);
    Ok((header.assemble(&values), stored))
}

/// The Txn ops of planned record writes.
pub fn txn_ops(ops: Vec<RecordOp>) -> Vec<TxnOp> {
    ops.into_iter()
        .map(|op| match op {
            RecordOp::Put { key, value } => TxnOp::put(key, value, None),
            RecordOp::Delete { from, to } => TxnOp::delete(from, Some(DeleteOptions::new().with_range(to))),
        })
        .collect()
}
