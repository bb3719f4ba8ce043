"""Real zshard-server processes for the Python tests (not a test itself).

Shards(n) starts n servers on port 0 (shard ids 0..n-1 of n), waits until each
has written its port file, and stops them on exit, raising if one did not
exit cleanly after SIGTERM. Its `addresses` is the list a client takes. The
zshard package is imported from the build tree: ZSHARD_PYTHONPATH (set by
CTest) or build/python under the source directory.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

READY_SECONDS = 20
STOP_SECONDS = 30


def use_build_tree_package():
    path = os.environ.get("ZSHARD_PYTHONPATH")
    if not path:
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.path.join(src, "build", "python")
    if path not in sys.path:
        sys.path.insert(0, path)


class Shards:
    def __init__(self, n, threads=1, state_dirs=False, extra_args=()):
        self.n, self.threads, self.state_dirs = n, threads, state_dirs
        self.extra_args = list(extra_args)
        self.killed = set()
        self.procs, self.logs = [], []
        self.args, self.ports = [], []
        self._env = None
        self.tmp = None
        self.addresses = None
        # Further environment variables for the servers (the caller's
        # ZSHARD_* are not passed on); set before entering.
        self.env = {}

    def __enter__(self):
        binary = os.environ.get("ZSHARD_SERVER_BIN")
        if not binary or not os.access(binary, os.X_OK):
            raise RuntimeError("ZSHARD_SERVER_BIN must name the zshard-server binary")
        self.tmp = tempfile.mkdtemp(prefix="zshard-pyt-")
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZSHARD_")}
        env.update(self.env)
        self._env = env
        ports = self.ports
        try:
            for i in range(self.n):
                port_file = os.path.join(self.tmp, "port%d" % i)
                log = open(os.path.join(self.tmp, "log%d" % i), "w")
                self.logs.append(log)
                args = [binary, "--listen", "127.0.0.1:0", "--port-file", port_file, "--shard-id",
                        str(i), "--shards", str(self.n), "--threads", str(self.threads)]
                if self.state_dirs:
                    state = os.path.join(self.tmp, "state%d" % i)
                    os.mkdir(state)
                    args += ["--state-dir", state]
                args += self.extra_args
                self.args.append(args)
                self.procs.append(subprocess.Popen(
                    args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env))
            for i, proc in enumerate(self.procs):
                ports.append(self._wait_port(proc, os.path.join(self.tmp, "port%d" % i)))
        except BaseException:
            self._stop()
            raise
        self.addresses = ",".join("127.0.0.1:%d" % p for p in ports)
        return self

    def _wait_port(self, proc, port_file):
        deadline = time.monotonic() + READY_SECONDS
        while True:
            if proc.poll() is not None:
                raise RuntimeError("zshard-server exited with %d:\n%s" %
                                   (proc.returncode, self.read_logs()))
            try:
                with open(port_file) as f:
                    return int(f.read())
            except (FileNotFoundError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("zshard-server not ready:\n" + self.read_logs())
            time.sleep(0.01)

    def read_logs(self):
        out = []
        for i, log in enumerate(self.logs):
            log.flush()
            with open(log.name) as f:
                out.append("----- shard %d -----\n%s" % (i, f.read()))
        return "".join(out)

    def kill(self, i):
        """SIGKILLs shard i (its exit status is then not checked)."""
        self.killed.add(i)
        self.procs[i].kill()
        self.procs[i].wait()

    def restart(self, i, without=()):
        """Starts killed shard i again on the same gRPC address (and state
        directory); its data port is a new one. Returns once it listens.
        without: flags of the first start (each followed by its value) to
        leave out, from this start on."""
        args = list(self.args[i])
        for flag in without:
            at = args.index(flag)
            del args[at:at + 2]
        self.args[i] = list(args)
        args[args.index("--listen") + 1] = "127.0.0.1:%d" % self.ports[i]
        port_file = os.path.join(self.tmp, "port%d" % i)
        os.unlink(port_file)
        self.procs[i] = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self.logs[i],
                                         stderr=self.logs[i], env=self._env)
        self.killed.discard(i)
        self._wait_port(self.procs[i], port_file)

    def restart_all(self, without=()):
        """SIGKILLs every shard, then starts each again (restart, with
        `without`): a whole job's servers lost at once and brought back from
        their state directories."""
        for i in range(len(self.procs)):
            self.kill(i)
        for i in range(len(self.procs)):
            self.restart(i, without)

    def _stop(self):
        codes = []
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                codes.append(proc.wait(STOP_SECONDS))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        codes = [0 if i in self.killed else code for i, code in enumerate(codes)]
        logs = self.read_logs() if any(codes) else ""
        for log in self.logs:
            log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return codes, logs

    def __exit__(self, et, ev, tb):
        codes, logs = self._stop()
        if any(codes) and et is None:
            raise AssertionError("zshard-server exit codes %s after SIGTERM\n%s" % (codes, logs))
        return False
