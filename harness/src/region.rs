//! One region as the operator sees it: a kube-apiserver (with its own etcd) and the region's
//! registry etcd, which the mirror reads from and writes into.
use crate::{EtcdServer, KubeApiserver};

pub struct Region {
    pub name: String,
    pub apiserver: KubeApiserver,
    pub registry: EtcdServer,
}

impl Region {
    pub async fn start(name: &str) -> anyhow::Result<Self> {
        let registry_name = format!("{name}-registry");
        let (apiserver, registry) = tokio::try_join!(KubeApiserver::start(name), EtcdServer::start(&registry_name))?;
        Ok(Region { name: name.to_string(), apiserver, registry })
    }
}
