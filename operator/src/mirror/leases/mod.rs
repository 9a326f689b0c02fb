//! The origin-heartbeat leases: [`keeper`] renews every lease of the mirror on the peer (IO), and
//! [`shards`] places each key on one of them (pure).
pub mod keeper;
pub mod renewal;
pub mod rpc;
pub mod shards;
