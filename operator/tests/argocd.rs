//! The Argo CD health checks (config/argocd/*.lua), run against the cases in
//! config/argocd/testdata by `aether-lua-health` (hack/tools/lua-health, built by `make tools`):
//! gopher-lua, the interpreter Argo CD embeds, with the libraries and the `obj` Argo CD gives a
//! health script.
use aether_harness::tool_path;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

/// Runs `script` on `object` as Argo CD would: (status, message).
fn health(runner: &Path, script: &Path, object: &serde_json::Value) -> (String, String) {
    let mut child = Command::new(runner)
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("aether-lua-health runs");
    child.stdin.take().unwrap().write_all(object.to_string().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}: {}", script.display(), String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let (status, message) = text.trim_end_matches('\n').split_once('|').expect("status|message");
    (status.to_string(), message.to_string())
}

#[test]
fn health_checks_map_status_to_argo_health() {
    let runner = tool_path("aether-lua-health").unwrap();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/argocd");
    let cases: Vec<serde_json::Value> =
        serde_yaml::from_str(&std::fs::read_to_string(dir.join("testdata/cases.yaml")).unwrap()).unwrap();
    assert!(cases.len() >= 10);
    for (i, case) in cases.iter().enumerate() {
        let script = dir.join(case["script"].as_str().unwrap());
        let (status, message) = health(&runner, &script, &case["object"]);
        assert_eq!(status, case["expect"].as_str().unwrap(), "case {i} ({}): message {message:?}", case["script"]);
        assert!(!message.is_empty(), "case {i}: a health status always says why");
        if let Some(part) = case["messageContains"].as_str() {
            assert!(message.contains(part), "case {i}: message {message:?} lacks {part:?}");
        }
    }
}

/// The scripts' header names the doc that says how to install them, and that doc exists.
#[test]
fn health_checks_link_an_existing_doc() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for name in ["regionpeering-health.lua", "registryschema-health.lua", "crd-health.lua"] {
        let text = std::fs::read_to_string(root.join("config/argocd").join(name)).unwrap();
        let link = text
            .lines()
            .take_while(|l| l.starts_with("--"))
            .find_map(|l| l.split_whitespace().find(|w| w.starts_with("docs/")))
            .unwrap_or_else(|| panic!("{name}: no docs/ link in its header"));
        let (file, anchor) = link.split_once('#').unwrap_or((link, ""));
        let doc = std::fs::read_to_string(root.join(file)).unwrap_or_else(|e| panic!("{name}: {file}: {e}"));
        if !anchor.is_empty() {
            let anchors: Vec<String> = doc
                .lines()
                .filter(|l| l.starts_with('#'))
                .map(|l| {
                    l.trim_start_matches('#')
                        .trim()
                        .to_lowercase()
                        .chars()
                        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
                        .map(|c| if c == ' ' { '-' } else { c })
                        .collect()
                })
                .collect();
            assert!(anchors.iter().any(|a| a == anchor), "{name}: {file} has no heading #{anchor}");
        }
    }
}
