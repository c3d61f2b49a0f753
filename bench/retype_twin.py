"""A twin header with some tensor types replaced, to time a type on a known layout.

Usage: python bench/retype_twin.py SRC.hdr.gguf OUT.hdr.gguf Q4_K=IQ4_XS [Q6_K=Q8_0 ...]
then `gguf-run synth --fill OUT.hdr.gguf -o twin.gguf` (SRC: `synth --preset ... --header-only`).
"""

import sys

from gguf_runtime.format.blocks import BY_NAME
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.tools.synth_presets import pack_header


def main() -> None:
    src, out, *maps = sys.argv[1:]
    remap = {BY_NAME[a]: BY_NAME[b] for a, b in (m.split("=") for m in maps)}
    with open_gguf(src, check_data=False) as f:
        kvs = [(k, f.metadata_types[k], v) for k, v in f.metadata.items() if k != "general.alignment"]
        table = [(n, tuple(t.ne), remap.get(t.type_id, t.type_id)) for n, t in f.tensors.items()]
    with open(out, "wb") as fh:
        fh.write(pack_header(kvs, table))


if __name__ == "__main__":
    main()
