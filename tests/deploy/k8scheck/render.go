// Package main is k8scheck: it renders deploy/k8s with kustomize (the same
// library `kubectl kustomize` embeds), validates every rendered object
// strictly against the Kubernetes API types and schema, checks the rules that
// tie the zshard objects together, and checks that the server and trainer
// arguments in the manifests and the compose file are flags the programs
// accept. See main.go for the command line.
package main

import (
	"fmt"
	"sort"

	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// rendered is one object of the kustomize output, before validation.
type rendered struct {
	// id names the object in messages, "Kind/name".
	id string
	// json is the object exactly as kustomize rendered it.
	json []byte
}

// render runs kustomize on dir, as `kubectl kustomize dir` would, and returns
// the objects in a stable order. Plugins and remote bases stay disabled, so
// rendering reads nothing but the files under dir.
func render(dir string) ([]rendered, error) {
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	m, err := k.Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		return nil, fmt.Errorf("kustomize %s: %w", dir, err)
	}
	var out []rendered
	for _, r := range m.Resources() {
		j, err := r.MarshalJSON()
		if err != nil {
			return nil, fmt.Errorf("kustomize %s: %s/%s: %w", dir, r.GetKind(), r.GetName(), err)
		}
		out = append(out, rendered{id: r.GetKind() + "/" + r.GetName(), json: j})
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].id < out[j].id })
	return out, nil
}

// renderYAML returns the kustomize output as one multi-document YAML stream,
// which is what `kubectl kustomize` prints.
func renderYAML(dir string) ([]byte, error) {
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	m, err := k.Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		return nil, fmt.Errorf("kustomize %s: %w", dir, err)
	}
	return m.AsYaml()
}
