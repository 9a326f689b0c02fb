//! Where the binaries built by `make tools` live.
use std::path::PathBuf;

/// The directory `hack/tools.sh` links every tool into: `AETHER_TOOLS_BIN`, or the default cache.
pub fn tools_bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("AETHER_TOOLS_BIN") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/root"));
    home.join(".cache/aether-federation/tools/bin")
}

/// The path of one tool, with an error that says how to get it when it is missing.
pub fn tool_path(name: &str) -> anyhow::Result<PathBuf> {
    let path = tools_bin_dir().join(name);
    if path.exists() {
        Ok(path)
    } else {
        anyhow::bail!("{} is missing: run `make tools` first (or set AETHER_TOOLS_BIN)", path.display())
    }
}
