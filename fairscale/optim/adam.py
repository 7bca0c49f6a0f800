# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``Adam`` with fp16 training modes (:class:`Precision`), without upstream's CUDA extension.

Upstream's ``Adam`` needed the optional ``fused_adam_cuda`` extension and was missing from ``fairscale.optim``
without it. Here it is always available, on every device: the update runs on PyTorch's AdamW kernels (fused where
the device has the fused kernel, foreach elsewhere) with hyper-parameters mapped so that the arithmetic is
upstream's (see :mod:`fairscale.optim._adam_update`).

Modes (``precision``):

* ``FULL_PRECISION``: fp32 parameters and state. Inferred for fp32 parameters.
* ``MIXED_PRECISION``: fp16 parameters, fp32 master copies (``fp32_param_groups``) and fp32 state; the fp16
  parameters receive the rounded masters after each step. Inferred for fp16 parameters. A parameter written outside
  the optimizer (``model.load_state_dict``, ``copy_`` under ``no_grad``, ``p.data = t``) is noticed at the next
  step, and its master re-read from it; ``load_state_dict`` re-reads every master (see :class:`Adam`).
* ``MEMORY_EFFICIENT_MIXED_PRECISION``: fp16 parameters, fp32 state, no master copies (the update is computed in
  fp32 from the fp16 values).
* ``PURE_FP16``: fp16 parameters and fp16 state; the state is stored multiplied by a dynamic optimizer-state scale
  (``_optim_scale``, initially ``2**16``) that halves when a stored moment overflows (the state is then reset) and
  doubles, up to ``2**16``, after ``_optim_scale_update_freq`` clean updates. Use it with
  :class:`fairscale.optim.GradScaler`, which accepts fp16 gradients.
"""

import math
import numbers
from enum import Enum, auto
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor

from fairscale.internal.errors import FairscaleValueError

from ._adam_update import AdamHyper, adam_update
from ._param_state import check_param_state

__all__ = ["Adam", "Precision"]

_MAX_OPTIM_SCALE = 2.0**16
# A parameter as the optimizer last left it (see _mark).
_Mark = Tuple[int, int, torch.Size, Tuple[int, ...]]
# A mark no parameter has: the parameter was written outside the optimizer (its master is read again at the step).
_CHANGED: _Mark = (-1, 0, torch.Size(), ())


class Precision(Enum):
    """Where Adam keeps the values it updates (see the module documentation)."""

    FULL_PRECISION = auto()
    MIXED_PRECISION = auto()
    MEMORY_EFFICIENT_MIXED_PRECISION = auto()
    PURE_FP16 = auto()


def _first_param(parameters: List[Any]) -> Tensor:
    if not parameters:
        raise ValueError("Adam got an empty parameter list; pass the model's parameters")
    first = parameters[0]
    if isinstance(first, dict):
        params = list(first.get("params", []))
        if not params:
            raise ValueError("Adam: the first param group has no parameters")
        return params[0]  # type: ignore[no-any-return]
    return first  # type: ignore[no-any-return]


class Adam(torch.optim.Optimizer):
    """Adam with fp16 training modes, numerically upstream fairscale's fused Adam.

    Weight decay is applied as upstream's kernel does: inside the update, ``p -= step_size * (m / denom + wd * p)``
    with the bias-corrected step size (neither torch's L2 ``Adam`` nor its ``AdamW``). ``eps`` is added to
    ``sqrt(v)`` before the bias correction (``eps_inside_sqrt=True``: inside the square root).

    In ``MIXED_PRECISION`` the fp32 masters follow the parameters: at each step, a parameter written since the
    optimizer's last write (an in-place write such as ``model.load_state_dict()`` or ``p.copy_()`` under
    ``torch.no_grad()``, or ``p.data = t``) has its master re-read from it wherever its value is no longer the
    rounded master (the re-read elements lose the master's extra precision; the others keep it). Unchanged
    parameters cost a few attribute reads, no tensor work. An in-place write through ``p.data`` (``p.data.copy_()``)
    bypasses the parameter's version counter and is not noticed: write under ``torch.no_grad()`` instead.
    :meth:`load_state_dict` re-reads every master from its parameter, as a new optimizer would build it.
    :meth:`add_param_group` builds masters for the new group as the constructor does.

    Args:
        params: parameters or param-group dicts.
        lr (float): learning rate. Default: 1e-3.
        bias_correction (bool): apply Adam's bias correction. Default: ``True``.
        betas (Tuple[float, float]): moment decay rates. Default: (0.9, 0.999).
        eps (float): added to the denominator. Default: 1e-8.
        eps_inside_sqrt (bool): add ``eps`` inside the square root. Default: ``False``.
        weight_decay (float): weight decay. Default: 0.
        max_grad_norm (float): accepted and stored, not used (as upstream). Default: 0.
        amsgrad (bool): not supported; ``True`` raises ``RuntimeError``.
        precision (Optional[Precision]): default ``FULL_PRECISION`` for fp32 parameters, ``MIXED_PRECISION`` for
            fp16 ones.

    Raises:
        ValueError: (also an ``AssertionError``, as upstream asserted) a mode other than ``FULL_PRECISION`` with
            parameters that are not fp16.
        RuntimeError: ``amsgrad=True``; at :meth:`step`, in ``MIXED_PRECISION``, a parameter whose shape or
            device changed since it was given to the optimizer (its master and moments no longer fit: build a new
            optimizer).
        ValueError: an invalid learning rate, beta, epsilon or weight decay.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        amsgrad: bool = False,
        precision: Optional[Precision] = None,
    ) -> None:
        parameters: List[Any] = list(params)
        first = _first_param(parameters)
        if precision is None:
            precision = Precision.FULL_PRECISION if first.dtype == torch.float32 else Precision.MIXED_PRECISION
        if precision is not Precision.FULL_PRECISION and first.dtype != torch.float16:
            raise FairscaleValueError(
                f"Adam: {precision} needs fp16 parameters, got {first.dtype}; use Precision.FULL_PRECISION for "
                "fp32 parameters, or convert the model to fp16 (model.half()) first"
            )
        self.precision = precision
        self.optim_type = torch.float16 if precision is Precision.PURE_FP16 else torch.float32
        self._optim_scale = _MAX_OPTIM_SCALE if precision is Precision.PURE_FP16 else 1.0
        self._steps_since_optim_scale_change = 0
        self._optim_scale_update_freq = 2000
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        _check_hyper_parameters(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
        )
        # Filled by add_param_group, which torch's constructor calls for each group.
        self.fp32_param_groups: List[Dict[str, Any]] = []
        self._written: Dict[Tensor, _Mark] = {}  # in MIXED_PRECISION: each parameter as the optimizer last left it
        super().__init__(parameters, defaults)
        self.eps_mode = 0 if eps_inside_sqrt else 1

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a param group (torch's ``add_param_group``); in ``MIXED_PRECISION`` also its fp32 masters.

        Args:
            param_group (dict): the group's ``params`` and hyper-parameters (the missing ones from the defaults).

        Raises:
            ValueError: an invalid learning rate, beta, epsilon or weight decay of the group's own (checked as the
                defaults are; the constructor's groups come here too). Nothing is added then.
        """
        if isinstance(param_group, dict):  # anything else is refused by torch in its own words
            # Only the defaults used to be checked: a group's betas=(0.9,) failed in step() with a bare IndexError.
            _check_group(param_group, self.defaults)
        super().add_param_group(param_group)
        if self.mixed_precision:
            # One group of fp32 masters per param group, built like the constructor's (upstream built a single
            # group at construction only, so its next step after add_param_group failed with an IndexError).
            self.fp32_param_groups.append(self._fp32_group(self.param_groups[-1], self.param_groups[-1]["params"]))

    def _fp32_group(self, group: Dict[str, Any], params: List[Tensor]) -> Dict[str, Any]:
        """A group of fp32 master copies (zero gradients) of ``params``, with ``group``'s hyper-parameters."""
        masters = []
        for p in params:
            master = torch.nn.Parameter(p.detach().clone().float())
            master.grad = torch.zeros_like(master)
            masters.append(master)
            self._written[p] = _mark(p)
        return {**{k: v for k, v in group.items() if k != "params"}, "params": masters}

    def _build_fp32_params(self, params: Iterable[Tensor]) -> None:
        """Rebuild the fp32 master copies from ``params`` (upstream's private helper, which its tests call).

        As upstream, the masters form a single group (with the first param group's hyper-parameters), so this
        optimizer must have one param group holding exactly ``params``; their optimizer state is kept.

        Raises:
            ValueError: more than one param group, or ``params`` are not the group's parameters in order.
        """
        parameters = list(params)
        if len(self.param_groups) != 1 or [id(p) for p in parameters] != [
            id(p) for p in self.param_groups[0]["params"]
        ]:
            raise FairscaleValueError(
                f"Adam._build_fp32_params builds the masters of a single param group: it needs an optimizer with one "
                f"group (this one has {len(self.param_groups)}) and that group's parameters, in order ({len(parameters)} "
                "given). Masters of more groups are built by the constructor and add_param_group."
            )
        self.fp32_param_groups = [self._fp32_group(self.param_groups[0], parameters)]

    # torch's Optimizer pickles (and deep-copies) only defaults, state and param_groups: a copy lacked the precision,
    # the masters and the scale counters, and its first step raised AttributeError.
    _PICKLED = (
        "precision",
        "optim_type",
        "_optim_scale",
        "_steps_since_optim_scale_change",
        "_optim_scale_update_freq",
        "fp32_param_groups",
        "eps_mode",
    )

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state.update({name: self.__dict__[name] for name in self._PICKLED if name in self.__dict__})
        # Memory addresses and versions mean nothing in the copy: record only which parameters the optimizer left
        # as they are (their masters stay), and mark the others again in the copy.
        state["_unchanged"] = {p: mark == _mark(p) for p, mark in self.__dict__.get("_written", {}).items()}
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        unchanged = state.pop("_unchanged", {})
        super().__setstate__(state)
        self._written = {p: _mark(p) if same else _CHANGED for p, same in unchanged.items()}

    @property
    def supports_memory_efficient_fp16(self) -> bool:
        return True

    @property
    def _step_supports_amp_scaling(self) -> bool:
        return False

    @property
    def mixed_precision(self) -> bool:
        """Whether fp32 master copies are kept (``Precision.MIXED_PRECISION``)."""
        return self.precision is Precision.MIXED_PRECISION

    def state_dict(self) -> Dict[str, Any]:
        """torch's optimizer state dict plus ``"optim_scale"`` (the fp16 optimizer-state scale) and
        ``"optim_scale_steps"`` (clean updates since it last changed: without it a resumed run doubled the scale later
        than the uninterrupted one, and their moments overflowed at different steps; an addition of this
        distribution's, which upstream's ``load_state_dict`` ignores and whose absence counts as 0)."""
        state = super().state_dict()
        state["optim_scale"] = self._optim_scale
        state["optim_scale_steps"] = self._steps_since_optim_scale_change
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict`; the moments keep this optimizer's state dtype, exactly.

        Everything is checked before anything changes: a dict that does not fit raises and leaves the optimizer as
        it was. Each parameter's state must be empty (never stepped) or hold ``step`` (a non-negative number)
        and ``exp_avg`` / ``exp_avg_sq`` tensors of exactly the parameter's shape.

        In ``MIXED_PRECISION`` every fp32 master is re-read from its parameter (the state dict holds no masters): the
        optimizer then steps exactly as one built on the current parameters and given this state dict, also when
        the model's weights were loaded after the optimizer was built.

        Raises:
            KeyError: the dict has no ``"optim_scale"`` (it was not written by this optimizer).
            ValueError: (also an ``AssertionError``) another number of parameter groups or of parameters in a
                group, an invalid ``optim_scale``, or a parameter's state that cannot be this optimizer's state of
                that parameter (e.g. moments shaped for another model); the message names the parameter.
            RuntimeError: in ``MIXED_PRECISION``, a parameter whose shape or device changed since it was given to
                the optimizer.
        """
        self._check_loadable_state_dict(state_dict, self.param_groups)
        for p, master in self._masters():
            _check_master_fits(p, master)
        super().load_state_dict(state_dict)
        self._optim_scale = float(state_dict["optim_scale"])
        self._steps_since_optim_scale_change = int(state_dict.get("optim_scale_steps", 0))
        # torch casts floating state to each parameter's dtype (fp16 here in the mixed modes): re-read the saved
        # moments in the optimizer's state dtype so that no precision is lost.
        by_id = _saved_id_to_param(state_dict, self.param_groups)
        for idx, saved in state_dict["state"].items():
            param = by_id.get(idx)
            if param is None:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                if key in saved:
                    # A fresh tensor laid out like the parameter: the kernels walk both memories in step, and a
                    # crafted layout (stride 0, transposed) must not make them read or write out of bounds.
                    moment = torch.empty_like(param, dtype=self.optim_type)
                    self.state[param][key] = moment.copy_(saved[key])
        # The usual resume loads the model's weights after the optimizer was built: without this, the next step
        # would write the masters of the initial weights back over the loaded ones.
        with torch.no_grad():
            for p, master in self._masters():
                master.copy_(p)
                self._written[p] = _mark(p)

    def _masters(self) -> List[Tuple[Tensor, Tensor]]:
        """``(parameter, fp32 master)`` of every parameter (empty unless ``MIXED_PRECISION``)."""
        return [
            (p, master)
            for group, fp32_group in zip(self.param_groups, self.fp32_param_groups)
            for p, master in zip(group["params"], fp32_group["params"])
        ]

    def _read_changed_parameters(self) -> None:
        """Re-read the master of each parameter written since the optimizer last wrote it."""
        for p, master in self._masters():
            if self._written[p] == _mark(p):
                continue  # the common case: no tensor work
            _check_master_fits(p, master)
            # The version counter also moves for writes that keep the values (an EMA swapped in and out, a view
            # of a buffer written elsewhere), and a partial write (a pruning mask) leaves most elements alone:
            # keep the master's extra precision wherever the parameter still holds the rounded master.
            unchanged = p == master.to(p.dtype)
            master.copy_(torch.where(unchanged, master, p.to(master.dtype)))

    @staticmethod
    def _check_loadable_state_dict(state_dict: Dict[str, Any], param_groups: List[Dict[str, Any]]) -> None:
        """Raise unless :meth:`load_state_dict` can load ``state_dict`` into ``param_groups``; changes nothing.

        Static so that a wrapper holding a shard of the parameters (OSS) can check a whole state dict against all
        of them, on every rank, and every rank raises the same error.
        """
        if "optim_scale" not in state_dict:
            raise KeyError("optim_scale: this state dict was not written by fairscale.optim.Adam.state_dict()")
        _check_loadable(state_dict, param_groups)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One Adam step over every parameter with a gradient.

        In ``MIXED_PRECISION`` the masters of the parameters written outside the optimizer since its last step are
        re-read first (see :class:`Adam`).

        Args:
            closure (Optional[Callable]): re-evaluates the model and returns the loss (called with gradients on).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            RuntimeError: a sparse gradient; the fp16 optimizer-state scale fell below 1; in ``MIXED_PRECISION``, a
                parameter whose shape or device changed since it was given to the optimizer.
            ValueError: a param group's learning rate, betas, epsilon or weight decay is invalid (edited since it was
                added); nothing changes then.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every group's values are checked before anything changes: they may have been edited since the group was
        # added (param_groups[i]["betas"] = ...), and a bad one used to fail half-way, after the step counters moved.
        for group in self.param_groups:
            _check_group(group, self.defaults)
        if self.mixed_precision:
            self._read_changed_parameters()
        for idx, group in enumerate(self.param_groups):
            found_inf = self._step_group(idx, group)
            self._after_group(found_inf)
        # Marked after all groups: parameters that are views of one buffer share a version counter, which the
        # write-back of every group moves.
        for p, _ in self._masters():
            self._written[p] = _mark(p)
        return loss

    def _step_group(self, idx: int, group: Dict[str, Any]) -> bool:
        targets = self.fp32_param_groups[idx]["params"] if self.mixed_precision else group["params"]
        by_device: Dict[torch.device, List[Tuple[Tensor, Tensor, Dict[str, Any]]]] = {}
        step = 0
        for p, target in zip(group["params"], targets):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("FusedAdam does not support sparse gradients, please consider SparseAdam instead")
            state = self.state[p]
            if len(state) == 0 or "step" not in state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(target, dtype=self.optim_type)
                state["exp_avg_sq"] = torch.zeros_like(target, dtype=self.optim_type)
            state["step"] += 1
            step = state["step"]  # upstream's kernel uses the step of the last parameter for the whole group
            by_device.setdefault(target.device, []).append((target, p.grad, state))
        found_inf = False
        for entries in by_device.values():
            hyper = AdamHyper(
                lr=group["lr"],
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                bias_correction=bool(group["bias_correction"]),
                eps_inside_sqrt=self.eps_mode == 0,
                step=step,
            )
            overflow = adam_update(
                [t for t, _, _ in entries],
                [g for _, g, _ in entries],
                [s["exp_avg"] for _, _, s in entries],
                [s["exp_avg_sq"] for _, _, s in entries],
                hyper,
                self._optim_scale,
            )
            found_inf = found_inf or bool(overflow)
        if self.mixed_precision:
            for p, master in zip(group["params"], targets):
                if p.grad is not None:
                    p.copy_(master)
        return found_inf

    def _after_group(self, found_inf: bool) -> None:
        # Upstream advances the scale counter once per group (not per step); kept for identical scale schedules.
        if found_inf:
            self._steps_since_optim_scale_change = 0
            self._optim_scale /= 2
            if self._optim_scale < 1.0:
                raise RuntimeError("Optimizer state scale < 1. This may mean that gradients are exploding")
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state.get(p)
                    if state:  # never create state for a parameter that has not stepped yet
                        state["exp_avg"] = torch.zeros_like(state["exp_avg"])
                        state["exp_avg_sq"] = torch.zeros_like(state["exp_avg_sq"])
        else:
            self._steps_since_optim_scale_change += 1
        if self._steps_since_optim_scale_change == self._optim_scale_update_freq:
            self._steps_since_optim_scale_change = 0
            if self._optim_scale < _MAX_OPTIM_SCALE:
                self._optim_scale *= 2


def _mark(p: Tensor) -> _Mark:
    """What changes when ``p`` is written, read without touching its values.

    ``_version`` counts in-place writes to ``p`` and to the tensors sharing its memory (``copy_`` under
    ``no_grad``, ``Module.load_state_dict``); ``p.data = t`` keeps the counter but replaces the memory, seen in the
    address, the shape and the strides.
    """
    return (p._version, p.data_ptr(), p.shape, p.stride())


def _check_master_fits(p: Tensor, master: Tensor) -> None:
    if master.shape != p.shape or master.device != p.device:
        raise RuntimeError(
            f"Adam: a parameter is now {tuple(p.shape)} on {p.device} but was {tuple(master.shape)} on "
            f"{master.device} when it was given to the optimizer (e.g. replaced through p.data, or moved after the "
            "optimizer was built); its fp32 master and moments no longer fit: build the optimizer after changing "
            "the parameters"
        )


def _saved_id_to_param(state_dict: Dict[str, Any], param_groups: List[Dict[str, Any]]) -> Dict[Any, Tensor]:
    """``{saved parameter id: parameter}``, positional over the groups (as torch pairs them)."""
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in param_groups for p in g["params"]]
    return dict(zip(saved_ids, params))


def _check_loadable(state_dict: Dict[str, Any], param_groups: List[Dict[str, Any]]) -> None:
    """Raise unless ``state_dict`` is Adam state for exactly these groups (shapes included); changes nothing.

    The fused and foreach kernels trust the moments' shapes: moments of another model would be read and written
    out of bounds, so every state is checked here, before torch's loader changes anything.
    """
    who = "fairscale.optim.Adam.load_state_dict"
    scale = state_dict["optim_scale"]
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not (0 < float(scale) < math.inf):
        raise FairscaleValueError(f"{who}: optim_scale must be a positive finite number, got {scale!r}")
    steps = state_dict.get("optim_scale_steps", 0)
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise FairscaleValueError(f"{who}: optim_scale_steps must be an integer >= 0, got {steps!r}")
    for name in ("state", "param_groups"):
        if name not in state_dict:
            raise FairscaleValueError(f"{who}: the state dict has no {name!r} entry; pass Adam.state_dict()'s output")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise FairscaleValueError(
            f"{who}: the state dict has {len(saved_groups)} parameter groups but this optimizer has "
            f"{len(param_groups)}; build the optimizer with the same groups before loading"
        )
    for i, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if len(saved.get("params", ())) != len(group["params"]):
            raise FairscaleValueError(
                f"{who}: parameter group {i} of the state dict has {len(saved.get('params', ()))} parameters but "
                f"this optimizer's has {len(group['params'])}"
            )
    by_id = _saved_id_to_param(state_dict, param_groups)
    for idx, entry in state_dict["state"].items():
        param = by_id.get(idx)
        if param is None:
            continue  # torch ignores state that no group lists
        check_param_state(who, idx, entry, param)
        if not entry:
            continue
        missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in entry]
        if missing:
            raise FairscaleValueError(
                f"{who}: the state of parameter {idx} has no {missing}; a stepped parameter's state holds 'step', "
                "'exp_avg' and 'exp_avg_sq'"
            )
        for key in ("exp_avg", "exp_avg_sq"):
            value = entry[key]
            if not isinstance(value, Tensor) or not (value.is_floating_point() and value.layout == torch.strided):
                raise FairscaleValueError(
                    f"{who}: state {key!r} of parameter {idx} must be a dense floating-point tensor, got "
                    f"{type(value).__name__}{'' if not isinstance(value, Tensor) else f' of {value.dtype}'}"
                )
        step = entry["step"]
        step_value = step.item() if isinstance(step, Tensor) and step.numel() == 1 else step
        if isinstance(step_value, bool) or not isinstance(step_value, numbers.Real) or step_value < 0:
            raise FairscaleValueError(
                f"{who}: state 'step' of parameter {idx} must be a non-negative number, got {step!r}"
            )


def _check_group(group: Dict[str, Any], defaults: Dict[str, Any]) -> None:
    """Check a param group's hyper-parameters (the ones it lacks come from ``defaults``) as the defaults are."""
    values = {name: group.get(name, defaults[name]) for name in ("lr", "betas", "eps", "weight_decay")}
    _check_hyper_parameters(values["lr"], values["betas"], values["eps"], values["weight_decay"])


def _check_hyper_parameters(lr: float, betas: Tuple[float, float], eps: float, weight_decay: float) -> None:
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}; it must be >= 0")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}; it must be >= 0")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        # Only the step read betas[1]: (0.9,) was accepted and failed there with an IndexError.
        raise ValueError(f"Invalid betas: {betas!r}; pass two decay rates (beta1, beta2), e.g. (0.9, 0.999)")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}; it must be in [0, 1)")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}; it must be >= 0")
