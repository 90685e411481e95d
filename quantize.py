"""quantize.py: write an int8 / int4 / nf4 / llm.int8 variant of a checkpoint (the command line; the layers and
quantizers are in quantized.py, the files are written by convert.write_variant).

    python quantize.py --ckpt DIR --mode int8|int4|nf4|llm.int8 [--group-size 32] [--double-quant] [--out DIR]

writes DIR/model.MODE.safetensors and records the mode in DIR/config.json ("quantization"), never touching
model.safetensors. load.from_pretrained(DIR, quant=MODE) then loads the variant directly.
"""

from __future__ import annotations

import argparse
import os
import sys

from dense_engine.cpu import quantized
from dense_engine.formats import convert
from dense_engine.system.errors import CheckpointError, run_program


def quantize_checkpoint(src: str, mode: str, out: str | None = None, group_size: int = 32, progress=None,
                        double_quant: bool = False) -> str:
    """Write model.MODE.safetensors (+ the config record) beside a native checkpoint, or into `out` with the config
    and tokenizer files, from any checkpoint from_pretrained reads. Returns the written file."""
    quantized.check_mode(mode)
    checkpoint = convert.read_checkpoint(src)
    native = checkpoint.native
    if native and not checkpoint.tensors:
        raise CheckpointError(f"{src}: already quantized (no full-precision model.safetensors to quantize from)")
    if not native and out is None:
        raise CheckpointError(f"{src}: not a native checkpoint; pass --out DIR for the quantized folder")
    if double_quant and mode != "nf4":
        raise CheckpointError("--double-quant applies to --mode nf4 only")
    if mode == "int4" and group_size not in (32, 64, 128):
        raise CheckpointError(f"--group-size must be 32, 64 or 128, got {group_size}")
    exact, params = convert.exact_variant(checkpoint, mode, group_size)
    return convert.write_variant(checkpoint, mode, out or src, {**params, "double_quant": double_quant}, progress,
                                 exact)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Write an int8 / int4 / nf4 / llm.int8 variant of a checkpoint.")
    parser.add_argument("--ckpt", required=True, help="checkpoint folder or file")
    parser.add_argument("--mode", required=True, choices=quantized.MODES)
    parser.add_argument("--group-size", type=int, default=32, help="int4 group size: 32, 64 or 128")
    parser.add_argument("--double-quant", action="store_true", help="nf4: quantize the absmax values too "
                        "(bitsandbytes' compress_statistics; 0.4 fewer bits a weight on disk)")
    parser.add_argument("--out", help="write into this folder (with config and tokenizer) instead of beside --ckpt")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    from rich.progress import Progress


    def work() -> int:
        with Progress(transient=True) as bar:
            task = bar.add_task(f"Quantizing to {args.mode}", total=None)
            written = quantize_checkpoint(args.ckpt, args.mode, args.out, args.group_size,
                                          progress=lambda done, total: bar.update(task, completed=done, total=total),
                                          double_quant=args.double_quant)
        print(f"wrote {written} ({os.path.getsize(written) / 2**20:.1f} MiB)")
        return 0

    return run_program(work, sys.argv[1:] if argv is None else argv)

if __name__ == "__main__":
    sys.exit(main())
