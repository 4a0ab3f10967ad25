"""``benchmarks/fidelity_text.py`` -- the storage modes' fidelity on real text, in bits per byte.

The numbers themselves are a benchmark; here: the parts the numbers rest on, against references
written in the test (the corpus read byte for byte, every validation byte scored once, bits/byte of
models whose cross-entropy is known in closed form), and a smoke run of ``main`` on a tiny config.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "fidelity_text.py")


@pytest.fixture(scope="module")
def ft():
    spec = importlib.util.spec_from_file_location("fidelity_text", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(path, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def test_corpus_files_take_seeds_then_docs_and_fall_back_to_docs(ft, tmp_path):
    seeds, docs = tmp_path / "seeds", tmp_path / "docs"
    _write(str(docs / "b.md"), b"b")
    _write(str(docs / "sub" / "a.md"), b"a")
    _write(str(docs / "skip.png"), b"\x89PNG")
    assert ft.corpus_files(str(seeds), str(docs)) == [str(docs / "b.md"), str(docs / "sub" / "a.md")]
    _write(str(seeds / "2.txt"), b"two")
    _write(str(seeds / "1.md"), b"one")
    assert ft.corpus_files(str(seeds), str(docs)) == [str(seeds / "1.md"), str(seeds / "2.txt"),
                                                      str(docs / "b.md"), str(docs / "sub" / "a.md")]
    with pytest.raises(ValueError, match="no text files"):
        ft.corpus_files(str(tmp_path / "none"), str(tmp_path / "none2"))


def test_read_corpus_keeps_the_bytes_and_holds_out_the_last_tenth(ft, tmp_path):
    one, two = b"caf\xc3\xa9\r\nline\n" * 7, b"x" * 30  # UTF-8 and CRLF kept as bytes
    _write(str(tmp_path / "1.md"), one)
    _write(str(tmp_path / "2.md"), two)
    train, val = ft.read_corpus([str(tmp_path / "1.md"), str(tmp_path / "2.md")])
    data = one + two
    assert len(val) == len(data) // 10
    assert bytes(torch.cat([train, val]).to(torch.uint8).tolist()) == data
    assert bytes(val.to(torch.uint8).tolist()) == data[len(data) - len(data) // 10:]
    _write(str(tmp_path / "bad.md"), b"\xff\xfe")
    with pytest.raises(UnicodeDecodeError):
        ft.read_corpus([str(tmp_path / "bad.md")])
    with pytest.raises(ValueError, match="val_fraction"):
        ft.read_corpus([str(tmp_path / "1.md")], val_fraction=1.0)


def test_val_windows_score_every_byte_after_the_first_once(ft):
    context = 8
    val = torch.arange(3 * context + 1 + 5) % 256
    w = ft.val_windows(val, context)
    assert w.shape == (3, context + 1)
    assert torch.equal(w[:, 1:].reshape(-1), val[1:3 * context + 1])
    assert torch.equal(w[:, :-1].reshape(-1), val[:3 * context])
    with pytest.raises(ValueError, match="context=8"):
        ft.val_windows(val[:8], context)


class _Fixed(torch.nn.Module):
    """Logits 0 everywhere except ``boost`` at byte ``favourite``, whatever the input (bf16 params)."""

    def __init__(self, favourite: int, boost: float) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(torch.zeros(256, dtype=torch.bfloat16))
        with torch.no_grad():
            self.logits[favourite] = boost

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(*x.shape, 256)


@pytest.mark.parametrize("boost", [0.0, 4.0])
def test_bits_per_byte_matches_the_closed_form(ft, boost):
    windows = torch.full((5, 17), 97)
    got = ft.bits_per_byte(_Fixed(97, boost), windows, batch=2)
    # -log2 of the probability softmax gives byte 97: e^b / (e^b + 255)
    want = -math.log2(math.exp(boost) / (math.exp(boost) + 255))
    assert got == pytest.approx(want, rel=1e-6)
    assert got == pytest.approx(8.0 if boost == 0 else 2.50347, abs=1e-5)  # log2(256); log2(1 + 255 e^-4)


def test_main_smoke_table_and_json(ft, tmp_path, capsys):
    docs = tmp_path / "docs"
    text = b"".join(f"Line {i}: mixed precision keeps a master copy of the weights.\n".encode() for i in range(120))
    _write(str(docs / "t.md"), text)
    mode = "mpkern 8-bit master + 8-bit moments"
    out_path = tmp_path / "out.json"
    out = ft.main(["--steps", "5", "--batch", "4", "--context", "32", "--layers", "1", "--d-model", "32",
                   "--heads", "2", "--only", "8-bit master + 8-bit", "--seeds-dir", str(tmp_path / "absent"),
                   "--docs-dir", str(docs), "--threads", str(torch.get_num_threads()), "--json", str(out_path)])
    assert json.loads(out_path.read_text()) == json.loads(json.dumps(out))
    assert out["corpus"]["files"] == [str(docs / "t.md")] and out["corpus"]["bytes"] == len(text)
    assert out["corpus"]["val_bytes"] == len(text) // 10
    assert list(out["rows"]) == ["fp32 AdamW", mode]
    ref = out["rows"]["fp32 AdamW"]["val_bits_per_byte"]
    for row in out["rows"].values():
        assert set(row) >= {"val_bits_per_byte", "diff_bits_per_byte", "within_tolerance", "train_loss",
                            "state_B_per_param", "seconds"}
        assert 0 < row["val_bits_per_byte"] < 16 and math.isfinite(row["train_loss"])
        assert row["diff_bits_per_byte"] == pytest.approx(row["val_bits_per_byte"] - ref, abs=1e-12)
        assert row["within_tolerance"] == (abs(row["diff_bits_per_byte"]) <= 0.005)
    assert out["rows"]["fp32 AdamW"]["diff_bits_per_byte"] == 0
    table = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")]
    assert "within 0.005" in table[0] and "val bits/byte" in table[0]
    assert [ln.split(" | ")[0][2:] for ln in table[1:]] == ["fp32 AdamW", mode]
    assert all(ln.count("|") == 8 for ln in table)


def test_main_refuses_bad_sizes(ft):
    with pytest.raises(ValueError, match="--d-model"):
        ft.main(["--d-model", "0"])
    with pytest.raises(ValueError, match="d_model=30 is not a multiple of heads=4"):
        ft.Block(30, 4)
