//! What a session runs against the origin and the peer: [`sync`] (the full sync), [`watch`]
//! (watching and applying whole revisions, with continuous verification between batches),
//! [`split`] (splitting an overfull lease shard beside the watch), and [`apply`] (the fenced Txn
//! every write goes through), [`catch_up`] (a resumed watch coalescing what the peer may already
//! hold) and [`spread`] (the peer's connections their Txns spread over).
pub(in crate::mirror) mod apply;
pub(in crate::mirror) mod catch_up;
pub(in crate::mirror) mod split;
pub(in crate::mirror) mod spread;
pub(in crate::mirror) mod sync;
pub(in crate::mirror) mod watch;
