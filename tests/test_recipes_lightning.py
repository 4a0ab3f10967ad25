"""Recipe: PyTorch Lightning with ``configure_optimizers`` returning ``FusedAdamWMP`` (docs/recipes.md).

* ``precision="bf16-true"``: Lightning casts the module to bf16; FusedAdamWMP keeps the fp32
  masters; clipping goes into ``FusedAdamWMP(max_grad_norm=...)`` (checked through the first
  moment, which holds the clipped gradient after step 1) and a run resumed with
  ``trainer.fit(..., ckpt_path=...)`` ends on the uninterrupted run's weights bit for bit.
* ``precision="16-mixed"`` (and ``"bf16-mixed"``): Lightning refuses ``gradient_clip_val`` with an
  optimizer that unscales inside its step ("Are you using a 'fused' optimizer?") -- the recipe is
  ``max_grad_norm``, which clips the *unscaled* gradients inside the step.

Skips without lightning.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import mpkern

L = pytest.importorskip("lightning")

D_IN, CLASSES, BATCH = 12, 3, 16


def _data(n: int = 48) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, D_IN, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()  # 3 classes, learnable
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)


class Tiny(L.LightningModule):
    def __init__(self, max_grad_norm: float | None = 1.0, lr: float = 1e-2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(D_IN, 32), torch.nn.GELU(), torch.nn.Linear(32, CLASSES))
        self.max_grad_norm, self.lr = max_grad_norm, lr
        self.losses: list[float] = []
        self.grads: list[list[torch.Tensor]] = []   # float64 copies of the grads each step saw
        self.scales: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x.to(self.dtype)).float(), y)
        self.losses.append(float(loss))  # host read: test bookkeeping only
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.grads.append([p.grad.detach().double().clone() for p in self.parameters()])
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        self.scales.append(float(scaler.get_scale()) if scaler is not None else 1.0)

    def configure_optimizers(self):
        return mpkern.FusedAdamWMP(self.parameters(), lr=self.lr, weight_decay=0.0, max_grad_norm=self.max_grad_norm)


def _trainer(tmp_path, precision: str, max_epochs: int, **kw) -> L.Trainer:
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path), save_top_k=-1, every_n_epochs=1,
                                               filename="{epoch}")
    return L.Trainer(accelerator="cpu", devices=1, precision=precision, max_epochs=max_epochs, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=[ckpt], deterministic=True,
                     **kw)


def _fit(tmp_path, precision="bf16-true", max_epochs=2, ckpt_path=None, **kw):
    model = Tiny(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes about num_workers etc.
        _trainer(tmp_path, precision, max_epochs).fit(model, _data(), ckpt_path=ckpt_path)
    return model


def _opt(model) -> mpkern.FusedAdamWMP:
    opt = model.optimizers()
    return getattr(opt, "optimizer", opt)  # unwrap LightningOptimizer


def test_bf16_true_keeps_masters_and_clips_in_the_step(tmp_path):
    model = _fit(tmp_path, max_epochs=1, max_grad_norm=0.05)
    opt = _opt(model)
    assert isinstance(opt, mpkern.FusedAdamWMP)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # Lightning cast the module
    st = [opt.state[p] for p in model.parameters()]
    assert all(s["master_param"].dtype == torch.float32 for s in st)
    # the last step's norm against a float64 norm of the grads that step saw
    last = model.grads[-1]
    ref = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in last]))
    assert float(opt.last_grad_norm) == pytest.approx(float(ref), rel=1e-4)
    assert len(model.grads) == 3 and model.losses[-1] < model.losses[0]


def test_bf16_true_clip_reaches_the_first_moment(tmp_path):
    """After one step exp_avg = (1 - beta1) * clip_coef * grad: the clip was applied in the step."""
    model = Tiny(max_grad_norm=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(accelerator="cpu", devices=1, precision="bf16-true", max_steps=1, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False
                  ).fit(model, _data())
    opt = _opt(model)
    grads = model.grads[0]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    coef = min(1.0, 0.05 / (norm + 1e-6))
    assert coef < 0.5  # the threshold really clips here
    for p, g in zip(model.parameters(), grads):
        want = (1 - 0.9) * coef * g
        assert torch.allclose(opt.state[p]["exp_avg"].double(), want, rtol=1e-5, atol=1e-9)


def test_bf16_true_resume_from_ckpt_path_is_bitwise(tmp_path):
    full = _fit(tmp_path / "full", max_epochs=2)
    _fit(tmp_path / "part", max_epochs=1)
    ckpt = tmp_path / "part" / "epoch=0.ckpt"
    assert ckpt.exists()
    saved = torch.load(ckpt, weights_only=False)["optimizer_states"][0]["state"]
    assert all(s["master_param"].dtype == torch.float32 for s in saved.values())
    resumed = _fit(tmp_path / "part", max_epochs=2, ckpt_path=str(ckpt))
    for (n, a), b in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n
    assert resumed.losses == full.losses[3:]  # the second epoch's losses, exactly


def _mixed16() -> list:
    """fp16 AMP with a GradScaler. ``precision="16-mixed"`` on CPU becomes bf16-mixed in Lightning
    (it says so), so the plugin is given explicitly -- what ``"16-mixed"`` builds on a GPU."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_refuses_gradient_clip_val(precision):
    kw = {"plugins": _mixed16()} if precision == "16-mixed" else {"precision": precision}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, gradient_clip_val=1.0, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="fused"):
            trainer.fit(Tiny(max_grad_norm=None), _data())


def test_16_mixed_with_max_grad_norm_clips_the_unscaled_grads(tmp_path):
    """The recipe instead of gradient_clip_val: FusedAdamWMP(max_grad_norm=...). Lightning leaves the
    unscaling to the optimizer, so the hook sees the grads still multiplied by the loss scale; the
    fused norm is that of the unscaled grads."""
    model = Tiny(max_grad_norm=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, plugins=_mixed16()).fit(model, _data())
    opt = _opt(model)
    grads, scale = model.grads[-1], model.scales[-1]
    assert scale > 1.0
    ref = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) / scale
    assert float(opt.last_grad_norm) == pytest.approx(ref, rel=1e-4)
    assert float(opt.last_found_inf) == 0.0
