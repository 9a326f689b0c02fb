//! Where an etcd's CPU goes during a bench window: with `AETHER_BENCH_PPROF=<seconds>`, the etcds
//! a scenario starts serve Go's profiler (`--enable-pprof`), and a CPU profile of each is taken
//! over that many seconds from the window's start, kept under `target/bench-pprof/` and its top
//! functions printed (`go tool pprof -top`, when Go is installed).
use aether_harness::EtcdServer;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// The profile's length, when profiles are asked for.
pub fn seconds() -> Option<u64> {
    std::env::var("AETHER_BENCH_PPROF").ok().and_then(|s| s.parse().ok()).filter(|s| *s > 0)
}

/// The etcd flags a profiled scenario starts its etcds with.
pub fn etcd_flags() -> &'static [&'static str] {
    if seconds().is_some() { &["--enable-pprof"] } else { &[] }
}

/// Profiles being taken; `finish` waits for them and prints each one's top.
pub struct Profiles {
    taking: Vec<(String, PathBuf, Child)>,
}

impl Profiles {
    /// Starts a profile of each (label, etcd) when asked for; nothing otherwise.
    pub fn start(scenario: &str, etcds: &[(&str, &EtcdServer)]) -> anyhow::Result<Self> {
        let Some(seconds) = seconds() else { return Ok(Self { taking: Vec::new() }) };
        let dir = PathBuf::from("target/bench-pprof");
        std::fs::create_dir_all(&dir)?;
        let mut taking = Vec::new();
        for (label, etcd) in etcds {
            let name: String = format!("{scenario}-{label}")
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
                .collect();
            let file = dir.join(format!("{name}.pb.gz"));
            let url = format!("http://{}/debug/pprof/profile?seconds={seconds}", etcd.client_addr());
            let child = Command::new("curl").args(["-sS", "-o"]).arg(&file).arg(url).stdin(Stdio::null()).spawn()?;
            taking.push((label.to_string(), file, child));
        }
        Ok(Self { taking })
    }

    pub fn finish(self) {
        for (label, file, mut child) in self.taking {
            if !child.wait().is_ok_and(|s| s.success()) {
                println!("    profile of {label}: curl failed");
                continue;
            }
            let top = Command::new("go").args(["tool", "pprof", "-top", "-nodecount=12"]).arg(&file).output();
            match top {
                Ok(out) if out.status.success() => {
                    println!("    profile of {label} ({}):", file.display());
                    for line in String::from_utf8_lossy(&out.stdout).lines().skip(4) {
                        println!("      {line}");
                    }
                }
                _ => println!("    profile of {label}: {} (go tool pprof not run)", file.display()),
            }
        }
    }
}
