//! Deciding, without IO, what the drain does with one legacy key, and what it reports.
use crate::keys::{EndpointKeyV0, EndpointKeyV1, EndpointValue, is_dns_label};

/// The v1 key's state when the decision is made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct V1State {
    pub mod_revision: i64,
    pub value: Vec<u8>,
}

/// What to do with one legacy key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Write the legacy value to the v1 key (absent, or older than the legacy write).
    Copy { v1_key: EndpointKeyV1 },
    /// The v1 key holds a write newer than the legacy one (a new registrar's): leave it.
    AlreadyPresent { v1_key: EndpointKeyV1 },
    /// Malformed: left in place, counted and reported, never deleted.
    Skip { reason: String },
}

/// Where the v1 key of a legacy key is: origin from the value, defaults for what it lacks.
pub fn v1_key_for(
    legacy_key: &str,
    legacy_prefix: &str,
    value: &[u8],
    default_region: &str,
    default_cluster: &str,
) -> Result<EndpointKeyV1, String> {
    let key = EndpointKeyV0::parse_under(legacy_key, legacy_prefix).map_err(|e| e.to_string())?;
    let value = EndpointValue::parse(value).map_err(|e| format!("value is not endpoint JSON: {e}"))?;
    let region = value.region.as_deref().filter(|r| !r.is_empty()).unwrap_or(default_region);
    let cluster = value.cluster_name.as_deref().filter(|c| !c.is_empty()).unwrap_or(default_cluster);
    if !is_dns_label(region) {
        return Err(format!("region {region:?} is not a DNS label"));
    }
    if cluster.contains('/') || cluster.chars().any(char::is_whitespace) {
        return Err(format!("cluster {cluster:?} cannot be a key segment"));
    }
    Ok(key.to_v1(region, cluster))
}

/// Decides for one legacy key seen at `legacy_mod_revision`, given its v1 key's state.
pub fn decide(v1_key: Result<EndpointKeyV1, String>, legacy_mod_revision: i64, v1: Option<&V1State>) -> Decision {
    match v1_key {
        Err(reason) => Decision::Skip { reason },
        Ok(v1_key) => match v1 {
            Some(state) if state.mod_revision > legacy_mod_revision => Decision::AlreadyPresent { v1_key },
            _ => Decision::Copy { v1_key },
        },
    }
}

/// The drain's phases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrainPhase {
    Pending,
    /// Copying the legacy snapshot.
    Copying,
    /// Forwarding legacy writes while waiting for the prefix to be quiet.
    Draining,
    Complete,
    Failed,
}

impl DrainPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            DrainPhase::Pending => "Pending",
            DrainPhase::Copying => "Copying",
            DrainPhase::Draining => "Draining",
            DrainPhase::Complete => "Complete",
            DrainPhase::Failed => "Failed",
        }
    }
}

/// Progress and counters, as status and the CLI print them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DrainReport {
    pub phase: Option<DrainPhase>,
    pub legacy_seen: i64,
    pub copied: i64,
    pub already_present: i64,
    pub skipped: i64,
    pub deleted: i64,
    pub conflicts: i64,
    /// The first few skipped keys with why.
    pub skipped_keys: Vec<String>,
    pub dry_run: bool,
    pub message: Option<String>,
}

/// How many skipped keys the report names.
pub const SKIPPED_KEYS_SHOWN: usize = 10;

impl DrainReport {
    pub fn record(&mut self, key: &str, decision: &Decision) {
        self.legacy_seen += 1;
        match decision {
            Decision::Copy { .. } => self.copied += 1,
            Decision::AlreadyPresent { .. } => self.already_present += 1,
            Decision::Skip { reason } => {
                self.skipped += 1;
                if self.skipped_keys.len() < SKIPPED_KEYS_SHOWN {
                    self.skipped_keys.push(format!("{key}: {reason}"));
                }
            }
        }
    }

    /// The report as a person reads it (the CLI's output).
    pub fn render(&self) -> String {
        let verb = if self.dry_run { "would be " } else { "" };
        let mut out = format!(
            "phase: {}\nlegacy keys seen: {}\n{verb}copied: {}\nalready present in v1: {}\nskipped (malformed, left in place): {}\n{verb}deleted: {}\nconflicts (retried): {}\n",
            self.phase.map(DrainPhase::as_str).unwrap_or("Pending"),
            self.legacy_seen,
            self.copied,
            self.already_present,
            self.skipped,
            self.deleted,
            self.conflicts
        );
        for key in &self.skipped_keys {
            out.push_str(&format!("  skipped {key}\n"));
        }
        if let Some(m) = &self.message {
            out.push_str(&format!("{m}\n"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PREFIX: &str = "/aether/services/";

    #[test]
    fn origin_comes_from_the_value_then_the_defaults() {
        let k = "/aether/services/web/protocols/http/endpoints/10.0.0.1";
        let full = v1_key_for(k, PREFIX, br#"{"region":"eu","clusterName":"c9"}"#, "dr", "dc").unwrap();
        assert_eq!(
            full.to_string(),
            "/aether/v1/regions/eu/clusters/c9/services/web/protocols/http/endpoints/10.0.0.1"
        );
        let bare = v1_key_for(k, PREFIX, br#"{"zone":"z"}"#, "dr", "dc").unwrap();
        assert_eq!((bare.region.as_str(), bare.cluster.as_str()), ("dr", "dc"));
    }

    #[test]
    fn malformed_keys_and_values_are_skipped_with_a_reason() {
        let ok = "/aether/services/web/protocols/http/endpoints/10.0.0.1";
        for (key, value, needle) in [
            (ok, &b"not json"[..], "not endpoint JSON"),
            ("/aether/services/web/endpoints/10.0.0.1", &b"{}"[..], "segments"),
            ("/aether/services/web/protocols/http/endpoints/nope", &b"{}"[..], "IPv4"),
            (ok, &br#"{"region":"Bad Region"}"#[..], "DNS label"),
            (ok, &br#"{"clusterName":"a/b"}"#[..], "key segment"),
        ] {
            match decide(v1_key_for(key, PREFIX, value, "r", "c"), 5, None) {
                Decision::Skip { reason } => assert!(reason.contains(needle), "{reason} lacks {needle}"),
                other => panic!("{key}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_newer_v1_write_is_never_overwritten() {
        let key = || v1_key_for("/aether/services/s/protocols/p/endpoints/1.2.3.4", PREFIX, b"{}", "r", "c");
        assert!(matches!(decide(key(), 10, None), Decision::Copy { .. }));
        assert!(matches!(decide(key(), 10, Some(&V1State { mod_revision: 4, value: vec![] })), Decision::Copy { .. }));
        assert!(matches!(
            decide(key(), 10, Some(&V1State { mod_revision: 11, value: vec![] })),
            Decision::AlreadyPresent { .. }
        ));
    }

    #[test]
    fn the_report_counts_and_names_skips() {
        let mut r = DrainReport { dry_run: true, ..Default::default() };
        for i in 0..12 {
            r.record(&format!("k{i}"), &Decision::Skip { reason: "bad".into() });
        }
        assert_eq!((r.legacy_seen, r.skipped, r.skipped_keys.len()), (12, 12, SKIPPED_KEYS_SHOWN));
        assert!(r.render().contains("would be copied: 0"));
    }
}
