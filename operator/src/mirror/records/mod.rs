//! What a worker keeps on the peer, outside `regions/`: the owner record (its mod revision is the
//! fencing epoch), the checkpoint (the lease layout) and the progress record (the revision the
//! peer holds). [`checkpoint`] has their formats and how to write them (pure), [`store`] reads
//! and writes them, [`resume`] decides from them how a session starts (pure).
pub mod checkpoint;
pub mod resume;
pub mod store;

pub use store::read_checkpoint;
