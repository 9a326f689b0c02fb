//! Client connections an etcd holds open: the TCP sockets established to its client port (every
//! process on this machine, so every worker's).
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// How often a sampler counts.
const SAMPLE_EVERY: Duration = Duration::from_millis(250);

/// Established connections to each of `ports` (server side: the socket's local port).
pub fn established(ports: &[u16]) -> Vec<usize> {
    let mut counts: BTreeMap<u16, usize> = ports.iter().map(|p| (*p, 0)).collect();
    for connection in aether_harness::established_connections() {
        if let Some(count) = counts.get_mut(&connection.local_port) {
            *count += 1;
        }
    }
    ports.iter().map(|p| counts[p]).collect()
}

/// The most connections each port held while it ran, sampled on a thread of its own (the mesh
/// waits for its processes synchronously).
pub struct PeakSampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<usize>>,
}

impl PeakSampler {
    pub fn start(ports: Vec<u16>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut peaks = vec![0; ports.len()];
            loop {
                for (peak, now) in peaks.iter_mut().zip(established(&ports)) {
                    *peak = (*peak).max(now);
                }
                if stopping.load(Ordering::SeqCst) {
                    return peaks;
                }
                std::thread::sleep(SAMPLE_EVERY);
            }
        });
        PeakSampler { stop, thread }
    }

    /// Each port's peak.
    pub fn stop(self) -> Vec<usize> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.join().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listener_with_one_client_has_one_established_connection() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        assert_eq!(established(&[port]), vec![0]);
        let _client = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let (_server, _) = listener.accept().expect("accept");
        assert_eq!(established(&[port]), vec![1]);
    }
}
