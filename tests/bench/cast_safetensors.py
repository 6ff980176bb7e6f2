#!/usr/bin/python3
"""Casts every F32 tensor of a safetensors file to BF16 (round to nearest
even) or F16, for the unquantized floor rows of docs/QUALITY.md.

  cast_safetensors.py IN.safetensors OUT.safetensors bf16|f16
"""
import json
import struct
import sys

import numpy as np


def main():
    src, dst, kind = sys.argv[1], sys.argv[2], sys.argv[3]
    raw = open(src, "rb").read()
    (hlen,) = struct.unpack_from("<Q", raw, 0)
    header = json.loads(raw[8:8 + hlen])
    data = raw[8 + hlen:]
    out_header, chunks, offset = {}, [], 0
    for name, info in header.items():
        if name == "__metadata__":
            out_header[name] = info
            continue
        a, b = info["data_offsets"]
        blob = data[a:b]
        dtype = info["dtype"]
        if dtype == "F32":
            x = np.frombuffer(blob, dtype="<f4")
            if kind == "f16":
                blob, dtype = x.astype("<f2").tobytes(), "F16"
            else:
                bits = x.view("<u4").astype(np.uint64)
                rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                blob, dtype = rounded.astype("<u2").tobytes(), "BF16"
        out_header[name] = {"dtype": dtype, "shape": info["shape"],
                            "data_offsets": [offset, offset + len(blob)]}
        chunks.append(blob)
        offset += len(blob)
    h = json.dumps(out_header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for c in chunks:
            f.write(c)


if __name__ == "__main__":
    main()
