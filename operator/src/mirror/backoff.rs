//! Capped exponential backoff with jitter, without IO.
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(base: Duration, cap: Duration) -> Self {
        Backoff { base, cap, attempt: 0 }
    }

    /// The next delay: base * 2^attempt, capped, scaled by `jitter` in [0.5, 1.0] so that many
    /// workers failing together do not retry in lockstep.
    pub fn next_delay(&mut self, jitter: f64) -> Duration {
        let exp = self.base.saturating_mul(1u32 << self.attempt.min(20));
        self.attempt = self.attempt.saturating_add(1);
        exp.min(self.cap).mul_f64(jitter.clamp(0.5, 1.0))
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    pub fn attempts(&self) -> u32 {
        self.attempt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let delays: Vec<u128> = (0..7).map(|_| b.next_delay(1.0).as_millis()).collect();
        assert_eq!(delays, vec![100, 200, 400, 800, 1600, 2000, 2000]);
        b.reset();
        assert_eq!(b.next_delay(0.5), Duration::from_millis(50));
        assert_eq!(b.next_delay(0.0), Duration::from_millis(100), "jitter is clamped to at least half");
    }
}
