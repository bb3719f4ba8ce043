package main

import (
	"fmt"
	"math"
	"regexp"
	"sort"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// Replicated shards (deploy/k8s-replicated): every shard is a replica set of
// R members, one pod from each of R StatefulSets; pod <set k>-<i> is member
// k of shard i. Each server is told its shard's members (ZSHARD_REPLICAS,
// worked out per pod from the pod-index label) and its place among them
// (ZSHARD_REPLICA_INDEX), and the trainers list the same members in the same
// order. None of that is visible to the schema, and a mistake in it shows
// only when a shard fails over: two members that disagree on who is member
// 1, two members of one shard on one node (a node failure then takes the
// whole shard), a disruption budget that lets a drain evict both, a network
// policy that keeps the primary from forwarding to the backup.

// podIndexLabel is the label the StatefulSet controller gives each pod, its
// ordinal (Kubernetes 1.28+).
const podIndexLabel = "apps.kubernetes.io/pod-index"

// podNameLabel is the StatefulSet controller's label with the pod's name.
const podNameLabel = "statefulset.kubernetes.io/pod-name"

// shardSet is one StatefulSet of shard servers.
type shardSet struct {
	id  string
	sts *appsv1.StatefulSet
	// ctr is the container that runs the server.
	ctr corev1.Container
	// index is the set's ZSHARD_REPLICA_INDEX, 0 when it has none.
	index int
	// indexSet tells whether ZSHARD_REPLICA_INDEX is given (literally).
	indexSet bool
}

func (s shardSet) replicas() int {
	if s.sts.Spec.Replicas == nil {
		return 1
	}
	return int(*s.sts.Spec.Replicas)
}

// podName is the name, and host name, of the set's pod with ordinal i.
func (s shardSet) podName(i int) string { return fmt.Sprintf("%s-%d", s.sts.Name, i) }

// podLabels are the labels the pod with ordinal i carries: the template's
// and those the StatefulSet controller adds.
func (s shardSet) podLabels(i int) labels.Set {
	l := labels.Set{}
	for k, v := range s.sts.Spec.Template.Labels {
		l[k] = v
	}
	l[podIndexLabel] = strconv.Itoa(i)
	l[podNameLabel] = s.podName(i)
	return l
}

// shardSets returns the StatefulSets that run the server, ordered by their
// ZSHARD_REPLICA_INDEX (then by name).
func (p *programs) shardSets(c *cluster) []shardSet {
	var out []shardSet
	for _, o := range c.objects {
		s, ok := o.typed.(*appsv1.StatefulSet)
		if !ok {
			continue
		}
		for _, ctr := range s.Spec.Template.Spec.Containers {
			if prog, _ := p.resolve(ctr.Image, ctr.Command, ctr.Args); prog != p.server {
				continue
			}
			set := shardSet{id: o.id, sts: s, ctr: ctr}
			if v, ok := c.envValue(ctr, "ZSHARD_REPLICA_INDEX"); ok {
				set.index, set.indexSet = atoiOr(v, -1), true
			}
			out = append(out, set)
			break
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].index < out[j].index })
	return out
}

func atoiOr(s string, bad int) int {
	n, err := strconv.Atoi(s)
	if err != nil {
		return bad
	}
	return n
}

// statefulShards returns, for the shard StatefulSets rendered, the host name
// of each member of each shard as trainers reach it (<pod>.<service>;
// members[i][k] is member k of shard i) and the gRPC port.
func (p *programs) statefulShards(c *cluster) ([][]string, string, bool) {
	sets := p.shardSets(c)
	if len(sets) == 0 || len(sets[0].sts.Spec.Template.Spec.Containers) == 0 {
		return nil, "", false
	}
	members := make([][]string, sets[0].replicas())
	for i := range members {
		for _, s := range sets {
			members[i] = append(members[i], fmt.Sprintf("%s.%s", s.podName(i), s.sts.Spec.ServiceName))
		}
	}
	return members, grpcPort(sets[0].ctr), true
}

// grpcPort is the container's port named grpc, or its first port.
func grpcPort(ctr corev1.Container) string {
	port := ""
	for _, cp := range ctr.Ports {
		if cp.Name == "grpc" || port == "" {
			port = fmt.Sprint(cp.ContainerPort)
		}
	}
	return port
}

// --- The environment a pod sees --------------------------------------------------

// envRef is a $(NAME) reference in an env value; $$ escapes a dollar.
var envRef = regexp.MustCompile(`\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)`)

// podEnv returns the value variable name has in the pod of set s with
// ordinal i, as the kubelet works it out: literal values and ConfigMap
// entries, the downward API's pod name and labels, and $(VAR) references to
// variables defined before it in env (or through envFrom). ok is false when
// the variable is not set; unresolved lists what could not be worked out
// offline (a reference left as it is, a field the pod does not have here).
func (c *cluster) podEnv(s shardSet, i int, name string) (value string, ok bool, unresolved []string) {
	vars := map[string]string{}
	for _, n := range c.envNames(s.ctr) {
		if v, ok := c.envValue(corev1.Container{EnvFrom: s.ctr.EnvFrom}, n); ok {
			vars[n] = v
		}
	}
	podLabels := s.podLabels(i)
	for _, e := range s.ctr.Env {
		var v string
		switch {
		case e.ValueFrom == nil:
			v = envRef.ReplaceAllStringFunc(e.Value, func(ref string) string {
				if ref == "$$" {
					return "$"
				}
				inner := ref[2 : len(ref)-1]
				if rv, ok := vars[inner]; ok {
					return rv
				}
				if e.Name == name {
					unresolved = append(unresolved, ref)
				}
				return ref
			})
		case e.ValueFrom.FieldRef != nil:
			fv, found := fieldValue(e.ValueFrom.FieldRef.FieldPath, s.podName(i), podLabels)
			if !found {
				delete(vars, e.Name)
				if e.Name == name {
					return "", true, []string{"fieldRef " + e.ValueFrom.FieldRef.FieldPath}
				}
				continue
			}
			v = fv
		default:
			delete(vars, e.Name)
			if e.Name == name {
				return "", true, []string{"its valueFrom"}
			}
			continue
		}
		vars[e.Name] = v
	}
	value, ok = vars[name]
	return value, ok, unresolved
}

var labelField = regexp.MustCompile(`^metadata\.labels\['([^']+)'\]$`)

// fieldValue is what the downward API puts in an env variable for a pod
// named podName with labels podLabels.
func fieldValue(path, podName string, podLabels labels.Set) (string, bool) {
	if path == "metadata.name" {
		return podName, true
	}
	if m := labelField.FindStringSubmatch(path); m != nil {
		v, ok := podLabels[m[1]]
		return v, ok
	}
	return "", false
}

// --- The rules ----------------------------------------------------------------------

// checkReplicaSets checks the shard StatefulSets as replica sets, when they
// are replicated (more than one set, or ZSHARD_REPLICAS given).
func (p *programs) checkReplicaSets(c *cluster) []error {
	sets := p.shardSets(c)
	replicated := len(sets) > 1
	for _, s := range sets {
		if _, ok := c.envNamed(s.ctr, "ZSHARD_REPLICAS"); ok {
			replicated = true
		}
	}
	if !replicated {
		return nil
	}
	errs := checkSetsAgree(sets)
	if len(errs) > 0 {
		return errs
	}
	errs = append(errs, c.checkMemberLists(sets)...)
	for _, s := range sets {
		errs = append(errs, checkPlacement(s, sets)...)
	}
	errs = append(errs, c.checkBudgets(sets)...)
	errs = append(errs, c.checkPeersAdmitted(sets)...)
	return errs
}

// envNamed reports whether the container gets variable name at all (from
// env, whatever its source, or from a rendered ConfigMap).
func (c *cluster) envNamed(ctr corev1.Container, name string) (string, bool) {
	for _, n := range c.envNames(ctr) {
		if n == name {
			return n, true
		}
	}
	return "", false
}

// checkSetsAgree: the sets are members 0..R-1, each given its index, with as
// many pods each, behind one Service.
func checkSetsAgree(sets []shardSet) []error {
	var errs []error
	for k, s := range sets {
		switch {
		case !s.indexSet:
			errs = append(errs, fmt.Errorf("%s: a replicated shard's StatefulSet must set ZSHARD_REPLICA_INDEX (its place in ZSHARD_REPLICAS)", s.id))
		case s.index != k:
			errs = append(errs, fmt.Errorf("%s: ZSHARD_REPLICA_INDEX is %d, but the %d StatefulSets of shards need the indexes 0 to %d, each once",
				s.id, s.index, len(sets), len(sets)-1))
		}
		if s.replicas() != sets[0].replicas() {
			errs = append(errs, fmt.Errorf("%s: replicas=%d but %s has %d: every shard needs a pod in every set",
				s.id, s.replicas(), sets[0].id, sets[0].replicas()))
		}
		if s.sts.Spec.ServiceName != sets[0].sts.Spec.ServiceName {
			errs = append(errs, fmt.Errorf("%s: serviceName %q differs from %s's %q",
				s.id, s.sts.Spec.ServiceName, sets[0].id, sets[0].sts.Spec.ServiceName))
		}
	}
	return errs
}

// checkMemberLists: in every pod, ZSHARD_REPLICAS names the pod's shard's
// members in index order, and ZSHARD_SHARD_ID, when given, is the ordinal.
func (c *cluster) checkMemberLists(sets []shardSet) []error {
	var errs []error
	port := grpcPort(sets[0].ctr)
	for _, s := range sets {
		for i := 0; i < s.replicas(); i++ {
			want := make([]string, len(sets))
			for k, m := range sets {
				want[k] = fmt.Sprintf("%s.%s:%s", m.podName(i), m.sts.Spec.ServiceName, port)
			}
			where := fmt.Sprintf("%s pod %s", s.id, s.podName(i))
			got, ok, unresolved := c.podEnv(s, i, "ZSHARD_REPLICAS")
			switch {
			case !ok:
				errs = append(errs, fmt.Errorf("%s: no ZSHARD_REPLICAS", where))
			case len(unresolved) > 0:
				errs = append(errs, fmt.Errorf("%s: ZSHARD_REPLICAS cannot be worked out (%s)", where,
					strings.Join(unresolved, ", ")))
			case got != strings.Join(want, "|"):
				errs = append(errs, fmt.Errorf("%s: ZSHARD_REPLICAS is %q, want %q", where, got,
					strings.Join(want, "|")))
			}
			if id, ok, unresolved := c.podEnv(s, i, "ZSHARD_SHARD_ID"); ok &&
				(len(unresolved) > 0 || id != strconv.Itoa(i)) {
				errs = append(errs, fmt.Errorf("%s: ZSHARD_SHARD_ID is %q, want %d (the pod's ordinal)", where, id, i))
			}
			if len(errs) > 0 {
				return errs // one pod's mistake is every pod's
			}
		}
	}
	return errs
}

// affinitySelector is the selector a pod affinity term applies for a pod
// with labels own: its labelSelector, and for each matchLabelKeys key "the
// same value as this pod".
func affinitySelector(t corev1.PodAffinityTerm, own labels.Set) (labels.Selector, error) {
	sel, err := metav1.LabelSelectorAsSelector(t.LabelSelector)
	if err != nil || t.LabelSelector == nil {
		return labels.Nothing(), err
	}
	for _, k := range t.MatchLabelKeys {
		if v, ok := own[k]; ok {
			r, err := labels.NewRequirement(k, "in", []string{v})
			if err != nil {
				return nil, err
			}
			sel = sel.Add(*r)
		}
	}
	return sel, nil
}

// checkPlacement: a required anti-affinity on kubernetes.io/hostname keeps
// each pod of set s off the nodes of the other members of its shard, and of
// no other shard's pods (that would need a node per pod); and the pods
// spread over nodes.
func checkPlacement(s shardSet, sets []shardSet) []error {
	spec := s.sts.Spec.Template.Spec
	var terms []corev1.PodAffinityTerm
	if a := spec.Affinity; a != nil && a.PodAntiAffinity != nil {
		for _, t := range a.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution {
			if t.TopologyKey == corev1.LabelHostname {
				terms = append(terms, t)
			}
		}
	}
	var errs []error
	if len(terms) == 0 {
		errs = append(errs, fmt.Errorf("%s: no required podAntiAffinity on %s: both members of a shard may land on one node, and that node's failure takes the shard",
			s.id, corev1.LabelHostname))
	}
	n := s.replicas()
	if n > 1 {
		n = 2 // ordinals 0 and 1 show every mistake a longer list would
	}
	for i := 0; i < n && len(terms) > 0; i++ {
		apart, also := membersKeptApart(terms, s, i, sets)
		if !apart {
			errs = append(errs, fmt.Errorf("%s: the required podAntiAffinity on %s does not keep pod %s off the nodes of the other members of shard %d",
				s.id, corev1.LabelHostname, s.podName(i), i))
		}
		if also != "" {
			errs = append(errs, fmt.Errorf("%s: the required podAntiAffinity keeps pod %s apart from %s, a pod of another shard, too: each shard pod would need a node of its own (pair the members with matchLabelKeys: [%s])",
				s.id, s.podName(i), also, podIndexLabel))
		}
	}
	spread := false
	for _, tsc := range spec.TopologySpreadConstraints {
		sel, err := metav1.LabelSelectorAsSelector(tsc.LabelSelector)
		if err == nil && tsc.LabelSelector != nil && tsc.TopologyKey == corev1.LabelHostname &&
			sel.Matches(sets[len(sets)-1].podLabels(0)) && sel.Matches(sets[0].podLabels(0)) {
			spread = true
		}
	}
	if !spread {
		errs = append(errs, fmt.Errorf("%s: no topologySpreadConstraints on %s over the shard pods of every set",
			s.id, corev1.LabelHostname))
	}
	return errs
}

// membersKeptApart tells whether the terms, for pod i of set s, select
// every other member of shard i, and names a pod of another shard they
// select ("" for none).
func membersKeptApart(terms []corev1.PodAffinityTerm, s shardSet, i int, sets []shardSet) (bool, string) {
	own := s.podLabels(i)
	var sels []labels.Selector
	for _, t := range terms {
		if sel, err := affinitySelector(t, own); err == nil {
			sels = append(sels, sel)
		}
	}
	matches := func(l labels.Set) bool {
		for _, sel := range sels {
			if sel.Matches(l) {
				return true
			}
		}
		return false
	}
	apart, also := true, ""
	for _, m := range sets {
		if m.id != s.id && !matches(m.podLabels(i)) {
			apart = false
		}
		other := i + 1
		if other >= m.replicas() {
			other = i - 1
		}
		if other >= 0 && also == "" && matches(m.podLabels(other)) {
			also = m.podName(other)
		}
	}
	return apart, also
}

// checkBudgets: every shard has a PodDisruptionBudget over all its members
// that allows fewer disruptions than it has members, and no pod is under two
// budgets (the eviction API refuses to evict such a pod at all).
func (c *cluster) checkBudgets(sets []shardSet) []error {
	var pdbs []*policyv1.PodDisruptionBudget
	var ids []string
	for _, o := range c.objects {
		if b, ok := o.typed.(*policyv1.PodDisruptionBudget); ok {
			pdbs = append(pdbs, b)
			ids = append(ids, o.id)
		}
	}
	var errs []error
	r := len(sets)
	for i := 0; i < sets[0].replicas(); i++ {
		protected := false
		for bi, b := range pdbs {
			sel, err := metav1.LabelSelectorAsSelector(b.Spec.Selector)
			if err != nil || b.Spec.Selector == nil {
				continue
			}
			all, count := true, 0
			for _, s := range sets {
				for j := 0; j < s.replicas(); j++ {
					if !sel.Matches(s.podLabels(j)) {
						all = all && j != i
						continue
					}
					count++
					if other := budgetOf(pdbs, ids, s.podLabels(j), bi); other != "" && j == i {
						errs = append(errs, fmt.Errorf("%s and %s both select pod %s: the eviction API refuses pods under two budgets",
							ids[bi], other, s.podName(j)))
					}
				}
			}
			if all && allowedDisruptions(b, count) < r {
				protected = true
			}
		}
		if !protected {
			errs = append(errs, fmt.Errorf("no PodDisruptionBudget keeps a member of shard %d up: a drain may evict all %d at once", i, r))
		}
	}
	return errs
}

// budgetOf names a budget other than pdbs[skip] that selects a pod with
// labels l, or "".
func budgetOf(pdbs []*policyv1.PodDisruptionBudget, ids []string, l labels.Set, skip int) string {
	for k, b := range pdbs {
		if k == skip || k < skip {
			continue // each pair is reported once, by the first of the two
		}
		if sel, err := metav1.LabelSelectorAsSelector(b.Spec.Selector); err == nil && b.Spec.Selector != nil &&
			sel.Matches(l) {
			return ids[k]
		}
	}
	return ""
}

// allowedDisruptions is how many of the count pods a budget lets be evicted
// when all are healthy (percentages round up, as the disruption controller's
// do for minAvailable and maxUnavailable alike).
func allowedDisruptions(b *policyv1.PodDisruptionBudget, count int) int {
	scaled := func(v *intstr.IntOrString) int {
		n, err := intstr.GetScaledValueFromIntOrPercent(v, count, true)
		if err != nil {
			return math.MaxInt32
		}
		return n
	}
	switch {
	case b.Spec.MaxUnavailable != nil:
		return scaled(b.Spec.MaxUnavailable)
	case b.Spec.MinAvailable != nil:
		return count - scaled(b.Spec.MinAvailable)
	}
	return count
}

// checkPeersAdmitted: a NetworkPolicy that protects the shard pods admits
// the shard pods themselves on the gRPC and the data-plane ports, where the
// primary forwards writes and a restarted member copies the state.
func (c *cluster) checkPeersAdmitted(sets []shardSet) []error {
	var errs []error
	shardPod := sets[0].podLabels(0)
	for _, o := range c.objects {
		np, ok := o.typed.(*networkingv1.NetworkPolicy)
		if !ok {
			continue
		}
		sel, err := metav1.LabelSelectorAsSelector(&np.Spec.PodSelector)
		if err != nil || !sel.Matches(shardPod) || !hasIngressPolicy(np) {
			continue
		}
		for _, port := range []string{"grpc", "data"} {
			if !admitsPodOnPort(np, shardPod, sets[0].ctr, port) {
				errs = append(errs, fmt.Errorf("%s: does not admit the shard pods themselves on their %s port: the members of a shard could not reach each other",
					o.id, port))
			}
		}
	}
	return errs
}

func hasIngressPolicy(np *networkingv1.NetworkPolicy) bool {
	if len(np.Spec.PolicyTypes) == 0 {
		return true
	}
	for _, t := range np.Spec.PolicyTypes {
		if t == networkingv1.PolicyTypeIngress {
			return true
		}
	}
	return false
}

// admitsPodOnPort tells whether an ingress rule admits a pod with labels
// from (in the policy's namespace) on the container's port named portName.
func admitsPodOnPort(np *networkingv1.NetworkPolicy, from labels.Set, ctr corev1.Container, portName string) bool {
	var number int32
	for _, cp := range ctr.Ports {
		if cp.Name == portName {
			number = cp.ContainerPort
		}
	}
	for _, rule := range np.Spec.Ingress {
		peerOK := len(rule.From) == 0
		for _, peer := range rule.From {
			if peer.PodSelector == nil || peer.NamespaceSelector != nil || peer.IPBlock != nil {
				continue
			}
			if sel, err := metav1.LabelSelectorAsSelector(peer.PodSelector); err == nil && sel.Matches(from) {
				peerOK = true
			}
		}
		portOK := len(rule.Ports) == 0
		for _, p := range rule.Ports {
			if p.Port == nil || p.Port.StrVal == portName || (p.Port.StrVal == "" && p.Port.IntVal == number) {
				portOK = true
			}
		}
		if peerOK && portOK {
			return true
		}
	}
	return false
}
