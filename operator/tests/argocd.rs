//! The Argo CD health checks (config/argocd/*.lua), run with a real Lua interpreter against the
//! cases in config/argocd/testdata.
use std::path::Path;
use std::process::Command;

fn lua_literal(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => "nil".into(),
        serde_json::Value::Bool(b) => b.to_string(),
        serde_json::Value::Number(n) => n.to_string(),
        serde_json::Value::String(s) => format!("{s:?}"),
        serde_json::Value::Array(items) => {
            format!("{{{}}}", items.iter().map(lua_literal).collect::<Vec<_>>().join(", "))
        }
        serde_json::Value::Object(map) => format!(
            "{{{}}}",
            map.iter().map(|(k, v)| format!("[{k:?}] = {}", lua_literal(v))).collect::<Vec<_>>().join(", ")
        ),
    }
}

#[test]
fn health_checks_map_status_to_argo_health() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/argocd");
    let cases: Vec<serde_json::Value> =
        serde_yaml::from_str(&std::fs::read_to_string(dir.join("testdata/cases.yaml")).unwrap()).unwrap();
    assert!(cases.len() >= 10);
    for (i, case) in cases.iter().enumerate() {
        let script = dir.join(case["script"].as_str().unwrap());
        let program = format!(
            "obj = {}\nlocal hs = dofile({:?})\nio.write(hs.status, '|', hs.message or '')",
            lua_literal(&case["object"]),
            script.display().to_string()
        );
        let out = Command::new("lua5.4").arg("-e").arg(&program).output().expect("lua5.4 is installed by `make tools`");
        assert!(out.status.success(), "case {i}: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (status, message) = text.split_once('|').unwrap();
        assert_eq!(status, case["expect"].as_str().unwrap(), "case {i} ({}): message {message:?}", case["script"]);
        assert!(!message.is_empty(), "case {i}: a health status always says why");
    }
}
