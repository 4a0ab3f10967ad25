"""What :func:`mpkern.diagnose` returns: per-layer numbers, per-parameter gradient numbers, findings.

:class:`Diagnosis` prints as a table (``str()``), serialises with :meth:`Diagnosis.to_dict` (JSON:
non-finite numbers become ``null``) and draws error and headroom by layer with :meth:`Diagnosis.plot`.
Records read by attribute or by key (``f.kind`` or ``f["kind"]``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch


class _Record:
    """Attribute records that also read like dicts (``r["name"]``) and turn into JSON-able dicts."""

    def __getitem__(self, key: str) -> Any:
        if key not in {f.name for f in fields(self)}:  # type: ignore[arg-type]
            raise KeyError(key)
        return getattr(self, key)

    def keys(self) -> list[str]:
        return [f.name for f in fields(self)]  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(asdict(self))  # type: ignore[call-overload]


def _jsonable(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.dtype):
        return str(x).replace("torch.", "")
    return x


@dataclass
class LayerStats(_Record):
    """One module (every call of it in the run aggregated: worst error, largest value, sum of counts).

    * ``rel_err`` -- its **own** error: the module alone in the recipe on the fp32 run's input
      (cast to the dtypes the 16-bit run gave it) against its fp32 output, norm-wise relative;
    * ``acc_rel_err`` -- the error accumulated by the whole 16-bit run at its output;
    * ``max_abs`` / ``headroom_bits`` -- the largest |value| of a 16-bit tensor made inside it
      (true fp32 magnitude for values that overflowed) and ``log2(dtype max / max_abs)``; None when
      nothing in it is 16-bit (an fp32 island, or an op autocast runs in fp32);
    * ``overflow_count`` -- inf/NaN elements its own ops made from finite inputs;
    * ``underflow_frac`` -- of its fp32 output's nonzero values, the fraction below the dtype's
      smallest normal (subnormal or zero in 16 bits: lost to range, not rounding); None when its
      output is not 16-bit in the recipe.
    """

    name: str
    type: str
    calls: int
    out_dtype: str | None
    kept_fp32: bool
    rel_err: float | None
    acc_rel_err: float | None
    max_abs: float | None
    headroom_bits: float | None
    overflow_count: int
    underflow_frac: float | None
    passthrough: bool = False
    note: str | None = None


@dataclass
class GradStats(_Record):
    """One parameter's gradient in the 16-bit dtype at loss scale ``Diagnosis.loss_scale``.

    From the fp32 run's true gradient: ``underflow_frac`` (nonzero elements that would fall below the
    dtype's smallest normal once scaled), ``overflow_count`` (elements that would round to inf);
    observed in the recipe's own scaled backward: ``observed_nonfinite`` and ``observed_zero_frac``
    (elements exactly zero where the fp32 gradient is not).
    """

    param: str
    module: str
    numel: int
    nonzero: int
    max_abs: float
    underflow_frac: float
    overflow_count: int
    observed_nonfinite: int
    observed_zero_frac: float | None


@dataclass
class Finding(_Record):
    """A problem, where it is introduced, the numbers behind it and what to change."""

    module: str
    kind: str  # overflow | underflow | precision | grad_overflow | grad_underflow
    message: str
    fix: str
    numbers: dict[str, Any] = field(default_factory=dict)


@dataclass
class Diagnosis:
    """The result of :func:`mpkern.diagnose`. See the module docstring for the formats."""

    dtype: torch.dtype
    recipe: str
    loss_scale: float | None
    layers: list[LayerStats]
    findings: list[Finding]
    first_overflow: str | None
    grads: list[GradStats] = field(default_factory=list)
    scale_range: tuple[int, int] | None = None  # exponents: loss scales 2**lo .. 2**hi fit
    kept_fp32: list[str] = field(default_factory=list)
    thresholds: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def layer(self, name: str) -> LayerStats:
        """The :class:`LayerStats` of module ``name`` (qualified, ``""`` is the model itself)."""
        for lay in self.layers:
            if lay.name == name:
                return lay
        raise KeyError(f"no module {name!r} ran in the diagnosed forward")

    @property
    def ok(self) -> bool:
        """No findings."""
        return not self.findings

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: ``dtype``, ``recipe``, ``loss_scale``, ``first_overflow``, ``kept_fp32``,
        ``scale_range``, ``thresholds``, ``layers`` / ``grads`` / ``findings`` (lists of dicts)."""
        return _jsonable({
            "dtype": self.dtype, "recipe": self.recipe, "loss_scale": self.loss_scale,
            "first_overflow": self.first_overflow, "kept_fp32": list(self.kept_fp32),
            "scale_range": None if self.scale_range is None else list(self.scale_range),
            "thresholds": dict(self.thresholds), "seconds": self.seconds,
            "layers": [asdict(x) for x in self.layers], "grads": [asdict(g) for g in self.grads],
            "findings": [asdict(f) for f in self.findings]})

    def __str__(self) -> str:
        return format_table(self)

    def plot(self, path: str | None = None) -> Any:
        """Own and accumulated error (log) and headroom in bits, by layer; saved to ``path`` if given.

        Returns the matplotlib ``Figure``; raises ``ImportError`` naming the package without matplotlib.
        """
        try:
            import matplotlib

            if path is not None:
                matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError as e:  # pragma: no cover - matplotlib is a test extra
            raise ImportError("Diagnosis.plot needs matplotlib (pip install matplotlib)") from e
        rows = [x for x in self.layers if not x.passthrough]
        xs = list(range(len(rows)))
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 0.28 * len(rows) + 3), 7), sharex=True)
        dt = _jsonable(self.dtype)
        for key, label, marker in (("rel_err", "own error (module alone, fp32 input)", "o"),
                                   ("acc_rel_err", "accumulated error of the run", "x")):
            ys = [getattr(x, key) for x in rows]
            ax1.semilogy([i for i, y in zip(xs, ys) if y], [y for y in ys if y], marker, label=label, ms=4)
        if self.thresholds.get("precision"):
            ax1.axhline(self.thresholds["precision"], ls="--", c="r", lw=0.8, label="precision finding above")
        ax1.set_ylabel("relative error")
        ax1.legend(fontsize=8)
        ax1.set_title(f"mpkern.diagnose: {dt} ({self.recipe}) against fp32")
        hb = [x.headroom_bits if x.headroom_bits is not None and math.isfinite(x.headroom_bits) else 0.0 for x in rows]
        ax2.bar(xs, hb, color=["tab:red" if h < 0 else "tab:blue" for h in hb])
        ax2.axhline(0, c="k", lw=0.8)
        ax2.set_ylabel(f"headroom to {dt} max (bits)")
        ax2.set_xticks(xs)
        ax2.set_xticklabels([x.name or "<model>" for x in rows], rotation=90, fontsize=6)
        for f in self.findings:
            if f.module in {x.name for x in rows}:
                ax2.annotate(f.kind, (next(i for i, x in zip(xs, rows) if x.name == f.module), 0),
                             fontsize=7, color="tab:red", rotation=90, va="bottom")
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=120)
        return fig


def _num(x: float | None, fmt: str = ".2e") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else "-inf"
    return format(x, fmt)


def format_table(d: Diagnosis) -> str:
    """The text report: one row per module that ran, then the findings with their fixes."""
    dt = _jsonable(d.dtype)
    head = (f"mpkern.diagnose: {dt} ({d.recipe}) against fp32"
            + (f", loss scale {d.loss_scale:g}" if d.loss_scale is not None else "")
            + f" -- {len(d.layers)} modules, {d.seconds:.1f} s")
    cols = ("module", "type", "out", "max|x|", "headroom", "overflow", "<normal", "own err", "run err")
    rows = []
    for x in d.layers:
        tag = " [fp32]" if x.kept_fp32 else ""
        rows.append(((x.name or "<model>") + tag, x.type, (x.out_dtype or "-").replace("float", "f"),
                     _num(x.max_abs), _num(x.headroom_bits, "+.1f"), str(x.overflow_count or "."),
                     "-" if x.underflow_frac is None else f"{100 * x.underflow_frac:.1f}%",
                     _num(x.rel_err), _num(x.acc_rel_err)))
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    widths[0] = min(widths[0], 48)

    def fmt(r: Sequence[str]) -> str:
        return "  ".join(s[:w].ljust(w) if i < 3 else s.rjust(w) for i, (s, w) in enumerate(zip(r, widths)))

    lines = [head, fmt(cols), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows]
    if d.grads:
        lo_hi = ("no single scale fits" if d.scale_range and d.scale_range[0] > d.scale_range[1] else
                 f"2^{d.scale_range[0]} .. 2^{d.scale_range[1]}" if d.scale_range else "-")
        worst = max(d.grads, key=lambda g: g.underflow_frac)
        lines.append(f"gradients: {len(d.grads)} params; loss scales that keep them in {dt}: {lo_hi}; "
                     f"most underflow: {worst.param} {100 * worst.underflow_frac:.1f}%")
    lines.append(f"first overflow: {d.first_overflow if d.first_overflow is not None else 'none'}"
                 + (f"; fp32 islands: {', '.join(d.kept_fp32)}" if d.kept_fp32 else ""))
    if not d.findings:
        lines.append("findings: none -- this model runs in " + dt + " like it does in fp32")
    else:
        lines.append(f"findings ({len(d.findings)}):")
        for i, f in enumerate(d.findings, 1):
            lines.append(f"{i:2d}. [{f.kind}] {f.module or '<model>'}: {f.message}")
            lines.append(f"    fix: {f.fix}")
    return "\n".join(lines)
