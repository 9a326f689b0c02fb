//! When and how the keeper renews the leases, without IO.
//!
//! Renewal is scheduled from the time each lease has left, not from a fixed beat: a round is due
//! an interval after the least recently renewed lease; a round that fails or hangs is abandoned at
//! a deadline of a third of what the stalest lease has left, and retried at once with a short
//! capped backoff, so that a partition shorter than the TTL never costs a lease, however it ends.
//! A round renews only what it must (leases renewed in an earlier, partly failed attempt stay
//! renewed), spread over as many streams as the measured rate needs to finish within a sixth of
//! the TTL: etcd serves one stream's renewals one at a time, and a follower forwards each to the
//! leader.
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The shortest deadline of a round: below it, a healthy peer across a region could not answer.
pub const MIN_ROUND_DEADLINE: Duration = Duration::from_millis(500);
/// Backoff between attempts after a failed round: short, since the leases are running out.
pub const RETRY_BASE: Duration = Duration::from_millis(50);
pub const RETRY_CAP: Duration = Duration::from_millis(500);
/// Streams a first round uses per this many leases, before any round was measured.
pub const LEASES_PER_STREAM: usize = 2048;
pub const MAX_STREAMS: usize = 32;

/// What the keeper knows of one lease it keeps alive.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Kept {
    /// When the last renewal the peer answered with a live lease was sent, or when the lease was
    /// granted. None: not known (an adopted lease), so it is renewed at once.
    pub renewed_at: Option<Instant>,
    /// When the peer last answered for it, alive or gone.
    pub answered_at: Option<Instant>,
    /// The peer said the lease is gone.
    pub lost: bool,
    /// The worker was told it is gone (a retiring lease never is).
    pub reported: bool,
    /// An earlier layout's lease, expected to empty and lapse: its loss is not reported.
    pub retiring: bool,
}

/// The leases kept alive, by id.
pub type Book = BTreeMap<i64, Kept>;

/// The settings renewal is planned from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    pub ttl: Duration,
    pub interval: Duration,
    /// The longest a round may run (the RPC deadline).
    pub ceiling: Duration,
}

impl Timing {
    /// The leases a round renews now: every lease not gone that was renewed more than half an
    /// interval ago, or never. Past the interval they all go together, so rounds stay few.
    pub fn due(&self, book: &Book, now: Instant) -> Vec<i64> {
        let half = self.interval / 2;
        book.iter()
            .filter(|(_, k)| !k.lost && k.renewed_at.is_none_or(|t| now.saturating_duration_since(t) >= half))
            .map(|(id, _)| *id)
            .collect()
    }

    /// When a round is due: an interval after the least recently renewed lease (now for one never
    /// renewed); None when nothing is kept.
    pub fn next_round(&self, book: &Book, now: Instant) -> Option<Instant> {
        book.values().filter(|k| !k.lost).map(|k| k.renewed_at.map_or(now, |t| t + self.interval)).min()
    }

    /// What the stalest live lease has left. A lease whose last renewal is not known is taken to
    /// have a third of the TTL left: its predecessor may have renewed it an interval ago and
    /// stopped since.
    pub fn time_left(&self, book: &Book, now: Instant) -> Option<Duration> {
        book.values()
            .filter(|k| !k.lost)
            .map(|k| match k.renewed_at {
                Some(t) => (t + self.ttl).saturating_duration_since(now),
                None => self.ttl / 3,
            })
            .min()
    }

    /// How long a round may run before it is abandoned and retried: a third of what the stalest
    /// lease has left, so that a hung round leaves room for two more before the TTL runs out.
    pub fn round_deadline(&self, book: &Book, now: Instant) -> Duration {
        let left = self.time_left(book, now).unwrap_or(self.ttl);
        (left / 3).clamp(MIN_ROUND_DEADLINE, self.ceiling.max(MIN_ROUND_DEADLINE))
    }

    /// How long a round should take at most: a sixth of the TTL, half of what raises
    /// `KeepaliveDegraded`. Streams are added until rounds fit.
    pub fn target_round(&self) -> Duration {
        self.ttl / 6
    }

    /// Whether a round this long puts the leases at risk (more than a third of the TTL).
    pub fn degraded(&self, round: Duration) -> bool {
        round > self.ttl / 3
    }
}

/// The delay before attempt `attempt` (1 after the first failure), scaled by `jitter` in
/// [0.5, 1] so that workers failing together do not retry in lockstep.
pub fn retry_delay(attempt: u32, jitter: f64) -> Duration {
    let exp = RETRY_BASE.saturating_mul(1u32 << attempt.saturating_sub(1).min(16));
    exp.min(RETRY_CAP).mul_f64(jitter.clamp(0.5, 1.0))
}

/// What a round measured: leases answered, over how long, on how many streams.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measured {
    pub answered: usize,
    pub elapsed: Duration,
    pub streams: usize,
}

/// Streams for a round of `leases`: at least one per [`LEASES_PER_STREAM`], and as many as the
/// last round's rate per stream needs to renew them all within `target`; fewer again (halving)
/// once rounds run far under it. A round that got no answer says nothing of the rate.
pub fn streams_for(leases: usize, current: usize, last: Option<Measured>, target: Duration) -> usize {
    let floor = leases.div_ceil(LEASES_PER_STREAM).clamp(1, MAX_STREAMS);
    let current = current.max(floor).min(MAX_STREAMS);
    let Some(m) = last.filter(|m| m.answered > 0 && m.streams > 0) else { return current };
    let per_stream = m.answered as f64 / (m.elapsed.as_secs_f64().max(1e-6) * m.streams as f64);
    let needed = (leases as f64 / (per_stream * target.as_secs_f64().max(1e-3))).ceil() as usize;
    if needed > current {
        needed.min(MAX_STREAMS)
    } else if needed.saturating_mul(4) <= current {
        (current / 2).max(needed).max(floor)
    } else {
        current
    }
}

/// `leases` cut into at most `streams` runs of nearly equal length, in order.
pub fn chunks(leases: &[i64], streams: usize) -> Vec<Vec<i64>> {
    if leases.is_empty() {
        return Vec::new();
    }
    let size = leases.len().div_ceil(streams.max(1));
    leases.chunks(size).map(<[i64]>::to_vec).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(30);
    const INTERVAL: Duration = Duration::from_secs(10);

    fn timing() -> Timing {
        Timing { ttl: TTL, interval: INTERVAL, ceiling: Duration::from_secs(10) }
    }

    fn renewed(at: Instant) -> Kept {
        Kept { renewed_at: Some(at), answered_at: Some(at), ..Kept::default() }
    }

    #[test]
    fn a_round_is_due_an_interval_after_the_stalest_renewal_and_takes_every_half_stale_lease() {
        let t0 = Instant::now();
        let mut book = Book::new();
        book.insert(1, renewed(t0));
        book.insert(2, renewed(t0 + Duration::from_secs(4)));
        book.insert(3, renewed(t0 + Duration::from_secs(9)));
        assert_eq!(timing().next_round(&book, t0), Some(t0 + INTERVAL));
        let at = t0 + INTERVAL;
        // 2 was renewed 6 s ago (past half an interval) and goes along; 3 only 1 s ago.
        assert_eq!(timing().due(&book, at), vec![1, 2]);
    }

    #[test]
    fn a_lease_not_known_to_be_renewed_is_due_at_once_and_gone_ones_never() {
        let t0 = Instant::now();
        let mut book = Book::new();
        book.insert(1, Kept::default());
        book.insert(2, Kept { lost: true, ..Kept::default() });
        assert_eq!(timing().due(&book, t0), vec![1]);
        assert_eq!(timing().next_round(&book, t0), Some(t0));
        assert_eq!(timing().time_left(&book, t0), Some(TTL / 3));
        book.clear();
        assert_eq!(timing().next_round(&book, t0), None);
    }

    #[test]
    fn the_deadline_leaves_room_for_two_more_attempts_before_the_ttl() {
        let t0 = Instant::now();
        let mut book = Book::new();
        book.insert(1, renewed(t0));
        // At the interval 20 s are left: a round may take 6.67 s, then the ceiling caps it.
        let d = timing().round_deadline(&book, t0 + INTERVAL);
        assert!(d > Duration::from_secs(6) && d < Duration::from_secs(7), "{d:?}");
        // After a partition of 25 s, 5 s are left: 1.67 s a round.
        let d = timing().round_deadline(&book, t0 + Duration::from_secs(25));
        assert!(d > Duration::from_millis(1600) && d < Duration::from_millis(1700), "{d:?}");
        // Never below the floor, however late.
        assert_eq!(timing().round_deadline(&book, t0 + Duration::from_secs(40)), MIN_ROUND_DEADLINE);
        // Hung rounds and retries never use up the TTL: each takes a third of what is left.
        let mut now = t0 + INTERVAL;
        for _ in 0..5 {
            now += timing().round_deadline(&book, now) + RETRY_CAP;
        }
        assert!(now < t0 + TTL, "five hung attempts end {:?} after the renewal", now - t0);
    }

    #[test]
    fn retries_start_fast_and_stay_under_half_a_second() {
        assert_eq!(retry_delay(1, 1.0), Duration::from_millis(50));
        assert_eq!(retry_delay(2, 1.0), Duration::from_millis(100));
        assert_eq!(retry_delay(10, 1.0), RETRY_CAP);
        assert_eq!(retry_delay(30, 0.5), RETRY_CAP / 2);
    }

    #[test]
    fn streams_grow_with_the_measured_rate_and_shrink_slowly() {
        let target = Duration::from_secs(5);
        assert_eq!(streams_for(1_000, 1, None, target), 1);
        assert_eq!(streams_for(32_768, 1, None, target), 16, "one stream per 2,048 leases before any measure");
        // Through a follower, 3,000 renewals a second on one stream: 32k leases need 3 streams
        // for 5 s, and 16 are there already.
        let slow =
            Measured { answered: 32_768, elapsed: Duration::from_secs_f64(32_768.0 / 3_000.0 / 16.0), streams: 16 };
        assert_eq!(streams_for(32_768, 16, Some(slow), target), 16);
        // A round of 16k leases on 8 streams that took 4 s against a 1 s target: 32 streams.
        let late = Measured { answered: 16_384, elapsed: Duration::from_secs(4), streams: 8 };
        assert_eq!(streams_for(16_384, 8, Some(late), Duration::from_secs(1)), 32);
        // A round cut short at its deadline still measures the rate of what was answered.
        let cut = Measured { answered: 4_000, elapsed: Duration::from_secs(1), streams: 8 };
        assert_eq!(streams_for(16_384, 8, Some(cut), Duration::from_secs(1)), 32);
        // Next to a leader that answers 100k a second, streams halve down to the floor.
        let fast = Measured { answered: 16_384, elapsed: Duration::from_millis(160), streams: 32 };
        assert_eq!(streams_for(16_384, 32, Some(fast), target), 16);
        assert_eq!(streams_for(16_384, 16, Some(fast), target), 8);
        assert_eq!(streams_for(16_384, 8, Some(fast), target), 8, "never under one per 2,048 leases");
        // No answer at all (a partition) says nothing about the rate.
        let none = Measured { answered: 0, elapsed: Duration::from_secs(3), streams: 4 };
        assert_eq!(streams_for(8_192, 4, Some(none), target), 4);
    }

    #[test]
    fn chunks_cover_every_lease_once_in_order() {
        let leases: Vec<i64> = (1..=10).collect();
        assert_eq!(chunks(&leases, 3), vec![vec![1, 2, 3, 4], vec![5, 6, 7, 8], vec![9, 10]]);
        assert_eq!(chunks(&leases, 20).len(), 10);
        assert_eq!(chunks(&leases, 1), vec![leases.clone()]);
        assert!(chunks(&[], 4).is_empty());
    }

    #[test]
    fn degraded_is_a_round_past_a_third_of_the_ttl() {
        assert!(!timing().degraded(Duration::from_secs(10)));
        assert!(timing().degraded(Duration::from_millis(10_001)));
        assert_eq!(timing().target_round(), Duration::from_secs(5));
    }
}
