// zscri: a minimal CRI client (k8s.io/cri-api v1) for driving a containerd's
// CRI plugin without a kubelet. Configs are the CRI messages as protobuf JSON.
//
//	zscri SOCK runp SANDBOX.json                 -> sandbox id
//	zscri SOCK create POD SANDBOX.json CTR.json  -> container id
//	zscri SOCK start ID
//	zscri SOCK podip POD                          -> the sandbox's IP
//	zscri SOCK stopp POD | rmp POD
package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	cri "k8s.io/cri-api/pkg/apis/runtime/v1"
)

func load(path string, m proto.Message) {
	b, err := os.ReadFile(path)
	if err == nil {
		err = protojson.Unmarshal(b, m)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "zscri: %s: %v\n", path, err)
		os.Exit(2)
	}
}

func main() {
	a := os.Args
	if len(a) < 4 {
		fmt.Fprintln(os.Stderr, "usage: zscri SOCK runp|create|start|podip|stopp|rmp ARGS...")
		os.Exit(2)
	}
	conn, err := grpc.NewClient("unix://"+a[1], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, "zscri:", err)
		os.Exit(1)
	}
	rt := cri.NewRuntimeServiceClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	switch {
	case a[2] == "runp":
		var c cri.PodSandboxConfig
		load(a[3], &c)
		var r *cri.RunPodSandboxResponse
		if r, err = rt.RunPodSandbox(ctx, &cri.RunPodSandboxRequest{Config: &c}); err == nil {
			fmt.Println(r.PodSandboxId)
		}
	case a[2] == "create" && len(a) == 6:
		var p cri.PodSandboxConfig
		var c cri.ContainerConfig
		load(a[4], &p)
		load(a[5], &c)
		var r *cri.CreateContainerResponse
		r, err = rt.CreateContainer(ctx, &cri.CreateContainerRequest{PodSandboxId: a[3], Config: &c, SandboxConfig: &p})
		if err == nil {
			fmt.Println(r.ContainerId)
		}
	case a[2] == "start":
		_, err = rt.StartContainer(ctx, &cri.StartContainerRequest{ContainerId: a[3]})
	case a[2] == "podip":
		var r *cri.PodSandboxStatusResponse
		if r, err = rt.PodSandboxStatus(ctx, &cri.PodSandboxStatusRequest{PodSandboxId: a[3]}); err == nil {
			fmt.Println(r.GetStatus().GetNetwork().GetIp())
		}
	case a[2] == "stopp":
		_, err = rt.StopPodSandbox(ctx, &cri.StopPodSandboxRequest{PodSandboxId: a[3]})
	case a[2] == "rmp":
		_, err = rt.RemovePodSandbox(ctx, &cri.RemovePodSandboxRequest{PodSandboxId: a[3]})
	default:
		fmt.Fprintln(os.Stderr, "zscri: unknown command or wrong arguments:", a[2])
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "zscri:", err)
		os.Exit(1)
	}
}
