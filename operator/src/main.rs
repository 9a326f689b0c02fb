//! `aether-operator`: the operator binary.
use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "aether-operator", version, about = "Federates the aether endpoint registry across regions")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write the CRD YAML files into a directory (what `make crds` runs).
    Crds {
        #[arg(long, default_value = "crds")]
        out: PathBuf,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crds { out } => {
            std::fs::create_dir_all(&out)?;
            for (name, yaml) in aether_operator::api::crd_files() {
                std::fs::write(out.join(&name), yaml)?;
                println!("wrote {}", out.join(&name).display());
            }
            Ok(())
        }
    }
}
