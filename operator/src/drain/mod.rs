//! The v0 -> v1 drain: re-keys the legacy flat registry into the origin-first layout, losslessly
//! while not-yet-upgraded registrars keep writing legacy keys.
//!
//! - [`plan`]: what to do with each legacy key, the phases, the counters and the progress record
//!   (pure).
//! - [`lock`]: one drain per legacy prefix per etcd, fenced.
//! - [`run`]: the IO: copy pinned at a revision, forward legacy writes from a watch, and delete
//!   the legacy keys (each with a compare on its mod revision) once the prefix has been quiet.

pub mod lock;
pub mod plan;
pub mod run;

pub use lock::Held;
pub use plan::{Decision, DrainPhase, DrainRecord, DrainReport};
pub use run::{DrainSettings, drain};
