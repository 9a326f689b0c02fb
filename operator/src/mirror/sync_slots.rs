//! How many of one origin's workers run a full sync at once. A region that starts with many
//! peers (a full mesh, an operator's first start, a restore of the origin) owes every peer a
//! full sync at the same moment: each reads the whole subtree from the origin and writes it into
//! its peer. All at once, the origin etcd serves N-1 copies of its subtree together and every
//! peer takes N-1 writers together; at 32 regions on one machine the reads went unanswered for
//! longer than the RPC deadline and the failed sessions started their syncs over
//! (docs/scaling.md). Taking turns, each sync runs at the speed the etcds have for it and ends.
//!
//! A worker waits for a slot before it takes ownership of the peer, while the keeper already
//! renews every lease the peer's records name: waiting never lets a copy lapse, and the owner
//! record stays the predecessor's until the worker is about to write.
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Full syncs one origin's workers run at once. Four keeps a region with up to four peers (a
/// five-region mesh) syncing every peer at once, as before there were slots.
pub const FULL_SYNCS_AT_ONCE: usize = 4;

/// The slots an origin's workers share (`MirrorConfig::sync_slots`).
#[derive(Debug)]
pub struct SyncSlots {
    slots: Arc<Semaphore>,
    size: usize,
}

/// A slot held for one full sync; dropping it frees the slot.
pub type SyncSlot = OwnedSemaphorePermit;

impl SyncSlots {
    pub fn new(size: usize) -> Self {
        let size = size.max(1);
        SyncSlots { slots: Arc::new(Semaphore::new(size)), size }
    }

    /// A free slot now, if there is one.
    pub fn try_take(&self) -> Option<SyncSlot> {
        self.slots.clone().try_acquire_owned().ok()
    }

    /// Waits for a slot. The semaphore is never closed, so this ends only with a slot (or when
    /// the caller's future is dropped, on shutdown).
    pub async fn take(&self) -> SyncSlot {
        self.slots.clone().acquire_owned().await.expect("sync slots are never closed")
    }

    /// How many slots there are.
    pub fn size(&self) -> usize {
        self.size
    }
}

impl Default for SyncSlots {
    fn default() -> Self {
        SyncSlots::new(FULL_SYNCS_AT_ONCE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_slot_comes_free_when_a_sync_ends() {
        let slots = SyncSlots::new(2);
        let first = slots.try_take().expect("first");
        let _second = slots.try_take().expect("second");
        assert!(slots.try_take().is_none(), "two slots, both held");
        let waiting = tokio::spawn({
            let slots = Arc::new(slots);
            async move { slots.take().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        drop(first);
        let _slot =
            tokio::time::timeout(std::time::Duration::from_secs(5), waiting).await.expect("a slot").expect("task");
    }

    #[test]
    fn there_is_always_at_least_one_slot() {
        assert_eq!(SyncSlots::new(0).size(), 1);
        assert!(SyncSlots::new(0).try_take().is_some());
    }
}
