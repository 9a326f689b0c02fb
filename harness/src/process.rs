//! A child process whose output goes to a log file, killed on drop.
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// A process started by the harness (or a test): logs to a file, killed on drop, log tail
/// printed when a test panics.
pub struct Managed {
    name: String,
    log: PathBuf,
    child: Option<Child>,
}

impl Managed {
    pub fn spawn(name: &str, mut cmd: Command, log: &Path) -> anyhow::Result<Self> {
        let out = File::options().create(true).append(true).open(log)?;
        let err = out.try_clone()?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        let child = cmd.spawn().map_err(|e| anyhow::anyhow!("starting {name}: {e}"))?;
        Ok(Self { name: name.to_string(), log: log.to_path_buf(), child: Some(child) })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Fails with the log's tail when the process has already exited.
    pub fn check_running(&mut self) -> anyhow::Result<()> {
        if let Some(child) = self.child.as_mut()
            && let Some(status) = child.try_wait()?
        {
            anyhow::bail!("{} exited ({status}):\n{}", self.name, self.log_tail(40));
        }
        Ok(())
    }

    /// SIGTERM, then wait for the exit.
    pub fn terminate(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), "TERM");
            // A paused (SIGSTOP) process holds TERM until it runs again.
            signal(child.id(), "CONT");
            let _ = child.wait();
        }
    }

    /// SIGSTOP: the process is frozen (it holds what it held, renews nothing) until it is killed or
    /// terminated.
    pub fn pause(&self) {
        if let Some(child) = self.child.as_ref() {
            signal(child.id(), "STOP");
        }
    }

    /// SIGKILL, then wait for the exit: a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for Managed {
    fn drop(&mut self) {
        if std::thread::panicking() && self.child.is_some() {
            eprintln!("----- last lines of {} ({}) -----\n{}", self.name, self.log.display(), self.log_tail(60));
        }
        self.kill();
    }
}

pub(crate) fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status();
}

/// A port on 127.0.0.1 that was free a moment ago, outside the kernel's ephemeral range.
///
/// A server the harness restarts binds the same ports again. A port the kernel hands out for
/// `bind(0)` or as a connection's local port can be taken by any process on the machine in the
/// moment between the old server's exit and the new one's bind (a restarted etcd once failed with
/// "bind: address already in use" on its peer port). Ports outside that range are taken only by
/// whoever asks for them by number: here, other harness processes, each starting at its own
/// random place and never handing out a port twice.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let Some(range) = ephemeral_range().and_then(harness_ports) else {
        return kernel_port();
    };
    let width = u32::from(range.1 - range.0) + 1;
    if NEXT.load(Ordering::Relaxed) == u32::MAX {
        let _ = NEXT.compare_exchange(u32::MAX, random_below(width), Ordering::Relaxed, Ordering::Relaxed);
    }
    for _ in 0..width {
        let offset = NEXT.fetch_add(1, Ordering::Relaxed) % width;
        let port = range.0 + offset as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    kernel_port()
}

fn kernel_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local addr").port()
}

/// The kernel's ephemeral port range (net.ipv4.ip_local_port_range).
fn ephemeral_range() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut parts = text.split_whitespace().map(|p| p.parse::<u16>().ok());
    Some((parts.next()??, parts.next()??))
}

/// The ports the harness hands out (pure): the larger of the spans below and above the ephemeral
/// range, within 10000-65535, if it holds at least 4096 ports.
pub(crate) fn harness_ports(ephemeral: (u16, u16)) -> Option<(u16, u16)> {
    const LOWEST: u16 = 10_000;
    const ENOUGH: u32 = 4_096;
    let (lo, hi) = ephemeral;
    let below = (lo > LOWEST).then(|| (LOWEST, lo - 1));
    let above = (hi < u16::MAX).then(|| (hi.max(LOWEST - 1) + 1, u16::MAX));
    let size = |r: &(u16, u16)| u32::from(r.1) - u32::from(r.0) + 1;
    [below, above].into_iter().flatten().filter(|r| size(r) >= ENOUGH).max_by_key(size)
}

/// A number below `n`, different in each process (the clock and the process id hashed).
fn random_below(n: u32) -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    (h.finish() % u64::from(n.max(1))) as u32
}

/// Polls `probe` until it returns true, failing after `deadline`.
pub async fn wait_until<F, Fut>(what: &str, deadline: std::time::Duration, mut probe: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let start = std::time::Instant::now();
    let mut last_err = String::new();
    loop {
        match probe().await {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => last_err = e.to_string(),
        }
        if start.elapsed() > deadline {
            anyhow::bail!("{what} not ready after {deadline:?} {last_err}");
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Whether process `pid` holds the listening socket on 127.0.0.1:`port` (from /proc/net/tcp and
/// the process's descriptors). A port free a moment ago may be bound by another test's process
/// by the time ours binds it: only an answer from a port our process holds is its answer.
pub fn listens_on(pid: u32, port: u16) -> bool {
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else { return false };
    let listening: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (_, local_port) = fields.get(1)?.split_once(':')?;
            let (state, inode) = (*fields.get(3)?, *fields.get(9)?);
            (state == "0A" && u16::from_str_radix(local_port, 16).ok()? == port).then(|| format!("socket:[{inode}]"))
        })
        .collect();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    !listening.is_empty()
        && fds.flatten().any(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|target| listening.iter().any(|s| target.as_os_str() == s.as_str()))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listening_port_is_ours_only_while_we_hold_it() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(listens_on(std::process::id(), port), "this process holds {port}");
        assert!(!listens_on(1, port), "another process does not");
        drop(listener);
        assert!(!listens_on(std::process::id(), port), "released");
    }

    #[test]
    fn the_harness_ports_lie_outside_the_ephemeral_range() {
        assert_eq!(harness_ports((32768, 60999)), Some((10_000, 32767)));
        assert_eq!(harness_ports((1024, 40000)), Some((40001, 65535)));
        assert_eq!(harness_ports((12000, 65535)), None, "neither span holds 4096 ports");
        assert_eq!(harness_ports((1024, 65535)), None);
    }

    #[test]
    fn free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() {
        let ephemeral = ephemeral_range().unwrap();
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        let distinct: std::collections::BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "a port handed out twice");
        if harness_ports(ephemeral).is_some() {
            assert!(ports.iter().all(|p| *p < ephemeral.0 || *p > ephemeral.1), "{ports:?} vs {ephemeral:?}");
        }
        for port in ports.iter().take(10) {
            std::net::TcpListener::bind(("127.0.0.1", *port)).expect("the port binds");
        }
    }
}
