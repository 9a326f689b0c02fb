#!/usr/bin/env python3
"""Writes the operator's image as an OCI image layout and its tarball, without a container
engine: one image per platform, each a single layer holding the static binary (FROM scratch),
user 65532, and a multi-arch index over them. Byte for byte reproducible: every timestamp is the
commit's, tar entries are sorted and owned by root, gzip carries no name or time.

    hack/oci-image.py --version V --revision SHA --source URL --created EPOCH \
        --binary linux/amd64=path --binary linux/arm64=path --out DIR

writes DIR/aether-operator-V.oci/ (the layout) and DIR/aether-operator-V.oci.tar (the same
layout as one file, what `crane push` and `skopeo copy oci-archive:` take).
"""
import argparse
import datetime
import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile


def blob(layout, data, media_type):
    digest = hashlib.sha256(data).hexdigest()
    path = os.path.join(layout, "blobs", "sha256", digest)
    with open(path, "wb") as f:
        f.write(data)
    return {"mediaType": media_type, "digest": "sha256:" + digest, "size": len(data)}


def layer_of(binary, created):
    """A tar with /aether-operator (0755, root-owned, at the commit's time), and its gzip."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        with open(binary, "rb") as f:
            content = f.read()
        info = tarfile.TarInfo("aether-operator")
        info.size, info.mode, info.mtime = len(content), 0o755, created
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        tar.addfile(info, io.BytesIO(content))
    uncompressed = raw.getvalue()
    compressed = io.BytesIO()
    with gzip.GzipFile(fileobj=compressed, mode="wb", mtime=0, filename="") as gz:
        gz.write(uncompressed)
    return uncompressed, compressed.getvalue()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--version", required=True)
    p.add_argument("--revision", required=True)
    p.add_argument("--source", required=True)
    p.add_argument("--created", type=int, required=True, help="seconds since the epoch")
    p.add_argument("--binary", action="append", required=True, help="os/arch=path")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    name = f"aether-operator-{a.version}"
    layout = os.path.join(a.out, name + ".oci")
    shutil.rmtree(layout, ignore_errors=True)
    os.makedirs(os.path.join(layout, "blobs", "sha256"))
    created = datetime.datetime.fromtimestamp(a.created, datetime.timezone.utc)
    created_text = created.strftime("%Y-%m-%dT%H:%M:%SZ")
    labels = {
        "org.opencontainers.image.title": "aether-operator",
        "org.opencontainers.image.description": "Federates the aether endpoint registry across regions' etcd clusters",
        "org.opencontainers.image.version": a.version,
        "org.opencontainers.image.revision": a.revision,
        "org.opencontainers.image.source": a.source,
        "org.opencontainers.image.licenses": "Apache-2.0",
        "org.opencontainers.image.created": created_text,
    }
    manifests = []
    for spec in a.binary:
        platform, binary = spec.split("=", 1)
        os_name, arch = platform.split("/")
        uncompressed, compressed = layer_of(binary, a.created)
        layer = blob(layout, compressed, "application/vnd.oci.image.layer.v1.tar+gzip")
        config = {
            "created": created_text,
            "architecture": arch,
            "os": os_name,
            "config": {
                "User": "65532:65532",
                "Entrypoint": ["/aether-operator"],
                "Cmd": ["run"],
                "ExposedPorts": {"8080/tcp": {}, "8443/tcp": {}},
                "Labels": labels,
            },
            "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(uncompressed).hexdigest()]},
            "history": [{"created": created_text, "created_by": "hack/oci-image.py: the static binary, FROM scratch"}],
        }
        config_desc = blob(
            layout, json.dumps(config, sort_keys=True).encode(), "application/vnd.oci.image.config.v1+json"
        )
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": config_desc,
            "layers": [layer],
            "annotations": labels,
        }
        desc = blob(layout, json.dumps(manifest, sort_keys=True).encode(), manifest["mediaType"])
        desc["platform"] = {"os": os_name, "architecture": arch}
        manifests.append(desc)
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": manifests,
        "annotations": labels,
    }
    index_desc = blob(layout, json.dumps(index, sort_keys=True).encode(), index["mediaType"])
    index_desc["annotations"] = {"org.opencontainers.image.ref.name": a.version}
    with open(os.path.join(layout, "index.json"), "w") as f:
        json.dump({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [index_desc]}, f, sort_keys=True)
    with open(os.path.join(layout, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)

    archive = os.path.join(a.out, name + ".oci.tar")
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for root, dirs, files in os.walk(layout):
            dirs.sort()
            for file in sorted(files):
                path = os.path.join(root, file)
                info = tar.gettarinfo(path, os.path.relpath(path, layout))
                info.mtime, info.uid, info.gid, info.uname, info.gname = a.created, 0, 0, "root", "root"
                with open(path, "rb") as f:
                    tar.addfile(info, f)
    print(f"{archive}: {os.path.getsize(archive)} bytes, index {index_desc['digest']}")
    for m in manifests:
        print(f"  {m['platform']['os']}/{m['platform']['architecture']}: manifest {m['digest']}")


if __name__ == "__main__":
    main()
