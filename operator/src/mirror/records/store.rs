//! Reading and writing the checkpoint on a peer, whole or in parts (the plan is
//! `checkpoint::plan_write`; this is its thin IO).
use super::checkpoint::{Checkpoint, RecordOp, Stored};
use crate::keys;
use anyhow::Context;
use etcd_client::{Client, DeleteOptions, GetOptions, KvClient, TxnOp};

/// The peer's checkpoint for `origin`, with its parts; None when there is none or it is damaged.
pub async fn read_checkpoint(client: &Client, origin: &str) -> anyhow::Result<Option<Checkpoint>> {
    let mut kv = super::target::kv(client);
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
    let (from, to) = super::checkpoint::parts_range(origin, parts);
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
