"""load_pretrained(): pretrained weights from a file onto the shards, one
tensor at a time.

Two formats are read, neither by loading the whole file:

* safetensors: an 8-byte little-endian header length, a JSON header
  {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
  {...}} and the raw little-endian data. The header is checked whole (dtypes,
  shapes, offsets inside the data and not overlapping) before anything is read.
* torch.save's zip format (.pt, .bin): `<prefix>/data.pkl` is a pickle whose
  tensors refer to storages stored as members `<prefix>/data/<key>`. The
  pickle is read by an unpickler that builds only records (which storage,
  offset, shape, stride): its find_class knows the few names a state dict
  needs and refuses every other global, so a hostile file cannot make it run
  code, and no tensor data is read while unpickling.

Each tensor's bytes are then read straight into an fp32 tensor of its size
(fp32 files), or in chunks of CHUNK_BYTES converted into it (bf16 and fp16
files: both convert to fp32 exactly, as torch's copy_ in
model.load_state_dict() does), written to the shards and dropped before the
next tensor is read. Peak memory: the largest tensor in fp32 plus a chunk.
The files are read with readinto rather than mmap because the pages of a
mapping stay in the process's resident set until it is unmapped.
"""

import collections
import ctypes
import json
import os
import pickle
import struct
import sys
import zipfile
from typing import Any, Callable, Optional, Union

import torch

import zshard

from ._common import _buffer

__all__ = ["load_pretrained"]

CHUNK_BYTES = 4 << 20
# A safetensors header longer than this is refused (the format's own
# reference reader caps it at 100 MB too).
MAX_HEADER_BYTES = 100 << 20

# safetensors dtype -> (torch dtype, bytes per element). Parameters take
# the floating types the fp32 masters hold exactly (_MASTER_DTYPES); the
# others are there for buffers (BatchNorm's num_batches_tracked).
_ST_DTYPES = {"F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
              "F64": (torch.float64, 8), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
              "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1),
              "BOOL": (torch.bool, 1)}
_SIZES = {t: n for t, n in _ST_DTYPES.values()}
_MASTER_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class PretrainedError(ValueError):
    """The file cannot be imported: malformed, or not this model's. Nothing
    was written to the shards."""


# ---- the tensors of a file --------------------------------------------------------------


class _Entry:
    """One tensor of the file: where its elements are and how to read them."""
    __slots__ = ("name", "dtype", "shape", "offset", "stride", "member")

    def __init__(self, name, dtype, shape, offset, stride=None, member=None):
        self.name, self.dtype, self.shape = name, dtype, tuple(shape)
        self.offset = offset    # safetensors: bytes into the file; torch: elements into the storage
        self.stride = stride    # torch: the tensor's strides; None: contiguous
        self.member = member    # torch: the zip member of its storage

    @property
    def numel(self):
        n = 1
        for d in self.shape:
            n *= d
        return n


def _safetensors_entries(f, path):
    """The entries of a safetensors file, its whole header checked."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) != 8:
        raise PretrainedError("%s: %d bytes: too short for a safetensors file" % (path, size))
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES or n > size - 8:
        raise PretrainedError("%s: header length %d is beyond the file (%d bytes) or the limit "
                              "(%d)" % (path, n, size, MAX_HEADER_BYTES))
    try:
        header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise PretrainedError("%s: the safetensors header is not JSON: %s" % (path, err)) from None
    if not isinstance(header, dict):
        raise PretrainedError("%s: the safetensors header is not a JSON object" % path)
    data_start, data_len = 8 + n, size - 8 - n
    entries, spans = [], []
    for name, v in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(v, dict) or set(v) != {"dtype", "shape", "data_offsets"}:
            raise PretrainedError("%s: tensor %r: not an object with exactly dtype, shape and "
                                  "data_offsets" % (path, name))
        dtype, shape, offs = v["dtype"], v["shape"], v["data_offsets"]
        if dtype not in _ST_DTYPES:
            raise PretrainedError("%s: tensor %r has dtype %r, which is not imported" %
                                  (path, name, dtype))
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise PretrainedError("%s: tensor %r: shape %r is not a list of sizes"
                                  % (path, name, shape))
        if not (isinstance(offs, list) and len(offs) == 2 and
                all(type(o) is int for o in offs) and 0 <= offs[0] <= offs[1] <= data_len):
            raise PretrainedError("%s: tensor %r: data_offsets %r are not a range inside the "
                                  "%d data bytes" % (path, name, offs, data_len))
        e = _Entry(name, _ST_DTYPES[dtype][0], shape, data_start + offs[0])
        if offs[1] - offs[0] != e.numel * _ST_DTYPES[dtype][1]:
            raise PretrainedError("%s: tensor %r: data_offsets %r hold %d bytes, its shape %s of "
                                  "%s needs %d" % (path, name, offs, offs[1] - offs[0], shape,
                                                   dtype, e.numel * _ST_DTYPES[dtype][1]))
        entries.append(e)
        spans.append((offs[0], offs[1], name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise PretrainedError("%s: tensors %r and %r overlap in the data" % (path, n0, n1))
    return entries


class _Storage:
    """A persistent id of torch's pickle: storage `key` of `numel` elements."""
    __slots__ = ("dtype", "key", "numel")

    def __init__(self, dtype, key, numel):
        self.dtype, self.key, self.numel = dtype, key, numel


class _StorageType:
    def __init__(self, dtype):
        self.dtype = dtype


class _Tensor:
    """What torch._utils._rebuild_tensor_v2 would have built, as a record."""
    __slots__ = ("storage", "offset", "shape", "stride")

    def __init__(self, storage, offset, shape, stride):
        self.storage, self.offset, self.shape, self.stride = storage, offset, shape, stride


def _rebuild_tensor(storage, offset, size, stride, *unused):
    if not isinstance(storage, _Storage):
        raise PretrainedError("a tensor whose storage is %s" % type(storage).__name__)
    return _Tensor(storage, int(offset), tuple(int(d) for d in size), tuple(int(s) for s in stride))


def _rebuild_parameter(data, *unused):
    return data


class _SafeUnpickler(pickle.Unpickler):
    """Unpickles a torch state dict into _Tensor records. Only these globals
    exist for it; anything else (os.system, builtins.eval...) is refused."""

    _STORAGES = {"FloatStorage": torch.float32, "HalfStorage": torch.float16,
                 "BFloat16Storage": torch.bfloat16, "DoubleStorage": torch.float64,
                 "LongStorage": torch.int64, "IntStorage": torch.int32,
                 "ShortStorage": torch.int16, "CharStorage": torch.int8,
                 "ByteStorage": torch.uint8, "BoolStorage": torch.bool}
    _GLOBALS = {("collections", "OrderedDict"): collections.OrderedDict,
                ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
                ("torch._utils", "_rebuild_parameter"): _rebuild_parameter}

    def find_class(self, module, name):
        if module == "torch" and name in self._STORAGES:
            return _StorageType(self._STORAGES[name])
        if (module, name) in self._GLOBALS:
            return self._GLOBALS[(module, name)]
        raise pickle.UnpicklingError("global %s.%s is not allowed in a state dict (only torch "
                                     "tensors, parameters and dicts are read)" % (module, name))

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and
                isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and
                isinstance(pid[4], int)):
            raise pickle.UnpicklingError("persistent id %r is not a torch storage" % (pid,))
        return _Storage(pid[1].dtype, pid[2], pid[4])


def _torch_entries(z, path):
    """The entries of torch.save's zip file, from its pickle alone."""
    pkls = [n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkls) != 1:
        raise PretrainedError("%s: not a torch.save zip file (no single <name>/data.pkl)" % path)
    prefix = pkls[0][:-len("data.pkl")]
    try:
        with z.open(pkls[0]) as f:
            obj = _SafeUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, IndexError,
            ValueError) as err:
        raise PretrainedError("%s: cannot read %s: %s" % (path, pkls[0], err)) from None
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]   # a training checkpoint {"state_dict": ..., ...}
    if not isinstance(obj, dict):
        raise PretrainedError("%s: holds a %s, not a state dict" % (path, type(obj).__name__))
    members = set(z.namelist())
    entries = []
    for name, t in obj.items():
        if not isinstance(name, str) or not isinstance(t, _Tensor):
            raise PretrainedError("%s: entry %r is not a tensor" % (path, name))
        s = t.storage
        e = _Entry(name, s.dtype, t.shape, t.offset, t.stride, prefix + "data/" + s.key)
        if len(t.stride) != len(t.shape) or any(st < 0 for st in t.stride) or t.offset < 0:
            raise PretrainedError("%s: tensor %r: bad strides %r" % (path, name, t.stride))
        last = t.offset + sum((d - 1) * st for d, st in zip(t.shape, t.stride)) if e.numel else 0
        if e.member not in members or (e.numel and last >= s.numel):
            raise PretrainedError("%s: tensor %r reaches past its storage %s" % (path, name, s.key))
        if z.getinfo(e.member).file_size != s.numel * _SIZES[s.dtype]:
            raise PretrainedError("%s: storage %s has %d bytes, not %d" % (
                path, s.key, z.getinfo(e.member).file_size, s.numel * _SIZES[s.dtype]))
        entries.append(e)
    return entries


# ---- reading one tensor ------------------------------------------------------------------


def _readinto(f, view):
    """Fills view from f, CHUNK_BYTES at a time: a zip member's readinto
    reads a bytes object of the asked size and copies it."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:got + CHUNK_BYTES])
        if not n:
            raise PretrainedError("the file ended %d bytes early" % (len(view) - got))
        got += n


def _read_fp32(f, dtype, numel):
    """numel elements of dtype from f's position, as a new fp32 tensor (a
    tensor of dtype itself when that is not a floating type of the masters)."""
    if dtype not in _MASTER_DTYPES:
        out = torch.empty(numel, dtype=dtype)
        if numel:
            _readinto(f, memoryview(out.view(torch.uint8).numpy()).cast("B"))
        return out
    out = torch.empty(numel, dtype=torch.float32)
    if numel == 0:
        return out
    if dtype == torch.float32:
        _readinto(f, memoryview(_buffer(out)).cast("B"))
        return out
    size = _SIZES[dtype]
    per = CHUNK_BYTES // size
    raw = torch.empty(min(per, numel), dtype=torch.int16)
    for i in range(0, numel, per):
        n = min(per, numel - i)
        _readinto(f, memoryview(raw.numpy()).cast("B")[:n * size])
        # bf16 -> fp32 is a 16-bit shift, fp16 -> fp32 exact: copy_ does both.
        out[i:i + n].copy_(raw[:n].view(dtype))
    return out


def _contiguous_strides(shape):
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= d
    return tuple(reversed(strides))


def _read_entry(src, e):
    """Entry e of the open file src as an fp32 tensor of its shape."""
    if e.member is None:
        src.seek(e.offset)
        return _read_fp32(src, e.dtype, e.numel).view(e.shape)
    size = _SIZES[e.dtype]
    contiguous = e.numel == 0 or e.stride == _contiguous_strides(e.shape)
    with src.open(e.member) as f:
        if contiguous:
            f.seek(e.offset * size)
            return _read_fp32(f, e.dtype, e.numel).view(e.shape)
        # A view saved on its own (a slice, a transpose): read the span it
        # covers and gather it.
        span = 1 + sum((d - 1) * s for d, s in zip(e.shape, e.stride))
        f.seek(e.offset * size)
        flat = _read_fp32(f, e.dtype, span)
        return flat.as_strided(e.shape, e.stride).contiguous()


# ---- the model's names ----------------------------------------------------------------------


def _model_keys(opt):
    """The model's state_dict keys, in its order, without reading any data:
    ('param', _Param) or ('buffer', tensor) for each. Tied parameters appear
    under every name, as in model.state_dict()."""
    keys = {}
    for prefix, m in opt._model.named_modules(remove_duplicate=False):
        pre = prefix + "." if prefix else ""
        for n, p in m._parameters.items():
            if p is not None:
                keys[pre + n] = ("param", opt._by_id.get(id(p)), p)
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set:
                keys[pre + n] = ("buffer", None, b)
    return keys


def _check_names(opt, entries, strict):
    """torch's load_state_dict(strict) report, raised before any write."""
    keys = _model_keys(opt)
    have = {e.name: e for e in entries}
    errors = []
    if strict:
        unexpected = [e.name for e in entries if e.name not in keys]
        missing = [k for k in keys if k not in have]
        # torch's order: missing, unexpected, then the size mismatches.
        if missing:
            errors.append("Missing key(s) in state_dict: %s. " %
                          ", ".join('"%s"' % k for k in missing))
        if unexpected:
            errors.append("Unexpected key(s) in state_dict: %s. " %
                          ", ".join('"%s"' % k for k in unexpected))
    for k, (kind, P, t) in keys.items():
        e = have.get(k)
        if e is not None and e.shape != tuple(t.shape):
            errors.append("size mismatch for %s: copying a param with shape %s from checkpoint, "
                          "the shape in current model is %s." % (k, torch.Size(e.shape), t.shape))
        if e is not None and kind == "param" and e.dtype not in _MASTER_DTYPES:
            errors.append("%s has dtype %s in the file: the fp32 masters take float32, float16 "
                          "and bfloat16" % (k, e.dtype))
        if e is not None and kind == "param" and P is None:
            errors.append("parameter %s is in no param group of the optimizer: the shards do not "
                          "hold it" % k)
    if errors:
        raise RuntimeError("Error(s) in loading state_dict for %s:\n\t%s" %
                           (type(opt._model).__name__, "\n\t".join(errors)))
    # safetensors: in file order, so that the reads go forward.
    order = entries if entries and entries[0].member else sorted(entries, key=lambda e: e.offset)
    return [(keys[e.name], e) for e in order if e.name in keys]


def _trim():
    """Asks glibc to hand freed memory back to the system. Without it the
    arenas of libzshard's worker threads keep the memory of the write
    messages (1 MiB each; glibc's trim threshold follows its mmap threshold,
    which freeing one large tensor raises to that tensor's size), and the
    resident set grows by up to that threshold per worker before it levels
    off. One call per tensor costs far less than the tensor's write."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(ctypes.c_size_t(0))


_malloc_trim = None


# ---- the entry point --------------------------------------------------------------------------


def load_pretrained(opt: Any, path: Union[str, os.PathLike[str]], strict: bool = True,
                    progress: Optional[Callable[[str, int], Any]] = None) -> int:
    """Loads the weights of a safetensors file or a torch.save'd state dict
    (.pt, .bin) onto the shards of `opt` (zshard.torch.shard()'s optimizer),
    one tensor at a time: the file is never held whole in memory.

    Names are the model's state_dict keys. As model.load_state_dict(strict)
    does, missing and unexpected keys (with strict) and shape mismatches
    raise RuntimeError naming all of them; a malformed file raises
    PretrainedError; both before anything is written. bf16 and fp16 values
    convert to the fp32 masters exactly (the bits model.load_state_dict()
    gives). Persistent buffers in the file are copied into the model's own
    (trainers hold buffers, not the shards).

    Every rank calls it with the same file between the same two steps (after
    shard() or step(), before the next backward), as load_state_dict: each
    writes the same values, so no barrier is needed, and each marks its
    parameters stale, so that the next forward pulls the new weights. The
    optimizer's moments and step count are left as they are.

    progress, if given, is called as progress(name, bytes_read) after each
    tensor. Returns the number of bytes of tensor data read."""
    opt._check_open()
    if sys.byteorder != "little":
        raise PretrainedError("big-endian hosts cannot read these little-endian files")
    path = os.fspath(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    zipped = magic == b"PK\x03\x04"
    src: Any = zipfile.ZipFile(path) if zipped else open(path, "rb")
    try:
        entries = _torch_entries(src, path) if zipped else _safetensors_entries(src, path)
    except BaseException:
        src.close()
        raise
    total = 0
    with src:
        todo = _check_names(opt, entries, strict)
        opt._check_between_steps("load_pretrained")
        for (kind, P, t), e in todo:
            w = _read_entry(src, e)
            total += e.numel * _SIZES[e.dtype]
            if kind == "buffer":
                with torch.no_grad():
                    t.copy_(w)
            else:
                opt._write_state(P, zshard.MASTER, w)
                opt._loaded(P)
            del w
            _trim()
            if progress is not None:
                progress(e.name, total)
    return total
