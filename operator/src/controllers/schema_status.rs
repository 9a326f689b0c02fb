//! A RegistrySchema's status from its drain's progress, without IO: the phase, the counters and
//! the Ready, Migrated and Drained conditions a person reads.
use crate::api::{DrainCounts, RegistrySchemaStatus};
use crate::drain::{DrainPhase, DrainReport};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

fn condition(
    previous: &RegistrySchemaStatus,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
) -> Condition {
    let status = if status { "True" } else { "False" }.to_string();
    let last_transition_time = match previous.conditions.iter().find(|c| c.type_ == type_) {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => now(),
    };
    Condition {
        type_: type_.into(),
        status,
        reason: reason.into(),
        message: message.into(),
        observed_generation: generation,
        last_transition_time,
    }
}

/// The status a drain report implies.
pub fn status_from(
    previous: &RegistrySchemaStatus,
    generation: Option<i64>,
    report: &DrainReport,
    error: Option<&str>,
) -> RegistrySchemaStatus {
    let phase = report.phase.unwrap_or(DrainPhase::Pending);
    let copied_all = matches!(phase, DrainPhase::Draining | DrainPhase::Complete);
    let complete = phase == DrainPhase::Complete;
    // An error belongs to the phase it happened in: once the drain is complete it is history.
    let error = error.filter(|_| !complete && phase != DrainPhase::DryRunComplete);
    let dry = if report.dry_run { " (dry run: nothing written)" } else { "" };
    let migrated = condition(
        previous,
        "Migrated",
        copied_all && !report.dry_run,
        if copied_all { "SnapshotCopied" } else { "Copying" },
        &format!(
            "{} copied, {} already in v1, {} skipped, {} naming another region (left in place){dry}",
            report.copied, report.already_present, report.skipped, report.foreign
        ),
        generation,
    );
    let drained = condition(
        previous,
        "Drained",
        complete && !report.dry_run,
        if complete {
            "LegacyPrefixEmpty"
        } else if copied_all {
            "WaitingForQuiet"
        } else {
            "Copying"
        },
        &format!("{} legacy keys deleted; malformed keys are left in place{dry}", report.deleted),
        generation,
    );
    // Ready: the registry is on v1 (the legacy prefix drained); a dry run is never Ready.
    let ready = if report.dry_run {
        condition(
            previous,
            "Ready",
            false,
            "DryRun",
            "a dry run: nothing was migrated; set dryRun to false to migrate",
            generation,
        )
    } else if complete {
        condition(
            previous,
            "Ready",
            true,
            "Migrated",
            "the registry is on v1; late legacy writes are migrated too",
            generation,
        )
    } else if let Some(e) = error {
        condition(previous, "Ready", false, "Retrying", &format!("the drain retries after: {e}"), generation)
    } else {
        condition(previous, "Ready", false, phase.as_str(), "the drain is running", generation)
    };
    RegistrySchemaStatus {
        observed_generation: generation,
        phase: Some(phase.as_str().to_string()),
        conditions: vec![ready, migrated, drained],
        counts: DrainCounts {
            legacy_seen: report.legacy_seen,
            copied: report.copied,
            already_present: report.already_present,
            skipped: report.skipped,
            deleted: report.deleted,
            conflicts: report.conflicts,
            foreign: report.foreign,
        },
        skipped_keys: report.skipped_keys.clone(),
        foreign_keys: report.foreign_keys.clone(),
        started_time: previous.started_time.clone().or_else(|| Some(now())),
        completed_time: if complete { previous.completed_time.clone().or_else(|| Some(now())) } else { None },
        message: error.map(|e| format!("retrying after: {e}")).or_else(|| report.message.clone()),
    }
}

pub fn failed_status(
    previous: &RegistrySchemaStatus,
    generation: Option<i64>,
    reason: &str,
    message: &str,
) -> RegistrySchemaStatus {
    RegistrySchemaStatus {
        observed_generation: generation,
        phase: Some(DrainPhase::Failed.as_str().to_string()),
        conditions: vec![
            condition(previous, "Ready", false, reason, message, generation),
            condition(previous, "Migrated", false, reason, message, generation),
            condition(previous, "Drained", false, reason, message, generation),
        ],
        message: Some(message.to_string()),
        ..previous.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_map_to_conditions() {
        let prev = RegistrySchemaStatus::default();
        let mut report = DrainReport { phase: Some(DrainPhase::Copying), copied: 5, ..Default::default() };
        let s = status_from(&prev, Some(1), &report, None);
        assert_eq!(s.phase.as_deref(), Some("Copying"));
        assert!(s.conditions.iter().all(|c| c.status == "False"));
        report.phase = Some(DrainPhase::Draining);
        let s = status_from(&s, Some(1), &report, None);
        assert_eq!(s.conditions[1].status, "True");
        assert_eq!(s.conditions[2].reason, "WaitingForQuiet");
        report.phase = Some(DrainPhase::Complete);
        let s = status_from(&s, Some(1), &report, None);
        assert!(s.conditions.iter().all(|c| c.status == "True"));
        let dry = DrainReport { phase: Some(DrainPhase::DryRunComplete), dry_run: true, ..Default::default() };
        let d = status_from(&RegistrySchemaStatus::default(), Some(1), &dry, None);
        assert_eq!(d.phase.as_deref(), Some("DryRunComplete"), "a dry run never reads as Complete");
        assert!(d.conditions.iter().all(|c| c.status == "False"));
        assert_eq!(d.conditions[0].reason, "DryRun");
        assert!(s.completed_time.is_some());
        // An error of an earlier phase does not outlive it.
        let s = status_from(&s, Some(1), &report, Some("another drain holds the legacy prefix"));
        assert_eq!(s.message, report.message, "{:?}", s.message);
        report.phase = Some(DrainPhase::Draining);
        let s = status_from(&s, Some(1), &report, Some("etcd down"));
        assert!(s.message.unwrap().contains("etcd down"));
    }

    #[test]
    fn a_failed_drain_is_not_ready_with_its_reason() {
        let s = failed_status(&RegistrySchemaStatus::default(), Some(2), "InvalidSpec", "legacyPrefix is not a prefix");
        let ready = s.conditions.iter().find(|c| c.type_ == "Ready").expect("a Ready condition");
        assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("False", "InvalidSpec"));
        assert_eq!(s.phase.as_deref(), Some("Failed"));
    }
}
