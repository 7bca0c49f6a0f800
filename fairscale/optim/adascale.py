# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AdaScale: scale the learning rate with the gradient-noise "gain" of large-batch training.

AdaScale (Johnson et al., "AdaScale SGD: A User-Friendly Algorithm for Distributed Training", ICML 2020) wraps an
optimizer. While the backward passes of one step run, it estimates the squared norm of the true gradient and the
variance of the per-worker (or per-micro-batch) gradients, keeps moving averages of both in the wrapped optimizer's
state (under the key ``"adascale"``, so checkpoints carry them), and multiplies every group's learning rate by

    gain = (var + sqr) / (var / scale + sqr)

for the duration of ``step()``. ``scale`` is the batch-size ratio to the single-worker setting (default: world size
times accumulation steps), and the gain lies between 1 (no noise: a bigger batch does not help) and ``scale``
(pure noise: the bigger batch is as good as ``scale`` small steps).

Typical use, with DDP::

    optim = AdaScale(SGD(model.parameters(), lr=0.1))
    for batch in data:
        optim.zero_grad()
        loss = ddp_model(batch).sum()
        loss.backward()
        optim.step()

The statistics are gathered by tensor hooks on every parameter that requires grad (the local gradient, before DDP
averages it) and an end-of-backward callback queued so that it runs after DDP's own reduction. Frozen parameters
are accepted and left out of the statistics; one unfrozen later is hooked when AdaScale first sees its gradient, and
that step's statistics are left out. So are those of a step whose gradients are not finite (the step an AMP grad
scaler skips), on every rank alike. Ranks that measured different gradients (FSDP, ShardedDataParallel, or
``OSS(params, optim=AdaScaleWrapper)``: each holds a part of them) compute different gains: the first window's end
warns, on every rank.
"""

import math
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, cast

import numpy as np
import torch
from torch import Tensor
from torch.autograd import Variable

from fairscale.internal import collectives
from fairscale.internal.errors import FairscaleRuntimeError
from fairscale.optim._adascale import arguments
from fairscale.optim._adascale import correlation as _correlation
from fairscale.optim._adascale import hooks, measured_grads, rank_checks
from fairscale.optim._adascale import statistics
from fairscale.optim._adascale.statistics import STATE_KEY

__all__ = ["AdaScale", "AdaScaleWrapper"]


class AdaScale(torch.optim.Optimizer):
    """Wraps an optimizer and adapts its learning rate to the gradient noise of large-batch training.

    AdaScale itself never calls ``torch.optim.Optimizer.__init__``: it shares ``param_groups`` (the same list
    object, so LR schedulers work) and the ``state`` of the wrapped optimizer; unknown attributes are looked up
    on the wrapped optimizer.

    Args:
        optimizer (torch.optim.Optimizer): the optimizer to wrap (e.g. SGD, or OSS for sharded training).
        world_size (Optional[int]): number of data-parallel workers; default the default group's size when
            torch.distributed is initialised, else 1.
        scale (Optional[float]): batch-size ratio to the single-worker baseline, a finite number >= 1; default
            ``world_size * num_gradients_to_accumulate``.
        smoothing (Optional[float]): factor of the moving averages, in ``[0, 1)`` (``1`` too with
            ``debias_ewma=False``: a plain running mean); default ``max(1 - scale_default / 1000, 0)``.
        num_gradients_to_accumulate (int): backward passes per optimizer step, a whole number >= 1. Default: 1.
        is_scaled_loss (bool): whether each micro-batch's loss is divided by ``num_gradients_to_accumulate``
            (the gradients then sum to the mean). Default: ``True``.
        debias_ewma (bool): debias the moving averages (each starts at the first value). Default: ``True``.

    Raises:
        RuntimeError: a single worker without gradient accumulation (no gradient noise to measure).
        ValueError: ``scale`` below 1 or not finite, ``num_gradients_to_accumulate`` not a whole number >= 1 (both
            also ``AssertionError``, as upstream asserted), or ``smoothing`` out of range.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        world_size: Optional[int] = None,
        scale: Optional[float] = None,
        smoothing: Optional[float] = None,
        num_gradients_to_accumulate: int = 1,
        is_scaled_loss: bool = True,
        debias_ewma: bool = True,
    ) -> None:
        # First, so that a half-built object can still be deleted (``__del__`` unhooks).
        self._hook_handles: List[Any] = []
        self._hooked: Set[int] = set()  # ids of the hooked parameters
        self._hooks_enabled = False  # False after unhook(): then nothing is hooked behind the user's back
        self._calls_at_last_step = 0
        self._optimizer = optimizer
        self._local_grad_sqr: Optional[Tensor] = None
        self._callback_queued = False
        self._warned_ranks_differ = False  # the warning of measured_grads, once per AdaScale
        # Whether load_state_dict() ran since the last window's end, which then compares the ranks' statistics
        # (rank_checks.check_same_loaded_statistics).
        self._loaded = False
        self._world_size = arguments.checked_world_size(world_size)
        self._num_backward_calls = 0
        self._last_final_backward_call = 0
        self._debias_ewma = debias_ewma
        self._is_scaled_loss = is_scaled_loss
        self.param_groups = optimizer.param_groups

        # Also refuses a single worker without grad accumulation (the setter applies that rule too).
        self.set_num_gradients_to_accumulate(num_gradients_to_accumulate, update_smoothing=True)
        if smoothing is not None:
            self._smoothing = statistics.checked_smoothing(smoothing, debias_ewma)

        n_groups = len(optimizer.param_groups)
        # The end of each accumulation window all-reduces one value per param group: ranks with other group counts
        # or windows would meet in collectives of different sizes (gloo waits until its timeout) or not at all.
        initial_scale = (
            self._world_size * self._num_grads_to_accum if scale is None else arguments.as_number("scale", scale)
        )
        self._check_ranks_agree(
            n_groups, initial_scale, _has_trainable(group["params"] for group in optimizer.param_groups)
        )
        cast(Dict[Any, Any], optimizer.state).setdefault(STATE_KEY, statistics.fresh(n_groups))
        self._scale = 1.0
        self.set_scale(initial_scale)
        self._hook()

    # ------------------------------------------------------------------------------------------
    # Attribute forwarding and properties

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes AdaScale does not have (``state``, ``defaults`` ...).
        if name.startswith("__") or name in ("_optimizer", "_hook_handles", "_hooked", "_hooks_enabled"):
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    def __getstate__(self) -> Dict[str, Any]:
        # Reached by copy.copy, copy.deepcopy and pickling. torch's Optimizer keeps only defaults, state and
        # param_groups: the copy lacked the wrapped optimizer and failed at its first use ("_optimizer"). A copy
        # cannot work either way: AdaScale's statistics come from hooks on the gradients of the parameters it was
        # built over, which a copy would not see.
        raise TypeError(
            "AdaScale cannot be copied or pickled: it measures gradients through hooks on the parameters it was built "
            "over, which a copy would not see. Build a new AdaScale around an optimizer over the copied model's "
            "parameters and load_state_dict(adascale.state_dict()) into it (the statistics travel in the state dict)."
        )

    @property
    def _state(self) -> Dict[str, Any]:
        return cast(Dict[str, Any], cast(Dict[Any, Any], self._optimizer.state)[STATE_KEY])

    @property
    def scale(self) -> float:
        """The current batch-size scale ``S``."""
        return self._scale

    @property
    def smoothing(self) -> float:
        """The factor of the moving averages of the gradient statistics."""
        return self._smoothing

    def _in_backward(self) -> bool:
        # Statistics of the current accumulation window exist from the first hook until the window's final callback.
        return self._local_grad_sqr is not None

    def _backward_aborted(self) -> bool:
        """Whether a backward queued the end-of-backward callback but ended without running it (it raised).

        The engine runs queued callbacks before ``backward()`` returns, so outside of any backward a callback that
        is still marked queued belongs to a backward that raised; the engine dropped it.
        """
        return self._callback_queued and torch._C._current_graph_task_id() == -1

    def _check_not_in_backward(self, what: str) -> None:
        """Raise unless no accumulation window is open and no backward was left unfinished.

        Args:
            what (str): upstream's message for the call (e.g. ``"Don't step without finishing backward phase"``),
                kept first so that code matching it still does.
        """
        if self._backward_aborted():
            raise FairscaleRuntimeError(
                f"AdaScale: {what}: the last backward raised before it finished, leaving partial gradient "
                "statistics. Call zero_grad() to discard them (and the gradients), then run the iteration again."
            )
        if self._in_backward():
            done = self._num_backward_calls - self._last_final_backward_call
            raise FairscaleRuntimeError(
                f"AdaScale: {what}: {done} of the {self._num_grads_to_accum} backward passes of this step "
                "(num_gradients_to_accumulate) have run; run the others first."
            )

    def _reset_backward_window(self) -> None:
        """Forget the gradient statistics of the current step's backward passes (their gradients are dropped)."""
        self._local_grad_sqr = None
        self._callback_queued = False
        self._num_backward_calls = self._last_final_backward_call

    # ------------------------------------------------------------------------------------------
    # Configuration

    def set_scale(self, scale: float, update_estimate: bool = True) -> None:
        """Set the batch-size scale ``S``.

        Args:
            scale (float): the new scale, a finite number >= 1.
            update_estimate (bool): rescale the stored variance estimate to the new scale (it is measured per
                ``S`` samples). Default: ``True``.

        Raises:
            ValueError: (also an ``AssertionError``) ``scale`` below 1, or not finite (an infinite scale made the
                gain, and so the learning rate, NaN).
        """
        self._check_not_in_backward("Don't change scale in backward phase")
        scale = arguments.as_number("scale", scale)
        arguments.check_scale(scale)
        if update_estimate:
            statistics.rescale_variance(self._state, self._scale / scale, self._debias_ewma)
        self._scale = scale

    def set_num_gradients_to_accumulate(self, num_gradients_to_accumulate: int, update_smoothing: bool = True) -> None:
        """Set the number of backward passes per step.

        Args:
            num_gradients_to_accumulate (int): a whole number, at least 1.
            update_smoothing (bool): reset the smoothing factor to ``max(1 - world_size * n / 1000, 0)``.

        Raises:
            ValueError: (also an ``AssertionError``) not a whole number >= 1 (a fraction such as 2.5 never ends an
                accumulation window).
            RuntimeError: 1 with a single worker (``world_size`` 1), as the constructor refuses it; nothing changes.
        """
        self._check_not_in_backward("Don't change num_grad_to_accum in backward phase")
        num_gradients_to_accumulate = arguments.as_number("num_gradients_to_accumulate", num_gradients_to_accumulate)
        arguments.check_num_gradients(num_gradients_to_accumulate, self._world_size)
        self._num_grads_to_accum = num_gradients_to_accumulate
        if update_smoothing:
            self._smoothing = max(1 - self._world_size * num_gradients_to_accumulate / 1000, 0)

    def scale_grad_by_num_grads_to_accum(self) -> None:
        """Divide every gradient by the number of accumulation steps (for unscaled losses), after backward."""
        self._check_not_in_backward("Only call this after backward")
        if self._num_grads_to_accum <= 1:
            raise FairscaleRuntimeError(
                "AdaScale.scale_grad_by_num_grads_to_accum: only for gradient accumulation "
                "(num_gradients_to_accumulate > 1)"
            )
        if self._is_scaled_loss:
            raise FairscaleRuntimeError(
                "AdaScale.scale_grad_by_num_grads_to_accum: only for unscaled losses; build AdaScale with "
                "is_scaled_loss=False, or divide each loss by num_gradients_to_accumulate and do not call this"
            )
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(self._num_grads_to_accum)

    # ------------------------------------------------------------------------------------------
    # Hooks and gradient statistics

    def _use_hooks(self, handles: List[Any], hooked: Set[int]) -> None:
        """Replace the current hooks by ``handles`` (from :func:`hooks.register_hooks`)."""
        self.unhook()
        self._hook_handles, self._hooked, self._hooks_enabled = handles, hooked, True

    def _hook(self) -> None:
        # Registered before the old hooks go: an error leaves the old ones in place. The hooks hold this AdaScale
        # weakly, so that a dropped one is freed (and ``__del__`` unhooks) while the model lives on.
        self._use_hooks(*hooks.register_hooks(self, [group["params"] for group in self._optimizer.param_groups]))

    def _hook_unfrozen(self) -> List[str]:
        """Hook the parameters that require grad but have no hook (frozen when AdaScale hooked them).

        Returns where those of them that already hold a gradient are (``"group 0, param 3"``): AdaScale did not
        measure that gradient. Nothing is hooked after :meth:`unhook`.
        """
        if not self._hooks_enabled:
            return []
        return hooks.hook_unfrozen(self, self._optimizer.param_groups, self._hook_handles, self._hooked)

    def unhook(self) -> None:
        """Remove the gradient hooks (AdaScale stops measuring; ``gain()`` keeps its last value)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self._hooked = set()
        self._hooks_enabled = False

    def __del__(self) -> None:
        if "_hook_handles" in self.__dict__:
            self.unhook()

    def _backward_hook(self, pg_idx: int, grad: Tensor) -> None:
        # The incoming local gradient of one parameter, before accumulation and before DDP averages it.
        if self._local_grad_sqr is None:
            self._local_grad_sqr = torch.zeros(len(self._optimizer.param_groups), device=grad.device)
        self._local_grad_sqr[pg_idx] += grad.detach().float().pow(2).sum()
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._queue_final_callback)

    def _queue_final_callback(self) -> None:
        # Queued once more so that it runs after callbacks queued during this backward (DDP's reduction).
        Variable._execution_engine.queue_callback(self._final_callback)

    def _final_callback(self) -> None:
        self._callback_queued = False
        if self._local_grad_sqr is None:  # pragma: no cover - queued only after a hook set it
            raise FairscaleRuntimeError("AdaScale: end of backward without gradient statistics (internal error)")
        self._num_backward_calls += 1
        calls, last, accum = self._num_backward_calls, self._last_final_backward_call, self._num_grads_to_accum
        if calls - last > accum:  # pragma: no cover - the window closes at ``accum`` calls
            raise FairscaleRuntimeError(f"AdaScale: {calls - last} backward passes in a window of {accum}")
        if (calls - last) % accum != 0:
            return  # still accumulating
        work = None
        payload = self._local_grad_sqr
        # Before the all-reduce, so that what this rank alone sees travels in it (no extra collective): a window with
        # a non-finite reduced gradient (the step an AMP grad scaler skips) or with a gradient that no hook measured
        # (a parameter unfrozen since AdaScale hooked the parameters) is marked NaN, so that every rank leaves it out
        # of the statistics. Non-finite local statistics need no mark: the sum carries them to every rank.
        total = np.array([hooks.hooked_grad_sqr(group["params"], self._hooked) for group in self.param_groups])
        unmeasured = self._hook_unfrozen()
        if unmeasured or not np.isfinite(total).all():
            payload = torch.full_like(payload, math.nan)
        if self._world_size > 1:
            rank_checks.check_group_size(self._world_size)
            # The window length rides along, as n and n * n (exact in fp32): a rank with another
            # num_gradients_to_accumulate reaches this all-reduce at another backward, which paired statistics of
            # different windows silently and left one all-reduce unmatched at the end (a hang). The scale rides along
            # the same way: set_scale() on some ranks only trained them with other learning rates, silently. So do the
            # squared norms of the gradients this rank measured, which differ between ranks with sharded gradients.
            scale = float(self._scale)
            extra = measured_grads.payload_values(total) + [float(accum), float(accum * accum), scale, scale * scale]
            extra.append(float(self._loaded))
            payload = torch.cat([payload, payload.new_tensor(extra)])
            work = collectives.all_reduce(payload, op="sum", async_op=True)
        self._last_final_backward_call = calls
        self._local_grad_sqr = None
        if work is not None:
            work.wait()
            rank_checks.check_same_window(payload[-5:-3].tolist(), self._num_grads_to_accum)
            rank_checks.check_same_scale(payload[-3:-1].tolist(), self._scale)
            n_groups = len(total)
            sums = payload[n_groups:-5].tolist()
            differ = measured_grads.differing_group(sums, collectives.group_size(None)) is not None
            # Deferred to a window that tells sharded gradients apart (finite and not all zero: an AMP overflow or an
            # all-zero window looks like agreeing ranks), else per-rank checkpoints of sharded setups were refused.
            if rank_checks.tells_sharding(sums):
                rank_checks.check_same_loaded_statistics(float(payload[-1]), self._loaded, self._state, differ)
                self._loaded = False
            self._warn_if_ranks_differ(sums)
            payload = payload[:n_groups]
        if unmeasured:
            warnings.warn(hooks.unmeasured_message(unmeasured, "this step's gradient statistics were left out"))
        # The local squared norms stay fp32 through the accumulation correction, the reduced ones are fp32 per
        # parameter and float64 across parameters, the estimates float64: upstream's roundings, so its gains are
        # reproduced to the last bit.
        self._update_statistics(payload.cpu().numpy(), total)

    def _warn_if_ranks_differ(self, sums: List[float]) -> None:
        """Warn (once, on every rank alike) when the ranks measured different gradients: see :mod:`measured_grads`.

        A warning, not an error: upstream trained so under ShardedDataParallel, and its gains, though they differ
        between the ranks, may be what a run relies on."""
        if self._warned_ranks_differ:
            return
        size = collectives.group_size(None)
        found = measured_grads.differing_group(sums, size)
        if found is not None:
            self._warned_ranks_differ = True
            warnings.warn(measured_grads.ranks_differ_message(found[0], found[1], size))

    def _update_statistics(self, local_sqr: "np.ndarray[Any, Any]", total_sqr: "np.ndarray[Any, Any]") -> None:
        """Fold one window's estimates into the moving averages; a window whose values are not finite leaves them as
        they are (every rank has the same all-reduced values, so every rank decides alike)."""
        estimates = statistics.estimate(
            local_sqr, total_sqr, self._num_grads_to_accum, self._world_size, self._scale, self._is_scaled_loss
        )
        if estimates is None:
            return
        grad_sqr, grad_var = estimates
        statistics.update_average(self._state, "grad_sqr_avg", grad_sqr, self._smoothing, self._debias_ewma)
        statistics.update_average(self._state, "grad_var_avg", grad_var, self._smoothing, self._debias_ewma)

    # ------------------------------------------------------------------------------------------
    # Optimizer interface

    def gain(self, pg_idx: Optional[int] = None) -> float:
        """The learning-rate gain ``(var + sqr) / (var / scale + sqr)``.

        Args:
            pg_idx (Optional[int]): a param group's index, or ``None`` for the sums over all groups.
        """
        return statistics.gain(self._state, self._scale, pg_idx)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Step the wrapped optimizer with every group's ``lr`` multiplied by its gain (restored afterwards).

        When no hooked parameter had a gradient since the last step but a parameter unfrozen since AdaScale hooked
        the parameters has one, that parameter is hooked now, with a warning (the step used the last gain).

        Raises:
            RuntimeError (an ``AssertionError`` too): the step's backward passes are not all done, or the last
                backward raised (call :meth:`zero_grad` first).
        """
        self._check_not_in_backward("Don't step without finishing backward phase")
        saved = []
        for idx, group in enumerate(self._optimizer.param_groups):
            saved.append(group["lr"])
            group["lr"] = group["lr"] * self.gain(idx)
        try:
            result = self._optimizer.step(*args, **kwargs)
        finally:
            for group, lr in zip(self._optimizer.param_groups, saved):
                group["lr"] = lr
        if self._num_backward_calls == self._calls_at_last_step:
            # No hooked gradient since the last step, so no window end looked for unfrozen parameters: a model whose
            # parameters were all frozen when AdaScale hooked them would otherwise never be measured.
            unmeasured = self._hook_unfrozen()
            if unmeasured:
                warnings.warn(hooks.unmeasured_message(unmeasured, "this step used the last gain"))
        self._calls_at_last_step = self._num_backward_calls
        return result

    def _check_ranks_agree(self, n_groups: int, scale: Any, has_trainable: bool) -> None:
        """Raise the same error on every rank unless all of them have ``n_groups`` param groups and this AdaScale's
        settings with ``scale``, and all or none of them a parameter that requires grad (``has_trainable``; see
        :func:`arguments.check_ranks_agree_on_settings`)."""
        arguments.check_ranks_agree_on_settings(
            self._optimizer.param_groups,
            n_groups,
            self._num_grads_to_accum,
            self._world_size,
            scale,
            self._smoothing,
            self._debias_ewma,
            self._is_scaled_loss,
            has_trainable,
        )

    def add_param_group(self, pg: Dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer, hook its parameters and extend the statistics by one entry.

        Every rank must add a group (the call checks that the ranks agree, with one small all-gather). The group may
        hold frozen parameters (they are not hooked, as at construction). All or nothing: if the call raises,
        neither AdaScale nor the wrapped optimizer has changed. Like the constructor, it (re)hooks the parameters of
        every group, also after :meth:`unhook`.
        """
        self._check_not_in_backward("Don't add param group in backward phase")
        groups = self._optimizer.param_groups
        new_params: List[Any] = []
        if isinstance(pg, dict) and "params" in pg:
            params = pg["params"]
            if isinstance(params, Tensor):
                new_params = [params]
            elif not isinstance(params, (set, frozenset)):  # the optimizer refuses a set (no order), in its words
                # Listed once, in the group itself (as torch does): a generator would be used up by the hooking and
                # by the check below.
                new_params = list(params)
                pg["params"] = new_params
        trainable = _has_trainable([group["params"] for group in groups] + [new_params])
        self._check_ranks_agree(len(groups) + 1, self._scale, trainable)
        # The hooks first, as they are AdaScale's own and can be removed again; the wrapped optimizer's add, which
        # may refuse the group, last; the statistics' extension after it cannot fail.
        handles, hooked = hooks.register_hooks(self, [group["params"] for group in groups] + [new_params])
        try:
            self._optimizer.add_param_group(pg)
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        self._use_hooks(handles, hooked)
        statistics.add_group(self._state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (``set_to_none=False``) or drop the gradients through the wrapped optimizer.

        After a backward that raised, this also discards the gradient statistics of the step's backward passes
        (their gradients are dropped too), with a warning, so that training can go on.

        Raises:
            RuntimeError (an ``AssertionError`` too): called between the backward passes of one step.
        """
        if self._backward_aborted():
            # The failed backward's end-of-backward callback will never run: drop what it and the earlier passes of
            # this step measured, as their gradients are dropped now.
            warnings.warn("AdaScale: the previous backward did not finish (it raised); discarding its statistics.")
            self._reset_backward_window()
        self._check_not_in_backward("Don't zero_grad in backward phase")
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state dict (the AdaScale statistics are in its ``state["adascale"]``)."""
        self._check_not_in_backward("Don't checkpoint in backward phase")
        return self._optimizer.state_dict()

    def load_state_dict(self, data: Dict[str, Any]) -> None:
        """Load a state dict written by :meth:`state_dict` into the wrapped optimizer.

        A state dict without AdaScale statistics (a plain optimizer's, e.g. to go on with AdaScale from a checkpoint
        of training without it) loads too: the statistics start afresh, as when AdaScale wraps an optimizer, and a
        warning says so (upstream loaded it, then failed in ``gain()`` and ``step()`` with ``KeyError``).
        """
        self._check_not_in_backward("Don't load checkpoint in backward phase")
        statistics.check_loadable(data)  # before anything loads: a failed load leaves the optimizer as it was
        self._optimizer.load_state_dict(data)
        # torch's load rebinds the wrapped optimizer's param_groups to a new list: share it again, or an LR scheduler
        # built on AdaScale before the load would change a list that no step reads any more.
        self.param_groups = self._optimizer.param_groups
        state = cast(Dict[Any, Any], self._optimizer.state)
        if STATE_KEY in state:
            state[STATE_KEY] = statistics.as_vectors(state[STATE_KEY])
        else:
            warnings.warn(
                "AdaScale.load_state_dict: the state dict holds no AdaScale statistics (state['adascale']); "
                "they start afresh (gain 1 until the next step's backward passes are measured)."
            )
            state[STATE_KEY] = statistics.fresh(len(self._optimizer.param_groups))
        self._loaded = True

    def __repr__(self) -> str:
        return f"AdaScale(scale={self._scale}, world_size={self._world_size}, optimizer={self._optimizer!r})"

    # ------------------------------------------------------------------------------------------
    # Diagnostics

    def _gather_flat_grad(self) -> Tensor:
        """All gradients, flattened and concatenated in group order (zeros for parameters without one)."""
        return _correlation.flat_grad(self._optimizer.param_groups)

    def _compute_intra_grad_corr_mean(self) -> Tensor:
        """Mean Pearson correlation between the workers' flat gradients (mean of the strict upper triangle).

        Call after backward and before the gradients are averaged across workers (e.g. inside DDP's
        ``no_sync()``); every rank gets the same value.
        """
        if self._world_size <= 1:  # before gathering: the gradients are not needed then
            raise FairscaleRuntimeError("AdaScale._compute_intra_grad_corr_mean: only for distributed training")
        return _correlation.intra_grad_corr_mean(self._gather_flat_grad(), self._world_size)


def _has_trainable(groups: Iterable[Iterable[Any]]) -> bool:
    """Whether any of the parameters of ``groups`` requires grad (and so gets a hook that starts each window)."""
    return any(isinstance(p, Tensor) and p.requires_grad for params in groups for p in params)


class AdaScaleWrapper(AdaScale):
    """AdaScale around an optimizer it builds: ``optim_cls(params, **additional_optim_args)``.

    Useful where a framework expects an optimizer class and its arguments. For sharded optimizer state, let it
    build OSS: ``AdaScaleWrapper(params, optim_cls=OSS, optim=SGD, lr=0.1)`` (under DDP: the gains of the unsharded
    optimizer). Not ``OSS(params, optim=AdaScaleWrapper, optim_cls=SGD, lr=0.1)``: each rank's AdaScale would then
    measure only the parameters that rank owns and compute its own, meaningless gain (the first window's end warns),
    its statistics would be left out of OSS's consolidated state dict, and a rank that owns no parameter that
    requires grad is refused at construction (on every rank).

    Args:
        params: the parameters (or param groups) for ``optim_cls``.
        world_size, scale, smoothing, num_gradients_to_accumulate, debias_ewma: as for :class:`AdaScale`.
        optim_cls (type): the optimizer class to build. Default: ``torch.optim.SGD``.
        **additional_optim_args: passed to ``optim_cls``.
    """

    def __init__(
        self,
        params: Any,
        world_size: Optional[int] = None,
        scale: Optional[float] = None,
        smoothing: Optional[float] = None,
        num_gradients_to_accumulate: int = 1,
        debias_ewma: bool = True,
        optim_cls: Callable[..., torch.optim.Optimizer] = torch.optim.SGD,
        **additional_optim_args: Any,
    ) -> None:
        optim = optim_cls(params, **additional_optim_args)
        # By keyword: upstream passed these positionally, so its ``debias_ewma`` landed in ``is_scaled_loss``.
        super().__init__(
            optim,
            world_size=world_size,
            scale=scale,
            smoothing=smoothing,
            num_gradients_to_accumulate=num_gradients_to_accumulate,
            debias_ewma=debias_ewma,
        )
