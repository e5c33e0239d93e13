"""A GGUF file's header in one walk: metadata scalars, the tensor table, and each tensor's bytes as a
view of the memory map, typed and shaped as gguf-py's reader gives them.

gguf-py's `GGUFReader` builds numpy objects for every metadata value: on the embedded model's
49k-token vocabulary and merges that took ~2 s. Here arrays are stepped over, never decoded.

    | magic "GGUF" | version u32 | tensor count u64 | kv count u64 |
    | kv: key string, value type u32, value | ...                       (string = u64 length + bytes;
    | tensor: name string, n_dims u32, dims u64 x n_dims, type u32, offset u64 | ...   array = item
    | padding to general.alignment (32) | tensor data (offsets from here) |          type u32, count
                                                                                     u64, items)
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass

import gguf
import numpy as np

# GGUF value type -> struct format of the fixed-size ones (little-endian); 8 is a string, 9 an array
_SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "<B", gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H", gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I", gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f", gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q", gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}
# GGML types whose tensors gguf-py reads as typed values; every other type as uint8 blocks
_VALUE_DTYPES = {
    gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}
DEFAULT_ALIGNMENT = 32  # GGUF's, where the file sets no general.alignment


@dataclass(frozen=True)
class SkippedArray:
    """A metadata array, stepped over: its item type and length only."""

    item_type: gguf.GGUFValueType
    count: int


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file; fields named as gguf-py's `ReaderTensor`'s."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGML order: the fastest-moving dimension first
    data_offset: int  # bytes from the start of the file
    n_bytes: int
    # a read-only view of the memory map: typed values [rows, ..., cols] for F32/F16/F64/I*, else
    # uint8 blocks [rows, ..., bytes per row]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFLayout:
    path: str
    # key -> int | float | bool | str, or SkippedArray for arrays (the vocabulary, its merges)
    metadata: dict[str, object]
    tensors: list[GGUFTensor]  # in file order
    data_start: int  # bytes of header (metadata, tensor table, padding) before the tensor data


def read_gguf_layout(path: str) -> GGUFLayout:
    """Walk `path`'s header; tensor data stays on disk until a view of it is read."""
    with open(path, "rb") as file:
        try:
            buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise ValueError(f"{path} is not a GGUF file (empty)") from None
    try:
        return _Walker(path, buffer).layout()
    except (struct.error, UnicodeDecodeError, IndexError) as error:
        raise ValueError(f"{path} is not a valid GGUF file: its header is cut short or "
                         f"corrupt ({error})") from None


class _Walker:
    """Reads the header front to back; `pos` is the offset of the next unread byte."""

    def __init__(self, path: str, buffer: mmap.mmap) -> None:
        self.path = path
        self.buffer = buffer
        self.pos = 0

    def layout(self) -> GGUFLayout:
        if self.buffer[:4] != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic)")
        self.pos = 4
        version = self._unpack("<I")
        if version & 0xFFFF == 0:  # gguf-py's test: written on a machine of the other byte order
            raise ValueError(f"{self.path} is a big-endian GGUF; specserve reads little-endian")
        if version not in gguf.READER_SUPPORTED_VERSIONS:
            raise ValueError(f"{self.path} is GGUF version {version}; specserve reads versions "
                             f"{', '.join(map(str, gguf.READER_SUPPORTED_VERSIONS))}")
        num_tensors, num_kv = self._unpack("<Q"), self._unpack("<Q")
        metadata: dict[str, object] = {}
        for _ in range(num_kv):
            key = self._string()
            metadata[key] = self._value(gguf.GGUFValueType(self._unpack("<I")))
        table = [self._tensor_entry() for _ in range(num_tensors)]
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0
                or alignment & (alignment - 1)):
            raise ValueError(f"{self.path}: general.alignment {alignment!r} is not a power of two")
        data_start = -(-self.pos // alignment) * alignment
        return GGUFLayout(self.path, metadata, self._tensors(table, data_start), data_start)

    def _tensors(self, table: list[tuple], data_start: int) -> list[GGUFTensor]:
        file_bytes = np.frombuffer(self.buffer, dtype=np.uint8)
        tensors, names = [], set()
        for name, dims, tensor_type, offset in table:
            if name in names:
                raise ValueError(f"{self.path} is not a valid GGUF file: tensor {name} twice")
            names.add(name)
            block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
            n_bytes = math.prod(dims) * type_size // block_size
            start = data_start + offset
            if start + n_bytes > len(file_bytes):
                raise ValueError(f"{self.path} is not a valid GGUF file: tensor {name} ends "
                                 f"past the file's end")
            np_dims = tuple(reversed(dims))  # numpy order: the slowest-moving dimension first
            dtype = _VALUE_DTYPES.get(tensor_type)
            if dtype is None:
                np_dims = gguf.quants.quant_shape_to_byte_shape(np_dims, tensor_type)
                dtype = np.uint8
            data = file_bytes[start:start + n_bytes].view(dtype).reshape(np_dims)
            tensors.append(GGUFTensor(name, tensor_type, dims, start, n_bytes, data))
        return tensors

    def _tensor_entry(self) -> tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, int]:
        name = self._string()
        num_dims = self._unpack("<I")
        dims = struct.unpack_from(f"<{num_dims}Q", self.buffer, self.pos)
        self.pos += 8 * num_dims
        tensor_type = gguf.GGMLQuantizationType(self._unpack("<I"))
        return name, tuple(int(d) for d in dims), tensor_type, self._unpack("<Q")

    def _value(self, value_type: gguf.GGUFValueType) -> object:
        if value_type == gguf.GGUFValueType.STRING:
            return self._string()
        if value_type == gguf.GGUFValueType.ARRAY:
            item_type = gguf.GGUFValueType(self._unpack("<I"))
            count = self._unpack("<Q")
            self._skip_items(item_type, count)
            return SkippedArray(item_type, count)
        return self._unpack(_SCALAR_FORMATS[value_type])

    def _skip_items(self, item_type: gguf.GGUFValueType, count: int) -> None:
        if item_type in _SCALAR_FORMATS:
            self.pos += count * struct.calcsize(_SCALAR_FORMATS[item_type])
        elif item_type == gguf.GGUFValueType.STRING:
            buffer, pos = self.buffer, self.pos
            for _ in range(count):  # each string's length says where the next one starts
                pos += 8 + struct.unpack_from("<Q", buffer, pos)[0]
            self.pos = pos
        else:  # arrays of arrays: each item has its own type and length
            for _ in range(count):
                self._value(item_type)
        if self.pos > len(self.buffer):
            raise ValueError(f"{self.path} is not a valid GGUF file: cut short in its metadata")

    def _string(self) -> str:
        length = self._unpack("<Q")
        if self.pos + length > len(self.buffer):
            raise ValueError(f"{self.path} is not a valid GGUF file: cut short in its metadata")
        text = self.buffer[self.pos:self.pos + length].decode("utf-8")
        self.pos += length
        return text

    def _unpack(self, fmt: str) -> int | float | bool:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value
