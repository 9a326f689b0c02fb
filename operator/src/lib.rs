//! The aether region federation operator.
//!
//! - [`keys`]: the registry key schema (v1 origin-first, v0 legacy).
//! - [`api`]: the `RegionPeering` and `RegistrySchema` CRDs.

pub mod api;
pub mod keys;
pub mod mirror;
