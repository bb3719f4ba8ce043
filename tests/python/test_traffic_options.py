"""zshard.Client takes the traffic options as keywords (schedule,
schedule_window, tcp_congestion, tcp_pacing_mbit; docs/CLIENT.md, "Traffic schedules"):
each reaches libzshard (a bad value is refused there or here with a clear
error, before anything is sent), a keyword wins over its environment
variable, the congestion control and the pacing reach the data-plane
sockets, link pacing (ZSHARD_TCP_LINK_MBIT, --tcp-link-mbit) sets each
sending socket's cap to the link's share and keeps the bits, and every
schedule trains to the bits of the FIFO one. Real zshard-server processes on
loopback."""
import array
import math
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()
import zshard  # noqa: E402

NUMEL = (4096, 700, 33)  # with split_threshold 512: two tensors split over both shards


def _read(path):
    with open(path) as f:
        return f.read().strip()


def other_congestion_control():
    """An algorithm this kernel offers other than the host's default (reno is
    built into every Linux; the default may be it)."""
    default = _read("/proc/sys/net/ipv4/tcp_congestion_control")
    allowed = _read("/proc/sys/net/ipv4/tcp_allowed_congestion_control").split()
    others = [a for a in allowed if a != default]
    if not others:
        pytest.fail("the kernel lets this process use only '%s': nothing to tell apart" % default)
    return others[0]


def sockets_of_this_process_where(match, pid=None):
    """(sockets whose info line's words `match`, all established TCP
    sockets) of this process, or of process `pid` (ss -tinp: a socket's
    line, then its info line)."""
    out = subprocess.run(["ss", "-Htinp", "state", "established"], check=True,
                         capture_output=True, text=True).stdout
    want = "pid=%d," % (pid or os.getpid())
    mine = matched = total = 0
    for line in out.splitlines():
        if not line[:1].isspace():
            mine = want in line
            continue
        if mine:
            total += 1
            matched += bool(match(line.split()))
            mine = False
    return matched, total


def sockets_of_this_process(cc):
    """(sockets using `cc`, all established TCP sockets) of this process:
    the info line names the algorithm as a word of its own."""
    return sockets_of_this_process_where(lambda words: cc in words)


def train(addresses, steps=4, **options):
    """A few AdamW steps of one trainer on fresh shards; the final weights."""
    c = zshard.Client(addresses, push_dtype="fp32", pull_dtype="fp32", split_threshold=512,
                      job="traffic", **options)
    try:
        c.add_group("adamw", weight_decay=0.01)
        ids = [c.add_tensor("t%d" % i, n) for i, n in enumerate(NUMEL)]
        w = [array.array("f", (math.sin(0.37 * j + i) for j in range(n)))
             for i, n in enumerate(NUMEL)]
        c.open_job(w)
        for s in range(steps):
            for r in c.pull_many(ids, w):
                r.wait()
            g = [array.array("f", (x * 0.5 + 0.01 * (s + 1) for x in b)) for b in w]
            for r in c.push_many(ids, g):
                r.wait()
            c.step(lr=1e-2)
        for r in c.pull_many(ids, w):
            r.wait()
        return [b.tobytes() for b in w]
    finally:
        c.close()


def test_every_schedule_given_as_a_keyword_trains_to_the_fifo_bits():
    results = {}
    for name, opts in (("fifo", dict(schedule="fifo")),
                       ("rotated, window 1", dict(schedule="rotated", schedule_window=1)),
                       ("rotated, window 3", dict(schedule=zshard.SCHEDULE_ROTATED,
                                                  schedule_window=3))):
        with zshard_servers.Shards(2) as shards:
            results[name] = train(shards.addresses, **opts)
    assert results["rotated, window 1"] == results["fifo"]
    assert results["rotated, window 3"] == results["fifo"]


def test_bad_traffic_options_are_refused_with_a_clear_error():
    with zshard_servers.Shards(1) as shards:
        a = shards.addresses
        with pytest.raises(ValueError, match="schedule: 'pairwise' is not one of"):
            zshard.Client(a, schedule="pairwise")
        with pytest.raises(zshard.Error, match="schedule 7 is not a zs_schedule value") as e:
            zshard.Client(a, schedule=7)
        assert e.value.status == zshard.EINVAL
        with pytest.raises(zshard.Error, match="schedule_window must be at most 64") as e:
            zshard.Client(a, schedule="rotated", schedule_window=65)
        assert e.value.status == zshard.EINVAL
        with pytest.raises(OverflowError):
            zshard.Client(a, schedule_window=-1)
        with pytest.raises(zshard.Error, match="nosuchcc") as e:
            zshard.Client(a, tcp_congestion="nosuchcc")
        assert e.value.status == zshard.EINVAL
        with pytest.raises(TypeError, match="tcp_congestion must be a str"):
            zshard.Client(a, tcp_congestion=1)
        with pytest.raises(TypeError, match="unknown option 'schedule_windows'"):
            zshard.Client(a, schedule_windows=2)


def test_a_keyword_wins_over_its_environment_variable(monkeypatch):
    with zshard_servers.Shards(1) as shards:
        a = shards.addresses
        monkeypatch.setenv("ZSHARD_SCHEDULE", "bogus")
        monkeypatch.setenv("ZSHARD_SCHEDULE_WINDOW", "999")
        monkeypatch.setenv("ZSHARD_TCP_CONGESTION", "nosuchcc")
        with pytest.raises(zshard.Error, match="ZSHARD_SCHEDULE"):
            zshard.Client(a, tcp_congestion=other_congestion_control())
        zshard.Client(a, schedule="rotated", schedule_window=4,
                      tcp_congestion=other_congestion_control()).close()


def test_tcp_congestion_reaches_the_data_plane_sockets():
    cc = other_congestion_control()
    with zshard_servers.Shards(2) as shards:
        c = zshard.Client(shards.addresses, tcp_congestion=cc, data_connections=2,
                          push_dtype="fp32", pull_dtype="fp32")
        try:
            c.add_group("sgd")
            t = c.add_tensor("w", 256)
            w = array.array("f", [1.0] * 256)
            c.open_job([w])
            c.pull(t, w).wait()  # the data plane's connections are open now
            with_cc, total = sockets_of_this_process(cc)
        finally:
            c.close()
    # The gRPC channels keep the host's default; the data plane's two
    # connections to each of the two shards use cc.
    assert with_cc == 4, (with_cc, total)
    assert total > with_cc, (with_cc, total)


def paced_sockets_of_this_process(bps, pid=None):
    """(sockets whose pacing is capped at `bps` bits/s, all established TCP
    sockets) of this process or of `pid` (ss -tin: "pacing_rate
    <now>bps/<cap>bps")."""
    def capped(words):
        rate = words[words.index("pacing_rate") + 1] if "pacing_rate" in words else ""
        return rate.endswith("/%dbps" % bps)
    return sockets_of_this_process_where(capped, pid)


def test_tcp_pacing_reaches_the_data_plane_sockets_and_bad_rates_are_refused(monkeypatch):
    with zshard_servers.Shards(1) as shards:
        a = shards.addresses
        with pytest.raises(zshard.Error, match="tcp_pacing_mbit is 100001") as e:
            zshard.Client(a, tcp_pacing_mbit=100001)
        assert e.value.status == zshard.EINVAL
        with pytest.raises(OverflowError):
            zshard.Client(a, tcp_pacing_mbit=-1)
        monkeypatch.setenv("ZSHARD_TCP_PACING_MBIT", "fast")
        with pytest.raises(zshard.Error, match="ZSHARD_TCP_PACING_MBIT must be a whole number"):
            zshard.Client(a)
        # The keyword wins over the variable.
        c = zshard.Client(a, tcp_pacing_mbit=80, data_connections=2,
                          push_dtype="fp32", pull_dtype="fp32")
        try:
            c.add_group("sgd")
            t = c.add_tensor("w", 256)
            w = array.array("f", [1.0] * 256)
            c.open_job([w])
            c.pull(t, w).wait()
            paced, total = paced_sockets_of_this_process(80 * 1000 * 1000)
        finally:
            c.close()
    assert paced == 2, (paced, total)
    assert total > paced, (paced, total)


def test_link_pacing_shares_the_link_between_the_data_sockets_sending_and_keeps_the_bits(
        monkeypatch):
    """ZSHARD_TCP_LINK_MBIT on the client and --tcp-link-mbit on the servers
    (docs/CLIENT.md, docs/OPERATIONS.md): a data socket that sent a tensor
    piece is capped at L / n, n the sockets of its process sending at that
    moment: the client's two (one per shard) at L or L / 2, each server's
    one, answering the only trainer, at L. gRPC stays unpaced, bad values
    and fixed pacing with it are refused, and training keeps the unpaced
    bits."""
    L = 80
    with zshard_servers.Shards(1) as shards:
        monkeypatch.setenv("ZSHARD_TCP_LINK_MBIT", "fast")
        with pytest.raises(zshard.Error, match="ZSHARD_TCP_LINK_MBIT must be a whole number"):
            zshard.Client(shards.addresses)
        monkeypatch.setenv("ZSHARD_TCP_LINK_MBIT", str(L))
        with pytest.raises(zshard.Error, match="exclude each other") as e:
            zshard.Client(shards.addresses, tcp_pacing_mbit=20)
        assert e.value.status == zshard.EINVAL
        monkeypatch.setenv("ZSHARD_TCP_LINK_NOTSENT_LOWAT", "-1")
        with pytest.raises(zshard.Error, match="ZSHARD_TCP_LINK_NOTSENT_LOWAT"):
            zshard.Client(shards.addresses)
        monkeypatch.delenv("ZSHARD_TCP_LINK_NOTSENT_LOWAT")
    both = subprocess.run([os.environ["ZSHARD_SERVER_BIN"], "--tcp-link-mbit", "80",
                           "--tcp-pacing-mbit", "20"], capture_output=True, text=True)
    assert both.returncode != 0 and "exclude each other" in both.stderr, both

    n = 1 << 18  # 1 MiB of fp32, split over both shards: 512 KiB pieces
    with zshard_servers.Shards(2, extra_args=["--tcp-link-mbit", str(L)]) as shards:
        c = zshard.Client(shards.addresses, data_connections=1, split_threshold=4096,
                          push_dtype="fp32", pull_dtype="fp32")
        try:
            c.add_group("sgd")
            t = c.add_tensor("w", n)
            w = array.array("f", [1.0] * n)
            c.open_job([w])
            c.push(t, array.array("f", [0.5] * n)).wait()
            c.pull(t, w).wait()
            mine = [paced_sockets_of_this_process(L * 1000 * 1000 // k) for k in (1, 2)]
            theirs = [paced_sockets_of_this_process(L * 1000 * 1000, pid=p.pid)
                      for p in shards.procs]
        finally:
            c.close()
    assert mine[0][0] + mine[1][0] == 2, mine  # both data sockets, gRPC not
    assert mine[0][1] > 2, mine
    for paced, total in theirs:
        assert paced == 1 and total > 1, theirs

    monkeypatch.delenv("ZSHARD_TCP_LINK_MBIT")
    with zshard_servers.Shards(2) as shards:
        unpaced = train(shards.addresses)
    monkeypatch.setenv("ZSHARD_TCP_LINK_MBIT", "200")
    with zshard_servers.Shards(2, extra_args=["--tcp-link-mbit", "200"]) as shards:
        paced = train(shards.addresses)
    assert paced == unpaced
