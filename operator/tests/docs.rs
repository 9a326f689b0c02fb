//! The commands the README and the guides tell a user to run are ones the tools accept, as
//! written: every shell block of README.md and docs/*.md is split into commands, and each command
//! of this project's tools goes to the real tool. `aether-operator` and `kubectl aether` commands
//! are parsed by this build's executable; `kubectl` commands by kubectl (its flags, values and
//! subcommands); `helm install`/`upgrade` with their `--set`s render the chart in the checkout
//! (values.schema.json and the templates judge the values); `helm show crds` reads it; `make`
//! targets exist. A renamed flag, value or subcommand fails here before a user meets it.
mod support;

use aether_harness::tool_path;
use std::path::PathBuf;
use std::process::Command;
use support::*;

/// The documents whose shell blocks are checked.
fn documents() -> Vec<PathBuf> {
    let mut out = vec![repo("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(repo("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    out.extend(docs);
    out
}

/// What the variables the guides set stand for, as a user's shell would have them.
const SAMPLES: &[(&str, &str)] = &[
    ("$DIGEST", "sha256:0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9"),
    ("$MIRROR_PASSWORD", "0123456789abcdef"),
];

/// The commands of a document's ```sh / ```bash / ```console blocks: continuation lines joined,
/// comments dropped, pipelines and `&&` lists split, each as its words (pure).
fn commands(markdown: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut in_block = false;
    let mut text = String::new();
    for line in markdown.lines() {
        let fence = line.trim_start().starts_with("```");
        if fence && !in_block {
            let lang = line.trim_start().trim_start_matches('`').trim();
            in_block = matches!(lang, "sh" | "bash" | "console" | "shell");
            continue;
        }
        if fence {
            in_block = false;
            continue;
        }
        if in_block {
            text.push_str(line.trim_start_matches("$ "));
            text.push('\n');
        }
    }
    for line in text.replace("\\\n", " ").lines() {
        let line = SAMPLES.iter().fold(line.to_string(), |l, (name, value)| l.replace(name, value));
        let Some(words) = shlex::split(&line) else { panic!("not one shell command line: {line}") };
        let words: Vec<String> = words.into_iter().take_while(|w| !w.starts_with('#')).collect();
        for command in words.split(|w| matches!(w.as_str(), "|" | "&&" | "&" | ";")) {
            if !command.is_empty() {
                out.push(command.to_vec());
            }
        }
    }
    out
}

/// What checking one command ran, and whether the tool accepted it; None when the command is not
/// one of the tools checked here (openssl, curl, crane, a hack/ script).
fn check(command: &[String]) -> Option<(String, bool)> {
    let words: Vec<&str> = command.iter().map(String::as_str).collect();
    let run = |mut cmd: Command| {
        let shown = format!("{cmd:?}");
        let out = cmd.output().unwrap_or_else(|e| panic!("{shown}: {e}"));
        let said = format!("{shown}\n{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (said, out.status.success())
    };
    match words.as_slice() {
        ["kubectl", "aether", args @ ..] | ["aether-operator", args @ ..] => {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_aether-operator"));
            cmd.args(args).arg("--help");
            Some(run(cmd))
        }
        ["kubectl", args @ ..] => {
            let mut cmd = Command::new(tool_path("kubectl").unwrap());
            cmd.args(args).arg("--help");
            Some(run(cmd))
        }
        ["helm", verb @ ("install" | "upgrade"), release, _chart, args @ ..] => {
            let mut cmd = Command::new(tool_path("helm").unwrap());
            cmd.args(["template", release]).arg(repo("charts/aether-federation")).args(["--kube-version", "1.35.0"]);
            cmd.args(args.iter().filter(|a| !matches!(**a, "--reuse-values" | "--wait" | "--atomic")));
            let (said, ok) = run(cmd);
            Some((format!("helm {verb}, rendered as: {said}"), ok))
        }
        ["helm", "show", "crds", _chart] => {
            let mut cmd = Command::new(tool_path("helm").unwrap());
            cmd.args(["show", "crds"]).arg(repo("charts/aether-federation"));
            Some(run(cmd))
        }
        ["helm", "uninstall" | "test", args @ ..] => {
            let mut cmd = Command::new(tool_path("helm").unwrap());
            cmd.args(&words[1..2]).args(args).arg("--help");
            Some(run(cmd))
        }
        ["make", targets @ ..] => {
            let makefile = std::fs::read_to_string(repo("Makefile")).unwrap();
            let missing: Vec<&&str> =
                targets.iter().filter(|t| !makefile.lines().any(|l| l.starts_with(&format!("{t}:")))).collect();
            Some((format!("make targets {targets:?}, missing {missing:?}"), missing.is_empty()))
        }
        _ => None,
    }
}

#[test]
fn every_command_the_readme_and_the_guides_give_is_one_the_tools_accept() {
    let (mut checked, mut refused) = (0, Vec::new());
    let mut per_tool = std::collections::BTreeMap::<String, usize>::new();
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap();
        for command in commands(&text) {
            let Some((said, ok)) = check(&command) else { continue };
            checked += 1;
            *per_tool.entry(command[..2.min(command.len())].join(" ")).or_default() += 1;
            if !ok {
                refused.push(format!(
                    "{}: {}\n  {}",
                    doc.display(),
                    command.join(" "),
                    said.trim().replace('\n', "\n  ")
                ));
            }
        }
    }
    println!("checked {checked} commands: {per_tool:?}");
    assert!(refused.is_empty(), "commands in the docs the tools refuse:\n{}", refused.join("\n"));
    // The README's own: install, verify, status.
    for tool in ["helm install", "kubectl aether", "kubectl -n", "make demo", "make test"] {
        assert!(per_tool.keys().any(|k| k.starts_with(tool)), "no `{tool}` command checked: {per_tool:?}");
    }
}

#[test]
fn a_command_with_a_renamed_flag_value_or_subcommand_is_refused() {
    let refused = |line: &str| {
        let command = commands(&format!("```sh\n{line}\n```\n")).remove(0);
        let (said, ok) = check(&command).expect("a checked tool");
        assert!(!ok, "{line} was accepted:\n{said}");
    };
    refused("kubectl aether status --context a --etc");
    refused("kubectl aether statuss");
    refused("kubectl aether status --wait forever");
    refused("kubectl -n aether-system wait --for=condition=Ready regionpeering/eu-west --timout=5m");
    refused("helm install aether chart.tgz -n aether-system --set regionPeering.regoin=eu-west");
    refused("make deom");
    // And the shapes the docs use parse as one command each.
    let parsed = commands("```sh\nkubectl get x -o json \\\n  | jq . # a comment\nmake demo   # two regions\n```\n");
    assert_eq!(parsed, [vec!["kubectl", "get", "x", "-o", "json"], vec!["jq", "."], vec!["make", "demo"]]);
}
