//! The kind e2e's steps written in Rust: hack/kind/e2e.sh runs each by name on the clusters it made
//! (`cargo test -p aether-e2e --test kind -- --ignored --exact <step>`); the same steps run on
//! local processes in e2e.rs. The environment: AETHER_KIND_FED_DIR (federation.sh's state),
//! AETHER_E2E_KEYS and AETHER_E2E_DELETE (default 50 and 10), AETHER_E2E_PROPAGATION_TIMEOUT (s,
//! default 120).
use aether_e2e::scenarios::data_path;
use aether_e2e::substrate::KindFederation;
use std::time::Duration;

fn number(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Both ways between a and b: keys put into the origin reach the peer verbatim; deleted, they go.
#[tokio::test]
#[ignore = "needs the kind clusters hack/kind/e2e.sh makes"]
async fn data_path_both_ways() {
    let kind = KindFederation::from_env().unwrap();
    let (n, deletes) = (number("AETHER_E2E_KEYS", 50) as usize, number("AETHER_E2E_DELETE", 10) as usize);
    let deadline = Duration::from_secs(number("AETHER_E2E_PROPAGATION_TIMEOUT", 120));
    for (origin, peer) in [("a", "b"), ("b", "a")] {
        let took = data_path(&kind, origin, peer, &format!("kind-{origin}"), n, deletes, deadline)
            .await
            .unwrap_or_else(|e| panic!("{origin} -> {peer}: {e:#}"));
        let seconds = |d: Duration| format!("{:.2} s", d.as_secs_f64());
        println!(
            "time: propagation {origin} -> {peer}: {n} puts, first put to all visible = {}",
            seconds(took.first_put_to_visible)
        );
        println!(
            "time: propagation {origin} -> {peer}: last put to all visible = {}",
            seconds(took.last_put_to_visible)
        );
        println!(
            "time: deletes {origin} -> {peer}: last of {deletes} deletes to gone = {}",
            seconds(took.last_delete_to_gone)
        );
    }
}
