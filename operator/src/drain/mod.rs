//! The v0 -> v1 drain: re-keys the legacy flat registry into the origin-first layout, losslessly
//! while not-yet-upgraded registrars keep writing legacy keys.
//!
//! - [`plan`]: what to do with each legacy key, the phases and the counters (pure).
//! - [`run`]: the IO: copy pinned at a revision, forward legacy writes from a watch, and delete
//!   the legacy keys (each with a compare on its mod revision) once the prefix has been quiet.

pub mod plan;
pub mod run;

pub use plan::{Decision, DrainPhase, DrainReport};
pub use run::{DrainSettings, drain};
