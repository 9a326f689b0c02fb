#!/usr/bin/env python3
"""The image's SBOM: an SPDX 2.3 JSON document of every crate compiled into the operator binary
for a target (the normal-dependency closure of aether-operator, as `cargo metadata` resolves it
for that platform), with versions, licenses and Cargo.lock's checksums.

    hack/sbom.py --version V --target TRIPLE --created EPOCH --out FILE
"""
import argparse
import datetime
import json
import subprocess
import tomllib


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--version", required=True)
    p.add_argument("--target", action="append", required=True)
    p.add_argument("--created", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    with open("Cargo.lock", "rb") as f:
        checksums = {(pkg["name"], pkg["version"]): pkg.get("checksum") for pkg in tomllib.load(f)["package"]}
    crates = {}
    for target in a.target:
        meta = json.loads(
            subprocess.check_output(
                ["cargo", "metadata", "--format-version", "1", "--locked", "--filter-platform", target]
            )
        )
        packages = {pkg["id"]: pkg for pkg in meta["packages"]}
        nodes = {node["id"]: node for node in meta["resolve"]["nodes"]}
        root = next(pkg["id"] for pkg in meta["packages"] if pkg["name"] == "aether-operator")
        todo = [root]
        while todo:
            pid = todo.pop()
            if pid in crates:
                continue
            crates[pid] = packages[pid]
            for dep in nodes[pid]["deps"]:
                if any(kind["kind"] is None for kind in dep["dep_kinds"]):
                    todo.append(dep["pkg"])

    def spdx_id(pkg):
        return "SPDXRef-Crate-" + "".join(c if c.isalnum() or c in ".-" else "-" for c in f"{pkg['name']}-{pkg['version']}")

    created = datetime.datetime.fromtimestamp(a.created, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    spdx_packages, relationships = [], []
    for pkg in sorted(crates.values(), key=lambda p: (p["name"], p["version"])):
        entry = {
            "SPDXID": spdx_id(pkg),
            "name": pkg["name"],
            "versionInfo": pkg["version"],
            "licenseDeclared": pkg.get("license") or "NOASSERTION",
            "licenseConcluded": "NOASSERTION",
            "copyrightText": "NOASSERTION",
            "downloadLocation": f"https://crates.io/api/v1/crates/{pkg['name']}/{pkg['version']}/download"
            if pkg.get("source", "") and "crates.io" in pkg.get("source", "")
            else "NOASSERTION",
            "filesAnalyzed": False,
            "externalRefs": [
                {"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl",
                 "referenceLocator": f"pkg:cargo/{pkg['name']}@{pkg['version']}"}
            ],
        }
        checksum = checksums.get((pkg["name"], pkg["version"]))
        if checksum:
            entry["checksums"] = [{"algorithm": "SHA256", "checksumValue": checksum}]
        spdx_packages.append(entry)
        if pkg["name"] == "aether-operator":
            relationships.append({"spdxElementId": "SPDXRef-DOCUMENT", "relationshipType": "DESCRIBES", "relatedSpdxElement": spdx_id(pkg)})
        else:
            relationships.append({"spdxElementId": "SPDXRef-Crate-aether-operator-" + a.version, "relationshipType": "DEPENDS_ON", "relatedSpdxElement": spdx_id(pkg)})
    document = {
        "spdxVersion": "SPDX-2.3",
        "dataLicense": "CC0-1.0",
        "SPDXID": "SPDXRef-DOCUMENT",
        "name": f"aether-operator-{a.version}",
        "documentNamespace": f"https://github.com/aether/aether-operator/spdx/{a.version}",
        "creationInfo": {"created": created, "creators": ["Tool: hack/sbom.py"]},
        "packages": spdx_packages,
        "relationships": relationships,
    }
    with open(a.out, "w") as f:
        json.dump(document, f, indent=1, sort_keys=True)
    print(f"{a.out}: {len(spdx_packages)} crates")


if __name__ == "__main__":
    main()
