//! The sync's pace (pure): how many batch Txns to keep in flight, from how long they take.
//!
//! A peer etcd takes the syncs of every origin that writes into it (in a full mesh, all the
//! others), and queues what they send beyond what it applies. etcd 3.5+ answers a lease renewal
//! only once it has applied what it had committed, and gives up after a second: a queue longer
//! than that fails the renewals of every origin on that peer, and one that lasts a TTL lapses
//! the leases of live origins. So each worker reads the queue from its own Txns (the time one
//! takes beyond the fastest seen, or beyond the peer's round trip) and keeps it short:
//! - it starts with one Txn and doubles its window each round while the queue stays short (four
//!   times over while Txns queue under a quarter of the target: 150 ms away each round is a round
//!   trip), so that no worker puts a whole window in the queue before its first Txn says how the
//!   peer does;
//! - it halves the window when a Txn queued longer than `QUEUE_TARGET`, at most once a round
//!   (the Txns sent before the cut land late too), and then grows it by one Txn a round;
//! - below one Txn in flight, it waits between Txns (a window of a quarter sends one, then waits
//!   three times as long as it took), so that 31 origins syncing into one peer that applies
//!   a few Txns a second do not queue a Txn each;
//! - a worker's next sync starts where its last one left off (`SyncPace::resume`): a session
//!   that ended on a Txn that timed out left Txns queued at the peer, and the next one must not
//!   add a whole first window to them.
//!
//! Workers that share a peer see the same queue, so they all slow down, and each window ends
//! near its share of what the peer applies.
use std::time::Duration;

/// The queue a sync aims to stay under at the peer: half of etcd's wait for its applied index
/// (1 s) before it fails a renewal.
pub const QUEUE_TARGET: Duration = Duration::from_millis(500);

/// Txns a sync sends before the first one lands. At 4, eight origins starting at once into a peer
/// held to 5 % of a core queued about 8 s of its work, and leases lapsed at a TTL of 6 s
/// (`tests/overload.rs`); 150 ms away one Txn costs two round trips more than four.
pub const FIRST_WINDOW: usize = 1;

/// The smallest window: one Txn, then a wait fifteen times as long as it took.
pub const MIN_WINDOW: f64 = 1.0 / 16.0;

/// The window of one sync's batch Txns.
#[derive(Clone, Debug)]
pub struct SyncPace {
    /// Never more in flight than this (`plan::sync_window`).
    limit: usize,
    window: f64,
    /// The fastest a Txn can take: the shortest seen, or the peer's round trip if shorter.
    fastest: Option<Duration>,
    /// Up to this window it doubles each round (no queue seen since it was set).
    doubling_below: f64,
    /// Txns landed since the last cut, and how many were in flight at it.
    landed_since_cut: usize,
    in_flight_at_cut: usize,
    /// What the last Txn took: the wait between Txns below one in flight is measured in it.
    last_took: Duration,
    cuts: u64,
}

impl SyncPace {
    /// A sync's pace with at most `limit` Txns in flight, to a peer `distance` away (the round
    /// trip measured beyond this machine's, if measured).
    pub fn new(limit: usize, distance: Option<Duration>) -> Self {
        let limit = limit.max(1);
        SyncPace {
            limit,
            window: FIRST_WINDOW.min(limit) as f64,
            fastest: distance,
            doubling_below: f64::INFINITY,
            landed_since_cut: 0,
            in_flight_at_cut: 0,
            last_took: Duration::ZERO,
            cuts: 0,
        }
    }

    /// The next sync's pace, after `last` (the worker's previous sync, if any): it starts no
    /// wider than the last one ended and doubles back up to it, then grows a Txn a round.
    pub fn resume(limit: usize, distance: Option<Duration>, last: Option<&SyncPace>) -> Self {
        let mut pace = SyncPace::new(limit, distance);
        if let Some(last) = last {
            pace.window = pace.window.min(last.window);
            // Back to where the last one ended at full speed only if a queue ever cut it: after
            // syncs that never queued (a small one ends at a small window) it opens as a first.
            if last.doubling_below.is_finite() {
                pace.doubling_below = last.window;
            }
            pace.last_took = last.last_took;
            pace.cuts = last.cuts;
            pace.fastest = crate::mirror::plan::nearest(pace.fastest, last.fastest);
        }
        pace
    }

    /// Txns to keep in flight now (at least one: below that, `hold` spaces them out).
    pub fn window(&self) -> usize {
        (self.window as usize).clamp(1, self.limit)
    }

    /// How long to wait before the next Txn, `since` the last one landed: only below one Txn
    /// in flight. Measured in what the last Txn took, at most twice the target past the fastest:
    /// a Txn that took seconds waited behind a queue that is applied by the time it lands.
    pub fn hold(&self, since: Duration) -> Duration {
        if self.window >= 1.0 {
            return Duration::ZERO;
        }
        let basis = self.last_took.min(self.fastest.unwrap_or_default() + 2 * QUEUE_TARGET);
        basis.mul_f64(1.0 / self.window - 1.0).saturating_sub(since)
    }

    /// How long a Txn queued at the peer, from what it took.
    pub fn queued(&self, took: Duration) -> Duration {
        took.saturating_sub(self.fastest.unwrap_or(took))
    }

    /// A Txn landed after `took`.
    pub fn landed(&mut self, took: Duration) {
        self.fastest = Some(self.fastest.map_or(took, |f| f.min(took)));
        self.last_took = took;
        self.landed_since_cut += 1;
        let grown = if self.queued(took) > QUEUE_TARGET {
            self.cut();
            return;
        } else if self.window < 1.0 {
            self.window * 1.25
        } else if self.window < self.doubling_below {
            let quick = self.queued(took) < QUEUE_TARGET / 4;
            let grown = self.window + if quick { 3.0 } else { 1.0 };
            grown.min(self.doubling_below.max(self.window + 1.0))
        } else {
            self.window + 1.0 / self.window
        };
        self.window = grown.min(self.limit as f64);
    }

    /// The most Txns it lets in flight.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// A Txn failed after `took`: a failure that came back fast says nothing of the peer's
    /// queue (and must not pass for the fastest Txn); one that took past the target (a timeout)
    /// counts as a queue.
    pub fn failed(&mut self, took: Duration) {
        self.landed_since_cut += 1;
        if self.queued(took) > QUEUE_TARGET {
            self.cut();
        }
    }

    /// How often the queue halved the window.
    pub fn cuts(&self) -> u64 {
        self.cuts
    }

    /// Halves the window, unless the Txn that asks was sent before the last cut.
    fn cut(&mut self) {
        if self.landed_since_cut <= self.in_flight_at_cut {
            return;
        }
        self.cuts += 1;
        self.in_flight_at_cut = self.window();
        self.landed_since_cut = 0;
        self.window = (self.window / 2.0).max(MIN_WINDOW);
        self.doubling_below = self.window;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Lands a round: as many Txns as the window, each after `took`.
    fn round(pace: &mut SyncPace, took: Duration) {
        for _ in 0..pace.window() {
            pace.landed(took);
        }
    }

    /// Lands rounds of Txns that queue a little (half the target: the window doubles) until the
    /// window is `window`.
    fn grow_to(pace: &mut SyncPace, window: usize) {
        let fastest = pace.fastest.expect("a pace whose distance is known");
        while pace.window() < window {
            round(pace, fastest + QUEUE_TARGET / 2);
        }
        assert_eq!(pace.window(), window);
    }

    /// The windows of each round until the limit, each Txn taking `took`.
    fn rounds_to_the_limit(pace: &mut SyncPace, took: Duration) -> Vec<usize> {
        let mut windows = vec![pace.window()];
        while pace.window() < pace.limit {
            round(pace, took);
            windows.push(pace.window());
        }
        windows
    }

    #[test]
    fn a_sync_starts_with_one_txn_and_grows_fourfold_a_round_while_nothing_queues_twofold_while_little_does() {
        let mut pace = SyncPace::new(124, Some(ms(150)));
        let windows = rounds_to_the_limit(&mut pace, ms(155));
        assert_eq!(windows, vec![1, 4, 16, 64, 124], "150 ms away the full window in four round trips");
        let mut pace = SyncPace::new(124, Some(ms(150)));
        let windows = rounds_to_the_limit(&mut pace, ms(150) + QUEUE_TARGET / 2);
        assert_eq!(windows, vec![1, 2, 4, 8, 16, 32, 64, 124], "Txns that queue half the target: seven");
        assert_eq!(pace.cuts(), 0);
    }

    #[test]
    fn the_window_never_passes_its_limit_and_starts_within_it() {
        let mut pace = SyncPace::new(2, None);
        assert!(pace.window() <= 2);
        for _ in 0..100 {
            pace.landed(ms(1));
        }
        assert_eq!(pace.window(), 2);
        assert_eq!(SyncPace::new(0, None).window(), 1, "at least one Txn in flight");
    }

    #[test]
    fn a_queue_past_the_target_halves_the_window_once_a_round() {
        let mut pace = SyncPace::new(128, Some(ms(0)));
        grow_to(&mut pace, 16);
        let late = QUEUE_TARGET + ms(150);
        pace.landed(late);
        assert_eq!(pace.window(), 8, "halved");
        for _ in 0..16 {
            pace.landed(late);
        }
        assert_eq!(pace.window(), 8, "the Txns sent before the cut do not cut it again");
        pace.landed(late);
        assert_eq!(pace.window(), 4, "a Txn sent after the cut that queued too");
        assert_eq!(pace.cuts(), 2);
    }

    #[test]
    fn after_a_cut_the_window_grows_by_one_a_round() {
        let mut pace = SyncPace::new(128, Some(ms(0)));
        grow_to(&mut pace, 8);
        let late = QUEUE_TARGET + ms(50);
        pace.landed(late);
        let cut = pace.window();
        for _ in 0..8 {
            pace.landed(late); // the rest of the cut round
        }
        assert_eq!((cut, pace.window()), (4, 4));
        round(&mut pace, ms(5));
        assert!(pace.window() <= 5, "not a doubling: {}", pace.window());
        for _ in 0..7 {
            round(&mut pace, ms(5));
        }
        assert!((10..=12).contains(&pace.window()), "about one Txn a round: {}", pace.window());
    }

    #[test]
    fn the_queue_is_measured_beyond_the_peers_round_trip() {
        let far = SyncPace::new(128, Some(ms(150)));
        assert_eq!(far.queued(ms(350)), ms(200), "150 ms of it is the distance");
        let mut pace = SyncPace::new(128, Some(ms(150)));
        round(&mut pace, ms(150) + QUEUE_TARGET - ms(10));
        assert!(pace.window() > FIRST_WINDOW, "just under the target beyond the round trip");
        let mut pace = SyncPace::new(128, None);
        pace.landed(ms(20));
        assert_eq!(pace.queued(ms(500)), ms(480), "beyond the fastest Txn seen, when the distance is not known");
    }

    #[test]
    fn below_one_txn_in_flight_the_txns_are_spaced_out() {
        let mut pace = SyncPace::new(16, None);
        pace.landed(ms(100));
        assert_eq!(pace.hold(ms(0)), ms(0), "one Txn in flight or more: no wait");
        let slow = ms(100) + QUEUE_TARGET + ms(200);
        for _ in 0..40 {
            pace.landed(slow);
        }
        assert_eq!(pace.window(), 1);
        assert_eq!(pace.hold(ms(0)), slow * 15, "the smallest window: a wait of fifteen Txns");
        assert_eq!(pace.hold(ms(1000)), slow * 15 - ms(1000), "counted from the landing");
        let before = pace.hold(ms(0));
        pace.landed(ms(150));
        assert!(pace.hold(ms(0)) < before, "a Txn that did not queue shortens the wait");
    }

    #[test]
    fn the_next_sync_starts_no_wider_than_the_last_ended_and_doubles_back_to_it() {
        let mut last = SyncPace::new(128, Some(ms(150)));
        grow_to(&mut last, 64);
        last.landed(ms(150) + QUEUE_TARGET + ms(100));
        assert_eq!(last.window(), 32, "cut once");
        let mut next = SyncPace::resume(128, Some(ms(150)), Some(&last));
        assert_eq!(next.window(), FIRST_WINDOW, "a first window, as a new worker's");
        grow_to(&mut next, 32);
        round(&mut next, ms(155));
        assert_eq!(next.window(), 32, "then a Txn a round: {}", next.window());

        let mut slow = SyncPace::new(128, None);
        slow.landed(ms(10));
        for _ in 0..40 {
            slow.landed(ms(10) + QUEUE_TARGET + ms(100));
        }
        let next = SyncPace::resume(128, None, Some(&slow));
        assert_eq!(next.window(), 1);
        assert!(next.hold(ms(0)) > ms(0), "a sync after one that ended at a queue keeps its pace");
        assert_eq!(SyncPace::resume(128, None, None).window(), FIRST_WINDOW);
    }

    #[test]
    fn a_sync_after_syncs_that_never_queued_opens_as_fast_as_a_first() {
        let mut small = SyncPace::new(128, Some(ms(150)));
        small.landed(ms(155)); // a subtree of one Txn
        let mut next = SyncPace::resume(128, Some(ms(150)), Some(&small));
        assert_eq!(rounds_to_the_limit(&mut next, ms(155)), vec![1, 4, 16, 64, 128]);
    }

    #[test]
    fn the_wait_between_txns_is_not_measured_in_a_txn_that_took_seconds() {
        let mut pace = SyncPace::new(16, Some(ms(0)));
        for _ in 0..40 {
            pace.landed(ms(9_000));
        }
        assert_eq!(pace.window(), 1);
        assert_eq!(pace.hold(ms(0)), 2 * QUEUE_TARGET * 15, "at most twice the target past the fastest, fifteen times");
    }

    #[test]
    fn a_failed_txn_is_not_the_fastest_and_cuts_only_if_it_took_past_the_target() {
        let mut pace = SyncPace::new(128, Some(ms(150)));
        grow_to(&mut pace, 16);
        pace.failed(ms(1)); // a broken connection, answered at once
        assert_eq!(pace.queued(ms(160)), ms(10), "the distance still counts as the fastest");
        assert_eq!(pace.window(), 16);
        pace.failed(ms(150) + QUEUE_TARGET + ms(2_000)); // timed out
        assert_eq!(pace.window(), 8);
    }

    proptest::proptest! {
        /// Whatever the peer answers, the window stays within 1..=limit, and a peer that queues
        /// every Txn past the target for long enough brings any window to the smallest: one Txn,
        /// then a wait fifteen times as long.
        #[test]
        fn the_window_stays_in_bounds_and_a_queue_that_lasts_brings_it_to_the_smallest(
            limit in 1usize..200,
            distance in proptest::option::of(0u64..300),
            tooks in proptest::collection::vec(0u64..3_000, 0..400),
        ) {
            let mut pace = SyncPace::new(limit, distance.map(ms));
            for took in tooks {
                pace.landed(ms(took));
                proptest::prop_assert!((1..=limit).contains(&pace.window()));
                proptest::prop_assert!(pace.hold(ms(0)) <= ms(took) * 15);
            }
            if pace.fastest.is_none() {
                pace.landed(ms(1)); // a Txn to measure the queue from
            }
            let slow = pace.fastest.unwrap_or_default() + QUEUE_TARGET + ms(1);
            for _ in 0..(2 * limit + 20) {
                pace.landed(slow);
            }
            proptest::prop_assert_eq!(pace.window(), 1);
            proptest::prop_assert_eq!(pace.hold(ms(0)), slow * 15);
        }
    }
}
