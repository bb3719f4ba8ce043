"""zshard: the trainer's client library (libzshard) in Python.

    import zshard
    c = zshard.Client("127.0.0.1:7070,127.0.0.1:7071", push_dtype="bf16", pull_dtype="bf16")
    c.add_group("adamw", weight_decay=0.01)
    w = c.add_tensor("w", 1024, shape=(32, 32))
    c.open_job([weights])                    # rank 0: one fp32 buffer per tensor
    c.pull(w, param).wait()                  # any writable buffer, no copy
    c.push(w, grad).wait()                   # any buffer, no copy
    r = c.step(lr=1e-3)                      # a StepResult, r.timing a Timing
    c.state_read(w, zshard.EXP_AVG, moment)  # optimizer state, fp32, between steps
    c.optimizer_steps()                      # applied steps (torch's state 'step')

Every failure raises zshard.Error, whose message is libzshard's
zs_last_error() text and whose .status / .name are the zs_status. Blocking
calls release the GIL. A Request holds its buffer until wait(); dropping an
unwaited Request waits for it. PyTorch integration: zshard.torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Union

from . import _zshard
from ._zshard import (  # noqa: F401
    ADAM, ADAMW, BF16, EXP_AVG, EXP_AVG_SQ, FP16, FP32, INT8_BLOCK, LION, LOSS_SCALE_DYNAMIC, LOSS_SCALE_NONE,
    LOSS_SCALE_STATIC, MASTER, OPEN_CREATE, OPEN_EITHER, OPEN_JOIN, OPEN_RESUME, REDUCE_MEAN, REDUCE_SUM,
    SCHEDULE_DEFAULT, SCHEDULE_FIFO, SCHEDULE_ROTATED, SGD, TRANSPORT_DATA, TRANSPORT_DEFAULT,
    TRANSPORT_GRPC, Error, Request, StepResult, Timing, dtype_size,
    err_name, strerror, version)
# The status codes, named so that a type checker sees them (_zshard/status.c
# adds them from ZS_STATUS_MAP; STATUS below collects the same names at run time).
from ._zshard import (  # noqa: F401
    OK, EINVAL, ENOMEM, ENOTFOUND, EHASH, ESTEP, ESIZE, EDTYPE, ETIMEDOUT, ECONN, EPROTO, ECRC, ECLOSED,
    EEXIST, ENOTOPEN, ENOTREADY, ENONFINITE, EIO, EINTERNAL, EUNIMPL, EBEHIND, ECANCELED, ERANGE,
    EUNAUTHENTICATED, EPERM, ELIMIT, ENOTPRIMARY, ESTALE, ELEFT)

if TYPE_CHECKING:
    from ._zshard import _Buffer

__all__ = [
    "Client", "STATUS", "ADAM", "ADAMW", "BF16", "EXP_AVG", "EXP_AVG_SQ", "FP16", "FP32", "INT8_BLOCK",
    "LION", "LOSS_SCALE_DYNAMIC", "LOSS_SCALE_NONE", "LOSS_SCALE_STATIC", "MASTER", "OPEN_CREATE",
    "OPEN_EITHER", "OPEN_JOIN", "OPEN_RESUME", "REDUCE_MEAN", "REDUCE_SUM", "SCHEDULE_DEFAULT", "SCHEDULE_FIFO",
    "SCHEDULE_ROTATED", "SGD", "TRANSPORT_DATA", "TRANSPORT_DEFAULT",
    "TRANSPORT_GRPC", "Error", "Request", "StepResult", "Timing", "dtype_size", "err_name", "strerror",
    "version", "OK", "EINVAL", "ENOMEM", "ENOTFOUND", "EHASH", "ESTEP", "ESIZE", "EDTYPE", "ETIMEDOUT",
    "ECONN", "EPROTO", "ECRC", "ECLOSED", "EEXIST", "ENOTOPEN", "ENOTREADY", "ENONFINITE", "EIO", "EINTERNAL",
    "EUNIMPL", "EBEHIND", "ECANCELED", "ERANGE", "EUNAUTHENTICATED", "EPERM", "ELIMIT", "ENOTPRIMARY",
    "ESTALE", "ELEFT",
]

# Every status code as a constant: zshard.EINVAL == -1 ... Status codes are
# 0 and below; EXP_AVG and EXP_AVG_SQ (state arrays) also start with E.
STATUS: Dict[str, int] = {
    name: getattr(_zshard, name) for name in dir(_zshard)
    if name.isupper() and (name == "OK" or name.startswith("E"))
    and isinstance(getattr(_zshard, name), int) and getattr(_zshard, name) <= 0}
globals().update(STATUS)

_ENUMS: Dict[str, Dict[str, int]] = {
    "param_dtype": {"fp32": FP32, "fp16": FP16, "bf16": BF16},
    "push_dtype": {"fp32": FP32, "fp16": FP16, "bf16": BF16, "int8": INT8_BLOCK},
    "pull_dtype": {"fp32": FP32, "fp16": FP16, "bf16": BF16, "int8": INT8_BLOCK},
    "grad_reduce": {"mean": REDUCE_MEAN, "sum": REDUCE_SUM},
    "loss_scaling": {"none": LOSS_SCALE_NONE, "static": LOSS_SCALE_STATIC,
                     "dynamic": LOSS_SCALE_DYNAMIC},
    "transport": {"default": TRANSPORT_DEFAULT, "data": TRANSPORT_DATA, "grpc": TRANSPORT_GRPC},
    "schedule": {"default": SCHEDULE_DEFAULT, "fifo": SCHEDULE_FIFO, "rotated": SCHEDULE_ROTATED},
    "open_mode": {"either": OPEN_EITHER, "create": OPEN_CREATE, "resume": OPEN_RESUME,
                  "join": OPEN_JOIN},
    "optimizer": {"adamw": ADAMW, "adam": ADAM, "sgd": SGD, "lion": LION},
    "dtype": {"fp32": FP32, "fp16": FP16, "bf16": BF16},
}


def _enum(key: str, value: Any) -> Any:
    names = _ENUMS.get(key)
    if names is None or not isinstance(value, str):
        return value
    try:
        return names[value.lower()]
    except KeyError:
        raise ValueError("%s: %r is not one of %s" % (key, value, ", ".join(names))) from None


class Client(_zshard.Client):
    """Client(addresses, **options): one trainer's connection to the shards of
    one job. Options are the fields of zs_client_options (num_shards, rank,
    world_size, grad_accum, job, grad_reduce, param_dtype, split_threshold,
    push_dtype, pull_dtype, threads, reduce_bucket_size, allgather_bucket_size,
    prefetch_depth, rpc_timeout_ms, step_timeout_ms, max_retries,
    retry_initial_ms, retry_max_ms, loss_scaling, static_loss_scale, transport,
    data_connections, checkpoint_every, checkpoint_timeout_ms, open_mode,
    error_feedback, pipelined, failover_ms, schedule, schedule_window,
    tcp_congestion, trainer_timeout_ms, tcp_pacing_mbit, and token, tls_ca, tls_cert, tls_key, tls_server_name for
    the C fields token, tls_ca_file, tls_cert_file, tls_key_file,
    tls_server_name) plus the dynamic
    loss scaler's initial_loss_scale, min_loss_scale, loss_scale_factor,
    loss_scale_window and hysteresis; enums also by name ("bf16", "sum", ...).
    Unset options keep zs_client_options_init's defaults.

    A replicated shard lists its replica set's members separated by "|"
    ("h0a:7070|h0b:7070,h1a:7070|h1b:7070"); failover_ms (default the
    environment's ZSHARD_FAILOVER_MS, else 3000) is how long its primary may
    fail to answer before the client promotes another member
    (docs/CLIENT.md, "Replica sets and failover").

    Traffic (docs/CLIENT.md, "Traffic schedules"): schedule= "fifo" or
    "rotated" (default the environment's ZSHARD_SCHEDULE, else "fifo"),
    schedule_window= the rotated schedule's pushes and pulls in flight, 1 to
    64 (default ZSHARD_SCHEDULE_WINDOW, else 2), tcp_congestion= the TCP
    congestion control of the data-plane sockets, e.g. "cubic" (default
    ZSHARD_TCP_CONGESTION, else the host's), tcp_pacing_mbit= a cap on each
    data-plane socket's send rate in Mbit/s, 1 to 100000 (SO_MAX_PACING_RATE;
    default ZSHARD_TCP_PACING_MBIT, else no pacing). A keyword wins over its
    variable; a bad value raises ValueError (an unknown schedule name),
    OverflowError (a negative window or rate) or zshard.Error EINVAL (a window
    over 64, a congestion control the kernel lacks or refuses, a rate over
    100000).

    open_mode says what open_job() may find on the shards: "either" (default:
    create the job, or resume the same model where the shards left it,
    ignoring the initial weights), "create" (a new run: zshard.Error EEXIST
    if the shards hold another job or this one already trained) or "resume"
    (zshard.Error ENOTOPEN if a shard holds no job), or "join" (a new or
    restarted trainer of an elastic job, docs/CLIENT.md "Elastic trainers":
    the job must be on the shards, rank 0 passes no initial weights, and the
    rank is admitted at the next step boundary; close() leaves it cleanly).


    Security (docs/CLIENT.md): token= is the shards' token (default the
    environment's ZSHARD_TOKEN, else the file ZSHARD_TOKEN_FILE names);
    tls_ca= a PEM CA bundle that turns TLS on, tls_cert= and tls_key= this
    client's certificate for mTLS, tls_server_name= the name the shards'
    certificates carry (defaults ZSHARD_TLS_CA, _CERT, _KEY, _SERVER_NAME).
    Paths may be str or os.PathLike."""

    def __init__(self, addresses: str, **options: Any) -> None:
        for k in ("tls_ca", "tls_cert", "tls_key"):
            if options.get(k) is not None:
                options[k] = os.fspath(options[k])
        super().__init__(addresses, **{k: _enum(k, v) for k, v in options.items()})

    def add_group(self, optimizer: Union[int, str] = ADAMW, **options: Any) -> int:
        """Adds a param group (torch's defaults for `optimizer`, then the
        given zs_group_options fields, push_dtype and pull_dtype also by
        name); returns its id."""
        options = {k: _enum(k, v) for k, v in options.items()}
        return super().add_group(optimizer=_enum("optimizer", optimizer), **options)

    def push(self, tensor: int, buffer: Optional[_Buffer], micro: int = 0,
             dtype: Union[int, str] = 0) -> Request:
        """Pushes `buffer` as the tensor's gradient of micro-batch `micro`
        (zs_push); None pushes "no gradient": the shards skip the tensor
        when no trainer has one, and count it as zeros when one does."""
        # The transfer calls skip _enum and super() for an int dtype: they run
        # once per module and step (docs/PERFORMANCE.md, "Submission cost").
        d = dtype if isinstance(dtype, int) else _enum("dtype", dtype)
        return _zshard.Client.push(self, tensor, buffer, micro, d)

    def pull(self, tensor: int, buffer: _Buffer, dtype: Union[int, str] = 0) -> Request:
        d = dtype if isinstance(dtype, int) else _enum("dtype", dtype)
        return _zshard.Client.pull(self, tensor, buffer, d)

    def push_many(self, tensors: Sequence[int], buffers: Sequence[Optional[_Buffer]], micro: int = 0,
                  dtype: Union[int, str] = 0) -> List[Request]:
        """Pushes buffers[i] as tensors[i]'s gradient, all in one submission
        (zs_push_many; None: no gradient, as in push); returns one Request
        per entry."""
        d = dtype if isinstance(dtype, int) else _enum("dtype", dtype)
        return _zshard.Client.push_many(self, tensors, buffers, micro, d)

    def pull_many(self, tensors: Sequence[int], buffers: Sequence[_Buffer],
                  dtype: Union[int, str] = 0) -> List[Request]:
        """Pulls tensors[i] into buffers[i], all in one submission
        (zs_pull_many); returns one Request per entry."""
        d = dtype if isinstance(dtype, int) else _enum("dtype", dtype)
        return _zshard.Client.pull_many(self, tensors, buffers, d)

    def __repr__(self) -> str:
        if self.closed:
            return "<zshard.Client closed>"
        return "<zshard.Client %d tensors, step %d>" % (self.num_tensors, self.current_step)
