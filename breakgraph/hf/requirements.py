"""What a Generator requires of the model it serves and of its settings, checked as it is made
(and, for what may change since, at each call).

Each check refuses with what to do instead: a model or setting that got
through would fail later, inside a capture or on the GPU, far from its cause.
"""

from __future__ import annotations

from typing import Any, Sequence

from transformers import PreTrainedModel

from breakgraph.base.checks import require_bool
from breakgraph.hf.registration import ATTENTION


def require_causal_lm(model: Any) -> None:
    """Refuse what is not a transformers model that makes its next token's logits from the tokens so
    far: a PreTrainedModel with a generation head (what the Generator's steps call), no encoder."""
    if not (isinstance(model, PreTrainedModel) and model.can_generate() and not model.config.is_encoder_decoder):
        raise TypeError(
            "Generator takes a transformers causal LM: a PreTrainedModel with a generation head, as "
            f"AutoModelForCausalLM.from_pretrained(...) loads; got {type(model).__name__}"
        )


def require_inference_with_breakgraph_attention(model: PreTrainedModel) -> None:
    """Refuse a model in training, or whose attention is not breakgraph's: another would ignore the
    cache's lengths. A Generator checks again at each call: the model may have changed since."""
    if not model.is_backend_compatible():
        raise ValueError(
            f"{type(model).__name__} does not route its attention through transformers' AttentionInterface, "
            "so breakgraph's attention cannot be selected for it"
        )
    # A private attribute: transformers has no public way to read the implementation a model runs.
    implementation = model.config._attn_implementation
    if implementation != ATTENTION:
        raise ValueError(
            f"the model uses the attention implementation {implementation!r}; select breakgraph's first: "
            f"model.set_attn_implementation({ATTENTION!r})"
        )
    if model.training:
        raise ValueError("Generator runs inference: put the model in eval mode first (model.eval())")


# Settings of a generation config that transformers' generate() applies and the Generator does not,
# each with the values that change nothing (transformers' defaults, over its releases).
_NOT_APPLIED = {
    "repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "min_p": (None, 0.0),
    "typical_p": (None, 1.0),
    "top_h": (None,),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "bad_words_ids": (None, []),
    "suppress_tokens": (None, []),
    "begin_suppress_tokens": (None, []),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "sequence_bias": (None,),
    "exponential_decay_length_penalty": (None,),
    "guidance_scale": (None, 1.0),
    "num_beams": (None, 1),
    "num_return_sequences": (None, 1),
    "diversity_penalty": (None, 0.0),
    "penalty_alpha": (None,),
    "watermarking_config": (None,),
}


def require_applied_generation_settings(generation_config: Any) -> None:
    """Refuse a generation config that sets what transformers applies and the Generator does not
    (a repetition penalty, say): its tokens would differ from ``model.generate()``'s without a word.
    Checked at each call: the config may have changed since."""
    set_here = {
        name: value for name, no_op in _NOT_APPLIED.items() if (value := getattr(generation_config, name, None)) not in no_op
    }
    if set_here:
        settings = ", ".join(f"{name}={value!r}" for name, value in set_here.items())
        raise ValueError(
            f"the model's generation config sets {settings}, which transformers' generate() applies and the "
            "Generator does not (it decodes greedily, or samples with temperature, top_k and top_p). To generate "
            f"without {'them' if len(set_here) > 1 else 'it'}, set {' and '.join(f'model.generation_config.{name} = None' for name in set_here)}."
        )


def require_capture_sizes(capture_sizes: Sequence[int] | None, max_batch_size: int) -> None:
    """Refuse capture sizes the cache has no rows for, or none at all (None: the runner's default)."""
    if capture_sizes is not None and len(capture_sizes) == 0:
        raise ValueError(
            "capture_sizes is empty: give the batch sizes to capture, such as [1, 2, 4], or leave it out "
            "for the default (1, 2, 4, 8, then every multiple of 8 up to max_batch_size)"
        )
    if capture_sizes is not None and max(capture_sizes) > max_batch_size:
        raise ValueError(f"capture_sizes {list(capture_sizes)} go above max_batch_size {max_batch_size}: raise max_batch_size")


def require_compile_in_background(compile_in_background: Any, compiling: dict | None) -> None:
    """Refuse ``compile_in_background`` without a compile to run (``compiling``: torch.compile's keywords)."""
    require_bool("compile_in_background", compile_in_background)
    if compile_in_background and compiling is None:
        raise ValueError("compile_in_background=True compiles the decode step: give compile=True (or torch.compile's keywords) too")


def require_one_rank_to_compile_beside(compile_in_background: bool, tensor_parallel_group: Any) -> None:
    """Refuse a background compile on a tensor-parallel model, whose compile's collectives would
    pair with the served steps'."""
    if compile_in_background and tensor_parallel_group is not None:
        raise ValueError(
            "compile_in_background=True compiles beside the served steps, and on a tensor-parallel model its "
            "collectives would pair with theirs: compile up front (compile=True alone)"
        )
