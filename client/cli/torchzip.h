/*
 * torchzip — a strict reader of torch.save's zip format (.pt, .bin), for
 * `zshard import`: where each tensor of a saved state dict lies in the file,
 * found without reading any tensor's data and without running anything.
 *
 * The format (torch >= 1.6): a zip archive whose members are
 * `<archive>/data.pkl` (a pickle of the state dict in which each tensor is
 * torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...) and
 * each storage a persistent id ('storage', torch.FloatStorage, key,
 * location, numel)), `<archive>/data/<key>` (each storage's raw
 * little-endian bytes, STORED: not compressed, 64-byte aligned) and a few
 * small members (version, byteorder).
 *
 * The file is untrusted. tz_parse reads the zip's central directory (zip64
 * too) and the pickle with its own interpreter of the few opcodes
 * torch.save writes for a dict of tensors: PROTO, GLOBAL (only
 * collections.OrderedDict, torch._utils._rebuild_tensor_v2 and
 * _rebuild_parameter, and torch's storage classes), REDUCE of those,
 * BINPERSID, EMPTY_DICT, EMPTY_TUPLE, MARK, TUPLE*, SETITEM(S), BUILD (a
 * dict's attributes, dropped), BINUNICODE, BININT*, LONG1, NONE,
 * NEWTRUE/NEWFALSE, BINPUT/BINGET and their LONG_ forms, STOP. Any other
 * opcode or global is refused with a sentence naming it: nothing is ever
 * called or imported. Every length, offset and index in the file is
 * checked against what holds it; a compressed or encrypted member, a
 * tensor whose furthest element lies past its storage, and a storage whose
 * member is missing or of another size are refused before tz_parse
 * returns. A tensor saved as a view (strides other than row-major: a
 * transpose, a slice) is taken with its strides (st_tensor.strided), for
 * the importer to gather.
 */
#ifndef ZSHARD_CLI_TORCHZIP_H
#define ZSHARD_CLI_TORCHZIP_H

#include <stddef.h>
#include <stdint.h>

#include "safetensors.h"

/* The longest data.pkl taken: a state dict of 100k tensors pickles to a few
 * MiB, and the interpreter's memory grows with the pickle's length. */
#define TZ_MAX_PICKLE_BYTES (100u << 20)

/* 1 if the `size` bytes at `file` begin as a zip archive does. */
int tz_is_zip(const uint8_t *file, uint64_t size);

/* Parses the torch.save zip file of `size` bytes at `file` (the whole
 * file, typically mapped; only read) into the tensor index the safetensors
 * reader fills, so that `zshard import` checks and writes both formats
 * alike: out->data_start is 0 and each tensor's [begin, end) are bytes of
 * the file that hold all its elements (ranges of tensors that share a
 * storage may overlap; a strided tensor's elements are spread over its
 * range). A name
 * given twice keeps its last tensor, as unpickling the dict does. FP32,
 * FP16 and BF16 storages are taken; a tensor of another one is refused
 * (ZS_EDTYPE, naming it). Returns 0 and fills *out (freed with
 * st_header_free), or ZS_EPROTO (malformed, or something torch.save does
 * not write for a state dict), ZS_EDTYPE or ZS_ENOMEM with a sentence in
 * err; *out is then empty. */
int tz_parse(const uint8_t *file, uint64_t size, st_header *out, char *err, size_t errlen);

#endif
