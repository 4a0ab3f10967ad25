"""The Hugging Face Trainer recipe (docs/recipes.md): FusedAdamWMP on a bf16 model, checkpoint resume.

A tiny randomly initialised GPT-2 built from a config (no download) learns a counting pattern on
CPU. Checks: the loss falls; a run resumed from a checkpoint continues the uninterrupted run's
trajectory (same losses, same final weights), i.e. the fp32 masters and moments travel through
Trainer's optimizer.pt. Skips without transformers/accelerate.
"""

from __future__ import annotations

import pytest
import torch

import mpkern

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

VOCAB, LEN = 24, 16


class Counting(torch.utils.data.Dataset):
    """x_t = (start + step * t) mod VOCAB: predictable from the first two tokens."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + step * torch.arange(LEN)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_trainer(out_dir: str, max_steps: int) -> transformers.Trainer:
    """The recipe of docs/recipes.md: bf16 model, FusedAdamWMP (fp32 masters, clipping fused), Trainer clipping off."""
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LEN, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16)
    opt = mpkern.FusedAdamWMP(model.parameters(), lr=3e-3, weight_decay=0.0, max_grad_norm=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    args = transformers.TrainingArguments(
        output_dir=out_dir, max_steps=max_steps, per_device_train_batch_size=16, logging_steps=1,
        save_strategy="steps", save_steps=10, report_to=[], use_cpu=True, seed=0, data_seed=0,
        max_grad_norm=0.0,  # clipping is fused into FusedAdamWMP.step (max_grad_norm=1.0)
        bf16=False,         # params are bf16 already: no autocast needed
        dataloader_num_workers=0, disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=Counting(512), optimizers=(opt, sched))


def _losses(trainer):
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def test_trainer_loss_falls_and_resume_continues_the_trajectory(tmp_path):
    full = make_trainer(str(tmp_path / "full"), max_steps=20)
    full.train()
    lf = _losses(full)
    first, last = sum(lf[s] for s in range(1, 6)) / 5, sum(lf[s] for s in range(16, 21)) / 5
    assert last < first - 0.5, (first, last)  # nats; ln(24) = 3.18 at the start
    # the optimizer kept fp32 masters for the bf16 params, and they went into the checkpoint
    state = torch.load(tmp_path / "full" / "checkpoint-10" / "optimizer.pt", weights_only=False)["state"]
    assert all(st["master_param"].dtype == torch.float32 for st in state.values())

    resumed = make_trainer(str(tmp_path / "full"), max_steps=20)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-10"))
    lr_ = _losses(resumed)
    assert set(range(11, 21)) <= set(lr_)  # (steps 1-10 come from the checkpoint's trainer_state.json)
    for s in range(11, 21):
        assert lr_[s] == pytest.approx(lf[s], rel=1e-3, abs=1e-3), s
    for (n, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), n


def test_trainer_with_gradient_release_is_bitwise_the_regular_run(tmp_path):
    """docs/recipes.md's release recipe: Trainer's backward routed to ``opt.backward`` (the step and the fused
    clip inside backward, two passes); Trainer's own ``optimizer.step()`` is then a no-op. Same losses and
    weights as the regular run, every grad freed."""
    def run(out: str, release: bool) -> transformers.Trainer:
        trainer = make_trainer(out, max_steps=8)
        if release:
            regular = trainer.optimizer
            opt = mpkern.FusedAdamWMP(trainer.model.parameters(), lr=3e-3, weight_decay=0.0, max_grad_norm=1.0,
                                      release_grads=True)
            trainer.optimizer = opt
            trainer.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
            assert not regular.state
            trainer.accelerator.backward = lambda loss, **kw: opt.backward(loss)
        trainer.train()
        return trainer

    a, b = run(str(tmp_path / "a"), False), run(str(tmp_path / "b"), True)
    assert _losses(a) == _losses(b) and len(_losses(a)) == 8
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    assert all(p.grad is None for p in b.model.parameters())
    assert float(b.optimizer.state[next(b.model.parameters())]["step"]) == 8
