"""``mpkern.matmul`` against the platform's GEMM in TFLOP/s, route by route.

Per GEMM (the GPT-2-small and Llama-7B layer shapes: forward, input gradient and weight gradient,
in ``nn.Linear``'s layouts, plus on CUDA the square and LLM shapes of the first GPU run): the
platform GEMM a PyTorch user runs (``torch.matmul`` in the operand dtype), every route of
:mod:`mpkern.matmul_routes` forced in turn, and ``mpkern.matmul`` as it runs by default (the route
it chose, timed once and cached). The weight gradients also run as ``main_grad += dY^T X`` into an
fp32 ``main_grad`` against :func:`wgrad_accumulate_peer`. Each shape's calls are timed in
alternation (median; the order rotated each round, so no call always follows the cache-cold upcast
GEMM), so a slow stretch of a shared machine falls on all of them alike. :func:`bench_linear_e2e`
times a model's forward + backward with ``torch.nn.Linear`` and with ``mpkern.nn.Linear`` side by
side. (The Triton kernel's accuracy against float64 is ``tests/test_matmul.py``'s, in the
interpreter on a CPU.)
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ..measure import time_alternating
from .common import Tensor, row

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
GPU_SQUARE = [(4096, 4096, 4096), (8192, 8192, 8192)]
GPU_LLM = (16384, 4096, 11008)  # M, K, N
#: (model, layer, in_features K, out_features N); shapes shared by several layers are listed once
MODEL_LAYERS = [
    ("gpt2-small", "attn.c_attn", 768, 2304), ("gpt2-small", "attn.c_proj", 768, 768),
    ("gpt2-small", "mlp.c_fc", 768, 3072), ("gpt2-small", "mlp.c_proj", 3072, 768),
    ("gpt2-small", "lm_head", 768, 50257),
    ("llama-7b", "q/k/v/o_proj", 4096, 4096), ("llama-7b", "gate/up_proj", 4096, 11008),
    ("llama-7b", "down_proj", 11008, 4096),
]
#: tokens per GEMM (batch x sequence): CPU quick / full, CUDA quick / full
TOKENS = {"cpu": (256, 1024), "cuda": (2048, 8192)}
#: shapes the quick CPU run leaves out (seconds each on two cores)
CPU_QUICK_SKIP = ("lm_head", "gate/up_proj", "down_proj")


def wgrad_accumulate_peer(device: torch.device | str) -> tuple[str, Callable[[Tensor, Tensor, Tensor], Tensor]]:
    """``(name, fn)``: what a PyTorch user runs for ``main_grad += a @ b`` with 16-bit ``a``, ``b`` and
    an fp32 ``main_grad`` -- fp32 accumulation throughout, the product never rounded to 16 bits:

    * ``torch.addmm(mg, a, b, out_dtype=fp32, out=mg)``: one GEMM with an fp32 C and beta 1 (what
      Megatron's fused wgrad kernel does), where this torch has it on ``device``;
    * else ``mg.add_(torch.mm(a, b, out_dtype=fp32))`` (an fp32 product, then an add pass);
    * else ``mg.addmm_(a.float(), b.float())`` (upcast copies, an fp32 GEMM; older torch, CPU).
    """
    dev = torch.device(device)

    def fused(a, b, mg):
        return torch.addmm(mg, a, b, out_dtype=torch.float32, out=mg)

    def two_pass(a, b, mg):
        return mg.add_(torch.mm(a, b, out_dtype=torch.float32))

    def upcast(a, b, mg):
        return mg.addmm_(a.float(), b.float())

    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=g).to(torch.bfloat16).to(dev)
    b = torch.randn(16, 16, generator=g).to(torch.bfloat16).to(dev)
    want = a.double() @ b.double() + 1.0
    for name, fn in (("torch.addmm(out_dtype=fp32, out=main_grad)", fused),
                     ("torch.mm(out_dtype=fp32) + main_grad.add_", two_pass)):
        try:
            got = fn(a, b, torch.ones(16, 16, device=dev)).double()
        except (RuntimeError, NotImplementedError, TypeError):  # this torch or device lacks it
            continue
        if torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            return name, fn
    return "main_grad.addmm_(a.float(), b.float())", upcast


def _randn(shape: tuple[int, ...], dt: torch.dtype, dev: torch.device, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.1).to(dev, dt)


#: the operand layouts of :func:`operands`
LAYOUTS = ("square", "fwd", "dgrad", "wgrad")


def operands(layout: str, m: int, n: int, k: int, dtype: torch.dtype,
             device: torch.device | str) -> tuple[Tensor, Tensor]:
    """``(a, b)`` for ``a (M, K) @ b (K, N)`` in one of nn.Linear's layouts (N(0, 0.1^2), drawn on the
    CPU from fixed seeds, so every device gets the same): ``"square"`` and ``"dgrad"`` (``dY @ W``)
    both operands row-major; ``"fwd"`` ``x @ W.T`` (W stored (N, K)); ``"wgrad"`` ``dY.T @ X`` (dY
    stored (K, M): the reduction runs over the tokens)."""
    dev = torch.device(device)
    if layout == "square":
        return _randn((m, k), dtype, dev, 1), _randn((k, n), dtype, dev, 2)
    if layout == "fwd":
        return _randn((m, k), dtype, dev, 1), _randn((n, k), dtype, dev, 2).t()
    if layout == "dgrad":
        return _randn((m, k), dtype, dev, 3), _randn((k, n), dtype, dev, 2)
    if layout == "wgrad":
        return _randn((k, m), dtype, dev, 3).t(), _randn((k, n), dtype, dev, 1)
    raise ValueError(f"operands: layout must be one of {LAYOUTS}, got {layout!r}")


def problems(device: torch.device | str, quick: bool) -> list[tuple[str, int, int, int, Callable]]:
    """``(name, M, N, K, make(dtype, device) -> (a, b))`` for ``a (M, K) @ b (K, N)``, in nn.Linear's
    layouts (:func:`operands`): forward ``x @ W.T`` (W stored (N, K)), input gradient ``dY @ W``,
    weight gradient ``dY.T @ X`` (the reduction over the tokens)."""
    dev = torch.device(device)
    out: list[tuple[str, int, int, int, Callable]] = []

    def case(name: str, layout: str, m: int, n: int, k: int) -> None:
        out.append((name, m, n, k, partial(operands, layout, m, n, k)))

    if dev.type == "cuda":
        for m, n, k in GPU_SQUARE[:1] if quick else GPU_SQUARE:
            case(f"square {m}^3", "square", m, n, k)
        big, k_, n_ = GPU_LLM
        if not quick:
            case(f"LLM fwd {big}x{k_}x{n_}", "fwd", big, n_, k_)
    t = TOKENS["cuda" if dev.type == "cuda" else "cpu"][0 if quick else 1]
    for model, layer, k, n in MODEL_LAYERS:
        if dev.type != "cuda" and quick and layer in CPU_QUICK_SKIP:
            continue
        tag = f"{model} {layer} T={t}"
        case(f"{tag} fwd", "fwd", t, n, k)
        case(f"{tag} dgrad", "dgrad", t, k, n)
        case(f"{tag} wgrad", "wgrad", n, k, t)
    return out


def _matmul_float(a: Tensor, b: Tensor) -> Tensor:
    """The peer of a 16-bit GEMM with an fp32 output where ``torch.mm`` takes no ``out_dtype``."""
    return torch.matmul(a, b).float()


def _forced(route: str | None, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run with ``MPKERN_MATMUL_ROUTE=route`` (None: the default, auto)."""
    from ..matmul import use_route

    def go() -> Any:
        with use_route(route):
            return fn()
    return go


def bench_matmul(device: torch.device | str, *, quick: bool = False, dtypes: str = "bf16,fp16", reps: int = 20,
                 log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every route of ``mpkern.matmul`` and its default choice against ``torch.matmul`` in TFLOP/s
    (16-bit outputs; fp32 outputs on the forward GEMMs; ``main_grad +=`` on the weight gradients)."""
    import mpkern

    from .. import matmul_routes
    from ..matmul import matmul_accumulate_, routes

    dev = torch.device(device)
    rows: list[dict[str, Any]] = []
    mm_out = matmul_routes.has_mm_out_dtype(dev)
    if dev.type != "cuda":
        reps = min(reps, 5 if quick else 7)
    for dname in dtypes.split(","):
        if dname not in DTYPES:
            raise ValueError(f"dtypes: {dname!r} is not one of {list(DTYPES)}")
        dt = DTYPES[dname]
        for name, m, n, k, make in problems(dev, quick):
            a, b = make(dt, dev)
            flops = 2.0 * m * n * k
            outs = [(dname, dt)] + ([("fp32", torch.float32)] if name.endswith("fwd") or "square" in name else [])
            for out_name, od in outs:
                label = f"{name} {dname}->{out_name}"
                if od == dt:
                    peer, peer_fn = "torch.matmul", partial(torch.matmul, a, b)
                elif mm_out:
                    peer, peer_fn = "torch.mm(out_dtype=fp32)", partial(torch.mm, a, b, out_dtype=torch.float32)
                else:
                    peer, peer_fn = "torch.matmul + .float()", partial(_matmul_float, a, b)
                cands = [r for r, why in routes(dev, dt, od).items() if not why]
                fns = {peer: peer_fn} | {f"route {r}": _forced(r, partial(mpkern.matmul, a, b, out_dtype=od))
                                         for r in cands}
                fns["mpkern.matmul (default)"] = partial(mpkern.matmul, a, b, out_dtype=od)
                fns["mpkern.matmul (default)"]()  # the default's one timing of this shape happens here
                took = matmul_routes.route_for(a, b, None, od)
                rows += _rows(label, fns, peer, flops, dev, reps, log, took)
            if name.endswith("wgrad"):
                mg = torch.zeros(m, n, device=dev, dtype=torch.float32)
                peer, peer_acc = wgrad_accumulate_peer(dev)
                cands = [r for r, why in routes(dev, dt, epilogue="accumulate").items() if not why]
                fns = {peer: partial(peer_acc, a, b, mg)}
                fns |= {f"route {r}": _forced(r, partial(matmul_accumulate_, a, b, mg)) for r in cands}
                fns["mpkern (default)"] = partial(matmul_accumulate_, a, b, mg)
                fns["mpkern (default)"]()
                took = matmul_routes.route_for(a, b, None, torch.float32, mg)
                rows += _rows(f"{name} {dname} +=main_grad", fns, peer, flops, dev, reps, log, took)
            del a, b
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def _rows(label: str, fns: dict[str, Callable[[], Any]], peer: str, flops: float, dev: torch.device, reps: int,
          log: Callable[[str], None], took: str) -> list[dict[str, Any]]:
    """Time ``fns`` in alternation; one row each, mpkern's with their speed over ``peer``'s."""
    reps = -(-reps // len(fns)) * len(fns)  # a multiple of the calls: each follows each other equally often
    times = dict(zip(fns, time_alternating([(fn, None) for fn in fns.values()], dev, reps=reps, warmup=1,
                                           rotate=True)))
    peer_rate = flops / times[peer] / 1e12
    out = [row("matmul", f"{peer}: {label}", times[peer], flops=flops, bound=peer_rate)]
    parts = [f"{peer} {peer_rate:.2f}"]
    for name, t in times.items():
        if name == peer:
            continue
        shown = f"{name} -> {took}" if "default" in name else name
        out.append(row("matmul", f"{shown}: {label}", t, flops=flops, bound=peer_rate, vs=peer,
                       peer_ratio=times[peer] / t))
        parts.append(f"{shown} {flops / t / 1e12:.2f} ({times[peer] / t:.2f}x)")
    log(f"matmul {label} TFLOP/s: " + ", ".join(parts))
    return out


def bench_linear_e2e(device: torch.device | str, *, model: str = "gpt2", dtype: torch.dtype = torch.bfloat16,
                     seq: int = 1024, batch: int = 1, reps: int = 3,
                     log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Forward + backward of a randomly initialised ``transformers`` model (``"gpt2"``: GPT-2 small;
    ``"llama"``: a 4-layer Llama of GPT-2-small width, all nn.Linear) in ``dtype``, timed in
    alternation: with ``torch.nn.Linear``, converted with ``mpkern.nn.convert``, and converted with
    ``fp32_main_grad=True``. GPT-2's attention and MLP projections are ``transformers`` Conv1D layers,
    which ``convert`` leaves alone: there only ``lm_head`` (the largest GEMM) changes hands."""
    import copy

    import transformers

    from .. import nn as mpnn

    dev = torch.device(device)
    cfg: transformers.PretrainedConfig
    base: torch.nn.Module
    if model == "gpt2":
        cfg = transformers.GPT2Config(n_positions=max(1024, seq))
        base = transformers.GPT2LMHeadModel(cfg)
    elif model == "llama":
        cfg = transformers.LlamaConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=4,
                                       num_attention_heads=12, num_key_value_heads=12, vocab_size=32000,
                                       max_position_embeddings=max(2048, seq))
        base = transformers.LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"model must be 'gpt2' or 'llama', got {model!r}")
    # transformers wraps PreTrainedModel.to in functools.wraps, whose _Wrapped type mypy does not bind as a method
    base = base.to(dev, dtype)  # type: ignore[arg-type]
    models = {"torch.nn.Linear": base, "mpkern.nn.convert": mpnn.convert(copy.deepcopy(base)),
              "mpkern.nn.convert(fp32_main_grad)": mpnn.convert(copy.deepcopy(base), fp32_main_grad=True)}
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(dev)

    def step(m: torch.nn.Module) -> Callable[[], None]:
        def go() -> None:
            m(input_ids=ids, labels=ids).loss.backward()
            for p in m.parameters():
                p.grad = None
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad = None  # type: ignore[attr-defined]  # the attribute mpkern.nn adds to weights
        return go

    converted = sum(isinstance(mod, mpnn.Linear) for mod in models["mpkern.nn.convert"].modules())
    times = dict(zip(models, time_alternating([(step(m), None) for m in models.values()], dev, reps=reps, warmup=1)))
    base_t = times["torch.nn.Linear"]
    out = []
    for name, t in times.items():
        out.append(row("linear-e2e", f"{name}: {model} {str(dtype)[6:]} {batch}x{seq} fwd+bwd ({converted} Linear "
                       "converted)", t, vs=None if name == "torch.nn.Linear" else "torch.nn.Linear",
                       peer_ratio=None if name == "torch.nn.Linear" else base_t / t))
        log(f"linear-e2e {model} {batch}x{seq} {name}: {t * 1e3:.0f} ms ({base_t / t:.2f}x of torch.nn.Linear)")
    return out
