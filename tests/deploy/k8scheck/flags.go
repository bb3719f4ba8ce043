package main

import (
	"fmt"
	"os"
	"path"
	"regexp"
	"sort"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
)

// A program's command line is checked against the flags the program itself
// says it accepts (its --help, read by tests/deploy/run-k8s-check). The
// server's settings may also come from the environment: ZSHARD_SHARD_ID is
// --shard-id, and so on, so every ZSHARD_* variable given to the server must
// name one of its flags too.

// flagSet is the set of options one program accepts, "--listen", "-h".
type flagSet map[string]bool

// parseFlags reads a program's help text (or a list of flags, one a line) and
// returns the options it lists. Only a line that starts with an option counts,
// with its aliases ("-h, --help"): an option that help text merely mentions in
// a sentence is not taken as accepted.
func parseFlags(text string) flagSet {
	fs := flagSet{}
	for _, line := range strings.Split(text, "\n") {
		for _, part := range strings.Split(strings.TrimSpace(line), ", ") {
			name := part
			if i := strings.IndexAny(name, " =\t["); i >= 0 {
				name = name[:i]
			}
			if !optionName.MatchString(name) {
				break
			}
			fs[name] = true
		}
	}
	return fs
}

var optionName = regexp.MustCompile(`^--?[A-Za-z0-9][A-Za-z0-9-]*$`)

func readFlagFile(name string) (flagSet, error) {
	b, err := os.ReadFile(name)
	if err != nil {
		return nil, err
	}
	fs := parseFlags(string(b))
	if len(fs) == 0 {
		return nil, fmt.Errorf("%s lists no flags", name)
	}
	return fs, nil
}

// programs knows which flags each program accepts and which program an image
// runs when a container does not name a command.
type programs struct {
	flags map[string]flagSet
	// entrypoints maps an image's repository name (no registry, no tag) to the
	// program its ENTRYPOINT runs: "zshard" -> "zshard-server".
	entrypoints map[string]string
	server      string
	// trainer is the example trainer's program name; "" when not checked.
	trainer string
}

// envFlagPrefix is the prefix of the server's environment settings.
const envFlagPrefix = "ZSHARD_"

// envToFlag turns ZSHARD_SHARD_ID into --shard-id.
func envToFlag(name string) string {
	return "--" + strings.ToLower(strings.ReplaceAll(strings.TrimPrefix(name, envFlagPrefix), "_", "-"))
}

// imageRepo turns "registry:5000/team/zshard:1.2@sha256:..." into "zshard".
func imageRepo(image string) string {
	if i := strings.Index(image, "@"); i >= 0 {
		image = image[:i]
	}
	base := path.Base(image)
	if i := strings.Index(base, ":"); i >= 0 {
		base = base[:i]
	}
	return base
}

// resolve returns the program a container runs and the arguments it gets, or
// "" when it runs something this checker cannot see into (a shell script, a
// foreign image).
func (p *programs) resolve(image string, entrypoint, command []string) (string, []string) {
	if len(entrypoint) > 0 {
		return path.Base(entrypoint[0]), append(append([]string{}, entrypoint[1:]...), command...)
	}
	if prog, ok := p.entrypoints[imageRepo(image)]; ok {
		return prog, command
	}
	return "", nil
}

// checkCommand checks the arguments and environment one container or compose
// service gives a program.
func (p *programs) checkCommand(where, prog string, args, env []string) []error {
	fs, known := p.flags[prog]
	if !known {
		return nil
	}
	var errs []error
	for _, a := range args {
		if a == "--" {
			break
		}
		// Values ("4", "zshard-0:7070") and negative numbers are not options.
		if !strings.HasPrefix(a, "-") || len(a) < 2 || (a[1] >= '0' && a[1] <= '9') {
			continue
		}
		name := a
		if i := strings.Index(a, "="); i >= 0 {
			name = a[:i]
		}
		if !fs[name] {
			errs = append(errs, fmt.Errorf("%s: %s does not accept %s", where, prog, name))
		}
	}
	if prog == p.server {
		for _, e := range env {
			if strings.HasPrefix(e, envFlagPrefix) && !fs[envToFlag(e)] && !clientOnlyVars[e] {
				errs = append(errs, fmt.Errorf("%s: %s=... would set %s, which %s does not accept",
					where, e, envToFlag(e), prog))
			}
		}
	}
	return errs
}

// flagValue returns the value of option name in args ("--x=v" or "--x v").
func flagValue(args []string, name string) (string, bool) {
	for i, a := range args {
		if a == name && i+1 < len(args) {
			return args[i+1], true
		}
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			return v, true
		}
	}
	return "", false
}

// checkShardList checks a trainer's --shards list: entry i must reach shard
// i, that is, for each member k of shard i in order, host members[i][k] (or a
// longer DNS name starting with "members[i][k].") on port; a replicated
// shard's members are separated by "|". There must be one entry per shard. A
// list in the wrong order would pair every tensor slice with the wrong
// server, and members in another order than the servers' ZSHARD_REPLICAS
// would give a member two different indexes.
func checkShardList(where, list string, members [][]string, port string) []error {
	entries := strings.Split(list, ",")
	if len(entries) != len(members) {
		return []error{fmt.Errorf("%s: --shards lists %d addresses, but there are %d shards",
			where, len(entries), len(members))}
	}
	var errs []error
	for i, e := range entries {
		alts := strings.Split(e, "|")
		good := len(alts) == len(members[i])
		for k := 0; good && k < len(alts); k++ {
			host, p, found := strings.Cut(alts[k], ":")
			want := members[i][k]
			good = found && p == port && (host == want || strings.HasPrefix(host, want+"."))
		}
		if !good {
			want := make([]string, len(members[i]))
			for k, h := range members[i] {
				want[k] = h + ":" + port
			}
			errs = append(errs, fmt.Errorf("%s: --shards entry %d is %q, want %s", where, i, e,
				strings.Join(want, "|")))
		}
	}
	return errs
}

// checkManifestFlags checks every container of every rendered workload.
func (p *programs) checkManifestFlags(c *cluster) []error {
	var errs []error
	members, port, haveShards := p.statefulShards(c)
	for _, o := range c.objects {
		var spec *corev1.PodSpec
		switch t := o.typed.(type) {
		case *appsv1.StatefulSet:
			spec = &t.Spec.Template.Spec
		case *appsv1.Deployment:
			spec = &t.Spec.Template.Spec
		case *batchv1.Job:
			spec = &t.Spec.Template.Spec
		default:
			continue
		}
		for _, ctr := range append(append([]corev1.Container{}, spec.InitContainers...), spec.Containers...) {
			prog, args := p.resolve(ctr.Image, ctr.Command, ctr.Args)
			where := fmt.Sprintf("%s container %q", o.id, ctr.Name)
			errs = append(errs, p.checkCommand(where, prog, args, c.envNames(ctr))...)
			if prog == p.trainer && p.trainer != "" && haveShards {
				if list, ok := flagValue(args, "--shards"); ok {
					errs = append(errs, checkShardList(where, list, members, port)...)
				} else {
					errs = append(errs, fmt.Errorf("%s: the trainer is not given --shards", where))
				}
			}
		}
	}
	return errs
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
