#!/usr/bin/env python3
"""Join single-platform OCI archives into one multi-platform image: an OCI image index.

    images/index.py OUT.oci.tar PLATFORM=IN.oci.tar [PLATFORM=IN.oci.tar ...]

Each IN is an archive of images/build.sh --platform PLATFORM: an OCI layout whose index.json
names one image manifest, tagged with the version. OUT is an OCI layout (an `oci-archive`)
holding every input's blobs and one image index (application/vnd.oci.image.index.v1+json)
with one manifest per platform, in the order given, each with its platform (os, architecture,
variant for linux/arm/v7); index.json names that image index with the inputs' tag. A
registry or engine that pulls it gets the manifest of its node's platform
(`skopeo copy --all oci-archive:OUT docker://...` pushes all of them).

Reproducible: the JSON is written with fixed key order and no spaces, the archive's members
are sorted, owned by 0:0 and dated SOURCE_DATE_EPOCH (default 0). Every input blob's digest
is checked as it is copied.
"""

import hashlib
import io
import json
import os
import sys
import tarfile

INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
REF = "org.opencontainers.image.ref.name"


def die(message):
    print(f"images/index.py: {message}", file=sys.stderr)
    sys.exit(1)


def platform_of(name):
    parts = name.split("/")
    if len(parts) not in (2, 3) or not all(parts):
        die(f"not an OCI platform: {name} (os/architecture[/variant])")
    platform = {"architecture": parts[1], "os": parts[0]}
    if len(parts) == 3:
        platform["variant"] = parts[2]
    return platform


def encode(value):
    return json.dumps(value, separators=(",", ":")).encode()


def digest(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def read_layout(path):
    """The blobs (digest -> bytes) and the one manifest descriptor of a single-image archive."""
    blobs = {}
    index = None
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            name = os.path.normpath(member.name)
            if not member.isfile():
                continue
            data = tar.extractfile(member).read()
            if name == "index.json":
                index = json.loads(data)
            elif name.startswith("blobs/sha256/"):
                d = "sha256:" + name[len("blobs/sha256/"):]
                if digest(data) != d:
                    die(f"{path}: blob {d} does not match its content")
                blobs[d] = data
    if index is None:
        die(f"{path}: no index.json (not an OCI layout)")
    manifests = index.get("manifests", [])
    if len(manifests) != 1 or manifests[0].get("mediaType") != MANIFEST:
        die(f"{path}: index.json must name exactly one image manifest, not {manifests}")
    descriptor = manifests[0]
    if descriptor["digest"] not in blobs:
        die(f"{path}: the manifest {descriptor['digest']} is not in the archive")
    return blobs, descriptor


def main(argv):
    if len(argv) < 3 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(argv) > 1 and argv[1] in ("-h", "--help") else 2
    out = argv[1]
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    blobs = {}
    entries = []
    tag = None
    seen = set()
    for arg in argv[2:]:
        name, sep, path = arg.partition("=")
        if not sep:
            die(f"expected PLATFORM=ARCHIVE, not {arg}")
        if name in seen:
            die(f"platform {name} given twice")
        seen.add(name)
        input_blobs, descriptor = read_layout(path)
        ref = descriptor.get("annotations", {}).get(REF)
        if tag is None:
            tag = ref
        elif ref != tag:
            die(f"{path} is tagged {ref}, the others {tag}")
        config = json.loads(input_blobs[json.loads(input_blobs[descriptor["digest"]])["config"]["digest"]])
        platform = platform_of(name)
        if (config.get("os"), config.get("architecture")) != (platform["os"], platform["architecture"]):
            die(f"{path} is {config.get('os')}/{config.get('architecture')}, not {name}")
        blobs.update(input_blobs)
        entries.append(
            {
                "mediaType": MANIFEST,
                "digest": descriptor["digest"],
                "size": descriptor["size"],
                "platform": platform,
            }
        )
    image_index = encode({"schemaVersion": 2, "mediaType": INDEX, "manifests": entries})
    blobs[digest(image_index)] = image_index
    top = {"mediaType": INDEX, "digest": digest(image_index), "size": len(image_index)}
    if tag is not None:
        top["annotations"] = {REF: tag}
    files = {
        "oci-layout": encode({"imageLayoutVersion": "1.0.0"}),
        "index.json": encode({"schemaVersion": 2, "mediaType": INDEX, "manifests": [top]}),
    }
    for d, data in blobs.items():
        files["blobs/sha256/" + d.split(":", 1)[1]] = data

    def entry(name, directory=False):
        info = tarfile.TarInfo(name)
        info.mtime = epoch
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        if directory:
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
        else:
            info.mode = 0o644
        return info

    tmp = out + ".tmp"
    with tarfile.open(tmp, "w", format=tarfile.GNU_FORMAT) as tar:
        for name in ["blobs", "blobs/sha256"]:
            tar.addfile(entry(name, directory=True))
        for name in sorted(files):
            info = entry(name)
            info.size = len(files[name])
            tar.addfile(info, io.BytesIO(files[name]))
    os.replace(tmp, out)
    platforms = ", ".join(argv[i].partition("=")[0] for i in range(2, len(argv)))
    print(f"{out}\t{os.path.getsize(out)} bytes\t({tag}: {platforms})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
