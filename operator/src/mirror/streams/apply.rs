//! The fenced batch Txn every write of the mirror goes through: it applies only while the owner
//! record still holds this session's epoch, so neither a deposed worker nor a late Txn of an
//! earlier session can interleave with the current writer. Also the progress record's raise and
//! the checkpoint's planned writes, both fenced the same way.
use crate::keys;
use crate::mirror::context::Worker;
use crate::mirror::plan::MirrorOp;
use crate::mirror::records::checkpoint::{CheckpointWrite, Owner};
use anyhow::Context;
use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};
use std::future::Future;

/// The outcome of one batch Txn.
pub(in crate::mirror) enum Applied {
    Yes,
    Fenced(String),
}

impl Worker {
    /// The progress record raised to `revision`, never lowered: a nested Txn that writes it only
    /// over a lower record (or none). Watch batches in flight together may land in any order;
    /// each carries a revision the peer held completely when it was sent, and the keys the peer
    /// holds at that revision.
    pub(in crate::mirror) fn raise_progress_op(&self, revision: i64, sent_through: i64, keys: i64) -> TxnOp {
        let key = keys::progress_key(&self.config.origin);
        let value = self.progress_value(revision, sent_through, keys);
        let put = || TxnOp::put(key.as_str(), value.clone(), None);
        let absent = Txn::new().when([Compare::version(key.as_str(), CompareOp::Equal, 0)]).and_then([put()]);
        TxnOp::txn(
            Txn::new()
                .when([Compare::value(key.as_str(), CompareOp::Less, value.clone())])
                .and_then([put()])
                .or_else([TxnOp::txn(absent)]),
        )
    }

    /// One batch Txn: `ops` (each put on its shard's lease) and `bookkeeping`, applied only while
    /// the owner key still has this session's epoch, so that neither a deposed worker nor a late
    /// Txn of this worker's own earlier session can interleave with the current writer.
    pub(in crate::mirror) fn apply(
        &self,
        peer: &Client,
        epoch: i64,
        ops: Vec<MirrorOp>,
        leases: &[i64],
        bookkeeping: Vec<TxnOp>,
    ) -> impl Future<Output = anyhow::Result<Applied>> + Send + 'static {
        let owner_key = keys::owner_key(&self.config.origin);
        let mut txn_ops: Vec<TxnOp> = ops
            .into_iter()
            .map(|op| match op {
                MirrorOp::Put { key, value, shard } => {
                    TxnOp::put(key, value, Some(PutOptions::new().with_lease(leases[shard])))
                }
                MirrorOp::Delete { key } => TxnOp::delete(key, None),
            })
            .collect();
        txn_ops.extend(bookkeeping);
        let fence = Compare::mod_revision(owner_key.as_str(), CompareOp::Equal, epoch);
        let txn = Txn::new().when([fence]).and_then(txn_ops).or_else([TxnOp::get(owner_key.as_str(), None)]);
        let timeout = self.config.rpc_timeout;
        let shared = self.shared.clone();
        let mut kv = crate::mirror::target::kv(peer);
        async move {
            let resp = match tokio::time::timeout(timeout, kv.txn(txn)).await {
                Err(_) => anyhow::bail!("peer txn: timed out after {timeout:?}"),
                Ok(r) => r.context("peer txn")?,
            };
            shared.detector_success();
            if resp.succeeded() {
                return Ok(Applied::Yes);
            }
            Ok(Applied::Fenced(owner_of(&resp).1))
        }
    }
}

impl Worker {
    /// Writes a checkpoint as planned: the Txns that come first (parts under a new id), then the
    /// commit with `bookkeeping`; each fenced like every batch. Stops at the first fenced one.
    pub(in crate::mirror) fn apply_checkpoint(
        &self,
        peer: &Client,
        epoch: i64,
        write: CheckpointWrite,
        mut bookkeeping: Vec<TxnOp>,
    ) -> impl Future<Output = anyhow::Result<Applied>> + Send + 'static {
        let before: Vec<_> = write
            .before
            .into_iter()
            .map(|txn| self.apply(peer, epoch, Vec::new(), &[], crate::mirror::records::store::txn_ops(txn)))
            .collect();
        bookkeeping.extend(crate::mirror::records::store::txn_ops(write.commit));
        let commit = self.apply(peer, epoch, Vec::new(), &[], bookkeeping);
        async move {
            for txn in before {
                if let Applied::Fenced(by) = txn.await? {
                    return Ok(Applied::Fenced(by));
                }
            }
            commit.await
        }
    }
}

/// The owner record's mod revision and owner from a fenced Txn's failure branch (revision 0
/// when the owner key is gone).
pub(in crate::mirror) fn owner_of(resp: &etcd_client::TxnResponse) -> (i64, String) {
    resp.op_responses()
        .into_iter()
        .find_map(|r| match r {
            TxnOpResponse::Get(get) => get.kvs().first().map(|kv| {
                let owner = Owner::decode(kv.value()).map_or_else(|| "unknown".to_string(), |o| o.owner);
                (kv.mod_revision(), owner)
            }),
            _ => None,
        })
        .unwrap_or_else(|| (0, "nobody (the owner key was deleted)".to_string()))
}
