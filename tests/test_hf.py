"""breakgraph.hf on the CPU: the registered attention, and the Generator's eager path against transformers."""

import gc
import os
import subprocess
import sys
import warnings
import weakref
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers extra is not installed (pip install -e '.[transformers]')")

from hypothesis import given, settings, strategies as st
from transformers import (
    AttentionInterface,
    BloomConfig,
    BloomForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.masking_utils import AttentionMaskInterface

from breakgraph import hf
from tests.helpers import tiny_llama, transformers_eager_generate

# Without a GPU the runner warns that it runs eagerly. A deprecation (transformers warns with
# FutureWarning) fails the test: breakgraph passes nothing a release of its range deprecates.
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("error::FutureWarning"),
    pytest.mark.filterwarnings("error::DeprecationWarning"),
]


@pytest.fixture(autouse=True)
def no_deprecation_logged(caplog):
    """transformers also announces deprecations through its logger: those fail the test as well."""
    yield
    logged = [record.getMessage() for phase in ("setup", "call") for record in caplog.get_records(phase)]
    deprecated = [message for message in logged if "deprecat" in message.lower()]
    assert not deprecated, deprecated


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def generator(model, **kwargs):
    model.set_attn_implementation(hf.ATTENTION)
    return hf.Generator(model, max_length=kwargs.pop("max_length", 64), progress=False, **kwargs)


def test_importing_registers_the_attention_implementation(model):
    assert AttentionInterface()[hf.ATTENTION] is hf.attention_forward
    assert AttentionMaskInterface()[hf.ATTENTION] is hf.attention_mask
    model.set_attn_implementation(hf.ATTENTION)
    assert model.config._attn_implementation == "breakgraph"


def test_register_is_idempotent_and_puts_back_what_was_replaced():
    hf.register()
    hf.register()
    assert AttentionInterface()[hf.ATTENTION] is hf.attention_forward
    AttentionInterface.register(hf.ATTENTION, lambda *args, **kwargs: None)
    AttentionMaskInterface.register(hf.ATTENTION, lambda *args, **kwargs: None)
    hf.register()
    assert AttentionInterface()[hf.ATTENTION] is hf.attention_forward
    assert AttentionMaskInterface()[hf.ATTENTION] is hf.attention_mask


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


@pytest.mark.parametrize("user_setting", [True, False])
@pytest.mark.parametrize("mode", ["breakable", "full"])
def test_generation_attends_without_cudnn_and_leaves_the_user_s_setting(model, monkeypatch, mode, user_setting):
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(user_setting)
    try:
        generator(model, mode=mode, max_batch_size=2).generate(torch.randint(0, 300, (2, 5)), 4)
        assert torch.backends.cuda.cudnn_sdp_enabled() is user_setting
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
    assert len(seen) == 2 * 4 and not any(seen)  # 2 layers, the prefill and 3 decode steps


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
    ids = torch.randint(0, 299, (2, 6))
    ids[0, 2] = 299  # the pad token inside a prompt is a token: a mask says what is padding
    free = transformers_eager_generate(model, ids, 30)
    end = int(free[1, 6 + 3])  # row 1's fourth new token ends it
    # Without a mask, transformers would infer one from the pad tokens in the prompt.
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False, eos_token_id=end, pad_token_id=299)
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
    with pytest.raises(ValueError, match=r"attention_mask must be shaped as input_ids, \(1, 4\), got \(1, 8\)"):
        gen.generate(torch.zeros(1, 4, dtype=torch.long), 2, attention_mask=torch.ones(1, 8))
    with pytest.raises(ValueError, match="go above max_batch_size 2"):
        generator(model, max_batch_size=2, capture_sizes=[1, 4])
    with pytest.raises(ValueError, match=r"capture_sizes is empty: give the batch sizes to capture, such as \[1, 2, 4\]"):
        generator(model, capture_sizes=[])
    model.train()
    try:
        with pytest.raises(ValueError, match="eval"):
            hf.Generator(model, max_length=32)
    finally:
        model.eval()


@pytest.mark.parametrize(
    "not_a_causal_lm", [lambda model: object(), lambda model: model.model], ids=["object", "LlamaModel, no generation head"]
)
def test_a_model_that_is_not_a_causal_lm_is_refused_with_what_it_takes(model, not_a_causal_lm):
    refused = not_a_causal_lm(model)
    with pytest.raises(TypeError, match=(
        r"Generator takes a transformers causal LM: a PreTrainedModel with a generation head, as "
        rf"AutoModelForCausalLM.from_pretrained\(...\) loads; got {type(refused).__name__}$"
    )):
        hf.Generator(refused, max_length=16)


@pytest.mark.parametrize(
    "prompts, bad, row, position",
    [([[5, 6, 7, 300]], 300, 0, 3), ([[5, 6, 7, 8], [9, -1, 10, 11]], -1, 1, 1)],
    ids=["the vocabulary's size", "negative"],
)
def test_a_token_id_outside_the_vocabulary_is_refused_before_it_reaches_the_model(model, prompts, bad, row, position):
    gen = generator(model, max_batch_size=2, max_length=16)
    with pytest.raises(ValueError, match=(
        rf"input_ids holds token id {bad} \(row {row}, position {position}\), outside the model's vocabulary "
        r"of 300 tokens \(ids 0 to 299\): tokenize with the model's own tokenizer"
    )):
        gen.generate(torch.tensor(prompts), 2)
    ids = torch.tensor([[0, 5, 299]])  # the vocabulary's ends are in it
    assert torch.equal(gen.generate(ids, 4), transformers_eager_generate(model, ids, 4))


def test_the_no_gpu_warnings_point_to_the_line_that_made_the_generator(model):
    if torch.cuda.is_available():
        pytest.skip("with a GPU the runners capture, and have nothing to warn of")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen = generator(model, max_batch_size=2, max_length=16)
        gen.generate(torch.randint(0, 300, (1, 4)), 2)
    eager = [warning for warning in caught if "no CUDA GPU is available" in str(warning.message)]
    assert len(eager) == 2, [str(warning.message) for warning in caught]  # the greedy step's runner, the sampling step's
    assert {warning.filename for warning in eager} == {__file__}


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


def _mistral_window_16():
    return small(MistralForCausalLM, MistralConfig, sliding_window=16)


def _gemma2_soft_capping():
    return small(Gemma2ForCausalLM, Gemma2Config, head_dim=16, attn_logit_softcapping=50.0)


def _gpt_oss_sinks():
    return small(GptOssForCausalLM, GptOssConfig, head_dim=16, num_local_experts=4, num_experts_per_tok=2)


def _llama_one_layer_training():
    model = small(LlamaForCausalLM, LlamaConfig, attention_dropout=0.1)
    model.model.layers[1].train()  # the model in eval mode, one layer's attention dropping out
    return model


@pytest.mark.parametrize(
    "build, error",
    [
        (_mistral_window_16, r"MistralAttention attends through a sliding window of 16 tokens.*max_length of at most 16"),
        (_gemma2_soft_capping, r"Gemma2Attention asks attention for logit soft-capping \(softcap=\)"),
        (_gpt_oss_sinks, r"GptOssAttention asks attention for attention sinks \(s_aux=\)"),
        (_llama_one_layer_training, r"for inference: put the model in eval mode"),
    ],
    ids=["sliding window shorter than the cache", "soft-capping", "sinks", "dropout"],
)
def test_what_the_break_does_not_apply_is_refused_not_ignored(build, error):
    gen = generator(build(), max_batch_size=1, max_length=64)
    with pytest.raises((NotImplementedError, ValueError), match=error):
        gen.generate(torch.randint(0, 300, (1, 8)), 4)


def test_a_model_whose_attention_is_its_own_code_is_refused():
    # Bloom computes its attention (ALiBi biases) in its own code on every transformers of the
    # extra's range: transformers can only warn that it keeps Bloom's attention.
    bloom = BloomForCausalLM(BloomConfig(vocab_size=300, hidden_size=64, n_layer=2, n_head=4)).eval()
    bloom.set_attn_implementation(hf.ATTENTION)
    with pytest.raises(ValueError, match="does not route its attention through transformers' AttentionInterface"):
        hf.Generator(bloom, max_length=32)


def test_a_model_put_in_training_after_the_generator_was_made_is_refused(model):
    gen = generator(model, max_batch_size=1)
    model.train()
    try:
        with pytest.raises(ValueError, match=r"eval mode first \(model.eval\(\)\)"):
            gen.generate(torch.randint(0, 300, (1, 4)), 2)
    finally:
        model.eval()


@pytest.mark.parametrize("setting, value", [("repetition_penalty", 1.5), ("no_repeat_ngram_size", 2), ("min_new_tokens", 5)])
def test_generation_settings_the_generator_does_not_apply_are_refused_not_ignored(model, setting, value):
    gen = generator(model, max_batch_size=1)
    ids = torch.randint(0, 300, (1, 6))
    try:
        setattr(model.generation_config, setting, value)
        with pytest.raises(ValueError, match=rf"sets {setting}={value}, which transformers' generate\(\) applies.*"
                                             rf"set model.generation_config.{setting} = None\."):
            gen.generate(ids, 8)
        setattr(model.generation_config, setting, {"repetition_penalty": 1.0}.get(setting, 0))  # values that change nothing
        got = gen.generate(ids, 8)
    finally:
        setattr(model.generation_config, setting, None)
    assert torch.equal(got, transformers_eager_generate(model, ids, 8))


def test_a_dropped_generator_dies_at_once_with_its_cache_not_at_a_later_garbage_collection(model):
    """A collection that frees it later can fall inside another library's capture, where
    destroying its runners' pools aborts the process; and its cache is the memory to get back."""
    gen = generator(model, max_batch_size=2)
    ids = torch.randint(0, 300, (2, 5))
    gen.generate(ids, 4)
    gen.generate(ids, 4, do_sample=True, top_k=1)
    gc.disable()
    try:
        alive = [weakref.ref(gen), weakref.ref(gen.cache.layers[0].keys), weakref.ref(gen.runner), weakref.ref(gen.sampling_runner)]
        del gen
        assert [ref() for ref in alive] == [None] * 4, "a reference cycle keeps it for the collector"
    finally:
        gc.enable()


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


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_length": "64"}, r"max_length must be a whole number >= 2, got '64' \(str\)"),
        ({"max_length": 64, "max_batch_size": 0}, r"max_batch_size must be a whole number >= 1, got 0"),
        ({"max_length": 64, "mode": "piecewise"}, r"mode must be one of 'breakable', 'full', got 'piecewise'"),
    ],
)
def test_the_generator_s_options_are_checked_before_anything_is_allocated(model, options, message):
    model.set_attn_implementation(hf.ATTENTION)
    with pytest.raises(ValueError, match=message):
        hf.Generator(model, progress=False, **options)
