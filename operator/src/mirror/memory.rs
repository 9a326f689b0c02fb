//! The process's budget of bytes the mirror holds for writes on their way: revisions received from
//! an origin's watch and not yet applied (Txns in flight included), a sync's Txns in flight and
//! the pages it reads ahead. Every worker of the process shares one budget (`--memory-budget-mib`),
//! so that a failover catch-up of large values into several peers at once, or full syncs side by
//! side, stay within what the pod may use, whatever the number of workers; each worker keeps its
//! own bounds as well (`MirrorConfig::max_pending_bytes`).
//!
//! Each part of a worker that holds bytes has a [`Held`] share. It may take more while the process
//! is under its budget, or while it holds nothing: a part with nothing pending may always take one
//! more revision or page, so no worker stalls behind the others, and the process exceeds the
//! budget by at most one unit of each part at a time.
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The CRD-independent default: the chart's pod is limited to 256 MiB.
pub const DEFAULT_BUDGET_BYTES: usize = 96 << 20;

#[derive(Debug)]
pub struct MemoryBudget {
    limit: usize,
    used: AtomicUsize,
}

impl Default for MemoryBudget {
    fn default() -> Self {
        MemoryBudget { limit: DEFAULT_BUDGET_BYTES, used: AtomicUsize::new(0) }
    }
}

impl MemoryBudget {
    pub fn new(limit: usize) -> Arc<MemoryBudget> {
        Arc::new(MemoryBudget { limit: limit.max(1 << 20), used: AtomicUsize::new(0) })
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes held now, by every share.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// A new share, holding nothing.
    pub fn share(self: &Arc<Self>) -> Held {
        Held { budget: self.clone(), bytes: 0 }
    }
}

/// One part's share of the budget.
#[derive(Debug)]
pub struct Held {
    budget: Arc<MemoryBudget>,
    bytes: usize,
}

impl Held {
    /// This part holds `now` bytes from here on.
    pub fn set(&mut self, now: usize) {
        if now >= self.bytes {
            self.budget.used.fetch_add(now - self.bytes, Ordering::Relaxed);
        } else {
            self.budget.used.fetch_sub(self.bytes - now, Ordering::Relaxed);
        }
        self.bytes = now;
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether this part may take more: it holds nothing, or the process is under its budget.
    pub fn may_grow(&self) -> bool {
        self.bytes == 0 || self.budget.used() < self.budget.limit
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.set(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_add_up_and_each_may_always_take_one_more_when_it_holds_nothing() {
        let budget = MemoryBudget::new(10 << 20);
        let (mut a, mut b) = (budget.share(), budget.share());
        a.set(6 << 20);
        assert!(a.may_grow() && b.may_grow());
        b.set(5 << 20);
        assert_eq!(budget.used(), 11 << 20);
        assert!(!a.may_grow() && !b.may_grow(), "over the budget: neither takes more");
        let c = budget.share();
        assert!(c.may_grow(), "a part holding nothing always takes one more");
        a.set(1 << 20);
        assert!(a.may_grow() && b.may_grow());
        drop(b);
        assert_eq!(budget.used(), 1 << 20, "a share dropped gives its bytes back");
        drop(a);
        assert_eq!(budget.used(), 0);
    }
}
