"""Gradient release (``FusedAdamWMP(release_grads=True)``, ``opt.backward``): the step inside backward.

The contract checked here, each time against the regular loop run side by side on a twin model
(the same weights, the same batches):

* bit-identical params, state tensors, ``last_grad_norm`` / ``last_found_inf`` to
  ``loss.backward(); opt.step()`` (and to GradScaler's ``scale/step/update`` with fp16), over many
  steps, for every storage mode, with and without the clip, tied weights, ``maximize``, tensor lr,
  param groups of different modes, on every backend;
* one backward pass without clip/scaler, two with either, one on an overflow (pass 2 skipped);
* every ``.grad`` None afterwards, ``step()`` a no-op, the grad bytes alive at once (measured
  independently, by weak references to every grad autograd made) within ``release_bucket_bytes``
  + the largest grad;
* refusals that change nothing; checkpoints across release and regular optimizers; copies.
"""

from __future__ import annotations

import copy
import pickle
import weakref

import pytest
import torch
import torch.nn.functional as F

import mpkern
from conftest import DEVICE
from mpkern.optim import buckets, release

BF16, FP16 = torch.bfloat16, torch.float16
VOCAB, DIM = 61, 24

MODES = [  # (master_weights, state_dtype)
    (True, torch.float32),
    ("remainder", torch.bfloat16),
    ("8bit", "8bit"),
    ("8bit", "4bit_m"),
    (False, torch.float32),
]


class _CountBackward(torch.autograd.Function):
    """Identity whose backward counts how often backward passes through it."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _CountBackward.calls += 1
        return g


class TinyLM(torch.nn.Module):
    """Embedding -> MLP -> head tied to the embedding (GPT-2's weight sharing)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.up = torch.nn.Linear(DIM, 3 * DIM)
        self.down = torch.nn.Linear(3 * DIM, DIM)
        self.norm = torch.nn.LayerNorm(DIM)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.down(F.gelu(self.up(h)))
        h = _CountBackward.apply(self.norm(h))
        return h @ self.emb.weight.t()  # the tied head: the embedding's hook fires once, after both uses


def make_model(dtype=BF16, seed=3):
    torch.manual_seed(seed)
    return TinyLM().to(device=DEVICE, dtype=dtype)


def lm_loss(model, x, y):
    return F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))


def batches(n, seed=11, scale_at=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, VOCAB, (4, 9), generator=g).to(DEVICE)
        y = torch.randint(0, VOCAB, (4, 9), generator=g).to(DEVICE)
        out.append((x, y))
    return out


def assert_same(model_a, opt_a, model_b, opt_b):
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(p, q), name
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert sa.keys() == sb.keys(), name
        for k in sa:
            va, vb = sa[k], sb[k]
            if isinstance(va, torch.Tensor):
                assert torch.equal(va, vb), (name, k)
            else:
                assert va == vb, (name, k)
    for attr in ("last_grad_norm", "last_found_inf"):
        va, vb = getattr(opt_a, attr), getattr(opt_b, attr)
        assert (va is None) == (vb is None), attr
        if va is not None:
            assert torch.equal(va.reshape(1).view(torch.int32), vb.reshape(1).view(torch.int32)), (attr, va, vb)


def twins(mode=(True, torch.float32), dtype=BF16, bucket=2000, **kw):
    master, sd = mode
    a, b = make_model(dtype), make_model(dtype)
    kw = dict(lr=3e-3, weight_decay=0.05, master_weights=master, state_dtype=sd, **kw)
    return a, mpkern.FusedAdamWMP(a.parameters(), **kw), b, mpkern.FusedAdamWMP(
        b.parameters(), release_grads=True, release_bucket_bytes=bucket, **kw)


def regular_step(model, opt, x, y):
    lm_loss(model, x, y).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"{m[0]}-{m[1]}")
@pytest.mark.parametrize("clip", [None, 0.3])
def test_bitwise_equal_to_regular_step(mode, clip):
    a, oa, b, ob = twins(mode, max_grad_norm=clip)
    for x, y in batches(6):
        regular_step(a, oa, x, y)
        ob.backward(lm_loss(b, x, y))
        assert all(p.grad is None for p in b.parameters())
        ob.step()  # a documented no-op after opt.backward
        assert_same(a, oa, b, ob)
    if clip is not None:  # the clip was active: the norm was above the threshold
        assert float(ob.last_grad_norm) > clip


def test_bitwise_on_every_backend(backend):
    a, oa, b, ob = twins(("8bit", "8bit"), max_grad_norm=0.3, bucket=3000)
    for x, y in batches(3):
        regular_step(a, oa, x, y)
        ob.backward(lm_loss(b, x, y))
        assert_same(a, oa, b, ob)


def test_maximize_tensor_lr_and_groups_of_different_modes():
    def build(model, **kw):
        lr = torch.tensor(2e-3, device=DEVICE)
        groups = [
            {"params": [model.emb.weight, model.norm.weight], "master_weights": "remainder",
             "state_dtype": torch.bfloat16},
            {"params": [model.up.weight, model.up.bias], "master_weights": "8bit", "state_dtype": "4bit_m",
             "maximize": True},
            {"params": [model.down.weight, model.down.bias, model.norm.bias], "weight_decay": 0.0},
        ]
        return mpkern.FusedAdamWMP(groups, lr=lr, max_grad_norm=0.4, **kw)

    a, b = make_model(), make_model()
    oa, ob = build(a), build(b, release_grads=True, release_bucket_bytes=1500)
    for x, y in batches(5):
        regular_step(a, oa, x, y)
        ob.backward(lm_loss(b, x, y))
        assert_same(a, oa, b, ob)


def test_fp32_and_bf16_params_mixed_in_one_group_keep_the_norm_order():
    """fp32 params have another master kind: step() buckets them apart, so its statistics order is not
    the param order -- the release norm must still be the same bits."""
    def build(model, **kw):
        torch.manual_seed(7)
        gain = torch.nn.Parameter(1 + 0.1 * torch.randn(VOCAB, device=DEVICE))  # fp32, between bf16 params
        bias = torch.nn.Parameter(0.1 * torch.randn(VOCAB, device=DEVICE))
        ps = list(model.parameters())
        return gain, bias, mpkern.FusedAdamWMP(ps[:2] + [gain] + ps[2:5] + [bias] + ps[5:], lr=1e-3,
                                                max_grad_norm=0.2, **kw)

    def loss(model, gain, bias, x, y):
        return F.cross_entropy((model(x).float() * gain + bias).reshape(-1, VOCAB), y.reshape(-1))

    a, b = make_model(), make_model()
    ga, ba, oa = build(a)
    gb, bb, ob = build(b, release_grads=True, release_bucket_bytes=700)
    for x, y in batches(4):
        loss(a, ga, ba, x, y).backward()
        oa.step()
        oa.zero_grad()
        ob.backward(loss(b, gb, bb, x, y))
        assert_same(a, oa, b, ob)
        assert torch.equal(ga, gb) and torch.equal(ba, bb)


def test_step_order_is_collects_order():
    m = make_model()
    m.norm.float()
    p32 = torch.nn.Parameter(torch.randn(5, device=DEVICE))
    groups = [{"params": list(m.parameters())[:3] + [p32] + list(m.parameters())[3:], "master_weights": True},
              {"params": [torch.nn.Parameter(torch.randn(3, device=DEVICE, dtype=BF16))], "master_weights": "8bit"}]
    opt = mpkern.FusedAdamWMP(groups)
    every = [p for g in opt.param_groups for p in g["params"]]
    for keep in (every, every[1::2], every[::3]):
        for p in every:
            p.grad = torch.randn_like(p) if any(p is q for q in keep) else None
        work, _ = buckets.collect(opt.param_groups)
        expected = [p for b in work for p, *_ in b.pairs]
        assert buckets.step_order(opt.param_groups, {id(p) for p in keep}) == expected


@pytest.mark.parametrize("clip", [None, 0.5])
def test_fp16_gradscaler_with_overflow(clip):
    a, oa, b, ob = twins((True, torch.float32), dtype=FP16, max_grad_norm=clip)
    sa = torch.amp.GradScaler(DEVICE.type, init_scale=2.0 ** 16, growth_interval=2)
    sb = torch.amp.GradScaler(DEVICE.type, init_scale=2.0 ** 16, growth_interval=2)
    skipped = 0
    for i, (x, y) in enumerate(batches(7)):
        scale = 1e4 if i == 3 else 1.0  # an overflow at step 3 (the fp16 loss-scaled grads reach inf)
        sa.scale(lm_loss(a, x, y) * scale).backward()
        sa.step(oa)
        sa.update()
        oa.zero_grad()
        _CountBackward.calls = 0
        ob.backward(lm_loss(b, x, y) * scale, scaler=sb)
        sb.update()
        overflow = float(ob.last_found_inf) > 0
        skipped += overflow
        assert _CountBackward.calls == (1 if overflow else 2)
        assert sa.get_scale() == sb.get_scale()
        assert_same(a, oa, b, ob)
    assert skipped >= 1  # the overflow really happened (and was skipped the same way)


def test_scaler_step_after_backward_is_a_no_op():
    a, oa, b, ob = twins((True, torch.float32), dtype=FP16)
    sa, sb = torch.amp.GradScaler(DEVICE.type), torch.amp.GradScaler(DEVICE.type)
    for x, y in batches(3):
        sa.scale(lm_loss(a, x, y)).backward()
        sa.step(oa)
        sa.update()
        oa.zero_grad()
        ob.backward(lm_loss(b, x, y), scaler=sb)
        sb.step(ob)  # what the regular loop calls: allowed, changes nothing
        sb.update()
        assert_same(a, oa, b, ob)


@pytest.mark.parametrize("clip,passes", [(None, 1), (1e-3, 2)])
def test_backward_pass_count(clip, passes):
    _, _, b, ob = twins(max_grad_norm=clip)
    x, y = batches(1)[0]
    _CountBackward.calls = 0
    ob.backward(lm_loss(b, x, y))
    assert _CountBackward.calls == passes
    assert ob.mpkern_runtime.release.passes == passes


def test_step_after_backward_changes_nothing():
    _, _, b, ob = twins(max_grad_norm=0.5)
    x, y = batches(1)[0]
    ob.backward(lm_loss(b, x, y))
    params = [p.clone() for p in b.parameters()]
    steps = [ob.state[p]["step"].clone() for p in b.parameters()]
    ob.step()
    ob.step()
    assert all(torch.equal(p, q) for p, q in zip(params, b.parameters()))
    assert all(torch.equal(s, ob.state[p]["step"]) for s, p in zip(steps, b.parameters()))


@pytest.mark.parametrize("bucket", [0, 1000])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_grad_bytes_alive_at_once(clip, bucket):
    """Every grad autograd makes is followed by a weak reference from a hook registered before the
    optimizer's: at each hook, the grads still alive anywhere (bucket, .grad) are summed. Bucket 0: every
    grad is stepped (or counted) the moment it arrives."""
    model = make_model()
    alive: list[tuple[weakref.ref, int]] = []
    peaks = []

    def meter(p):
        alive.append((weakref.ref(p.grad), p.grad.numel() * p.grad.element_size()))
        peaks.append(sum(n for r, n in alive if r() is not None))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(meter)
    opt = mpkern.FusedAdamWMP(model.parameters(), max_grad_norm=clip, release_grads=True,
                              release_bucket_bytes=bucket)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert total > 2 * (bucket + largest)  # the limit is a real one
    for x, y in batches(2):
        alive.clear()
        opt.backward(lm_loss(model, x, y))
        assert len(alive) == len(list(model.parameters())) * (1 if clip is None else 2)  # one grad per param per pass
        assert max(peaks) <= bucket + largest
        assert all(r() is None for r, _ in alive)  # nothing kept after backward
    assert opt.mpkern_runtime.release.peak_bytes <= bucket + largest


def test_plain_backward_without_clip_steps_in_backward():
    a, oa, b, ob = twins(("remainder", torch.bfloat16))
    for x, y in batches(4):
        regular_step(a, oa, x, y)
        lm_loss(b, x, y).backward()  # the hooks step; the last bucket at the end of backward
        assert all(p.grad is None for p in b.parameters())
        ob.step()  # no-op
        ob.zero_grad()
        assert_same(a, oa, b, ob)


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters() if p in opt.state})


def _unchanged(model, opt, snap):
    params, state = snap
    assert all(torch.equal(p, q) for p, q in zip(params, model.parameters()))
    for p in model.parameters():
        if id(p) in state:
            assert all(torch.equal(v, opt.state[p][k]) for k, v in state[id(p)].items())
        else:
            assert p not in opt.state or not opt.state[p]


def _warm(model, opt):
    x, y = batches(1, seed=5)[0]
    opt.backward(lm_loss(model, x, y))


@pytest.mark.parametrize("why", ["clip", "fp16"])
def test_plain_backward_refused_when_the_step_must_clip_or_scale(why):
    model = make_model(FP16 if why == "fp16" else BF16)
    opt = mpkern.FusedAdamWMP(model.parameters(), max_grad_norm=1.0 if why == "clip" else None,
                              release_grads=True)
    if why == "clip":
        _warm(model, opt)
    snap = _snapshot(model, opt)
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match=r"opt\.backward"):
        lm_loss(model, x, y).backward()
    _unchanged(model, opt, snap)
    assert all(p.grad is None for p in model.parameters())
    opt.backward(lm_loss(model, x, y), scaler=torch.amp.GradScaler(DEVICE.type) if why == "fp16" else None)


def test_gradient_accumulation_refused_nothing_changed():
    model = make_model()
    opt = mpkern.FusedAdamWMP(model.parameters(), release_grads=True)
    _warm(model, opt)
    model.up.weight.grad = torch.ones_like(model.up.weight)
    snap = _snapshot(model, opt)
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match="accumulation"):
        opt.backward(lm_loss(model, x, y))
    _unchanged(model, opt, snap)
    assert torch.equal(model.up.weight.grad, torch.ones_like(model.up.weight))  # the caller's grad is kept


def test_distributed_refused(monkeypatch):
    model = make_model()
    opt = mpkern.FusedAdamWMP(model.parameters(), release_grads=True)
    snap = _snapshot(model, opt)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match="DDP"):
        opt.backward(lm_loss(model, x, y))
    _unchanged(model, opt, snap)
    with pytest.raises(ValueError, match="process_group"):
        mpkern.FusedAdamWMP(model.parameters(), release_grads=True, process_group=object())


def test_fp32_main_grad_weights_refused():
    torch.manual_seed(0)
    model = torch.nn.Sequential(mpkern.nn.Linear(8, 16, fp32_main_grad=True), torch.nn.GELU(),
                                torch.nn.Linear(16, 4)).to(device=DEVICE, dtype=BF16)
    opt = mpkern.FusedAdamWMP(model.parameters(), release_grads=True)
    snap = _snapshot(model, opt)
    loss = model(torch.randn(5, 8, device=DEVICE, dtype=BF16)).float().square().mean()
    with pytest.raises(ValueError, match="main_grad"):
        opt.backward(loss)
    _unchanged(model, opt, snap)


def test_argument_errors():
    model = make_model()
    with pytest.raises(TypeError, match="release_bucket_bytes"):
        mpkern.FusedAdamWMP(model.parameters(), release_grads=True, release_bucket_bytes="1MB")
    for bad in (1.5, -1):
        with pytest.raises(ValueError, match="release_bucket_bytes"):
            mpkern.FusedAdamWMP(model.parameters(), release_grads=True, release_bucket_bytes=bad)
    with pytest.raises(ValueError, match="release_bucket_bytes"):
        mpkern.FusedAdamWMP(model.parameters(), release_bucket_bytes=-5)  # checked even when unused
    assert mpkern.FusedAdamWMP(model.parameters(), release_grads=True, release_bucket_bytes=4e6).release_bucket_bytes \
        == 4_000_000
    assert mpkern.FusedAdamWMP(model.parameters(), release_bucket_bytes=1 << 20).release_bucket_bytes is None
    with pytest.raises(TypeError, match="release_grads"):
        mpkern.FusedAdamWMP(model.parameters(), release_grads="yes")
    regular = mpkern.FusedAdamWMP(model.parameters())
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match="release_grads=True"):
        regular.backward(lm_loss(model, x, y))
    opt = mpkern.FusedAdamWMP(model.parameters(), release_grads=True)
    assert opt.release_grads and opt.release_bucket_bytes == release.DEFAULT_BUCKET_BYTES
    assert not regular.release_grads and regular.release_bucket_bytes is None
    with pytest.raises(ValueError, match="require grad"), torch.no_grad():
        opt.backward(lm_loss(model, x, y))
    with pytest.raises(TypeError, match="scaler"):
        opt.backward(lm_loss(model, x, y), scaler=1.0)
    with pytest.raises(ValueError, match="twice"):
        mpkern.FusedAdamWMP([model.up.weight, model.up.weight], release_grads=True).backward(lm_loss(model, x, y))


@pytest.mark.parametrize("direction", ["release->regular", "regular->release"])
def test_checkpoints_cross_load_and_resume_bitwise(direction):
    mode = ("8bit", "4bit_m")
    a, oa, b, ob = twins(mode, max_grad_norm=0.3)  # oa regular, ob release: trained in lockstep
    data = batches(6)
    for x, y in data[:3]:
        regular_step(a, oa, x, y)
        ob.backward(lm_loss(b, x, y))
    src_model, src = (b, ob) if direction == "release->regular" else (a, oa)
    c = make_model()
    c.load_state_dict(src_model.state_dict())
    release_dst = direction == "regular->release"
    oc = mpkern.FusedAdamWMP(c.parameters(), lr=3e-3, weight_decay=0.05, master_weights=mode[0], state_dtype=mode[1],
                             max_grad_norm=0.3, release_grads=release_dst, release_bucket_bytes=2000 if release_dst
                             else None)
    oc.load_state_dict(copy.deepcopy(src.state_dict()))
    assert oc.release_grads is release_dst  # the constructor's setting wins
    for x, y in data[3:]:
        regular_step(a, oa, x, y)
        if release_dst:
            oc.backward(lm_loss(c, x, y))
        else:
            regular_step(c, oc, x, y)
    assert_same(a, oa, c, oc)


def test_copies_keep_release():
    _, _, b, ob = twins()
    original = [p.clone() for p in b.parameters()]
    for oc in (copy.deepcopy(ob), pickle.loads(pickle.dumps(ob))):
        assert oc.release_grads and oc.release_bucket_bytes == 2000
        params = oc.param_groups[0]["params"]
        loss = sum(p.float().square().sum() for p in params)
        oc.backward(loss)
        assert all(p.grad is None for p in params)
        assert all(float(oc.state[p]["step"]) == 1 for p in params)  # the copy's own hooks stepped its params
    assert all(torch.equal(p, q) for p, q in zip(original, b.parameters()))  # the copies' hooks are their own
    assert not ob.state


def test_a_param_that_starts_requiring_grad_later_is_hooked():
    a, oa, b, ob = twins()
    for m in (a, b):
        m.up.bias.requires_grad_(False)
    data = batches(4)
    for i, (x, y) in enumerate(data):
        if i == 2:
            for m in (a, b):
                m.up.bias.requires_grad_(True)
        regular_step(a, oa, x, y)
        ob.backward(lm_loss(b, x, y))
        assert b.up.bias.grad is None
        assert_same(a, oa, b, ob)
    assert float(ob.state[b.up.bias]["step"]) == 2


class _Boom(torch.autograd.Function):
    """Identity whose backward raises (a backward that dies halfway)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom")


def test_a_plain_backward_that_dies_leaves_nothing_behind():
    """A plain backward that dies before its end-of-backward callback leaves a grad in the bucket; the
    next backward starts afresh (by autograd's graph task) -- the dead one's grad is dropped, not stepped
    with it, and its own last bucket is stepped at its end."""
    _, _, b, ob = twins(bucket=1 << 20)  # one bucket for the whole model
    x, y = batches(1)[0]
    h = b.down(F.gelu(b.up(b.emb(x))))
    loss = _Boom.apply(h).float().sum() + b.norm.weight.float().sum()  # norm.weight's grad arrives first
    with pytest.raises(RuntimeError, match="boom"):
        loss.backward()
    assert not ob.state  # nothing was stepped: the one grad that arrived waits in the bucket
    for x, y in batches(3, seed=4):
        lm_loss(b, x, y).backward()
        assert all(p.grad is None for p in b.parameters())
    assert all(float(ob.state[p]["step"]) == 3 for p in b.parameters())


def test_gpt2_tied_embedding_and_head_bitwise():
    """GPT-2 (transformers) shares one Parameter between its embedding and its LM head: its hook fires once,
    after both contributions; three storage modes, clip active, bit for bit."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=101, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg).to(device=DEVICE, dtype=BF16)
    assert base.lm_head.weight is base.transformer.wte.weight
    for master, sd in (MODES[0], MODES[1], MODES[3]):
        a, b = copy.deepcopy(base), copy.deepcopy(base)
        kw = dict(lr=1e-3, max_grad_norm=0.5, master_weights=master, state_dtype=sd)
        oa = mpkern.FusedAdamWMP(a.parameters(), **kw)
        ob = mpkern.FusedAdamWMP(b.parameters(), release_grads=True, release_bucket_bytes=20_000, **kw)
        for s in range(3):
            ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(s)).to(DEVICE)
            a(ids, labels=ids).loss.backward()
            oa.step()
            oa.zero_grad()
            ob.backward(b(ids, labels=ids).loss)
        assert float(ob.last_grad_norm) > 0.5  # the clip was active
        assert_same(a, oa, b, ob)
