"""Hostile clients on the data plane (raw sockets, docs/PROTOCOL.md):
unauthenticated pushes, oversized batches, connection floods from one
address, answers nobody reads, the 256-pending deadlock, a stalled reader of
the bf16 copy. One test per attack, named in its docstring (the harness is
tests/python/hostile.py). The attacker connects from 127.0.0.2, the
legitimate trainer from 127.0.0.1.

Run with Debian's interpreter: /usr/bin/python3 -m pytest tests/python/test_hostile_dataplane.py
"""

import resource
import socket
import struct


import hostile
from hostile import MiB, SERVER_RSS_CEILING, DataConn, Shard, stubs

ATTACKER, TRAINER = "127.0.0.2", "127.0.0.1"
# What the server may hold in copied Pull answers over all connections
# (dp_server_config.max_answer_bytes_total's default).
ANSWER_BUDGET = 1 << 30
ZS_ERANGE = -22
NUMELS = [1024, 16]


def _enough_fds(n):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, hard), hard))


def test_dataplane_push_before_real_rank_refused():
    """The attack "push as rank 1 before the real rank 1": on the data plane, a
    peer that has not authenticated gets no push in; the real rank 1's push
    is then new, not a duplicate."""
    pb = stubs().pb
    with Shard(tokens=True) as s:
        c = s.client()
        h = hostile.open_job(c, NUMELS, world_size=2)
        hostile.init_params(c, h, NUMELS)
        port = s.data_port()
        push = hostile.dp_push(h, 1, 0, struct.pack("<f", 1e30) * NUMELS[0], rank=1)
        bad = DataConn(port, ATTACKER, hello=False)
        try:
            bad.send(push)
            try:
                ftype, rid, meta, _ = bad.read_frame()
                assert ftype == hostile.ERROR, "the unauthenticated push was answered %d" % ftype
                assert bad.error(meta)[0] == hostile.ZS_EUNAUTHENTICATED, bad.error(meta)
            except hostile.Closed:
                pass  # closed unanswered: refused as well
        finally:
            bad.close()
        try:
            bad = DataConn(port, ATTACKER, token="guess")
            bad.send(push)
            ftype, _, meta, _ = bad.read_frame()
            bad.close()
            raise AssertionError("a wrong token was accepted; the push was answered %d" % ftype)
        except hostile.Refused as e:
            assert e.status == hostile.ZS_EUNAUTHENTICATED, e
        real = c.call("Push", pb.PushRequest(spec_hash=h, step=1, rank=1, micro=0, tensor=0,
                                             slice=0, dtype=pb.DTYPE_FP32,
                                             data=struct.pack("<f", 0.25) * NUMELS[0]))
        assert not real.duplicate, "the attacker's push took rank 1's place"
        good = DataConn(port, TRAINER, token=s.trainer)
        try:
            assert good.ping()
        finally:
            good.close()


def test_dataplane_unauthenticated_connection_closed():
    """The data plane closes a connection that has not authenticated within
    a few seconds, without processing anything it sent."""
    with Shard(tokens=True) as s:
        conn = DataConn(s.data_port(), ATTACKER, hello=False)
        try:
            assert conn.closed_within(), "an unauthenticated idle connection stayed open"
        finally:
            conn.close()


def test_push_batch_1gib_no_job_bounded():
    """The attack "PUSH_BATCH declaring 1 GiB, no job, bogus hash, 3 connections":
    refused before the payload is stored; 3 x 256 MiB of it sent leave the
    server's memory bounded."""
    d = stubs().dpb
    with Shard() as s:
        port = s.data_port()
        hostile.reset_peak(s.pid)
        pieces = [d.DataPiece(tensor=i, slice=0, dtype=stubs().pb.DTYPE_FP32, length=4 * MiB)
                  for i in range(256)]
        meta = d.DataPushBatch(spec_hash=0x1234, step=1, rank=0, micro=0,
                               pieces=pieces).SerializeToString()
        head = hostile.frame(hostile.PUSH_BATCH, 7, meta, payload_len=1 << 30)
        conns = [DataConn(port, ATTACKER) for _ in range(3)]
        chunk = bytes(4 * MiB)
        try:
            for conn in conns:
                conn.send(head)
            live = list(conns)
            for _ in range(64):
                for conn in list(live):
                    try:
                        conn.send(chunk, seconds=5)
                    except (OSError, socket.timeout):
                        live.remove(conn)  # the server closed or stopped reading: fine
            peak = hostile.settle(s.pid)
            assert peak < SERVER_RSS_CEILING, "%d MiB resident" % (peak // MiB)
        finally:
            for conn in conns:
                conn.close()


def test_idle_connections_from_one_address_leave_trainer_working():
    """The attack "1100 idle data-plane connections": one address's flood does not
    lock the trainers out."""
    _enough_fds(4000)
    with Shard() as s:
        c = s.client()
        h = hostile.open_job(c, NUMELS)
        hostile.init_params(c, h, NUMELS)
        port = s.data_port()
        flood = []
        try:
            for _ in range(1100):
                try:
                    flood.append(DataConn(port, ATTACKER))
                except (OSError, hostile.Closed, hostile.Refused):
                    pass  # refused by a cap: what a cap does
            good = DataConn(port, TRAINER)
            try:
                assert good.ping(), "the trainer's PING was not answered"
                good.send(hostile.dp_pull(h, 0, 0, 2))
                ftype, rid, _, payload = good.read_frame()
                assert (ftype, rid, len(payload)) == (hostile.PULL_DATA, 2, 4 * NUMELS[0])
            except hostile.Closed:
                raise AssertionError("the trainer's connection was closed: locked out")
            finally:
                good.close()
        finally:
            for conn in flood:
                conn.close()


def test_pulls_far_ahead_then_close_leave_trainer_working():
    """The attack "1100 x (connect, Pull far ahead, close)": a closed peer's waiting
    Pull no longer holds its slot; the trainer gets in."""
    _enough_fds(4000)
    with Shard() as s:
        c = s.client()
        h = hostile.open_job(c, NUMELS)
        hostile.init_params(c, h, NUMELS)
        port = s.data_port()
        pull = hostile.dp_pull(h, 0, 10**9, 1)
        for _ in range(1100):
            try:
                conn = DataConn(port, ATTACKER)
            except (OSError, hostile.Closed, hostile.Refused):
                continue  # refused by a cap: what a cap does
            try:
                conn.send(pull)
            except OSError:
                pass
            conn.close()
        good = DataConn(port, TRAINER)
        try:
            assert good.ping(), "the trainer's PING was not answered"
        except hostile.Closed:
            raise AssertionError("the trainer's connection was closed: locked out")
        finally:
            good.close()


def _big_job(c, numel):
    h = hostile.open_job(c, [numel])
    hostile.init_params(c, h, [numel])
    return h


def test_unread_fp32_pulls_bounded():
    """The attack "a client that stops reading 64 MiB fp32 Pulls": the answers the
    server holds for peers that do not read stay within the whole-server
    budget (ANSWER_BUDGET), however many connections the attacker opens (50
    here, each asking for 8 x 8 MiB), and the trainer's own Pull is still
    answered meanwhile (or refused by the budget, clearly)."""
    numel = 2 * MiB  # 8 MiB of fp32
    with Shard() as s:
        c = s.client()
        h = _big_job(c, numel)
        port = s.data_port()
        hostile.reset_peak(s.pid)
        conns = []
        try:
            for _ in range(50):
                conn = DataConn(port, ATTACKER, rcvbuf=4096)
                conns.append(conn)
                conn.send(b"".join(hostile.dp_pull(h, 0, 0, i + 1) for i in range(8)))
            ceiling = SERVER_RSS_CEILING + ANSWER_BUDGET
            peak = hostile.settle(s.pid, ceiling=ceiling)
            assert peak < ceiling, "%d MiB resident" % (peak // MiB)
            # The trainer is answered: its piece, or a clear refusal by a
            # budget (ZS_ELIMIT), not a wait for the attacker to go away.
            good = DataConn(port, TRAINER)
            try:
                good.send(hostile.dp_pull(h, 0, 0, 1))
                ftype, _, meta, payload = good.read_frame()
                if ftype == hostile.ERROR:
                    assert good.error(meta)[0] == hostile.ZS_ELIMIT, good.error(meta)
                else:
                    assert (ftype, len(payload)) == (hostile.PULL_DATA, 4 * numel), ftype
            finally:
                good.close()
        finally:
            for conn in conns:
                conn.close()


def test_pull_batch_1gib_bounded():
    """The attack "a 1 GiB PULL_BATCH" nobody reads: refused or bounded, not a
    1 GiB answer buffer per request."""
    d, pb = stubs().dpb, stubs().pb
    numel = 2 * MiB  # 8 MiB of fp32; 128 of them make 1 GiB
    with Shard() as s:
        c = s.client()
        h = _big_job(c, numel)
        conn = DataConn(s.data_port(), ATTACKER, rcvbuf=4096)
        try:
            hostile.reset_peak(s.pid)
            pieces = [d.DataPiece(tensor=0, slice=0, dtype=pb.DTYPE_FP32, length=4 * numel)] * 128
            meta = d.DataPullBatch(spec_hash=h, min_version=0, pieces=pieces).SerializeToString()
            conn.send(hostile.frame(hostile.PULL_BATCH, 1, meta) +
                      hostile.frame(hostile.PULL_BATCH, 2, meta))
            peak = hostile.settle(s.pid)
            assert peak < SERVER_RSS_CEILING, "%d MiB resident" % (peak // MiB)
            ftype, rid, meta, _ = conn.read_frame()
            assert (ftype, rid) == (hostile.ERROR, 1), (ftype, rid)
            assert conn.error(meta)[0] == hostile.ZS_ELIMIT, conn.error(meta)
        finally:
            conn.close()


def test_300_pulls_then_push_on_one_connection_no_deadlock():
    """The attack "300 Pulls waiting on one data-plane connection, then the Push
    they wait for": the push is read and acknowledged, the step applies and
    every Pull is answered."""
    pb = stubs().pb
    numels = [256]
    with Shard() as s:
        c = s.client()
        h = hostile.open_job(c, numels)
        hostile.init_params(c, h, numels)
        conn = DataConn(s.data_port(), TRAINER)
        try:
            conn.send(b"".join(hostile.dp_pull(h, 0, 1, i + 1, timeout_ms=60000)
                               for i in range(300)))
            # Every Pull the server reads waits. An answered request (a
            # PING) makes it look at its bound of 256 requests in progress,
            # which waiting Pulls must not count against (PROTOCOL.md).
            hostile.wait_for(lambda: hostile.waiting_pulls(c) >= 300, seconds=5)
            assert conn.ping(999)
            conn.send(hostile.dp_push(h, 1, 0, struct.pack("<f", 0.25) * numels[0],
                                      request_id=1000))
            ftype, rid, meta, _ = conn.read_frame()
            assert (ftype, rid) == (hostile.PUSH_ACK, 1000), (ftype, rid, meta)
            hostile.grad_stats(c, h, 1)
            c.call("Apply", pb.ApplyRequest(spec_hash=h, step=1, lr=1e-3, coef=1.0))
            got = set()
            for _ in range(300):
                ftype, rid, _, payload = conn.read_frame()
                assert ftype == hostile.PULL_DATA and len(payload) == 4 * numels[0], (ftype, rid)
                got.add(rid)
            assert got == set(range(1, 301))
        finally:
            conn.close()


def test_stalled_bf16_reader_does_not_hold_the_state_lock():
    """The attack "one peer that stalls reading the bf16 copy": while an Apply
    deals with the stalled peer's pinned answer, a Pull of the current
    version is not held back behind it (the apply does not wait with the
    state lock held)."""
    pb = stubs().pb
    numel = MiB  # 2 MiB of bf16 per answer
    with Shard() as s:
        c = s.client()
        h = _big_job(c, numel)
        stalled = DataConn(s.data_port(), ATTACKER, rcvbuf=4096)
        try:
            served = c.call("Stats", pb.StatsRequest()).pulls
            stalled.send(b"".join(hostile.dp_pull(h, 0, 0, i + 1, dtype=pb.DTYPE_BF16)
                                  for i in range(8)))
            assert hostile.wait_for(lambda: c.call("Stats", pb.StatsRequest()).pulls > served)
            for k in range(1, 4):
                hostile.push_all(c, h, k, [numel])
                hostile.grad_stats(c, h, k)
                apply = c.future("Apply", pb.ApplyRequest(spec_hash=h, step=k, lr=1e-3, coef=1.0))
                # Give the apply the time to reach the pinned piece; if it is
                # done by then, it did not wait at all, which is fine too.
                hostile.wait_for(apply.done, seconds=0.5)
                if apply.done():
                    apply.result()
                    continue
                order = []
                apply.add_done_callback(lambda _: order.append("apply"))
                read = c.future("Pull", pb.PullRequest(spec_hash=h, tensor=0, slice=0,
                                                       min_version=k - 1, dtype=pb.DTYPE_FP32))
                read.add_done_callback(lambda _: order.append("pull"))
                read.result(timeout=hostile.OUTCOME_SECONDS)
                apply.result(timeout=hostile.OUTCOME_SECONDS)
                assert order[0] == "pull", "step %d: the Pull waited for the Apply (%s)" % (
                    k, order)
        finally:
            stalled.close()


class _Flood:
    """Strangers that connect and never say HELLO, from `addresses`, `per`
    connections each, reconnecting whatever the server closes (as the
    issue's attacker did every 4.5 s) until stopped."""

    def __init__(self, port, addresses, per):
        self.port, self.addresses, self.per = port, addresses, per
        self.socks = {a: [] for a in addresses}
        self.connects = 0

    def _connect(self, address):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(True)
        s.settimeout(2)
        try:
            s.bind((address, 0))
            s.connect(("127.0.0.1", self.port))
            s.setblocking(False)
            self.connects += 1
            return s
        except OSError:
            s.close()
            return None

    def refill(self):
        """Drops the connections the server closed and opens new ones up to
        `per` per address."""
        for a, socks in self.socks.items():
            alive = []
            for s in socks:
                try:
                    if s.recv(1 << 16) == b"":
                        s.close()
                        continue
                    # An ERROR frame (evicted or refused): the close follows.
                    s.close()
                    continue
                except BlockingIOError:
                    alive.append(s)
                except OSError:
                    s.close()
            while len(alive) < self.per:
                s = self._connect(a)
                if s is None:
                    break
                alive.append(s)
            self.socks[a] = alive

    def open_count(self):
        return sum(len(v) for v in self.socks.values())

    def close(self):
        for socks in self.socks.values():
            for s in socks:
                s.close()


def test_unauthenticated_flood_from_20_addresses_leaves_trainer_working():
    """20 loopback addresses x 24 connections that never
    say HELLO, held open and refilled as the server closes them. Before, the
    first 128 filled the server's budget of unauthenticated connections and
    every trainer connection after them was refused. Now each address holds
    at most its share, a newer connection evicts the oldest stranger, and a
    trainer connecting in the middle of the flood authenticates and pushes."""
    _enough_fds(4000)
    numels = [1024]
    with Shard(tokens=True) as s:
        c = s.client()
        h = hostile.open_job(c, numels)
        hostile.init_params(c, h, numels)
        port = s.data_port()
        flood = _Flood(port, ["127.0.0.%d" % i for i in range(2, 22)], 24)
        try:
            flood.refill()
            flood.refill()
            # The flood is in place: at least the old budget's worth of
            # strangers were accepted (the rest were refused or evicted).
            assert flood.connects >= 128, flood.connects
            outcomes = []
            for attempt in range(5):
                flood.refill()
                try:
                    good = DataConn(port, TRAINER, token=s.trainer)
                except (hostile.Refused, hostile.Closed, OSError) as e:
                    outcomes.append(repr(e))
                    continue
                try:
                    good.send(hostile.dp_push(h, 1, 0, struct.pack("<f", 0.5) * numels[0],
                                              request_id=7))
                    ftype, rid, meta, _ = good.read_frame()
                    if ftype == hostile.ERROR:
                        outcomes.append(good.error(meta))
                        continue
                    assert (ftype, rid) == (hostile.PUSH_ACK, 7), (ftype, rid)
                    break
                except hostile.Closed as e:
                    outcomes.append(repr(e))
                finally:
                    good.close()
            else:
                raise AssertionError("the trainer was locked out by the flood: %s" % outcomes)
            # The trainer's first try is the expected one; retries only
            # absorb a connection accepted in the same instant as >128 others.
            assert len(outcomes) <= 1, outcomes
        finally:
            flood.close()


def test_full_pull_budget_never_refuses_a_pull_answerable_now():
    """On the data plane, a connection parks its whole
    budget (4096) of Pulls of the next version; a Pull of the current
    version on the same connection is answered (before: refused, "4096
    pulls already wait"), and a Pull more than two versions ahead is refused
    at once with ZS_ERANGE."""
    with Shard(tokens=True) as s:
        c = s.client()
        h = hostile.open_job(c, NUMELS)
        hostile.init_params(c, h, NUMELS)
        conn = DataConn(s.data_port(), TRAINER, token=s.trainer)
        try:
            conn.send(hostile.dp_pull(h, 0, 10**9, 1))
            ftype, rid, meta, _ = conn.read_frame()
            assert (ftype, rid) == (hostile.ERROR, 1), (ftype, rid)
            status, message = conn.error(meta)
            assert status == ZS_ERANGE and "at most 2 versions past" in message, (status, message)
            budget = 4096
            conn.send(b"".join(hostile.dp_pull(h, 0, 1, 100 + i) for i in range(budget)))
            assert hostile.wait_for(lambda: hostile.waiting_pulls(c) >= budget)
            conn.send(hostile.dp_pull(h, 0, 1, 2))  # would wait: over the budget
            conn.send(hostile.dp_pull(h, 0, 0, 3))  # answerable now
            seen = {}
            while len(seen) < 2:
                ftype, rid, meta, payload = conn.read_frame()
                seen[rid] = (ftype, conn.error(meta)[0] if ftype == hostile.ERROR else len(payload))
            assert seen[2] == (hostile.ERROR, hostile.ZS_ELIMIT), seen
            assert seen[3] == (hostile.PULL_DATA, 4 * NUMELS[0]), seen
        finally:
            conn.close()


def test_connections_of_a_rotated_token_are_closed_after_sighup():
    """The trainer token is rotated (file rewritten, then
    SIGHUP). A data-plane connection that authenticated with the old token
    is told and closed within a bounded time (before: it kept pushing and
    pulling indefinitely); one authenticated with the admin token, which did
    not change, keeps working; the new token gets in, the old one does not."""
    import os
    import signal
    with Shard(tokens=True) as s:
        c = s.client()
        h = hostile.open_job(c, NUMELS)
        hostile.init_params(c, h, NUMELS)
        port = s.data_port()
        old = DataConn(port, TRAINER, token=s.trainer)
        admin = DataConn(port, TRAINER, token=s.admin)
        try:
            assert old.ping() and admin.ping()
            new_token = "trainer-" + os.urandom(16).hex()
            path = os.path.join(s.tmp, "token-file")
            with open(path + ".new", "w") as f:
                f.write(new_token + "\n")
            os.chmod(path + ".new", 0o600)
            os.rename(path + ".new", path)
            os.kill(s.pid, signal.SIGHUP)
            # The old connection gets an ERROR (UNAUTHENTICATED) and is
            # closed; frames it is sent meanwhile are not served.
            ftype, rid, meta, _ = old.read_frame(seconds=hostile.OUTCOME_SECONDS)
            assert ftype == hostile.ERROR, ftype
            status, message = old.error(meta)
            assert status == hostile.ZS_EUNAUTHENTICATED and "no longer accepted" in message, \
                (status, message)
            assert old.closed_within(), "the connection of a revoked token stayed open"
            assert admin.ping(), "the admin's connection was closed though its token is unchanged"
            fresh = DataConn(port, TRAINER, token=new_token)
            try:
                assert fresh.ping()
            finally:
                fresh.close()
            try:
                DataConn(port, TRAINER, token=s.trainer).close()
                raise AssertionError("the old token still opens a connection")
            except hostile.Refused as e:
                assert e.status == hostile.ZS_EUNAUTHENTICATED
        finally:
            old.close()
            admin.close()
