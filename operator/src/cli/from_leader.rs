//! `status --etcd` and `doctor` from the region's leader: where this machine cannot reach a
//! region's etcds (its local etcd is named by an in-cluster Service, a peer is reachable only from
//! the cluster's network), the leader checks them from its pod, with the network and credentials
//! the mirror itself uses. The leader's pod is found from the leader Lease the status names (its
//! holder), and asked through the API server: the operator's own executable, run in the
//! operator's container (`status --etcd --etcd-from here -o json`, `doctor --from here -o json`),
//! reading the cluster from inside it. Who may do this is who may exec into the operator's pods:
//! the API server decides, nothing new is served.
use super::status::{EtcdCheck, Federation, MirrorRow};
use crate::api::RegionPeering;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, AttachParams};
use std::time::Duration;
use tokio::io::AsyncReadExt;

/// The executable in the operator's image, when the container does not name its command.
const ENTRYPOINT: &str = "/aether-operator";
/// The container of the chart's Deployment that runs the operator.
const CONTAINER: &str = "operator";
/// At most this much of the leader's answer is read.
const MAX_ANSWER: u64 = 8 << 20;

/// What the leader answered: its pod ("namespace/name") and its rows of the RegionPeering.
pub struct Answer {
    pub pod: String,
    pub mirrors: Vec<MirrorRow>,
}

/// The rows of `rp` as checked by its region's leader, or why the leader could not be asked.
pub async fn check(client: &kube::Client, rp: &RegionPeering, timeout: Duration) -> Result<Answer, String> {
    let namespace = rp.namespace().unwrap_or_default();
    let (pod, stdout, stderr) = run_in_leader(client, rp, &status_args(&namespace, timeout), timeout).await?;
    let federation: Federation = parse(&stdout, &stderr).map_err(|e| format!("the leader {pod}: {e}"))?;
    let object = format!("{namespace}/{}", rp.name_any());
    let mirrors = federation.mirrors.into_iter().filter(|m| m.object == object).collect();
    Ok(Answer { pod, mirrors })
}

/// `doctor`'s findings of `rp`, checked by its region's leader from its pod: the leader's pod and
/// the findings, or why the leader could not be asked.
pub async fn doctor(
    client: &kube::Client,
    rp: &RegionPeering,
    timeout: Duration,
) -> Result<(String, Vec<super::doctor::Finding>), String> {
    let namespace = rp.namespace().unwrap_or_default();
    let (pod, stdout, stderr) = run_in_leader(client, rp, &doctor_args(&rp.name_any(), &namespace), timeout).await?;
    let findings = parse(&stdout, &stderr).map_err(|e| format!("the leader {pod}: {e}"))?;
    Ok((pod, findings))
}

/// Runs the operator's executable with `args` in the container of the pod holding the leader
/// Lease `rp`'s status names; the pod ("namespace/name"), and what the executable wrote.
async fn run_in_leader(
    client: &kube::Client,
    rp: &RegionPeering,
    args: &[String],
    timeout: Duration,
) -> Result<(String, Vec<u8>, Vec<u8>), String> {
    let lease = rp
        .status
        .as_ref()
        .and_then(|s| s.leader_lease.clone())
        .ok_or("the status names no leader Lease (no operator has led this region)")?;
    let (namespace, name) =
        lease.split_once('/').ok_or_else(|| format!("leader Lease {lease:?} is not namespace/name"))?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let holder = leases
        .get_opt(name)
        .await
        .map_err(|e| format!("reading the leader Lease {lease}: {e}"))?
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
        .filter(|h| !h.is_empty())
        .ok_or_else(|| format!("the leader Lease {lease} is held by nobody"))?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod = pods.get(&holder).await.map_err(|e| format!("reading the leader's pod {namespace}/{holder}: {e}"))?;
    let pod_name = format!("{namespace}/{holder}");
    let (container, executable) =
        operator_container(&pod).ok_or_else(|| format!("the pod {pod_name} has no container"))?;
    let argv: Vec<String> = std::iter::once(executable).chain(args.iter().cloned()).collect();
    let (stdout, stderr) =
        tokio::time::timeout(timeout + Duration::from_secs(10), run(&pods, &holder, &container, argv))
            .await
            .map_err(|_| format!("the leader {pod_name} did not answer within {timeout:?}"))?
            .map_err(|e| format!("asking the leader {pod_name}: {e}"))?;
    Ok((pod_name, stdout, stderr))
}

/// The operator's container in `pod`, and the executable it runs (pure).
fn operator_container(pod: &Pod) -> Option<(String, String)> {
    let containers = &pod.spec.as_ref()?.containers;
    let c = containers.iter().find(|c| c.name == CONTAINER).or_else(|| containers.first())?;
    let command = c.command.as_ref().and_then(|c| c.first()).cloned().unwrap_or_else(|| ENTRYPOINT.to_string());
    Some((c.name.clone(), command))
}

/// What the leader runs for `status --etcd`: the check from where it stands, of `namespace`'s
/// RegionPeerings (pure).
pub fn status_args(namespace: &str, timeout: Duration) -> Vec<String> {
    let timeout = format!("{}s", timeout.as_secs().max(1));
    ["status", "--etcd", "--etcd-from", "here", "--namespace", namespace, "--output", "json", "--timeout", &timeout]
        .map(String::from)
        .to_vec()
}

/// What the leader runs for `doctor`: the checks from where it stands, as JSON (pure).
pub fn doctor_args(name: &str, namespace: &str) -> Vec<String> {
    ["doctor", name, "--namespace", namespace, "--from", "here", "--output", "json"].map(String::from).to_vec()
}

/// Runs `argv` in the container; its standard output and error.
async fn run(pods: &Api<Pod>, pod: &str, container: &str, argv: Vec<String>) -> anyhow::Result<(Vec<u8>, Vec<u8>)> {
    let params = AttachParams::default().container(container).stdin(false).stdout(true).stderr(true);
    let mut process = pods.exec(pod, argv, &params).await?;
    let (stdout, stderr) = (process.stdout(), process.stderr());
    let read_all = |stream: Option<tokio::io::ReadHalf<tokio::io::SimplexStream>>| async move {
        let mut buffer = Vec::new();
        if let Some(stream) = stream {
            stream.take(MAX_ANSWER).read_to_end(&mut buffer).await?;
        }
        Ok::<_, std::io::Error>(buffer)
    };
    let (out, err) = tokio::join!(read_all(stdout), read_all(stderr));
    let _ = process.join().await;
    Ok((out?, err?))
}

/// The leader's answer as JSON, or what it said instead (pure).
fn parse<T: serde::de::DeserializeOwned>(stdout: &[u8], stderr: &[u8]) -> Result<T, String> {
    serde_json::from_slice(stdout).map_err(|_| {
        let said = String::from_utf8_lossy(stderr);
        let said = said.trim();
        let said: String = said.chars().take(400).collect();
        if said.is_empty() {
            "answered nothing readable".to_string()
        } else {
            format!("answered nothing readable: {said}")
        }
    })
}

/// The checks of `mirrors` after asking the leader (pure): each mirror takes the leader's check of
/// it; when the leader could not be asked, or did not check a mirror, that is a problem of the
/// mirror beside what was found here.
pub fn merge(mirrors: &mut [MirrorRow], asked: Result<Answer, String>) {
    for m in mirrors.iter_mut() {
        let theirs = match &asked {
            Ok(answer) => answer
                .mirrors
                .iter()
                .find(|r| r.origin == m.origin && r.peer == m.peer)
                .and_then(|r| r.etcd.clone())
                .map(|check| EtcdCheck { checked_from: Some(answer.pod.clone()), ..check })
                .ok_or_else(|| format!("the leader {} did not check this mirror", answer.pod)),
            Err(e) => Err(e.clone()),
        };
        match theirs {
            Ok(check) => m.etcd = Some(check),
            Err(why) => {
                let check = m.etcd.get_or_insert_with(EtcdCheck::default);
                check.problems.push(format!("not checked from the region's leader either: {why}"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mirror(origin: &str, peer: &str, check: Option<EtcdCheck>) -> MirrorRow {
        MirrorRow {
            origin: origin.into(),
            peer: peer.into(),
            object: "fed/a".into(),
            etcd: check,
            ..Default::default()
        }
    }

    fn unreachable_here() -> EtcdCheck {
        EtcdCheck {
            problems: vec!["cannot count the origin's keys on the local etcd: unreachable".into()],
            unreachable: true,
            ..Default::default()
        }
    }

    #[test]
    fn each_mirror_takes_the_leaders_check_of_it_and_says_where_it_ran() {
        let mut mirrors = [mirror("a", "b", Some(unreachable_here())), mirror("a", "c", Some(unreachable_here()))];
        let good =
            EtcdCheck { origin_keys: Some(5), peer_keys: Some(5), canary_synced: Some(true), ..Default::default() };
        let answer = Answer {
            pod: "aether-system/op-1".into(),
            mirrors: vec![mirror("a", "c", Some(good.clone())), mirror("a", "b", Some(good.clone()))],
        };
        merge(&mut mirrors, Ok(answer));
        for m in &mirrors {
            let check = m.etcd.as_ref().unwrap();
            assert_eq!(check.problems, Vec::<String>::new(), "{m:?}");
            assert_eq!(check.checked_from.as_deref(), Some("aether-system/op-1"));
            assert_eq!(check.peer_keys, Some(5));
        }
    }

    #[test]
    fn a_leader_that_could_not_be_asked_or_skipped_a_mirror_leaves_a_problem_beside_what_was_found_here() {
        let mut mirrors = [mirror("a", "b", Some(unreachable_here())), mirror("a", "c", None)];
        merge(&mut mirrors, Err("the leader Lease x/y is held by nobody".into()));
        assert_eq!(mirrors[0].etcd.as_ref().unwrap().problems.len(), 2);
        assert!(mirrors[0].etcd.as_ref().unwrap().problems[1].contains("held by nobody"));
        assert_eq!(mirrors[1].etcd.as_ref().unwrap().problems.len(), 1);

        let mut mirrors = [mirror("a", "b", Some(unreachable_here()))];
        merge(&mut mirrors, Ok(Answer { pod: "ns/p".into(), mirrors: vec![mirror("a", "c", None)] }));
        let problems = &mirrors[0].etcd.as_ref().unwrap().problems;
        assert!(problems.last().unwrap().contains("ns/p did not check this mirror"), "{problems:?}");
    }

    #[test]
    fn the_leaders_answer_is_its_status_as_json_or_what_it_said_instead() {
        let federation =
            Federation { mirrors: vec![mirror("a", "b", Some(EtcdCheck::default()))], ..Default::default() };
        let mut json = serde_json::to_value(&federation).unwrap();
        json["healthy"] = true.into();
        let parsed: Federation = parse(json.to_string().as_bytes(), b"").unwrap();
        assert_eq!(parsed.mirrors[0].origin, "a");
        let refused = parse::<Federation>(b"", b"error: unexpected argument '--etcd-from' found\n").err().unwrap();
        assert!(refused.contains("unexpected argument '--etcd-from'"), "{refused}");
        assert_eq!(parse::<Federation>(b"", b"").err().unwrap(), "answered nothing readable");
    }

    #[test]
    fn the_leader_runs_its_own_executable_with_the_check_from_where_it_stands() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "spec": {"containers": [{"name": "sidecar"}, {"name": "operator", "command": ["/bin/op"]}]}
        }))
        .unwrap();
        assert_eq!(operator_container(&pod), Some(("operator".into(), "/bin/op".into())));
        let plain: Pod = serde_json::from_value(serde_json::json!({"spec": {"containers": [{"name": "x"}]}})).unwrap();
        assert_eq!(operator_container(&plain), Some(("x".into(), ENTRYPOINT.into())));
        let args = status_args("fed", Duration::from_secs(20));
        assert_eq!(args.join(" "), "status --etcd --etcd-from here --namespace fed --output json --timeout 20s");
    }
}
