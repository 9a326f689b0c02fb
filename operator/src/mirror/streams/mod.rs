//! What a session runs against the origin and the peer: [`sync`] (the full sync), [`watch`]
//! (watching and applying whole revisions, with continuous verification between batches),
//! [`split`] (splitting an overfull lease shard beside the watch), and [`apply`] (the fenced Txn
//! every write goes through), [`pipeline`] (the watch's decisions, without IO: what to send, when
//! a Txn counts as landed, what a failure does to its keys), [`catch_up`] (a resumed watch
//! coalescing what the peer may already hold), [`pace`] (how many of the sync's Txns a peer's
//! queue allows in flight) and [`spread`] (the peer's connections their Txns spread over).
pub(in crate::mirror) mod apply;
pub(in crate::mirror) mod catch_up;
pub(in crate::mirror) mod pace;
pub(in crate::mirror) mod pipeline;
pub(in crate::mirror) mod split;
pub(in crate::mirror) mod spread;
pub(in crate::mirror) mod sync;
pub(in crate::mirror) mod watch;
