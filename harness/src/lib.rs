//! Real parts on loopback for the tests, the demo and the benchmarks: etcd servers and clusters
//! (plaintext or TLS), a fault proxy to put a cross-region network between them, and
//! kube-apiservers, each on free 127.0.0.1 ports with its own temporary directory. Everything is
//! stopped and removed on drop, also when a test panics (and then the servers' logs are printed).

mod apiserver;
mod cluster;
mod etcd;
pub mod https;
mod kube_setup;
mod pki;
mod process;
mod proxy;
mod region;
mod sockets;
mod tools;

pub use apiserver::{KubeApiserver, client_from_kubeconfig};
pub use cluster::{ClusterOptions, EtcdCluster};
pub use etcd::{EtcdFlavor, EtcdServer, ServerTls};
pub use kube_setup::{ensure_namespace, install_crds};
pub use pki::{CertFiles, Pki};
pub use process::{Managed as ManagedProcess, free_port, wait_until};
pub use proxy::{FaultProxy, Faults};
pub use region::Region;
pub use sockets::{Established, established_connections};
pub use tools::{tool_path, tools_bin_dir};

/// How long a server may take to become ready before the harness gives up.
pub const STARTUP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);
