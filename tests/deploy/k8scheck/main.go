package main

import (
	"flag"
	"fmt"
	"os"
	"strings"
)

const usage = `usage: k8scheck [options] [KUSTOMIZE_DIR]

Renders KUSTOMIZE_DIR (default deploy/k8s) with kustomize, validates every
object strictly against the Kubernetes API types and schema, checks the rules
that tie the zshard objects together, and checks program arguments:

  -server-flags FILE    zshard-server's --help output (or a list of flags);
                        the server's args and ZSHARD_* variables must be in it
  -trainer PROG         the example trainer's program name
  -trainer-flags FILE   its --help output; its args must be in it
  -compose FILE         also check this docker compose file
  -secrets FILE         Secrets made outside the kustomization (the output
                        of deploy/k8s-secrets), validated and used to check
                        the pods' Secret volumes and TLS and token files
  -print                print the rendered manifests and exit

Exit status 0 when everything passes, 1 when anything fails, 2 on usage errors.
`

func main() {
	serverFlags := flag.String("server-flags", "", "")
	trainer := flag.String("trainer", "", "")
	trainerFlags := flag.String("trainer-flags", "", "")
	composeFile := flag.String("compose", "", "")
	secretsFile := flag.String("secrets", "", "")
	printOnly := flag.Bool("print", false, "")
	flag.Usage = func() { fmt.Fprint(os.Stderr, usage) }
	flag.Parse()
	dir := "deploy/k8s"
	switch flag.NArg() {
	case 0:
	case 1:
		dir = flag.Arg(0)
	default:
		flag.Usage()
		os.Exit(2)
	}

	if *printOnly {
		y, err := renderYAML(dir)
		if err != nil {
			fmt.Fprintln(os.Stderr, "k8scheck:", err)
			os.Exit(1)
		}
		os.Stdout.Write(y)
		return
	}

	progs := &programs{
		flags:       map[string]flagSet{},
		entrypoints: map[string]string{"zshard": "zshard-server"},
		server:      "zshard-server",
		trainer:     *trainer,
	}
	for prog, file := range map[string]string{"zshard-server": *serverFlags, *trainer: *trainerFlags} {
		if file == "" || prog == "" {
			continue
		}
		fs, err := readFlagFile(file)
		if err != nil {
			fmt.Fprintln(os.Stderr, "k8scheck:", err)
			os.Exit(2)
		}
		progs.flags[prog] = fs
	}

	problems, objects := run(dir, progs, *composeFile, *trainer, *secretsFile)
	for _, id := range objects {
		fmt.Println("ok  ", id)
	}
	for _, p := range problems {
		fmt.Println("FAIL", p)
	}
	checked := []string{"schema", "rules", "TLS and tokens"}
	for _, prog := range sortedKeys(progs.flags) {
		checked = append(checked, prog+" flags")
	}
	if *composeFile != "" {
		checked = append(checked, "compose")
	}
	fmt.Printf("k8scheck: %s: %d objects valid, checked %s: %d problems\n",
		dir, len(objects), strings.Join(checked, ", "), len(problems))
	if len(problems) > 0 {
		os.Exit(1)
	}
}

// run does every check and returns the problems and the objects that passed
// schema validation. secretsFile ("" for none) holds Secrets made outside
// the kustomization.
func run(dir string, progs *programs, composeFile, trainer, secretsFile string) ([]error, []string) {
	var problems []error
	rs, err := render(dir)
	if err != nil {
		return []error{err}, nil
	}
	if secretsFile != "" {
		ss, err := readSecrets(secretsFile)
		if err != nil {
			return []error{err}, nil
		}
		rs = append(rs, ss...)
	}
	var objs []*object
	var ids []string
	for _, r := range rs {
		o, errs := validateSchema(r)
		problems = append(problems, errs...)
		if o != nil {
			objs = append(objs, o)
			ids = append(ids, o.id)
		}
	}
	// Cross-object rules only mean something when every object decoded.
	if len(objs) == len(rs) {
		c := newCluster(objs)
		problems = append(problems, c.checkRules()...)
		problems = append(problems, progs.checkManifestFlags(c)...)
		problems = append(problems, progs.checkSecurity(c)...)
		problems = append(problems, progs.checkReplicaSets(c)...)
	}
	if composeFile != "" {
		problems = append(problems, progs.checkCompose(composeFile, trainer, "/var/lib/zshard")...)
	}
	return problems, ids
}
