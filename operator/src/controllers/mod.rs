//! The Kubernetes side: reconcilers for `RegionPeering` and `RegistrySchema`, leader election,
//! and the pure pieces they are built from.
//!
//! - [`region_peering`]: reads Secrets, claims and workers; decides ([`plan`]); starts and stops
//!   mirror workers; reports status, events and metrics.
//! - [`plan`]: what a reconcile decides: which workers run, which claim wins (pure).
//! - [`status`]: conditions and status from the workers' health (pure).
//! - [`registry_schema`]: runs each RegistrySchema's drain and reports its progress.
//! - [`schema_status`]: a RegistrySchema's phase and conditions from the drain's report (pure).
//! - [`trials`]: each peer's configuration tried beside its running worker before it replaces
//!   it (verify, then switch).
//! - [`etcd_access`]: connection + Secret -> something to dial (pure).
//! - [`leader`]: one leader per region, on a coordination.k8s.io Lease.

pub mod etcd_access;
pub mod leader;
pub mod plan;
pub mod region_peering;
pub mod registry_schema;
pub mod schema_status;
pub mod status;
pub mod trials;
