//! `kubectl aether` as its users run it: the shipped binary, as a kubectl plugin on the PATH,
//! against the kind clusters' contexts. What it prints (`-o json`) is read into the operator's own
//! types, so a field renamed on one side fails to compile here rather than reading as empty.
//! On kind only: the local federation has no kubeconfig contexts per region.
use aether_operator::cli::doctor::{Finding, Level};
use aether_operator::cli::status::Federation;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The plugin and the kubectl that runs it.
#[derive(Clone, Debug)]
pub struct Plugin {
    /// A directory holding `kubectl-aether`.
    dir: PathBuf,
    kubectl: PathBuf,
    kubeconfig: PathBuf,
}

/// What `kubectl aether status -o json` said, and its exit code.
#[derive(Debug)]
pub struct Status {
    pub code: i32,
    pub federation: Federation,
    pub healthy: Option<bool>,
    pub problems: Vec<String>,
}

impl Plugin {
    /// The plugin of AETHER_E2E_PLUGIN_DIR, run by AETHER_E2E_KUBECTL with the kind federation's
    /// kubeconfig; None when no plugin was found (its checks are then skipped).
    pub fn from_env(kind: &crate::substrate::KindFederation) -> Option<Plugin> {
        let dir = PathBuf::from(std::env::var("AETHER_E2E_PLUGIN_DIR").ok().filter(|d| !d.is_empty())?);
        let kubectl = PathBuf::from(std::env::var("AETHER_E2E_KUBECTL").ok()?);
        Some(Plugin { dir, kubectl, kubeconfig: kind.kubeconfig() })
    }

    async fn run(&self, args: &[&str]) -> anyhow::Result<(i32, Vec<u8>, String)> {
        let path = format!("{}:{}", self.dir.display(), std::env::var("PATH").unwrap_or_default());
        let out = tokio::process::Command::new(&self.kubectl)
            .arg("aether")
            .args(args)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .env("PATH", path)
            .output()
            .await?;
        let code = out.status.code().unwrap_or(-1);
        Ok((code, out.stdout, String::from_utf8_lossy(&out.stderr).into_owned()))
    }

    /// `kubectl aether status --context kind-aether-<r>... -o json EXTRA...`.
    pub async fn status(&self, regions: &[&str], extra: &[&str]) -> anyhow::Result<Status> {
        let contexts: Vec<String> = regions.iter().map(|r| format!("kind-aether-{r}")).collect();
        let mut args = vec!["status", "-o", "json"];
        for context in &contexts {
            args.extend(["--context", context.as_str()]);
        }
        args.extend(extra);
        let (code, stdout, stderr) = self.run(&args).await?;
        let value: serde_json::Value = serde_json::from_slice(&stdout).map_err(|e| {
            anyhow::anyhow!(
                "kubectl aether status (exit {code}) printed no JSON ({e}): {}{stderr}",
                String::from_utf8_lossy(&stdout)
            )
        })?;
        Ok(Status {
            code,
            healthy: value["healthy"].as_bool(),
            problems: serde_json::from_value(value["problems"].clone()).unwrap_or_default(),
            federation: serde_json::from_value(value)?,
        })
    }

    /// `kubectl aether doctor REGION --context kind-aether-REGION -o json`.
    pub async fn doctor(&self, region: &str) -> anyhow::Result<(i32, Vec<Finding>)> {
        let context = format!("kind-aether-{region}");
        let args = ["doctor", region, "--context", context.as_str(), "-n", crate::NAMESPACE, "-o", "json"];
        let (code, stdout, stderr) = self.run(&args).await?;
        let findings = serde_json::from_slice(&stdout).map_err(|e| {
            anyhow::anyhow!(
                "kubectl aether doctor (exit {code}) printed no findings ({e}): {}{stderr}",
                String::from_utf8_lossy(&stdout)
            )
        })?;
        Ok((code, findings))
    }
}

/// What a region's row and mirror say, one line each, for a person.
pub fn lines(status: &Status) -> String {
    let f = &status.federation;
    let mut out = format!("exit {}, healthy {:?}", status.code, status.healthy);
    for r in &f.regions {
        out.push_str(&format!(
            "\n  region {}: Ready={} ({}) leader={:?} stale={:?} warnings={:?}",
            r.region, r.ready, r.reason, r.leader, r.stale, r.warnings
        ));
    }
    for m in &f.mirrors {
        out.push_str(&format!(
            "\n  mirror {} -> {}: phase={} synced={} reachable={} keys={} etcd={:?}",
            m.origin, m.peer, m.phase, m.synced, m.reachable, m.keys, m.etcd
        ));
    }
    for u in &f.unreachable {
        out.push_str(&format!("\n  context {} unreadable: {}", u.context, u.error));
    }
    for p in &status.problems {
        out.push_str(&format!("\n  problem: {p}"));
    }
    out
}

/// On a healthy federation of `regions` (each the other's peer): `status` exits 0; `status
/// --etcd` exits 0 with each peer's canary synced, a checkpoint, the peer's key count equal to what
/// `on_peer` counted and each origin counted by its region's leader (its local etcd is an in-cluster
/// Service); `doctor` of the first region exits 0, its local etcd checked from the leader's pod.
/// The seconds `status --etcd` and `doctor` took.
pub async fn reports_healthy(
    plugin: &Plugin,
    regions: &[&str],
    on_peer: &std::collections::BTreeMap<String, i64>,
) -> anyhow::Result<(Duration, Duration)> {
    let plain = plugin.status(regions, &[]).await?;
    println!("kubectl aether status: {}", lines(&plain));
    anyhow::ensure!(plain.code == 0, "kubectl aether status: exit {} on a healthy federation", plain.code);
    let asked = Instant::now();
    let checked = plugin.status(regions, &["--etcd"]).await?;
    let status_took = asked.elapsed();
    println!("kubectl aether status --etcd: {}", lines(&checked));
    let mut bad = Vec::new();
    for origin in regions {
        let Some(r) = checked.federation.regions.iter().find(|r| r.region == *origin) else {
            bad.push(format!("no region row for {origin}"));
            continue;
        };
        if let Some(stale) = &r.stale {
            bad.push(format!("region {origin} STALE: {stale}"));
        }
        if r.ready != "True" {
            bad.push(format!("region {origin} Ready={}", r.ready));
        }
        let Some(m) = checked.federation.mirrors.iter().find(|m| m.origin == *origin) else {
            bad.push(format!("no mirror row from {origin}"));
            continue;
        };
        if !(m.synced && m.reachable) {
            bad.push(format!("mirror from {origin}: synced={} reachable={}", m.synced, m.reachable));
        }
        let Some(e) = &m.etcd else {
            bad.push(format!("mirror from {origin}: no etcd check"));
            continue;
        };
        if e.canary_synced != Some(true) {
            bad.push(format!("mirror from {origin}: canary {:?}", e.canary_synced));
        }
        if e.checkpoint_revision.is_none() {
            bad.push(format!("mirror from {origin}: no checkpoint"));
        }
        if e.peer_keys != on_peer.get(*origin).copied() {
            bad.push(format!(
                "mirror from {origin}: peerKeys {:?}, the peer's etcd holds {:?}",
                e.peer_keys,
                on_peer.get(*origin)
            ));
        }
        if e.origin_keys.is_none() {
            bad.push(format!("mirror from {origin}: the origin's keys not counted"));
        }
        if !e.problems.is_empty() {
            bad.push(format!("mirror from {origin}: {:?}", e.problems));
        }
        // The origin's local etcd is an in-cluster Service: only the region's leader can reach it.
        let expected = r.leader.as_ref().map(|l| format!("{}/{l}", crate::NAMESPACE));
        if e.checked_from.is_none() || e.checked_from != expected {
            bad.push(format!(
                "mirror from {origin}: checked from {:?}, expected the leader's pod {expected:?}",
                e.checked_from
            ));
        }
    }
    if !checked.federation.unreachable.is_empty() {
        bad.push(format!("unreadable contexts: {:?}", checked.federation.unreachable));
    }
    if !checked.problems.is_empty() || checked.code != 0 || checked.healthy != Some(true) {
        bad.push(format!("exit {}, healthy {:?}, problems {:?}", checked.code, checked.healthy, checked.problems));
    }
    anyhow::ensure!(bad.is_empty(), "kubectl aether status --etcd on a healthy federation: {}", bad.join("; "));

    let asked = Instant::now();
    let (code, findings) = plugin.doctor(regions[0]).await?;
    let doctor_took = asked.elapsed();
    let failed: Vec<&Finding> = findings.iter().filter(|f| f.level == Level::Fail).collect();
    let local: Vec<&Finding> = findings.iter().filter(|f| f.target == "local etcd").collect();
    let mut bad = Vec::new();
    if !failed.is_empty() {
        bad.push(format!("failed: {failed:?}"));
    }
    if !local.iter().any(|f| f.check == "connect" && f.level == Level::Ok) {
        bad.push(format!("the local etcd was not connected to: {local:?}"));
    }
    if local.is_empty() || !local.iter().all(|f| f.detail.contains("checked from the leader's pod")) {
        bad.push(format!("the local etcd's findings do not say the leader checked them: {local:?}"));
    }
    if !findings.iter().any(|f| f.target.starts_with("peer ") && f.check == "connect" && f.level == Level::Ok) {
        bad.push("no peer connected to".into());
    }
    if code != 0 {
        bad.push(format!("exit {code}"));
    }
    anyhow::ensure!(bad.is_empty(), "kubectl aether doctor {}: {}", regions[0], bad.join("; "));
    Ok((status_took, doctor_took))
}

/// `kubectl aether status --etcd` over `regions` every second until it calls `lost` STALE, for at
/// most `deadline`: how long that took, and what it said then. It must exit 1, not healthy, with
/// `lost` STALE (a problem naming it so) and no other region STALE.
pub async fn watch_stale(
    plugin: &Plugin,
    regions: &[&str],
    lost: &str,
    deadline: Duration,
) -> anyhow::Result<(Duration, String)> {
    let start = Instant::now();
    loop {
        let said = plugin.status(regions, &["--etcd"]).await;
        if let Ok(status) = &said
            && let Some(why) = status.federation.regions.iter().find(|r| r.region == lost).and_then(|r| r.stale.clone())
        {
            let took = start.elapsed();
            let mut bad = Vec::new();
            if status.code != 1 || status.healthy != Some(false) {
                bad.push(format!("exit {}, healthy {:?} (expected 1, false)", status.code, status.healthy));
            }
            let others: Vec<&str> = status
                .federation
                .regions
                .iter()
                .filter(|r| r.region != lost && r.stale.is_some())
                .map(|r| r.region.as_str())
                .collect();
            if !others.is_empty() {
                bad.push(format!("STALE too: {others:?}"));
            }
            if !status.problems.iter().any(|p| p.starts_with(&format!("{lost} (")) && p.contains(": stale:")) {
                bad.push(format!("no problem names {lost} stale: {:?}", status.problems));
            }
            anyhow::ensure!(
                bad.is_empty(),
                "kubectl aether status during {lost}'s loss: {}\n{}",
                bad.join("; "),
                lines(status)
            );
            return Ok((took, why));
        }
        anyhow::ensure!(
            start.elapsed() < deadline,
            "kubectl aether status never called {lost} STALE within {} s; last: {}",
            deadline.as_secs(),
            match &said {
                Ok(status) => lines(status),
                Err(e) => e.to_string(),
            }
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
