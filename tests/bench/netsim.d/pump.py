"""A raw TCP pump across the emulated link: the link's real limit.

    pump.py recv HOST PORT SECONDS        accepts one connection, drains it,
                                          prints {"bytes", "seconds"} as JSON
    pump.py send HOST PORT BYTES SECONDS  connects, sends BYTES, closes

The receiver times from the first byte to the end of the stream, so that
connection set-up is not counted; both sides give up after SECONDS.
"""
import json
import socket
import sys
import time

CHUNK = 1 << 20


def recv(host, port, seconds):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(1)
    srv.settimeout(seconds)
    conn, _ = srv.accept()
    conn.settimeout(seconds)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total, t0 = 0, None
    while True:
        n = conn.recv_into(view)
        if n == 0:
            break
        if t0 is None:
            t0 = time.monotonic()
        total += n
    t1 = time.monotonic()
    print(json.dumps({"bytes": total, "seconds": t1 - (t0 or t1)}), flush=True)


def send(host, port, nbytes, seconds):
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


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        recv(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
