//! What a worker's parts share while it runs: the health it publishes, the events it raises and
//! the failure detector every successful round trip feeds. The bottom of the mirror: it imports
//! only the pure health and detector modules.
use crate::mirror::detector::{ReachabilityDetector, Transition};
use crate::mirror::health::{MirrorEvent, PeerHealth, Phase};
use std::sync::Mutex;
use std::time::Instant;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

/// What the worker and its keepalive task share.
pub(super) struct Shared {
    pub(super) health: watch::Sender<PeerHealth>,
    pub(super) events: mpsc::Sender<MirrorEvent>,
    pub(super) detector: Mutex<ReachabilityDetector>,
}

impl Shared {
    pub(super) fn update(&self, f: impl FnOnce(&mut PeerHealth)) {
        self.health.send_if_modified(|h| {
            let before = h.clone();
            f(h);
            *h != before
        });
    }

    pub(super) fn emit(&self, event: MirrorEvent) {
        if self.events.try_send(event.clone()).is_err() {
            debug!(?event, "event dropped: nobody is reading events fast enough");
        }
    }

    pub(super) fn phase(&self, phase: Phase) {
        self.update(|h| h.phase = phase);
    }

    pub(super) fn detector_success(&self) {
        let transition = self.detector.lock().expect("detector lock").success(Instant::now());
        self.report_transition(transition);
    }

    pub(super) fn detector_evaluate(&self) {
        let transition = self.detector.lock().expect("detector lock").evaluate(Instant::now());
        self.report_transition(transition);
    }

    /// Something was applied: the error is over, and so is the lag up to here.
    pub(super) fn progressed(&self) {
        self.update(|h| {
            h.last_error = None;
            h.last_error_time = None;
            h.last_error_reason = None;
        });
    }

    fn report_transition(&self, transition: Option<Transition>) {
        match transition {
            Some(Transition::BecameUnreachable) => {
                warn!("peer region unreachable; its data is left alone");
                self.update(|h| h.reachable = false);
                self.emit(MirrorEvent::RegionUnreachable);
            }
            Some(Transition::BecameReachable) => {
                info!("peer region reachable again");
                self.update(|h| h.reachable = true);
                self.emit(MirrorEvent::RegionReachable);
            }
            None => {}
        }
    }
}
