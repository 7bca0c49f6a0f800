# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Upstream's test helpers (fairscale.fair_dev.testing.testing / testing_memory) on CPU."""

import functools
import os
import pickle
from collections import OrderedDict
from typing import Any, List

import numpy
import pytest
import torch
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing import run_distributed, run_ranks
from fairscale.fair_dev.testing.testing import (
    GPT2,
    DeviceAndTypeCheckModule,
    DummyProcessGroup,
    IdentityLayer,
    ObjectsNotEqualError,
    SGDWithPausingCompute,
    available_devices,
    check_same_model_params,
    check_same_models_across_ranks,
    dist_init,
    dump_all_tensors,
    get_cycles_per_ms,
    get_smi_memory,
    get_worker_map,
    get_world_sizes,
    in_temporary_directory,
    make_cudnn_deterministic,
    objects_are_equal,
    rmf,
    set_random_seed,
    skip_a_test_if_in_CI,
    skip_if_cuda,
    skip_if_no_cuda,
    spawn_for_all_world_sizes,
    state_dict_norm,
    teardown,
    temp_files_ctx,
    test_runner,
    torch_cuda_version,
    torch_spawn,
    worker_process,
)
from fairscale.fair_dev.testing.testing_memory import find_tensor_by_shape
from fairscale.internal.device import accelerator_available


@pytest.fixture(autouse=True)
def restore_cudnn_flags() -> Any:
    # Some helpers flip process-wide cuDNN and TF32 flags; keep other tests unaffected.
    saved = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    saved_tf32 = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved_tf32


# ----------------------------------------------------------------------------------------------
# objects_are_equal


def _nested(value: float = 1.0) -> Any:
    return {"a": [torch.tensor([1.0, value]), (2, "x")], "b": {"c": torch.zeros(2, 2), "d": None}}


def test_objects_are_equal_nested() -> None:
    assert objects_are_equal(_nested(), _nested())
    assert not objects_are_equal(_nested(), _nested(2.0))
    with pytest.raises(ObjectsNotEqualError, match=r"tensors differ at \['a'\]\[0\]"):
        objects_are_equal(_nested(), _nested(2.0), raise_exception=True)


@pytest.mark.parametrize(
    "a, b, where",
    [
        ({"k": 1}, {"k": 1.0}, r"type mismatch at \['k'\]: int vs float"),
        ({"k": 1, "j": 2}, {"k": 1}, r"keys differ at the top level: only in first \[\"'j'\"\]"),
        ([1, 2], [1, 2, 3], "length mismatch at the top level: 2 vs 3"),
        ((1, "x"), (1, "y"), r"values differ at \[1\]: 'x' vs 'y'"),
        (numpy.arange(3), numpy.arange(1, 4), "arrays differ at the top level"),
        (torch.zeros(2), torch.zeros(3), "tensors differ"),
        (torch.zeros(2), torch.zeros(2, dtype=torch.float64), "tensors differ"),
        (OrderedDict(k=1), {"k": 1}, "type mismatch"),
    ],
)
def test_objects_are_equal_reports_where(a: Any, b: Any, where: str) -> None:
    assert not objects_are_equal(a, b)
    with pytest.raises(ObjectsNotEqualError, match=where) as info:
        objects_are_equal(a, b, raise_exception=True)
    # Upstream raised ValueError or AssertionError depending on the mismatch; both still catch it.
    assert isinstance(info.value, ValueError) and isinstance(info.value, AssertionError)


def test_objects_are_equal_tolerances_and_dict_key() -> None:
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.01])
    assert not objects_are_equal(a, b)
    assert objects_are_equal(a, b, atol=0.02)
    assert objects_are_equal(a, b, rtol=0.01)
    assert objects_are_equal(a, b, rtol=0.0, atol=0.011)
    assert objects_are_equal(numpy.arange(3), numpy.arange(3))
    with pytest.raises(ObjectsNotEqualError, match=r"at \['weight'\]"):
        objects_are_equal(a, b, raise_exception=True, dict_key="weight")


# ----------------------------------------------------------------------------------------------
# Models and model comparisons


def test_check_same_model_params() -> None:
    set_random_seed(1)
    model_a = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    set_random_seed(1)
    model_b = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    check_same_model_params(model_a, model_b)
    linear_b = model_b[0]
    assert isinstance(linear_b, nn.Linear)
    with torch.no_grad():
        linear_b.bias.add_(1.0)
    with pytest.raises(AssertionError, match="(?s)model parameters differ: 0.bias vs 0.bias.*after step 3"):
        check_same_model_params(model_a, model_b, "after step 3")
    with pytest.raises(AssertionError, match="2 and 4 parameters"):
        check_same_model_params(nn.Linear(2, 2), model_b)


def _models_across_ranks(rank: int, world_size: int) -> List[str]:
    linear = nn.Linear(4, 4)  # same seed on every rank: the same initial values
    model = nn.Sequential(linear, nn.BatchNorm1d(4))
    outcomes = []
    check_same_models_across_ranks(model, None, params_should_be_equal=True, check_broadcast_buffers=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(rank))  # every parameter now differs between ranks
    check_same_models_across_ranks(model, None, params_should_be_equal=False, check_broadcast_buffers=True)
    for should_be_equal in (True, False):
        try:
            if should_be_equal:
                check_same_models_across_ranks(model, None, True, False)
            else:
                with torch.no_grad():
                    linear.bias.zero_()  # the same again on every rank
                check_same_models_across_ranks(model, None, False, False)
        except AssertionError as e:
            outcomes.append(str(e).split(":")[0])
    return outcomes


def test_check_same_models_across_ranks() -> None:
    # False asserts nothing, as upstream (its tests pass it for models with a frozen layer, equal on every rank).
    expected = ["0.weight differs between group ranks 0 and 1"]
    assert run_distributed(_models_across_ranks, 2) == [expected, expected]


def test_identity_layer_and_seeding() -> None:
    set_random_seed(3)
    layer = IdentityLayer(5, scale=2.0)
    set_random_seed(3)
    expected = 2.0 * torch.randn(5)
    assert torch.equal(layer(torch.ones(1), extra=1), expected)
    assert layer(None) is layer.weight


def test_gpt2_forward_backward_and_causality() -> None:
    set_random_seed(0)
    model = GPT2(embed_dim=16, num_heads=2, num_layers=2, num_positions=8, num_vocab=11, num_classes=3).eval()
    tokens = torch.randint(0, 11, (8, 4))
    logits = model(tokens)
    assert logits.shape == (4, 3)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    # Causal attention: changing the last token does not change the first position's features.
    changed = tokens.clone()
    changed[-1] = (changed[-1] + 1) % 11
    first = model.layers[0](model.token_embeddings(tokens) + model.position_embeddings(torch.arange(8)).unsqueeze(1))
    first_changed = model.layers[0](
        model.token_embeddings(changed) + model.position_embeddings(torch.arange(8)).unsqueeze(1)
    )
    assert torch.allclose(first[0], first_changed[0]) and not torch.allclose(first[-1], first_changed[-1])


def test_device_and_type_check_module() -> None:
    ok = DeviceAndTypeCheckModule(
        expected_input_dtype=torch.float32,
        expected_input_device=torch.device("cpu"),
        expected_param_dtype=torch.float32,
        expected_param_device=torch.device("cpu"),
        expected_loss_dtype=torch.float32,
        expected_loss_device=torch.device("cpu"),
        expected_buffer_dtype=torch.float32,
    )
    assert ok(torch.rand(2, 5)).shape == ()
    with pytest.raises(AssertionError, match="input.dtype is torch.float64, expected torch.float32"):
        ok(torch.rand(2, 5, dtype=torch.float64))
    with pytest.raises(AssertionError, match="param.dtype is torch.float32, expected torch.float16"):
        DeviceAndTypeCheckModule(expected_param_dtype=torch.float16)(torch.rand(2, 5))
    with pytest.raises(AssertionError, match="loss.device is cpu, expected cuda"):
        DeviceAndTypeCheckModule(expected_loss_device=torch.device("cuda"))(torch.rand(2, 5))


def test_sgd_with_pausing_compute_steps_like_sgd() -> None:
    set_random_seed(0)
    model_a = nn.Linear(3, 2)
    model_b = nn.Linear(3, 2)
    model_b.load_state_dict(model_a.state_dict())
    opt_a = SGDWithPausingCompute(model_a.parameters(), lr=0.1, momentum=0.9, rank=0)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        for model, opt in ((model_a, opt_a), (model_b, opt_b)):
            opt.zero_grad()
            model(torch.ones(4, 3)).pow(2).sum().backward()
            opt.step()
    check_same_model_params(model_a, model_b, rtol=0.0, atol=0.0)
    assert SGDWithPausingCompute(model_a.parameters(), lr=0.1).rank == 0


def test_state_dict_norm() -> None:
    state = {"w": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0]), "steps": torch.tensor(7)}
    norm = state_dict_norm(state)
    # As upstream: the sum of each tensor's norm (3 + 4 + 7, the integer one counted), float32 of shape (1,).
    assert norm.dtype == torch.float32 and norm.shape == (1,) and norm.item() == 14.0


# ----------------------------------------------------------------------------------------------
# Process groups and runners


def test_get_world_sizes_never_empty() -> None:
    sizes = get_world_sizes()
    assert sizes and sizes[0] == 1
    if not accelerator_available():  # FAIRSCALE_CPU_ONLY hides a GPU too
        assert sizes == [1, 2, 4]


def test_dummy_process_group() -> None:
    group = DummyProcessGroup(rank=1, size=4)
    assert (group.rank(), group.size()) == (1, 4)
    copy = pickle.loads(pickle.dumps(group))
    assert (copy.rank(), copy.size()) == (1, 4) and "rank=1, size=4" in repr(copy)
    for rank, size in ((4, 4), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="0 <= rank < size"):
            DummyProcessGroup(rank, size)


def _init_all_reduce_teardown(store: str, rank: int) -> Any:
    assert dist_init(rank, 2, store)
    backend = dist.get_backend()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    teardown()
    teardown()  # a second call is harmless
    return backend, t.item(), dist.is_initialized()


def test_dist_init_and_teardown(tmp_path: Any) -> None:
    store = str(tmp_path / "store")
    assert run_ranks(functools.partial(_init_all_reduce_teardown, store), 2) == [("gloo", 3.0, False)] * 2


def _record_rank(rank: int, world_size: int, filename: str, filename_rpc: str, out_dir: str, tag: str) -> None:
    assert os.path.isabs(filename) and filename != filename_rpc
    assert dist_init(rank, world_size, filename, filename_rpc)
    total = torch.ones(1)
    dist.all_reduce(total)
    with open(os.path.join(out_dir, f"{tag}-ws{world_size}-rank{rank}"), "w") as f:
        f.write(f"{int(total.item())} {torch.rand(1).item()}")
    teardown()


def test_spawn_for_all_world_sizes(tmp_path: Any) -> None:
    spawn_for_all_world_sizes(_record_rank, world_sizes=[1, 2], args=(str(tmp_path), "run"), deterministic=True)
    names = sorted(os.listdir(tmp_path))
    assert names == ["run-ws1-rank0", "run-ws2-rank0", "run-ws2-rank1"]
    contents = {name: (tmp_path / name).read_text().split() for name in names}
    assert [contents[n][0] for n in names] == ["1", "2", "2"]  # all_reduce over the right world
    assert len({contents[n][1] for n in names}) == 1  # deterministic=True seeds every rank alike


def test_test_runner_is_not_collected_and_seeds() -> None:
    assert getattr(test_runner, "__test__", True) is False
    seen: List[Any] = []
    torch.manual_seed(123)
    test_runner(5, lambda rank, x: seen.append((rank, x, torch.rand(1))), True, "x")
    torch.manual_seed(1357)  # upstream's test_runner seed
    assert seen[0][:2] == (5, "x") and torch.equal(seen[0][2], torch.rand(1))
    assert torch.backends.cudnn.deterministic


class _FileQueue:
    """A picklable stand-in for worker_process's error queue: one file per message."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def put(self, message: str) -> None:
        with open(os.path.join(self.directory, f"message-{os.getpid()}"), "w") as f:
            f.write(message)


def _skipping() -> None:
    assert dist.get_world_size() == 2
    pytest.skip("no can do")


def _worker_that_skips(store: str, queue: _FileQueue, rank: int) -> None:
    worker_process(rank, 2, store, "", _skipping, (), queue)


def test_worker_process_reports_skip(tmp_path: Any) -> None:
    messages_dir = tmp_path / "messages"
    messages_dir.mkdir()
    store = str(tmp_path / "store")
    run_ranks(functools.partial(_worker_that_skips, store, _FileQueue(str(messages_dir))), 2)
    messages = sorted(path.read_text() for path in messages_dir.iterdir())
    assert messages == ["no can do", "no can do"]


def _spawned_body(value: int) -> None:
    tensor = torch.tensor([float(value)])
    dist.all_reduce(tensor)
    assert tensor.item() == value * dist.get_world_size()


# Registers test__spawned_body here: run for world sizes 1 and 2, for each parametrised value.
torch_spawn([1, 2])(pytest.mark.parametrize("value", [1, 3])(_spawned_body))


def test_torch_spawn_registered_and_rejects_test_names() -> None:
    registered = globals()["test__spawned_body"]
    assert registered.__name__ == "test__spawned_body"

    def test_bad() -> None:
        pass

    with pytest.raises(ValueError, match="rename 'test_bad'"):
        torch_spawn([1])(test_bad)


def test_get_worker_map_needs_a_group() -> None:
    with pytest.raises(RuntimeError, match="call dist_init first"):
        get_worker_map()


def _rpc_neighbour() -> None:
    """Inside torch_spawn, as upstream: RPC workers named by get_worker_map() answer each other."""
    import torch.distributed.rpc as rpc

    rank, world_size = dist.get_rank(), dist.get_world_size()
    workers = get_worker_map()
    assert workers == {r: f"Test{r}" for r in range(world_size)}
    assert rpc.get_worker_info().name == workers[rank]
    peer = workers[(rank + 1) % world_size]
    assert rpc.rpc_sync(peer, torch.add, args=(torch.ones(2), rank)).tolist() == [rank + 1.0] * 2


torch_spawn([1, 2])(_rpc_neighbour)


def _dist_init_starts_rpc(filename: str, filename_rpc: str, rank: int) -> Any:
    import torch.distributed.rpc as rpc

    assert dist_init(rank, 2, filename, filename_rpc)
    answer = rpc.rpc_sync(get_worker_map()[1 - rank], max, args=(rank, 5))
    teardown()
    return answer, dist.is_initialized(), rpc.api._is_current_rpc_agent_set()


def test_dist_init_starts_rpc_and_teardown_stops_it(tmp_path: Any) -> None:
    body = functools.partial(_dist_init_starts_rpc, str(tmp_path / "store"), str(tmp_path / "rpc"))
    assert run_ranks(body, 2) == [(5, False, False)] * 2


# ----------------------------------------------------------------------------------------------
# Files, environment and small probes


def test_temp_files_ctx_and_rmf() -> None:
    with temp_files_ctx(num=3) as files:
        assert isinstance(files, tuple) and len(set(files)) == 3  # a tuple, as upstream
        assert all(os.path.isfile(f) for f in files)
        rmf(files[0])  # removing one early is fine
    assert not any(os.path.exists(f) for f in files)
    rmf(files[1])  # missing file: no error


def test_in_temporary_directory() -> None:
    before = os.getcwd()
    with in_temporary_directory() as directory:
        assert os.path.realpath(os.getcwd()) == os.path.realpath(directory)
        with open("scratch.txt", "w") as f:
            f.write("x")
    assert os.getcwd() == before and not os.path.exists(directory)


def test_marks_and_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert available_devices[0] == "cpu"
    gpus = accelerator_available() and torch.cuda.device_count() > 0  # FAIRSCALE_CPU_ONLY hides them (conftest)
    assert skip_if_cuda.mark.args[0] == gpus
    assert skip_if_no_cuda.mark.args[0] == (not gpus)
    version = torch_cuda_version()
    assert version == (() if torch.version.cuda is None else version) and isinstance(version, tuple)
    assert get_cycles_per_ms() > 0
    if not accelerator_available():  # e.g. FAIRSCALE_CPU_ONLY in the suite's process: nominal, no CUDA context
        assert get_cycles_per_ms() == 1_000_000.0
    if not accelerator_available():  # no CUDA context in this process either way
        assert get_smi_memory() == 0.0
    make_cudnn_deterministic()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    monkeypatch.setenv("CIRCLECI", "true")
    with pytest.raises(pytest.skip.Exception):
        skip_a_test_if_in_CI()


def test_find_tensor_by_shape_and_dump(capsys: pytest.CaptureFixture[str]) -> None:
    param = nn.Parameter(torch.zeros(7, 13, 3))
    plain = torch.zeros(5, 17, 3)
    assert find_tensor_by_shape((7, 13, 3))
    assert not find_tensor_by_shape((5, 17, 3))  # not a parameter
    assert find_tensor_by_shape([5, 17, 3], only_param=False)
    assert not find_tensor_by_shape((9, 19, 3), only_param=False)
    dump_all_tensors(3)
    out = capsys.readouterr().out
    assert "rank 3: live tensors" in out and "(5, 17, 3)" in out
    del param, plain
