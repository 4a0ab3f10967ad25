"""Issue 7, point 7: ``convert(fp32_main_grad=True)`` driven through Hugging Face ``Trainer``.

Trainer calls ``model.zero_grad()`` (not the optimizer's), and its ``max_grad_norm`` clips with
``torch.nn.utils.clip_grad_norm_``, which sees ``.grad`` only -- so with ``main_grad`` the recipe is
``TrainingArguments(max_grad_norm=0)`` + ``FusedAdamWMP(max_grad_norm=...)`` (clipping fused into
the step, over ``main_grad``). Before the fix, ``main_grad`` was never cleared by
``model.zero_grad()``, so the optimizer saw gradients summed over all previous steps, and
resuming from a checkpoint was not bitwise. Skips without transformers/accelerate.
"""

from __future__ import annotations

import pytest
import torch

import mpkern

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

VOCAB, SEQ = 64, 16


def _model(seed: int, main_grad: bool) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    return mpkern.nn.convert(model, fp32_main_grad=main_grad)


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _train(tmp_path, main_grad: bool, max_steps: int, resume: str | None = None, save_steps: int = 1000):
    model = _model(0, main_grad)
    opt = mpkern.FusedAdamWMP(model.parameters(), lr=3e-3, weight_decay=0.0, max_grad_norm=1.0)
    norms: list[float] = []
    used_main_grad: list[bool] = []

    class Norms(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            used_main_grad.append(getattr(model.lm_head.weight, "main_grad", None) is not None)

        def on_optimizer_step(self, args, state, control, **kw):
            norms.append(float(opt.last_grad_norm))  # a host read, in the test only

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, max_grad_norm=0.0, logging_steps=1, save_steps=save_steps,
        save_strategy="steps", report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
        dataloader_num_workers=0, lr_scheduler_type="constant")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data(64, 1),
                                   optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)),
                                   callbacks=[Norms()])
    trainer.train(resume_from_checkpoint=resume)
    assert used_main_grad and all(u == main_grad for u in used_main_grad)  # the fp32 path really ran
    return model, norms


def test_trainer_main_grad_norms_match_plain_grads(tmp_path):
    _, with_main = _train(tmp_path / "a", True, 4)
    _, plain = _train(tmp_path / "b", False, 4)
    assert len(with_main) == len(plain) == 4
    # same model, data and steps: fp32 main_grad vs bf16 .grad differ by bf16 rounding only, not by
    # the 2x-3x of gradients accumulated over previous steps
    for a, b in zip(with_main, plain):
        assert a == pytest.approx(b, rel=0.05)


def test_trainer_main_grad_resume_is_bitwise(tmp_path):
    full, _ = _train(tmp_path / "full", True, 4)
    _train(tmp_path / "part", True, 2, save_steps=2)
    resumed, _ = _train(tmp_path / "part", True, 4, resume=str(tmp_path / "part" / "checkpoint-2"))
    for (n, a), b in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n
