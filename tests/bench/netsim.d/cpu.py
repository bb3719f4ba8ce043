"""CPU seconds from /proc, shared by the trainer and ring helpers: a
process's (utime + stime) and the whole machine's busy time, which
includes the softirq time that the veths and the tbf shaping cost and that
no process is charged with. /proc is the same in every network namespace,
so a helper inside one can read the shards' and the machine's."""
import os

HZ = os.sysconf("SC_CLK_TCK")


def process(pid):
    return stat(pid)[0]


def stat(pid):
    """(CPU seconds, minor page faults) of a process so far. The faults
    say how much of its CPU went to first touches of fresh memory (15 us
    each on this VM, docs/PERFORMANCE.md)."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / HZ, int(fields[7])


def machine():
    """(busy, softirq) CPU seconds of the machine since boot: busy is all
    but idle and iowait; softirq is where the veths' and tbf's packet work
    runs."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    return (sum(v) - v[3] - v[4]) / HZ, v[6] / HZ


class Window:
    """What the machine and the given processes spent between start() and
    stop(), as a dict for the JSON report."""

    def __init__(self, pids=()):
        self.pids = list(pids)

    def start(self):
        self.m0 = machine()
        self.p0 = [stat(p) for p in self.pids]
        self.self0 = os.times()
        self.flt0 = stat(os.getpid())[1]
        return self

    def stop(self, wall):
        t = os.times()
        m = machine()
        now = [stat(p) for p in self.pids]
        return {"self_minflt": stat(os.getpid())[1] - self.flt0,
                "pids_minflt": [b[1] - a[1] for a, b in zip(self.p0, now)],
                "self_cpu_s": round(t.user + t.system - self.self0.user - self.self0.system, 3),
                "machine_busy_s": round(m[0] - self.m0[0], 3),
                "machine_softirq_s": round(m[1] - self.m0[1], 3),
                "machine_capacity_s": round(wall * os.cpu_count(), 3),
                "pids_cpu_s": [round(b[0] - a[0], 3) for a, b in zip(self.p0, now)]}
