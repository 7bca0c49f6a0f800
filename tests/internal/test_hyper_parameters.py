# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""fairscale.internal.hyper_parameters: saved parameter-group values checked before they are copied or compared."""

from typing import Any

import pytest
import torch

from fairscale.internal.hyper_parameters import checked_hyper_parameters


def test_every_torch_optimizer_group_round_trips() -> None:
    """Each torch optimizer's own group is accepted, copied (tensors cloned), with its params left out."""
    param = torch.nn.Parameter(torch.ones(3))
    for cls, kwargs in (
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        (torch.optim.Adam, {"lr": torch.tensor(0.01), "betas": (0.8, 0.9), "amsgrad": True}),
        (torch.optim.AdamW, {"lr": 0.01, "fused": None}),
        (torch.optim.Adagrad, {}),
        (torch.optim.RMSprop, {"momentum": 0.5, "centered": True}),
        (torch.optim.NAdam, {"decoupled_weight_decay": True}),
        (torch.optim.LBFGS, {"line_search_fn": "strong_wolfe"}),
    ):
        group = cls([param], **kwargs).param_groups[0]
        copied = checked_hyper_parameters(group, group, "load")
        assert "params" not in copied and set(copied) == set(group) - {"params"}, cls
        for key, value in copied.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, group[key]) and value is not group[key]
            else:
                assert value == group[key], (cls, key)


def test_numbers_of_any_kind_load_into_numbers() -> None:
    import numpy as np

    live = {"lr": 0.1, "betas": (0.9, 0.99), "momentum": 0, "foreach": None, "eps": 1e-8, "wd": 0.0}
    saved = {"lr": torch.tensor(0.5), "betas": [torch.tensor(0.8), 0.9], "momentum": 0.9, "foreach": True, "new": "x"}
    saved.update({"eps": np.array(1e-6), "wd": np.float32(0.1)})  # numpy values of an old checkpoint
    copied = checked_hyper_parameters(saved, live, "load")
    assert float(copied["lr"]) == 0.5 and copied["momentum"] == 0.9 and copied["new"] == "x"
    # betas as one tensor; a learned lr goes on learning (a review, session 50).
    lr = torch.tensor(0.01, requires_grad=True)
    copied = checked_hyper_parameters({"betas": torch.tensor([0.8, 0.9]), "lr": lr}, live, "load")
    assert (
        copied["lr"].requires_grad and copied["lr"] is not lr and torch.equal(copied["betas"], torch.tensor([0.8, 0.9]))
    )


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("lr", "0.1", "'lr' is a str .* the optimizer's is a number"),
        ("lr", True, "'lr' is a bool"),
        ("lr", torch.ones(2), "'lr' is a Tensor"),
        ("betas", 0.9, "'betas' is 0.9, but the optimizer's is 2 numbers"),
        ("betas", (0.9, 0.9, 0.9), "is 3 numbers|is \\(0.9, 0.9, 0.9\\)"),
        ("extra", list(range(70000)), "holds more than 65536 values"),
    ],
)
def test_values_of_another_kind_are_refused(key: str, value: Any, match: str) -> None:
    live = {"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}
    with pytest.raises(ValueError, match=match):
        checked_hyper_parameters({key: value}, live, "load")


def test_a_tuple_tower_is_refused_at_once() -> None:
    """Each level's two items are one tuple: deepcopy and repr walk 2**depth tuples (a few bytes per level in a
    pickle). Refused after a bounded walk."""
    tower: Any = ()
    for _ in range(60):
        tower = (tower, tower)
    with pytest.raises(ValueError, match="nests more than 8 levels deep|holds more than 65536"):
        checked_hyper_parameters({"betas": tower}, {}, "load")
    wide: Any = ()
    for _ in range(8):
        wide = (wide, wide)  # 2**9 - 1 tuples: within both limits, and copied
    assert checked_hyper_parameters({"x": wide}, {}, "load")["x"] == wide
