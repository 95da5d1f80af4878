"""What a Generator requires of the model it serves and of its settings, checked as it is made.

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
