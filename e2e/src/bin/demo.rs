//! `make demo`: two regions on this machine, each with a kube-apiserver, its etcd and a registry
//! etcd; a RegionPeering and an operator per region; a few hundred endpoints each. It shows the
//! federation as each region sees it, then stops region a's operator and shows a's mirror lapse
//! in region b within the lease TTL. Ctrl-C cleans everything up.
use aether_e2e::{Federation, LEASE_TTL_SECONDS, NAMESPACE};
use std::time::{Duration, Instant};

const ENDPOINTS: usize = 300;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    aether_e2e::check_tools()?;
    tokio::select! {
        r = demo() => r,
        _ = tokio::signal::ctrl_c() => {
            println!("\ninterrupted; cleaning up");
            Ok(())
        }
    }
}

fn step(text: &str) {
    println!("\n==> {text}");
}

async fn demo() -> anyhow::Result<()> {
    step("starting two regions (a kube-apiserver, its etcd and a registry etcd each)");
    let started = Instant::now();
    let mut fed = Federation::start(&["a", "b"]).await?;
    println!(
        "regions up in {:.1}s; CRDs installed; work dir {}",
        started.elapsed().as_secs_f64(),
        fed.workdir().display()
    );

    step("kubectl apply -f <region>-peering.yaml in each region");
    println!("{}", fed.peering_yaml("a"));
    fed.apply_peerings()?;

    step(&format!("writing {ENDPOINTS} sample endpoints in each region"));
    fed.write_endpoints("a", ENDPOINTS).await?;
    fed.write_endpoints("b", ENDPOINTS).await?;

    step("starting one operator per region");
    fed.start_operator("a")?;
    fed.start_operator("b")?;
    let t0 = Instant::now();
    fed.wait_condition("a", "Ready", "True", Duration::from_secs(60)).await?;
    fed.wait_condition("b", "Ready", "True", Duration::from_secs(60)).await?;
    println!("both regions Ready {:.1}s after the operators started", t0.elapsed().as_secs_f64());
    // One more refresh so that the inbound view shows in the table.
    tokio::time::sleep(Duration::from_secs(2)).await;

    for region in ["a", "b"] {
        step(&format!("kubectl get regionpeerings -n {NAMESPACE} -o wide   (region {region})"));
        print!("{}", fed.get_wide(region)?);
    }
    step("kubectl aether status --etcd --context a --context b   (the federation in one table; exit 0: healthy)");
    show_status(&fed)?;
    step("mirrored key counts (keys of each origin in each region's registry etcd)");
    for region in ["a", "b"] {
        println!(
            "region {region}: own /aether/v1/regions/{region}/ = {}, mirrored from {} = {}",
            fed.keys_of(region, region).await?,
            other(region),
            fed.keys_of(region, other(region)).await?
        );
    }

    step(&format!(
        "stopping region a's operator: its mirror in region b lapses within the {LEASE_TTL_SECONDS}s lease TTL"
    ));
    let name = fed.operators["a"][0].name.clone();
    fed.kill_operator(&name);
    let stopped = Instant::now();
    loop {
        let n = fed.keys_of("b", "a").await?;
        println!("  t+{:>4.1}s  keys of a in b: {n}", stopped.elapsed().as_secs_f64());
        if n == 0 {
            break;
        }
        if stopped.elapsed() > Duration::from_secs(LEASE_TTL_SECONDS as u64 * 3) {
            anyhow::bail!("a's mirror did not lapse");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    println!(
        "a's mirror lapsed in b {:.1}s after a's operator stopped (TTL {LEASE_TTL_SECONDS}s); b's own data is untouched: {} keys",
        stopped.elapsed().as_secs_f64(),
        fed.keys_of("b", "b").await?
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    step("region b's view now");
    print!("{}", fed.get_wide("b")?);
    step("kubectl aether status --etcd --context a --context b   (exit 1: a is STALE, its copy on b gone)");
    show_status(&fed)?;

    if std::env::var_os("AETHER_DEMO_EXIT").is_some() {
        return Ok(());
    }
    println!("\nThe regions keep running; press Ctrl-C to stop and clean up.");
    std::future::pending::<()>().await;
    Ok(())
}

/// `kubectl aether status --etcd` over both regions' contexts, as a user runs it, and its exit code.
fn show_status(fed: &Federation) -> anyhow::Result<()> {
    let (code, out) = fed.kubectl_plugin_exit(&["status", "--etcd", "--context", "a", "--context", "b"])?;
    print!("{out}");
    println!("(exit {})", code.map_or_else(|| "by a signal".to_string(), |c| c.to_string()));
    Ok(())
}

fn other(region: &str) -> &'static str {
    if region == "a" { "b" } else { "a" }
}
