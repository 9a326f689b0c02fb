//! The image as shipped (`make image`): an OCI index (linux/amd64 and linux/arm64; `make test`
//! builds the host's only) whose images are FROM scratch, run as user 65532, carry the version,
//! and hold a static binary; the host's binary, taken out of the image's layer, runs a two-region federation (no CA bundle in the image: the public web roots
//! are compiled in, and the tests' etcds and API servers give their own CAs).
use aether_e2e::Federation;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The platforms `make image` was asked for (hack/image.sh: AETHER_IMAGE_PLATFORMS, both by
/// default; `make test` builds the host's only), in the index's order.
fn platforms_built() -> Vec<String> {
    let wanted = std::env::var("AETHER_IMAGE_PLATFORMS").unwrap_or_else(|_| "linux/amd64,linux/arm64".into());
    let wanted: Vec<&str> = wanted.split(',').map(str::trim).collect();
    ["linux/amd64", "linux/arm64"].into_iter().filter(|p| wanted.contains(p)).map(String::from).collect()
}

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// One platform's image: its config, and its layer unpacked.
struct Image {
    config: serde_json::Value,
    root: PathBuf,
}

/// Unpacks the image tarball `make image` wrote into `dir`: every platform's image, by
/// "os/arch".
fn unpack(dir: &Path) -> BTreeMap<String, Image> {
    let archive = repo(&format!("target/image/aether-operator-{VERSION}.oci.tar"));
    assert!(archive.is_file(), "{} is missing: `make image` writes it", archive.display());
    let layout = dir.join("layout");
    std::fs::create_dir_all(&layout).unwrap();
    run(Command::new("tar").arg("-xf").arg(&archive).arg("-C").arg(&layout));
    let read = |digest: &str| -> Vec<u8> {
        let hex = digest.strip_prefix("sha256:").expect("a sha256 digest");
        std::fs::read(layout.join("blobs/sha256").join(hex)).unwrap()
    };
    let json = |digest: &str| -> serde_json::Value { serde_json::from_slice(&read(digest)).unwrap() };
    let top: serde_json::Value = serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let index = json(top["manifests"][0]["digest"].as_str().unwrap());
    assert_eq!(index["mediaType"], "application/vnd.oci.image.index.v1+json");
    let mut images = BTreeMap::new();
    for entry in index["manifests"].as_array().unwrap() {
        let platform = format!(
            "{}/{}",
            entry["platform"]["os"].as_str().unwrap(),
            entry["platform"]["architecture"].as_str().unwrap()
        );
        let manifest = json(entry["digest"].as_str().unwrap());
        let config = json(manifest["config"]["digest"].as_str().unwrap());
        let layers = manifest["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 1, "{platform}: FROM scratch and one layer");
        let root = dir.join(platform.replace('/', "-"));
        std::fs::create_dir_all(&root).unwrap();
        let layer = dir.join(format!("{}.tar.gz", platform.replace('/', "-")));
        std::fs::write(&layer, read(layers[0]["digest"].as_str().unwrap())).unwrap();
        run(Command::new("tar").arg("-xzf").arg(&layer).arg("-C").arg(&root));
        images.insert(platform, Image { config, root });
    }
    images
}

/// The ELF machine of a binary, and whether it asks for a dynamic loader (PT_INTERP).
fn elf(path: &Path) -> (u16, bool) {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[..4], b"\x7fELF", "{} is an ELF file", path.display());
    assert_eq!(bytes[4], 2, "64-bit");
    let u16_at = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]);
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
    let (phoff, phentsize, phnum) = (u64_at(32) as usize, u16_at(54) as usize, u16_at(56) as usize);
    let interp = (0..phnum).any(|i| {
        let at = phoff + i * phentsize;
        u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) == 3
    });
    (u16_at(18), interp)
}

#[test]
fn the_images_index_lists_the_platforms_built_each_static_non_root_and_versioned() {
    let dir = tempfile::tempdir().unwrap();
    let images = unpack(dir.path());
    assert_eq!(images.keys().cloned().collect::<Vec<_>>(), platforms_built());
    for (platform, image) in &images {
        let config = &image.config["config"];
        assert_eq!(config["User"], "65532:65532", "{platform}");
        assert_eq!(config["Entrypoint"], serde_json::json!(["/aether-operator"]), "{platform}");
        let labels = &config["Labels"];
        assert_eq!(labels["org.opencontainers.image.version"], VERSION, "{platform}");
        for label in ["org.opencontainers.image.revision", "org.opencontainers.image.source"] {
            assert!(labels[label].as_str().is_some_and(|v| !v.is_empty()), "{platform}: {label}");
        }
        let entries: Vec<_> = std::fs::read_dir(&image.root).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(entries, ["aether-operator"], "{platform}: the binary and nothing else (no CA bundle, no shell)");
    }
    for (platform, image) in &images {
        let expected = match platform.as_str() {
            "linux/amd64" => (62, false),
            "linux/arm64" => (183, false),
            other => panic!("{other}: a platform nobody asked for"),
        };
        assert_eq!(elf(&image.root.join("aether-operator")), expected, "{platform}: its machine, static");
    }
    let sbom = repo(&format!("target/image/aether-operator-{VERSION}.spdx.json"));
    let sbom: serde_json::Value = serde_json::from_slice(&std::fs::read(&sbom).unwrap()).unwrap();
    let crates = sbom["packages"].as_array().unwrap();
    assert!(
        crates.iter().any(|p| p["name"] == "etcd-client") && crates.len() > 100,
        "{} crates in the SBOM",
        crates.len()
    );
}

#[tokio::test]
async fn a_federation_runs_on_the_images_binary() {
    let dir = tempfile::tempdir().unwrap();
    let images = unpack(dir.path());
    let host = match std::env::consts::ARCH {
        "aarch64" => "linux/arm64",
        _ => "linux/amd64",
    };
    let binary = images[host].root.join("aether-operator");
    let out = Command::new(&binary).arg("--version").output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), format!("aether-operator {VERSION}"));
    // SAFETY: set once, before anything reads it on another thread.
    unsafe { std::env::set_var("AETHER_OPERATOR_BIN", &binary) };

    let mut fed = Federation::start(&["a", "b"]).await.expect("regions start");
    fed.apply_peerings().unwrap();
    for r in ["a", "b"] {
        fed.write_endpoints(r, 100).await.unwrap();
        fed.start_operator(r).unwrap();
    }
    for r in ["a", "b"] {
        fed.wait_condition(r, "Ready", "True", Duration::from_secs(90)).await.unwrap();
    }
    for (region, origin) in [("a", "b"), ("b", "a")] {
        assert_eq!(fed.keys_of(region, origin).await.unwrap(), 100, "{origin}'s keys in {region}");
    }
    let (healthy, table) = fed.operator_cli(&["status", "--context", "a", "--context", "b"]).unwrap();
    assert!(healthy, "{table}");
}

/// The air-gapped steps of docs/installation.md work as written: the tarball unpacked and pushed with
/// `crane push <dir> <ref>` lands as one multi-arch index (not an index of an index), and each
/// platform's image is pulled by platform.
#[test]
fn the_air_gapped_push_lands_one_multi_arch_index() {
    let crane = aether_harness::tool_path("crane").expect("crane, from `make tools`");
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let address = format!("127.0.0.1:{port}");
    let mut registry = Command::new(&crane)
        .args(["registry", "serve", "--address", &address])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("crane registry serve");
    let layout = dir.path().join(format!("aether-operator-{VERSION}"));
    std::fs::create_dir_all(&layout).unwrap();
    let archive = repo(&format!("target/image/aether-operator-{VERSION}.oci.tar"));
    run(Command::new("tar").arg("-xf").arg(&archive).arg("-C").arg(&layout));
    let reference = format!("{address}/aether/aether-operator:{VERSION}");
    // The registry takes a moment to listen: the push is retried until a deadline.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let out = Command::new(&crane).arg("push").arg(&layout).arg(&reference).output().unwrap();
        if out.status.success() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "crane push: {}", String::from_utf8_lossy(&out.stderr));
        std::thread::sleep(Duration::from_millis(200));
    }
    let output = |args: &[&str]| {
        let out = Command::new(&crane).args(args).output().unwrap();
        assert!(out.status.success(), "crane {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let index = output(&["manifest", &reference]);
    let platforms: Vec<String> = index["manifests"]
        .as_array()
        .expect("an index")
        .iter()
        .map(|m| {
            format!(
                "{}/{}",
                m["platform"]["os"].as_str().unwrap_or("?"),
                m["platform"]["architecture"].as_str().unwrap_or("?")
            )
        })
        .collect();
    assert_eq!(platforms, platforms_built(), "{index}");
    for platform in &platforms {
        let config = output(&["config", &reference, "--platform", platform]);
        assert_eq!(config["config"]["User"], "65532:65532", "{platform}: {config}");
        assert_eq!(
            format!("{}/{}", config["os"].as_str().unwrap(), config["architecture"].as_str().unwrap()),
            *platform
        );
    }
    let _ = registry.kill();
    let _ = registry.wait();
}
