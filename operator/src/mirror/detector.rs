//! The cross-region failure detector, without IO: a deadline on successful round trips to the
//! peer, lax on purpose (cross-region pauses of seconds are normal). It only reports.
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct ReachabilityDetector {
    acceptable_pause: Duration,
    last_success: Option<Instant>,
    started: Instant,
    reported_reachable: bool,
}

/// A change of the detector's verdict, reported once per change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    BecameUnreachable,
    BecameReachable,
}

impl ReachabilityDetector {
    pub fn new(acceptable_pause: Duration, now: Instant) -> Self {
        ReachabilityDetector { acceptable_pause, last_success: None, started: now, reported_reachable: true }
    }

    /// A successful round trip (a keepalive answer or an applied Txn).
    pub fn success(&mut self, now: Instant) -> Option<Transition> {
        self.last_success = Some(now);
        self.evaluate(now)
    }

    /// Re-evaluates the verdict; returns a transition when it changed.
    pub fn evaluate(&mut self, now: Instant) -> Option<Transition> {
        let reachable = self.is_reachable(now);
        if reachable == self.reported_reachable {
            return None;
        }
        self.reported_reachable = reachable;
        Some(if reachable { Transition::BecameReachable } else { Transition::BecameUnreachable })
    }

    /// Reachable while the last success (or the start) is within the acceptable pause.
    pub fn is_reachable(&self, now: Instant) -> bool {
        let since = self.last_success.unwrap_or(self.started);
        now.saturating_duration_since(since) <= self.acceptable_pause
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_each_change_once() {
        let t0 = Instant::now();
        let pause = Duration::from_secs(10);
        let mut d = ReachabilityDetector::new(pause, t0);
        assert_eq!(d.success(t0 + Duration::from_secs(1)), None);
        assert_eq!(d.evaluate(t0 + Duration::from_secs(5)), None);
        assert_eq!(d.evaluate(t0 + Duration::from_secs(12)), Some(Transition::BecameUnreachable));
        assert_eq!(d.evaluate(t0 + Duration::from_secs(20)), None);
        assert!(!d.is_reachable(t0 + Duration::from_secs(20)));
        assert_eq!(d.success(t0 + Duration::from_secs(21)), Some(Transition::BecameReachable));
    }

    #[test]
    fn a_peer_never_reached_becomes_unreachable_after_the_pause() {
        let t0 = Instant::now();
        let mut d = ReachabilityDetector::new(Duration::from_secs(3), t0);
        assert_eq!(d.evaluate(t0 + Duration::from_secs(2)), None);
        assert_eq!(d.evaluate(t0 + Duration::from_secs(4)), Some(Transition::BecameUnreachable));
    }
}
