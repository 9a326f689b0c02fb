//! Faults a test injects into a debug build of the operator, to see that what
//! [`crate::supervise`] promises holds in the running process: `AETHER_FAULTS=keeper=1,controller=always`
//! makes the keeper panic at its next renewal round and the RegionPeering reconciler at every
//! reconcile. Release builds (the image, the krew archives) have no fault points: [`point`] is
//! empty there and the variable is never read.

/// How many times each named point panics: a count, or `always`.
#[cfg(any(debug_assertions, test))]
fn parse(spec: &str) -> Vec<(String, u64)> {
    spec.split(',')
        .filter_map(|term| term.split_once('='))
        .filter_map(|(name, times)| {
            let times = match times.trim() {
                "always" => u64::MAX,
                n => n.parse().ok()?,
            };
            Some((name.trim().to_string(), times))
        })
        .collect()
}

/// Panics if `AETHER_FAULTS` asks the point `name` to, in a debug build; nothing otherwise.
#[cfg(debug_assertions)]
pub fn point(name: &str) {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static POINTS: OnceLock<Vec<(String, AtomicU64)>> = OnceLock::new();
    let points = POINTS.get_or_init(|| {
        parse(&std::env::var("AETHER_FAULTS").unwrap_or_default())
            .into_iter()
            .map(|(name, times)| (name, AtomicU64::new(times)))
            .collect()
    });
    let Some((_, left)) = points.iter().find(|(n, _)| n == name) else { return };
    let take = |n: u64| match n {
        0 => None,
        u64::MAX => Some(u64::MAX),
        n => Some(n - 1),
    };
    if left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, take).is_ok() {
        panic!("a fault injected at {name} (AETHER_FAULTS)");
    }
}

/// Release builds: no fault points.
#[cfg(not(debug_assertions))]
#[inline(always)]
pub fn point(_name: &str) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_names_points_and_counts() {
        assert_eq!(
            parse("keeper=1, controller=always,bad,worker=x"),
            vec![("keeper".to_string(), 1), ("controller".to_string(), u64::MAX)]
        );
        assert!(parse("").is_empty());
    }
}
