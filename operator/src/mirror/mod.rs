//! The data plane: one worker per (origin region, peer region) pair mirrors the origin's subtree
//! into the peer's etcd under origin-heartbeat leases. No Kubernetes in here.
//!
//! Read it top-down; each layer imports only the layers below it:
//!
//! 1. [`worker`]: the worker's life across sessions: backoff, standing by when fenced.
//! 2. [`session`]: one session: the peer's records first, their leases kept alive, then the
//!    origin, ownership (the fencing epoch) and where to resume.
//! 3. [`streams`]: what a session runs: the full sync, the watch, online shard splits and
//!    continuous verification, every write through one fenced Txn (`streams::apply`).
//! 4. `context`: the worker's context and the state it keeps across sessions.
//! 5. [`leases`]: the origin-heartbeat leases: the keeper that renews them and the shard layout
//!    that places keys on them. [`records`]: what a worker keeps on the peer (owner, checkpoint,
//!    progress): their formats and plans (pure), reading and writing them, and how a session
//!    resumes from them (pure).
//! 6. Pure decisions and small parts: [`plan`] (the sync diff, batching, Txn packing), [`verify`],
//!    [`health`], [`detector`], [`backoff`], [`sync_slots`] (an origin's workers take turns at
//!    full syncs), [`origin_reads`] (the syncs running at once read the origin once) and
//!    [`target`] (reaching an etcd with a member down).
//! 7. `shared`: what a worker's parts share while it runs (health, events, the detector).
//!
//! Beside the worker, for the controllers: [`retire`] (what deleting a RegionPeering does on each
//! peer) and [`inbound`] (what other regions mirror into the local etcd, read-only).

pub mod backoff;
mod config;
mod context;
pub mod detector;
pub mod health;
pub mod inbound;
pub mod leases;
pub mod memory;
pub mod origin_reads;
pub mod plan;
pub mod problem;
pub mod records;
pub mod retire;
mod session;
mod shared;
mod streams;
pub mod sync_slots;
pub mod target;
pub mod trial;
pub mod verify;
pub mod worker;

pub use config::{DEFAULT_MAX_RESYNC_DELETE_PERCENT, DEFAULT_VERIFY_KEYS_PER_SECOND, MirrorConfig};
pub use health::{MirrorEvent, PeerHealth, Phase, Refusal, RenewalShortfall, ResyncCause};
pub use memory::MemoryBudget;
pub use origin_reads::OriginReads;
pub use records::checkpoint::OwningObject;
pub use sync_slots::{FULL_SYNCS_AT_ONCE, SyncSlots};
pub use target::EtcdTarget;
pub use verify::VerifyBudget;
pub use worker::{MirrorHandle, spawn};
