"""Measured peak of training-state + gradient bytes of a GPT-2-sized model, regular vs gradient release
(issue 30), on the CPU.

The model: GPT-2 small (``transformers.GPT2LMHeadModel(GPT2Config())``: 124M params, lm_head tied to
the token embedding; built from the config, no download) in bf16 params; without ``transformers`` a
stack of ``nn.Linear`` of the same shapes (12 blocks of 768 -> 2304, 768 -> 768, 768 -> 3072,
3072 -> 768, the 50257 x 768 embedding tied to the head). One step is a forward of ``--batch`` x
``--tokens`` tokens, the backward and the ``FusedAdamWMP`` step, each way:

* regular: ``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)``;
* release: ``FusedAdamWMP(..., release_grads=True)`` and ``opt.backward(loss)`` (with ``--clip``, the
  default 1.0, two backward passes; ``--clip 0``: one).

for the optimizer state ``master_weights=True`` + fp32 moments and ``master_weights="8bit"`` +
``state_dtype="4bit_m"``.

The meter: every grad is followed from its arrival to its free. A post-accumulate-grad hook
registered on every param *before* the optimizer's (so it runs first and sees ``p.grad`` before a
release hook takes it into its bucket) records the grad's storage and adds its bytes to the live
count, and ``weakref.finalize`` on that storage takes them off when it is freed -- wherever it is
held: ``.grad``, a release bucket, a step's argument list. The peak of the live count over the
measured step (the second: the state exists from the first) is the gradient peak; hooks are the
only places it grows, so sampling there finds it exactly. (Counting only ``p.grad`` from a hook
registered after the optimizer's would miss the grads in a release bucket: their ``.grad`` is
already None.) The persistent state -- weights, masters, moments -- is counted from the tensors
after the step (:func:`mpkern.bytemodel.count_state`). The optimizer's own ``release.peak_bytes``
(the bucket bytes it held at once) is printed beside it as a cross-check.

    python benchmarks/release_memory.py [--tokens 128] [--batch 1] [--clip 1.0] [--bucket-bytes N]
                                        [--threads N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mpkern
from mpkern import bytemodel
from mpkern.bench.common import backward_step
from mpkern.measure import fmt_size, machine_info

#: (label, FusedAdamWMP keywords) of the optimizer states measured
STATES = (("master_weights=True, fp32 moments", {"master_weights": True, "state_dtype": torch.float32}),
          ("master_weights='8bit', state_dtype='4bit_m'", {"master_weights": "8bit", "state_dtype": "4bit_m"}))
VOCAB, WIDTH, LAYERS, POSITIONS = 50257, 768, 12, 1024


class LinearStack(nn.Module):
    """GPT-2 small's parameter shapes as plain ``nn.Linear`` layers (no attention), head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(POSITIONS, WIDTH)
        self.blocks = nn.ModuleList(nn.ModuleList([nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH),
                                                   nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)])
                                    for _ in range(LAYERS))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for qkv, proj, fc1, fc2 in self.blocks:
            h = h + proj(qkv(h)[..., :WIDTH])
            h = h + fc2(F.gelu(fc1(h)))
        return h @ self.wte.weight.t()


def model_source() -> str:
    """What :func:`build_model` builds here."""
    try:
        import transformers
    except ImportError:
        return "nn.Linear stack of GPT-2 small's shapes (transformers not installed)"
    return f"transformers {transformers.__version__} GPT2LMHeadModel(GPT2Config()), random init"


def build_model(seed: int = 0) -> nn.Module:
    """GPT-2 small from ``transformers``' config (random init), else :class:`LinearStack`; bf16."""
    torch.manual_seed(seed)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return LinearStack().to(torch.bfloat16)
    return GPT2LMHeadModel(GPT2Config()).to(torch.bfloat16)


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (fp32 logits)."""
    out = model(input_ids=ids) if hasattr(model, "config") else model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())


class GradMeter:
    """Live bytes of every grad from its arrival (a post-accumulate-grad hook registered before the
    optimizer's) to the free of its storage; ``peak`` since the last :meth:`reset`."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.live = self.peak = 0
        self._seen: set[int] = set()
        self.handles = [p.register_post_accumulate_grad_hook(self._arrived) for p in params]

    def _arrived(self, p: torch.Tensor) -> None:
        st = p.grad.untyped_storage()
        key = id(st)
        if key not in self._seen:  # a grad accumulated into again is counted once
            self._seen.add(key)
            self.live += st.nbytes()
            weakref.finalize(st, self._freed, key, st.nbytes())
        self.peak = max(self.peak, self.live)

    def _freed(self, key: int, n: int) -> None:
        self._seen.discard(key)
        self.live -= n

    def reset(self) -> None:
        self.peak = self.live


def measure(kwargs: dict[str, Any], release: bool, ids: torch.Tensor, clip: float | None,
            bucket_bytes: int | None) -> dict[str, Any]:
    """One configuration: a warm step (the state exists from it on), then the measured step; its bytes
    by category."""
    model = build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    meter = GradMeter(params)  # before the optimizer: its hooks run first
    extra = {"release_grads": True, "release_bucket_bytes": bucket_bytes} if release else {}
    opt = mpkern.FusedAdamWMP(params, lr=1e-4, max_grad_norm=clip, **kwargs, **extra)

    def step() -> None:
        backward_step(opt, lm_loss(model, ids))

    step()
    meter.reset()
    step()
    state = bytemodel.count_state(params, opt)
    n = state.params
    out = {"params": n, "grad_peak_bytes": meter.peak, "grads_left_bytes": meter.live,
           "weights_bytes": state.bytes["weights"], "masters_bytes": state.bytes["masters"],
           "moments_bytes": state.bytes["moments"]}
    out["total_peak_bytes"] = out["weights_bytes"] + out["masters_bytes"] + out["moments_bytes"] + meter.peak
    if release:
        rel = opt.mpkern_runtime.release
        out.update(bucket_bytes=opt.release_bucket_bytes, optimizer_peak_bucket_bytes=rel.peak_bytes,
                   backward_passes=rel.passes)
    out["bytes_per_param"] = {k.removesuffix("_bytes"): v / n for k, v in out.items()
                              if k.endswith("_bytes") and "bucket" not in k}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per sequence (default 128)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    ap.add_argument("--clip", type=float, default=1.0, help="max_grad_norm (default 1.0; 0: none, one pass)")
    ap.add_argument("--bucket-bytes", type=int, default=None,
                    help="release_bucket_bytes (default: the optimizer's, 32 MiB)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clip = args.clip or None
    what = model_source()
    ids = torch.randint(0, VOCAB, (args.batch, args.tokens), generator=torch.Generator().manual_seed(1))
    info = machine_info(torch.device("cpu")) | {"model": what, "tokens": args.tokens, "batch": args.batch,
                                                "max_grad_norm": clip}
    print(f"{info['device']}, torch {info['torch']}, {info['threads']} threads, {info['timestamp']}")
    print(f"model: {what}; batch {args.batch} x {args.tokens} tokens, bf16 params, max_grad_norm {clip}\n")
    rows = []
    for label, kwargs in STATES:
        for release in (False, True):
            t0 = time.perf_counter()
            r = measure(kwargs, release, ids, clip, args.bucket_bytes)
            r.update(state=label, release=release, wall_s=time.perf_counter() - t0)
            rows.append(r)
    n = rows[0]["params"]
    print(f"{n:,} params. Bytes/param of the measured peak (weights + masters + moments persist; grads: the most "
          "alive at once during the step)\n")
    print("| optimizer state | step | weights | masters | moments | grads (peak) | total | total bytes | "
          "optimizer's bucket peak | backward passes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = r["bytes_per_param"]
        how = f"release, bucket {fmt_size(r['bucket_bytes'])}" if r["release"] else "regular"
        print(f"| {r['state']} | {how} | {b['weights']:.3g} | {b['masters']:.3g} | {b['moments']:.4g} | "
              f"{b['grad_peak']:.3g} | {b['total_peak']:.4g} | {fmt_size(r['total_peak_bytes'])} | "
              f"{fmt_size(r.get('optimizer_peak_bucket_bytes'))} | {r.get('backward_passes', 1)} |")
    print()
    for reg, rel in zip(rows[::2], rows[1::2]):
        saved = reg["total_peak_bytes"] - rel["total_peak_bytes"]
        print(f"{reg['state']}: release {rel['bytes_per_param']['total_peak']:.4g} vs regular "
              f"{reg['bytes_per_param']['total_peak']:.4g} B/param: {fmt_size(saved)} less "
              f"({100 * saved / reg['total_peak_bytes']:.1f} %); grads at the peak {fmt_size(rel['grad_peak_bytes'])} "
              f"vs {fmt_size(reg['grad_peak_bytes'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": info, "rows": rows}, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
