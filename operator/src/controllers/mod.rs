//! The Kubernetes side: reconcilers for `RegionPeering` and `RegistrySchema`, leader election,
//! and the pure pieces they are built from.
//!
//! - [`region_peering`]: spec -> mirror workers; health -> status, events, metrics.
//! - [`status`]: conditions and status from the workers' health (pure).
//! - [`plan`]: spec changes -> worker changes; region claims (pure).
//! - [`etcd_access`]: connection + Secret -> something to dial (pure).
//! - [`leader`]: one leader per region, on a coordination.k8s.io Lease.

pub mod etcd_access;
pub mod leader;
pub mod plan;
pub mod region_peering;
pub mod registry_schema;
pub mod status;
