# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FullyShardedDataParallel used the way users get it wrong (found by probing, session 9): each either works as a
fairscale user would expect or raises a clear error, instead of a bare assertion, a cryptic internal error, or a
silently wrong result.

* ``.to()/.half()`` between a forward and its backward (was a bare ``AssertionError`` in the backward);
* ``clip_grad_norm_`` after a ``no_sync()`` backward (was a silently wrong norm: each rank's full unreduced gradient),
  with a negative or NaN ``max_norm`` (flipped or skipped silently), with ``norm_type`` 0 (``ZeroDivisionError``);
* torch ``DistributedDataParallel`` around an FSDP instance (training went on, learning nothing: DDP overwrote rank 1's
  shards with rank 0's); ``FSDP(FSDP(module))`` (was a misleading tied-weights error; upstream supports it) and one module wrapped by two
  instances (was "setStorage ... out of bounds" in its forward);
* parameters rebound inside ``summon_full_params()`` (``m.weight.data = t``, ``m.bias = nn.Parameter(t)``: were
  dropped silently; in-place edits were kept);
* ``copy.deepcopy`` of a model (e.g. an EMA copy: the copy had no process groups and failed with "got str:
  'MISSING'"), and a pickled model used without its groups;
* an optimizer stepped in a post-accumulate-grad hook (it saw no gradient: the model silently did not train);
* constructor arguments no step can honour, and ``get_shard_from_optim_state_dict`` with what
  ``gather_full_optim_state_dict`` returns on the other ranks (``None``) or with state for an unknown parameter.
"""

import copy
import functools
import io
import pickle
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.wrap import auto_wrap, default_auto_wrap_policy, enable_wrap

WORLD = 2
TIMEOUT = 120.0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class _ListNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(3, 3) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _CalledNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 3)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.layer(x)


def _w() -> nn.Parameter:
    return nn.Parameter(torch.ones(3))


def _nested(**kwargs: object) -> FSDP:
    torch.manual_seed(0)
    net = _Net()
    net.a = FSDP(net.a, **kwargs)  # type: ignore[assignment]
    return FSDP(net, **kwargs)


def _input(step: int = 0) -> torch.Tensor:
    # The same on every rank: the averaged gradient then equals the single-process one.
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 + step))


def _full(model: FSDP) -> Dict[str, torch.Tensor]:
    with model.summon_full_params():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(model: nn.Module, steps: int = 2) -> None:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        model(_input(step)).pow(2).sum().backward()
        optim.step()
        optim.zero_grad()


def _reference_after_training(steps: int = 2) -> Dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ref = _Net()
    _train(ref, steps)
    return {n: p.detach().clone() for n, p in ref.named_parameters()}


def _assert_equal_to_reference(got: Dict[str, torch.Tensor], steps: int = 2) -> None:
    expected = _reference_after_training(steps)
    assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


# --------------------------------------------------------------------------------------------- wrong state


def _case_move_between_forward_and_backward() -> None:
    model = _nested()
    out = model(_input())
    with pytest.raises(RuntimeError, match="between a forward and its backward"):
        model.double()
    out.pow(2).sum().backward()  # the refused move changed nothing: the backward runs
    model.double()  # and after the backward the move works
    assert all(p.dtype == torch.float64 for p in model.parameters())


def _case_clip_after_no_sync_backward(obc: bool) -> None:
    model = _nested(optimize_backward_concat=obc)
    with model.no_sync():
        model(_input()).pow(2).sum().backward()
        with pytest.raises(RuntimeError, match="inside no_sync"):
            model.clip_grad_norm_(1.0)
    # Outside the context too, until the synchronizing backward; each instance's parameters named by its path.
    with pytest.raises(RuntimeError, match=r"not reduced yet \(unreduced on \['flat_param_0', 'a.flat_param_0'\]\)"):
        model.clip_grad_norm_(1.0)
    model(_input()).pow(2).sum().backward()
    # After the window: the norm of the averaged gradient of both microbatches, as torch computes it unsharded.
    torch.manual_seed(0)
    ref = _Net()
    for _ in range(2):
        ref(_input()).pow(2).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    torch.testing.assert_close(model.clip_grad_norm_(1.0), expected, rtol=1e-5, atol=1e-6)
    # A window's gradient cleared by zero_grad() (a microbatch dropped) leaves nothing unreduced, flag on or off
    # (with the flag, its buffer stayed until the next backward and clip_grad_norm_ was refused).
    model.zero_grad(set_to_none=True)
    with model.no_sync():
        model(_input()).pow(2).sum().backward()
    model.zero_grad(set_to_none=True)
    assert model.clip_grad_norm_(1.0).item() == 0.0
    model(_input(1)).pow(2).sum().backward()  # the next step holds that microbatch's gradient only
    torch.manual_seed(0)
    ref = _Net()
    for _ in range(2):
        ref(_input()).pow(2).sum().backward()
    ref.zero_grad(set_to_none=True)
    ref(_input(1)).pow(2).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    torch.testing.assert_close(model.clip_grad_norm_(1.0), expected, rtol=1e-5, atol=1e-6)


def _case_clip_arguments() -> None:
    model = _nested()
    model(_input()).pow(2).sum().backward()
    before = _full_grads(model)
    for max_norm, norm_type, needle in (
        (-1.0, 2.0, "max_norm must be a non-negative number"),
        (float("nan"), 2.0, "max_norm must be a non-negative number"),
        (1.0, 0, "norm_type must be a positive number or inf"),
        (1.0, -2.0, "norm_type must be a positive number or inf"),
    ):
        with pytest.raises(ValueError, match=needle):
            model.clip_grad_norm_(max_norm, norm_type)
    with pytest.raises(TypeError, match="max_norm and norm_type must be numbers, got True"):
        model.clip_grad_norm_(True)  # type: ignore[arg-type]  # taken for 1.0 before
    after = _full_grads(model)
    assert all(torch.equal(before[n], after[n]) for n in before), "a refused clip changed the gradients"


def _case_clip_arguments_differ_between_ranks() -> None:
    # Another norm_type on one rank combined its part of the norm by another rule (or joined a max with a sum) and
    # another max_norm clipped its shard by another factor, both silently: the arguments ride in the norm's gather.
    model = _nested()
    model(_input()).pow(2).sum().backward()
    before = _full_grads(model)
    for max_norm, norm_type in ((1.0, 3.0), (2.0, 2.0), (1.0, float("inf"))):
        mine = (max_norm, norm_type) if dist.get_rank() == 1 else (1.0, 2.0)
        with pytest.raises(ValueError, match=r"clip_grad_norm_: \(norm_type, max_norm\) differ between ranks"):
            model.clip_grad_norm_(*mine)
    assert all(torch.equal(before[n], v) for n, v in _full_grads(model).items()), "a refused clip changed gradients"
    torch.manual_seed(0)
    ref = _Net()
    ref(_input()).pow(2).sum().backward()
    for norm_type in (2.0, float("inf")):
        norms = [torch.linalg.vector_norm(p.grad, norm_type) for p in ref.parameters() if p.grad is not None]
        expected = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        torch.testing.assert_close(model.clip_grad_norm_(1e9, norm_type), expected, rtol=1e-5, atol=1e-6)


def _full_grads(model: FSDP) -> Dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ----------------------------------------------------------------------------------------------- wrapping


def _case_fsdp_of_fsdp_trains_like_the_module() -> None:
    torch.manual_seed(0)
    model = FSDP(FSDP(_Net()))
    _train(model)
    got = _full(model)
    assert sorted(model.state_dict()) == ["a.bias", "a.weight", "b.bias", "b.weight"]
    _assert_equal_to_reference(got)
    # The local dict names the inner instance's flat parameter at the top ("flat_param_0"): its load raised "Missing
    # flat_param_0 ... Unexpected flat_param_0" (the outer wrapper took the key for its own; found by a fuzz).
    local = {k: v.clone() for k, v in model.local_state_dict().items()}  # its values alias the shards, as torch's
    assert sorted(local) == ["flat_param_0"]
    _train(model)
    model.load_local_state_dict(local)
    for name, value in _full(model).items():
        assert torch.equal(value, got[name]), name


def _case_one_module_in_two_instances() -> None:
    torch.manual_seed(0)
    net = _Net()
    first = FSDP(net)
    second = FSDP(net)
    with pytest.raises(ValueError, match=r"module 'a' \(Linear\) is already wrapped by another"):
        second(_input())
    _train(first)  # the first wrapping is unharmed
    _assert_equal_to_reference(_full(first))


def _case_torch_ddp_around_fsdp_is_refused() -> None:
    # DDP would broadcast rank 0's shards over rank 1's and all-reduce gradients of different shards (transformers
    # 4.30-4.34's Trainer does this with --sharded_ddp zero_dp_2/3): refused in DDP's constructor, before it sends.
    model = _nested()
    with pytest.raises(TypeError, match="DistributedDataParallel cannot wrap a FullyShardedDataParallel"):
        nn.parallel.DistributedDataParallel(model)
    with pytest.raises(TypeError, match="Train the FSDP instance directly"):
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["a.weight"])
    assert FSDP._ddp_params_and_buffers_to_ignore is not None  # class access (docs tools) does not raise
    _train(model)  # nothing was sent or changed: the model trains as if DDP had not been tried
    _assert_equal_to_reference(_full(model))
    # DDP around a plain module that holds FSDP instances: test_fsdp_inside_ddp.py. DDP of a plain model is fine.
    plain = nn.parallel.DistributedDataParallel(_Net())
    assert isinstance(plain.module, _Net)


# -------------------------------------------------------------------------------------------------- copies


def _case_deepcopy_is_an_independent_working_model() -> None:
    model = _nested()
    _train(model, 1)
    clone = copy.deepcopy(model)
    trained_once = _full(model)
    # The copy trains on as the original would have (equal to the single-process reference), and leaves it alone.
    optim = torch.optim.SGD(clone.parameters(), lr=0.1)
    clone(_input(1)).pow(2).sum().backward()
    assert _full_buffers_freed(clone), "the copy's backward kept its full parameters (no gradient hooks)"
    optim.step()
    _assert_equal_to_reference(_full(clone), steps=2)
    assert all(torch.equal(trained_once[n], v) for n, v in _full(model).items()), "the copy's step moved the original"
    out = model(_input())
    with pytest.raises(RuntimeError, match="between a forward and its backward"):
        copy.deepcopy(model)
    out.sum().backward()


def _case_unpickled_model_needs_its_groups() -> None:
    model = _nested()
    _train(model, 1)
    clone = pickle.loads(pickle.dumps(model))
    with pytest.raises(RuntimeError, match=r"was unpickled .* process_group, process_group_reduce_scatter"):
        clone(_input(1))
    _set_groups(clone)
    optim = torch.optim.SGD(clone.parameters(), lr=0.1)
    clone(_input(1)).pow(2).sum().backward()
    optim.step()
    _assert_equal_to_reference(_full(clone), steps=2)


def _full_buffers_freed(model: FSDP) -> bool:
    """Whether every instance freed its full parameters (as a backward whose gradient hooks ran leaves them)."""
    handles = [h for m in model.modules() if isinstance(m, FSDP) for h in m._fsdp_unit.handles]
    return all(h.full_padded is None or h.full_padded.untyped_storage().nbytes() == 0 for h in handles)


def _set_groups(model: nn.Module) -> None:
    for m in model.modules():  # as upstream's serialization tests do
        if isinstance(m, FSDP):
            m.process_group = dist.group.WORLD
            m.process_group_reduce_scatter = dist.group.WORLD


def _case_torch_save_of_the_whole_model(mixed_precision: bool) -> None:
    # torch.save(model) after a step wrote views of freed buffers that torch.load could not rebuild ("Trying to
    # resize storage that is not resizable"); copies and unpickled models had no gradient hooks (their backward kept
    # every full parameter and reduced late).
    model = _nested(mixed_precision=mixed_precision)
    _train(model, 1)
    with torch.no_grad():
        model(_input(5))  # an evaluation forward before saving, as in a validation loop
    out = model(_input(1))
    with pytest.raises(RuntimeError, match=r"pickling \(torch.save .*between a forward and its backward"):
        torch.save(model, io.BytesIO())
    out.sum().backward()  # the refused save left the step alone
    model.zero_grad()
    trained_once = _full(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    _set_groups(loaded)
    tags = [(p._is_sharded, p._orig_size) for p in loaded.parameters()]  # upstream's parameter attributes
    assert tags == [(p._is_sharded, p._orig_size) for p in model.parameters()] and all(s for s, _ in tags), tags
    assert all(torch.equal(trained_once[n], v) for n, v in _full(loaded).items())
    optim = torch.optim.SGD(loaded.parameters(), lr=0.1)
    loaded(_input(1)).pow(2).sum().backward()
    assert _full_buffers_freed(loaded), "the loaded model's backward kept its full parameters (no gradient hooks)"
    optim.step()
    if not mixed_precision:
        _assert_equal_to_reference(_full(loaded), steps=2)
    assert all(torch.equal(trained_once[n], v) for n, v in _full(model).items()), "saving changed the original"
    _train(model, 1)  # and the saved model trains on


def _case_full_state_dicts_differing_between_ranks() -> None:
    # Each rank keeps its own slice of the full dict it loads: dicts with the same keys and shapes but other values
    # (another checkpoint on one rank, or a checkpoint read by rank 0 only) mixed silently into one model.
    model = _nested()
    _train(model, 1)
    saved = model.state_dict()
    before = _full(model)
    for key, names in (("b.bias", "b.weight, b.bias"), ("a.weight", "a.weight, a.bias")):
        other = {k: v.clone() for k, v in saved.items()}
        if dist.get_rank() == 1:
            other[key].add_(1.0)
        # One fingerprint per flat parameter: the message says the difference is in one of its members (it named
        # them all as if all differed; session 45).
        with pytest.raises(
            RuntimeError,
            match=rf"the ranks loaded different full state dicts \(the values of one of the 2 parameters flattened "
            rf"together \({names}\) differ",
        ):
            model.load_state_dict(other)
        assert all(torch.equal(before[n], v) for n, v in _full(model).items()), "a refused load changed the model"
    changed = {k: v + 1.0 for k, v in saved.items()}
    model.load_state_dict(changed)  # the same dict on every rank loads as before
    assert all(torch.equal(before[n] + 1.0, v) for n, v in _full(model).items())


def _case_parent_module_loads_differing_dicts() -> None:
    # A plain parent's load_state_dict (as Lightning loads a LightningModule holding FSDP models) goes through the
    # instances' load hooks, not FSDP.load_state_dict: the ranks compare what they loaded there.
    parent = nn.Sequential(_nested(), nn.Linear(3, 3))
    saved = parent.state_dict()
    other = {k: v.clone() for k, v in saved.items()}
    if dist.get_rank() == 1:
        other["0.a.bias"].add_(1.0)
    with pytest.raises(
        RuntimeError,
        match=r"the ranks loaded different full state dicts \(the values of one of the 2 param.*a.weight, a.b",
    ):
        parent.load_state_dict(other)
    restored = parent[0].state_dict()
    assert all(torch.equal(saved["0." + k], v) for k, v in restored.items()), "the refused load changed the model"
    changed = {k: v + 1.0 for k, v in saved.items()}
    parent.load_state_dict(changed)  # the same dict on every rank loads as before
    assert all(torch.equal(changed[k], v) for k, v in parent.state_dict().items())
    _train(parent[0], 1)


class _Picky(nn.Linear):
    """A module whose own load check raises (instead of reporting through torch's error list)."""

    refuse = True

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
        if _Picky.refuse:
            raise ValueError("_Picky refuses this checkpoint")
        super()._load_from_state_dict(state_dict, prefix, *args)


def _picky_parent() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), FSDP(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), _Picky(6, 3))))


def _case_parent_load_that_raises_inside_an_instance_is_undone() -> None:
    # torch skips an instance's post load hook when a module inside it raises: the instance stayed summoned with the
    # dict's first values half loaded, and every later forward was refused ("forward called while the instance is
    # in SUMMON_FULL_PARAMS"). Its next use undoes that load (with a warning), as does the parent's next load.
    parent = _picky_parent()
    fsdp = parent[1]
    before = _full(fsdp)
    changed = {k: v + 1.0 for k, v in parent.state_dict().items()}
    _Picky.refuse = True
    try:
        for next_use in ("forward", "load"):
            with pytest.raises(ValueError, match="_Picky refuses"):
                parent.load_state_dict(changed)
            with pytest.warns(RuntimeWarning, match="raised before it finished; this instance's parameters"):
                if next_use == "forward":
                    assert all(torch.equal(before[n], v) for n, v in _full(fsdp).items()), "the load was not undone"
                else:
                    _Picky.refuse = False
                    parent.load_state_dict(changed)
        assert all(torch.equal(before[n] + 1.0, v) for n, v in _full(fsdp).items())
    finally:
        _Picky.refuse = True
    loaded = _full(fsdp)
    optim = torch.optim.SGD(parent.parameters(), lr=0.1)
    parent(_input()).sum().backward()  # trains again
    optim.step()
    assert all(not torch.equal(loaded[n], v) for n, v in _full(fsdp).items())


def _case_parent_load_with_assign_copies_into_the_shards(flatten: bool) -> None:
    # assign=True went three ways: FSDP.load_state_dict ignored it, a flattened instance under a parent copied, and
    # a non-flattened one raised about flat parameters it does not have (leaving it summoned, see above). FSDP
    # copies into its shards on every route; the parent's other modules are assigned as torch does.
    torch.manual_seed(0)
    parent = nn.Sequential(nn.Linear(4, 4), FSDP(nn.Linear(4, 3), flatten_parameters=flatten))
    own = [p for p in parent[1].parameters()]
    changed = {k: torch.full_like(v, 0.5) for k, v in parent.state_dict().items()}
    parent.load_state_dict(changed, assign=True)
    assert all(torch.equal(v, changed[k]) for k, v in parent.state_dict().items())
    assert [p for p in parent[1].parameters()] == own and all(p is q for p, q in zip(parent[1].parameters(), own))
    parent[1].load_state_dict({k[2:]: v + 1.0 for k, v in changed.items() if k.startswith("1.")}, assign=True)
    assert all(torch.equal(v, torch.full_like(v, 1.5)) for v in parent[1].state_dict().values())
    optim = torch.optim.SGD(parent.parameters(), lr=0.1)
    parent(_input()).sum().backward()
    optim.step()


def _case_failed_load_before_the_first_forward_changes_nothing() -> None:
    # Before the first forward the nested instances are not materialized: the snapshot missed their shards, and a
    # load failing on a later key left the nested instance with the dict's values.
    model = _nested()
    before = model.state_dict()
    bad = {k: v + 1.0 for k, v in before.items()}
    bad["b.weight"] = torch.zeros(2, 2)
    with pytest.raises(RuntimeError, match="size mismatch"):
        model.load_state_dict(bad)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "the failed load changed the model"
    _train(model)
    _assert_equal_to_reference(_full(model))


def _case_rebinds_inside_summon_are_written_back(flatten: bool) -> None:
    """With flatten_parameters=False the parameters are the modules' own: a rebind was dropped silently (``.data``),
    or left a plain parameter in the module that FSDP neither sharded nor reduced (the ranks then trained apart)."""
    model = _nested(flatten_parameters=flatten)
    bias = model.module.b.bias
    with model.summon_full_params():
        model.module.b.weight.data = torch.full((3, 6), 0.5)
        model.module.b.bias = nn.Parameter(torch.full((3,), -1.0))
    full = _full(model)
    assert torch.equal(full["b.weight"], torch.full((3, 6), 0.5)) and torch.equal(
        full["b.bias"], torch.full((3,), -1.0)
    )
    assert model.module.b.bias is bias  # FSDP's own parameter again: sharded, reduced, in the optimizer
    for bad, shape in [(None, "NoneType"), (nn.Parameter(torch.zeros(3, 2)), "\\(3, 2\\)")]:
        with pytest.raises(ValueError, match=rf"b\.bias: {shape} where \(3,\) was expected"):
            with model.summon_full_params():
                model.module.b.weight.data = torch.full((3, 6), 9.0)  # fits, but the summon is all or nothing
                model.module.b.bias = bad
        assert all(torch.equal(full[n], v) for n, v in _full(model).items()), "a refused write-back changed the model"
    if not flatten:  # the module's parameters are FSDP's again (with flattening they are views, not registered)
        assert model.module.b.bias is bias
    # And it still trains like the module with the rebound values.
    _train(model)
    torch.manual_seed(0)
    reference = _Net()
    with torch.no_grad():
        reference.b.weight.fill_(0.5)
        reference.b.bias.fill_(-1.0)
    _train(reference)
    got = _full(model)
    for name, value in reference.named_parameters():
        torch.testing.assert_close(got[name], value.detach(), rtol=1e-5, atol=1e-6)


def _case_keys_naming_the_wrappers() -> None:
    """A key written with FSDP's internal path never loads: it was reported cleaned, as "Missing key(s): 0.weight"
    and "Unexpected key(s): 0.weight" at once. It is named as written now."""
    model = _nested()
    state = model.state_dict()
    before = _full(model)
    bad = {("a._fsdp_wrapped_module.weight" if k == "a.weight" else k): v for k, v in state.items()}
    with pytest.raises(RuntimeError, match=r"the keys \['a\._fsdp_wrapped_module\.weight'\] name FullyShardedDataPar"):
        model.load_state_dict(bad)
    result = model.load_state_dict(bad, strict=False)
    assert result.missing_keys == ["a.weight"] and result.unexpected_keys == ["a._fsdp_wrapped_module.weight"]
    assert all(torch.equal(before[n], v) for n, v in _full(model).items())


def _case_optimizer_built_before_wrapping() -> None:
    """The optimizer holds the original parameters, which FSDP copied into its flat parameters: every step did
    nothing, silently (upstream the same). Now the first step raises, on every rank, before changing anything."""
    torch.manual_seed(0)
    net = _Net()
    optim = torch.optim.SGD(net.parameters(), lr=0.1)
    model = FSDP(net)
    model(_input()).sum().backward()
    with pytest.raises(RuntimeError, match=r"SGD.step\(\): 4 of the optimizer's 4 parameters .* were flattened into"):
        optim.step()
    model.zero_grad(set_to_none=True)
    _train(model)  # an optimizer built after wrapping trains as before
    _assert_equal_to_reference(_full(model))
    # An optimizer that stepped before its model was wrapped, once an instance exists already (the one above): it was
    # remembered as checked, and every step after wrapping did nothing, silently (a fuzz, session 50).
    torch.manual_seed(0)
    net = _Net()
    optim = torch.optim.SGD(net.parameters(), lr=0.1)
    net(_input()).sum().backward()
    optim.step()
    optim.zero_grad()
    model = FSDP(net)
    model(_input()).sum().backward()
    with pytest.raises(RuntimeError, match=r"SGD.step\(\): 4 of the optimizer's 4 parameters .* were flattened into"):
        optim.step()
    # Without flattening the original parameters are FSDP's: an optimizer built before wrapping works.
    torch.manual_seed(0)
    net = _Net()
    optim = torch.optim.SGD(net.parameters(), lr=0.1)
    model = FSDP(net, flatten_parameters=False)
    for step in range(2):
        model(_input(step)).pow(2).sum().backward()
        optim.step()
        optim.zero_grad()
    _assert_equal_to_reference(_full(model))


# ---------------------------------------------------------------------------------------------- arguments


def _case_constructor_arguments() -> None:
    for kwargs, error, needle in (
        ({"process_group": "gloo"}, TypeError, "process_group must be a torch.distributed ProcessGroup"),
        # Accepted before, then the first forward blamed an unpickled model or the ranks' membership.
        ({"zero2_process_group": "x"}, TypeError, "zero2_process_group must be a torch.distributed ProcessGroup"),
        ({"zero2_process_group": [0, 1]}, TypeError, r"zero2_process_group .* got list: \[0, 1\]"),
        ({"replicate_process_group": 3}, TypeError, r"replicate_process_group .*hybrid_groups.* got int: 3"),
        ({"bucket_cap_mb": float("nan")}, ValueError, "bucket_cap_mb must be a number"),
        ({"gradient_predivide_factor": 0.0}, ValueError, "gradient_predivide_factor must be a positive"),
        ({"buffer_dtype": torch.int64}, ValueError, "buffer_dtype must be a floating-point"),
        ({"compute_device": torch.device("meta")}, ValueError, "compute_device cannot be 'meta'"),
    ):
        with pytest.raises(error, match=needle):
            FSDP(_Net(), **kwargs)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="FullyShardedDataParallel wraps an nn.Module, got function"):
        FSDP(lambda x: x)  # type: ignore[arg-type]  # an AttributeError about .modules() before
    with torch.device("meta"):
        on_meta = _Net()
    with pytest.raises(ValueError, match="parameters on the meta device"):
        FSDP(on_meta)
    # Sparse gradients failed in the first backward ("reshape is not implemented for sparse tensors").
    for sparse_layer in (nn.Embedding(5, 3, sparse=True), nn.EmbeddingBag(5, 3, sparse=True)):
        with pytest.raises(ValueError, match=r"does not support sparse gradients: 0 is an Embedding.* sparse=False"):
            FSDP(nn.Sequential(sparse_layer, nn.Linear(3, 2)))
    frozen = nn.Embedding(5, 3, sparse=True)
    frozen.weight.requires_grad_(False)  # makes no gradient: accepted
    FSDP(nn.Sequential(frozen, nn.Linear(3, 2)), flatten_parameters=False)
    # A module without a forward of its own: its items, called by the parent, computed with the shard (rank 1 of a
    # (1,)-shaped parameter returned a wrong output with no error; other shapes raised a misleading error).
    containers = (nn.ModuleList([nn.Linear(3, 3)]), nn.ModuleDict({"a": nn.Linear(3, 3)}), nn.ParameterList([_w()]))
    for container in containers + (nn.ParameterDict({"w": _w()}),):
        with pytest.raises(
            ValueError,
            match=f"cannot wrap a {type(container).__name__} that holds parameters of its own: it has no forward",
        ):
            FSDP(container)
    blocks = nn.Sequential(nn.Linear(3, 3))
    blocks.layers = nn.ModuleList([nn.Linear(3, 3)])  # inside a wrapped module with a forward: fine
    FSDP(blocks)
    FSDP(nn.ModuleList([FSDP(nn.Linear(3, 3))]))  # its items wrapped on their own: they gather in their forward
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    FSDP(nn.ModuleList([nn.Linear(3, 3)]), process_group=singles[dist.get_rank()])  # one rank: its shard is whole
    torch.manual_seed(0)  # the same weights on every rank
    plain = _CalledNet()  # no forward, but called through its own __call__: the wrapper's forward runs it
    torch.testing.assert_close(FSDP(copy.deepcopy(plain))(torch.ones(1, 3)), plain(torch.ones(1, 3)))
    policy = functools.partial(default_auto_wrap_policy, min_num_params=20, exclude_wrap_modules=set())
    with enable_wrap(wrapper_cls=FSDP), pytest.raises(ValueError, match="cannot wrap a ModuleList"):
        auto_wrap(_ListNet(), auto_wrap_policy=policy)
    with enable_wrap(wrapper_cls=FSDP):  # the default policy leaves the list alone and wraps its items
        auto_wrap(_ListNet(), auto_wrap_policy=functools.partial(default_auto_wrap_policy, min_num_params=20))
    with_meta_buffer = _Net()
    with_meta_buffer.register_buffer("table", torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match="buffer table is on the meta device"):  # "Cannot copy out of meta tensor"
        FSDP(with_meta_buffer)
    model = _nested()
    with pytest.raises(ValueError, match="pre must be a positive finite number"):
        model.set_gradient_divide_factors(0.0, 2.0, recursive=True)
    _train(model)  # nothing was changed by the refused call
    _assert_equal_to_reference(_full(model))


def _case_optim_shard_from_the_wrong_input() -> None:
    model = _nested()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(_input()).pow(2).sum().backward()
    optim.step()
    full = model.gather_full_optim_state_dict(optim)  # None on rank 1
    if dist.get_rank() == 1:
        with pytest.raises(TypeError, match="returned on its recipient rank"):
            model.get_shard_from_optim_state_dict(full)  # type: ignore[arg-type]
        return
    assert full is not None
    bad = dict(full, state=dict(full["state"]))
    bad["state"][99] = bad["state"][0]
    with pytest.raises(ValueError, match="state for parameter 99"):
        model.get_shard_from_optim_state_dict(bad)
    model.get_shard_from_optim_state_dict(full)  # the real one still shards


def _case_consolidate_with_one_ranks_dicts() -> None:
    model = _nested()
    weights, meta = model.local_state_dict(), model.local_metadata_dict()
    with pytest.raises(TypeError, match="shard_weights must be a list with one dict per rank"):
        FSDP.consolidate_shard_weights(weights, meta)  # type: ignore[arg-type]
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, (weights, meta))
    full = FSDP.consolidate_shard_weights([w for w, _ in everyone], [m for _, m in everyone])
    assert sorted(full) == ["a.bias", "a.weight", "b.bias", "b.weight"]


def _step_in_hook(optimizers: Dict[int, torch.optim.Optimizer], param: torch.Tensor) -> None:
    optimizers[id(param)].step()
    optimizers[id(param)].zero_grad()


def _case_optimizer_stepped_in_backward(flatten: bool) -> None:
    """An optimizer per parameter stepped in a post-accumulate-grad hook (torchtune's idiom): the hook saw p.grad as
    None (FSDP sets the reduced shard at the end of the backward) and the model silently did not train. Refused at
    the next training forward, before anything is gathered; without the hooks the model trains."""
    model = _nested(flatten_parameters=flatten)
    optimizers = {id(p): torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    handles = [
        p.register_post_accumulate_grad_hook(functools.partial(_step_in_hook, optimizers)) for p in model.parameters()
    ]
    with pytest.raises(RuntimeError, match="post-accumulate-grad hook .* call optimizer.step.. after loss.backward"):
        model(_input())
    with torch.no_grad():
        model(_input())  # evaluation reaches no hook: allowed
    for handle in handles:
        handle.remove()
    _train(model)
    _assert_equal_to_reference(_full(model))


def _case_data_replaced_between_steps(after_step: bool) -> None:
    """`p.data = full_tensor` on a parameter (flatten_parameters=False; a plain module's way to load a weight): the
    first forward failed in the all-gather about element counts, and after a step the next forward overwrote it,
    silently (found by a fuzz of init patterns, session 42). Refused at the forward; a load works."""
    model = _nested(flatten_parameters=False)
    saved = model.state_dict()
    if after_step:
        _train(model, steps=1)
    weight = model.module.b.weight
    shard = weight.data
    weight.data = torch.ones(weight._orig_size)
    with pytest.raises(RuntimeError, match=r"'b\.weight' was replaced by a tensor of shape \(3, 6\).*load_state_dict"):
        model(_input())
    weight.data = shard
    for flatten in (True, False):  # inside a summon p.data is full: the refusal names the summon, not a replacement
        summoned = _nested(flatten_parameters=flatten)
        with summoned.summon_full_params(), pytest.raises(RuntimeError, match="cannot run inside summon_full_params"):
            summoned(_input())
    model.load_state_dict(saved)
    _train(model)
    _assert_equal_to_reference(_full(model))


def _init_constant(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.constant_(module.weight, 0.25)
        nn.init.zeros_(module.bias)


def _case_apply_inside_summon(flatten: bool) -> None:
    """A plain module's apply(init) inside the user's summon_full_params() reached the nested instance's apply, which
    raised "apply needs every FSDP instance idle" (found by a fuzz of init patterns, session 42): it runs on the
    summoned parameters, and the summon writes them back."""
    model = _nested(flatten_parameters=flatten)
    with model.summon_full_params():
        model.module.apply(_init_constant)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, torch.full_like(value, 0.25 if name.endswith("weight") else 0.0))
    with model.summon_full_params(recurse=False):  # the nested instance is not summoned: it summons itself
        model.module.apply(_init_constant)


def _case_freeze_inside_summon_is_refused() -> None:
    """`p.requires_grad_(False)` inside summon_full_params() (or an apply(freeze)) with flatten_parameters=True was
    dropped at the exit and the parameters kept training, silently (found by a fuzz of init patterns, session 42)."""
    model = _nested()
    with pytest.raises(
        ValueError, match=r"requires_grad of b\.weight, b\.bias changed.*freeze parameters before wrapping"
    ):
        with model.summon_full_params():
            model.module.b.requires_grad_(False)
    assert all(p.requires_grad for p in model.parameters())
    _train(model)
    _assert_equal_to_reference(_full(model))


def _body(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("freeze inside summon_full_params", _case_freeze_inside_summon_is_refused),
            ("apply inside summon_full_params", functools.partial(_case_apply_inside_summon, True)),
            ("apply inside summon_full_params, not flattened", functools.partial(_case_apply_inside_summon, False)),
            ("p.data replaced before the first forward", functools.partial(_case_data_replaced_between_steps, False)),
            ("p.data replaced between steps", functools.partial(_case_data_replaced_between_steps, True)),
            (".to() between forward and backward", _case_move_between_forward_and_backward),
            ("clip after no_sync", functools.partial(_case_clip_after_no_sync_backward, False)),
            (
                "clip after no_sync, optimize_backward_concat",
                functools.partial(_case_clip_after_no_sync_backward, True),
            ),
            ("clip arguments", _case_clip_arguments),
            ("clip arguments differ between ranks", _case_clip_arguments_differ_between_ranks),
            ("FSDP(FSDP(m))", _case_fsdp_of_fsdp_trains_like_the_module),
            ("one module in two instances", _case_one_module_in_two_instances),
            ("torch DDP around FSDP", _case_torch_ddp_around_fsdp_is_refused),
            (
                "rebinds inside summon_full_params",
                functools.partial(_case_rebinds_inside_summon_are_written_back, True),
            ),
            (
                "rebinds inside summon_full_params, not flattened",
                functools.partial(_case_rebinds_inside_summon_are_written_back, False),
            ),
            ("optimizer built before wrapping", _case_optimizer_built_before_wrapping),
            ("keys naming the wrappers", _case_keys_naming_the_wrappers),
            ("deepcopy", _case_deepcopy_is_an_independent_working_model),
            ("unpickled", _case_unpickled_model_needs_its_groups),
            ("full state dicts differing between ranks", _case_full_state_dicts_differing_between_ranks),
            ("a parent module loads differing dicts", _case_parent_module_loads_differing_dicts),
            ("failed load before the first forward", _case_failed_load_before_the_first_forward_changes_nothing),
            ("a parent's load raising inside an instance", _case_parent_load_that_raises_inside_an_instance_is_undone),
            (
                "a parent's load with assign=True",
                functools.partial(_case_parent_load_with_assign_copies_into_the_shards, True),
            ),
            (
                "a parent's load with assign=True, not flattened",
                functools.partial(_case_parent_load_with_assign_copies_into_the_shards, False),
            ),
            ("torch.save of the model", functools.partial(_case_torch_save_of_the_whole_model, False)),
            ("torch.save of the model, mixed precision", functools.partial(_case_torch_save_of_the_whole_model, True)),
            ("constructor arguments", _case_constructor_arguments),
            ("optim shard input", _case_optim_shard_from_the_wrong_input),
            ("consolidate with one rank's dicts", _case_consolidate_with_one_ranks_dicts),
            ("optimizer stepped in backward", functools.partial(_case_optimizer_stepped_in_backward, True)),
            (
                "optimizer stepped in backward, not flattened",
                functools.partial(_case_optimizer_stepped_in_backward, False),
            ),
        ]
    )


def test_misuse_works_or_raises_clearly() -> None:
    run_distributed(_body, WORLD, timeout=TIMEOUT)
