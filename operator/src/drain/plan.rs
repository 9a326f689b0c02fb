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
    /// The value names another region: only that region writes its subtree, anywhere. Left in
    /// place, counted and reported, never deleted (that region's operator should drain it from
    /// its own etcd, or someone moves it there).
    Foreign { region: String },
}

/// Bytes one page of legacy keys aims at: its size in keys follows the largest key-value seen.
pub const DRAIN_PAGE_BYTES: usize = 8 << 20;
/// Bytes of values one copy Txn carries at most: under etcd's default request limit (1.5 MiB).
pub const DRAIN_TXN_BYTES: usize = 1 << 20;
/// Keys of the first page, before any size is known.
pub const FIRST_PAGE: i64 = 32;

/// The next page's size in keys: as many as fit in [`DRAIN_PAGE_BYTES`] at the largest key-value
/// seen so far (0: none seen yet, the first page's), between 8 and `most`.
pub fn next_page(largest_seen: usize, most: i64) -> i64 {
    if largest_seen == 0 {
        return FIRST_PAGE.min(most).max(1);
    }
    ((DRAIN_PAGE_BYTES / largest_seen.max(1)) as i64).clamp(8.min(most), most.max(1))
}

/// Consecutive batches of the items sized `sizes`: at most `count` items and `bytes` each (an item
/// larger than `bytes` goes alone).
pub fn batches_by_bytes(sizes: &[usize], count: usize, bytes: usize) -> Vec<std::ops::Range<usize>> {
    let mut batches = Vec::new();
    let (mut start, mut held) = (0, 0usize);
    for (i, size) in sizes.iter().enumerate() {
        if i > start && (i - start >= count.max(1) || held + size > bytes) {
            batches.push(start..i);
            (start, held) = (i, 0);
        }
        held += size;
    }
    if start < sizes.len() {
        batches.push(start..sizes.len());
    }
    batches
}

/// The copy's cursor as the drain's record keeps it (text): a cursor of UTF-8 as it is (what
/// earlier versions wrote), any other as `hex:` and its bytes, so that a key that is not UTF-8
/// at a page's end never skips the keys after it. A cursor starts with the legacy prefix's `/`,
/// so text never reads as hex.
pub fn encode_cursor(cursor: &[u8]) -> String {
    match std::str::from_utf8(cursor) {
        Ok(text) => text.to_string(),
        Err(_) => format!("hex:{}", cursor.iter().map(|b| format!("{b:02x}")).collect::<String>()),
    }
}

pub fn decode_cursor(text: &str) -> Vec<u8> {
    let hex = |s: &str| -> Option<Vec<u8>> {
        s.len()
            .is_multiple_of(2)
            .then(|| (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok()).collect())
            .flatten()
    };
    text.strip_prefix("hex:").and_then(hex).unwrap_or_else(|| text.as_bytes().to_vec())
}

/// Why a legacy key has no v1 key in this drain's region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unmigratable {
    Malformed(String),
    Foreign { region: String },
}

/// Where the v1 key of a legacy key is: origin from the value, the drain's region and default
/// cluster for what it lacks. A value naming another region than `region` (the drain's) has no
/// v1 key here: this region writes only under its own subtree.
pub fn v1_key_for(
    legacy_key: &str,
    legacy_prefix: &str,
    value: &[u8],
    region: &str,
    default_cluster: &str,
) -> Result<EndpointKeyV1, Unmigratable> {
    let malformed = Unmigratable::Malformed;
    let key = EndpointKeyV0::parse_under(legacy_key, legacy_prefix).map_err(|e| malformed(e.to_string()))?;
    let value = EndpointValue::parse(value).map_err(|e| malformed(format!("value is not endpoint JSON: {e}")))?;
    let named = value.region.as_deref().filter(|r| !r.is_empty()).unwrap_or(region);
    let cluster = value.cluster_name.as_deref().filter(|c| !c.is_empty()).unwrap_or(default_cluster);
    if !is_dns_label(named) {
        return Err(malformed(format!("region {named:?} is not a DNS label")));
    }
    if !crate::keys::is_key_segment(cluster) {
        let shown: String = cluster.chars().take(80).collect();
        return Err(malformed(format!("cluster {shown:?} cannot be a key segment")));
    }
    if named != region {
        return Err(Unmigratable::Foreign { region: named.to_string() });
    }
    Ok(key.to_v1(region, cluster))
}

/// Decides for one legacy key seen at `legacy_mod_revision`, given its v1 key's state.
pub fn decide(v1_key: Result<EndpointKeyV1, Unmigratable>, legacy_mod_revision: i64, v1: Option<&V1State>) -> Decision {
    match v1_key {
        Err(Unmigratable::Malformed(reason)) => Decision::Skip { reason },
        Err(Unmigratable::Foreign { region }) => Decision::Foreign { region },
        Ok(v1_key) => match v1 {
            Some(state) if state.mod_revision > legacy_mod_revision => Decision::AlreadyPresent { v1_key },
            _ => Decision::Copy { v1_key },
        },
    }
}

/// The drain's phases.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DrainPhase {
    Pending,
    /// Copying the legacy snapshot.
    Copying,
    /// Forwarding legacy writes while waiting for the prefix to be quiet.
    Draining,
    Complete,
    /// A dry run finished: nothing was written.
    DryRunComplete,
    Failed,
}

impl DrainPhase {
    pub const ALL: [DrainPhase; 6] = [
        DrainPhase::Pending,
        DrainPhase::Copying,
        DrainPhase::Draining,
        DrainPhase::Complete,
        DrainPhase::DryRunComplete,
        DrainPhase::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DrainPhase::Pending => "Pending",
            DrainPhase::Copying => "Copying",
            DrainPhase::Draining => "Draining",
            DrainPhase::Complete => "Complete",
            DrainPhase::DryRunComplete => "DryRunComplete",
            DrainPhase::Failed => "Failed",
        }
    }
}

/// Progress and counters, as status and the CLI print them. Recorded in etcd with the drain's
/// progress, so the counters are cumulative across restarts.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct DrainReport {
    pub phase: Option<DrainPhase>,
    pub legacy_seen: i64,
    pub copied: i64,
    pub already_present: i64,
    pub skipped: i64,
    pub deleted: i64,
    pub conflicts: i64,
    /// Legacy values naming another region: left in place.
    pub foreign: i64,
    /// The first few skipped keys with why.
    pub skipped_keys: Vec<String>,
    /// The first few foreign keys with the region they name.
    pub foreign_keys: Vec<String>,
    pub dry_run: bool,
    pub message: Option<String>,
}

/// Where a drain stands, recorded in etcd next to its lock after every step, so that a restart
/// (a kill, a compaction, a new leader) resumes instead of starting over.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct DrainRecord {
    /// The revision the copy pass reads the legacy prefix at (0: not started).
    pub copy_revision: i64,
    /// The next legacy key to copy; None once the copy pass is done.
    pub copy_cursor: Option<String>,
    /// Set when the copy pass had to move to a later revision (the first was compacted): keys
    /// written after this revision are copied again by a catch-up scan.
    pub catch_up_from: Option<i64>,
    /// Legacy writes up to this revision are forwarded.
    pub watermark: i64,
    pub report: DrainReport,
}

impl DrainRecord {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a drain record always serializes")
    }

    pub fn decode(bytes: &[u8]) -> Option<DrainRecord> {
        serde_json::from_slice(bytes).ok()
    }

    pub fn copying(&self) -> bool {
        self.copy_revision == 0 || self.copy_cursor.is_some()
    }
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
            Decision::Foreign { region } => {
                self.foreign += 1;
                if self.foreign_keys.len() < SKIPPED_KEYS_SHOWN {
                    self.foreign_keys.push(format!("{key}: region {region}"));
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
        if self.foreign > 0 {
            out.push_str(&format!(
                "naming another region (left in place; drain them from that region's etcd): {}\n",
                self.foreign
            ));
        }
        for key in &self.foreign_keys {
            out.push_str(&format!("  foreign {key}\n"));
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

    #[test]
    fn pages_and_txns_follow_the_values_sizes() {
        assert_eq!(next_page(0, 1600), FIRST_PAGE);
        assert_eq!(next_page(200, 1600), 1600, "small values: the count bound");
        assert_eq!(next_page(1 << 20, 1600), 8, "mebibyte values: 8 MiB a page");
        assert_eq!(next_page(64 << 10, 1600), 128);
        let sizes = [600_000, 600_000, 100, 100, 2_000_000, 5];
        let batches = batches_by_bytes(&sizes, 100, 1 << 20);
        assert_eq!(batches, vec![0..1, 1..4, 4..5, 5..6], "no batch past a mebibyte but a lone large value");
        assert_eq!(batches_by_bytes(&[1; 250], 100, 1 << 20), vec![0..100, 100..200, 200..250]);
        assert!(batches_by_bytes(&[], 100, 1).is_empty());
    }

    #[test]
    fn a_cursor_after_a_key_that_is_not_utf8_is_kept_byte_for_byte() {
        let text = b"/aether/services/web/protocols/http/endpoints/10.0.0.1\0".to_vec();
        assert_eq!(encode_cursor(&text), String::from_utf8(text.clone()).unwrap(), "earlier records read the same");
        assert_eq!(decode_cursor(&encode_cursor(&text)), text);
        let raw = [b"/aether/services/".to_vec(), vec![0xff, 0xfe, 0x00]].concat();
        assert!(encode_cursor(&raw).starts_with("hex:"));
        assert_eq!(decode_cursor(&encode_cursor(&raw)), raw);
        // Lossy text would have put the cursor past every key between 0xff 0xfe and U+FFFD.
        assert_ne!(String::from_utf8_lossy(&raw).as_bytes(), &raw[..]);
    }

    const PREFIX: &str = "/aether/services/";

    #[test]
    fn origin_comes_from_the_value_then_the_defaults() {
        let k = "/aether/services/web/protocols/http/endpoints/10.0.0.1";
        let full = v1_key_for(k, PREFIX, br#"{"region":"eu","clusterName":"c9"}"#, "eu", "dc").unwrap();
        assert_eq!(
            full.to_string(),
            "/aether/v1/regions/eu/clusters/c9/services/web/protocols/http/endpoints/10.0.0.1"
        );
        let bare = v1_key_for(k, PREFIX, br#"{"zone":"z"}"#, "eu", "dc").unwrap();
        assert_eq!((bare.region.as_str(), bare.cluster.as_str()), ("eu", "dc"));
        let ipv6 = "/aether/services/web/protocols/http/endpoints/fd00::1";
        let v6 = v1_key_for(ipv6, PREFIX, br#"{"region":"eu"}"#, "eu", "dc").unwrap();
        assert_eq!(v6.to_string(), "/aether/v1/regions/eu/clusters/dc/services/web/protocols/http/endpoints/fd00::1");
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
    fn a_value_naming_another_region_is_foreign_and_never_copied() {
        let k = "/aether/services/web/protocols/http/endpoints/10.0.0.1";
        let target = v1_key_for(k, PREFIX, br#"{"region":"us","clusterName":"c9"}"#, "eu", "dc");
        assert_eq!(target, Err(Unmigratable::Foreign { region: "us".into() }));
        assert_eq!(decide(target, 5, None), Decision::Foreign { region: "us".into() });
        let mut r = DrainReport::default();
        r.record(k, &Decision::Foreign { region: "us".into() });
        assert_eq!((r.foreign, r.copied, r.skipped), (1, 0, 0));
        assert!(r.render().contains("foreign /aether/services/web/protocols/http/endpoints/10.0.0.1: region us"));
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
    fn a_record_roundtrips_and_says_whether_the_copy_is_done() {
        let fresh = DrainRecord::default();
        assert!(fresh.copying());
        let r = DrainRecord {
            copy_revision: 9,
            copy_cursor: None,
            watermark: 12,
            report: DrainReport { phase: Some(DrainPhase::Draining), copied: 3, ..Default::default() },
            ..Default::default()
        };
        assert!(!r.copying());
        assert_eq!(DrainRecord::decode(&r.encode()), Some(r));
        assert_eq!(DrainRecord::decode(b"garbage"), None);
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
