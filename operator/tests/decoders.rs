//! Everything the operator decodes from what a peer or an origin holds, fed what anyone who can
//! write there could write: arbitrary bytes, and mutations of valid records. No decoder may panic,
//! and what it accepts is bounded by its input. (`make test` runs these with their case counts;
//! `PROPTEST_CASES` raises them.)
use aether_operator::drain::plan::v1_key_for;
use aether_operator::keys::{self, EndpointKeyV0, EndpointKeyV1, EndpointValue};
use aether_operator::mirror::inbound::canary_says_synced;
use aether_operator::mirror::records::checkpoint::{Checkpoint, Owner, Progress, first_leases};
use proptest::prelude::*;

/// Bytes as written by hand: mostly JSON-ish and key-ish text, sometimes anything.
fn hostile_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..512),
        "[ -~]{0,300}".prop_map(String::into_bytes),
        r#"\{"(format|owner|revision|leases|keys|slots|parts|retiring|object|generation|rev|sent)":[-0-9\[\]{},":a-z]{0,80}\}"#
            .prop_map(String::into_bytes),
    ]
}

/// A valid record's bytes with a few bytes changed.
fn mutated(valid: Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
    let len = valid.len().max(1);
    proptest::collection::vec((0..len, any::<u8>()), 0..6).prop_map(move |edits| {
        let mut bytes = valid.clone();
        for (at, b) in edits {
            if at < bytes.len() {
                bytes[at] = b;
            }
        }
        bytes
    })
}

fn a_checkpoint() -> Vec<u8> {
    Checkpoint {
        owner: "op/1".into(),
        revision: 9,
        leases: vec![7, 8],
        keys: vec![1, 2],
        synced: true,
        ..Default::default()
    }
    .encode()
}

fn a_progress() -> Vec<u8> {
    Progress { owner: "op/1".into(), revision: 9, sent_through: 12, keys: Some(300) }.encode()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn records_never_panic_and_owner_strings_stay_bounded(
        bytes in prop_oneof![hostile_bytes(), mutated(a_checkpoint()), mutated(a_progress())],
    ) {
        if let Some(cp) = Checkpoint::decode(&bytes) {
            prop_assert!(cp.leases.len() <= bytes.len(), "more leases than bytes");
            let _ = first_leases(&cp, Some(&bytes));
            let _ = cp.assemble(&[&bytes, &bytes]);
        }
        if let Some(progress) = Progress::decode(&bytes) {
            prop_assert!(progress.keys.is_none_or(|keys| keys >= 0), "a negative count read: {progress:?}");
        }
        if let Some(owner) = Owner::decode(&bytes) {
            prop_assert!(owner.owner.chars().count() <= 253 && owner.peer.chars().count() <= 253);
        }
        let _ = canary_says_synced(&bytes);
        let _ = aether_operator::mirror::verify::decode_page_ends(&bytes);
        let _ = EndpointValue::parse(&bytes);
    }

    #[test]
    fn keys_never_panic_and_a_region_read_from_a_key_is_a_key_segment(key in prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..200),
        "/aether/(v1/regions/|services/|v1/federation/)[ -~]{0,120}".prop_map(String::into_bytes),
    ]) {
        if let Some(region) = keys::region_of(&key) {
            prop_assert!(!region.contains('/'));
        }
        if let Ok(text) = std::str::from_utf8(&key) {
            if let Ok(parsed) = EndpointKeyV1::parse(text) {
                prop_assert!(parsed.to_string().len() <= text.len() + 1);
            }
            let _ = EndpointKeyV0::parse(text);
            let _ = EndpointKeyV0::parse_under(text, "/aether/services/");
            let _ = keys::legacy_prefix_problem(text);
        }
    }

    #[test]
    fn an_owner_record_written_with_any_strings_reads_bounded(owner in ".{0,600}", peer in ".{0,600}") {
        let written = Owner { owner: owner.repeat(3), peer, ..Default::default() };
        let read = Owner::decode(&written.encode()).expect("a record of this format");
        prop_assert!(read.owner.chars().count() <= 253 && read.peer.chars().count() <= 253);
    }

    #[test]
    fn a_legacy_endpoint_maps_into_its_region_only_or_is_refused(
        key in prop_oneof![
            "/aether/services/[ -~]{0,80}",
            "/aether/services/[a-z]{1,8}/protocols/(tcp|http)/endpoints/10\\.[0-9]{1,3}\\.0\\.1",
        ],
        value in prop_oneof![
            hostile_bytes(),
            (prop_oneof![Just("eu".to_string()), ".{0,12}"], prop_oneof![Just("..".to_string()), Just(".".to_string()), ".{0,12}"])
                .prop_map(|(region, cluster)| serde_json::json!({"region": region, "clusterName": cluster}).to_string().into_bytes()),
        ],
    ) {
        if let Ok(v1) = v1_key_for(&key, "/aether/services/", &value, "eu", "dflt") {
            let text = v1.to_string();
            prop_assert!(text.starts_with(&keys::region_prefix("eu")), "{text} outside region eu");
            prop_assert!(!text.contains("/../") && !text.chars().any(char::is_control), "{text:?}");
        }
    }
}
