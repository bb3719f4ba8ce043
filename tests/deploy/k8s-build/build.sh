#!/usr/bin/env bash
# Build the Kubernetes control plane, kubelet, kubectl and the CNI plugins that
# tests/deploy/run-k8s-cluster-test runs, out of tree: this module pins
# k8s.io/kubernetes and replaces every k8s.io/* staging module with its
# matching v0.x release (k8s.io/kubernetes' own go.mod points them at
# ./staging, which only works inside its repository).
#
# Idempotent: binaries land in $ZS_K8S_CACHE/<version>/bin (default
# /var/cache/zshard-k8s) and a binary already there is not rebuilt.  The build
# is slow (tens of minutes of CPU); it runs at low priority, one package at a
# time, with the lowest-memory link flags, so it spares a shared machine.
#
#   tests/deploy/k8s-build/build.sh            build what is missing
#   tests/deploy/k8s-build/build.sh NAME...    only these (e.g. zscri bridge
#                                              host-local loopback portmap: what
#                                              run-k8s-cri-check needs, minutes)
#   tests/deploy/k8s-build/build.sh --print    print the bin directory only
# Environment: ZS_K8S_CACHE  where the binaries go (default /var/cache/zshard-k8s)
#              ZS_K8S_JOBS   packages compiled at once (default 1)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
k8s_version=$(awk '$1 == "k8s.io/kubernetes" { print $2; exit }' "$here/go.mod")
cni_version=$(awk '$1 == "github.com/containernetworking/plugins" { print $2; exit }' "$here/go.mod")
cache=${ZS_K8S_CACHE:-/var/cache/zshard-k8s}
bin="$cache/k8s-$k8s_version-cni-$cni_version/bin"
if [ "${1:-}" = --print ]; then
	echo "$bin"
	exit 0
fi
export PATH=/usr/local/go/bin:$PATH
# One package at a time and one thread by default (a shared machine);
# ZS_K8S_JOBS=N on an idle one.
jobs=${ZS_K8S_JOBS:-1}
export CGO_ENABLED=0 GOFLAGS="-p=$jobs -mod=mod -buildvcs=false" GOMAXPROCS=$jobs
mkdir -p "$bin"
cd "$here"
# What `kubectl version` and the node status report (the upstream build sets
# the same variables from git).
minor=${k8s_version#v1.}
minor=${minor%%.*}
vpkg=k8s.io/component-base/version
version_flags="-X $vpkg.gitVersion=$k8s_version -X $vpkg.gitMajor=1 -X $vpkg.gitMinor=$minor"
version_flags+=" -X $vpkg.gitTreeState=clean -X $vpkg.buildDate=1970-01-01T00:00:00Z"
# Most useful first: the API server alone gives server-side validation (dry
# run, with any kubectl); then the controllers and the scheduler, the
# kubelet, the cluster DNS (zsdns, ours) and the CNI plugins; kubectl last
# (run-k8s-cluster-test uses a kubectl on PATH of 1.31 or later until then).
targets=(
	kube-apiserver=k8s.io/kubernetes/cmd/kube-apiserver
	kube-controller-manager=k8s.io/kubernetes/cmd/kube-controller-manager
	kube-scheduler=k8s.io/kubernetes/cmd/kube-scheduler
	kubelet=k8s.io/kubernetes/cmd/kubelet
	zsdns=zshard/tests/deploy/k8s-build/zsdns
	zscri=zshard/tests/deploy/k8s-build/zscri
	bridge=github.com/containernetworking/plugins/plugins/main/bridge
	host-local=github.com/containernetworking/plugins/plugins/ipam/host-local
	loopback=github.com/containernetworking/plugins/plugins/main/loopback
	portmap=github.com/containernetworking/plugins/plugins/meta/portmap
	kubectl=k8s.io/kubernetes/cmd/kubectl
)
for t in "${targets[@]}"; do
	name=${t%%=*}
	pkg=${t#*=}
	if [ $# -gt 0 ] && ! printf '%s\n' "$@" | grep -qxF "$name"; then
		continue
	fi
	if [ -x "$bin/$name" ]; then
		echo "k8s-build: $name present ($bin/$name)"
		continue
	fi
	echo "k8s-build: building $name ($pkg) $(date +%T)"
	start=$(date +%s)
	nice -n 15 go build -trimpath -ldflags="-s -w $version_flags" -o "$bin/$name.tmp" "$pkg"
	mv "$bin/$name.tmp" "$bin/$name"
	echo "k8s-build: $name built in $(($(date +%s) - start)) s"
done
echo "k8s-build: all in $bin"
