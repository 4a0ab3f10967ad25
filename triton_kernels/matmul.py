"""Triton GEMM for fp16/bf16 operands with fp32 accumulation (the kernel behind ``mpkern.matmul``).

Math, for A (M, K) and B (K, N) in fp16 or bf16 (both the same dtype), any strides:

    acc[m, n] = sum_k float32(A[m, k]) * float32(B[k, n])          (fp32 accumulator, tl.dot)
    acc      += float32(bias[n])                  if a bias is given
    acc      += C[m, n]                           if ACCUMULATE (C is fp32: C += A @ B, main_grad)
    C[m, n]   = round_to_nearest_even(acc, dtype of C)   -- C is fp16, bf16 or fp32

Both kernels cut C into BLOCK_M x BLOCK_N tiles, walk K in BLOCK_K steps into an fp32 register
accumulator, and number the tiles in groups of GROUP_M tile-rows (swept column by column), so that
tiles computed at the same time share A rows and B columns in L2. The epilogue is one function for
both: fp32 bias, the fp32 C tile (ACCUMULATE), the rounding, a masked store through C's strides
(it and the tile order: :mod:`.matmul_tiles`).
All element offsets of C are int64. Transposed operands are strides, never copies. Batch
dimensions are folded into M by the caller.

Two kernels, chosen per call by :func:`matmul_into` (:func:`kernel_for`); this module is their host side
(configs, autotuning, launch planning):

* ``_matmul_kernel`` (:mod:`.matmul_pointer`) -- pointer loads, one program per tile (grid = number of
  tiles). Rows/columns past M/N are wrapped with ``% M`` / ``% N`` on load (valid memory; masked on store), only the K
  tail is masked. Software-pipelined by Triton (``cp.async`` + ``mma.sync`` on sm_80, wgmma on
  sm_90). It is the interpreter's kernel, the Ampere (sm_80/86/89) kernel, and the fallback for
  operands a TMA descriptor cannot describe.
* ``_matmul_tma_kernel`` (:mod:`.matmul_tma`) -- Hopper (sm_90) and datacenter Blackwell (sm_100): A and
  B tiles are read by the TMA engine through host-built tensor descriptors (``triton.tools.tensor_descriptor``,
  ``UTMALDG`` into swizzled shared memory, fed to ``HGMMA`` without passing through registers).
  The descriptor zero-fills reads past the tensor's edge, so the K, M and N tails need no masks or
  wraps. A transposed operand (A with ``stride(0) == 1``, e.g. ``grad_out.t()`` in the weight
  gradient; B with ``stride(0) == 1``, e.g. ``weight.t()`` in the forward) is described as the
  contiguous matrix it is a view of: its descriptor has the block shape swapped and the loaded tile
  is used as ``tile.T`` (a transposed shared-memory operand of the MMA: no data movement).
  The kernel is persistent: ``min(#SMs, #tiles)`` programs each take every #SMs-th tile of the
  grouped order, and the tile loop and the K loop are flattened into one software-pipelined loop
  (``tl.range(..., flatten=True)``), so the next tile's first TMA loads are in flight while the
  current tile's epilogue runs. Because those loads are in flight, the epilogue's layout conversion
  (through shared memory) cannot reuse the pipeline's buffers: it stores the tile in 1, 2 or 4 column
  slices of at most 32 KB of C each (``tl.split`` of the accumulator's registers), which keeps an fp32
  128x256 tile within the 227 KB of shared memory and an ACCUMULATE epilogue's C slice small enough
  not to spill. TMA needs a 16-byte aligned base, a unit last stride and 16-byte aligned other
  strides: :func:`tma_layout` checks each operand, and the launcher falls back to the pointer kernel
  when one does not qualify (or K == 0). C is written with masked pointer stores (any strides).

Under ``TRITON_INTERPRET=1`` (CPU tensors):
* the interpreter's ``tl.dot`` multiplies bfloat16 bit patterns as integers (triton-lang/triton
  #11584), so the launcher sets ``UPCAST=True`` there and the operands are converted to fp32
  before ``tl.dot`` (exact: every fp16/bf16 value is an fp32 value; products are exact in fp32);
* its fp32->bf16 cast truncates; bf16 output is therefore always rounded with integer bit math
  (``f32_to_bf16_bits``, the same as ``math.h``) and stored as raw 16-bit words -- identical on
  the GPU, whose cast rounds to nearest even too;
* autotuning is off: one small fixed config keeps the tests fast; the pointer kernel runs unless
  ``MPKERN_MATMUL_KERNEL=tma`` asks for the TMA kernel (a check of its tiling on CPU).

On the GPU both kernels are autotuned, each over configs for its architecture (:data:`CONFIGS_SM90`
for the TMA kernel, :data:`CONFIGS_SM80` for the pointer kernel). The tuning key buckets M, N and K
to the next power of two and reduces the operand strides to a layout code (per stride: is it 1, is
it a multiple of 16 -- the classes Triton specialises on). The token count is M in the forward and
input-gradient GEMMs and K in the weight-gradient GEMMs (N or a stride in other uses); it changes
with the batch shape, and each new exact value would re-run the host-synchronising tuning benchmark
for every layer shape. The fp32 ``main_grad`` accumulate epilogue -- which holds the loaded C tile
next to the accumulator -- only tries configs with at most 64 accumulator values per thread in the
pointer kernel (the larger tiles spill there) and 128 in the TMA kernel (whose epilogue loads C one
column slice at a time). ``MPKERN_MATMUL_CONFIG=fixed`` turns tuning off on the GPU too (one fixed
config per kernel, :data:`FIXED_CONFIG` / :data:`FIXED_CONFIG_SM90`: the tests and the GPU check use
it, so no test waits on tuning). ``MPKERN_MATMUL_KERNEL=pointer`` keeps the pointer kernel on Hopper
(for comparisons); ``benchmarks/matmul_sass.py`` compiles the main configs ahead of time and counts
their HGMMA / UTMALDG / HMMA instructions and spills, without a GPU.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ._common import device_guard

# the two kernels' raw JIT functions, public here too for ahead-of-time compilation (benchmarks/matmul_sass.py)
from .matmul_pointer import pointer_kernel
from .matmul_tma import tma_kernel

_IN_DTYPES = (torch.float16, torch.bfloat16)
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# The one config used under the interpreter (tl.dot needs every block dim >= 16).
INTERPRET_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}
# The TMA kernel under the interpreter (MPKERN_MATMUL_KERNEL=tma): few "SMs", so that each program
# walks several tiles of the persistent loop, and small epilogue slices, so that a 32x32 tile is stored in
# 2 (16-bit C) or 4 (fp32 C) slices as the GPU's big tiles are.
INTERPRET_SMS = 3
INTERPRET_EPI_SLICE_BYTES = 1024
# The TMA kernel's epilogue slices on the GPU (see _matmul_tma_kernel).
EPI_SLICE_BYTES = 32768

# The one config of each kernel used on the GPU when MPKERN_MATMUL_CONFIG=fixed (64 accumulator values
# per thread: also fine for the accumulate epilogue).
FIXED_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}
FIXED_LAUNCH = {"num_warps": 8, "num_stages": 3}
FIXED_CONFIG_SM90 = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}
FIXED_LAUNCH_SM90 = {"num_warps": 8, "num_stages": 4}
_MAX_ACC_PER_THREAD_ACCUMULATE = 64
_MAX_ACC_PER_THREAD_ACCUMULATE_SM90 = 128

KERNEL_ENV = "MPKERN_MATMUL_KERNEL"  # "" / "auto": by device and operands; "pointer"; "tma"


def _fixed_config() -> bool:
    return os.environ.get("MPKERN_MATMUL_CONFIG", "").strip().lower() == "fixed"


def _kernel_request() -> str:
    return os.environ.get(KERNEL_ENV, "").strip().lower() or "auto"


def m_bucket(m: int) -> int:
    """The autotuning bucket of a GEMM size (M, N or K): the next power of two (3000 and 4000 share
    one tuning)."""
    return 1 << max(0, int(m) - 1).bit_length()


def layout_code(*strides: int) -> int:
    """The autotuning key of the operand strides (A's, then B's): per stride, whether it is 1 and
    whether it is a multiple of 16 -- the classes Triton specialises integer arguments on -- not its
    value: a contiguous (tokens, K) operand's row stride is K, and K is the token count in wgrad."""
    code = 0
    for i, s in enumerate(strides):
        code |= (int(s == 1) | int(s % 16 == 0) << 1) << (2 * i)
    return code


def _acc_per_thread(cfg: triton.Config) -> int:
    return cfg.kwargs["BLOCK_M"] * cfg.kwargs["BLOCK_N"] // (32 * cfg.num_warps)


def prune_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Autotune pruning: for the fp32 accumulate epilogue keep only configs that do not spill
    (<= 64 accumulator values per thread); every config otherwise."""
    accumulate = kwargs.get("ACCUMULATE", named_args.get("ACCUMULATE", False))
    if not accumulate:
        return configs
    kept = [c for c in configs if _acc_per_thread(c) <= _MAX_ACC_PER_THREAD_ACCUMULATE]
    return kept or configs


def prune_configs_sm90(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The TMA kernel's pruning: its epilogue works in column slices of at most 32 KB of output, so the
    accumulate epilogue holds a slice of C, not a whole tile, next to the accumulator: configs with up to
    128 accumulator values per thread do not spill there (benchmarks/matmul_sass.py checks it)."""
    accumulate = kwargs.get("ACCUMULATE", named_args.get("ACCUMULATE", False))
    if not accumulate:
        return configs
    kept = [c for c in configs if _acc_per_thread(c) <= _MAX_ACC_PER_THREAD_ACCUMULATE_SM90]
    return kept or configs


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _cfg(bm: int, bn: int, bk: int, stages: int, warps: int,
         pre_hook: Callable[[dict], None] | None = None) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=stages,
                         num_warps=warps, pre_hook=pre_hook)


def _set_block_shapes(nargs: dict) -> None:
    """Config pre-hook of the TMA kernel: the descriptors' block shapes follow the config's tile (a
    transposed operand's descriptor has its block swapped: [BLOCK_K, BLOCK_M] / [BLOCK_N, BLOCK_K])."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bk, bm] if nargs["A_T"] else [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["B_T"] else [bk, bn]


#: Pointer kernel (Ampere sm_80: 164 KB of shared memory per block at most, so no 4-stage 128x256x64).
#: Large 128x256 / 256x128 tiles with 8 warps win on big problems; the 4-warp 128x128x32 and the
#: 64-wide tiles cover skinny shapes (few tiles -> more programs per SM). No 4-warp 128x128x64: it
#: spills with Triton 3.6 (benchmarks/matmul_sass.py).
CONFIGS_SM80: list[triton.Config] = [
    _cfg(128, 256, 64, 3, 8),
    _cfg(256, 128, 64, 3, 8),
    _cfg(128, 128, 64, 4, 8),
    _cfg(128, 256, 32, 3, 8),
    _cfg(128, 128, 32, 4, 4),
    _cfg(128, 64, 64, 4, 4),
    _cfg(64, 128, 64, 4, 4),
    _cfg(64, 64, 64, 5, 4),
    _cfg(64, 256, 32, 4, 4),
]

#: TMA kernel (Hopper sm_90: 228 KB of shared memory per SM, wgmma from two warpgroups with 8 warps).
#: 128x256x64 with 8 warps (128 accumulator registers per thread, each warpgroup a 64x256 wgmma) is the
#: big-problem tile, with 3 (144 KB) or 4 (192 KB) stages; 128x128x64 and 128x128x128 the mid-size
#: ones; 64x128 / 128x64 / 64x64 with one warpgroup the skinny and small shapes (more tiles per SM).
CONFIGS_SM90: list[triton.Config] = [
    _cfg(128, 256, 64, 3, 8, _set_block_shapes),
    _cfg(128, 256, 64, 4, 8, _set_block_shapes),
    _cfg(256, 128, 64, 3, 8, _set_block_shapes),
    _cfg(128, 128, 64, 4, 8, _set_block_shapes),
    _cfg(128, 128, 128, 3, 8, _set_block_shapes),
    _cfg(128, 128, 64, 4, 4, _set_block_shapes),
    _cfg(64, 128, 64, 5, 4, _set_block_shapes),
    _cfg(128, 64, 64, 5, 4, _set_block_shapes),
    _cfg(64, 64, 64, 6, 4, _set_block_shapes),
]


# GPU entry points: autotuned per (M, N, K buckets, layout code). restore_value keeps C intact while the
# tuner benchmarks candidates on an accumulating call (C += A @ B would otherwise be applied repeatedly).
TUNING_KEY = ["M_BUCKET", "N_BUCKET", "K_BUCKET", "LAYOUT", "ACCUMULATE", "OUT_BF16"]
_matmul_kernel_tuned = triton.autotune(
    configs=CONFIGS_SM80,
    key=TUNING_KEY,
    prune_configs_by={"early_config_prune": prune_configs},
    restore_value=["c_ptr"],
)(pointer_kernel)
_matmul_tma_kernel_tuned = triton.autotune(
    configs=CONFIGS_SM90,
    key=TUNING_KEY,
    prune_configs_by={"early_config_prune": prune_configs_sm90},
    restore_value=["c_ptr"],
)(tma_kernel)


def _check(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None) -> None:
    if a.dim() != 2 or b.dim() != 2 or c.dim() != 2:
        raise ValueError(f"matmul kernel: expected 2-D a, b, out; got {tuple(a.shape)}, {tuple(b.shape)}, "
                         f"{tuple(c.shape)}")
    M, K = a.shape
    K2, N = b.shape
    if K != K2 or tuple(c.shape) != (M, N):
        raise ValueError(f"matmul kernel: shapes a {tuple(a.shape)} @ b {tuple(b.shape)} -> out {tuple(c.shape)} "
                         "do not fit")
    if a.dtype not in _IN_DTYPES or b.dtype != a.dtype:
        raise TypeError(f"matmul kernel: operands must both be float16 or both bfloat16, got {a.dtype} and {b.dtype}")
    if c.dtype not in _OUT_DTYPES:
        raise TypeError(f"matmul kernel: output must be float16, bfloat16 or float32, got {c.dtype}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"matmul kernel: bias must have shape ({N},), got {tuple(bias.shape)}")
    if not (a.device == b.device == c.device) or (bias is not None and bias.device != a.device):
        raise ValueError("matmul kernel: all tensors must be on one device")


def kernel_args(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """The positional arguments of ``_matmul_kernel`` (up to the strides of C) for 2-D ``a @ b -> c``."""
    M, K = a.shape
    N = b.shape[1]
    return (a, b, c, bias if bias is not None else c, M, N, K, m_bucket(M), m_bucket(N), m_bucket(K),
            layout_code(a.stride(0), a.stride(1), b.stride(0), b.stride(1)),
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))


def tma_layout(t: torch.Tensor) -> bool | None:
    """How a TMA descriptor reads the 2-D operand ``t`` (rows, cols): ``False`` as itself (row-major:
    ``stride(1) == 1``), ``True`` as the row-major matrix ``t.T`` it is a view of (``stride(0) == 1``),
    ``None`` when TMA cannot read it (base not 16-byte aligned, no unit stride, the other stride not a
    positive multiple of 16 bytes, or rows overlapping)."""
    if t.data_ptr() % 16:
        return None
    rows, cols = t.shape
    s0, s1 = t.stride()
    esz = t.element_size()
    if s1 == 1 and s0 >= max(cols, 1) and (s0 * esz) % 16 == 0:
        return False
    if s0 == 1 and s1 >= max(rows, 1) and (s1 * esz) % 16 == 0:
        return True
    return None


def _descriptor(t: torch.Tensor, transposed: bool, block: list[int]) -> TensorDescriptor:
    """The TMA descriptor of operand ``t`` (or of the matrix ``t.T``, stored row-major, if ``transposed``)
    with the given block shape (out-of-bounds reads give zeros)."""
    rows, cols = t.shape
    if transposed:
        return TensorDescriptor(t, [cols, rows], [t.stride(1), 1], block)
    return TensorDescriptor(t, [rows, cols], [t.stride(0), 1], block)


def tma_kernel_args(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, a_t: bool,
                    b_t: bool, num_sms: int, cfg: dict | None = None) -> tuple:
    """The positional arguments of ``_matmul_tma_kernel`` (up to NUM_SMS) for 2-D ``a @ b -> c``, with
    ``a_t``/``b_t`` from :func:`tma_layout`. The descriptors get the block shapes of ``cfg`` (the
    autotuner's config pre-hook sets them per candidate when ``cfg`` is None)."""
    M, K = a.shape
    N = b.shape[1]
    bm, bn, bk = (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) if cfg else (64, 64, 64)
    a_desc = _descriptor(a, a_t, [bk, bm] if a_t else [bm, bk])
    b_desc = _descriptor(b, b_t, [bn, bk] if b_t else [bk, bn])
    return (a_desc, b_desc, c, bias if bias is not None else c, M, N, K, m_bucket(M), m_bucket(N), m_bucket(K),
            layout_code(a.stride(0), a.stride(1), b.stride(0), b.stride(1)), c.stride(0), c.stride(1), num_sms)


@functools.cache
def _cuda_info(index: int) -> tuple[tuple[int, int], int]:
    """(compute capability, number of SMs) of CUDA device ``index``, read once."""
    props = torch.cuda.get_device_properties(index)
    return torch.cuda.get_device_capability(index), props.multi_processor_count


def _gpu(device: torch.device, gpu: tuple[tuple[int, int], int] | None) -> tuple[tuple[int, int], int]:
    """``gpu`` when given (a GPU planned for, not present), else (capability, SMs) of CUDA ``device``."""
    return gpu if gpu is not None else _cuda_info(_device_index(device))


def _has_tma(capability: tuple[int, int]) -> bool:
    """Hopper (sm_90) and datacenter Blackwell (sm_100): TMA and >= 228 KB of shared memory per SM for the
    sm_90 configs (consumer Blackwell, sm_120, has TMA but about 100 KB)."""
    return capability[0] in (9, 10)


def fixed_config(device: torch.device | str) -> dict:
    """The tile config ``MPKERN_MATMUL_CONFIG=fixed`` runs on ``device`` (TMA-capable operands on a
    Hopper / datacenter Blackwell GPU: :data:`FIXED_CONFIG_SM90`; else :data:`FIXED_CONFIG`)."""
    device = torch.device(device)
    if device.type == "cuda" and _kernel_request() != "pointer" and _has_tma(_gpu(device, None)[0]):
        return FIXED_CONFIG_SM90
    return FIXED_CONFIG


def kernel_for(a: torch.Tensor, b: torch.Tensor, gpu: tuple[tuple[int, int], int] | None = None
               ) -> tuple[str, bool, bool]:
    """``("tma", a_t, b_t)`` when the TMA kernel runs ``a @ b``, ``("pointer", False, False)`` otherwise.

    TMA: on Hopper / datacenter Blackwell GPUs (capability 9.x / 10.x, read once per device, or that of
    ``gpu`` = (capability, SMs) when given) unless ``MPKERN_MATMUL_KERNEL=pointer``; under the interpreter
    only with ``MPKERN_MATMUL_KERNEL=tma``; and only when K > 0 and both operands pass :func:`tma_layout`
    (else the pointer kernel, which takes any strides)."""
    request = _kernel_request()
    if request == "pointer" or a.shape[1] == 0:
        return "pointer", False, False
    if gpu is None and (_interpreting() or a.device.type == "cpu"):
        if request != "tma":
            return "pointer", False, False
    elif not _has_tma(_gpu(a.device, gpu)[0]):
        return "pointer", False, False
    a_t, b_t = tma_layout(a), tma_layout(b)
    if a_t is None or b_t is None:
        return "pointer", False, False
    return "tma", a_t, b_t


def launch_flags(kind: str, has_bias: bool, accumulate: bool, out_bf16: bool, interp: bool, a_t: bool = False,
                 b_t: bool = False) -> dict[str, Any]:
    """The constexpr arguments (all but the config's) of a launch of the ``"pointer"`` or ``"tma"`` kernel."""
    flags: dict[str, Any] = dict(HAS_BIAS=has_bias, ACCUMULATE=accumulate, OUT_BF16=out_bf16, UPCAST=interp)
    if kind == "tma":
        flags.update(A_T=a_t, B_T=b_t, EPI_SLICE_BYTES=INTERPRET_EPI_SLICE_BYTES if interp else EPI_SLICE_BYTES)
    return flags


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


_last_tuned: list[triton.Config | None] = [None]


def last_tuned_config() -> triton.Config | None:
    """The config the autotuner picked for the last tuned GPU launch of either kernel (None before one):
    the TMA kernel's on Hopper, the pointer kernel's elsewhere."""
    return _last_tuned[0]


class Launch(NamedTuple):
    """One kernel launch: the raw JIT function, its grid and its positional and keyword arguments (the
    constexprs and compile options) -- ``kernel[grid](*args, **kwargs)``."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict


def _prepare(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, accumulate: bool,
             gpu: tuple[tuple[int, int], int] | None) -> tuple[torch.Tensor, torch.Tensor | None, str, bool, bool, dict,
                                                              bool]:
    """``(c, bias, kind, a_t, b_t, flags, interp)`` of a launch: C as the kernel stores it (bf16 as int16
    bits), the fp32 contiguous bias, the kernel (:func:`kernel_for`) and its constexpr flags."""
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    out_bf16 = out.dtype == torch.bfloat16
    c = out.view(torch.int16) if out_bf16 else out
    interp = gpu is None and (_interpreting() or a.device.type == "cpu")
    kind, a_t, b_t = kernel_for(a, b, gpu)
    return c, bias, kind, a_t, b_t, launch_flags(kind, bias is not None, bool(accumulate), out_bf16, interp, a_t,
                                                 b_t), interp


def plan_launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None,
                accumulate: bool = False, *, gpu: tuple[tuple[int, int], int] | None = None,
                config: triton.Config | None = None) -> Launch:
    """The untuned launch of :func:`matmul_into` for checked 2-D operands with M, N > 0: the interpreter's
    (CPU tensors, :data:`INTERPRET_CONFIG`) or, with ``MPKERN_MATMUL_CONFIG=fixed`` on a GPU, the fixed config
    of the kernel :func:`kernel_for` picks (:data:`FIXED_CONFIG_SM90` / :data:`FIXED_CONFIG`); ``config``: one
    of the autotuner's configs instead. ``gpu``: ``(compute capability, number of SMs)`` to plan for instead
    of reading ``a``'s device (ahead-of-time compilation -- ``benchmarks/triton_aot.py``,
    ``benchmarks/matmul_sass.py`` -- plans GPU launches on meta tensors)."""
    M, N = a.shape[0], b.shape[1]
    c, bias, kind, a_t, b_t, flags, interp = _prepare(a, b, out, bias, accumulate, gpu)
    tma = kind == "tma"
    if config is not None:
        cfg, options = config.kwargs, {"num_warps": config.num_warps, "num_stages": config.num_stages}
    else:
        cfg = INTERPRET_CONFIG if interp else (FIXED_CONFIG_SM90 if tma else FIXED_CONFIG)
        options = {} if interp else (FIXED_LAUNCH_SM90 if tma else FIXED_LAUNCH)
    tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    if not tma:
        return Launch(pointer_kernel, (tiles,), kernel_args(a, b, c, bias), {**flags, **cfg, **options})
    sms = min(INTERPRET_SMS, tiles) if interp else _gpu(a.device, gpu)[1]
    return Launch(tma_kernel, (min(sms, tiles),), tma_kernel_args(a, b, c, bias, a_t, b_t, sms, cfg),
                  {**flags, **cfg, **options})


def _launch_tuned(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
                  accumulate: bool) -> None:
    M, N = a.shape[0], b.shape[1]
    c, bias, kind, a_t, b_t, flags, _ = _prepare(a, b, out, bias, accumulate, None)
    if kind == "tma":
        num_sms = _gpu(a.device, None)[1]

        def grid(meta):
            return (min(num_sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)

        with torch.cuda.device(a.device):
            _matmul_tma_kernel_tuned[grid](*tma_kernel_args(a, b, c, bias, a_t, b_t, num_sms), **flags)
        _last_tuned[0] = getattr(_matmul_tma_kernel_tuned, "best_config", None)
        return

    def grid_ptr(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    with torch.cuda.device(a.device):
        _matmul_kernel_tuned[grid_ptr](*kernel_args(a, b, c, bias), **flags)
    _last_tuned[0] = getattr(_matmul_kernel_tuned, "best_config", None)


def matmul_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None,
                accumulate: bool = False) -> torch.Tensor:
    """``out = a @ b (+ bias)`` or, with ``accumulate``, ``out += a @ b (+ bias)``; returns ``out``.

    ``a`` (M, K) and ``b`` (K, N): fp16 or bf16, any strides. ``out`` (M, N): fp16/bf16/fp32,
    any strides (fp32 when accumulating). ``bias``: (N,), any float dtype, added in fp32.
    The kernel (TMA on Hopper when the operands allow it, pointer loads otherwise): :func:`kernel_for`.
    """
    _check(a, b, out, bias)
    if accumulate and out.dtype != torch.float32:
        raise TypeError(f"matmul kernel: accumulating needs an fp32 output, got {out.dtype}")
    if a.shape[0] == 0 or b.shape[1] == 0:
        return out
    if _interpreting() or a.device.type == "cpu" or _fixed_config():
        launch = plan_launch(a, b, out, bias, accumulate)
        with device_guard(a.device):
            launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    else:
        _launch_tuned(a, b, out, bias, accumulate)
    return out


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` for 2-D ``a`` (M, K), ``b`` (K, N), fp32 accumulation, new output tensor."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype, device=a.device)
    return matmul_into(a, b, out, bias)
