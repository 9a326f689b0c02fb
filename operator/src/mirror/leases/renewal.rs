//! When and how the keeper renews the leases, without IO.
//!
//! Renewal is scheduled from the time each lease has left, not from a fixed beat, and each lease
//! lives by the TTL the peer granted it (its answers say), not by the one configured now: after a
//! TTL change the leases granted under the old one are renewed by it until a resync has moved the
//! copy onto leases of the new one. A round is due an interval (at most a third of the lease's
//! TTL) after the least recently renewed lease; a round that fails, or hangs (no new
//! answer for a deadline of a third of what the stalest lease has left), is abandoned and retried
//! at once with a short capped backoff, so that a partition shorter than the TTL never costs a
//! lease, however it ends. The stalest leases go first on every stream.
//! A round renews only what it must (leases renewed in an earlier, partly failed attempt stay
//! renewed), spread over as many streams as the measured rate needs to finish within a sixth of
//! the TTL: etcd serves one stream's renewals one at a time, and a follower forwards each to the
//! leader.
use crate::mirror::health::RenewalShortfall;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The shortest deadline of a round: below it, a healthy peer across a region could not answer.
pub const MIN_ROUND_DEADLINE: Duration = Duration::from_millis(500);
/// Backoff between attempts after a failed round: short, since the leases are running out.
pub const RETRY_BASE: Duration = Duration::from_millis(50);
pub const RETRY_CAP: Duration = Duration::from_millis(500);
/// The cap when the peer refused the credentials or a permission: retrying at once cannot help
/// (a rotated password stays wrong), and every attempt costs the peer an authentication (a
/// bcrypt check) times every origin writing into it.
pub const REFUSED_RETRY_CAP: Duration = Duration::from_secs(10);
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
    /// The TTL the peer granted the lease with, as its answers (or the grant) say; None until
    /// then, when the configured TTL stands in for it.
    pub ttl: Option<Duration>,
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
    /// The TTL a lease lives by: the one the peer granted it, or the configured one until known.
    pub fn ttl_of(&self, kept: &Kept) -> Duration {
        kept.ttl.unwrap_or(self.ttl)
    }

    /// How often a lease is renewed: the configured interval, or a third of its own TTL when that
    /// is shorter (a lease granted under a shorter TTL than the one configured now).
    pub fn interval_of(&self, kept: &Kept) -> Duration {
        self.interval.min(self.ttl_of(kept) / 3)
    }

    /// The timing of the leases in `book` taken together: the shortest TTL any of them lives by
    /// (the configured one while none is known), and the interval that fits it. Rounds are sized,
    /// and judged degraded, against it.
    pub fn of_book(&self, book: &Book) -> Timing {
        let ttl = book.values().filter(|k| !k.lost).map(|k| self.ttl_of(k)).min().unwrap_or(self.ttl);
        Timing { ttl, interval: self.interval.min(ttl / 3), ceiling: self.ceiling }
    }

    /// The leases a round renews now: every lease not gone that was renewed more than half its
    /// interval ago, or never. Past the interval they all go together, so rounds stay few. The
    /// stalest come first (never renewed, then the least time left): a round cut short at its
    /// deadline has renewed the ones with the least time left.
    pub fn due(&self, book: &Book, now: Instant) -> Vec<i64> {
        let mut due: Vec<(Option<Instant>, i64)> = book
            .iter()
            .filter(|(_, k)| {
                !k.lost && k.renewed_at.is_none_or(|t| now.saturating_duration_since(t) >= self.interval_of(k) / 2)
            })
            .map(|(id, k)| (k.renewed_at.map(|t| t + self.ttl_of(k)), *id))
            .collect();
        due.sort_unstable();
        due.into_iter().map(|(_, id)| id).collect()
    }

    /// When a round is due: an interval after the least recently renewed lease (now for one never
    /// renewed); None when nothing is kept.
    pub fn next_round(&self, book: &Book, now: Instant) -> Option<Instant> {
        book.values().filter(|k| !k.lost).map(|k| k.renewed_at.map_or(now, |t| t + self.interval_of(k))).min()
    }

    /// What the stalest live lease has left. A lease whose last renewal is not known is taken to
    /// have a third of its TTL left: its predecessor may have renewed it an interval ago and
    /// stopped since.
    pub fn time_left(&self, book: &Book, now: Instant) -> Option<Duration> {
        book.values()
            .filter(|k| !k.lost)
            .map(|k| match k.renewed_at {
                Some(t) => (t + self.ttl_of(k)).saturating_duration_since(now),
                None => self.ttl_of(k) / 3,
            })
            .min()
    }

    /// The stalest live lease's last renewal and the TTL it lives by: together they say when it
    /// lapses unless renewed (status and `KeepaliveDegraded` read it).
    pub fn stalest(&self, book: &Book) -> Option<(Instant, Duration)> {
        book.values()
            .filter(|k| !k.lost)
            .filter_map(|k| k.renewed_at.map(|t| (t, self.ttl_of(k))))
            .min_by_key(|(t, ttl)| *t + *ttl)
    }

    /// How long a round may go without a new answer before it is abandoned and retried: a third
    /// of what the stalest lease has left, so that a hung round leaves room for two more before
    /// the TTL runs out.
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
/// [0.5, 1] so that workers failing together do not retry in lockstep; longer when the peer
/// `refused` the credentials or a permission.
pub fn retry_delay(attempt: u32, jitter: f64, refused: bool) -> Duration {
    let exp = RETRY_BASE.saturating_mul(1u32 << attempt.saturating_sub(1).min(16));
    exp.min(if refused { REFUSED_RETRY_CAP } else { RETRY_CAP }).mul_f64(jitter.clamp(0.5, 1.0))
}

/// Whether a keepalive round's error says the peer refused the credentials or a permission.
pub fn refused(error: &str) -> bool {
    let error = error.to_ascii_lowercase();
    [
        "authentication failed",
        "authenticationfailed",
        "permission denied",
        "permissiondenied",
        "unauthenticated",
        "user name is empty",
        "invalid auth token",
    ]
    .iter()
    .any(|said| error.contains(said))
}

/// What a round measured: leases answered, over how long, on how many streams.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measured {
    pub answered: usize,
    pub elapsed: Duration,
    pub streams: usize,
}

/// Answers a stream must have given in a round for the round to measure the peer's rate: a
/// round of a few leases (a split's new one) measures the round trip, not the rate.
pub const MIN_ANSWERS_PER_STREAM: usize = 64;

impl Measured {
    /// Whether the round says how fast the peer renews.
    pub fn measures_rate(&self) -> bool {
        self.streams > 0 && self.answered >= self.streams * MIN_ANSWERS_PER_STREAM
    }
}

/// Streams for rounds of a layout of `leases`: at least one per [`LEASES_PER_STREAM`], and as
/// many as the last round's rate per stream needs to renew them all within `target`; fewer again
/// (halving) once rounds run far under it. A round that got no answer, or too few to measure a
/// rate ([`Measured::measures_rate`]), changes nothing.
pub fn streams_for(leases: usize, current: usize, last: Option<Measured>, target: Duration) -> usize {
    let floor = leases.div_ceil(LEASES_PER_STREAM).clamp(1, MAX_STREAMS);
    let current = current.max(floor).min(MAX_STREAMS);
    let Some(m) = last.filter(Measured::measures_rate) else { return current };
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

/// Whether `leases` can be renewed within a third of `ttl` at the rate `last` measured: if not,
/// two slow rounds and a retry would not fit in the TTL, and it is said before anything lapses.
/// On fewer streams than the most, a round that would still fit in half the TTL says nothing yet
/// (the next round adds streams); past half, there is no time to find out whether streams help
/// (through one follower they do not). A round too small to measure a rate says nothing.
pub fn shortfall(leases: usize, last: Measured, ttl: Duration) -> Option<RenewalShortfall> {
    if !last.measures_rate() || leases == 0 {
        return None;
    }
    let rate = last.answered as f64 / last.elapsed.as_secs_f64().max(1e-6);
    let round = Duration::from_secs_f64(leases as f64 / rate);
    let streams_can_help = last.streams < MAX_STREAMS && round <= ttl / 2;
    (round > ttl / 3 && !streams_can_help).then_some(RenewalShortfall {
        leases,
        rate: rate.round() as u64,
        streams: last.streams,
        round,
        ttl,
    })
}

/// The streams a round of `leases` uses out of `streams` open: one per lease at most, one at least.
pub fn runs(leases: usize, streams: usize) -> usize {
    streams.clamp(1, leases.max(1))
}

/// `leases` dealt to at most `streams` runs in turn, each run keeping their order: every stream
/// starts with its share of the first (the stalest), so all of them are renewed first.
pub fn deal(leases: &[i64], streams: usize) -> Vec<Vec<i64>> {
    let runs = runs(leases.len(), streams);
    let mut dealt: Vec<Vec<i64>> = (0..runs).map(|_| Vec::with_capacity(leases.len() / runs + 1)).collect();
    for (i, id) in leases.iter().enumerate() {
        dealt[i % runs].push(*id);
    }
    dealt.retain(|run| !run.is_empty());
    dealt
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
        assert_eq!(retry_delay(1, 1.0, false), Duration::from_millis(50));
        assert_eq!(retry_delay(2, 1.0, false), Duration::from_millis(100));
        assert_eq!(retry_delay(10, 1.0, false), RETRY_CAP);
        assert_eq!(retry_delay(30, 0.5, false), RETRY_CAP / 2);
    }

    #[test]
    fn credentials_refused_back_off_to_seconds() {
        assert!(refused("Unauthenticated: etcdserver: authentication failed, invalid user ID or password"));
        assert!(refused("connecting: ... PermissionDenied: etcdserver: permission denied"));
        assert!(refused("connecting: no member of the etcd can be used: http://b:2379: ... (AuthenticationFailed)"));
        assert!(!refused("no answer for 3s"));
        assert_eq!(retry_delay(1, 1.0, true), Duration::from_millis(50), "the first retry stays fast");
        assert_eq!(retry_delay(20, 1.0, true), REFUSED_RETRY_CAP);
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
    fn a_layout_the_measured_rate_cannot_renew_in_a_third_of_the_ttl_is_a_shortfall() {
        let ttl = Duration::from_secs(6);
        // 16,384 leases through one follower at 1,500 renewals a second on every stream: 10.9 s
        // a round against the 2 s a 6 s TTL allows.
        let slow = Measured { answered: 3_000, elapsed: Duration::from_secs(2), streams: MAX_STREAMS };
        let short = shortfall(16_384, slow, ttl).expect("a shortfall");
        assert_eq!((short.leases, short.streams), (16_384, MAX_STREAMS));
        assert!(short.rate == 1_500 && short.round > Duration::from_secs(10), "{short:?}");
        // The same rate at a 60 s TTL fits (20 s allowed).
        assert_eq!(shortfall(16_384, slow, Duration::from_secs(60)), None);
        // Fewer streams than the most, and a round that fits in half the TTL: the next round adds
        // streams before anything is said.
        let few = Measured { streams: 4, ..slow };
        assert_eq!(shortfall(16_384, few, Duration::from_secs(24)), None);
        // Fewer streams, but a round past half the TTL: said now, streams may not come in time.
        assert!(shortfall(16_384, few, Duration::from_secs(20)).is_some());
        assert!(shortfall(16_384, few, ttl).is_some());
        // No answer says nothing of the rate; nothing kept needs nothing.
        assert_eq!(shortfall(16_384, Measured { answered: 0, ..slow }, ttl), None);
        assert_eq!(shortfall(0, slow, ttl), None);
    }

    #[test]
    fn dealing_covers_every_lease_once_and_starts_every_stream_with_the_stalest() {
        let leases: Vec<i64> = (1..=10).collect();
        assert_eq!(deal(&leases, 3), vec![vec![1, 4, 7, 10], vec![2, 5, 8], vec![3, 6, 9]]);
        assert_eq!(deal(&leases, 20).len(), 10);
        assert_eq!(deal(&leases, 1), vec![leases.clone()]);
        assert!(deal(&[], 4).is_empty());
        // A round of one lease uses one of the streams open; none with nothing to renew but one.
        assert_eq!((runs(1, 3), runs(0, 3), runs(10, 3), runs(10, 0)), (1, 1, 3, 1));
    }

    #[test]
    fn the_stalest_leases_are_due_first_whatever_their_ids() {
        let t0 = Instant::now();
        let mut book = Book::new();
        book.insert(1, renewed(t0 + Duration::from_secs(3)));
        book.insert(2, Kept::default());
        book.insert(3, renewed(t0));
        book.insert(4, renewed(t0 + Duration::from_secs(1)));
        assert_eq!(timing().due(&book, t0 + Duration::from_secs(12)), vec![2, 3, 4, 1]);
    }

    #[test]
    fn a_round_of_a_few_leases_measures_nothing() {
        let target = Duration::from_secs(5);
        // A split's new lease renewed alone in 8 ms on one of 16 streams: a round trip, not a
        // rate; the streams stay, and no shortfall is read into it.
        let tiny = Measured { answered: 2, elapsed: Duration::from_millis(8), streams: 2 };
        assert!(!tiny.measures_rate());
        assert_eq!(streams_for(16_384, 16, Some(tiny), target), 16);
        assert_eq!(shortfall(16_423, tiny, Duration::from_secs(30)), None);
    }

    #[test]
    fn each_lease_lives_by_the_ttl_it_was_granted_not_the_one_configured_now() {
        // The TTL was raised to 60 s (keepalive 20 s); lease 1 was granted at 30 s, lease 2 at 60 s.
        let raised = Timing { ttl: Duration::from_secs(60), interval: Duration::from_secs(20), ceiling: INTERVAL };
        let t0 = Instant::now();
        let mut book = Book::new();
        book.insert(1, Kept { ttl: Some(TTL), ..renewed(t0) });
        book.insert(2, Kept { ttl: Some(Duration::from_secs(60)), ..renewed(t0) });
        // The 30 s lease is renewed every 10 s, a third of its own TTL, not every 20 s.
        assert_eq!(raised.next_round(&book, t0), Some(t0 + INTERVAL));
        assert_eq!(raised.due(&book, t0 + INTERVAL), vec![1, 2], "the 60 s lease is past half its interval too");
        assert_eq!(raised.due(&book, t0 + Duration::from_secs(6)), vec![1]);
        // Its time left, the round deadline and the degraded threshold come from 30 s.
        assert_eq!(raised.time_left(&book, t0 + INTERVAL), Some(Duration::from_secs(20)));
        assert_eq!(raised.stalest(&book), Some((t0, TTL)));
        let together = raised.of_book(&book);
        assert_eq!((together.ttl, together.interval), (TTL, INTERVAL));
        assert!(together.degraded(Duration::from_secs(11)));
        // Lowered to 12 s (keepalive 4 s): a 60 s lease still renewed every 4 s, lapsing by its own TTL.
        let lowered = Timing { ttl: Duration::from_secs(12), interval: Duration::from_secs(4), ceiling: INTERVAL };
        book.remove(&1);
        assert_eq!(lowered.next_round(&book, t0), Some(t0 + Duration::from_secs(4)));
        assert_eq!(lowered.time_left(&book, t0), Some(Duration::from_secs(60)));
        // Unknown until it answers: the configured TTL stands in.
        assert_eq!(lowered.ttl_of(&Kept::default()), Duration::from_secs(12));
    }

    #[test]
    fn degraded_is_a_round_past_a_third_of_the_ttl() {
        assert!(!timing().degraded(Duration::from_secs(10)));
        assert!(timing().degraded(Duration::from_millis(10_001)));
        assert_eq!(timing().target_round(), Duration::from_secs(5));
    }
}
