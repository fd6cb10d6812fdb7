"""Build the Gluon Hopper kernel for sm_90 on a machine without a GPU: compile errors, shared
memory, registers and stack (spill) bytes per form, before any device time is spent.

    pip install --no-deps --target /tmp/t36 triton==3.6.0     # the device's Triton, apart
    PYTHONPATH=/tmp/t36:src python scripts/gluon_sm90_build.py [MODULE] [--sass DIR]

MODULE defaults to ``mlaprefill.kernels.hopper_attention`` (any module holding a
``_hopper_attention_kernel`` of the same signature: a copy of an older version for an A/B of
the generated code). ``--sass DIR`` writes each form's SASS to
``DIR/c{causal}p{persistent}n{block_n}.sass`` (``...m64.sass`` for 64-row programs).
Gluon's API moves between Triton releases (3.9 has no ``gl.thread_barrier``), so build with the
Triton the GPU machine runs. Nothing here runs a kernel.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pathlib
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

_BF16_PTRS = {"q_ptr", "k_ptr", "r_ptr", "v_ptr", "out_ptr"}


def _signature(params: list[str], constants: dict) -> tuple[dict, dict]:
    sig, consts = {}, {}
    for i, name in enumerate(params):
        if name in constants:
            sig[name] = "constexpr"
            consts[(i,)] = constants[name]
        elif name in _BF16_PTRS:
            sig[name] = "*bf16"
        elif name in ("lse_ptr", "ws_o_ptr", "ws_l_ptr"):
            sig[name] = "*fp32"
        elif name in ("cu_q_ptr", "cu_k_ptr"):
            sig[name] = "*i32"
        elif name == "qk_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig, consts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("module", nargs="?", default="mlaprefill.kernels.hopper_attention")
    p.add_argument("--sass", type=pathlib.Path, default=None, help="write SASS here")
    a = p.parse_args()
    mod = importlib.import_module(a.module)
    fn = mod._hopper_attention_kernel
    params = list(inspect.signature(fn.fn).parameters)
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    # (causal, persistent, query rows, keys per block, stages): every form the module can launch
    wide = (mod.BLOCK_M, mod.BLOCK_N, mod.STAGES)
    narrow = (mod.BLOCK_M, *getattr(mod, "_NARROW", wide[1:]))  # where the module has them
    single = getattr(mod, "_SINGLE", narrow)
    # (context parts run the wide form; the narrow one too for an A/B of their key-block size)
    # (and with the last round's tiles split over the programs, SPLIT, where the module has it)
    splits = (False, True) if "SPLIT" in params else (False,)
    forms = [(False, True, *shape, sp) for shape in dict.fromkeys([wide, narrow])
             for sp in splits]
    forms += [(False, False, *wide, False)]
    forms += [(True, p, *shape, False) for shape in dict.fromkeys([single, narrow, wide])
              for p in (True, False)]
    for causal, persistent, block_m, block_n, stages, split in forms:
        # the form's constants and register budget as the module launches it (older modules
        # without _form_consts: one budget)
        form = dict(PERSISTENT=persistent, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
                    maxnreg=mod._MAXNREG)
        if hasattr(mod, "_form_consts"):
            form = mod._form_consts((persistent, block_m, block_n, stages))
        maxnreg = form.pop("maxnreg")
        constants = dict(CAUSAL=causal, ACCUMULATE=False, D1=128, D2=64, DV=128, num_warps=4,
                         **form)
        if "SPLIT" in params:
            constants["SPLIT"] = split
        sig, consts = _signature(params, constants)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(params)
                 if n.endswith("_ptr")}
        kernel = triton.compile(GluonASTSource(fn, sig, consts, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=4, maxnreg=maxnreg))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name],
                                   capture_output=True, text=True).stdout
            if a.sass is not None:
                a.sass.mkdir(parents=True, exist_ok=True)
                sass = subprocess.run([str(cuobjdump), "-sass", f.name],
                                      capture_output=True, text=True).stdout
                rows = "" if block_m == mod.BLOCK_M else f"m{block_m}"
                name = f"c{int(causal)}p{int(persistent)}n{block_n}{rows}{'s' * split}.sass"
                (a.sass / name).write_text(sass)
        regs = " ".join(x for x in usage.split() if x.startswith(("REG:", "STACK:")))
        print(f"causal={causal!s:5} persistent={persistent!s:5} block_m={block_m:3} "
              f"block_n={block_n:3} split={split!s:5} "
              f"shared={kernel.metadata.shared} {regs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
