//! Every way an etcd refuses the mirror, against real etcd servers: each failure is reported with
//! a reason a person can act on (the condition reason), and a message that names the endpoint and
//! the Secret the credentials come from and says what to do, never a Debug dump.
mod support;

use aether_harness::{CertFiles, ClusterOptions, EtcdCluster, EtcdServer, Pki, free_port};
use aether_operator::mirror::{EtcdTarget, Phase};
use etcd_client::{Certificate, Identity, TlsOptions};
use support::etcd::*;
use support::mirror::*;

const SECRET: &str = "Secret aether-system/b-etcd";

fn identity(files: &CertFiles) -> (Identity, Vec<u8>) {
    let cert = std::fs::read(&files.cert).unwrap();
    (Identity::from_pem(cert.clone(), std::fs::read(&files.key).unwrap()), cert)
}

/// A target for `cluster` trusting `ca`, with `client` as its certificate (or none).
fn tls_target(cluster: &EtcdCluster, ca: &[u8], client: Option<&CertFiles>) -> EtcdTarget {
    let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(ca));
    let mut target = EtcdTarget::plain(cluster.endpoints()).with_credentials_from(SECRET);
    if let Some(files) = client {
        let (id, cert) = identity(files);
        tls = tls.identity(id);
        target = target.with_client_certificate(&cert);
    }
    target.with_tls(tls)
}

/// Starts a worker from a healthy origin into `peer` and waits until its failures say `reason`.
async fn reported(origin: &EtcdServer, peer: EtcdTarget, reason: &str) -> String {
    let (handle, _events) = start(fast_config("w1"), EtcdTarget::plain([origin.endpoint()]), peer);
    wait_health(&handle, &format!("a failure reported as {reason}"), |h| {
        h.phase == Phase::Backoff && h.last_error_reason == Some(reason)
    })
    .await;
    let message = handle.health().last_error.unwrap_or_default();
    handle.shutdown().await;
    for dump in ["Status {", "tonic::transport", "ConnectError(", "Os {", "InvalidArgs"] {
        assert!(!message.contains(dump), "{reason}: a Debug dump in {message:?}");
    }
    message
}

#[tokio::test]
async fn each_refusal_of_a_tls_etcd_is_reported_with_what_to_do() {
    let origin = EtcdServer::start("a").await.unwrap();
    let cluster = EtcdCluster::start_with("b", ClusterOptions::new(1).with_tls()).await.unwrap();
    let ca = std::fs::read(cluster.ca_cert().unwrap()).unwrap();
    let good = cluster.client_cert("root").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let stranger = Pki::new(dir.path()).unwrap();
    let stranger_ca = std::fs::read(&stranger.ca_cert).unwrap();
    let endpoint = cluster.endpoints()[0].clone();

    let untrusted_server = reported(&origin, tls_target(&cluster, &stranger_ca, Some(&good)), "TLSUntrusted").await;
    assert!(untrusted_server.contains(&endpoint) && untrusted_server.contains(SECRET), "{untrusted_server}");
    assert!(untrusted_server.contains("ca.crt"), "{untrusted_server}");

    let foreign = stranger.client("foreign", "root", &[]).unwrap();
    let untrusted_client = reported(&origin, tls_target(&cluster, &ca, Some(&foreign)), "TLSUntrusted").await;
    assert!(untrusted_client.contains("refused the client certificate") && untrusted_client.contains(SECRET));

    let expired = cluster.expired_client_cert("root").unwrap();
    let expiry = reported(&origin, tls_target(&cluster, &ca, Some(&expired)), "CertificateExpired").await;
    assert!(expiry.contains("expired on 2021-01-01") && expiry.contains(SECRET), "{expiry}");

    let none = reported(&origin, tls_target(&cluster, &ca, None), "ClientCertificateRequired").await;
    assert!(none.contains("tls.crt and tls.key") && none.contains(SECRET), "{none}");

    // And the same connection with a good certificate works.
    let (handle, _e) =
        start(fast_config("w2"), EtcdTarget::plain([origin.endpoint()]), tls_target(&cluster, &ca, Some(&good)));
    wait_synced(&handle).await;
    handle.shutdown().await;
}

#[tokio::test]
async fn nothing_listening_a_wrong_password_and_a_user_without_permission_are_reported() {
    let origin = EtcdServer::start("a").await.unwrap();
    let nowhere = format!("http://127.0.0.1:{}", free_port());
    let unreachable = reported(&origin, EtcdTarget::plain([nowhere.clone()]), "Unreachable").await;
    assert!(unreachable.contains(&nowhere) && unreachable.contains("connection refused"), "{unreachable}");

    let peer = EtcdServer::start("b").await.unwrap();
    let mut admin = connect(&[peer.endpoint()], None).await;
    admin.role_add("nothing").await.unwrap();
    admin.user_add("nobody", "nobody-pw", None).await.unwrap();
    admin.user_grant_role("nobody", "nothing").await.unwrap();
    enable_auth_with_mirror_user(&mut admin, "a", "mirror-pw").await;
    let target = |user: &str, password: &str| {
        EtcdTarget::plain([peer.endpoint()]).with_user(user, password).with_credentials_from(SECRET)
    };
    let wrong = reported(&origin, target("mirror-a", "not-the-password"), "AuthenticationFailed").await;
    assert!(wrong.contains("mirror-a") && wrong.contains(SECRET) && wrong.contains(&peer.endpoint()), "{wrong}");
    let denied = reported(&origin, target("nobody", "nobody-pw"), "PermissionDenied").await;
    assert!(denied.contains("nobody") && denied.contains("etcd-mirror-role.sh"), "{denied}");
}
