"""Fidelity of FusedAdamWMP's storage modes against fp32 AdamW on real English text (a byte-level LM).

The real-text companion of ``fidelity_compact.py`` (whose ``MODES`` it trains): a small causal
transformer over bytes (vocab 256) learns the Markdown/plain-text corpus of ``/work/shared/seeds``
(``*.md`` and ``*.txt``; skipped when the folder is absent) and ``docs/*.md``, read as UTF-8 bytes
and concatenated in sorted order; the last 10 % of the bytes are held out. Every mode starts from the
same initial weights (fixed seed; bf16 params for the mpkern modes, as fidelity_compact) and sees the
same batches; lr 1e-3, weight decay 0.01, max_grad_norm 1.0 (mpkern: the optimizer's own clip; torch
AdamW: ``clip_grad_norm_``). Each mode reports validation **bits per byte** -- mean cross-entropy
(nats) / ln 2 over every byte of the held-out windows (non-overlapping, ``context + 1`` bytes each),
evaluated on an fp32 copy of the model -- and its difference to fp32 AdamW's; the issue-43 bar is
``|difference| <= 0.005`` bits/byte ("within 0.005").

The backend is whatever FusedAdamWMP picks here (printed); ``MPKERN_BACKEND=torch`` runs the
reference codecs (pure PyTorch) instead. One thread unless ``--threads``. This is a benchmark (it
trains models), not a test: run it by hand and record the numbers in ``benchmarks/RESULTS.md``.

    OMP_NUM_THREADS=1 python benchmarks/fidelity_text.py [--steps 600] [--only 8-bit,4-bit] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import math
import os
import pathlib
import platform
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import mpkern
from mpkern.optim import storage

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:  # the sibling benchmark, imported by name as the other benchmarks do
    sys.path.insert(0, HERE)
from fidelity_compact import MODES  # noqa: E402

SEEDS = "/work/shared/seeds"
DOCS = os.path.join(ROOT, "docs")
REFERENCE = "fp32 AdamW"
TOLERANCE = 0.005  # bits/byte, issue 43 item 1


def corpus_files(seeds: str = SEEDS, docs: str = DOCS) -> list[str]:
    """The corpus's files in reading order: ``seeds``' ``*.md`` and ``*.txt`` (none when the folder is
    absent), then ``docs``' ``*.md``, each folder searched recursively and sorted by path."""
    files: list[str] = []
    if os.path.isdir(seeds):
        files += sorted(p for ext in ("md", "txt") for p in glob.glob(os.path.join(seeds, "**", f"*.{ext}"),
                                                                        recursive=True))
    files += sorted(glob.glob(os.path.join(docs, "**", "*.md"), recursive=True))
    if not files:
        raise ValueError(f"corpus: no text files under seeds={seeds!r} or docs={docs!r}")
    return files


def read_corpus(files: list[str], val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """The files' UTF-8 bytes concatenated, as int64 byte values split into (train, validation): the last
    ``val_fraction`` of the bytes is the validation part."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    data = b"".join(pathlib.Path(p).read_bytes() for p in files)
    data.decode("utf-8")  # the corpus must be UTF-8 text: raises UnicodeDecodeError naming the offset if not
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    n_val = int(len(ids) * val_fraction)
    return ids[:-n_val], ids[-n_val:]


def val_windows(val: torch.Tensor, context: int) -> torch.Tensor:
    """Non-overlapping windows of ``context + 1`` bytes over ``val`` (the tail shorter than one dropped):
    inputs ``w[:, :-1]``, targets ``w[:, 1:]``; every byte after the first is a target exactly once."""
    n = (len(val) - 1) // context
    if n < 1:
        raise ValueError(f"context={context}: the validation part ({len(val)} bytes) holds no window")
    return torch.stack([val[i * context:i * context + context + 1] for i in range(n)])


def train_batches(train: torch.Tensor, steps: int, batch: int, context: int, seed: int) -> torch.Tensor:
    """Start offsets ``[steps, batch]`` of the training windows, drawn once so every mode sees the same."""
    if len(train) <= context + 1:
        raise ValueError(f"context={context}: the training part ({len(train)} bytes) is too short")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, len(train) - context - 1, (steps, batch), generator=g)


class Block(nn.Module):
    """A pre-norm transformer block: causal multi-head self-attention, then a 4x GELU MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} is not a multiple of heads={heads}")
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.fc1, self.fc2 = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ByteLM(nn.Module):
    """A causal byte-level language model: byte and position embeddings, ``layers`` blocks, a final norm
    and an untied head to 256 logits."""

    def __init__(self, layers: int, d_model: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, d_model), nn.Embedding(context, d_model)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h))


@torch.no_grad()
def bits_per_byte(model: nn.Module, windows: torch.Tensor, batch: int = 64) -> float:
    """Mean cross-entropy (nats) / ln 2 of ``model``'s next-byte predictions over every target of
    ``windows`` (see :func:`val_windows`), computed on an fp32 copy of ``model``."""
    ev = copy.deepcopy(model).float().eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch]
        logits = ev(w[:, :-1]).float()
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"))
        count += w[:, 1:].numel()
    return total / count / math.log(2)


def train_mode(name: str, base: nn.Module, train: torch.Tensor, starts: torch.Tensor, context: int,
               windows: torch.Tensor, lr: float, weight_decay: float, max_grad_norm: float) -> dict:
    """Train a copy of ``base`` with mode ``name`` of ``MODES`` over the batches ``starts``; returns its
    validation bits/byte, mean training loss of the last 10 % of steps, state bytes/param and seconds."""
    dtype, make, nbytes = MODES[name]
    model = copy.deepcopy(base).to(dtype)
    params = list(model.parameters())
    clip: float | None = None
    if isinstance(make, dict):
        opt = mpkern.FusedAdamWMP(params, lr=lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm, **make)
        nbytes = storage.state_bytes_per_param(make.get("master_weights", True), make.get("state_dtype", "float32"),
                                               dtype)
    else:
        assert callable(make), f"MODES[{name!r}]: neither mpkern options nor an optimizer factory"
        opt = make(params, lr, weight_decay)
        clip = max_grad_norm
    offsets = torch.arange(context + 1)
    losses = []
    t0 = time.perf_counter()
    for row in starts:
        w = train[row[:, None] + offsets]
        logits = model(w[:, :-1]).float()
        loss = F.cross_entropy(logits.reshape(-1, 256), w[:, 1:].reshape(-1))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - t0
    tail = max(1, len(losses) // 10)
    return {"val_bits_per_byte": bits_per_byte(model, windows), "train_loss": sum(losses[-tail:]) / tail,
            "state_B_per_param": nbytes, "seconds": seconds}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds-dir", default=SEEDS, help="folder of seed texts (*.md, *.txt); skipped if absent")
    ap.add_argument("--docs-dir", default=DOCS, help="folder of Markdown docs (*.md)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default="", metavar="SUBSTRING,...",
                    help="run only the modes whose name contains one of these (fp32 AdamW, the reference, always runs)")
    args = ap.parse_args(argv)
    for k in ("steps", "batch", "context", "layers", "d_model", "heads"):
        if getattr(args, k) < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; prints the corpus, the backend and a markdown table row per mode as it finishes,
    and returns (and with ``--json`` writes) ``{"config", "corpus", "backend", "rows": {mode: row}}``."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads or 1)
    wanted = [w for w in args.only.split(",") if w]
    names = [n for n in MODES if n == REFERENCE or not wanted or any(w in n for w in wanted)]
    files = corpus_files(args.seeds_dir, args.docs_dir)
    train, val = read_corpus(files)
    windows = val_windows(val, args.context)
    starts = train_batches(train, args.steps, args.batch, args.context, args.seed)
    torch.manual_seed(args.seed)
    base = ByteLM(args.layers, args.d_model, args.heads, args.context)
    n_params = sum(p.numel() for p in base.parameters())
    backend = mpkern.info()["selected_backend"]
    print(f"# fidelity of FusedAdamWMP storage modes vs fp32 AdamW on real text (byte LM) -- "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}, mpkern {mpkern.__version__}, backend {backend}")
    print(f"corpus: {len(files)} files, {len(train) + len(val)} bytes (train {len(train)}, validation {len(val)}, "
          f"{windows.shape[0]} windows = {windows[:, 1:].numel()} scored bytes)")
    for p in files:
        print(f"  {p}: {os.path.getsize(p)} bytes")
    print(f"model: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, context {args.context}, "
          f"{n_params} params; {args.steps} steps of {args.batch} x {args.context} bytes, lr {args.lr}, "
          f"wd {args.weight_decay}, max_grad_norm {args.max_grad_norm}, seed {args.seed}\n")
    print(f"| run | state B/param | val bits/byte | vs fp32 AdamW (bits/byte) | within {TOLERANCE} | "
          f"train loss (last 10 %) | seconds |")
    print("|---|---|---|---|---|---|---|")
    rows: dict[str, dict] = {}
    for name in names:
        r = train_mode(name, base, train, starts, args.context, windows, args.lr, args.weight_decay,
                       args.max_grad_norm)
        r["diff_bits_per_byte"] = r["val_bits_per_byte"] - rows.get(REFERENCE, r)["val_bits_per_byte"]
        r["within_tolerance"] = abs(r["diff_bits_per_byte"]) <= TOLERANCE
        rows[name] = r
        print(f"| {name} | {r['state_B_per_param']:g} | {r['val_bits_per_byte']:.4f} | "
              f"{r['diff_bits_per_byte']:+.4f} | {'yes' if r['within_tolerance'] else '**no**'} | "
              f"{r['train_loss']:.4f} | {r['seconds']:.1f} |", flush=True)
    out = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "only")} | {"params": n_params},
           "corpus": {"files": files, "bytes": len(train) + len(val), "train_bytes": len(train),
                      "val_bytes": len(val), "val_scored_bytes": windows[:, 1:].numel()},
           "backend": backend, "threads": torch.get_num_threads(), "tolerance_bits_per_byte": TOLERANCE,
           "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
