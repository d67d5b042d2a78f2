"""The varlen prefill kernel's machine code, per loop, without a GPU.

Triton's wheel carries ptxas and nvdisasm, so the kernel compiles for sm_90 on any machine. This
prints, for every loop of the compiled kernel (a backward branch), its instruction count and its
opcode histogram: how many exponentials, FMA-pipe instructions, tensor-core ops and loads one
KV tile costs a thread, and where the compiler waits for the tensor cores. Integer arguments are
marked divisible by 16, as Triton's JIT specializes the strides and pointers it is given.

Needs Triton (`pip install triton==3.6.0`, as on the GPU image); torch may be the CPU build.

    python -m bench.engine.kernel_sass --config 128x64:8:2 [--head-dim 64 --group 4] [--waits]
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_POINTERS = {
    "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
    "block_tables_ptr": "*i32", "query_start_ptr": "*i32", "context_lens_ptr": "*i32",
    "out_ptr": "*bf16",
}  # fmt: skip
_SCALARS = {"qk_scale": "fp32", "window": "i32", "num_seqs": "i32"}
_STRIDES = (
    "stride_q_tok", "stride_q_head", "stride_kv_block", "stride_kv_slot", "stride_kv_head",
    "stride_bt_seq", "stride_o_tok", "stride_o_head",
)  # fmt: skip


def compile_sass(config: str, head_dim: int, group: int, block_size: int) -> str:
    """SASS of _paged_prefill_kernel for one tile configuration (bf16, no window)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from site_engine.engine.cuda import paged_prefill

    tiles = paged_prefill.parse_tiles(config)
    block_m = max(tiles.block_m, group)
    signature: dict[str, str] = {**_POINTERS, **_SCALARS, **dict.fromkeys(_STRIDES, "i32")}
    constants: dict[str, Any] = {
        "GROUP": group, "BLOCK_Q": block_m // group, "BLOCK_M": block_m, "HEAD_DIM": head_dim,
        "BLOCK_SIZE": block_size, "TILE": max(tiles.tile, block_size), "PRECISION": "tf32",
        "SKIP_SINGLE": False, "HAS_WINDOW": False,
    }  # fmt: skip
    kernel = paged_prefill._paged_prefill_kernel
    signature.update(dict.fromkeys(constants, "constexpr"))
    names = list(kernel.arg_names)
    source = ASTSource(
        fn=kernel,
        signature={name: signature[name] for name in names},
        constexprs={(names.index(k),): v for k, v in constants.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in (*_POINTERS, *_STRIDES)},
    )
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages},
    )
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cubin = Path("/tmp/fedllm_paged_prefill.cubin")
    cubin.write_bytes(compiled.asm["cubin"])
    return subprocess.run(
        [str(tools / "nvdisasm"), "-c", str(cubin)], check=True, capture_output=True, text=True
    ).stdout


_OPCODE = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")


def loops(sass: str) -> list[tuple[str, list[str]]]:
    """(label, instruction lines) of every loop: from a label to the branch back to it."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    found = []
    for i, line in enumerate(lines):
        match = _BRANCH.search(line)
        if match and labels.get(match.group(1), i) < i:
            found.append((match.group(1), lines[labels[match.group(1)] : i + 1]))
    return found


def histogram(body: Sequence[str]) -> collections.Counter[str]:
    return collections.Counter(m.group(1) for line in body if (m := _OPCODE.search(line)))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.kernel_sass")
    parser.add_argument("--config", default="128x64:8:2", help="'BLOCK_MxTILE:warps:stages'")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--waits", action="store_true", help="print each loop's MMA/exp/wait lines")
    args = parser.parse_args(argv)
    sass = compile_sass(args.config, args.head_dim, args.group, args.block_size)
    for label, body in loops(sass):
        counts = histogram(body)
        print(f"loop {label}: {sum(counts.values())} instructions: "
              + ", ".join(f"{op} {n}" for op, n in counts.most_common(16)))  # fmt: skip
        if args.waits:
            for line in body:
                if re.search(r"HGMMA|WARPGROUP|BAR\.SYNC|LDGSTS", line):
                    print("   ", " ".join(line.split())[:110])


if __name__ == "__main__":
    main()
