package main

import (
	"fmt"
	"path"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	metavalidation "k8s.io/apimachinery/pkg/apis/meta/v1/validation"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

// The schema says what fields exist and what types they have; it does not say
// that a Service selects the pods it is meant for, or that a probe asks a port
// the container listens on. The API server checks some of this on admission
// and some of it nobody checks until a pod fails to start or a trainer cannot
// connect. These rules are the subset that matters for zshard, checked
// offline.

// podTemplate is a workload's pod template with where it came from.
type podTemplate struct {
	owner  string
	labels map[string]string
	spec   *corev1.PodSpec
	// claims are the StatefulSet's volumeClaimTemplates names, which pods
	// mount like volumes.
	claims map[string]bool
	// pods are the labels of the pods made from the template: a
	// StatefulSet's controller adds each pod's index and name.
	pods []labels.Set
}

type cluster struct {
	objects    []*object
	configMaps map[string]*corev1.ConfigMap
	services   map[string]*corev1.Service
	// secrets are the rendered Secrets and those deploy/k8s-secrets makes.
	secrets   map[string]*corev1.Secret
	templates []podTemplate
}

func newCluster(objs []*object) *cluster {
	c := &cluster{objects: objs, configMaps: map[string]*corev1.ConfigMap{},
		services: map[string]*corev1.Service{}, secrets: map[string]*corev1.Secret{}}
	for _, o := range objs {
		switch t := o.typed.(type) {
		case *corev1.ConfigMap:
			c.configMaps[t.Name] = t
		case *corev1.Service:
			c.services[t.Name] = t
		case *corev1.Secret:
			c.secrets[t.Name] = t
		case *appsv1.StatefulSet:
			claims := map[string]bool{}
			for _, vct := range t.Spec.VolumeClaimTemplates {
				claims[vct.Name] = true
			}
			set := shardSet{id: o.id, sts: t}
			var pods []labels.Set
			for i := 0; i < set.replicas(); i++ {
				pods = append(pods, set.podLabels(i))
			}
			c.templates = append(c.templates, podTemplate{owner: o.id,
				labels: t.Spec.Template.Labels, spec: &t.Spec.Template.Spec, claims: claims, pods: pods})
		case *appsv1.Deployment:
			c.templates = append(c.templates, podTemplate{owner: o.id,
				labels: t.Spec.Template.Labels, spec: &t.Spec.Template.Spec})
		case *batchv1.Job:
			c.templates = append(c.templates, podTemplate{owner: o.id,
				labels: t.Spec.Template.Labels, spec: &t.Spec.Template.Spec})
		}
	}
	return c
}

// selecting returns the pod templates a label selector matches, with the
// API's meaning: a missing selector matches nothing, an empty one everything.
func (c *cluster) selecting(sel *metav1.LabelSelector) ([]podTemplate, error) {
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		return nil, err
	}
	var out []podTemplate
	for _, t := range c.templates {
		if s.Matches(labels.Set(t.labels)) {
			out = append(out, t)
		}
	}
	return out, nil
}

// selectingPods counts the pods a label selector matches, with the labels
// their controllers give them (a StatefulSet's pod index and name) besides
// the template's. Other templates count as one pod.
func (c *cluster) selectingPods(sel *metav1.LabelSelector) (int, error) {
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, t := range c.templates {
		pods := t.pods
		if len(pods) == 0 {
			pods = []labels.Set{t.labels}
		}
		for _, l := range pods {
			if s.Matches(l) {
				n++
			}
		}
	}
	return n, nil
}

// checkRules applies every rule and returns the problems found.
func (c *cluster) checkRules() []error {
	var errs []error
	add := func(id, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", id, fmt.Sprintf(format, args...)))
	}
	addList := func(id string, l field.ErrorList) {
		for _, e := range l {
			add(id, "%v", e)
		}
	}
	for _, o := range c.objects {
		acc, ok := o.typed.(metav1.Object)
		if !ok {
			add(o.id, "has no object metadata")
			continue
		}
		for _, m := range validation.IsDNS1123Subdomain(acc.GetName()) {
			add(o.id, "metadata.name: %s", m)
		}
		addList(o.id, metavalidation.ValidateLabels(acc.GetLabels(), field.NewPath("metadata", "labels")))

		switch t := o.typed.(type) {
		case *appsv1.StatefulSet:
			errs = append(errs, c.checkStatefulSet(o.id, t)...)
		case *batchv1.Job:
			errs = append(errs, c.checkJob(o.id, t)...)
		case *corev1.Service:
			errs = append(errs, c.checkService(o.id, t)...)
		case *policyv1.PodDisruptionBudget:
			if (t.Spec.MinAvailable == nil) == (t.Spec.MaxUnavailable == nil) {
				add(o.id, "exactly one of spec.minAvailable and spec.maxUnavailable must be set")
			}
			if n, err := c.selectingPods(t.Spec.Selector); err != nil {
				add(o.id, "spec.selector: %v", err)
			} else if n == 0 {
				add(o.id, "spec.selector matches no pod template")
			}
		case *networkingv1.NetworkPolicy:
			errs = append(errs, c.checkNetworkPolicy(o.id, t)...)
		}
	}
	for _, t := range c.templates {
		errs = append(errs, c.checkPodSpec(t)...)
	}
	return errs
}

func (c *cluster) checkStatefulSet(id string, s *appsv1.StatefulSet) []error {
	var errs []error
	add := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", id, fmt.Sprintf(format, args...)))
	}
	errs = append(errs, checkSelector(id, s.Spec.Selector, s.Spec.Template.Labels)...)
	// Pod names are <name>-<ordinal> and become hostnames: a DNS label.
	replicas := int32(1)
	if s.Spec.Replicas != nil {
		replicas = *s.Spec.Replicas
	}
	podName := s.Name + "-" + strconv.Itoa(int(max(replicas-1, 0)))
	for _, m := range validation.IsDNS1123Label(podName) {
		add("pod name %q: %s", podName, m)
	}

	// zshard: every shard must be reachable as <pod>.<service>, which needs a
	// headless Service that selects these pods.
	svc, ok := c.services[s.Spec.ServiceName]
	switch {
	case s.Spec.ServiceName == "":
		add("spec.serviceName is empty: shards would have no stable DNS names")
	case !ok:
		add("spec.serviceName %q names no Service in the rendered output", s.Spec.ServiceName)
	case svc.Spec.ClusterIP != corev1.ClusterIPNone:
		add("Service %q must be headless (clusterIP: None) to give each shard its own name", svc.Name)
	case !labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(s.Spec.Template.Labels)) ||
		len(svc.Spec.Selector) == 0:
		add("Service %q does not select this StatefulSet's pods", svc.Name)
	}
	if s.Spec.PodManagementPolicy != appsv1.ParallelPodManagement {
		add("spec.podManagementPolicy must be Parallel: shards do not depend on each other")
	}
	if len(s.Spec.VolumeClaimTemplates) == 0 {
		add("spec.volumeClaimTemplates is empty: each shard needs a volume for its checkpoints")
	}
	if s.Spec.Template.Spec.TerminationGracePeriodSeconds == nil {
		add("terminationGracePeriodSeconds is not set: the default 30 s may cut a drain short")
	}

	// zshard: the shard count the servers are told must be the number of pods,
	// or the layout of every shard differs from what the trainers compute.
	for _, ctr := range s.Spec.Template.Spec.Containers {
		if n, ok := c.envValue(ctr, "ZSHARD_SHARDS"); ok {
			if n != strconv.Itoa(int(replicas)) {
				add("container %q: ZSHARD_SHARDS=%s but replicas=%d", ctr.Name, n, replicas)
			}
		}
		if !isHealthProbe(ctr.ReadinessProbe) {
			add("container %q: readinessProbe must ask the health service (a gRPC probe, or exec zshard-healthcheck)", ctr.Name)
		}
		if !isHealthProbe(ctr.LivenessProbe) {
			add("container %q: livenessProbe must ask the health service (a gRPC probe, or exec zshard-healthcheck)", ctr.Name)
		}
		if len(ctr.Resources.Requests) == 0 {
			add("container %q: no resource requests (size them with `zshard estimate`)", ctr.Name)
		}
	}
	return errs
}

func (c *cluster) checkJob(id string, j *batchv1.Job) []error {
	var errs []error
	rp := j.Spec.Template.Spec.RestartPolicy
	if rp != corev1.RestartPolicyNever && rp != corev1.RestartPolicyOnFailure {
		errs = append(errs, fmt.Errorf("%s: restartPolicy must be Never or OnFailure, not %q", id, rp))
	}
	if j.Spec.Selector != nil {
		errs = append(errs, checkSelector(id, j.Spec.Selector, j.Spec.Template.Labels)...)
	}
	if j.Spec.CompletionMode != nil && *j.Spec.CompletionMode == batchv1.IndexedCompletion &&
		j.Spec.Completions == nil {
		errs = append(errs, fmt.Errorf("%s: an Indexed Job needs spec.completions", id))
	}
	return errs
}

func (c *cluster) checkService(id string, s *corev1.Service) []error {
	var errs []error
	add := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", id, fmt.Sprintf(format, args...)))
	}
	for _, m := range validation.IsDNS1035Label(s.Name) {
		add("metadata.name: %s", m)
	}
	if len(s.Spec.Selector) == 0 {
		return errs
	}
	sel := labels.SelectorFromSet(s.Spec.Selector)
	var targets []podTemplate
	for _, t := range c.templates {
		if sel.Matches(labels.Set(t.labels)) {
			targets = append(targets, t)
		}
	}
	if len(targets) == 0 {
		add("spec.selector matches no pod template")
		return errs
	}
	// Every port must lead to a port some selected container declares.
	for _, p := range s.Spec.Ports {
		tp := p.TargetPort
		for _, t := range targets {
			found := false
			for _, ctr := range t.spec.Containers {
				for _, cp := range ctr.Ports {
					if (tp.StrVal != "" && cp.Name == tp.StrVal) ||
						(tp.StrVal == "" && tp.IntVal != 0 && cp.ContainerPort == tp.IntVal) ||
						(tp.StrVal == "" && tp.IntVal == 0 && cp.ContainerPort == p.Port) {
						found = true
					}
				}
			}
			if !found {
				add("port %q: target %s is not a port of %s's containers", p.Name, tp.String(), t.owner)
			}
		}
	}
	return errs
}

func (c *cluster) checkNetworkPolicy(id string, np *networkingv1.NetworkPolicy) []error {
	var errs []error
	add := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", id, fmt.Sprintf(format, args...)))
	}
	protected, err := c.selecting(&np.Spec.PodSelector)
	if err != nil {
		add("spec.podSelector: %v", err)
	} else if len(protected) == 0 {
		add("spec.podSelector matches no pod template: the policy protects nothing")
	}
	// zshard: a policy that admits nobody rendered here would lock the
	// example trainer out of the shards.
	for i, rule := range np.Spec.Ingress {
		for k, peer := range rule.From {
			if peer.PodSelector == nil || peer.NamespaceSelector != nil {
				continue
			}
			admitted, err := c.selecting(peer.PodSelector)
			if err != nil {
				add("spec.ingress[%d].from[%d].podSelector: %v", i, k, err)
			} else if len(admitted) == 0 {
				add("spec.ingress[%d].from[%d].podSelector admits no pod template rendered here", i, k)
			}
		}
	}
	return errs
}

// checkPodSpec checks one pod template on its own.
func (c *cluster) checkPodSpec(t podTemplate) []error {
	var errs []error
	add := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", t.owner, fmt.Sprintf(format, args...)))
	}
	spec := t.spec
	if len(spec.Containers) == 0 {
		add("the pod template has no containers")
	}
	volumes := map[string]bool{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = true
	}
	for name := range t.claims {
		volumes[name] = true
	}
	all := append(append([]corev1.Container{}, spec.InitContainers...), spec.Containers...)
	names := map[string]bool{}
	for _, ctr := range all {
		where := fmt.Sprintf("container %q", ctr.Name)
		for _, m := range validation.IsDNS1123Label(ctr.Name) {
			add("%s: name: %s", where, m)
		}
		if names[ctr.Name] {
			add("%s: two containers have this name", where)
		}
		names[ctr.Name] = true
		if ctr.Image == "" {
			add("%s: no image", where)
		}
		ports := map[int32]bool{}
		for _, p := range ctr.Ports {
			ports[p.ContainerPort] = true
			for _, m := range validation.IsValidPortNum(int(p.ContainerPort)) {
				add("%s: port %d: %s", where, p.ContainerPort, m)
			}
			if p.Name != "" {
				for _, m := range validation.IsValidPortName(p.Name) {
					add("%s: port name %q: %s", where, p.Name, m)
				}
			}
		}
		for pname, pr := range map[string]*corev1.Probe{"startupProbe": ctr.StartupProbe,
			"readinessProbe": ctr.ReadinessProbe, "livenessProbe": ctr.LivenessProbe} {
			if pr == nil {
				continue
			}
			n := 0
			for _, set := range []bool{pr.Exec != nil, pr.HTTPGet != nil, pr.TCPSocket != nil, pr.GRPC != nil} {
				if set {
					n++
				}
			}
			if n != 1 {
				add("%s: %s must have exactly one handler, has %d", where, pname, n)
			}
			if pr.GRPC != nil && !ports[pr.GRPC.Port] {
				add("%s: %s asks port %d, which the container does not declare", where, pname, pr.GRPC.Port)
			}
		}
		for _, e := range ctr.Env {
			for _, m := range validation.IsEnvVarName(e.Name) {
				add("%s: env %q: %s", where, e.Name, m)
			}
			if e.ValueFrom != nil && e.ValueFrom.ConfigMapKeyRef != nil {
				ref := e.ValueFrom.ConfigMapKeyRef
				cm, ok := c.configMaps[ref.Name]
				optional := ref.Optional != nil && *ref.Optional
				if !optional && (!ok || !hasKey(cm, ref.Key)) {
					add("%s: env %q refers to ConfigMap %q key %q, not rendered", where, e.Name, ref.Name, ref.Key)
				}
			}
		}
		for _, ef := range ctr.EnvFrom {
			if ef.ConfigMapRef != nil {
				optional := ef.ConfigMapRef.Optional != nil && *ef.ConfigMapRef.Optional
				if _, ok := c.configMaps[ef.ConfigMapRef.Name]; !ok && !optional {
					add("%s: envFrom refers to ConfigMap %q, which is not rendered", where, ef.ConfigMapRef.Name)
				}
			}
		}
		mounts := map[string]bool{}
		for _, vm := range ctr.VolumeMounts {
			if !volumes[vm.Name] {
				add("%s: volumeMount %q names no volume or claim template", where, vm.Name)
			}
			if !path.IsAbs(vm.MountPath) {
				add("%s: mountPath %q is not absolute", where, vm.MountPath)
			}
			if mounts[vm.MountPath] {
				add("%s: two volumes are mounted at %q", where, vm.MountPath)
			}
			mounts[vm.MountPath] = true
		}
		for res, lim := range ctr.Resources.Limits {
			if req, ok := ctr.Resources.Requests[res]; ok && req.Cmp(lim) > 0 {
				add("%s: %s request %s exceeds its limit %s", where, res, req.String(), lim.String())
			}
		}
	}
	if sc := spec.SecurityContext; sc != nil && sc.RunAsNonRoot != nil && *sc.RunAsNonRoot &&
		(sc.RunAsUser == nil || *sc.RunAsUser == 0) {
		add("runAsNonRoot is set without a non-zero runAsUser")
	}
	return errs
}

func checkSelector(id string, sel *metav1.LabelSelector, podLabels map[string]string) []error {
	if sel == nil {
		return []error{fmt.Errorf("%s: spec.selector is missing", id)}
	}
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		return []error{fmt.Errorf("%s: spec.selector: %w", id, err)}
	}
	if s.Empty() || !s.Matches(labels.Set(podLabels)) {
		return []error{fmt.Errorf("%s: spec.selector does not match the pod template's labels", id)}
	}
	return nil
}

func hasKey(cm *corev1.ConfigMap, key string) bool {
	_, ok := cm.Data[key]
	return ok
}

// envValue returns the value a container sees for variable name, from env
// (literal values only) or from a rendered ConfigMap through envFrom. Later
// sources win, and env wins over envFrom, as in Kubernetes.
func (c *cluster) envValue(ctr corev1.Container, name string) (string, bool) {
	for i := len(ctr.Env) - 1; i >= 0; i-- {
		if ctr.Env[i].Name == name {
			return ctr.Env[i].Value, ctr.Env[i].ValueFrom == nil
		}
	}
	for i := len(ctr.EnvFrom) - 1; i >= 0; i-- {
		ef := ctr.EnvFrom[i]
		if ef.ConfigMapRef == nil {
			continue
		}
		if cm, ok := c.configMaps[ef.ConfigMapRef.Name]; ok {
			if v, ok := cm.Data[strings.TrimPrefix(name, ef.Prefix)]; ok && strings.HasPrefix(name, ef.Prefix) {
				return v, true
			}
		}
	}
	return "", false
}

// envNames returns every variable name a container gets from env and from
// rendered ConfigMaps through envFrom.
func (c *cluster) envNames(ctr corev1.Container) []string {
	var out []string
	for _, e := range ctr.Env {
		out = append(out, e.Name)
	}
	for _, ef := range ctr.EnvFrom {
		if ef.ConfigMapRef == nil {
			continue
		}
		if cm, ok := c.configMaps[ef.ConfigMapRef.Name]; ok {
			for k := range cm.Data {
				out = append(out, ef.Prefix+k)
			}
		}
	}
	return out
}
