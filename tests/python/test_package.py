"""The zshard module's constants match the C vocabulary (include/zshard/types.h)."""
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()
import zshard  # noqa: E402

SRC = os.environ.get("ZS_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))


def status_list():
    with open(os.path.join(SRC, "include", "zshard", "types.h")) as f:
        text = f.read()
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"XX\((\w+), (-?\d+),", text)}


def test_status_holds_every_status_code_and_nothing_else():
    want = status_list()
    assert len(want) >= 28
    assert zshard.STATUS == want
    assert "EXP_AVG" not in zshard.STATUS and "EXP_AVG_SQ" not in zshard.STATUS


def test_every_status_code_has_its_name_and_sentence():
    for name, value in zshard.STATUS.items():
        assert getattr(zshard, name) == value
        assert zshard.err_name(value) == "ZS_" + name
        assert zshard.strerror(value)


def test_a_failed_request_dropped_unwaited_warns_with_a_hint():
    import array
    import gc
    import warnings

    with zshard_servers.Shards(1) as shards:
        c = zshard.Client(",".join(shards.addresses) if isinstance(shards.addresses, list)
                          else shards.addresses, max_retries=0, rpc_timeout_ms=2000,
                          transport="grpc")
        c.add_group("sgd")
        t = c.add_tensor("w", 64)
        w = array.array("f", [1.0] * 64)
        c.open_job([w])
        shards.kill(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            r = c.pull(t, w)
            del r
            gc.collect()
        c.close()
    msgs = [str(x.message) for x in caught if issubclass(x.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert "a pull of tensor 0 dropped without wait() failed: ZS_ECONN" in msgs[0]
    assert "wait() every Request" in msgs[0]


def test_transfer_arguments_positional_keyword_and_bad_ones_alike():
    """push / pull / push_many / pull_many take their ints positionally
    (the fast path zshard.torch uses) or by keyword, dtypes also by name,
    and refuse a bad int or type the same way on either path, submitting
    nothing."""
    import array

    with zshard_servers.Shards(1) as shards:
        c = zshard.Client(shards.addresses, push_dtype="fp32", pull_dtype="fp32")
        c.add_group("sgd")
        t0, t1 = c.add_tensor("a", 16), c.add_tensor("b", 16)
        w = [array.array("f", [1.0] * 16), array.array("f", [2.0] * 16)]
        c.open_job(w)
        g = array.array("f", [0.5] * 16)
        for r in c.push_many([t0, t1], [g, g], 0, zshard.FP32):
            r.wait()
        with pytest.raises(OverflowError):
            c.push_many([t0, t1], [g, g], 0, 1 << 40)
        with pytest.raises(TypeError):
            c.push_many([t0, t1], [g, g], 0.0)
        with pytest.raises(TypeError):
            c.push("a", g)
        with pytest.raises(zshard.Error):  # already pushed: the refusals above submitted nothing
            c.push(t0, g, micro=0, dtype="fp32").wait()
        c.step(lr=1.0)
        got = [array.array("f", [0.0] * 16) for _ in range(2)]
        for r in c.pull_many([t0, t1], got, zshard.FP32):
            r.wait()
        assert list(got[0]) == [0.5] * 16 and list(got[1]) == [1.5] * 16
        again = array.array("f", [0.0] * 16)
        c.pull(t1, again, "fp32").wait()
        assert list(again) == [1.5] * 16
        c.pull_many(tensors=[t0], buffers=[again], dtype="fp32")[0].wait()
        assert list(again) == [0.5] * 16
        c.close()
