package main

import (
	"fmt"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"sigs.k8s.io/yaml"
)

// The compose file is checked for what `docker-compose config` cannot know:
// that the servers get flags they accept, that the shard services are exactly
// zshard-0..N-1 for the N they are told, that each keeps its state on a named
// volume, and that the trainer waits for every shard to be healthy.

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

var shardHostname = regexp.MustCompile(`^zshard-([0-9]+)$`)

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

	shardIDs := map[int]string{}
	shardCount := map[string]bool{}
	var shards, trainers []string
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
			shards = append(shards, name)
			id := -1
			if v, ok := env["ZSHARD_SHARD_ID"]; ok {
				id, _ = strconv.Atoi(v)
			} else if m := shardHostname.FindStringSubmatch(s.Hostname); m != nil {
				id, _ = strconv.Atoi(m[1])
			} else {
				add("%s: set hostname: zshard-<i> so the server takes its shard id from it", where)
			}
			if other, dup := shardIDs[id]; dup && id >= 0 {
				add("%s and service %s both are shard %d", where, other, id)
			}
			if id >= 0 {
				shardIDs[id] = name
			}
			shardCount[env["ZSHARD_SHARDS"]] = true
			if !mountsNamedVolume(s.Volumes, cf.Volumes, stateDir) {
				add("%s: no named volume mounted at %s for the shard's state", where, stateDir)
			}
			if s.Healthcheck != nil && s.Healthcheck["disable"] == true {
				add("%s: its health check is disabled; the trainer waits on it", where)
			}
			errs = append(errs, composeSecurity(file+": "+where, env, s.Volumes, serverSecurityVars)...)
		case trainer:
			trainers = append(trainers, name)
			trainerArgs[name] = args
			errs = append(errs, composeSecurity(file+": "+where, env, s.Volumes, trainerSecurityVars)...)
		}
	}

	if len(shards) > 0 {
		if len(shardCount) != 1 {
			add("the shard services disagree on ZSHARD_SHARDS (%v)", sortedKeys(shardCount))
		} else {
			n, err := strconv.Atoi(sortedKeys(shardCount)[0])
			if err != nil {
				add("ZSHARD_SHARDS must be set to the number of shard services")
			} else if n != len(shards) {
				add("ZSHARD_SHARDS=%d but there are %d shard services", n, len(shards))
			} else {
				for i := 0; i < n; i++ {
					if _, ok := shardIDs[i]; !ok {
						add("no service is shard %d of %d", i, n)
					}
				}
			}
		}
	}
	if trainer != "" && len(trainers) == 0 {
		add("no service runs the trainer %s", trainer)
	}
	// On the compose network a shard is reached by its service name.
	hosts := make([]string, len(shards))
	for i := range hosts {
		hosts[i] = shardIDs[i]
	}
	for _, t := range trainers {
		if list, ok := flagValue(trainerArgs[t], "--shards"); !ok {
			add("service %s: the trainer is not given --shards", t)
		} else {
			errs = append(errs, checkShardList(file+": service "+t, list, hosts, "7070")...)
		}
		deps, err := dependsOn(cf.Services[t].DependsOn)
		if err != nil {
			add("service %s: %v", t, err)
		}
		sort.Strings(shards)
		for _, s := range shards {
			if deps[s] != "service_healthy" {
				add("service %s must depend on %s with condition: service_healthy", t, s)
			}
		}
	}
	return errs
}

// mountsNamedVolume reports whether a service mounts one of the file's named
// volumes at dir, in the short ("name:/dir") or the long syntax.
func mountsNamedVolume(mounts []any, named map[string]any, dir string) bool {
	for _, m := range mounts {
		switch t := m.(type) {
		case string:
			parts := strings.Split(t, ":")
			if len(parts) >= 2 && parts[1] == dir {
				if _, ok := named[parts[0]]; ok {
					return true
				}
			}
		case map[string]any:
			src, _ := t["source"].(string)
			if t["type"] == "volume" && t["target"] == dir {
				if _, ok := named[src]; ok {
					return true
				}
			}
		}
	}
	return false
}
