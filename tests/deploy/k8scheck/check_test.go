package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// The tests start from the repository's own manifests and compose file, break
// one thing the way a person editing them might, and require the checker to
// name it. The unbroken files must pass, so a test that expects a failure
// fails for the reason it names and not for another.

const (
	repoK8s     = "../../../deploy/k8s"
	repoCompose = "../../../deploy/docker-compose.yml"
	// The replicated variant: an overlay of repoK8s, and its compose file.
	repoReplicated        = "../../../deploy/k8s-replicated"
	repoReplicatedCompose = "../../../deploy/docker-compose.replicated.yml"
	// The script that makes the Secrets the manifests mount.
	repoSecretsScript = "../../../deploy/k8s-secrets"
	trainerProg       = "zshard-mlp"
)

// serverHelp is the shape of zshard-server --help; run-k8s-check uses the
// real binary's output, these tests only need a fixed flag list.
const serverHelp = `Usage: zshard-server [OPTION]...
  --listen ADDR      address to listen on (ZSHARD_LISTEN, default 0.0.0.0:7070)
                     or with --shard-list (a sentence, not an option)
  --shard-id I       shard id; by default the ordinal of the host name "zshard-2"
  --shards N         number of shard servers (ZSHARD_SHARDS, default 1)
  --threads T        optimizer threads (ZSHARD_THREADS)
  --log-level LEVEL  debug, info, warn, error or off (ZSHARD_LOG_LEVEL)
  --port-file PATH   write the bound port to PATH
  --metrics-listen ADDR
                     serve Prometheus metrics (ZSHARD_METRICS_LISTEN)
  --data-listen ADDR
                     serve the data plane (ZSHARD_DATA_LISTEN)
  --state-dir DIR    load the newest complete checkpoint in DIR on start and
                     write checkpoints there (ZSHARD_STATE_DIR)
  --keep-checkpoints K
                     keep the K newest complete checkpoints
                     (ZSHARD_KEEP_CHECKPOINTS)
  --token-file PATH  the trainers' token (ZSHARD_TOKEN_FILE)
  --admin-token-file PATH
                     the operators' token (ZSHARD_ADMIN_TOKEN_FILE)
  --tls-cert PATH    certificate (ZSHARD_TLS_CERT)
  --tls-key PATH     its key (ZSHARD_TLS_KEY)
  --tls-client-ca PATH
                     verify client certificates against it (ZSHARD_TLS_CLIENT_CA)
  --replicas LIST    the members of this server's replica set (ZSHARD_REPLICAS)
  --replica-index K  this server's place in LIST (ZSHARD_REPLICA_INDEX)
  --failover-ms MS   a peer silent this long is dead (ZSHARD_FAILOVER_MS)
  --help, -h         print this help and exit
`

func testPrograms(t *testing.T, trainerFlags string) *programs {
	t.Helper()
	p := &programs{
		flags:       map[string]flagSet{"zshard-server": parseFlags(serverHelp)},
		entrypoints: map[string]string{"zshard": "zshard-server"},
		server:      "zshard-server",
		trainer:     trainerProg,
	}
	if trainerFlags != "" {
		p.flags[trainerProg] = parseFlags(trainerFlags)
	}
	return p
}

// copyK8s copies the repository's deploy/k8s into a temporary directory.
func copyK8s(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	entries, err := os.ReadDir(repoK8s)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		b, err := os.ReadFile(filepath.Join(repoK8s, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, e.Name()), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// edit replaces old by new in file, which must contain old exactly once: if
// the manifests change so that the edit no longer applies, the test says so
// instead of passing for the wrong reason.
func edit(t *testing.T, file, old, new string) {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(b), old); n != 1 {
		t.Fatalf("%s contains %q %d times, want once", file, old, n)
	}
	if err := os.WriteFile(file, []byte(strings.Replace(string(b), old, new, 1)), 0o644); err != nil {
		t.Fatal(err)
	}
}

var (
	secretsOnce sync.Once
	secretsFile string
	secretsErr  error
)

// testSecrets returns the Secrets deploy/k8s-secrets prints, made once from
// stand-in files: only the Secrets' names and keys matter here.
func testSecrets(t *testing.T) string {
	t.Helper()
	secretsOnce.Do(func() {
		dir, err := os.MkdirTemp("", "k8scheck-secrets")
		if err != nil {
			secretsErr = err
			return
		}
		for _, f := range []string{"ca.crt", "server.crt", "server.key", "trainer.crt", "trainer.key",
			"trainer-token", "admin-token"} {
			if err := os.WriteFile(filepath.Join(dir, f), []byte("stand-in "+f+"\n"), 0o600); err != nil {
				secretsErr = err
				return
			}
		}
		out, err := exec.Command(repoSecretsScript, dir).Output()
		if err != nil {
			secretsErr = err
			return
		}
		secretsFile = filepath.Join(dir, "secrets.yaml")
		secretsErr = os.WriteFile(secretsFile, out, 0o600)
	})
	if secretsErr != nil {
		t.Fatalf("making the Secrets with %s: %v", repoSecretsScript, secretsErr)
	}
	return secretsFile
}

// mustFail runs every check and requires a problem whose text contains want.
func mustFail(t *testing.T, dir string, p *programs, compose, want string) {
	t.Helper()
	problems, _ := run(dir, p, compose, trainerProg, testSecrets(t))
	for _, e := range problems {
		if strings.Contains(e.Error(), want) {
			return
		}
	}
	t.Fatalf("want a problem containing %q, got %d: %v", want, len(problems), problems)
}

func mustPass(t *testing.T, dir string, p *programs, compose string) {
	t.Helper()
	problems, ok := run(dir, p, compose, trainerProg, testSecrets(t))
	if len(problems) > 0 || len(ok) == 0 {
		t.Fatalf("want no problems, got %d valid objects and %v", len(ok), problems)
	}
}

func TestRepositoryManifestsAndComposeFilePass(t *testing.T) {
	mustPass(t, repoK8s, testPrograms(t, ""), repoCompose)
}

func TestAllRequiredKindsAreRendered(t *testing.T) {
	rs, err := render(repoK8s)
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[string]bool{}
	for _, r := range rs {
		kinds[strings.SplitN(r.id, "/", 2)[0]] = true
	}
	for _, k := range []string{"StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget",
		"NetworkPolicy", "Job"} {
		if !kinds[k] {
			t.Errorf("no %s rendered from %s", k, repoK8s)
		}
	}
}

func TestUnknownFieldFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "statefulset.yaml"),
		"terminationGracePeriodSeconds: 60", "terminationGracePeriod: 60")
	mustFail(t, dir, testPrograms(t, ""), "", `unknown field "spec.template.spec.terminationGracePeriod"`)
}

func TestUnknownFieldFailsTheSchemaCheckToo(t *testing.T) {
	// The structural schema is an independent second opinion on the same
	// mistake.
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "statefulset.yaml"),
		"terminationGracePeriodSeconds: 60", "terminationGracePeriod: 60")
	mustFail(t, dir, testPrograms(t, ""), "", "field not declared in schema")
}

func TestFieldWithWrongCaseFails(t *testing.T) {
	// encoding/json would accept "clusterIp" for clusterIP; the API server
	// does not, and neither does the checker.
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "service.yaml"), "clusterIP: None", "clusterIp: None")
	mustFail(t, dir, testPrograms(t, ""), "", `unknown field "spec.clusterIp"`)
}

func TestWrongTypeFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "statefulset.yaml"), "containerPort: 7070", `containerPort: "7070"`)
	mustFail(t, dir, testPrograms(t, ""), "", "containerPort")
}

func TestUnparsableQuantityFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "statefulset.yaml"), "storage: 10Gi", "storage: 10GB-ish")
	mustFail(t, dir, testPrograms(t, ""), "", "quantities must match")
}

func TestDuplicateMountPathFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "statefulset.yaml"), "mountPath: /tmp", "mountPath: /var/lib/zshard")
	mustFail(t, dir, testPrograms(t, ""), "", "duplicate entries for key")
}

func TestUnknownKindFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "poddisruptionbudget.yaml"), "apiVersion: policy/v1", "apiVersion: policy/v2")
	mustFail(t, dir, testPrograms(t, ""), "", "is not a kind this checker knows")
}

func TestMissingResourceFileFails(t *testing.T) {
	dir := copyK8s(t)
	if err := os.Remove(filepath.Join(dir, "service.yaml")); err != nil {
		t.Fatal(err)
	}
	mustFail(t, dir, testPrograms(t, ""), "", "kustomize")
}

func TestShardCountDifferentFromReplicasFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "kustomization.yaml"), "ZSHARD_SHARDS=4", "ZSHARD_SHARDS=3")
	mustFail(t, dir, testPrograms(t, ""), "", "ZSHARD_SHARDS=3 but replicas=4")
}

func TestServiceThatIsNotHeadlessFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "service.yaml"), "clusterIP: None", "type: ClusterIP")
	mustFail(t, dir, testPrograms(t, ""), "", "must be headless")
}

func TestOrderedPodManagementFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "statefulset.yaml"), "podManagementPolicy: Parallel",
		"podManagementPolicy: OrderedReady")
	mustFail(t, dir, testPrograms(t, ""), "", "podManagementPolicy must be Parallel")
}

func TestProbeOnUndeclaredPortFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "statefulset.yaml"),
		"livenessProbe:\n            exec:\n              command: [\"zshard-healthcheck\"]",
		"livenessProbe:\n            grpc:\n              port: 7079")
	mustFail(t, dir, testPrograms(t, ""), "", "asks port 7079")
}

func TestNetworkPolicyThatAdmitsNoTrainerFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "trainer-job.yaml"), "zshard.io/role: trainer", "zshard.io/role: trainers")
	mustFail(t, dir, testPrograms(t, ""), "", "admits no pod template rendered here")
}

func TestServiceTargetingAnUnknownPortNameFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "service.yaml"), "targetPort: grpc", "targetPort: rpc")
	mustFail(t, dir, testPrograms(t, ""), "", "target rpc is not a port")
}

func TestServerArgumentItDoesNotAcceptFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "statefulset.yaml"), "          envFrom:",
		"          args: [\"--state-directory=/var/lib/zshard\"]\n          envFrom:")
	mustFail(t, dir, testPrograms(t, ""), "", "zshard-server does not accept --state-directory")
}

func TestServerArgumentItAcceptsPasses(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "statefulset.yaml"), "          envFrom:",
		"          args: [\"--log-level=debug\", \"--threads\", \"2\"]\n          envFrom:")
	mustPass(t, dir, testPrograms(t, ""), "")
}

func TestServerVariableForNoFlagFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "kustomization.yaml"), "ZSHARD_THREADS=1", "ZSHARD_THREAD=1")
	mustFail(t, dir, testPrograms(t, ""), "", "ZSHARD_THREAD=... would set --thread")
}

func TestTrainerArgumentItDoesNotAcceptFails(t *testing.T) {
	// Only the flags' names matter here; the help text is made up.
	help := "  --shards LIST\n  --rank R\n  --world W\n  --steps S\n"
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "trainer-job.yaml"), "--world=2", "--world-size=2")
	mustFail(t, dir, testPrograms(t, help), "", "zshard-mlp does not accept --world-size")
}

func TestTrainerShardListInTheWrongOrderFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "trainer-job.yaml"), "zshard-0.zshard:7070,zshard-1.zshard:7070",
		"zshard-1.zshard:7070,zshard-0.zshard:7070")
	mustFail(t, dir, testPrograms(t, ""), "", `--shards entry 0 is "zshard-1.zshard:7070"`)
}

func TestTrainerShardListMissingAShardFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "trainer-job.yaml"), ",zshard-3.zshard:7070", "")
	mustFail(t, dir, testPrograms(t, ""), "", "--shards lists 3 addresses, but there are 4 shards")
}

func TestComposeTrainerShardListMissingAShardFails(t *testing.T) {
	f := copyCompose(t)
	edit(t, f, ",zshard-3:7070", "")
	mustFail(t, repoK8s, testPrograms(t, ""), f, "--shards lists 3 addresses, but there are 4 shards")
}

// copyCompose copies the repository's compose file to a temporary file.
func copyCompose(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(repoCompose)
	if err != nil {
		t.Fatal(err)
	}
	f := filepath.Join(t.TempDir(), "docker-compose.yml")
	if err := os.WriteFile(f, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return f
}

func TestComposeTrainerNotWaitingForHealthyShardFails(t *testing.T) {
	f := copyCompose(t)
	edit(t, f, "      zshard-3:\n        condition: service_healthy",
		"      zshard-3:\n        condition: service_started")
	mustFail(t, repoK8s, testPrograms(t, ""), f,
		"service trainer must depend on zshard-3 with condition: service_healthy")
}

func TestComposeShardWithoutOrdinalHostnameFails(t *testing.T) {
	f := copyCompose(t)
	edit(t, f, "hostname: zshard-2", "hostname: shard-two")
	mustFail(t, repoK8s, testPrograms(t, ""), f, "no service is shard 2 of 4")
}

func TestComposeShardWithoutNamedVolumeFails(t *testing.T) {
	f := copyCompose(t)
	edit(t, f, "      - zshard-1-state:/var/lib/zshard\n", "")
	mustFail(t, repoK8s, testPrograms(t, ""), f, "service zshard-1: no named volume")
}

func TestComposeShardCountMismatchFails(t *testing.T) {
	f := copyCompose(t)
	edit(t, f, `ZSHARD_SHARDS: "4"`, `ZSHARD_SHARDS: "5"`)
	mustFail(t, repoK8s, testPrograms(t, ""), f, "ZSHARD_SHARDS=5 but there are 4 shard services")
}

func TestComposeServerVariableForNoFlagFails(t *testing.T) {
	f := copyCompose(t)
	edit(t, f, "ZSHARD_LOG_LEVEL: info", "ZSHARD_LOGLEVEL: info")
	mustFail(t, repoK8s, testPrograms(t, ""), f, "would set --loglevel")
}

// --- TLS and tokens ------------------------------------------------------------

func TestShardWithoutTLSFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "kustomization.yaml"), "      - ZSHARD_TLS_CERT=/etc/zshard/tls/tls.crt\n", "")
	mustFail(t, dir, testPrograms(t, ""), "", "zshard-server runs without ZSHARD_TLS_CERT")
}

func TestShardWithoutAdminTokenFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "kustomization.yaml"),
		"      - ZSHARD_ADMIN_TOKEN_FILE=/etc/zshard/tokens/admin-token\n", "")
	mustFail(t, dir, testPrograms(t, ""), "", "zshard-server runs without ZSHARD_ADMIN_TOKEN_FILE")
}

func TestTokenFileNoSecretProvidesFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "kustomization.yaml"), "ZSHARD_TOKEN_FILE=/etc/zshard/tokens/trainer-token",
		"ZSHARD_TOKEN_FILE=/etc/zshard/token/trainer-token")
	mustFail(t, dir, testPrograms(t, ""), "",
		"ZSHARD_TOKEN_FILE=/etc/zshard/token/trainer-token is not a file of any Secret mounted")
}

func TestSecretTheScriptDoesNotMakeFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "statefulset.yaml"), "secretName: zshard-server-tls", "secretName: zshard-tls")
	mustFail(t, dir, testPrograms(t, ""), "", `Secret "zshard-tls" is neither rendered nor made by deploy/k8s-secrets`)
}

func TestSecretKeyTheScriptDoesNotMakeFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "trainer-job.yaml"), "              - key: admin-token", "              - key: admin.token")
	mustFail(t, dir, testPrograms(t, ""), "", `Secret "zshard-tokens" has no key "admin.token"`)
}

func TestSecretReadableByEveryoneFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "statefulset.yaml"),
		"secretName: zshard-tokens\n            defaultMode: 288", "secretName: zshard-tokens\n            defaultMode: 420")
	mustFail(t, dir, testPrograms(t, ""), "", "mode 0644 lets every user in the container read")
}

func TestSecretUnreadableWithoutFsGroupFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "trainer-job.yaml"), "        fsGroup: 10001\n", "")
	mustFail(t, dir, testPrograms(t, ""), "", "can read them only through the group: set fsGroup")
}

func TestWritableSecretMountFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "statefulset.yaml"),
		"mountPath: /etc/zshard/tls\n              readOnly: true", "mountPath: /etc/zshard/tls")
	mustFail(t, dir, testPrograms(t, ""), "", `the Secret volume "tls" is mounted without readOnly`)
}

func TestTrainerWithoutClientCertificateFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "trainer-job.yaml"),
		"            - name: ZSHARD_TLS_CERT\n              value: /etc/zshard/tls/tls.crt\n", "")
	mustFail(t, dir, testPrograms(t, ""), "", "zshard-mlp runs without ZSHARD_TLS_CERT")
}

func TestGrpcProbeOnATLSServerFails(t *testing.T) {
	dir := copyK8s(t)
	edit(t, filepath.Join(dir, "statefulset.yaml"),
		"readinessProbe:\n            exec:\n              command: [\"zshard-healthcheck\"]",
		"readinessProbe:\n            grpc:\n              port: 7070")
	mustFail(t, dir, testPrograms(t, ""), "", "readinessProbe is a gRPC probe, which speaks plaintext")
}

func TestMissingSecretsFileFails(t *testing.T) {
	// Without the script's Secrets the pods would wait for them forever.
	problems, _ := run(repoK8s, testPrograms(t, ""), "", trainerProg, "")
	for _, e := range problems {
		if strings.Contains(e.Error(), "is neither rendered nor made by deploy/k8s-secrets") {
			return
		}
	}
	t.Fatalf("want the unmade Secrets named, got %v", problems)
}

func TestComposeShardWithoutClientCAFails(t *testing.T) {
	f := copyCompose(t)
	edit(t, f, "    ZSHARD_TLS_CLIENT_CA: /run/secrets/zshard/ca.crt\n", "")
	mustFail(t, repoK8s, testPrograms(t, ""), f, "service zshard-2: runs without ZSHARD_TLS_CLIENT_CA")
}

func TestComposeTrainerTokenOutsideItsMountsFails(t *testing.T) {
	f := copyCompose(t)
	edit(t, f, "      ZSHARD_TOKEN_FILE: /run/secrets/zshard/admin-token\n",
		"      ZSHARD_TOKEN_FILE: /run/zshard/admin-token\n")
	mustFail(t, repoK8s, testPrograms(t, ""), f,
		"service trainer: ZSHARD_TOKEN_FILE=/run/zshard/admin-token is not below any volume")
}

func TestComposeTrainerWithoutTokenFails(t *testing.T) {
	f := copyCompose(t)
	edit(t, f, "      ZSHARD_TOKEN_FILE: /run/secrets/zshard/admin-token\n", "")
	mustFail(t, repoK8s, testPrograms(t, ""), f, "service trainer: runs without ZSHARD_TOKEN_FILE")
}

func TestFlagsAreReadFromHelpText(t *testing.T) {
	fs := parseFlags(serverHelp)
	for _, want := range []string{"--listen", "--shard-id", "--shards", "--port-file", "--help", "-h"} {
		if !fs[want] {
			t.Errorf("%s not found in the help text", want)
		}
	}
	// "zshard-2" and "0.0.0.0:7070" are not options, nor is an option the
	// text only mentions in a sentence.
	for _, not := range []string{"-2", "-0", "--shard-list"} {
		if fs[not] {
			t.Errorf("%s taken for an option", not)
		}
	}
}

func TestEnvironmentNamesMapToFlags(t *testing.T) {
	for env, flag := range map[string]string{"ZSHARD_SHARD_ID": "--shard-id",
		"ZSHARD_LOG_LEVEL": "--log-level", "ZSHARD_SHARDS": "--shards"} {
		if got := envToFlag(env); got != flag {
			t.Errorf("envToFlag(%s) = %s, want %s", env, got, flag)
		}
	}
}

// --- Replicated shards ---------------------------------------------------------

// copyReplicated copies deploy/k8s and deploy/k8s-replicated (which refers to
// it as ../../k8s) into a temporary directory and returns the copy of the
// latter.
func copyReplicated(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	for _, d := range []string{repoK8s, repoReplicated} {
		err := filepath.WalkDir(d, func(p string, e os.DirEntry, err error) error {
			if err != nil {
				return err
			}
			rel, err := filepath.Rel(filepath.Dir(d), p)
			if err != nil {
				return err
			}
			if e.IsDir() {
				return os.MkdirAll(filepath.Join(root, rel), 0o755)
			}
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			return os.WriteFile(filepath.Join(root, rel), b, 0o644)
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return filepath.Join(root, filepath.Base(repoReplicated))
}

// copyReplicatedCompose copies the replicated compose file.
func copyReplicatedCompose(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(repoReplicatedCompose)
	if err != nil {
		t.Fatal(err)
	}
	f := filepath.Join(t.TempDir(), "docker-compose.replicated.yml")
	if err := os.WriteFile(f, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return f
}

func TestReplicatedManifestsAndComposeFilePass(t *testing.T) {
	mustPass(t, repoReplicated, testPrograms(t, ""), repoReplicatedCompose)
}

func TestReplicatedManifestsRenderTwoShardStatefulSets(t *testing.T) {
	rs, err := render(repoReplicated)
	if err != nil {
		t.Fatal(err)
	}
	ids := map[string]bool{}
	for _, r := range rs {
		ids[r.id] = true
	}
	for _, id := range []string{"StatefulSet/zshard-a", "StatefulSet/zshard-b", "Service/zshard",
		"PodDisruptionBudget/zshard-shard-3", "Job/zshard-train-example", "NetworkPolicy/zshard-trainers-only"} {
		if !ids[id] {
			t.Errorf("no %s rendered from %s", id, repoReplicated)
		}
	}
	if ids["StatefulSet/zshard"] || ids["PodDisruptionBudget/zshard"] {
		t.Errorf("the base's StatefulSet or budget is rendered beside the replicated ones: %v", ids)
	}
}

func TestReplicatedWithoutAntiAffinityFails(t *testing.T) {
	dir := copyReplicated(t)
	// Required per zone only: two members may still share a node.
	edit(t, filepath.Join(dir, "replica-set.yaml"), "              topologyKey: kubernetes.io/hostname",
		"              topologyKey: topology.kubernetes.io/zone")
	mustFail(t, dir, testPrograms(t, ""), "", "no required podAntiAffinity on kubernetes.io/hostname")
}

func TestReplicatedAntiAffinityWithoutPairingFails(t *testing.T) {
	// Without matchLabelKeys the rule keeps every two shard pods apart.
	dir := copyReplicated(t)
	edit(t, filepath.Join(dir, "replica-set.yaml"),
		"              matchLabelKeys:\n                - apps.kubernetes.io/pod-index\n              topologyKey: kubernetes.io/hostname",
		"              topologyKey: kubernetes.io/hostname")
	mustFail(t, dir, testPrograms(t, ""), "", "a pod of another shard, too")
}

func TestReplicatedAntiAffinityOnTheWrongPodsFails(t *testing.T) {
	dir := copyReplicated(t)
	edit(t, filepath.Join(dir, "replica-set.yaml"),
		"                  app.kubernetes.io/component: shard\n              matchLabelKeys:",
		"                  app.kubernetes.io/component: trainer\n              matchLabelKeys:")
	mustFail(t, dir, testPrograms(t, ""), "",
		"does not keep pod zshard-a-0 off the nodes of the other members of shard 0")
}

func TestReplicatedWithoutSpreadOverNodesFails(t *testing.T) {
	dir := copyReplicated(t)
	edit(t, filepath.Join(dir, "..", "k8s", "statefulset.yaml"),
		"topologyKey: kubernetes.io/hostname", "topologyKey: topology.kubernetes.io/region")
	mustFail(t, dir, testPrograms(t, ""), "", "no topologySpreadConstraints on kubernetes.io/hostname")
}

func TestReplicatedMemberListInTheWrongOrderFails(t *testing.T) {
	dir := copyReplicated(t)
	edit(t, filepath.Join(dir, "replica-set.yaml"),
		"value: zshard-a-$(POD_INDEX).zshard:7070|zshard-b-$(POD_INDEX).zshard:7070",
		"value: zshard-b-$(POD_INDEX).zshard:7070|zshard-a-$(POD_INDEX).zshard:7070")
	mustFail(t, dir, testPrograms(t, ""), "",
		`ZSHARD_REPLICAS is "zshard-b-0.zshard:7070|zshard-a-0.zshard:7070", want "zshard-a-0.zshard:7070|zshard-b-0.zshard:7070"`)
}

func TestReplicatedMemberListBeforeTheIndexIsKnownFails(t *testing.T) {
	// A reference to a variable defined after it stays as it is.
	dir := copyReplicated(t)
	edit(t, filepath.Join(dir, "replica-set.yaml"), "$(POD_INDEX).zshard:7070|", "$(POD_INDEXX).zshard:7070|")
	mustFail(t, dir, testPrograms(t, ""), "", "ZSHARD_REPLICAS cannot be worked out ($(POD_INDEXX))")
}

func TestReplicatedShardIdThatIsNotTheOrdinalFails(t *testing.T) {
	dir := copyReplicated(t)
	edit(t, filepath.Join(dir, "replica-set.yaml"), "value: $(POD_INDEX)\n", "value: \"1\"\n")
	mustFail(t, dir, testPrograms(t, ""), "", `ZSHARD_SHARD_ID is "1", want 0`)
}

func TestReplicatedSameIndexTwiceFails(t *testing.T) {
	dir := copyReplicated(t)
	edit(t, filepath.Join(dir, "replica-b", "kustomization.yaml"), `value: "1"`, `value: "0"`)
	mustFail(t, dir, testPrograms(t, ""), "", "need the indexes 0 to 1, each once")
}

func TestReplicatedSetsOfDifferentSizesFail(t *testing.T) {
	dir := copyReplicated(t)
	edit(t, filepath.Join(dir, "kustomization.yaml"), "  - name: zshard-b\n    count: 4", "  - name: zshard-b\n    count: 3")
	mustFail(t, dir, testPrograms(t, ""), "", "replicas=3 but StatefulSet/zshard-a has 4")
}

func TestReplicatedTrainerListWithMembersSwappedFails(t *testing.T) {
	dir := copyReplicated(t)
	edit(t, filepath.Join(dir, "kustomization.yaml"), "--shards=zshard-a-0.zshard:7070|zshard-b-0.zshard:7070,",
		"--shards=zshard-b-0.zshard:7070|zshard-a-0.zshard:7070,")
	mustFail(t, dir, testPrograms(t, ""), "",
		`--shards entry 0 is "zshard-b-0.zshard:7070|zshard-a-0.zshard:7070", want zshard-a-0.zshard:7070|zshard-b-0.zshard:7070`)
}

func TestReplicatedTrainerListWithoutTheBackupsFails(t *testing.T) {
	dir := copyReplicated(t)
	edit(t, filepath.Join(dir, "kustomization.yaml"), "|zshard-b-3.zshard:7070\n", "\n")
	mustFail(t, dir, testPrograms(t, ""), "", `--shards entry 3 is "zshard-a-3.zshard:7070", want`)
}

func TestReplicatedBudgetThatAllowsBothMembersFails(t *testing.T) {
	dir := copyReplicated(t)
	edit(t, filepath.Join(dir, "poddisruptionbudget.yaml"),
		"  maxUnavailable: 1\n  selector:\n    matchLabels:\n      app.kubernetes.io/name: zshard\n      app.kubernetes.io/component: shard\n      apps.kubernetes.io/pod-index: \"2\"",
		"  maxUnavailable: 2\n  selector:\n    matchLabels:\n      app.kubernetes.io/name: zshard\n      app.kubernetes.io/component: shard\n      apps.kubernetes.io/pod-index: \"2\"")
	mustFail(t, dir, testPrograms(t, ""), "", "no PodDisruptionBudget keeps a member of shard 2 up")
}

func TestReplicatedBaseBudgetKeptBesideThePerShardOnesFails(t *testing.T) {
	dir := copyReplicated(t)
	edit(t, filepath.Join(dir, "replica-a", "kustomization.yaml"), "      name: zshard\n    patch: |-\n      $patch: delete",
		"      name: not-the-budget\n    patch: |-\n      $patch: delete")
	mustFail(t, dir, testPrograms(t, ""), "", "PodDisruptionBudget/zshard and PodDisruptionBudget/zshard-shard-0 both select pod zshard-a-0")
}

func TestReplicatedNetworkPolicyThatKeepsMembersApartFails(t *testing.T) {
	dir := copyReplicated(t)
	edit(t, filepath.Join(dir, "kustomization.yaml"), "      name: zshard-trainers-only\n", "      name: no-such-policy\n")
	mustFail(t, dir, testPrograms(t, ""), "", "does not admit the shard pods themselves on their grpc port")
}

func TestComposeReplicatedPassesWithTheUnreplicatedManifests(t *testing.T) {
	mustPass(t, repoK8s, testPrograms(t, ""), repoReplicatedCompose)
}

func TestComposeReplicatedMemberListThatDiffersFails(t *testing.T) {
	f := copyReplicatedCompose(t)
	edit(t, f, "ZSHARD_REPLICAS: zshard-a-2:7070|zshard-b-2:7070\n      ZSHARD_REPLICA_INDEX: \"1\"",
		"ZSHARD_REPLICAS: zshard-b-2:7070|zshard-a-2:7070\n      ZSHARD_REPLICA_INDEX: \"1\"")
	mustFail(t, repoK8s, testPrograms(t, ""), f,
		`service zshard-b-2: ZSHARD_REPLICAS is "zshard-b-2:7070|zshard-a-2:7070", want "zshard-a-2:7070|zshard-b-2:7070"`)
}

func TestComposeReplicatedMemberIndexTwiceFails(t *testing.T) {
	f := copyReplicatedCompose(t)
	edit(t, f, "ZSHARD_REPLICAS: zshard-a-3:7070|zshard-b-3:7070\n      ZSHARD_REPLICA_INDEX: \"1\"",
		"ZSHARD_REPLICAS: zshard-a-3:7070|zshard-b-3:7070\n      ZSHARD_REPLICA_INDEX: \"0\"")
	mustFail(t, repoK8s, testPrograms(t, ""), f, "service zshard-a-3 and service zshard-b-3 both are member 0 of shard 3")
}

func TestComposeReplicatedMembersSharingAVolumeFail(t *testing.T) {
	f := copyReplicatedCompose(t)
	edit(t, f, "      - zshard-b-1-state:/var/lib/zshard\n", "      - zshard-a-1-state:/var/lib/zshard\n")
	mustFail(t, repoK8s, testPrograms(t, ""), f, "services zshard-a-1 and zshard-b-1 keep their state on the same volume zshard-a-1-state")
}

func TestComposeReplicatedTrainerListWithMembersSwappedFails(t *testing.T) {
	f := copyReplicatedCompose(t)
	edit(t, f, "--shards=zshard-a-0:7070|zshard-b-0:7070,", "--shards=zshard-b-0:7070|zshard-a-0:7070,")
	mustFail(t, repoK8s, testPrograms(t, ""), f, `--shards entry 0 is "zshard-b-0:7070|zshard-a-0:7070", want zshard-a-0:7070|zshard-b-0:7070`)
}

func TestComposeReplicatedTrainerNotWaitingForABackupFails(t *testing.T) {
	f := copyReplicatedCompose(t)
	edit(t, f, "      zshard-b-3:\n        condition: service_healthy", "")
	mustFail(t, repoK8s, testPrograms(t, ""), f, "service trainer must depend on zshard-b-3 with condition: service_healthy")
}

func TestComposeReplicatedMemberWithoutANetworkFails(t *testing.T) {
	f := copyReplicatedCompose(t)
	edit(t, f, "  zshard-a-1:\n    <<: *shard\n", "  zshard-a-1:\n    <<: *shard\n    network_mode: host\n")
	mustFail(t, repoK8s, testPrograms(t, ""), f, "service zshard-a-1: network_mode host")
}
