"""Hugging Face transformers models on breakable CUDA graphs.

Select breakgraph's attention with one line, and a :class:`Generator`
captures the model's decode step once per batch size with a
:class:`~breakgraph.GraphRunner` and generates, greedily or sampling as
transformers samples (the token drawn inside the graph)::

    from breakgraph import hf
    model.set_attn_implementation("breakgraph")
    generator = hf.Generator(model, max_length=512)
    tokens = generator.generate(input_ids, max_new_tokens=128)
    drawn = generator.generate(input_ids, 128, do_sample=True, temperature=0.7, top_p=0.9)

Everything but attention is captured. Attention (:mod:`breakgraph.hf.attention`)
is an ``@eager_on_graph`` break that reads each row's length on the host and
attends over that many cached tokens (the breakable mode); its capturable
variant, recorded by ``mode="full"``, reads each row's position from a device
tensor and attends over the whole cache under a mask built on the device.
``Generator(model, ..., compile=True)`` compiles the decode step's forward
with ``torch.compile`` and captures Inductor's kernels instead, attention an
op Dynamo does not trace into (:mod:`~breakgraph.hf.compiled`).
Both attention variants run torch's scaled dot-product attention on any backend but cuDNN's,
which would build an execution plan for every new key length
(:mod:`breakgraph.hf.sdpa`). Called without a Generator (``model.generate()``,
training), the implementation is transformers' own SDPA attention, masks
included.

Importing this package registers ``"breakgraph"`` with transformers'
attention and mask registries (:func:`register`). transformers accepts only
registered names, in ``set_attn_implementation`` and in
``from_pretrained(attn_implementation=...)``, so a name that needed a second
call before it could be selected would only add a way to get it wrong; the
registration changes nothing for models that do not select it. ``register()``
is the same step said explicitly, and puts the entries back where something
replaced them; calling it again changes nothing.

Modules: :mod:`~breakgraph.hf.shapes` (model shapes to try),
:mod:`~breakgraph.hf.cache` (the static cache), :mod:`~breakgraph.hf.sdpa`
and :mod:`~breakgraph.hf.attention` (the break),
:mod:`~breakgraph.hf.registration` (what transformers calls),
:mod:`~breakgraph.hf.steps` (the decode steps and the model forward they run),
:mod:`~breakgraph.hf.compiled` (the compiled decode step),
:mod:`~breakgraph.hf.lifecycle` (which steps are captured, and the phases of their compile),
:mod:`~breakgraph.hf.tensor_parallel` (a model loaded tensor parallel: its ranks and their group),
:mod:`~breakgraph.hf.sampling` (transformers' sampling filters, read from device tensors, and a
draw a graph can hold), :mod:`~breakgraph.hf.draws` (the generator the sampling graphs draw from),
:mod:`~breakgraph.hf.requirements` and :mod:`~breakgraph.hf.prompts` (what a Generator and each
call are checked for), :mod:`~breakgraph.hf.end_tokens` and :mod:`~breakgraph.hf.generation`
(the Generator).
"""

from breakgraph.hf.attention import attend, attend_in_graph
from breakgraph.hf.cache import KVCache, RowLengths
from breakgraph.hf.generation import STOP_CHECK_STEPS, Generator
from breakgraph.hf.registration import ATTENTION, attention_forward, attention_mask, register
from breakgraph.hf.sampling import CANDIDATES, Sampling, sample
from breakgraph.hf.shapes import LLAMA_3_2_1B

register()

__all__ = [
    "ATTENTION",
    "CANDIDATES",
    "Generator",
    "KVCache",
    "LLAMA_3_2_1B",
    "RowLengths",
    "STOP_CHECK_STEPS",
    "Sampling",
    "attend",
    "attend_in_graph",
    "attention_forward",
    "attention_mask",
    "register",
    "sample",
]
