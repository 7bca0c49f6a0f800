# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Megatron-style layers whose weights are split over the model-parallel group.

Every rank of a model-parallel group draws the *full* weight (the "master", on CPU) with the same
RNG state and keeps its own partition, so a model built under one seed has, on each rank, exactly
the slices of the single-process model built under that seed. Parameters carry no extra attributes
(no ``model_parallel`` / ``partition_dim`` flags, unlike Megatron).

At its first forward, each layer checks that every rank of the model-parallel group built it with the same arguments
and called it with an input of the same shape and dtype (one small object all-gather), and raises the same
:class:`~fairscale.internal.agreement.RanksDisagreeError` on every rank when they differ (later forwards are not
checked: docs/model_parallel.rst).
"""

from typing import Any, Callable, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn.functional as F
import torch.nn.init as init
from torch import Tensor
from torch.nn.parameter import Parameter

from fairscale.internal.agreement import check_ranks_agree
from fairscale.internal.compiler import is_compiling
from fairscale.internal.dry_load import load_state_dict_all_or_nothing
from fairscale.internal.errors import FairscaleValueError

from . import initialize as _initialize
from .initialize import get_model_parallel_group, get_model_parallel_rank, get_model_parallel_world_size
from .load_hints import load_partition as _load_partition
from .mappings import (
    copy_to_model_parallel_region,
    gather_from_model_parallel_region,
    reduce_from_model_parallel_region,
    scatter_to_model_parallel_region,
)
from .utils import VocabUtility
from .utils import divide_and_check_no_remainder  # noqa: F401  # upstream's module namespace has it

__all__ = ["VocabParallelEmbedding", "ParallelEmbedding", "ColumnParallelLinear", "RowParallelLinear"]

InitMethod = Callable[[Tensor], Tensor]

#: What each layer describes for the check: ``(argument name, value)`` pairs, so that the message names the argument.
_Description = List[Tuple[str, Any]]


def _divide(numerator: int, denominator: int, what: str, by: str = "model-parallel world size") -> int:
    """``numerator // denominator``; the error (an AssertionError, as upstream) keeps upstream's leading text and says
    what to change (``by`` names the denominator)."""
    if numerator % denominator != 0:
        raise FairscaleValueError(
            f"{numerator} is not divisible by {denominator}: {what} ({numerator}) must be a multiple of the {by} "
            f"({denominator})"
        )
    return numerator // denominator


def _initialize_affine_weight(
    weight: Tensor,
    out_features: int,
    in_features: int,
    per_partition_size: int,
    partition_dim: int,
    init_method: InitMethod,
    stride: int = 1,
    return_master_weight: bool = False,
) -> Optional[Tensor]:
    """Initialise ``weight`` as this rank's partition of a full ``[out_features, in_features]`` master.

    The partition dimension is cut into ``world_size * stride`` chunks of ``per_partition_size /
    stride``; rank ``r`` keeps chunks ``r, r + world_size, ...`` in that order.

    Returns:
        Optional[Tensor]: the master weight when ``return_master_weight`` (the parameter itself at
        model-parallel world size 1), else ``None``.
    """
    # At every size (upstream ignored it at size 1, where get_master_weight() then failed with torch's words).
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise FairscaleValueError(f"stride must be a positive int (the number of interleaved blocks), got {stride!r}")
    world_size = get_model_parallel_world_size()
    if world_size == 1:
        init_method(weight)
        return weight if return_master_weight else None
    # Every rank draws the whole master from the same RNG state, so the partitions agree across ranks.
    master_weight = torch.empty(out_features, in_features, dtype=weight.dtype, requires_grad=False)
    init_method(master_weight)
    per_partition_per_stride_size = _divide(per_partition_size, stride, "the partition size", "stride")
    chunks = torch.split(master_weight, per_partition_per_stride_size, dim=partition_dim)
    mine = chunks[get_model_parallel_rank() :: world_size]
    with torch.no_grad():
        torch.cat(mine, dim=partition_dim, out=weight)
    return master_weight if return_master_weight else None


def _describe_input(input_: Any) -> _Description:
    """The input's shape and dtype, as the ranks of the model-parallel group must share them: the layers exchange
    activations of the input's leading shape (gloo aborts the process on a size mismatch, NCCL reads past buffers)."""
    if not isinstance(input_, Tensor):  # the layer's own call fails on every rank alike; say what it was
        return [("input type", type(input_).__name__)]
    # Whether the backward runs the layer's collective on the input's gradient (the parallel linears'): a first
    # forward under no_grad on some ranks only (an evaluation) left the others waiting in it (found by a fuzz).
    backward = torch.is_grad_enabled() and input_.requires_grad
    return [("input shape", tuple(input_.shape)), ("input dtype", str(input_.dtype)), ("input gradient", backward)]


def _ranks_agree_at_first_forward(layer: torch.nn.Module, arguments: _Description, input_: Any) -> bool:
    """Raise the same ``RanksDisagreeError`` on every rank of the model-parallel group when its ranks built ``layer``
    with other arguments or call it with an input of another shape or dtype.

    Called by each layer's forward until it returns ``True`` (once, normally): one ``all_gather_object`` over the
    model-parallel group, none at model-parallel size 1. Not at construction, which stays free of communication
    (Llama's reference code may build a model before it selects the accelerator). Only the first forward's
    input is checked: the batch size may change from one forward to the next (KV-cache decoding feeds one token after
    the prompt), and checking it in every forward needs a round trip per layer before its tensor collective (the
    activations' own collectives cannot carry it: a size mismatch aborts or corrupts inside them), which would double
    the latency-bound collectives of decoding. Later forwards rely on the caller feeding every rank the same batch
    (``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks every collective's shapes, see docs/model_parallel.rst).

    Args:
        layer (torch.nn.Module): the layer (its class names it in the message).
        arguments (_Description): the layer's configuration, ``(argument name, value)`` pairs.
        input_ (Any): this forward's input.

    Returns:
        bool: whether the check is done (passed, or nothing to compare); ``False`` while a compiler traces the
        forward (``torch.compile``, ``torch.jit.trace``), which an object gather would break or be baked into: the
        next eager forward checks instead.

    Raises:
        RanksDisagreeError: the ranks differ (on every rank of the model-parallel group); the message names the first
            argument, or the input's shape or dtype, that differs.
    """
    if is_compiling() or torch.jit.is_tracing():  # type: ignore[attr-defined]  # public, not in torch.jit.__all__
        return False
    if get_model_parallel_world_size() == 1:
        return True
    name = type(layer).__name__
    weight = getattr(layer, "weight", None)
    check_ranks_agree(
        f"{name}: the constructor arguments and the first forward's input",
        # The class first: ranks that reach different layers' checks (another model) are told so.
        [("layer", name)] + arguments + _describe_input(input_),
        get_model_parallel_group(),
        hint=f"Build {name} with the same arguments on every rank of the model-parallel group, and call it with the "
        "same input on every rank of the group (the same batch: data parallelism happens across model-parallel "
        "groups), in the same grad mode (evaluate under torch.no_grad() on every rank of the group or none).",
        # The object gather of an NCCL group runs on the current device: make it this rank's.
        device=weight.device if isinstance(weight, Tensor) else None,
    )
    return True


def _undo_stride(gathered: Tensor, world_size: int, stride: int, dim: int) -> Tensor:
    """Put the chunks of rank-ordered partitions (each ``stride`` interleaved chunks) back in master order."""
    if stride == 1:
        return gathered
    chunks = torch.chunk(gathered, world_size * stride, dim=dim)  # rank-major: rank r's s-th chunk at r*stride+s
    ordered = [chunks[r * stride + s] for s in range(stride) for r in range(world_size)]
    return torch.cat(ordered, dim=dim)


def _load_all_or_nothing(
    self: torch.nn.Module, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
) -> Any:
    """``nn.Module.load_state_dict``, all or nothing: tried on shape-only tensors first, so that a checkpoint of
    another model-parallel size (a weight of another shape) raises before the replicated bias was overwritten."""
    return load_state_dict_all_or_nothing(self, state_dict, strict, assign)


def _current_layout() -> Tuple[int, int, int]:
    """(how many times the groups were initialised, model-parallel size, rank): what a layer's partition depends on."""
    return (_initialize._GENERATION, get_model_parallel_world_size(), get_model_parallel_rank())


def _check_layout_unchanged(layer: torch.nn.Module) -> None:
    """Refuse a layer built for other model-parallel groups than the current ones (a rank-local check).

    After ``destroy_model_parallel()`` and ``initialize_model_parallel()`` at another size, a layer built before ran
    on with its old partition against the new group: a width of 4 for ``out_features=8``, zero vectors for half the
    ids, silently (its first-forward agreement check had run already). Only compared when the groups were
    initialised again since (one integer comparison per forward otherwise).
    """
    built = getattr(layer, "_mp_layout", None)  # a layer pickled by an earlier version has none: taken as it is
    if built is not None and built[0] == _initialize._GENERATION:
        return
    now = _current_layout()
    if built is not None and tuple(built[1:]) != now[1:]:
        raise RuntimeError(
            f"{type(layer).__name__} was built for a model-parallel group of {built[1]} rank(s) (as rank {built[2]}), "
            f"but the current model-parallel group has {now[1]} (this rank is {now[2]}): its weights are another "
            "partition. Build the layer again after initialize_model_parallel() (or load its full weights into a "
            "new one)."
        )
    setattr(layer, "_mp_layout", now)


def _check_until_done(layer: torch.nn.Module, arguments: Callable[[], _Description], input_: Any) -> None:
    """Run :func:`_ranks_agree_at_first_forward` in ``layer``'s forward until it reports the check done.

    ``arguments`` is called only then, so that the forwards after the first build no description. Every forward
    first checks that the model-parallel groups are still the ones the layer was built for.
    """
    _check_layout_unchanged(layer)
    # getattr: a layer pickled whole by an earlier version has no flag (it is checked at its next forward).
    if not getattr(layer, "_ranks_agree_checked", False):
        # setattr: a bool is neither of the types Module.__setattr__ declares.
        setattr(layer, "_ranks_agree_checked", _ranks_agree_at_first_forward(layer, arguments(), input_))


def _local_embedding(layer: Union["VocabParallelEmbedding", "ParallelEmbedding"], input_: Tensor) -> Tensor:
    """The lookup of ``input_`` in ``layer``'s own partition of the weight, with the layer's embedding options."""
    return F.embedding(
        input_, layer.weight, layer.padding_idx, layer.max_norm, layer.norm_type, layer.scale_grad_by_freq, layer.sparse
    )


def _add_partitioned_affine(
    layer: Union["ColumnParallelLinear", "RowParallelLinear"],
    partition_dim: int,
    bias: bool,
    init_method: InitMethod,
    keep_master_weight: bool,
) -> None:
    """Give a parallel linear layer its parameters: ``weight``, this rank's partition of the ``[out_features,
    in_features]`` master (cut along ``partition_dim``, see :func:`_initialize_affine_weight`), ``bias``, zeros of one
    element per row of that partition (a ``None`` parameter without ``bias``), and ``master_weight``."""
    shape = [layer.out_features, layer.in_features]
    shape[partition_dim] //= get_model_parallel_world_size()  # the layer checked that it divides
    layer.weight = Parameter(torch.empty(*shape))
    # Zero-initialised before the weight: zeroing draws no RNG, the weight draw order stays upstream's.
    layer.register_parameter("bias", Parameter(torch.zeros(shape[0])) if bias else None)
    # Assigned after the bias: at model-parallel size 1 it is the weight, which Module.__setattr__ registers again.
    layer.master_weight = _initialize_affine_weight(
        layer.weight,
        layer.out_features,
        layer.in_features,
        shape[partition_dim],
        partition_dim,
        init_method,
        stride=layer._stride,
        return_master_weight=keep_master_weight,
    )


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding split along the vocabulary: rank ``r`` holds the rows of ids ``[r * V/p, (r+1) * V/p)``.

    Each rank looks up the ids it owns (zeros for the others) and the results are summed over the
    model-parallel group. Ids outside ``[0, num_embeddings)`` give zero vectors. ``padding_idx`` is
    passed to each rank's local lookup as is, i.e. it is a *local* row index (upstream's behaviour).

    Args:
        num_embeddings (int): vocabulary size, divisible by the model-parallel world size.
        embedding_dim (int): size of each embedding vector.
        padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse: as :func:`torch.nn.functional.embedding`,
            applied to the local partition, to the ids this rank owns (``max_norm`` renormalises only rows that
            were looked up, ``scale_grad_by_freq`` counts only the uses of a row: upstream looked the other ranks'
            ids up as local row 0, which renormalised that row and scaled its gradient down).
        init_method (Callable[[Tensor], Tensor]): initialiser of the full ``[V, D]`` master weight.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        init_method: InitMethod = init.xavier_normal_,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = sparse
        self._weight = None
        world_size = get_model_parallel_world_size()
        _divide(num_embeddings, world_size, "VocabParallelEmbedding's num_embeddings")
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, get_model_parallel_rank(), world_size
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = Parameter(torch.empty(self.num_embeddings_per_partition, self.embedding_dim))
        _initialize_affine_weight(
            self.weight, self.num_embeddings, self.embedding_dim, self.num_embeddings_per_partition, 0, init_method
        )
        self._ranks_agree_checked = False  # see _ranks_agree_at_first_forward
        self._mp_layout = _current_layout()  # see _check_layout_unchanged

    load_state_dict = _load_all_or_nothing  # see _load_all_or_nothing
    _load_from_state_dict = _load_partition
    _partition_dim = 0  # the dimension of the master weight that is partitioned

    def _arguments(self) -> _Description:
        # Not padding_idx: it is a local row index (upstream's behaviour), which a rank may set for the pad id it
        # owns only; it changes neither the output's shape nor the sum's terms on other ranks.
        return [
            ("num_embeddings", self.num_embeddings),
            ("embedding_dim", self.embedding_dim),
            ("max_norm", self.max_norm),
            ("norm_type", self.norm_type),
            ("scale_grad_by_freq", self.scale_grad_by_freq),
            ("sparse", self.sparse),
            ("num_embeddings_per_partition", self.num_embeddings_per_partition),
            ("dtype", str(self.weight.dtype)),
        ]

    def forward(self, input_: Tensor) -> Tensor:
        _check_until_done(self, self._arguments, input_)
        input_mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        masked_input = input_.clone() - self.vocab_start_index
        masked_input[input_mask] = 0
        if self.max_norm is None and not self.scale_grad_by_freq:
            output_parallel = _local_embedding(self, masked_input)
            # Ids owned by another rank looked up local row 0: zero them so that the sum counts each id once.
            output_parallel[input_mask, :] = 0.0
        else:
            # Only the ids this rank owns are looked up: with the others sent to local row 0, scale_grad_by_freq
            # counted them as uses of that row (its gradient was divided by their number: 0.25 where 1.0 is
            # right), and max_norm renormalised that row although no token used it (upstream's behaviour).
            owned = ~input_mask
            output_parallel = self.weight.new_zeros(*input_.shape, self.embedding_dim)
            output_parallel[owned] = _local_embedding(self, masked_input[owned])
        return reduce_from_model_parallel_region(output_parallel)


class ParallelEmbedding(torch.nn.Module):
    """Embedding split along the embedding dimension: rank ``r`` holds columns ``[r * D/p, (r+1) * D/p)``.

    Args:
        num_embeddings (int): vocabulary size.
        embedding_dim (int): size of each embedding vector, divisible by the model-parallel world size.
        padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse: as :func:`torch.nn.functional.embedding`
            (``max_norm`` renormalises each rank's slice of a row on its own).
        init_method (Callable[[Tensor], Tensor]): initialiser of the full ``[V, D]`` master weight.
        keep_master_weight_for_test (bool): accepted and ignored, as upstream.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        init_method: InitMethod = init.xavier_normal_,
        keep_master_weight_for_test: bool = False,
    ) -> None:
        super().__init__()
        del keep_master_weight_for_test
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.max_norm = max_norm
        # Upstream 0.4.13 stored scale_grad_by_freq here; fixed here as upstream later did (see differences).
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = sparse
        self._weight = None
        world_size = get_model_parallel_world_size()
        self.embedding_dim_per_partition = _divide(embedding_dim, world_size, "ParallelEmbedding's embedding_dim")
        self.weight = Parameter(torch.empty(self.num_embeddings, self.embedding_dim_per_partition))
        _initialize_affine_weight(
            self.weight,
            self.num_embeddings,
            self.embedding_dim,
            self.embedding_dim_per_partition,
            1,
            init_method,
            stride=1,
            return_master_weight=False,
        )
        self._ranks_agree_checked = False  # see _ranks_agree_at_first_forward
        self._mp_layout = _current_layout()  # see _check_layout_unchanged

    load_state_dict = _load_all_or_nothing  # see _load_all_or_nothing
    _load_from_state_dict = _load_partition
    _partition_dim = 1  # the dimension of the master weight that is partitioned

    def _arguments(self) -> _Description:
        return [
            ("num_embeddings", self.num_embeddings),
            ("embedding_dim", self.embedding_dim),
            ("padding_idx", self.padding_idx),  # a row of the full vocabulary here: every rank holds every row
            ("max_norm", self.max_norm),
            ("norm_type", self.norm_type),
            ("scale_grad_by_freq", self.scale_grad_by_freq),
            ("sparse", self.sparse),
            ("embedding_dim_per_partition", self.embedding_dim_per_partition),
            ("dtype", str(self.weight.dtype)),
        ]

    def forward(self, input_: Tensor) -> Tensor:
        _check_until_done(self, self._arguments, input_)
        input_parallel = copy_to_model_parallel_region(input_)
        output_parallel = _local_embedding(self, input_parallel)
        return gather_from_model_parallel_region(output_parallel)


class ColumnParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its output rows: rank ``r`` computes outputs ``[r*out/p, (r+1)*out/p)``.

    Args:
        in_features (int): size of each input sample.
        out_features (int): size of each output sample, divisible by the model-parallel world size.
        bias (bool): add a (partitioned, zero-initialised) bias.
        gather_output (bool): all-gather the output so every rank gets ``[..., out_features]``;
            otherwise each rank returns its ``[..., out_features / p]`` slice.
        init_method (Callable[[Tensor], Tensor]): initialiser of the full ``[out, in]`` master weight.
        stride (int): number of interleaved chunks per partition (e.g. 3 for fused QKV projections).
        keep_master_weight_for_test (bool): keep the full master in ``self.master_weight``.
    """

    weight: Parameter
    bias: Optional[Parameter]
    master_weight: Optional[Tensor]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = True,
        init_method: InitMethod = init.xavier_normal_,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.gather_output = gather_output
        world_size = get_model_parallel_world_size()
        self.output_size_per_partition = _divide(out_features, world_size, "ColumnParallelLinear's out_features")
        self._stride = stride
        _add_partitioned_affine(self, 0, bias, init_method, keep_master_weight_for_test)
        self._ranks_agree_checked = False  # see _ranks_agree_at_first_forward
        self._mp_layout = _current_layout()  # see _check_layout_unchanged

    def get_master_weight(self) -> Tensor:
        """The full ``[out_features, in_features]`` weight, gathered over the model-parallel group."""
        _check_layout_unchanged(self)  # a gather over other groups returned a wrong tensor, silently
        gathered = gather_from_model_parallel_region(self.weight.data.transpose(0, 1)).transpose_(0, 1)
        return _undo_stride(gathered, get_model_parallel_world_size(), self._stride, 0)

    load_state_dict = _load_all_or_nothing  # see _load_all_or_nothing
    _load_from_state_dict = _load_partition
    _partition_dim = 0  # the dimension of the master weight that is partitioned

    def _arguments(self) -> _Description:
        return [
            ("in_features", self.in_features),
            ("out_features", self.out_features),
            ("bias", self.bias is not None),
            ("gather_output", self.gather_output),
            ("stride", self._stride),
            ("output_size_per_partition", self.output_size_per_partition),
            ("dtype", str(self.weight.dtype)),
        ]

    def forward(self, input_: Tensor) -> Tensor:
        _check_until_done(self, self._arguments, input_)
        input_parallel = copy_to_model_parallel_region(input_)
        output_parallel = F.linear(input_parallel, self.weight, self.bias)
        if self.gather_output:
            return gather_from_model_parallel_region(output_parallel)
        return output_parallel


class RowParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its input columns; partial products are summed over ranks.

    Args:
        in_features (int): size of each input sample, divisible by the model-parallel world size.
        out_features (int): size of each output sample.
        bias (bool): add a (replicated, zero-initialised) bias after the sum.
        input_is_parallel (bool): the input is already this rank's ``[..., in_features / p]`` slice
            (e.g. a :class:`ColumnParallelLinear` output with ``gather_output=False``).
        init_method (Callable[[Tensor], Tensor]): initialiser of the full ``[out, in]`` master weight.
        stride (int): number of interleaved chunks per partition.
        keep_master_weight_for_test (bool): keep the full master in ``self.master_weight``.
    """

    weight: Parameter
    bias: Optional[Parameter]
    master_weight: Optional[Tensor]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        init_method: InitMethod = init.xavier_normal_,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.input_is_parallel = input_is_parallel
        world_size = get_model_parallel_world_size()
        self.input_size_per_partition = _divide(in_features, world_size, "RowParallelLinear's in_features")
        self._stride = stride
        _add_partitioned_affine(self, 1, bias, init_method, keep_master_weight_for_test)
        self._ranks_agree_checked = False  # see _ranks_agree_at_first_forward
        self._mp_layout = _current_layout()  # see _check_layout_unchanged

    def get_master_weight(self) -> Tensor:
        """The full ``[out_features, in_features]`` weight, gathered over the model-parallel group."""
        _check_layout_unchanged(self)  # a gather over other groups returned a wrong tensor, silently
        gathered = gather_from_model_parallel_region(self.weight.data)
        return _undo_stride(gathered, get_model_parallel_world_size(), self._stride, 1)

    load_state_dict = _load_all_or_nothing  # see _load_all_or_nothing
    _load_from_state_dict = _load_partition
    _partition_dim = 1  # the dimension of the master weight that is partitioned

    def _arguments(self) -> _Description:
        # The input's whole shape is compared, its last dimension too: with input_is_parallel it is this rank's
        # partition, in_features / p on every rank (the partitions are equal), so it agrees as the full one does.
        return [
            ("in_features", self.in_features),
            ("out_features", self.out_features),
            ("bias", self.bias is not None),
            ("input_is_parallel", self.input_is_parallel),
            ("stride", self._stride),
            ("input_size_per_partition", self.input_size_per_partition),
            ("dtype", str(self.weight.dtype)),
        ]

    def forward(self, input_: Tensor) -> Tensor:
        _check_until_done(self, self._arguments, input_)
        input_parallel = input_ if self.input_is_parallel else scatter_to_model_parallel_region(input_)
        output_parallel = F.linear(input_parallel, self.weight)
        # The sum happens in place on the partial product; the replicated bias is added once, after it.
        output_ = reduce_from_model_parallel_region(output_parallel)
        if self.bias is not None:
            # In the output's dtype, as nn.Linear's bias under autocast (the fp32 bias promoted a bf16 output to fp32
            # there, upstream too, while ColumnParallelLinear and nn.Linear return bf16).
            return output_ + self.bias.to(output_.dtype)
        return output_
