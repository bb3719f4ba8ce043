"""Replica sets of real zshard-server processes for the Python tests (not a test itself).

ReplicaCluster(shards=N, replicas=R) starts N shards x R replicas on
127.0.0.1 (docs/OPERATIONS.md, "Replica sets"; the contract in issue 13).
The members of a set must know each other's gRPC addresses before any of
them starts (--replicas), so every member's port is picked first
(ports.free_ports: below the kernel's ephemeral range, all bound while they
are picked, then released and given to the servers). Each member has its own state directory (checkpoints are written by
the primary; a restarted member comes back with the same flags). The data
plane stays on port 0: clients learn it from GetInfo.

    with ReplicaCluster(2, 2, failover_ms=500) as rc:
        client = zshard.Client(rc.addresses, ...)   # "a0|b0,a1|b1"
        k = rc.primary(0)                           # from GetInfo.replica
        rc.kill(0, k); ...; rc.restart(0, k)

With replicas=1 the servers get no replica flags: plain shards, as
zshard_servers.Shards starts them (the uninterrupted reference runs).

Every wait has a deadline; SIGSTOPped members are continued before the stop;
a server gets SIGKILL if the test process dies (setpriv --pdeathsig).
At the end every live member gets SIGTERM and must exit 0 within
STOP_SECONDS (else SIGKILL, and the exit codes and logs are raised unless
the test already failed); killed members are not checked. GetInfo goes
through grpcio with stubs generated from proto/ once per process, under the
module name zs_rpc (the package zshard.v1 stays the service's name; the
import name would otherwise shadow the zshard client package).
"""

import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402
from ports import free_ports  # noqa: E402

SOURCE_DIR = os.environ.get(
    "ZS_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
READY_SECONDS = 20
STOP_SECONDS = 30
KILL_SECONDS = 10
INFO_TIMEOUT = 2.0

# ReplicaRole (proto/zshard/v1/zshard.proto).
ROLE_NONE, ROLE_STARTING, ROLE_PRIMARY, ROLE_BACKUP, ROLE_JOINING, ROLE_STALE = range(6)
ROLE_NAMES = {ROLE_NONE: "NONE", ROLE_STARTING: "STARTING", ROLE_PRIMARY: "PRIMARY",
              ROLE_BACKUP: "BACKUP", ROLE_JOINING: "JOINING", ROLE_STALE: "STALE"}

_stubs = None


def stubs():
    """(pb, pbg): the generated zshard.proto modules and grpc, generated once
    per process into a temporary directory."""
    global _stubs
    if _stubs is None:
        tmp = tempfile.mkdtemp(prefix="zshard-replica-stubs-")
        protos = os.path.join(tmp, "protos")
        os.makedirs(os.path.join(protos, "zs_rpc", "v1"))
        shutil.copy(os.path.join(SOURCE_DIR, "proto", "zshard", "v1", "zshard.proto"),
                    os.path.join(protos, "zs_rpc", "v1"))
        gen = os.path.join(tmp, "gen")
        os.makedirs(gen)
        subprocess.run(["protoc", "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin",
                        "-I" + protos, "--python_out=" + gen, "--grpc_out=" + gen,
                        "zs_rpc/v1/zshard.proto"], check=True, timeout=60)
        sys.path.insert(0, gen)
        import grpc
        _stubs = (importlib.import_module("zs_rpc.v1.zshard_pb2"),
                  importlib.import_module("zs_rpc.v1.zshard_pb2_grpc"), grpc)
    return _stubs


# In front of every server when present: SIGKILL when the test process dies
# (PR_SET_PDEATHSIG, kept across the exec), so that a test killed by its
# timeout leaves no server behind. setpriv execs the server in its own
# process: the pid stays the server's.
SETPRIV = ["/usr/bin/setpriv", "--pdeathsig", "KILL", "--"] if os.access(
    "/usr/bin/setpriv", os.X_OK) else []


def wait_for(what, seconds, poll=0.05):
    """Polls what() until it returns something true or `seconds` pass;
    returns its last value (the caller asserts it)."""
    deadline = time.monotonic() + seconds
    while True:
        value = what()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(poll)


class Member:
    """One replica: its place, address, process, log and state directory."""

    def __init__(self, shard, index, port, tmp):
        self.shard, self.index, self.port = shard, index, port
        self.address = "127.0.0.1:%d" % port
        name = "s%dr%d" % (shard, index)
        self.port_file = os.path.join(tmp, name + ".port")
        self.log_path = os.path.join(tmp, name + ".log")
        self.state_dir = os.path.join(tmp, name + ".state")
        os.mkdir(self.state_dir)
        self.proc = None
        self.stopped = False  # SIGSTOPped
        self.killed = False   # its current process was SIGKILLed
        self.starts = 0
        self.without = ()  # flags of extra_args (each with its value) left out


class ReplicaCluster:
    def __init__(self, shards, replicas, failover_ms=500, threads=1, state_dirs=True,
                 extra_args=()):
        self.nshards, self.nreplicas = shards, replicas
        self.failover_ms, self.threads, self.state_dirs = failover_ms, threads, state_dirs
        self.extra_args = list(extra_args)
        self.members = []  # [shard][index]
        self.tmp = None
        self.binary = None
        self.env = {}
        self.bad_exits = []  # (member name, exit code) of processes that ended on their own

    # ---------------------------------------------------------------- start

    def __enter__(self):
        self.binary = os.environ.get("ZSHARD_SERVER_BIN")
        if not self.binary or not os.access(self.binary, os.X_OK):
            raise RuntimeError("ZSHARD_SERVER_BIN must name the zshard-server binary")
        self.tmp = tempfile.mkdtemp(prefix="zshard-replicas-")
        try:
            ports = free_ports(self.nshards * self.nreplicas)
            for s in range(self.nshards):
                row = [Member(s, k, ports[s * self.nreplicas + k], self.tmp)
                       for k in range(self.nreplicas)]
                self.members.append(row)
            for m in self.all_members():
                self._spawn(m)
            for m in self.all_members():
                self._wait_ready(m)
        except BaseException:
            self._stop()
            raise
        return self

    def all_members(self):
        return [m for row in self.members for m in row]

    def member(self, shard, index):
        return self.members[shard][index]

    def replica_list(self, shard):
        return "|".join(m.address for m in self.members[shard])

    @property
    def addresses(self):
        """The client's address list: shards by ',', replicas by '|'."""
        return ",".join(self.replica_list(s) for s in range(self.nshards))

    def _args(self, m):
        args = [self.binary, "--listen", m.address, "--port-file", m.port_file,
                "--shard-id", str(m.shard), "--shards", str(self.nshards),
                "--threads", str(self.threads)]
        if self.nreplicas > 1:
            args += ["--replicas", self.replica_list(m.shard), "--replica-index", str(m.index),
                     "--failover-ms", str(self.failover_ms)]
        if self.state_dirs:
            args += ["--state-dir", m.state_dir]
        extra = list(self.extra_args)
        for flag in m.without:
            at = extra.index(flag)
            del extra[at:at + 2]
        return args + extra

    def _spawn(self, m):
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZSHARD_")}
        env.update(self.env)
        if os.path.exists(m.port_file):
            os.unlink(m.port_file)
        m.starts += 1
        with open(m.log_path, "a") as log:
            log.write("===== start %d: %s\n" % (m.starts, " ".join(self._args(m))))
            log.flush()
            m.proc = subprocess.Popen(SETPRIV + self._args(m), stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=log, env=env)
        m.killed = m.stopped = False

    def _wait_ready(self, m):
        deadline = time.monotonic() + READY_SECONDS
        while True:
            if m.proc.poll() is not None:
                raise RuntimeError("zshard-server s%dr%d exited with %d:\n%s" %
                                   (m.shard, m.index, m.proc.returncode, self.read_logs()))
            try:
                with open(m.port_file) as f:
                    if int(f.read()) == m.port:
                        return
            except (FileNotFoundError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("zshard-server s%dr%d not ready:\n%s" %
                                   (m.shard, m.index, self.read_logs()))
            time.sleep(0.01)

    # ---------------------------------------------------------------- faults

    def kill(self, shard, index):
        """SIGKILLs the member (its exit status is then not checked)."""
        m = self.member(shard, index)
        if m.proc.poll() is None:
            m.proc.send_signal(signal.SIGKILL)
        m.proc.wait(KILL_SECONDS)
        m.killed, m.stopped = True, False

    def restart(self, shard, index, without=()):
        """Starts a killed member again with the same flags (same port, same
        state directory) and waits until it serves. without: flags of
        extra_args (each followed by its value) this member goes on without,
        from this start on."""
        m = self.member(shard, index)
        m.without = tuple(without) or m.without
        if m.proc is not None and m.proc.poll() is None:
            raise RuntimeError("restart: s%dr%d is still running" % (shard, index))
        self._spawn(m)
        self._wait_ready(m)

    def pause(self, shard, index):
        """SIGSTOP: the member keeps its sockets but answers nothing (a
        partition, as far as loopback can emulate one)."""
        m = self.member(shard, index)
        m.proc.send_signal(signal.SIGSTOP)
        m.stopped = True

    def resume(self, shard, index):
        m = self.member(shard, index)
        m.proc.send_signal(signal.SIGCONT)
        m.stopped = False

    def alive(self, shard, index):
        m = self.member(shard, index)
        return m.proc is not None and m.proc.poll() is None and not m.killed

    # ---------------------------------------------------------------- GetInfo

    def info(self, shard, index, timeout=INFO_TIMEOUT):
        """The member's GetInfoResponse, or None when it does not answer."""
        pb, pbg, grpc = stubs()
        with grpc.insecure_channel(self.member(shard, index).address) as ch:
            try:
                return pbg.ZShardStub(ch).GetInfo(pb.GetInfoRequest(), timeout=timeout)
            except grpc.RpcError:
                return None

    def infos(self, shard, timeout=INFO_TIMEOUT):
        return [self.info(shard, k, timeout) if self.alive(shard, k)
                and not self.member(shard, k).stopped else None
                for k in range(self.nreplicas)]

    def primary(self, shard):
        """Index of the member that says it is PRIMARY with the highest term
        among those answering, or None (an unreplicated shard that answers
        is its own primary)."""
        if self.nreplicas == 1:
            return 0 if self.infos(shard)[0] is not None else None
        best = None
        for k, i in enumerate(self.infos(shard)):
            if i is None or not i.HasField("replica") or i.replica.role != ROLE_PRIMARY:
                continue
            if best is None or i.replica.term > best[1]:
                best = (k, i.replica.term)
        return None if best is None else best[0]

    def wait_primary(self, shard, seconds=READY_SECONDS):
        """primary(shard), waiting up to `seconds` for one (index 0 is one)."""
        found = wait_for(lambda: [self.primary(shard)] if self.primary(shard) is not None
                         else None, seconds)
        return found[0] if found else None

    def roles(self, shard):
        """[(role name, term, version)] per member; None for one not answering."""
        out = []
        for i in self.infos(shard):
            if i is None:
                out.append(None)
            elif not i.HasField("replica"):
                out.append(("NONE", 0, i.version))
            else:
                out.append((ROLE_NAMES.get(i.replica.role, str(i.replica.role)),
                            i.replica.term, i.version))
        return out

    def whole(self, shard):
        """(True, roles) when the shard's set is whole: one PRIMARY, every
        other member BACKUP of the same term, and the primary counts each
        of them in sync (a backup cut off and dropped may still call itself
        BACKUP); (False, what was seen) otherwise."""
        infos = self.infos(shard)
        seen = self.roles(shard)
        if any(i is None or not i.HasField("replica") for i in infos):
            return False, seen
        prim = [k for k, i in enumerate(infos) if i.replica.role == ROLE_PRIMARY]
        if len(prim) != 1:
            return False, seen
        p = infos[prim[0]].replica
        for k, i in enumerate(infos):
            if k == prim[0]:
                continue
            if i.replica.role != ROLE_BACKUP or i.replica.term != p.term:
                return False, seen
            if k >= len(p.members) or not p.members[k].in_sync:
                return False, (seen, "primary's in_sync: %s" % [m.in_sync for m in p.members])
        return True, seen

    def wait_joined(self, shard, seconds=READY_SECONDS):
        """Waits until every member of the shard has a place in the set
        (PRIMARY, BACKUP or JOINING): one that asked to join is copied at the
        primary's next applied step, so the set is whole after the next step
        (and in sync with the write after that). True if so in time."""
        return wait_for(lambda: all(r is not None and r[0] in ("PRIMARY", "BACKUP", "JOINING")
                                    for r in self.roles(shard)), seconds)

    def failovers(self):
        """Sum of GetInfo.replica.failovers over the members answering now."""
        total = 0
        for s in range(self.nshards):
            for i in self.infos(s):
                if i is not None and i.HasField("replica"):
                    total += i.replica.failovers
        return total

    # ---------------------------------------------------------------- ReadState

    def read_state(self, shard, index, spec_hash, tensor, slice_, array, numel, chunk=1 << 18):
        """(version, optimizer_steps, bytes) of one piece's state array read
        from one member with ReadState; raises grpc.RpcError on a refusal."""
        pb, pbg, grpc = stubs()
        data, version, steps = [], None, None
        with grpc.insecure_channel(self.member(shard, index).address) as ch:
            stub = pbg.ZShardStub(ch)
            for off in range(0, numel, chunk):
                r = stub.ReadState(pb.ReadStateRequest(
                    spec_hash=spec_hash, tensor=tensor, slice=slice_, array=array, offset=off,
                    count=min(chunk, numel - off)), timeout=30)
                if version is not None and (r.version, r.optimizer_steps) != (version, steps):
                    raise RuntimeError("read_state: the version moved during the read")
                version, steps = r.version, r.optimizer_steps
                data.append(r.data)
        return version, steps, b"".join(data)

    # ---------------------------------------------------------------- stop

    def read_logs(self, tail=200):
        out = []
        for m in self.all_members():
            try:
                with open(m.log_path) as f:
                    lines = f.read().splitlines()[-tail:]
            except FileNotFoundError:
                lines = []
            out.append("----- shard %d replica %d (%s) -----\n%s\n" %
                       (m.shard, m.index, m.address, "\n".join(lines)))
        return "".join(out)

    def _stop(self):
        """SIGCONT, SIGTERM, wait STOP_SECONDS, SIGKILL: returns the non-zero
        exit codes of members that were not killed on purpose."""
        live = [m for m in self.all_members() if m.proc is not None and m.proc.poll() is None]
        for m in live:
            if m.stopped:
                m.proc.send_signal(signal.SIGCONT)
            m.proc.send_signal(signal.SIGTERM)
        bad = []
        deadline = time.monotonic() + STOP_SECONDS
        for m in self.all_members():
            if m.proc is None:
                continue
            try:
                code = m.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                m.proc.kill()
                code = m.proc.wait(KILL_SECONDS)
                bad.append(("s%dr%d" % (m.shard, m.index), "no exit after SIGTERM"))
                continue
            if code != 0 and not m.killed:
                bad.append(("s%dr%d" % (m.shard, m.index), code))
        return bad

    def __exit__(self, et, ev, tb):
        bad = self._stop()
        logs = self.read_logs() if bad or et is not None else ""
        if et is not None and not issubclass(et, KeyboardInterrupt):
            sys.stderr.write("replica cluster logs (the test failed):\n" + logs)
        keep = os.environ.get("ZSHARD_KEEP_LOGS")
        if keep:
            print("replica cluster logs kept in %s" % self.tmp, file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if bad and et is None:
            raise AssertionError("zshard-server exits %s after SIGTERM\n%s" % (bad, logs))
        return False


zshard_servers.use_build_tree_package()
