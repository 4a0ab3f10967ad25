"""``mpkern::adamw_step_``'s schema as the dispatcher holds it: the scalars keyword-only, the codecs named
by strings; a bad codec is refused before anything changes; positional scalars are refused.
"""

from __future__ import annotations

import pytest
import torch

import mpkern
from conftest import DEVICE
from mpkern import _backend


def test_adamw_schema_scalars_are_keyword_only_and_codecs_named():
    schema = torch.ops.mpkern.adamw_step_.default._schema
    kw = {a.name for a in schema.arguments if a.kwarg_only}
    assert {"lr", "beta1", "beta2", "eps", "weight_decay", "maximize", "master_codec", "moment_codec",
            "stochastic_rounding", "seed"} <= kw
    kinds = {a.name: str(a.type) for a in schema.arguments}
    assert kinds["master_codec"] == "str" and kinds["moment_codec"] == "str"


def _one_param_args(master_codec="fp32", moment_codec="float32"):
    p = torch.randn(8, device=DEVICE)
    args = ([p.bfloat16()], [torch.randn(8, device=DEVICE).bfloat16()], [torch.zeros(8, device=DEVICE)],
            [torch.zeros(8, device=DEVICE)], [], [p.clone()], [torch.zeros((), device=DEVICE)],
            torch.ones((), device=DEVICE), torch.zeros((), device=DEVICE), None)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, maximize=False, master_codec=master_codec,
              moment_codec=moment_codec, stochastic_rounding=False, seed=0)
    return args, kw


@pytest.mark.parametrize("bad,match", [({"master_codec": "int16"}, "master_codec must be"),
                                       ({"moment_codec": "8bit"}, "moment_codec '8bit' needs"),
                                       ({"moment_codec": "fp8"}, "moment_codec must be")])
def test_bad_codecs_refused_before_anything_changes(bad, match):
    for backend in ("torch", *(["cpu"] if _backend.native() is not None and DEVICE.type == "cpu" else [])):
        args, kw = _one_param_args()
        kw.update(bad)
        before = args[0][0].clone()
        with pytest.raises((ValueError, TypeError), match=match):
            mpkern._ops.adamw_step_(backend, *args, **kw)
        assert torch.equal(args[0][0], before)


def test_positional_scalars_are_refused():
    args, kw = _one_param_args()
    with pytest.raises((TypeError, RuntimeError)):
        torch.ops.mpkern.adamw_step_(*args, None, None, *kw.values())
