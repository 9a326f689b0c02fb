//! Who may read /metrics and /debug/doctor on the secure listener: the API server says who a
//! bearer token is (TokenReview) and whether it may `get` the non-resource URL
//! (SubjectAccessReview). Anyone who can reach the port can send a token, so every cost a token
//! causes is bounded:
//!
//! - a token longer than [`MAX_TOKEN_BYTES`] is refused without a review (Kubernetes tokens are a
//!   few KiB at most);
//! - decisions are cached for [`DECISION_TTL`] under the token's SHA-256, never the token itself,
//!   in at most [`CACHE_ENTRIES`] entries; a full cache takes no more (it is never flushed, so a
//!   flood cannot evict the scraper's decision);
//! - tokens never seen allowed are reviewed at most [`STRANGERS_PER_SECOND`] a second (a burst of
//!   [`STRANGER_BURST`]), the rest are told to retry (429); a token allowed within the last
//!   [`ALLOWED_REMEMBERED`] is reviewed again whenever its decision expires, so the scraper is
//!   never starved by strangers;
//! - at most [`REVIEWS_AT_ONCE`] reviews are in flight, and a request waiting for one looks at the
//!   cache again first (concurrent requests with one token cost one review).
//!
//! The decisions are `Gate::admit` (pure, the clock passed in); the reviews are the IO.
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub const MAX_TOKEN_BYTES: usize = 8 * 1024;
pub const DECISION_TTL: Duration = Duration::from_secs(10);
pub const CACHE_ENTRIES: usize = 1024;
pub const ALLOWED_REMEMBERED: Duration = Duration::from_secs(300);
pub const STRANGERS_PER_SECOND: f64 = 10.0;
pub const STRANGER_BURST: f64 = 20.0;
pub const REVIEWS_AT_ONCE: usize = 4;

/// The outcome of checking a caller's token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    Allowed,
    Unauthenticated,
    Forbidden(String),
    /// Too many unknown tokens lately: retry later (429).
    Throttled,
}

impl Decision {
    /// The metric label of this outcome.
    pub fn outcome(&self) -> &'static str {
        match self {
            Decision::Allowed => "allowed",
            Decision::Unauthenticated => "unauthenticated",
            Decision::Forbidden(_) => "forbidden",
            Decision::Throttled => "throttled",
        }
    }
}

type Digest = [u8; 32];
/// A token's digest and the non-resource URL it asked for.
type Key = (Digest, &'static str);

/// What to do with a request before any review.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Decided already (cached, too long, or throttled).
    Decided(Decision),
    /// Needs a review.
    Review,
}

/// The bounded bookkeeping of decisions: the cache, the tokens allowed lately, and the budget for
/// reviews of strangers. No IO.
#[derive(Debug)]
pub struct Gate {
    cache: HashMap<Key, (Instant, Decision)>,
    allowed: HashMap<Digest, Instant>,
    tokens: f64,
    refilled: Instant,
}

impl Gate {
    pub fn new(now: Instant) -> Gate {
        Gate { cache: HashMap::new(), allowed: HashMap::new(), tokens: STRANGER_BURST, refilled: now }
    }

    /// Whether a request with this token (by `length` and `digest`) needs a review.
    pub fn admit(&mut self, length: usize, digest: Digest, path: &'static str, now: Instant) -> Admit {
        if length > MAX_TOKEN_BYTES {
            return Admit::Decided(Decision::Unauthenticated);
        }
        if let Some((at, decision)) = self.cache.get(&(digest, path))
            && now.saturating_duration_since(*at) < DECISION_TTL
        {
            return Admit::Decided(decision.clone());
        }
        let known = self.allowed.get(&digest).is_some_and(|at| now.saturating_duration_since(*at) < ALLOWED_REMEMBERED);
        if known {
            return Admit::Review;
        }
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.tokens = (self.tokens + elapsed * STRANGERS_PER_SECOND).min(STRANGER_BURST);
        self.refilled = now;
        if self.tokens < 1.0 {
            return Admit::Decided(Decision::Throttled);
        }
        self.tokens -= 1.0;
        Admit::Review
    }

    /// A fresh decision from a review, if one is cached (another request reviewed the same token
    /// meanwhile).
    pub fn cached(&self, digest: Digest, path: &'static str, now: Instant) -> Option<Decision> {
        let (at, decision) = self.cache.get(&(digest, path))?;
        (now.saturating_duration_since(*at) < DECISION_TTL).then(|| decision.clone())
    }

    /// Keeps a review's decision: expired entries make room; a cache still full takes nothing.
    pub fn record(&mut self, digest: Digest, path: &'static str, decision: &Decision, now: Instant) {
        if self.cache.len() >= CACHE_ENTRIES {
            self.cache.retain(|_, (at, _)| now.saturating_duration_since(*at) < DECISION_TTL);
        }
        if self.cache.len() < CACHE_ENTRIES {
            self.cache.insert((digest, path), (now, decision.clone()));
        }
        if *decision == Decision::Allowed {
            if self.allowed.len() >= CACHE_ENTRIES {
                self.allowed.retain(|_, at| now.saturating_duration_since(*at) < ALLOWED_REMEMBERED);
            }
            if self.allowed.len() < CACHE_ENTRIES {
                self.allowed.insert(digest, now);
            }
        }
    }
}

fn digest(token: &str) -> Digest {
    let d = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// Asks the API server about tokens, through the gate.
pub struct Authorizer {
    client: kube::Client,
    gate: Mutex<Gate>,
    reviews: tokio::sync::Semaphore,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
}

impl Authorizer {
    pub fn new(client: kube::Client, metrics: std::sync::Arc<crate::metrics::Metrics>) -> Authorizer {
        Authorizer {
            client,
            gate: Mutex::new(Gate::new(Instant::now())),
            reviews: tokio::sync::Semaphore::new(REVIEWS_AT_ONCE),
            metrics,
        }
    }

    fn gate(&self) -> std::sync::MutexGuard<'_, Gate> {
        self.gate.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether `token` may `get` the non-resource URL `path`.
    pub async fn decide(&self, token: &str, path: &'static str) -> Result<Decision, kube::Error> {
        let hashed = digest(token);
        let admitted = self.gate().admit(token.len(), hashed, path, Instant::now());
        let decision = match admitted {
            Admit::Decided(decision) => decision,
            Admit::Review => {
                let _permit = self.reviews.acquire().await.expect("the semaphore is never closed");
                let cached = self.gate().cached(hashed, path, Instant::now());
                match cached {
                    Some(decision) => decision,
                    None => {
                        let decision = self.ask(token, path).await?;
                        self.gate().record(hashed, path, &decision, Instant::now());
                        self.metrics.token_reviewed(decision.outcome());
                        decision
                    }
                }
            }
        };
        if decision == Decision::Throttled {
            self.metrics.token_reviewed(decision.outcome());
        }
        Ok(decision)
    }

    /// Whether the caller with `token` may itself `get` each of `objects` (resource, namespace,
    /// name): what the doctor reads with the operator's rights, it reads only for a caller who
    /// may read it too. The first it may not, if any. Reviewed every time (a doctor run is rare).
    pub async fn may_read(
        &self,
        token: &str,
        objects: &[(&'static str, String, String)],
    ) -> Result<Option<String>, kube::Error> {
        let _permit = self.reviews.acquire().await.expect("the semaphore is never closed");
        let review = TokenReview {
            spec: TokenReviewSpec { token: Some(token.to_string()), ..Default::default() },
            ..Default::default()
        };
        let reviewed = Api::<TokenReview>::all(self.client.clone()).create(&PostParams::default(), &review).await?;
        let Some(status) = reviewed.status.filter(|s| s.authenticated == Some(true)) else {
            return Ok(Some("the token is not valid".into()));
        };
        let user = status.user.unwrap_or_default();
        let name: String = user.username.clone().unwrap_or_default().chars().take(256).collect();
        for (resource, namespace, object) in objects {
            let access = SubjectAccessReview {
                spec: SubjectAccessReviewSpec {
                    user: user.username.clone(),
                    uid: user.uid.clone(),
                    groups: user.groups.clone(),
                    extra: user.extra.clone(),
                    resource_attributes: Some(ResourceAttributes {
                        group: Some(if *resource == "secrets" { String::new() } else { crate::api::GROUP.to_string() }),
                        resource: Some(resource.to_string()),
                        namespace: Some(namespace.clone()),
                        name: Some(object.clone()),
                        verb: Some("get".into()),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                ..Default::default()
            };
            let reviewed =
                Api::<SubjectAccessReview>::all(self.client.clone()).create(&PostParams::default(), &access).await?;
            if !reviewed.status.as_ref().is_some_and(|s| s.allowed) {
                return Ok(Some(format!("{name} may not get {resource} {namespace}/{object}")));
            }
        }
        Ok(None)
    }

    async fn ask(&self, token: &str, path: &'static str) -> Result<Decision, kube::Error> {
        let review = TokenReview {
            spec: TokenReviewSpec { token: Some(token.to_string()), ..Default::default() },
            ..Default::default()
        };
        let reviewed = Api::<TokenReview>::all(self.client.clone()).create(&PostParams::default(), &review).await?;
        let Some(status) = reviewed.status.filter(|s| s.authenticated == Some(true)) else {
            return Ok(Decision::Unauthenticated);
        };
        let user = status.user.unwrap_or_default();
        let access = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username.clone(),
                uid: user.uid,
                groups: user.groups,
                extra: user.extra,
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some(path.into()),
                    verb: Some("get".into()),
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let reviewed =
            Api::<SubjectAccessReview>::all(self.client.clone()).create(&PostParams::default(), &access).await?;
        let allowed = reviewed.status.as_ref().is_some_and(|s| s.allowed);
        Ok(if allowed {
            Decision::Allowed
        } else {
            let name: String = user.username.unwrap_or_default().chars().take(256).collect();
            Decision::Forbidden(format!("{name} may not get {path} (bind it to the metrics reader ClusterRole)"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(n: u8) -> Digest {
        [n; 32]
    }

    #[test]
    fn a_token_too_long_is_refused_without_a_review() {
        let mut gate = Gate::new(Instant::now());
        let now = Instant::now();
        assert_eq!(gate.admit(MAX_TOKEN_BYTES + 1, d(1), "/metrics", now), Admit::Decided(Decision::Unauthenticated));
        assert_eq!(gate.admit(MAX_TOKEN_BYTES, d(1), "/metrics", now), Admit::Review);
    }

    #[test]
    fn strangers_are_reviewed_at_a_bounded_rate_and_a_known_scraper_never_waits_for_them() {
        let t0 = Instant::now();
        let mut gate = Gate::new(t0);
        // The scraper is allowed once.
        assert_eq!(gate.admit(100, d(0), "/metrics", t0), Admit::Review);
        gate.record(d(0), "/metrics", &Decision::Allowed, t0);
        // A flood of new tokens: the burst is reviewed, the rest throttled.
        let reviewed = (1..=200u8).filter(|n| gate.admit(100, d(*n), "/metrics", t0) == Admit::Review).count();
        assert_eq!(reviewed as f64, STRANGER_BURST - 1.0);
        // A second later, the budget refilled by the rate only.
        let later = t0 + Duration::from_secs(1);
        let reviewed = (1..=200u8).filter(|n| gate.admit(100, d(*n), "/metrics", later) == Admit::Review).count();
        assert_eq!(reviewed as f64, STRANGERS_PER_SECOND);
        // The scraper's decision is cached, then reviewed again despite the flood.
        assert_eq!(gate.admit(100, d(0), "/metrics", later), Admit::Decided(Decision::Allowed));
        let expired = t0 + DECISION_TTL + Duration::from_millis(1);
        for n in 1..=200u8 {
            gate.admit(100, d(n), "/metrics", expired);
        }
        assert_eq!(gate.admit(100, d(0), "/metrics", expired), Admit::Review, "the scraper is not throttled");
    }

    #[test]
    fn the_cache_stays_bounded_and_a_flood_cannot_evict_live_decisions() {
        let t0 = Instant::now();
        let mut gate = Gate::new(t0);
        gate.record(d(0), "/metrics", &Decision::Allowed, t0);
        for n in 0..(CACHE_ENTRIES as u32 * 3) {
            let mut digest = [0u8; 32];
            digest[..4].copy_from_slice(&(n + 1).to_le_bytes());
            gate.record(digest, "/metrics", &Decision::Unauthenticated, t0);
        }
        assert_eq!(gate.cache.len(), CACHE_ENTRIES);
        assert_eq!(gate.cached(d(0), "/metrics", t0), Some(Decision::Allowed), "the live decision stays");
        // Expired entries make room.
        gate.record(d(9), "/metrics", &Decision::Allowed, t0 + DECISION_TTL * 2);
        assert_eq!(gate.cache.len(), 1);
    }

    #[test]
    fn a_digest_is_sha256() {
        let hex: String = digest("abc").iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }
}
