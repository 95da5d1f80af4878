"""Generation whose decode step is captured per batch size: the :class:`Generator`."""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
from typing import Any, Iterator, Sequence

import torch
from transformers import PreTrainedModel

import breakgraph as bg
from breakgraph import runtime
from breakgraph.checks import refuse_unknown, require_bool, require_choice, require_count
from breakgraph.hf.cache import KVCache
from breakgraph.hf.compiled import BackgroundCompile, compile_keywords, compiled_forward
from breakgraph.hf.end_tokens import EndTokens
from breakgraph.hf.registration import ATTENTION, COMPILED_CACHE, generating_into
from breakgraph.hf.sampling import CANDIDATES, Sampling, sample
from breakgraph.hf.tensor_parallel import tensor_parallel_group, tensor_parallel_size

STOP_CHECK_STEPS = 16  # generate() reads the end tokens back this often: one host sync each
_SAMPLING_KEYWORDS = ("do_sample", "temperature", "top_k", "top_p", "generator")
# The sampling step's two graph variants (its runner's keys): drawing among the CANDIDATES highest
# scores, where top-k keeps no more, or over the sorted vocabulary.
AMONG_CANDIDATES, OVER_VOCABULARY = "among candidates", "over the vocabulary"
_GREEDY = "greedy"
_STEPS = (_GREEDY, AMONG_CANDIDATES, OVER_VOCABULARY)


def _candidates(step: str) -> int | None:
    """What :func:`sample`'s ``candidates`` is for the sampling variant ``step``."""
    return CANDIDATES if step == AMONG_CANDIDATES else None


def _cache_keyword(model: PreTrainedModel) -> str:
    """The keyword the model's forward takes its cache by: ``cache`` where it has that parameter
    (newer transformers, which deprecate ``past_key_values``), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _is_causal_lm(model: Any) -> bool:
    """Whether ``model`` is a transformers model that makes its next token's logits from the tokens
    so far: a PreTrainedModel with a generation head (what the Generator's steps call), no encoder."""
    return isinstance(model, PreTrainedModel) and model.can_generate() and not model.config.is_encoder_decoder


def _takes_cache_position(model: PreTrainedModel) -> bool:
    """Whether the model's forward takes ``cache_position`` (older transformers): without it, such
    a forward reads the cache's length on the host to make them, which a compiled forward would
    guard on, compiling again at every step."""
    return "cache_position" in inspect.signature(model.forward).parameters


class Generator:
    """Generation with a transformers causal LM whose decode step is captured per batch size.

    The key/value cache holds ``max_batch_size`` rows of ``max_length``
    tokens (prompt and generated). Prefill runs eagerly; every later token
    comes from one replay of the graph captured for the smallest batch size
    that fits, or eagerly for a batch above the largest captured size.
    Greedy decoding and sampling are two steps with graphs of their own: the
    greedy step's are captured on the first greedy :meth:`generate`, the
    sampling step's on the first that samples, or either by :meth:`capture`.
    The sampling step has two variants, each captured on its first use: one
    draws among the ``hf.CANDIDATES`` highest scores (where top-k keeps no
    more: transformers' default top_k of 50 does), the other sorts the
    vocabulary.

    Arguments:
        model (PreTrainedModel): a causal LM in eval mode on its device, using breakgraph's
            attention (``model.set_attn_implementation("breakgraph")``).
        max_length (int): cache slots per row: prompt and new tokens.
        max_batch_size (int, default 8): cache rows: prompts generated at once.
        mode (str, default "breakable"): the runner's graph mode: "breakable" (attention an eager
            break between segments, reading each row's length on the host) or "full" (one graph
            per size, attention over the whole cache under a device mask).
        capture_sizes (sequence of int, optional): the batch sizes to capture, at least one, none above
            ``max_batch_size``; by default the runner's (1, 2, 4, 8, then every multiple of 8).
        progress (bool, default True): show the runner's capture progress bar.
        debug (bool, optional): the runner's debug mode; None: ``BREAKGRAPH_DEBUG``.
        measure_memory (bool, default False): have the runner measure its executables' memory.
        compile (bool or dict, default False): compile the decode step's forward with
            ``torch.compile`` (Inductor, without CUDA graphs of its own) and capture the compiled
            code, attention the break; a dict gives torch.compile's ``backend``, ``mode``,
            ``options``, ``dynamic`` or ``fullgraph``. Prefill runs uncompiled. The first capture
            compiles first, at the two smallest capture sizes (two compiles serve every size).
        compile_in_background (bool, default False): with ``compile``, capture the uncompiled
            step, and compile in a thread of its own once the first :meth:`generate` returned
            (on a cache and inputs of its own: a second cache's memory while it runs), the
            uncompiled graphs serving meanwhile; the first :meth:`generate` after the compile
            ended (or :meth:`wait_for_compile`) captures the compiled step. The compile holds
            Python's GIL for most of its time, so generation runs slower while it does. A
            capture of a step not captured yet waits for it: CUDA refuses another thread's
            allocations during a capture. Refused for a tensor-parallel model, whose compile's
            collectives would run beside the served step's.

    ``runner`` is the greedy step's :class:`~breakgraph.GraphRunner` (``report()``, ``memory()``,
    ``release()``), ``sampling_runner`` the sampling step's, with a memory pool of its own.

    A model loaded tensor parallel (``from_pretrained(..., tp_plan="auto")``) is served on each of its
    ranks: every rank makes its Generator alike and makes the same calls. The cache holds the rank's
    share of the heads, the runners capture together (``group=``, the model's tensor-parallel process
    group), each :meth:`generate` checks first that every rank was called alike, and sampling draws
    rank 0's numbers on every rank, so every rank makes the same tokens.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_length: int,
        max_batch_size: int = 8,
        mode: str = "breakable",
        capture_sizes: Sequence[int] | None = None,
        progress: bool = True,
        debug: bool | None = None,
        measure_memory: bool = False,
        compile: bool | dict = False,
        compile_in_background: bool = False,
    ):
        if not _is_causal_lm(model):
            raise TypeError(
                "Generator takes a transformers causal LM: a PreTrainedModel with a generation head, as "
                f"AutoModelForCausalLM.from_pretrained(...) loads; got {type(model).__name__}"
            )
        require_count("max_length", max_length, least=2)
        require_count("max_batch_size", max_batch_size)
        require_choice("mode", mode, ("breakable", "full"))
        if not model.is_backend_compatible():
            raise ValueError(
                f"{type(model).__name__} does not route its attention through transformers' AttentionInterface, "
                "so breakgraph's attention cannot be selected for it"
            )
        self.model = model
        self._require_inference_with_breakgraph_attention()
        compiling = compile_keywords(compile)
        require_bool("compile_in_background", compile_in_background)
        if compile_in_background and compiling is None:
            raise ValueError("compile_in_background=True compiles the decode step: give compile=True (or torch.compile's keywords) too")
        if capture_sizes is not None and len(capture_sizes) == 0:
            raise ValueError(
                "capture_sizes is empty: give the batch sizes to capture, such as [1, 2, 4], or leave it out "
                "for the default (1, 2, 4, 8, then every multiple of 8 up to max_batch_size)"
            )
        if capture_sizes is not None and max(capture_sizes) > max_batch_size:
            raise ValueError(f"capture_sizes {list(capture_sizes)} go above max_batch_size {max_batch_size}: raise max_batch_size")
        parameter = next(model.parameters())
        self.device = parameter.device
        tp_size = tensor_parallel_size(model)
        self.cache = KVCache(model.config, max_batch_size, max_length, parameter.dtype, parameter.device, tp_size)
        group = tensor_parallel_group(model)
        if group is not None and compile_in_background:
            raise ValueError(
                "compile_in_background=True compiles beside the served steps, and on a tensor-parallel model its "
                "collectives would pair with theirs: compile up front (compile=True alone)"
            )
        self._cache_keyword = _cache_keyword(model)
        self._compiled = None if compiling is None else compiled_forward(model, compiling)
        self._compiled_serves = compiling is not None and not compile_in_background  # the decode step runs self._compiled
        self._compile_due = False  # compile_in_background: the uncompiled step is captured, the compile not started yet
        self._compiling: BackgroundCompile | None = None
        self._drew_while_compiling = False  # sampled from the default generator while a background compile ran
        # A 4D mask transformers passes on as given rather than building one: breakgraph's attention
        # reads the rows' lengths instead, and the compiled forward then reads no host value.
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        self._takes_cache_position = _takes_cache_position(model)
        static = {
            "input_ids": torch.zeros(max_batch_size, 1, dtype=torch.long, device=self.device),
            "positions": torch.zeros(max_batch_size, dtype=torch.long, device=self.device),
        }
        options = dict(modes=mode, progress=progress, debug=debug, measure_memory=measure_memory)
        if group is not None:
            # generate() checks once per call that every rank was called alike: no exchange per step.
            options |= dict(group=group, agree_batches=False)
        if self._compiled is not None:
            options["warmup"] = 1  # each size runs before its capture: a size that compiles again does so outside it
        self.runner = bg.GraphRunner(self._decode_step, static, capture_sizes, **options)
        # The sampling graphs draw from this generator, whatever the call draws from: a graph
        # draws from the generators it was captured with (see _drawing_from).
        self._draws = torch.Generator(device=self.device)
        self.sampling_runner = bg.GraphRunner(
            self._sampling_step,
            {name: torch.zeros_like(buffer) for name, buffer in static.items()} | Sampling().rows(max_batch_size, self.device),
            capture_sizes,
            keys=[AMONG_CANDIDATES, OVER_VOCABULARY],
            key_fn=lambda *args, **kwargs: [self._sampling_key],
            generators=(self._draws,) if self.device.type == "cuda" else (),
            **options,
        )
        self._sampling_key = AMONG_CANDIDATES  # the variant the call being served replays
        self._captured: set[str] = set()  # greedy, and the sampling variants, once captured

    def _require_inference_with_breakgraph_attention(self) -> None:
        # A private attribute: transformers has no public way to read the implementation a model runs.
        implementation = self.model.config._attn_implementation
        if implementation != ATTENTION:
            raise ValueError(
                f"the model uses the attention implementation {implementation!r}; select breakgraph's first: "
                f"model.set_attn_implementation({ATTENTION!r})"
            )
        if self.model.training:
            raise ValueError("Generator runs inference: put the model in eval mode first (model.eval())")

    @property
    def max_batch_size(self) -> int:
        return self.cache.row_capacity

    @property
    def max_length(self) -> int:
        return self.cache.token_capacity

    @property
    def compiled(self) -> bool:
        """Whether the decode step runs compiled now (``compile_in_background``: once the compile ended)."""
        return self._compiled_serves

    @property
    def compiling(self) -> bool:
        """Whether a background compile is due or under way, the uncompiled step serving meanwhile."""
        return self._compile_due or self._compiling is not None

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, first_row: int = 0, decode: bool = False) -> torch.Tensor:
        """Logits of ``input_ids`` (``(b, q)``), whose row ``r`` starts at slot ``positions[r]`` of
        cache row ``first_row + r``; a ``decode`` step runs the compiled forward where it serves."""
        compiled = self._compiled if decode and self._compiled_serves else None
        return self._logits(self.cache, compiled, input_ids, positions, first_row)

    def _logits(self, cache: KVCache, compiled, input_ids: torch.Tensor, positions: torch.Tensor, first_row: int = 0) -> torch.Tensor:
        """:meth:`_forward` through ``cache``, by the ``compiled`` forward or, if None, the model's."""
        batch, length = input_ids.shape
        cache.begin(positions, first_row, length)
        position_ids = cache.position_ids(batch, length)
        inputs = dict(input_ids=input_ids, position_ids=position_ids, use_cache=True, logits_to_keep=1)
        inputs[self._cache_keyword] = cache
        forward = self.model
        if compiled is not None:
            forward = compiled
            inputs |= {COMPILED_CACHE: cache, "attention_mask": self._no_mask}
            if self._takes_cache_position:
                inputs["cache_position"] = position_ids[0]  # what transformers does with them, breakgraph's cache ignores
        with generating_into(cache):
            output = forward(**inputs)
        return output.logits[:, -1]

    def _decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor):
        logits = self._forward(input_ids, positions, decode=True)
        return logits, logits.argmax(-1)

    def _sampling_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        key: str,
    ):
        logits = self._forward(input_ids, positions, decode=True)
        return logits, sample(logits, temperature, top_k, top_p, generator=self._draws, candidates=_candidates(key))

    def capture(self, sampling: bool = False) -> Generator:
        """Capture every batch size of a step now, rather than on the first :meth:`generate` that
        needs it.

        Arguments:
            sampling (bool, default False): capture the sampling step's graphs, both
                variants (what ``generate(do_sample=True)`` replays), rather than the greedy step's.
        """
        require_bool("sampling", sampling)
        self._capture_steps([AMONG_CANDIDATES, OVER_VOCABULARY] if sampling else [_GREEDY])
        return self

    def _capture_steps(self, steps: Sequence[str]) -> None:
        """Capture every batch size of the steps named (greedy, or a sampling variant) not captured
        yet; first take the compiled step if a background compile ended."""
        self._take_background_compile(wait=False)
        missing = [step for step in steps if step not in self._captured]
        if not missing:
            return
        self._take_background_compile(wait=True)  # CUDA refuses another thread's allocations while one captures
        if self._compiled is not None and not self._captured:
            if not self._compiled_serves:  # compile_in_background: started as a generate() returns
                self._capture(missing)
                self._compile_due = True
                return
            if self.runner.eager_reason is None:
                self._compile_ahead()
        self._capture(missing)

    def _capture(self, steps: Sequence[str]) -> None:
        for step in steps:
            with torch.inference_mode():
                if step == _GREEDY:
                    self.runner.capture()
                else:
                    self.sampling_runner.capture(keys=[step])
            self._captured.add(step)

    def _compile_sizes(self) -> list[int]:
        """The batch sizes to compile ahead at: the two smallest capture sizes.

        torch.compile specialises a batch of 1 and makes the batch dynamic on
        the second size it meets: smallest first, two compiles serve every
        size, where the runner's largest-first warm-ups would need three.
        """
        return sorted({size for sizes in self.runner.sizes_by_key.values() for size in sizes})[:2]

    @torch.inference_mode()
    def _compile_ahead(self) -> None:
        """Compile the decode forward at :meth:`_compile_sizes`, before the first capture."""
        # The runner's own static inputs: torch.compile guards on a tensor's kind too, and one made
        # under inference mode (as here) is not the kind the runner passes.
        for size in self._compile_sizes():
            self._logits(self.cache, self._compiled, **self.runner.inputs.views(size))

    def _compile_on_a_twin(self) -> None:
        """:meth:`_compile_ahead` in the background thread, on a stream, a cache and inputs of its
        own: the step being served writes the Generator's."""
        cuda = self.device.type == "cuda"
        with torch.cuda.stream(torch.cuda.Stream(self.device)) if cuda else contextlib.nullcontext():
            twin = self.cache.twin()
            # Of the kind of the runner's static inputs, which torch.compile guards on: their shapes
            # and strides, and made under inference mode only if they were.
            views = [self.runner.inputs.views(size) for size in self._compile_sizes()]
            with torch.inference_mode(next(iter(views[0].values())).is_inference()):
                sizes = [{name: torch.zeros_like(view) for name, view in inputs.items()} for inputs in views]
            with torch.inference_mode():
                for inputs in sizes:
                    self._logits(twin, self._compiled, **inputs)
            if cuda:
                torch.cuda.current_stream(self.device).synchronize()

    def wait_for_compile(self) -> Generator:
        """Wait for the background compile (``compile_in_background=True``) to end and capture the
        compiled step now, rather than on the next :meth:`generate`; raises what the compile
        raised (where :meth:`generate` only warns). Returns at once where no compile is due or
        under way."""
        self._start_due_compile()
        self._take_background_compile(wait=True, raise_error=True)
        return self

    def _start_due_compile(self) -> None:
        if self._compile_due:
            self._compile_due = False
            self._draws.set_state(self._default_generator().get_state())  # where draws go on from during the compile
            self._compiling = BackgroundCompile(self._compile_on_a_twin)

    def _take_background_compile(self, wait: bool, raise_error: bool = False) -> None:
        """If the background compile ended (with ``wait``, once it ends), serve the compiled step
        from now on: capture the steps captured so far again, compiled. A failed compile leaves
        the step uncompiled, and is raised with ``raise_error``, else warned of (a generation
        that serves is not the place to fail for it)."""
        compiling = self._compiling
        if compiling is None or not (wait or compiling.finished):
            return
        error = compiling.error()  # waits for the thread; cleared only once it ended
        self._compiling = None
        self._hand_draws_back()
        gc.collect()  # the twin cache (its layers point back at it) and its inputs
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # their blocks, cached for the compile's stream, for the captures to come
        if error is not None:
            self._compiled = None
            message = "compiling the decode step in the background failed; the Generator goes on uncompiled"
            if raise_error:
                raise RuntimeError(message) from error
            runtime.warn_user(f"breakgraph: {message}: {error!r}")
            return
        self._compiled_serves = True
        if self.runner.eager_reason is not None:
            return
        for runner, variants in ((self.runner, {_GREEDY}), (self.sampling_runner, {AMONG_CANDIDATES, OVER_VOCABULARY})):
            if self._captured & variants and not runner.released:  # a runner released by its user captures on restore()
                runner.release()
                with torch.inference_mode():
                    runner.restore()  # every variant: capture() captures all of a runner's keys
                self._captured |= variants

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        attention_mask: torch.Tensor | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        return_logits: bool = False,
        **sampling: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """New tokens after ``input_ids``, as ``model.generate()`` returns them: greedy, or drawn.

        Arguments:
            input_ids (torch.Tensor): ``(n, T)`` prompts, ids of the model's vocabulary (checked: one
                host read), left-padded where ``attention_mask`` says
                (as transformers' tokenizers pad for generation); ``n`` at most ``max_batch_size``.
            max_new_tokens (int): new tokens per row, at most; ``T + max_new_tokens`` at most ``max_length``.
            attention_mask (torch.Tensor, optional): ``(n, T)``, zeros (padding) then ones per row;
                without it every token counts, pad tokens too (transformers would infer a mask).
            eos_token_id (int or sequence of int, optional): the end tokens; by default the model's
                generation config's; ``()`` for none. A row that produced one is padded from then
                on, and generation stops once every row has (checked every ``STOP_CHECK_STEPS``
                steps, one host read each).
            pad_token_id (int, optional): what pads a row after its end; by default the generation
                config's, else the first end token.
            return_logits (bool, default False): also return the logits of every new token.
            **sampling: transformers' ``do_sample``, ``temperature``, ``top_k`` and ``top_p``
                (:class:`~breakgraph.hf.Sampling`; each by default the generation config's, else
                greedy, 1.0, 50, 1.0), and ``generator`` (torch.Generator on the model's device,
                optional): what the draws come from; by default the device's default generator
                (on a tensor-parallel model, rank 0's state is drawn from on every rank).
                With ``do_sample`` the token is drawn inside the captured step, the other settings
                read from device buffers, so a new setting captures nothing again once its
                variant (see the class) is captured.

        Returns the prompt and new tokens, ``(n, T + new)``; with ``return_logits`` also the
        logits, ``(n, new, vocab)``.
        """
        refuse_unknown("Generator.generate", sampling, _SAMPLING_KEYWORDS)
        generator = sampling.pop("generator", None)
        settings = Sampling.resolve(self.model.generation_config, **sampling)
        if settings.do_sample:
            self._require_generator_on_device(generator)
        self._require_inference_with_breakgraph_attention()  # another attention would ignore the cache's lengths
        prompt_lengths = self._prompt_lengths(input_ids, attention_mask, max_new_tokens)
        self._require_ids_in_vocabulary(input_ids)
        step = _GREEDY if not settings.do_sample else AMONG_CANDIDATES if settings.among_candidates else OVER_VOCABULARY
        ranks = self.runner.ranks  # the tensor-parallel ranks' RankGroup; None on one rank
        if ranks is not None:  # before anything runs: ranks called differently would pair unrelated collectives
            rows = prompt_lengths + [0] * (self.max_batch_size - len(prompt_lengths))
            ranks.same(
                [*input_ids.shape, max_new_tokens, _STEPS.index(step), return_logits, *rows],
                "generate()'s prompts (batch, length, attention_mask), max_new_tokens, do_sample (and top_k's variant) "
                "and return_logits",
            )
        self._capture_steps([step])  # before the prefill: capturing runs the step, which writes cache slots
        if settings.do_sample:
            self._sampling_key = step
        input_ids = input_ids.to(self.device)
        end = EndTokens.resolve(self.model.generation_config, eos_token_id, pad_token_id)
        with self._drawing_from(generator) if settings.do_sample else contextlib.nullcontext():
            tokens, logits = self._new_tokens(input_ids, prompt_lengths, max_new_tokens, end, return_logits, settings)
        tokens = end.pad_after_stop(tokens)
        out = torch.cat([input_ids, tokens], dim=1)
        self._start_due_compile()  # once this call's tokens are made: the compile would slow them (see compile_in_background)
        return (out, torch.stack(logits[: tokens.shape[1]], dim=1)) if return_logits else out

    def _new_tokens(
        self, input_ids: torch.Tensor, prompt_lengths: list[int], max_new_tokens: int, end: EndTokens, keep_logits: bool,
        settings: Sampling,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Up to ``max_new_tokens`` tokens per row (the prefill's, then one per decode step, until
        every row has ended), and their logits if ``keep_logits``."""
        tokens = torch.empty(input_ids.shape[0], max_new_tokens, dtype=torch.long, device=self.device)
        first = self._prefill(input_ids, prompt_lengths)
        if settings.do_sample:
            rows = settings.rows(input_ids.shape[0], self.device)
            tokens[:, 0] = sample(first, **rows, generator=self._draws, candidates=_candidates(self._sampling_key))
            decode = functools.partial(self.sampling_runner, **rows)
        else:
            tokens[:, 0] = first.argmax(-1)
            decode = self.runner
        logits = [first] if keep_logits else []
        positions = torch.tensor(prompt_lengths, device=self.device)
        for step in range(1, max_new_tokens):
            self.cache.lengths.set([length + step for length in prompt_lengths])
            step_logits, token = decode(input_ids=tokens[:, step - 1 : step], positions=positions)
            tokens[:, step] = token
            if keep_logits:
                logits.append(step_logits.clone())
            positions += 1
            produced = step + 1
            if produced % STOP_CHECK_STEPS == 0 and end.all_stopped(tokens[:, :produced]):
                return tokens[:, :produced], logits
        return tokens, logits

    def _require_generator_on_device(self, generator: Any) -> None:
        if generator is None:
            return
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        device = generator.device
        if device.type != self.device.type or device.index not in (None, self.device.index):
            raise ValueError(
                f"generator is on {device}, but the model is on {self.device}, where the tokens are drawn: "
                f"pass one made there, torch.Generator({str(self.device)!r})"
            )

    @contextlib.contextmanager
    def _drawing_from(self, generator: torch.Generator | None) -> Iterator[None]:
        """Draw from ``generator`` (None: the device's default) for the body's length, through the
        Generator's own generator, which the sampling graphs were captured with: it starts from
        ``generator``'s state and hands the advanced state back, as if ``generator`` had drawn."""
        if generator is None and self._compiling is not None:
            # Dynamo sets the default generators back to their state at a compile's start as the
            # compile ends: while one runs, the draws go on from the Generator's own state, which
            # the default generator takes once the compile is taken (_hand_draws_back).
            self._drew_while_compiling = True
            yield
            return
        chain = self._draws.get_state() if self._compiling is not None else None
        if generator is None:
            generator = self._default_generator()
        state = generator.get_state()
        if self.runner.ranks is not None:  # every rank draws rank 0's numbers: tokens that differ would part the ranks
            self.runner.ranks.broadcast(state)
        self._draws.set_state(state)
        try:
            yield
        finally:
            generator.set_state(self._draws.get_state())
            if chain is not None:
                self._draws.set_state(chain)  # what the default generator's draws go on from during the compile

    def _default_generator(self) -> torch.Generator:
        return torch.cuda.default_generators[self.device.index] if self.device.type == "cuda" else torch.default_generator

    def _hand_draws_back(self) -> None:
        """Give the default generator the state the draws made during a background compile reached."""
        if self._drew_while_compiling:
            self._drew_while_compiling = False
            self._default_generator().set_state(self._draws.get_state())

    def _prompt_lengths(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int) -> list[int]:
        """Each row's prompt length, once the call is checked against the cache."""
        if input_ids.ndim != 2 or 0 in input_ids.shape:
            raise ValueError(f"input_ids must be (batch, prompt length), with rows and a prompt, got shape {tuple(input_ids.shape)}")
        n, length = input_ids.shape
        if n > self.max_batch_size:
            raise ValueError(f"{n} prompts, but this Generator's cache holds {self.max_batch_size} rows (max_batch_size)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if length + max_new_tokens > self.max_length:
            raise ValueError(
                f"a {length}-token prompt and {max_new_tokens} new tokens need {length + max_new_tokens} cache slots, "
                f"but this Generator holds {self.max_length} (max_length)"
            )
        if attention_mask is None:
            return [length] * n
        mask = attention_mask.to("cpu", torch.bool)
        lengths = mask.sum(1).tolist()
        for row, real in enumerate(lengths):
            if real == 0 or not bool(mask[row, length - real :].all()):
                raise ValueError(f"row {row} of attention_mask is not left-padded (zeros, then ones, at least one)")
        return lengths

    def _require_ids_in_vocabulary(self, input_ids: torch.Tensor) -> None:
        """Refuse a token id the embedding has no row for: on a GPU, its lookup would be a
        device-side assert, which leaves the process's CUDA context unusable. One host read."""
        vocabulary = self.model.get_input_embeddings().num_embeddings
        lowest, highest = torch.stack(torch.aminmax(input_ids)).tolist()
        if lowest >= 0 and highest < vocabulary:
            return
        bad = lowest if lowest < 0 else highest
        row, position = (input_ids == bad).nonzero()[0].tolist()
        raise ValueError(
            f"input_ids holds token id {bad} (row {row}, position {position}), outside the model's vocabulary of "
            f"{vocabulary} tokens (ids 0 to {vocabulary - 1}): tokenize with the model's own tokenizer"
        )

    def _prefill(self, input_ids: torch.Tensor, prompt_lengths: list[int]) -> torch.Tensor:
        """Run the prompts eagerly into the cache; the logits of each row's last prompt token."""
        n, length = input_ids.shape
        if len(set(prompt_lengths)) == 1 and prompt_lengths[0] == length:
            self.cache.lengths.set(prompt_lengths)
            return self._forward(input_ids, torch.zeros(n, dtype=torch.long, device=self.device))
        rows, zero = [], torch.zeros(1, dtype=torch.long, device=self.device)
        for row, real in enumerate(prompt_lengths):  # left padding is not the model's input: one row at a time
            self.cache.lengths.set([real])
            rows.append(self._forward(input_ids[row : row + 1, length - real :], zero, first_row=row))
        return torch.cat(rows)
