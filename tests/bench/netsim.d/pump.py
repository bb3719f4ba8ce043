"""A raw TCP pump across the emulated links: their real limit.

    pump.py recv HOST PORT SECONDS [CONNS]  accepts CONNS connections (default
                                            1), drains them all at once, prints
                                            {"bytes", "first", "last"} as JSON
    pump.py send PORT BYTES SECONDS HOST [HOST...]
                                            sends BYTES to each HOST at once,
                                            one connection each, and closes

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


def send_one(host, port, nbytes, seconds, errors):
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
        buf = memoryview(bytes(CHUNK))
        left = nbytes
        while left > 0:
            left -= s.send(buf[:min(left, CHUNK)])
        s.shutdown(socket.SHUT_WR)
        s.close()
    except OSError as e:
        errors.append("%s: %s" % (host, e))


def send(port, nbytes, seconds, hosts):
    errors = []
    threads = [threading.Thread(target=send_one, args=(h, port, nbytes, seconds, errors), daemon=True)
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
        send(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5:])
