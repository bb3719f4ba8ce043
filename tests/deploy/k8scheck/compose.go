package main

import (
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"

	"sigs.k8s.io/yaml"
)

// The compose file is checked for what `docker-compose config` cannot know:
// that the servers get flags they accept, that the shard services are exactly
// zshard-0..N-1 for the N they are told (or, replicated, that every shard
// 0..N-1 has the same members, each told the same member list as the
// trainer), that each keeps its state on a named volume of its own, and that
// the trainer waits for every shard to be healthy.

// composeFile is the part of the Compose Specification this check reads.
// Fields may take several shapes (a string or a list, a map or a list), so
// they stay untyped here and are normalised below.
type composeFile struct {
	Services map[string]composeService `json:"services"`
	Volumes  map[string]any            `json:"volumes"`
}

type composeService struct {
	Image       string         `json:"image"`
	Hostname    string         `json:"hostname"`
	Entrypoint  any            `json:"entrypoint"`
	Command     any            `json:"command"`
	Environment any            `json:"environment"`
	Volumes     []any          `json:"volumes"`
	DependsOn   any            `json:"depends_on"`
	Healthcheck map[string]any `json:"healthcheck"`
	NetworkMode string         `json:"network_mode"`
}

// words turns a compose command (a string, split on blanks the way compose
// splits it for exec form, or a list) into a list.
func words(v any) ([]string, error) {
	switch t := v.(type) {
	case nil:
		return nil, nil
	case string:
		return strings.Fields(t), nil
	case []any:
		out := make([]string, 0, len(t))
		for _, x := range t {
			s, ok := x.(string)
			if !ok {
				return nil, fmt.Errorf("list item %v is not a string", x)
			}
			out = append(out, s)
		}
		return out, nil
	}
	return nil, fmt.Errorf("expected a string or a list, got %T", v)
}

// environment turns a compose environment (a map, or a list of NAME=value)
// into a map.
func environment(v any) (map[string]string, error) {
	out := map[string]string{}
	switch t := v.(type) {
	case nil:
	case map[string]any:
		for k, x := range t {
			out[k] = fmt.Sprint(x)
		}
	case []any:
		for _, x := range t {
			s, ok := x.(string)
			if !ok {
				return nil, fmt.Errorf("environment item %v is not a string", x)
			}
			k, val, _ := strings.Cut(s, "=")
			out[k] = val
		}
	default:
		return nil, fmt.Errorf("environment: expected a map or a list, got %T", v)
	}
	return out, nil
}

// dependsOn returns each dependency with its condition ("service_started"
// when the short list form is used).
func dependsOn(v any) (map[string]string, error) {
	out := map[string]string{}
	switch t := v.(type) {
	case nil:
	case []any:
		for _, x := range t {
			out[fmt.Sprint(x)] = "service_started"
		}
	case map[string]any:
		for k, x := range t {
			cond := "service_started"
			if m, ok := x.(map[string]any); ok {
				if c, ok := m["condition"].(string); ok {
					cond = c
				}
			}
			out[k] = cond
		}
	default:
		return nil, fmt.Errorf("depends_on: expected a map or a list, got %T", v)
	}
	return out, nil
}

// shardHostname: the server takes its shard id from the digits after the
// last "-" of its host name (zshard-2, zshard-b-2).
var shardHostname = regexp.MustCompile(`-([0-9]+)$`)

// composeMember is one shard server of a compose file.
type composeMember struct {
	service string
	// shard is the shard id (-1 when none can be found), index the member's
	// ZSHARD_REPLICA_INDEX (0 when unset).
	shard, index int
	// replicas is ZSHARD_REPLICAS ("" when unset), shards ZSHARD_SHARDS.
	replicas, shards string
	// volume is the named volume mounted at the state directory.
	volume string
}

// checkCompose reads a compose file and checks it; stateDir is where the
// shards keep their state inside the container.
func (p *programs) checkCompose(file, trainer, stateDir string) []error {
	b, err := os.ReadFile(file)
	if err != nil {
		return []error{err}
	}
	var cf composeFile
	if err := yaml.Unmarshal(b, &cf); err != nil {
		return []error{fmt.Errorf("%s: %w", file, err)}
	}
	var errs []error
	add := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", file, fmt.Sprintf(format, args...)))
	}
	if len(cf.Services) == 0 {
		add("no services")
	}

	var shards []composeMember
	var trainers []string
	trainerArgs := map[string][]string{}
	for _, name := range sortedKeys(cf.Services) {
		s := cf.Services[name]
		where := "service " + name
		ep, err := words(s.Entrypoint)
		if err != nil {
			add("%s: entrypoint: %v", where, err)
		}
		cmd, err := words(s.Command)
		if err != nil {
			add("%s: command: %v", where, err)
		}
		env, err := environment(s.Environment)
		if err != nil {
			add("%s: %v", where, err)
		}
		prog, args := p.resolve(s.Image, ep, cmd)
		errs = append(errs, p.checkCommand(file+": "+where, prog, args, sortedKeys(env))...)

		switch prog {
		case p.server:
			m := composeMember{service: name, shard: -1, replicas: env["ZSHARD_REPLICAS"],
				shards: env["ZSHARD_SHARDS"], index: atoiOr(env["ZSHARD_REPLICA_INDEX"], -1)}
			if _, ok := env["ZSHARD_REPLICA_INDEX"]; !ok {
				m.index = 0
			}
			if v, ok := env["ZSHARD_SHARD_ID"]; ok {
				m.shard = atoiOr(v, -1)
			} else if g := shardHostname.FindStringSubmatch(s.Hostname); g != nil {
				m.shard = atoiOr(g[1], -1)
			} else {
				add("%s: set hostname: zshard-<i> so the server takes its shard id from it", where)
			}
			m.volume = namedVolumeAt(s.Volumes, cf.Volumes, stateDir)
			if m.volume == "" {
				add("%s: no named volume mounted at %s for the shard's state", where, stateDir)
			}
			if s.Healthcheck != nil && s.Healthcheck["disable"] == true {
				add("%s: its health check is disabled; the trainer waits on it", where)
			}
			if m.replicas != "" && s.NetworkMode != "" {
				add("%s: network_mode %s: a member of a replica set must be on a compose network, where `docker network disconnect` can cut it off", where, s.NetworkMode)
			}
			errs = append(errs, composeSecurity(file+": "+where, env, s.Volumes, serverSecurityVars)...)
			shards = append(shards, m)
		case trainer:
			trainers = append(trainers, name)
			trainerArgs[name] = args
			errs = append(errs, composeSecurity(file+": "+where, env, s.Volumes, trainerSecurityVars)...)
		}
	}

	members, serrs := composeShards(shards)
	for _, e := range serrs {
		add("%v", e)
	}
	if trainer != "" && len(trainers) == 0 {
		add("no service runs the trainer %s", trainer)
	}
	for _, t := range trainers {
		if list, ok := flagValue(trainerArgs[t], "--shards"); !ok {
			add("service %s: the trainer is not given --shards", t)
		} else if members != nil {
			errs = append(errs, checkShardList(file+": service "+t, list, members, "7070")...)
		}
		deps, err := dependsOn(cf.Services[t].DependsOn)
		if err != nil {
			add("service %s: %v", t, err)
		}
		for _, s := range shards {
			if deps[s.service] != "service_healthy" {
				add("service %s must depend on %s with condition: service_healthy", t, s.service)
			}
		}
	}
	return errs
}

// composeShards checks that the shard services are the shards 0..N-1 of
// ZSHARD_SHARDS, each with the members 0..R-1 (R is 1 without replication)
// that its ZSHARD_REPLICAS names, each on a volume of its own. It returns
// the service names by shard and member (as trainers reach them on the
// compose network), or nil when the services do not make such a layout.
func composeShards(shards []composeMember) ([][]string, []error) {
	if len(shards) == 0 {
		return nil, nil
	}
	var errs []error
	add := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	replicated := false
	byShard := map[int]map[int]string{}
	counts := map[string]bool{}
	volumes := map[string]string{}
	for _, m := range shards {
		replicated = replicated || m.replicas != "" || m.index != 0
		counts[m.shards] = true
		if other, dup := volumes[m.volume]; dup && m.volume != "" {
			add("services %s and %s keep their state on the same volume %s", other, m.service, m.volume)
		}
		volumes[m.volume] = m.service
		if m.shard < 0 || m.index < 0 {
			if m.index < 0 {
				add("service %s: ZSHARD_REPLICA_INDEX must be a number from 0", m.service)
			}
			continue
		}
		if byShard[m.shard] == nil {
			byShard[m.shard] = map[int]string{}
		}
		if other, dup := byShard[m.shard][m.index]; dup {
			if replicated {
				add("service %s and service %s both are member %d of shard %d", other, m.service, m.index, m.shard)
			} else {
				add("service %s and service %s both are shard %d", other, m.service, m.shard)
			}
		}
		byShard[m.shard][m.index] = m.service
	}
	if len(counts) != 1 {
		add("the shard services disagree on ZSHARD_SHARDS (%v)", sortedKeys(counts))
		return nil, errs
	}
	n, err := strconv.Atoi(sortedKeys(counts)[0])
	switch {
	case err != nil:
		add("ZSHARD_SHARDS must be set to the number of shards")
	case !replicated && n != len(shards):
		add("ZSHARD_SHARDS=%d but there are %d shard services", n, len(shards))
	case replicated && n != len(byShard):
		add("ZSHARD_SHARDS=%d but the shard services are %d shards", n, len(byShard))
	}
	if len(errs) > 0 {
		return nil, errs
	}
	r := len(byShard[0])
	members := make([][]string, n)
	for i := 0; i < n; i++ {
		if len(byShard[i]) == 0 {
			add("no service is shard %d of %d", i, n)
			continue
		}
		if len(byShard[i]) != r {
			add("shard %d has %d members, shard 0 has %d", i, len(byShard[i]), r)
		}
		for k := 0; k < len(byShard[i]); k++ {
			svc, ok := byShard[i][k]
			if !ok {
				add("shard %d has no member %d (ZSHARD_REPLICA_INDEX %d)", i, k, k)
			}
			members[i] = append(members[i], svc)
		}
	}
	if len(errs) > 0 {
		return nil, errs
	}
	if replicated {
		errs = append(errs, checkComposeMemberLists(shards, members)...)
	}
	return members, errs
}

// checkComposeMemberLists: each member's ZSHARD_REPLICAS names its shard's
// members by service name (their name on the compose network), in order.
func checkComposeMemberLists(shards []composeMember, members [][]string) []error {
	var errs []error
	for _, m := range shards {
		want := make([]string, len(members[m.shard]))
		for k, svc := range members[m.shard] {
			want[k] = svc + ":7070"
		}
		if m.replicas != strings.Join(want, "|") {
			errs = append(errs, fmt.Errorf("service %s: ZSHARD_REPLICAS is %q, want %q", m.service, m.replicas,
				strings.Join(want, "|")))
		}
	}
	return errs
}

// namedVolumeAt returns the one of the file's named volumes a service mounts
// at dir, in the short ("name:/dir") or the long syntax, or "".
func namedVolumeAt(mounts []any, named map[string]any, dir string) string {
	for _, m := range mounts {
		switch t := m.(type) {
		case string:
			parts := strings.Split(t, ":")
			if len(parts) >= 2 && parts[1] == dir {
				if _, ok := named[parts[0]]; ok {
					return parts[0]
				}
			}
		case map[string]any:
			src, _ := t["source"].(string)
			if t["type"] == "volume" && t["target"] == dir {
				if _, ok := named[src]; ok {
					return src
				}
			}
		}
	}
	return ""
}
