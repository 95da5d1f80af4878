"""breakgraph.hf on a tensor-parallel model, on the CPU: the cache sized per rank, the layouts refused,
the ranks' process group found, and a Generator served on two gloo ranks.

The two ranks split a tiny Llama as transformers' ``tp_plan="auto"`` does (colwise query, key,
value, gate and up projections; rowwise output and down projections) through torch's own tensor
parallelism, since transformers' ``from_pretrained(tp_plan=...)`` needs accelerate, which the
test extra does not install; the Generator reads the mesh and size where transformers keeps them.
``tests/gpu/ranks/hf_generate.py`` runs transformers' own loading on GPUs.
"""

import gc
import math
import os
import sys
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers", reason="the transformers extra is not installed (pip install -e '.[transformers]')")

from transformers import LlamaConfig, LlamaForCausalLM

from breakgraph import hf
from breakgraph.hf.tensor_parallel import tensor_parallel_group, tensor_parallel_size
from tests.helpers import tiny_llama, transformers_eager_generate

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # without a GPU the runners warn that they run eagerly


def llama(heads: int, kv_heads: int, tp_size: int | None = None) -> LlamaForCausalLM:
    """A one-layer Llama with 16-wide heads, on breakgraph's attention; ``tp_size`` set where
    transformers' ``from_pretrained(tp_plan=...)`` sets it."""
    config = LlamaConfig(
        vocab_size=64, hidden_size=16 * heads, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
    )
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation(hf.ATTENTION)
    model._tp_size = tp_size
    assert model.tp_size == tp_size
    return model


@pytest.mark.parametrize("tp_size, heads_per_rank", [(1, 4), (2, 2), (4, 1)])
def test_the_cache_holds_the_heads_of_one_rank(tp_size, heads_per_rank):
    config = LlamaConfig(hidden_size=128, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4)
    cache = hf.KVCache(config, 2, 24, torch.float32, torch.device("cpu"), tp_size=tp_size)
    assert [tuple(layer.keys.shape) for layer in cache.layers] == [(2, heads_per_rank, 24, 16)] * 3
    assert [tuple(layer.values.shape) for layer in cache.twin().layers] == [(2, heads_per_rank, 24, 16)] * 3


@pytest.mark.parametrize("heads, kv_heads, tp_size", [(8, 2, 4), (4, 1, 2), (6, 6, 4)])
def test_heads_that_do_not_split_among_the_ranks_are_refused_when_the_generator_is_made(heads, kv_heads, tp_size):
    common = math.gcd(heads, kv_heads)
    sizes = ", ".join(str(size) for size in range(1, common + 1) if common % size == 0)
    with pytest.raises(ValueError, match=(
        rf"{heads} attention heads and {kv_heads} key/value heads do not split evenly among {tp_size} "
        rf"tensor-parallel ranks.*load it on a number of ranks that divides both \({sizes}\)"
    )):
        hf.Generator(llama(heads, kv_heads, tp_size), max_length=16, progress=False)


def test_the_cache_refuses_keys_of_another_head_count_and_names_both():
    cache = hf.KVCache(tiny_llama().config, 2, 16, torch.float32, torch.device("cpu"), tp_size=2)  # 1 of 2 heads
    cache.begin(torch.tensor([0, 5]), first_row=0, query_length=3)
    layer = cache.layers[0]
    keys = torch.randn(2, 1, 3, 16)
    layer.update(keys, -keys)
    assert torch.equal(layer.keys[1, :, 5:8], keys[1]) and torch.equal(layer.values[0, :, :3], -keys[0])
    whole = torch.randn(2, 2, 3, 16)  # the model's every head: what a rank of an unsplit model gives
    with pytest.raises(ValueError, match=r"gives 2 key/value heads, but the cache holds 1 per layer.*tp_size=model\.tp_size"):
        layer.update(whole, whole)


class Mesh:
    """What the Generator reads of a torch DeviceMesh: its dimensions, by name, and a 1-D mesh's group."""

    def __init__(self, **sizes: int):
        self.sizes = sizes

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return tuple(self.sizes)

    def __getitem__(self, name: str) -> "Mesh":
        return Mesh(**{name: self.sizes[name]})

    def size(self) -> int:
        return math.prod(self.sizes.values())

    def get_group(self) -> str:
        assert self.ndim == 1, "a group is one dimension's"
        return f"the {self.mesh_dim_names[0]} group"


def test_the_tensor_parallel_group_is_found_on_the_model_s_mesh():
    assert tensor_parallel_group(SimpleNamespace(tp_size=2, _device_mesh=Mesh(tp=2))) == "the tp group"
    assert tensor_parallel_group(SimpleNamespace(tp_size=2, _device_mesh=Mesh(tp=2, fsdp=1, pp=1))) == "the tp group"
    assert tensor_parallel_group(SimpleNamespace(tp_size=4, _device_mesh=Mesh(fsdp=2, tp=4))) == "the tp group"
    # One rank, or other parallelism (FSDP, a mesh beside tp_size 1) alone: no group, nothing exchanged.
    for model in (SimpleNamespace(), SimpleNamespace(tp_size=None, _device_mesh=Mesh(fsdp=2)), SimpleNamespace(tp_size=1)):
        assert tensor_parallel_size(model) == 1 and tensor_parallel_group(model) is None


@pytest.mark.parametrize("mesh, error", [
    (None, "split among 2 tensor-parallel ranks .tp_size., but it has no device mesh"),
    (Mesh(dp=2, sp=1), r"has 2 dimensions, none of them named 'tp' \(names: \('dp', 'sp'\)\)"),
    (Mesh(tp=4), "split among 2 tensor-parallel ranks .tp_size., but its mesh's tensor-parallel dimension holds 4"),
])
def test_a_mesh_without_the_model_s_ranks_is_refused(mesh, error):
    with pytest.raises(ValueError, match=error):
        tensor_parallel_group(SimpleNamespace(tp_size=2, _device_mesh=mesh))


def test_a_model_on_one_rank_serves_as_before():
    generator = hf.Generator(llama(4, 2), max_length=16, progress=False)
    for runner in (generator.runner, generator.sampling_runner):
        assert runner.ranks is None and runner.options.group is None
    assert generator.cache.layers[0].keys.shape[1] == 2


def split_among_ranks(model: LlamaForCausalLM, world: int) -> None:
    """Split ``model``'s layers among the ``world`` ranks as transformers' ``tp_plan="auto"`` splits a
    Llama, and keep the mesh and size where transformers keeps them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    styles = {"self_attn.q_proj": ColwiseParallel, "self_attn.k_proj": ColwiseParallel, "self_attn.v_proj": ColwiseParallel,
              "self_attn.o_proj": RowwiseParallel, "mlp.gate_proj": ColwiseParallel, "mlp.up_proj": ColwiseParallel,
              "mlp.down_proj": RowwiseParallel}
    plan = {f"model.layers.{index}.{name}": style() for index in range(len(model.model.layers)) for name, style in styles.items()}
    parallelize_module(model, mesh, plan)
    model._device_mesh, model._tp_size = mesh, world


def on_every_rank(value) -> list:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _serve_on_a_rank(rank: int, world: int, store: str) -> None:
    # A rank left waiting (a check failed on another) times out and fails the test instead of hanging it.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        torch.manual_seed(0)  # the same weights on every rank
        model = tiny_llama()  # 4 heads, 2 key/value heads: 1 of them on each rank
        split_among_ranks(model, world)
        model.set_attn_implementation(hf.ATTENTION)
        with pytest.raises(ValueError, match="compile_in_background=True compiles beside the served steps"):
            hf.Generator(model, max_length=32, compile=True, compile_in_background=True, progress=False)

        generator = hf.Generator(model, max_length=32, max_batch_size=4, progress=False)
        for runner in (generator.runner, generator.sampling_runner):
            assert runner.ranks is not None and runner.options.group is model._device_mesh.get_group()
            assert not runner.options.agree_batches  # generate() agrees once per call instead
        assert generator.cache.layers[0].keys.shape[1] == 1

        ids = torch.randint(0, 300, (3, 9), generator=torch.Generator().manual_seed(1))
        expected = transformers_eager_generate(model, ids, 8)
        assert torch.equal(generator.generate(ids, 8), expected)

        mask = torch.ones_like(ids)
        mask[1, :5] = mask[2, :8] = 0  # rows of 9, 4 and 1 prompt tokens, left-padded
        padded = generator.generate(ids, 8, attention_mask=mask)
        for row, length in enumerate((9, 4, 1)):
            assert torch.equal(padded[row, 9:], transformers_eager_generate(model, ids[row : row + 1, 9 - length :], 8)[0, length:])

        draws = torch.Generator().manual_seed(100 + rank)  # seeded differently on each rank: rank 0's seed wins
        sampled = generator.generate(ids, 8, do_sample=True, temperature=0.9, generator=draws)
        results = on_every_rank((sampled, draws.get_state()))
        assert all(torch.equal(tokens, sampled) and torch.equal(state, draws.get_state()) for tokens, state in results)
        if rank == 0:
            assert not torch.equal(draws.get_state(), torch.Generator().manual_seed(100).get_state())  # it drew

        with pytest.raises(ValueError, match="the ranks disagree on generate"):
            generator.generate(ids, 8 + rank)
        with pytest.raises(ValueError, match="the ranks disagree on generate"):
            generator.generate(ids, 8, attention_mask=mask if rank else None)
        assert torch.equal(generator.generate(ids, 8), expected)  # the ranks still in step
        # Dropped before the teardown, as docs/multi-gpu.md asks: its runners' gloo groups then go
        # in destroy_process_group(), not in the interpreter's exit (a rank aborted there, rarely).
        del generator
        gc.collect()
        # Every rank done before any tears gloo down: a rank whose peer closed the connection
        # under its last exchange can abort at exit.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Every check passed: the rank leaves without the interpreter's teardown, in which a rank aborted
    # rarely ("terminate called without an active exception", no Python frame; about 1 run in 100,
    # cause not pinned down). A failed check raises above, and mp.spawn reports it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.skipif(not dist.is_available(), reason="this torch has no torch.distributed")
def test_a_tensor_parallel_model_generates_alike_on_every_rank(tmp_path):
    """Greedy tokens equal transformers' on the same split model, sampled tokens (each rank seeded
    differently) the same on every rank, and a call made differently on one rank raises on all."""
    mp.spawn(_serve_on_a_rank, args=(2, str(tmp_path / "store")), nprocs=2)
