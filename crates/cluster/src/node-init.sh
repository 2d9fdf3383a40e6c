# PID 1 of the node's own mount and PID namespaces (see node.rs). Run by `unshare --mount
# --pid --fork --propagation slave` as `bash -c`, with NODE_ROOT (the node's temporary
# directory) and SYSCTLS (`key=value ...`, the kernel settings the kubelet insists on) in the
# environment. Everything below happens inside the namespaces: the host sees none of it.
set -euo pipefail

# This PID namespace's own /proc: the kubelet and containerd look up their processes there.
mount -t proc proc /proc

# The node's well-known directories are the node's temporary directory. The kubelet and
# containerd write to /var/lib, /var/log and /run wherever they are configured otherwise
# (v1.20's kubelet has /var/log/pods built in, both write /var/log/containers, containerd's
# shims /run/containerd), and hostPath volumes of the deploy/ manifests name
# /var/lib/kubelet: all of it lands in NODE_ROOT.
for dir in var-lib var-log run; do
    mkdir -p "$NODE_ROOT/$dir"
done
mount --bind "$NODE_ROOT/var-lib" /var/lib
mount --bind "$NODE_ROOT/var-log" /var/log
mount --bind "$NODE_ROOT/run" /run
mkdir -p /var/lib/kubelet /var/log/pods /var/log/containers

# The kubelet sets these kernel settings at start when they differ (vm.overcommit_memory,
# kernel.panic, ...): on the host that would outlive the cluster. Here it reads them from
# files that already hold what it wants, so it writes nothing.
mkdir -p "$NODE_ROOT/sysctl"
for kv in $SYSCTLS; do
    key=${kv%%=*}
    file="$NODE_ROOT/sysctl/${key//\//.}"
    printf '%s\n' "${kv#*=}" >"$file"
    mount --bind "$file" "/proc/sys/$key"
done

# The kubelet adds iptables chains and rules (KUBE-FIREWALL, canaries) to the host's
# tables, and both releases carry on without iptables: here every iptables command fails.
for cmd in iptables ip6tables iptables-save ip6tables-save iptables-restore ip6tables-restore; do
    path=$(command -v "$cmd" || true)
    [ -n "$path" ] || continue
    real=$(readlink -f "$path")
    if ! grep -q " $real " /proc/self/mountinfo; then
        mount --bind /bin/false "$real"
    fi
done

echo ready
# Processes that the node's daemons leave behind (containerd's shims daemonize) become this
# shell's children: waiting reaps them.
while :; do
    sleep 3600 &
    wait $! || true
done
