package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strings"

	corev1 "k8s.io/api/core/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// The shards and the trainers run with TLS and tokens by default. Their
// files come from Secrets that deploy/k8s-secrets makes outside the
// kustomization (secrets are never committed), so nothing but this check
// notices, before a pod hangs in ContainerCreating or a server refuses to
// start, that a variable names a file no mounted Secret provides, that a
// volume names a Secret or a key the script does not make, or that the
// server's user cannot read the files it is given.

// secretFileVars are the variables that name a file a Secret provides: the
// server's (--tls-cert, --tls-key, --tls-client-ca, --token-file,
// --admin-token-file) and the client library's (ZSHARD_TLS_CA and the rest,
// read by the trainers and by the CLI in a shard's pod).
var secretFileVars = []string{"ZSHARD_TLS_CERT", "ZSHARD_TLS_KEY", "ZSHARD_TLS_CLIENT_CA",
	"ZSHARD_TLS_CA", "ZSHARD_TOKEN_FILE", "ZSHARD_ADMIN_TOKEN_FILE"}

// serverSecurityVars must be set for every server: TLS with client
// certificates, and both tokens.
var serverSecurityVars = []string{"ZSHARD_TLS_CERT", "ZSHARD_TLS_KEY", "ZSHARD_TLS_CLIENT_CA",
	"ZSHARD_TOKEN_FILE", "ZSHARD_ADMIN_TOKEN_FILE"}

// trainerSecurityVars must be set for every example trainer: the CA to
// verify the shards, its client certificate, and a token.
var trainerSecurityVars = []string{"ZSHARD_TLS_CA", "ZSHARD_TLS_CERT", "ZSHARD_TLS_KEY",
	"ZSHARD_TOKEN_FILE"}

// clientOnlyVars are ZSHARD_* variables the client library reads and the
// server does not: set in a shard's pod for the CLI that runs there (the
// health check, an operator's exec), they name no server flag.
var clientOnlyVars = map[string]bool{"ZSHARD_TLS_CA": true, "ZSHARD_TLS_SERVER_NAME": true,
	"ZSHARD_TOKEN": true}

// readSecrets reads the Secrets a script prints (a multi-document YAML
// stream) as objects to validate like the rendered ones.
func readSecrets(file string) ([]rendered, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(b)))
	var out []rendered
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		j, err := yaml.YAMLToJSON(doc)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		var head struct {
			Kind     string `json:"kind"`
			Metadata struct {
				Name string `json:"name"`
			} `json:"metadata"`
		}
		if err := yaml.Unmarshal(j, &head); err != nil {
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		out = append(out, rendered{id: head.Kind + "/" + head.Metadata.Name + " (" + path.Base(file) + ")", json: j})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s holds no objects", file)
	}
	return out, nil
}

// secretFile is one file a mounted Secret puts in a container.
type secretFile struct {
	secret, key string
}

// mountedSecretFiles returns the files the Secret volumes mounted in ctr
// provide, by path, and the problems with those volumes and mounts.
func (c *cluster) mountedSecretFiles(t podTemplate, ctr corev1.Container) (map[string]secretFile, []error) {
	var errs []error
	add := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s container %q: %s", t.owner, ctr.Name, fmt.Sprintf(format, args...)))
	}
	volumes := map[string]*corev1.Volume{}
	for i := range t.spec.Volumes {
		volumes[t.spec.Volumes[i].Name] = &t.spec.Volumes[i]
	}
	files := map[string]secretFile{}
	for _, vm := range ctr.VolumeMounts {
		v, ok := volumes[vm.Name]
		if !ok || v.Secret == nil {
			continue
		}
		s := v.Secret
		if !vm.ReadOnly {
			add("the Secret volume %q is mounted without readOnly: true", vm.Name)
		}
		if vm.SubPath != "" {
			add("the Secret volume %q is mounted with subPath: the kubelet never updates such a file, so a rotated certificate or token would not reach the server", vm.Name)
		}
		errs = append(errs, c.checkSecretMode(t, vm.Name, s)...)
		sec, known := c.secrets[s.SecretName]
		if !known {
			if s.Optional == nil || !*s.Optional {
				add("volume %q: Secret %q is neither rendered nor made by deploy/k8s-secrets", vm.Name, s.SecretName)
			}
			continue
		}
		if len(s.Items) == 0 {
			for k := range sec.Data {
				files[path.Join(vm.MountPath, k)] = secretFile{s.SecretName, k}
			}
			for k := range sec.StringData {
				files[path.Join(vm.MountPath, k)] = secretFile{s.SecretName, k}
			}
			continue
		}
		for _, it := range s.Items {
			_, inData := sec.Data[it.Key]
			_, inString := sec.StringData[it.Key]
			if !inData && !inString {
				add("volume %q: Secret %q has no key %q", vm.Name, s.SecretName, it.Key)
				continue
			}
			files[path.Join(vm.MountPath, it.Path)] = secretFile{s.SecretName, it.Key}
		}
	}
	return files, errs
}

// checkSecretMode checks that the files of a Secret volume are readable by
// the pod's user and by nobody else. Their owner is root; the group is the
// pod's fsGroup when it has one.
func (c *cluster) checkSecretMode(t podTemplate, volume string, s *corev1.SecretVolumeSource) []error {
	var errs []error
	modes := []int32{0o644} // the API's default
	if s.DefaultMode != nil {
		modes[0] = *s.DefaultMode
	}
	for _, it := range s.Items {
		if it.Mode != nil {
			modes = append(modes, *it.Mode)
		}
	}
	sc := t.spec.SecurityContext
	nonRoot := sc != nil && sc.RunAsUser != nil && *sc.RunAsUser != 0
	fsGroup := sc != nil && sc.FSGroup != nil
	for _, m := range modes {
		if m&0o007 != 0 {
			errs = append(errs, fmt.Errorf("%s: volume %q: mode %#o lets every user in the container read the keys and tokens (use 0440, 288)", t.owner, volume, m))
		}
		if nonRoot && (!fsGroup || m&0o040 == 0) {
			errs = append(errs, fmt.Errorf("%s: volume %q: the files belong to root, and the pod's user %d can read them only through the group: set fsGroup and a mode with group read (0440, 288)", t.owner, volume, *sc.RunAsUser))
		}
	}
	return errs
}

// checkSecurity checks that every server and every example trainer runs with
// TLS and tokens, from files that mounted Secrets provide.
func (p *programs) checkSecurity(c *cluster) []error {
	var errs []error
	for _, t := range c.templates {
		for _, ctr := range append(append([]corev1.Container{}, t.spec.InitContainers...), t.spec.Containers...) {
			where := fmt.Sprintf("%s container %q", t.owner, ctr.Name)
			files, ferrs := c.mountedSecretFiles(t, ctr)
			errs = append(errs, ferrs...)
			for _, name := range secretFileVars {
				v, ok := c.envValue(ctr, name)
				if !ok || v == "" {
					continue
				}
				if _, provided := files[v]; !provided {
					errs = append(errs, fmt.Errorf("%s: %s=%s is not a file of any Secret mounted in the container", where, name, v))
				}
			}
			prog, _ := p.resolve(ctr.Image, ctr.Command, ctr.Args)
			var need []string
			switch {
			case prog == p.server:
				need = serverSecurityVars
			case prog == p.trainer && p.trainer != "":
				need = trainerSecurityVars
			}
			for _, name := range need {
				if v, ok := c.envValue(ctr, name); !ok || v == "" {
					errs = append(errs, fmt.Errorf("%s: %s runs without %s: the deployment must run with TLS and tokens", where, prog, name))
				}
			}
			if prog == p.server {
				errs = append(errs, checkProbesSpeakTLS(where, c, ctr)...)
			}
		}
	}
	return errs
}

// checkProbesSpeakTLS: the kubelet's native gRPC probes connect in
// plaintext, which a server with a certificate refuses, so such a server's
// probes must run the health check in the container.
func checkProbesSpeakTLS(where string, c *cluster, ctr corev1.Container) []error {
	if v, ok := c.envValue(ctr, "ZSHARD_TLS_CERT"); !ok || v == "" {
		return nil
	}
	var errs []error
	for _, pr := range []struct {
		name  string
		probe *corev1.Probe
	}{{"startupProbe", ctr.StartupProbe}, {"readinessProbe", ctr.ReadinessProbe},
		{"livenessProbe", ctr.LivenessProbe}} {
		if pr.probe != nil && pr.probe.GRPC != nil {
			errs = append(errs, fmt.Errorf("%s: %s is a gRPC probe, which speaks plaintext to a server with TLS: use exec zshard-healthcheck", where, pr.name))
		}
	}
	return errs
}

// isHealthProbe reports whether a probe asks the server's health service:
// a gRPC probe, or the image's health check script run in the container.
func isHealthProbe(pr *corev1.Probe) bool {
	if pr == nil {
		return false
	}
	if pr.GRPC != nil {
		return true
	}
	return pr.Exec != nil && len(pr.Exec.Command) > 0 && path.Base(pr.Exec.Command[0]) == "zshard-healthcheck"
}

// composeSecurity checks one compose service's TLS and token variables: set
// for a server or trainer, and pointing below one of the service's mounts.
func composeSecurity(where string, env map[string]string, mounts []any, need []string) []error {
	var errs []error
	for _, name := range need {
		if env[name] == "" {
			errs = append(errs, fmt.Errorf("%s: runs without %s: the cluster must run with TLS and tokens", where, name))
		}
	}
	targets := mountTargets(mounts)
	for _, name := range secretFileVars {
		v := env[name]
		if v == "" {
			continue
		}
		found := false
		for _, dir := range targets {
			if strings.HasPrefix(v, strings.TrimSuffix(dir, "/")+"/") {
				found = true
			}
		}
		if !found {
			errs = append(errs, fmt.Errorf("%s: %s=%s is not below any volume the service mounts", where, name, v))
		}
	}
	return errs
}

// mountTargets returns the container paths of a compose service's volumes,
// in the short ("source:/dir[:ro]") and the long syntax.
func mountTargets(mounts []any) []string {
	var out []string
	for _, m := range mounts {
		switch t := m.(type) {
		case string:
			if parts := strings.Split(t, ":"); len(parts) >= 2 {
				out = append(out, parts[1])
			}
		case map[string]any:
			if s, ok := t["target"].(string); ok {
				out = append(out, s)
			}
		}
	}
	return out
}
