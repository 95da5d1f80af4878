"""breakgraph.hf on the CPU: the registered attention, and the Generator's eager path against transformers."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers extra is not installed (pip install -e '.[transformers]')")

from hypothesis import given, settings, strategies as st
from transformers import (
    AttentionInterface,
    GPTJConfig,
    GPTJForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from breakgraph import hf
from tests.helpers import transformers_eager_generate

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    return model


def generator(model, **kwargs):
    model.set_attn_implementation(hf.ATTENTION)
    return hf.Generator(model, max_length=kwargs.pop("max_length", 64), progress=False, **kwargs)


def test_importing_registers_the_attention_implementation(model):
    assert AttentionInterface()[hf.ATTENTION] is hf.attention_forward
    model.set_attn_implementation(hf.ATTENTION)
    assert model.config._attn_implementation == "breakgraph"


def test_the_generator_s_runner_measures_executables_only_when_asked(model):
    assert not generator(model).runner.options.measure_memory
    assert generator(model, measure_memory=True).runner.options.measure_memory


def test_without_a_generator_it_is_transformers_sdpa_masks_included(model):
    ids = torch.randint(0, 300, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row: the padding mask must still apply
    expected = transformers_eager_generate(model, ids, 6, attention_mask=mask)
    model.set_attn_implementation(hf.ATTENTION)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", ["breakable", "full"])
def test_generation_equals_transformers(model, mode):
    gen = generator(model, mode=mode, max_batch_size=4)
    for batch in (1, 3, 4):
        ids = torch.randint(0, 300, (batch, 12))
        assert torch.equal(gen.generate(ids, 20), transformers_eager_generate(model, ids, 20))


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(1, 10), min_size=1, max_size=4), new=st.integers(1, 8))
def test_left_padded_rows_each_equal_their_own_generation(model, lengths, new):
    gen = generator(model, max_batch_size=4, max_length=24)
    width = max(lengths)
    ids = torch.randint(0, 300, (len(lengths), width))
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    got = gen.generate(ids, new, attention_mask=mask)
    for row, length in enumerate(lengths):
        alone = transformers_eager_generate(model, ids[row : row + 1, width - length :], new)
        assert torch.equal(got[row, width:], alone[0, length:])


def test_the_capturable_variant_attends_as_the_eager_break():
    query, keys, values = torch.randn(3, 8, 1, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16)
    positions = torch.tensor([4, 17, 39])
    lengths = hf.RowLengths()
    lengths.set([5, 18, 40])
    eager = hf.attend(query, keys, values, positions, lengths, 0.25)
    torch.testing.assert_close(hf.attend_in_graph(query, keys, values, positions, lengths, 0.25), eager)
    for row, end in enumerate([5, 18, 40]):  # each row against plain attention over its own tokens
        k = keys[row, :, :end].repeat_interleave(4, dim=0)
        v = values[row, :, :end].repeat_interleave(4, dim=0)
        alone = torch.nn.functional.scaled_dot_product_attention(query[row], k, v, scale=0.25)
        torch.testing.assert_close(eager[row], alone.transpose(0, 1))


def test_end_tokens_pad_the_rest_and_stop_generation_as_transformers_does(model):
    gen = generator(model, max_batch_size=4)
    ids = torch.randint(0, 300, (2, 6))
    free = transformers_eager_generate(model, ids, 30)
    end = int(free[1, 6 + 3])  # row 1's fourth new token ends it
    expected = model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=end, pad_token_id=299)
    got, logits = gen.generate(ids, 30, eos_token_id=end, pad_token_id=299, return_logits=True)
    assert torch.equal(got, expected)
    assert logits.shape == (2, got.shape[1] - 6, 300)


def test_mistakes_are_refused_with_what_to_do(model):
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match=r"set_attn_implementation\('breakgraph'\)"):
        hf.Generator(model, max_length=32)
    gen = generator(model, max_batch_size=2, max_length=16)
    with pytest.raises(ValueError, match="holds 2 rows"):
        gen.generate(torch.zeros(3, 4, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="need 20 cache slots"):
        gen.generate(torch.zeros(1, 10, dtype=torch.long), 10)
    with pytest.raises(ValueError, match="not left-padded"):
        gen.generate(torch.zeros(1, 4, dtype=torch.long), 2, attention_mask=torch.tensor([[1, 1, 0, 0]]))
    with pytest.raises(ValueError, match="with rows and a prompt"):
        gen.generate(torch.zeros(0, 4, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="go above max_batch_size 2"):
        generator(model, max_batch_size=2, capture_sizes=[1, 4])
    model.train()
    try:
        with pytest.raises(ValueError, match="eval"):
            hf.Generator(model, max_length=32)
    finally:
        model.eval()


def test_the_worked_example_runs_without_a_gpu(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "llama_generate.py"
    done = subprocess.run(
        [sys.executable, str(example), "--batch", "2", "--prompt", "6", "--new", "5"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no CUDA GPU" in done.stdout and "row 0, first 16 new tokens" in done.stdout


SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def small(model_class, config_class, **overrides):
    model = model_class(config_class(**SMALL, **overrides)).eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize(
    "model_class, config_class, overrides",
    [(Qwen2ForCausalLM, Qwen2Config, {}), (MistralForCausalLM, MistralConfig, {"sliding_window": 64})],
    ids=["qwen2", "mistral, window as long as the cache"],
)
def test_other_decoder_families_equal_transformers(model_class, config_class, overrides):
    model = small(model_class, config_class, **overrides)
    gen = generator(model, max_batch_size=2, max_length=64)
    ids = torch.randint(0, 300, (2, 10))
    assert torch.equal(gen.generate(ids, 30), transformers_eager_generate(model, ids, 30))


def test_what_the_break_does_not_apply_is_refused_not_ignored():
    model = small(MistralForCausalLM, MistralConfig, sliding_window=16)
    gen = generator(model, max_batch_size=1, max_length=64)
    with pytest.raises(NotImplementedError, match="sliding window of 16 tokens.*max_length of at most 16"):
        gen.generate(torch.randint(0, 300, (1, 8)), 4)
    gptj = GPTJForCausalLM(GPTJConfig(vocab_size=300, n_embd=64, n_layer=2, n_head=4, rotary_dim=8)).eval()
    with pytest.raises(ValueError, match="does not route its attention through transformers' AttentionInterface"):
        hf.Generator(gptj, max_length=32)


def test_end_tokens_default_to_the_generation_config_as_transformers_does(model):
    gen = generator(model, max_batch_size=2)
    ids = torch.randint(0, 300, (1, 6))
    end = int(transformers_eager_generate(model, ids, 8)[0, 6 + 2])
    model.generation_config.eos_token_id = end
    try:
        model.set_attn_implementation("sdpa")
        # an explicit mask: transformers would otherwise take prompt tokens equal to the end token for padding
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        with pytest.raises(ValueError, match="uses the attention implementation 'sdpa'"):
            gen.generate(ids, 40)  # switched away after the Generator was made: refused, not silently wrong
        model.set_attn_implementation(hf.ATTENTION)
        got = gen.generate(ids, 40)
        assert torch.equal(got, expected) and got.shape[1] < 6 + 40
        assert gen.generate(ids, 40, eos_token_id=()).shape[1] == 6 + 40  # () turns the end tokens off
    finally:
        model.generation_config.eos_token_id = None
        model.set_attn_implementation(hf.ATTENTION)
