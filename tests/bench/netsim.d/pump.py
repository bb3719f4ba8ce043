"""A raw TCP pump across the emulated links: their real limit.

    pump.py recv HOST PORT SECONDS [CONNS]  accepts CONNS connections (default
                                            1), drains them all at once, prints
                                            {"bytes", "first", "last"} as JSON
    pump.py send [--pacing MBIT | --link MBIT [--lowat BYTES]] [--sequential] PORT BYTES SECONDS HOST [HOST...]
                                            sends BYTES to each HOST at once,
                                            one connection each, and closes;
                                            --pacing caps each connection at
                                            MBIT Mbit/s (SO_MAX_PACING_RATE, as
                                            zshard's --tcp-pacing-mbit does);
                                            --link paces each connection that
                                            is sending at MBIT / n, n the
                                            connections sending now, as
                                            zshard's --tcp-link-mbit does
                                            (each socket's TCP_NOTSENT_LOWAT
                                            --lowat, default 131072, 0: the
                                            kernel's);
                                            --sequential sends to the HOSTs one
                                            after another, in the order given,
                                            each stream closed before the next
                                            connection opens, once the receiver
                                            has read all of it (a rotated
                                            schedule's pattern)

The receiver's times (time.time(), one clock for every namespace on the
machine) run from its first byte to the end of its last stream, so that
connection set-up is not counted; every side gives up after SECONDS.
"""
import json
import socket
import sys
import threading
import time

CHUNK = 1 << 20
# socket.SO_MAX_PACING_RATE is missing from some Pythons; Linux's number.
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)


class Link:
    """zshard's link pacing (common/net/stream_pace.c) for this process's
    streams: each one sending is paced at link / n, set again on every
    socket whose rate changes when a stream starts or stops; the kernel
    holds at most 128 KiB unsent per socket (TCP_NOTSENT_LOWAT), so that a
    stream stops when its bytes have (nearly) left."""

    def __init__(self, mbit, lowat=128 << 10):
        self.rate, self.lock, self.rates = mbit * 125000, threading.Lock(), {}
        self.lowat = lowat

    def _repace(self):
        if self.rates:
            rate = self.rate // len(self.rates)
            for s, r in list(self.rates.items()):
                if r != rate:
                    s.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, rate)
                    self.rates[s] = rate

    def start(self, s):
        if self.lowat:
            s.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, self.lowat)
        with self.lock:
            self.rates[s] = 0
            self._repace()

    def stop(self, s):
        with self.lock:
            self.rates.pop(s, None)
            self._repace()


def drain(conn, seconds, out):
    conn.settimeout(seconds)
    view = memoryview(bytearray(CHUNK))
    total, first = 0, None
    while True:
        n = conn.recv_into(view)
        if n == 0:
            break
        if first is None:
            first = time.time()
        total += n
    out.append((total, first, time.time()))
    conn.close()


def recv(host, port, seconds, conns):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(conns)
    srv.settimeout(seconds)
    got, threads = [], []
    for _ in range(conns):
        conn, _ = srv.accept()
        t = threading.Thread(target=drain, args=(conn, seconds, got), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(seconds)
    if len(got) != conns:
        sys.exit("pump: %d of %d streams did not end in time" % (conns - len(got), conns))
    firsts = [g[1] for g in got if g[1] is not None]
    print(json.dumps({"bytes": sum(g[0] for g in got), "first": min(firsts),
                      "last": max(g[2] for g in got)}), flush=True)


def send_one(host, port, nbytes, seconds, errors, pacing=0, wait_end=False, link=None):
    try:
        deadline = time.monotonic() + seconds
        while True:
            try:
                s = socket.create_connection((host, port), timeout=seconds)
                break
            except OSError:
                # The receiver may not listen yet.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        if pacing:
            # Bytes per second; Linux's TCP paces by itself once it is set.
            s.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, pacing * 125000)
        if link:
            link.start(s)
        buf = memoryview(bytes(CHUNK))
        left = nbytes
        while left > 0:
            left -= s.send(buf[:min(left, CHUNK)])
        if link:
            link.stop(s)
        s.shutdown(socket.SHUT_WR)
        if wait_end:
            # The receiver closes once it has read everything: the stream
            # is over on the wire, not only in this socket's buffer.
            s.recv(1)
        s.close()
    except OSError as e:
        errors.append("%s: %s" % (host, e))


def send_all(port, nbytes, seconds, hosts, errors, pacing, link=None):
    """One stream after another, each to its end, in the order of hosts."""
    deadline = time.monotonic() + seconds
    for h in hosts:
        send_one(h, port, nbytes, max(1.0, deadline - time.monotonic()), errors, pacing, True,
                 link)
        if errors:
            return


def send(port, nbytes, seconds, hosts, pacing=0, sequential=False, link_mbit=0,
         lowat=128 << 10):
    errors = []
    link = Link(link_mbit, lowat) if link_mbit else None
    if sequential:
        threads = [threading.Thread(target=send_all,
                                    args=(port, nbytes, seconds, hosts, errors, pacing, link),
                                    daemon=True)]
    else:
        threads = [threading.Thread(target=send_one,
                                    args=(h, port, nbytes, seconds, errors, pacing, False,
                                          link), daemon=True)
                   for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds)
    if errors or any(t.is_alive() for t in threads):
        sys.exit("pump: sending failed: %s" % ("; ".join(errors) or "not done in time"))


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        recv(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]),
             int(sys.argv[5]) if len(sys.argv) > 5 else 1)
    else:
        argv, pacing, sequential, link, lowat = sys.argv[2:], 0, False, 0, 128 << 10
        while argv[0].startswith("--"):
            opt = argv.pop(0)
            if opt == "--pacing":
                pacing = int(argv.pop(0))
            elif opt == "--link":
                link = int(argv.pop(0))
            elif opt == "--lowat":
                lowat = int(argv.pop(0))
            elif opt == "--sequential":
                sequential = True
            else:
                sys.exit("pump: unknown option %s" % opt)
        send(int(argv[0]), int(argv[1]), float(argv[2]), argv[3:], pacing, sequential, link,
             lowat)
