# shellcheck shell=bash
# A node's container runtime as tests/deploy/run-k8s-cluster-test (with a
# kubelet) and tests/deploy/run-k8s-cri-check (without one) set it up: the
# pause image's source, the bridge CNI network and containerd's
# configuration. Sourced; defines functions only.

# node_restrict_oom: "true" when this machine refuses to lower an
# oom_score_adj to -998, the score containerd's CRI gives every pod sandbox
# (the kubelet gives Guaranteed containers -997). Lowering a score needs
# CAP_SYS_RESOURCE, which root lacks on a sandboxed machine; runc's init then
# fails ("nsexec: failed to update /proc/self/oom_score_adj: Permission
# denied" in runc's log, "can't get final child's PID from pipe: EOF" in the
# pod's events). A subshell tries it on itself.
node_restrict_oom() {
  if (echo -998 >/proc/self/oom_score_adj) 2>/dev/null; then echo false; else echo true; fi
}

# node_pause_source DIR: the pod sandbox ("pause") image's program and
# Dockerfile: a static program that waits for a signal.
node_pause_source() {
  cat >"$1/pause.c" <<'EOF'
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
static void quit(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, NULL, WNOHANG) > 0) {} }
int main(void) {
  signal(SIGINT, quit);
  signal(SIGTERM, quit);
  signal(SIGCHLD, reap);
  for (;;) pause();
}
EOF
  printf 'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n' >"$1/Dockerfile"
}

# node_cni_config N DIR: node N's pod network, in DIR/net.d: bridge zsk8sN,
# pods in 10.217.N.0/24 behind the gateway 10.217.N.1, port mappings.
node_cni_config() {
  local n=$1 d=$2
  cat >"$d/net.d/10-zshard.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "zshard-test-$n",
  "plugins": [
    {
      "type": "bridge", "bridge": "zsk8s$n", "isGateway": true, "ipMasq": false, "hairpinMode": true,
      "ipam": {
        "type": "host-local", "dataDir": "$d/ipam",
        "ranges": [[{ "subnet": "10.217.$n.0/24", "gateway": "10.217.$n.1" }]],
        "routes": [{ "dst": "0.0.0.0/0" }]
      }
    },
    { "type": "portmap", "capabilities": { "portMappings": true } }
  ]
}
EOF
}

# node_containerd_config DIR PAUSE_IMAGE CNI_BIN RESTRICT_OOM: a containerd of
# the node's own under DIR (socket DIR/containerd.sock), its CRI plugin with
# runc (cgroupfs), overlayfs and the CNI network of node_cni_config.
node_containerd_config() {
  local d=$1 pause_image=$2 cni_bin=$3 restrict_oom=$4
  cat >"$d/containerd.toml" <<EOF
version = 2
root = "$d/containerd/root"
state = "$d/containerd/state"
[grpc]
  address = "$d/containerd.sock"
[ttrpc]
  address = "$d/containerd.sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "$d/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$pause_image"
  stream_server_address = "127.0.0.1"
  # No score below containerd's own (node_restrict_oom).
  restrict_oom_score_adj = $restrict_oom
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$cni_bin"
    conf_dir = "$d/net.d"
EOF
}
