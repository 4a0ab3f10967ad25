"""Recipe: PEFT LoRA adapters on a bf16 base model, trained with ``FusedAdamWMP`` (docs/recipes.md).

* PEFT's default (``autocast_adapter_dtype=True``) makes the adapters fp32 on a bf16 base: then
  FusedAdamWMP has nothing to keep a master for and runs as fp32 AdamW (16 B per adapter param).
  ``autocast_adapter_dtype=False`` keeps them bf16 and FusedAdamWMP keeps their fp32 masters.
* Training touches the adapters only: every frozen base weight stays bit-identical.
* The adapters save and reload (``save_pretrained`` / ``PeftModel.from_pretrained``) to the same
  values and the same outputs; with the optimizer's state dict (fp32 masters) a reloaded run
  continues bit for bit.

Skips without transformers/peft.
"""

from __future__ import annotations

import pytest
import torch

import mpkern

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, LEN = 32, 12


def _base() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=LEN)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)


def _lora(model: torch.nn.Module, autocast_adapter_dtype: bool) -> torch.nn.Module:
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                          init_lora_weights=True)
    torch.manual_seed(1)
    return peft.get_peft_model(model, cfg, autocast_adapter_dtype=autocast_adapter_dtype)


def _batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 8, 1), generator=g)
    return list((start + torch.arange(LEN)) % VOCAB)  # counting sequences: learnable


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> list[float]:
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def _adapters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("autocast_adapter_dtype, adapter_dtype", [(True, torch.float32), (False, torch.bfloat16)])
def test_adapter_dtype_decides_what_the_optimizer_keeps(autocast_adapter_dtype, adapter_dtype):
    model = _lora(_base(), autocast_adapter_dtype)
    ad = _adapters(model)
    assert ad and all("lora_" in n for n in ad) and all(p.dtype == adapter_dtype for p in ad.values())
    opt = mpkern.FusedAdamWMP(ad.values(), lr=1e-2, weight_decay=0.0, max_grad_norm=1.0)
    _train(model, opt, _batches(1))
    for p in ad.values():
        st = opt.state[p]
        held = sum(t.numel() * t.element_size() for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
        # fp32 adapters: moments only (8 B) -- the param is its own master; bf16: fp32 master (4) + moments (8)
        assert held == p.numel() * (8 if adapter_dtype == torch.float32 else 12), p.dtype
        assert ("master_param" in st) == (adapter_dtype == torch.bfloat16)


def test_lora_trains_adapters_only_and_reloads(tmp_path):
    base = _base()
    frozen = {n: p.detach().clone() for n, p in base.named_parameters()}
    model = _lora(base, autocast_adapter_dtype=False)
    ad = _adapters(model)
    before = {n: p.detach().clone() for n, p in ad.items()}
    opt = mpkern.FusedAdamWMP(ad.values(), lr=1e-2, weight_decay=0.0, max_grad_norm=1.0)
    losses = _train(model, opt, _batches(12))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses
    # every base weight bit-identical; every lora_B moved (PEFT initialises it to zero)
    for n, p in model.get_base_model().named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, frozen[n.replace(".base_layer", "")]), n
    assert all(not torch.equal(p, before[n]) for n, p in ad.items() if "lora_B" in n)
    # save and reload the adapters onto a fresh copy of the base
    model.save_pretrained(tmp_path)
    again = peft.PeftModel.from_pretrained(_base(), tmp_path, autocast_adapter_dtype=False, is_trainable=True)
    ad2 = _adapters(again)
    assert ad2.keys() == ad.keys()
    for n in ad:
        assert ad2[n].dtype == torch.bfloat16 and torch.equal(ad2[n], ad[n]), n
    ids = _batches(1, seed=5)[0]
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)


def test_lora_resume_with_optimizer_state_is_bitwise(tmp_path):
    """The saved adapters are bf16; the fp32 masters live in the optimizer's state dict. Saved and
    loaded together, a reloaded run continues exactly like the uninterrupted one."""
    batches = _batches(8)
    full = _lora(_base(), autocast_adapter_dtype=False)
    opt = mpkern.FusedAdamWMP(_adapters(full).values(), lr=1e-2, weight_decay=0.0, max_grad_norm=1.0)
    _train(full, opt, batches)

    part = _lora(_base(), autocast_adapter_dtype=False)
    opt = mpkern.FusedAdamWMP(_adapters(part).values(), lr=1e-2, weight_decay=0.0, max_grad_norm=1.0)
    _train(part, opt, batches[:4])
    part.save_pretrained(tmp_path)
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")

    resumed = peft.PeftModel.from_pretrained(_base(), tmp_path, autocast_adapter_dtype=False, is_trainable=True)
    # the same parameter order as at save time (state dicts map params by position)
    assert list(_adapters(resumed)) == list(_adapters(part))
    opt = mpkern.FusedAdamWMP(_adapters(resumed).values(), lr=1e-2, weight_decay=0.0, max_grad_norm=1.0)
    opt.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=False))
    _train(resumed, opt, batches[4:])
    for (n, a), b in zip(_adapters(full).items(), _adapters(resumed).values()):
        assert torch.equal(a, b), n
