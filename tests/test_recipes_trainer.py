"""Recipes with Hugging Face ``Trainer`` (docs/recipes.md), against the real library.

* ``Trainer(optimizer_cls_and_kwargs=(mpkern.FusedAdamWMP, {...}))``: Trainer builds its own two
  weight-decay groups (no decay for biases and norms) and hands them to FusedAdamWMP; the lr comes
  from the kwargs (Trainer does not add ``args.learning_rate`` there). Resume is bitwise.
* The lessons' GPT-2 shape: ``AutoModelForCausalLM`` from a tiny ``GPT2Config`` (no download), whose
  ``lm_head`` is tied to ``wte``, in bf16 with FusedAdamWMP: the loss falls and a resumed run ends
  on the uninterrupted run's weights bit for bit, with ``mpkern.nn.convert(fp32_main_grad=True)``:
  the tied weight gets ``main_grad`` from the ``lm_head`` GEMM and ``.grad`` from the embedding, and
  every consumer must use their sum (the same model without convert: ``tests/test_trainer.py``).

Skips without transformers/accelerate.
"""

from __future__ import annotations

import re

import pytest
import torch

import mpkern

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

# the same counting task as the first Trainer recipe
from test_trainer import LEN, VOCAB, Counting  # noqa: E402 -- needs transformers: imported after importorskip


def _args(out: str, max_steps: int, **kw) -> transformers.TrainingArguments:
    base = dict(output_dir=out, max_steps=max_steps, per_device_train_batch_size=16, logging_steps=1,
                save_strategy="steps", save_steps=max(1, max_steps // 2), report_to=[], use_cpu=True, seed=0,
                data_seed=0, max_grad_norm=0.0, bf16=False, dataloader_num_workers=0, disable_tqdm=True,
                lr_scheduler_type="constant")
    return transformers.TrainingArguments(**(base | kw))


def _losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def _gpt2(convert: bool) -> torch.nn.Module:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LEN, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie this test is about
    if convert:
        mpkern.nn.convert(model, fp32_main_grad=True)
    return model


# ---- optimizer_cls_and_kwargs -------------------------------------------------------------------
def _llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=LEN,
                                   attention_bias=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)


_KW = {"lr": 3e-3, "betas": (0.9, 0.98), "max_grad_norm": 1.0}


def _cls_trainer(out: str, max_steps: int) -> transformers.Trainer:
    return transformers.Trainer(model=_llama(), args=_args(out, max_steps, weight_decay=0.1),
                                train_dataset=Counting(256), optimizer_cls_and_kwargs=(mpkern.FusedAdamWMP, _KW))


def test_optimizer_cls_and_kwargs_gets_trainers_weight_decay_groups(tmp_path):
    trainer = _cls_trainer(str(tmp_path), 4)
    trainer.train()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(opt, mpkern.FusedAdamWMP)
    # the groups, rebuilt here from the names: no decay for biases and norm weights, 0.1 for the rest
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    no_decay = re.compile(r"bias|norm")
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    decayed = {names[id(p)] for p in opt.param_groups[0]["params"]}
    plain = {names[id(p)] for p in opt.param_groups[1]["params"]}
    assert decayed == {n for n in names.values() if not no_decay.search(n)}
    assert plain == {n for n in names.values() if no_decay.search(n)} and plain
    assert any(n.endswith(".bias") for n in plain)  # attention_bias=True: biases exist and are not decayed
    for g in opt.param_groups:  # the kwargs reached every group; Trainer's own lr did not replace them
        assert g["lr"] == _KW["lr"] and g["betas"] == _KW["betas"] and g["max_grad_norm"] == 1.0
    st = opt.state_dict()["state"]
    assert len(st) == len(names) and all(s["master_param"].dtype == torch.float32 for s in st.values())


def test_optimizer_cls_and_kwargs_resume_is_bitwise(tmp_path):
    full = _cls_trainer(str(tmp_path / "full"), 6)
    full.train()
    part = _cls_trainer(str(tmp_path / "part"), 6)
    part.args.max_steps = 3  # stop at the checkpoint (save_steps=3)
    part.train()
    resumed = _cls_trainer(str(tmp_path / "part"), 6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-3"))
    for (n, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), n


# ---- GPT-2 with tied embeddings -----------------------------------------------------------------
def _gpt2_trainer(out: str, max_steps: int, convert: bool, save_steps: int) -> transformers.Trainer:
    model = _gpt2(convert)
    opt = mpkern.FusedAdamWMP(model.parameters(), lr=3e-3, weight_decay=0.0, max_grad_norm=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    return transformers.Trainer(model=model, args=_args(out, max_steps, save_steps=save_steps),
                                train_dataset=Counting(512), optimizers=(opt, sched))


def test_gpt2_tied_weights_fp32_main_grad_loss_falls_and_resume_is_bitwise(tmp_path):
    """(The same model without convert: tests/test_trainer.py.)"""
    convert = True
    full = _gpt2_trainer(str(tmp_path / "full"), 16, convert, save_steps=8)
    full.train()
    lf = _losses(full)
    first, last = sum(lf[s] for s in range(1, 5)) / 4, sum(lf[s] for s in range(13, 17)) / 4
    assert last < first - 0.5, (first, last)  # nats; ln(24) = 3.18 at the start
    model = full.model
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied after training
    assert isinstance(model.lm_head, mpkern.nn.Linear) and model.lm_head.fp32_main_grad
    resumed = _gpt2_trainer(str(tmp_path / "full"), 16, convert, save_steps=8)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-8"))
    lr_ = _losses(resumed)
    for s in range(9, 17):
        assert lr_[s] == pytest.approx(lf[s], rel=1e-3, abs=1e-3), s
    for (n, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), n


def test_gpt2_tied_weight_gets_both_gradients(tmp_path):
    """The tied weight's gradient is the lm_head part plus the embedding part. Reference: the same
    model in float64 (autograd sums the two uses of the one Parameter). With fp32_main_grad the two
    parts land in different places (main_grad and .grad); the optimizer's norm must cover both."""
    ids = Counting(8).ids
    ref = _gpt2(False).double()
    out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ref.parameters()]))
    for convert in (False, True):
        model = _gpt2(convert)
        opt = mpkern.FusedAdamWMP(model.parameters(), lr=1e-3, max_grad_norm=1e9)
        model(input_ids=ids, labels=ids).loss.backward()
        norm = opt.clip_grad_norm_(1e9)
        # bf16 forward/backward vs float64: within a few percent
        assert float(norm) == pytest.approx(float(ref_norm), rel=0.05), convert
