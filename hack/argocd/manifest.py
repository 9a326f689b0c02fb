#!/usr/bin/env python3
"""Argo CD's manifests/install.yaml trimmed to what syncs an Application, for a kind cluster that
pulls nothing.

Kept: the three CRDs, the application-controller (StatefulSet), the repo-server and redis, with
their ServiceAccounts, RBAC, Services, NetworkPolicies and the shared ConfigMaps and Secret.
Dropped: dex, notifications, the ApplicationSet controller and argocd-server (the scenarios read
Argo CD's view from the Application's status, which the controller writes).

Changed:
  * every quay.io/argoproj/argocd image -> IMAGE with imagePullPolicy Never;
  * redis runs from IMAGE too (Debian's redis-server is in it), as `redis-server` with upstream's args;
  * argocd-cmd-params-cm: controller.resource.health.persist (Argo CD 3 keeps resource health out
    of the Application's status unless asked);
  * argocd-cm: the reconciliation every RECONCILE without jitter (a commit shows within it), and
    the project's health checks (--health GROUP_KIND=FILE), as docs/operating.md installs them;
  * an AppProject "default" and argocd-secret's server.secretkey (argocd-server makes both at its
    first start; without the server nobody does).

usage: manifest.py --install install.yaml --image REF --out OUT.yaml
                   [--health GROUP_KIND=FILE.lua ...] [--reconcile 10s]
"""
import argparse
import secrets
import sys

import yaml

DROPPED = ("argocd-dex-server", "argocd-notifications", "argocd-applicationset-controller", "argocd-server")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--install", required=True)
    ap.add_argument("--image", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--health", action="append", default=[])
    ap.add_argument("--reconcile", default="10s")
    a = ap.parse_args()

    out = []
    with open(a.install) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    for d in docs:
        kind, name = d["kind"], d["metadata"]["name"]
        if kind != "CustomResourceDefinition" and name.startswith(DROPPED):
            continue
        if kind in ("Deployment", "StatefulSet"):
            spec = d["spec"]["template"]["spec"]
            for c in spec.get("initContainers", []) + spec["containers"]:
                image = c.get("image", "")
                if image.startswith("quay.io/argoproj/argocd:"):
                    c["image"] = a.image
                elif "redis" in image:
                    c["image"] = a.image
                    c["command"] = ["redis-server"]
                else:
                    sys.exit(f"manifest.py: unexpected image {image} in {kind}/{name}")
                c["imagePullPolicy"] = "Never"
        if kind == "Secret" and name == "argocd-secret":
            # argocd-server writes the key it signs with at its first start; without the server,
            # the controller refuses every Application ("server.secretkey is missing").
            d.setdefault("stringData", {})["server.secretkey"] = secrets.token_urlsafe(32)
        if kind == "ConfigMap" and name == "argocd-cmd-params-cm":
            # Argo CD 3 keeps each resource's health out of the Application's status (in redis, for
            # argocd-server's API); the scenarios read Argo CD's view from that status.
            d["data"] = {**(d.get("data") or {}), "controller.resource.health.persist": "true"}
        if kind == "ConfigMap" and name == "argocd-cm":
            data = d.get("data") or {}
            data["timeout.reconciliation"] = a.reconcile
            data["timeout.reconciliation.jitter"] = "0s"
            for h in a.health:
                group_kind, path = h.split("=", 1)
                with open(path) as f:
                    data[f"resource.customizations.health.{group_kind}"] = f.read()
            d["data"] = data
        out.append(d)
    out.append({
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "AppProject",
        "metadata": {"name": "default"},
        "spec": {
            "sourceRepos": ["*"],
            "destinations": [{"namespace": "*", "server": "*"}],
            "clusterResourceWhitelist": [{"group": "*", "kind": "*"}],
        },
    })
    with open(a.out, "w") as f:
        yaml.safe_dump_all(out, f, sort_keys=False, width=1 << 20)
    print(f"{a.out}: {len(out)} objects", file=sys.stderr)


if __name__ == "__main__":
    main()
