//! The aether region federation operator.
//!
//! - [`keys`]: the registry key schema (v1 origin-first, v0 legacy).
//! - [`api`]: the `RegionPeering` and `RegistrySchema` CRDs.
//! - [`mirror`]: the data plane: per-peer mirror workers with origin-heartbeat leases.
//! - [`drain`]: the v0 -> v1 re-key drain.
//! - [`controllers`]: the Kubernetes reconcilers and leader election.

pub mod api;
pub mod chart_values;
pub mod cli;
pub mod controllers;
pub mod drain;
pub mod faults;
pub mod http;
pub mod keys;
pub mod manifests;
pub mod metrics;
pub mod mirror;
pub mod preflight;
pub mod supervise;
