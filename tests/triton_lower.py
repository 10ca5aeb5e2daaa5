"""The Triton kernels' launches, lowered to Triton's IR for a GPU (an H100, sm90) on the CPU: the compiler's front
end checks what Triton's interpreter, which runs the kernels in the CPU suite, never does (the type of a value
carried through a loop, of both branches of an `if`, what the language allows where). A kernel that runs under the
interpreter but would not compile on a GPU fails tests/kernels/test_kernels_lower.py (once, a `_` reused in a loop
with another type broke every small-table backward on GPUs while the CPU suite passed).

The launches are recorded from the CPU suite (each kernel's argument types and constexpr values, one line per new
signature) into tests/triton_signatures.jsonl:

    rm tests/triton_signatures.jsonl
    EMBSHARD_TRITON_RECORD=$PWD/tests/triton_signatures.jsonl make test
    python tests/triton_lower.py --tidy tests/triton_signatures.jsonl   # sorted, one line per signature

and lowered where the kernels are `triton.jit` functions (TRITON_INTERPRET unset): `python tests/triton_lower.py
FILE` lowers every line and names each kernel that does not lower (status 1; 3 where this Triton has no CUDA back
end). Nothing is compiled further (no PTX, no GPU): about 10 ms a signature.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

RECORD_VAR = "EMBSHARD_TRITON_RECORD"
TARGET = ("cuda", 90, 32)  # an H100's
_TYPES = {
    "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
    "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1",
}  # fmt: skip


def record_from_env() -> bool:
    """Where EMBSHARD_TRITON_RECORD names a file and the kernels run under Triton's interpreter: every launch with
    a new signature appends its line to the file (module docstring). Returns whether it records."""
    path = os.environ.get(RECORD_VAR)
    if not path or os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    if getattr(InterpretedFunction.run, "_records", False):
        return True
    seen: set[str] = set()
    run = InterpretedFunction.run

    def run_recorded(self, *args, grid, warmup, **kwargs):
        if not warmup:
            line = json.dumps(launch_line(self.fn, args, kwargs), sort_keys=True)
            if line not in seen:
                seen.add(line)
                with open(path, "a") as f:  # one short line a write: whole lines from every process
                    f.write(line + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    run_recorded._records = True
    InterpretedFunction.run = run_recorded
    return True


def launch_line(fn: Any, args: tuple, kwargs: dict) -> dict:
    """A launch of kernel `fn` (its Python function) as plain data: module, name, each argument's type (a tensor's
    element type, an int's width) and the constexpr values."""
    params = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in params}  # not the launch options (num_warps, ...)
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    constexpr = {n for n, a in fn.__annotations__.items() if "constexpr" in str(a)}
    sig, consts = {}, {}
    for name, value in bound.arguments.items():
        kind = None if name in constexpr else _arg_type(value)
        if kind is None:
            sig[name], consts[name] = "constexpr", _plain(value)
        else:
            sig[name] = kind
    return {"module": fn.__module__, "kernel": fn.__name__, "signature": sig, "constexprs": consts}


def _arg_type(value: Any) -> str | None:
    """The signature entry of a launch argument (None: a constexpr)."""
    dtype = getattr(value, "dtype", None)
    if hasattr(value, "data_ptr") and dtype is not None:  # a tensor
        return "*" + _TYPES[str(dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def _plain(value: Any) -> Any:
    """A constexpr value as JSON: numbers, bools and None as they are, a Triton dtype as {"dtype": name}."""
    value = getattr(value, "value", value)  # tl.constexpr
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"dtype": str(value)}


def _value(plain: Any) -> Any:
    if isinstance(plain, dict) and "dtype" in plain:
        import triton.language as tl

        return tl.dtype(plain["dtype"])  # its name as str() gives it: fp32, bf16, ...
    return plain


class Lowering:
    """Triton's CUDA back end for an sm90 target, made once for every launch lowered (raises where this Triton has
    none)."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend

        self.target = GPUTarget(*TARGET)
        self.backend = make_backend(self.target)
        self.options = self.backend.parse_options({})
        self.codegen = self.backend.get_codegen_implementation(self.options)
        self.module_map = self.backend.get_module_map()

    def lower(self, line: dict) -> None:
        """Lower one recorded launch (raises Triton's CompilationError where the kernel does not compile, or an
        error saying the record no longer fits the kernel)."""
        from triton._C.libtriton import ir
        from triton.compiler import ASTSource

        kernel = getattr(importlib.import_module(line["module"]), line["kernel"])
        params = list(inspect.signature(kernel.fn).parameters)
        if set(params) != set(line["signature"]):
            raise ValueError(
                f"{line['module']}.{line['kernel']} now takes {params}, the record {sorted(line['signature'])}: "
                "record the launches again (tests/triton_lower.py)"
            )
        sig = {name: line["signature"][name] for name in params}  # the kernel's order (the record's is sorted)
        ctx = ir.context()
        ir.load_dialects(ctx)
        self.backend.load_dialects(ctx)
        consts = {k: _value(v) for k, v in line["constexprs"].items()}
        ASTSource(kernel, sig, consts).make_ir(self.target, self.options, self.codegen, self.module_map, ctx)


def read(path: Path) -> list[dict]:
    """The recorded launches of `path`, one per signature."""
    lines = {ln.strip() for ln in path.read_text().splitlines() if ln.strip()}
    return [json.loads(ln) for ln in sorted(lines)]


def main(argv: list[str]) -> int:
    tidy = "--tidy" in argv
    path = Path(next(a for a in argv if not a.startswith("--")))
    launches = read(path)
    if tidy:
        path.write_text("".join(json.dumps(x, sort_keys=True) + "\n" for x in launches))
        return 0
    try:
        lowering = Lowering()
    except Exception as e:  # a Triton without its CUDA back end: nothing to lower with (the caller skips)
        print(f"this Triton cannot lower for a CUDA target: {type(e).__name__}: {e}")
        return 3
    failed = 0
    for line in launches:
        try:
            lowering.lower(line)
        except Exception as e:  # every kernel that does not lower, named, not only the first
            failed += 1
            print(f"FAILED {line['module']}.{line['kernel']} {line['constexprs']}:\n{str(e)[-1500:]}\n")
    kernels = len({(x["module"], x["kernel"]) for x in launches})
    print(f"lowered {len(launches) - failed} of {len(launches)} launch signatures of {kernels} kernels for sm90")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
