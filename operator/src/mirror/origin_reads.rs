//! One read of the origin for the full syncs its workers run at once. A region that owes several
//! peers a full sync at the same moment (an operator's first start, a new region in a mesh)
//! read its whole subtree once per peer, and the origin etcd paid for each read: at 100k keys
//! into 4 peers it spent 9x the CPU of one read (docs/performance.md).
//!
//! The workers of one object share this: the first sync to start pins the snapshot (the revision
//! and the subtree's size at it), and a sync that starts within [`SHARE_WINDOW`] of it, against
//! the same origin cluster, copies the same snapshot. Their page reads are then the same reads
//! (the same cursor, end and limit at the same revision), so each is made once: the first sync
//! to need a page reads it, the others that need it meanwhile wait for that read rather than make
//! their own, and later ones take it from what is kept.
//!
//! Pages are kept while another sync copies the same snapshot or may still start to (within the
//! window: the worker of a peer 150 ms away owns its peer and pins several round trips after the
//! near peer's sync read its first pages, or even ended), and are let go when the last sync ends
//! and the window has passed, or when the window has passed with one sync alone on the snapshot
//! (it read them itself); what is kept is bounded ([`KEPT_BYTES`]), the oldest pages going
//! first. A sync
//! whose peer is slower falls so far behind that the pages it needs are gone, and reads them
//! itself: nobody waits on a slower peer, and each worker's health counts the pages it read and
//! those it was given. A snapshot older than the window, or of another cluster (the origin
//! replaced, or the object now naming another etcd), is never shared, nor with a sync because the
//! origin was restored, nor with a worker that already sent its peer a newer revision (a resync the
//! watch asked for: copied from the older snapshot, the merge would take the peer back, delete
//! what was created since, and the watch put it back), nor with one that took its peer's mirror
//! over from another Pod whose sync was cut short (what that sync copied is recorded nowhere):
//! those pin their own.
use crate::mirror::plan::Kv;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::OnceCell;

/// How long after a sync pins its snapshot another may copy the same one: the syncs one start
/// owes begin within moments of each other, and a copy's revision is the older by at most this
/// (its watch replays what came after).
pub const SHARE_WINDOW: Duration = Duration::from_secs(10);

/// The most page bytes kept for the syncs behind the first reader.
pub const KEPT_BYTES: usize = 8 << 20;

/// A snapshot of the origin's subtree as a sync pins it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pinned {
    pub cluster_id: u64,
    pub revision: i64,
    pub total: u64,
}

/// One read of the origin: its keys and whether more follow in the range read.
#[derive(Debug)]
pub struct SharedPage {
    pub kvs: Vec<Kv>,
    pub more: bool,
}

/// A page read: the cursor, the end of the range read and the limit, at the shared revision.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct PageKey {
    pub from: Vec<u8>,
    pub read_end: Vec<u8>,
    pub limit: i64,
}

type Slot = Arc<OnceCell<Arc<SharedPage>>>;

/// The reads one object's workers share (`MirrorConfig::origin_reads`).
#[derive(Debug, Default)]
pub struct OriginReads {
    /// Held while a snapshot is pinned, so that syncs starting together pin one.
    pinning: tokio::sync::Mutex<()>,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    snapshot: Option<(Pinned, Instant)>,
    /// Counts the snapshots pinned: a sync's end or a window's end is of one of them.
    generation: u64,
    /// Syncs copying the snapshot now.
    copiers: usize,
    /// Syncs that copied it at all: a sync alone on its snapshot past the window needs none of
    /// the pages it read itself, and they go.
    sharers: usize,
    pages: HashMap<PageKey, Slot>,
    /// Pages kept, oldest first, with their bytes.
    kept: VecDeque<(PageKey, usize)>,
    kept_bytes: usize,
}

impl Inner {
    fn let_go(&mut self) {
        self.pages.clear();
        self.kept.clear();
        self.kept_bytes = 0;
    }
}

/// What of an earlier sync's snapshot a sync may copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reuse {
    /// Nothing: the origin was restored or replaced; the sync pins its own.
    Never,
    /// A snapshot at this revision or newer: the worker may already have sent its peer the origin
    /// through this revision, and a copy from an older snapshot would take the peer back.
    NoOlderThan(i64),
}

/// Whether a sync starting `now` that may `reuse` copies the snapshot pinned `pinned_at` (pure).
pub fn shares_snapshot(pinned: &Pinned, pinned_at: Instant, cluster_id: u64, now: Instant, reuse: Reuse) -> bool {
    let new_enough = match reuse {
        Reuse::Never => false,
        Reuse::NoOlderThan(floor) => pinned.revision >= floor,
    };
    new_enough && pinned.cluster_id == cluster_id && now.saturating_duration_since(pinned_at) < SHARE_WINDOW
}

impl OriginReads {
    /// The snapshot a sync of the origin `cluster_id` copies: one pinned within the window that
    /// `reuse` allows, or a new one from `pin` (which counts the subtree), which later syncs then
    /// share. The sync copies it while it holds the returned [`Copying`].
    pub async fn pin<F, Fut>(
        self: &Arc<Self>,
        cluster_id: u64,
        reuse: Reuse,
        pin: F,
    ) -> anyhow::Result<(Pinned, Copying)>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<Pinned>>,
    {
        let _pinning = self.pinning.lock().await;
        let (pinned, generation) = match self.join(cluster_id, Instant::now(), reuse) {
            Some(shared) => shared,
            None => {
                let pinned = pin().await?;
                let at = Instant::now();
                let mut inner = self.lock();
                inner.let_go();
                inner.snapshot = Some((pinned, at));
                inner.generation += 1;
                (inner.copiers, inner.sharers) = (1, 1);
                let generation = inner.generation;
                drop(inner);
                self.let_go_at_window_end_if_alone(generation, at + SHARE_WINDOW);
                (pinned, generation)
            }
        };
        Ok((pinned, Copying { reads: self.clone(), generation }))
    }

    /// The snapshot shared now, if this sync may copy it, counted as copied in the same lock
    /// (so that nothing lets its pages go in between).
    fn join(&self, cluster_id: u64, now: Instant, reuse: Reuse) -> Option<(Pinned, u64)> {
        let mut inner = self.lock();
        let (pinned, at) = inner.snapshot?;
        if !shares_snapshot(&pinned, at, cluster_id, now, reuse) {
            return None;
        }
        inner.copiers += 1;
        inner.sharers += 1;
        Some((pinned, inner.generation))
    }

    /// At the window's end, the pages of a snapshot only one sync copied go: no sync may start to
    /// copy it any more, and the one that did read them itself.
    fn let_go_at_window_end_if_alone(self: &Arc<Self>, generation: u64, window_ends: Instant) {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            self.let_go_at(&runtime, generation, window_ends, |inner| inner.sharers == 1);
        }
    }

    /// Lets the pages of the snapshot pinned as `generation` go at `when`, if it is still the
    /// shared one and `still` holds then (a task holding no reference that keeps them).
    fn let_go_at(
        self: &Arc<Self>,
        runtime: &tokio::runtime::Handle,
        generation: u64,
        when: Instant,
        still: fn(&Inner) -> bool,
    ) {
        let reads = Arc::downgrade(self);
        runtime.spawn(async move {
            tokio::time::sleep_until(when.into()).await;
            let Some(reads) = reads.upgrade() else { return };
            let mut inner = reads.lock();
            if inner.generation == generation && still(&inner) {
                inner.let_go();
            }
        });
    }

    /// The page `key` of the snapshot at `revision`: read once by `read`, by whichever sync asks
    /// first; the others wait for that read, or take it while it is kept. Returns the page and
    /// whether this call read it. A snapshot no longer the shared one is read, not kept.
    pub async fn page<F, Fut>(&self, revision: i64, key: PageKey, read: F) -> anyhow::Result<(Arc<SharedPage>, bool)>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<SharedPage>>,
    {
        let slot = {
            let mut inner = self.lock();
            match inner.snapshot {
                Some((pinned, _)) if pinned.revision == revision => {
                    Some(inner.pages.entry(key.clone()).or_default().clone())
                }
                _ => None,
            }
        };
        let Some(slot) = slot else { return Ok((Arc::new(read().await?), true)) };
        let mut read_here = false;
        let page = slot
            .get_or_try_init(|| async {
                read_here = true;
                read().await.map(Arc::new)
            })
            .await?
            .clone();
        if read_here {
            self.keep(revision, key, page.kvs.iter().map(|kv| kv.key.len() + kv.value.len()).sum());
        }
        Ok((page, read_here))
    }

    /// Keeps a page read while another sync copies its snapshot, and lets the oldest go past
    /// [`KEPT_BYTES`].
    fn keep(&self, revision: i64, key: PageKey, bytes: usize) {
        let mut inner = self.lock();
        let wanted = match inner.snapshot {
            Some((pinned, at)) if pinned.revision == revision => {
                inner.copiers >= 2 || Instant::now().saturating_duration_since(at) < SHARE_WINDOW
            }
            // A new snapshot let this one's pages go; a slot of the same key is the new one's.
            _ => return,
        };
        if !wanted {
            inner.pages.remove(&key); // nobody else needs it, nor can any sync start to
            return;
        }
        inner.kept.push_back((key, bytes));
        inner.kept_bytes += bytes;
        while inner.kept_bytes > KEPT_BYTES {
            let Some((oldest, bytes)) = inner.kept.pop_front() else { break };
            inner.pages.remove(&oldest);
            inner.kept_bytes -= bytes;
        }
    }

    /// A sync of the snapshot pinned as `generation` ended. The last one lets the pages go: at once when
    /// the window has passed, else when it does (a sync may still start and be given them).
    fn copied(self: &Arc<Self>, generation: u64) {
        let mut inner = self.lock();
        // Another snapshot since (even at the same revision, pinned again): this one's count went.
        let Some((_, at)) = inner.snapshot.filter(|_| inner.generation == generation) else { return };
        inner.copiers = inner.copiers.saturating_sub(1);
        if inner.copiers > 0 {
            return;
        }
        let window_ends = at + SHARE_WINDOW;
        let runtime = match tokio::runtime::Handle::try_current() {
            Ok(runtime) if Instant::now() < window_ends => runtime,
            _ => return inner.let_go(),
        };
        drop(inner);
        // Unless a sync shared it since, or another was pinned.
        self.let_go_at(&runtime, generation, window_ends, |inner| inner.copiers == 0);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Page bytes kept now.
    pub fn kept_bytes(&self) -> usize {
        self.lock().kept_bytes
    }
}

/// A sync copying a pinned snapshot; the pages it shares are let go when the last one ends and
/// the window has passed.
#[derive(Debug)]
pub struct Copying {
    reads: Arc<OriginReads>,
    generation: u64,
}

impl Drop for Copying {
    fn drop(&mut self) {
        self.reads.copied(self.generation);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A sync that has sent its peer nothing yet.
    const ANY: Reuse = Reuse::NoOlderThan(0);

    fn pinned(cluster_id: u64, revision: i64) -> Pinned {
        Pinned { cluster_id, revision, total: 3 }
    }

    fn key(from: &str) -> PageKey {
        PageKey { from: from.as_bytes().to_vec(), read_end: b"z".to_vec(), limit: 2 }
    }

    fn page_of(bytes: usize) -> SharedPage {
        SharedPage { kvs: vec![Kv { key: b"k".to_vec(), value: vec![b'v'; bytes - 1], lease: 0 }], more: true }
    }

    /// Two syncs copying the snapshot at revision 100.
    async fn two_copying(reads: &Arc<OriginReads>) -> (Copying, Copying) {
        let (_, a) = reads.pin(7, ANY, || async { Ok(pinned(7, 100)) }).await.unwrap();
        let (_, b) = reads.pin(7, ANY, || async { Ok(pinned(7, 101)) }).await.unwrap();
        (a, b)
    }

    #[test]
    fn a_snapshot_is_shared_within_the_window_and_only_with_its_own_cluster() {
        let at = Instant::now();
        let p = pinned(7, 100);
        assert!(shares_snapshot(&p, at, 7, at + Duration::from_secs(9), ANY));
        assert!(!shares_snapshot(&p, at, 7, at + SHARE_WINDOW, ANY), "too old: the next sync pins its own");
        assert!(!shares_snapshot(&p, at, 8, at, ANY), "another cluster (the origin replaced)");
        assert!(!shares_snapshot(&p, at, 7, at, Reuse::Never), "the origin restored");
    }

    #[test]
    fn a_sync_never_copies_a_snapshot_older_than_what_its_worker_already_sent() {
        let at = Instant::now();
        let p = pinned(7, 100);
        assert!(shares_snapshot(&p, at, 7, at, Reuse::NoOlderThan(100)), "the peer holds exactly the snapshot");
        assert!(
            !shares_snapshot(&p, at, 7, at, Reuse::NoOlderThan(101)),
            "a resync after the watch sent revision 101 would take the peer back to 100"
        );
    }

    #[tokio::test]
    async fn syncs_starting_together_pin_one_snapshot_and_another_cluster_or_a_restore_pins_its_own() {
        let reads = Arc::new(OriginReads::default());
        let pins = AtomicUsize::new(0);
        let pin = |revision| {
            let pins = &pins;
            move || async move {
                pins.fetch_add(1, Ordering::SeqCst);
                Ok(pinned(7, revision))
            }
        };
        let (a, b) = tokio::join!(reads.pin(7, ANY, pin(100)), reads.pin(7, ANY, pin(101)));
        assert_eq!((a.unwrap().0.revision, b.unwrap().0.revision), (100, 100));
        assert_eq!(pins.load(Ordering::SeqCst), 1, "one count of the subtree");
        let (other, _) = reads.pin(8, ANY, || async { Ok(pinned(8, 5)) }).await.unwrap();
        assert_eq!(other, pinned(8, 5));
        let (restored, _) = reads.pin(8, Reuse::Never, || async { Ok(pinned(8, 2)) }).await.unwrap();
        assert_eq!(restored.revision, 2, "a sync because the origin was restored pins its own");
    }

    #[tokio::test]
    async fn a_page_is_read_once_for_the_syncs_that_need_it_together_or_after() {
        let reads = Arc::new(OriginReads::default());
        let _copying = two_copying(&reads).await;
        let made = AtomicUsize::new(0);
        let read = || async {
            made.fetch_add(1, Ordering::SeqCst);
            tokio::task::yield_now().await;
            Ok(page_of(10))
        };
        let (a, b) = tokio::join!(reads.page(100, key("a"), read), reads.page(100, key("a"), read));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(made.load(Ordering::SeqCst), 1);
        assert!(a.1 != b.1, "one of them read it");
        assert!(Arc::ptr_eq(&a.0, &b.0));
        let (_, read_here) = reads.page(100, key("a"), read).await.unwrap();
        assert!(!read_here, "kept for a later sync");
        // Another revision (a sync with a snapshot of its own) reads and keeps nothing.
        let (_, read_here) = reads.page(99, key("a"), read).await.unwrap();
        assert!(read_here);
        assert_eq!(reads.kept_bytes(), 10);
    }

    #[tokio::test]
    async fn pages_read_within_the_window_are_kept_for_a_sync_that_starts_later_even_after_the_first_ended() {
        let reads = Arc::new(OriginReads::default());
        let (_, near) = reads.pin(7, ANY, || async { Ok(pinned(7, 100)) }).await.unwrap();
        let (_, read_here) = reads.page(100, key("a"), || async { Ok(page_of(10)) }).await.unwrap();
        assert!(read_here);
        assert_eq!(reads.kept_bytes(), 10, "kept for a worker whose peer is farther and pins later");
        drop(near);
        assert_eq!(reads.kept_bytes(), 10, "the first sync ended, the window has not");
        let (_, far) = reads.pin(7, ANY, || async { Ok(pinned(7, 101)) }).await.unwrap();
        let (_, read_here) = reads.page(100, key("a"), || async { Ok(page_of(10)) }).await.unwrap();
        assert!(!read_here, "the sync that started later is given the page the first one read");
        drop(far);
    }

    #[tokio::test]
    async fn pages_are_let_go_when_the_window_has_passed_and_no_sync_copies() {
        let reads = Arc::new(OriginReads::default());
        let (_, first) = reads.pin(7, ANY, || async { Ok(pinned(7, 100)) }).await.unwrap();
        reads.page(100, key("a"), || async { Ok(page_of(10)) }).await.unwrap();
        // As if pinned almost a window ago: the window ends in 100 ms.
        reads.lock().snapshot.as_mut().unwrap().1 -= SHARE_WINDOW - Duration::from_millis(100);
        drop(first);
        assert_eq!(reads.kept_bytes(), 10, "kept until the window ends");
        let deadline = Instant::now() + Duration::from_secs(5);
        while reads.kept_bytes() > 0 {
            assert!(Instant::now() < deadline, "pages still kept 5 s after the window ended");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Past the window, a sync alone keeps nothing it reads.
        let (_, late) = reads.pin(7, ANY, || async { Ok(pinned(7, 100)) }).await.unwrap();
        reads.lock().snapshot.as_mut().unwrap().1 -= SHARE_WINDOW;
        reads.page(100, key("b"), || async { Ok(page_of(10)) }).await.unwrap();
        assert_eq!(reads.kept_bytes(), 0);
        drop(late);
    }

    #[tokio::test]
    async fn a_sync_alone_on_its_snapshot_keeps_nothing_past_the_window_while_it_still_copies() {
        let reads = Arc::new(OriginReads::default());
        let (_, long) = reads.pin(7, ANY, || async { Ok(pinned(7, 100)) }).await.unwrap();
        reads.page(100, key("a"), || async { Ok(page_of(10)) }).await.unwrap();
        assert_eq!(reads.kept_bytes(), 10, "kept within the window: another sync may still start");
        // Nobody else started within the window: its pages serve nobody while it copies on.
        let deadline = Instant::now() + SHARE_WINDOW + Duration::from_secs(5);
        while reads.kept_bytes() > 0 {
            assert!(Instant::now() < deadline, "a lone sync's pages still kept 5 s after the window");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        drop(long);
    }

    #[tokio::test]
    async fn a_sync_ending_after_the_snapshot_was_pinned_again_at_the_same_revision_leaves_the_new_count_alone() {
        let reads = Arc::new(OriginReads::default());
        let (_, old) = reads.pin(7, ANY, || async { Ok(pinned(7, 100)) }).await.unwrap();
        // An idle origin: the next snapshot, past the window, is at the same revision.
        reads.lock().snapshot.as_mut().unwrap().1 -= SHARE_WINDOW;
        let (_, a) = reads.pin(7, ANY, || async { Ok(pinned(7, 100)) }).await.unwrap();
        let (_, b) = reads.pin(7, ANY, || async { Ok(pinned(7, 101)) }).await.unwrap();
        reads.page(100, key("a"), || async { Ok(page_of(10)) }).await.unwrap();
        reads.lock().snapshot.as_mut().unwrap().1 -= SHARE_WINDOW; // past this one's window too
        drop(old);
        drop(a);
        let (_, read_here) = reads.page(100, key("a"), || async { Ok(page_of(10)) }).await.unwrap();
        assert!(!read_here, "b still copies: the old sync's end was not counted as one of the new snapshot's");
        drop(b);
    }

    #[tokio::test]
    async fn pages_kept_while_another_sync_copies_are_let_go_after_the_last_past_the_window() {
        let reads = Arc::new(OriginReads::default());
        let (a, b) = two_copying(&reads).await;
        reads.page(100, key("a"), || async { Ok(page_of(10)) }).await.unwrap();
        reads.page(100, key("b"), || async { Ok(page_of(10)) }).await.unwrap();
        assert_eq!(reads.kept_bytes(), 20);
        drop(a);
        assert_eq!(reads.kept_bytes(), 20, "one sync still copies");
        reads.lock().snapshot.as_mut().unwrap().1 -= SHARE_WINDOW; // as if pinned a window ago
        drop(b);
        assert_eq!(reads.kept_bytes(), 0, "the last sync ended after the window: everything let go");
    }

    #[tokio::test]
    async fn what_is_kept_is_bounded_and_a_page_let_go_is_read_again() {
        let reads = Arc::new(OriginReads::default());
        let _copying = two_copying(&reads).await;
        let big = KEPT_BYTES / 4 + 1;
        for from in ["a", "b", "c", "d", "e"] {
            let (_, read_here) = reads.page(100, key(from), || async { Ok(page_of(big)) }).await.unwrap();
            assert!(read_here);
            assert!(reads.kept_bytes() <= KEPT_BYTES);
        }
        let (_, read_here) = reads.page(100, key("a"), || async { Ok(page_of(big)) }).await.unwrap();
        assert!(read_here, "the oldest page was let go: the sync behind reads it itself");
        let (_, read_here) = reads.page(100, key("e"), || async { Ok(page_of(big)) }).await.unwrap();
        assert!(!read_here, "the newest is still kept");
    }

    #[tokio::test]
    async fn a_failed_read_is_made_again_by_the_next_sync_that_needs_the_page() {
        let reads = Arc::new(OriginReads::default());
        let _copying = two_copying(&reads).await;
        let failed = reads.page(100, key("a"), || async { Err(anyhow::anyhow!("deadline")) }).await;
        assert!(failed.is_err());
        let (page, read_here) = reads.page(100, key("a"), || async { Ok(page_of(4)) }).await.unwrap();
        assert!(read_here && page.more);
    }
}
