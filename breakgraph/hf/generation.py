"""Generation whose decode step is captured per batch size: the :class:`Generator`."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Sequence

import torch
from transformers import PreTrainedModel

import breakgraph as bg
from breakgraph.base.checks import refuse_unknown, require_bool, require_choice, require_count
from breakgraph.hf.cache import KVCache
from breakgraph.hf.compiled import DecodeCompile, compile_keywords, compiled_forward
from breakgraph.hf.draws import Draws, require_generator_on
from breakgraph.hf.end_tokens import EndTokens
from breakgraph.hf.lifecycle import CaptureLifecycle, CompilePhase
from breakgraph.hf.prompts import prompt_lengths, require_ids_in_vocabulary
from breakgraph.hf.requirements import require_applied_generation_settings, require_capture_sizes, require_causal_lm
from breakgraph.hf.requirements import require_compile_in_background, require_inference_with_breakgraph_attention
from breakgraph.hf.requirements import require_one_rank_to_compile_beside
from breakgraph.hf.sampling import Sampling, sample
from breakgraph.hf.steps import AMONG_CANDIDATES, GREEDY, OVER_VOCABULARY, SAMPLING_VARIANTS, STEPS, ModelForward, candidates, step_for
from breakgraph.hf.steps import weakly_bound
from breakgraph.hf.tensor_parallel import tensor_parallel_group, tensor_parallel_size

__all__ = ["AMONG_CANDIDATES", "OVER_VOCABULARY", "STOP_CHECK_STEPS", "Generator"]  # the sampling runner's keys: named here too

STOP_CHECK_STEPS = 16  # generate() reads the end tokens back this often: one host sync each
_SAMPLING_KEYWORDS = ("do_sample", "temperature", "top_k", "top_p", "generator")


class Generator:
    """Generation with a transformers causal LM whose decode step is captured per batch size.

    The key/value cache holds ``max_batch_size`` rows of ``max_length``
    tokens (prompt and generated). Prefill runs eagerly; every later token
    comes from one replay of the graph captured for the smallest batch size
    that fits, or eagerly for a batch above the largest captured size.
    Greedy decoding and sampling are two steps with graphs of their own. A
    :meth:`generate` captures its step at the batch size it needs where that
    size is not captured yet, before its prefill; the other sizes wait for the
    calls that need them, or for :meth:`capture`, which captures every size of
    a step. The sampling step has two variants, each captured on its first use: one
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
            Python's GIL for most of its time, so generation runs slower while it does. While
            it runs, a call whose batch size (or step) is not captured yet decodes eagerly, and
            :meth:`capture` waits for it: CUDA refuses another thread's allocations during a
            capture. Refused for a tensor-parallel model, whose compile's
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
        require_causal_lm(model)
        require_count("max_length", max_length, least=2)
        require_count("max_batch_size", max_batch_size)
        require_choice("mode", mode, ("breakable", "full"))
        require_inference_with_breakgraph_attention(model)
        self.model = model
        compiling = compile_keywords(compile)
        require_compile_in_background(compile_in_background, compiling)
        require_capture_sizes(capture_sizes, max_batch_size)
        parameter = next(model.parameters())
        self.device = parameter.device
        tp_size = tensor_parallel_size(model)
        self.cache = KVCache(model.config, max_batch_size, max_length, parameter.dtype, parameter.device, tp_size)
        group = tensor_parallel_group(model)
        require_one_rank_to_compile_beside(compile_in_background, group)
        self._model_forward = ModelForward(model, self.device)
        static = {
            "input_ids": torch.zeros(max_batch_size, 1, dtype=torch.long, device=self.device),
            "positions": torch.zeros(max_batch_size, dtype=torch.long, device=self.device),
        }
        options = dict(modes=mode, progress=progress, debug=debug, measure_memory=measure_memory)
        if group is not None:
            # generate() checks once per call that every rank was called alike: no exchange per step.
            options |= dict(group=group, agree_batches=False)
        if compiling is not None:
            options["warmup"] = 1  # each size runs before its capture: a size that compiles again does so outside it
        self.runner = bg.GraphRunner(weakly_bound(self._decode_step), static, capture_sizes, **options)
        # The sampling graphs draw from the Draws' generator, whatever the call draws from: a graph
        # draws from the generators it was captured with.
        self._draws = Draws(self.device)
        self._sampling_key = AMONG_CANDIDATES  # the variant the call being served replays (generate() sets it)
        self.sampling_runner = bg.GraphRunner(
            weakly_bound(self._sampling_step),
            {name: torch.zeros_like(buffer) for name, buffer in static.items()} | Sampling().rows(max_batch_size, self.device),
            capture_sizes,
            keys=list(SAMPLING_VARIANTS),
            key_fn=weakly_bound(self._sampling_keys),
            generators=self._draws.captured_with,
            **options,
        )
        step_compile = None
        if compiling is not None:
            step_compile = DecodeCompile(compiled_forward(model, compiling), self._model_forward, self.cache, self.runner)
        runners = [(self.runner, [GREEDY]), (self.sampling_runner, SAMPLING_VARIANTS)]
        self._lifecycle = CaptureLifecycle(runners, self._draws, step_compile, compile_in_background)

    @property
    def max_batch_size(self) -> int:
        return self.cache.row_capacity

    @property
    def max_length(self) -> int:
        return self.cache.token_capacity

    @property
    def compiled(self) -> bool:
        """Whether the decode step runs compiled now (``compile_in_background``: once the compile ended)."""
        return self._lifecycle.compiled_forward is not None

    @property
    def compiling(self) -> bool:
        """Whether a background compile is due or under way, the uncompiled step serving meanwhile."""
        return self._lifecycle.compiling

    def _decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor):
        logits = self._model_forward(self.cache, input_ids, positions, compiled=self._lifecycle.compiled_forward)
        return logits, logits.argmax(-1)

    def _sampling_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
        key: str,
    ):
        logits = self._model_forward(self.cache, input_ids, positions, compiled=self._lifecycle.compiled_forward)
        return logits, sample(logits, temperature, top_k, top_p, generator=self._draws.generator, candidates=candidates(key))

    def _sampling_keys(self, *inputs: Any, **named_inputs: Any) -> list[str]:
        """The sampling runner's ``key_fn``: the variant the call being served replays, whatever its inputs."""
        return [self._sampling_key]

    def capture(self, sampling: bool = False) -> Generator:
        """Capture every batch size of a step now, rather than each on the first :meth:`generate`
        that needs it.

        Arguments:
            sampling (bool, default False): capture the sampling step's graphs, both
                variants (what ``generate(do_sample=True)`` replays), rather than the greedy step's.
        """
        require_bool("sampling", sampling)
        self._lifecycle.capture(SAMPLING_VARIANTS if sampling else [GREEDY])
        return self

    def wait_for_compile(self) -> Generator:
        """Wait for the background compile (``compile_in_background=True``) to end and capture the
        compiled step now, rather than on the next :meth:`generate`; raises what the compile
        raised (where :meth:`generate` only warns). Returns at once where no compile is due or
        under way."""
        self._start_due_compile()
        if self._lifecycle.phase is CompilePhase.RUNNING:
            self._lifecycle.take(raise_error=True)
        return self

    def _start_due_compile(self) -> None:
        if self._lifecycle.phase is CompilePhase.DUE:
            self._lifecycle.start()

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
        require_applied_generation_settings(self.model.generation_config)
        settings = Sampling.resolve(self.model.generation_config, **sampling)
        if settings.do_sample:
            require_generator_on(self.device, generator)
        require_inference_with_breakgraph_attention(self.model)
        lengths = prompt_lengths(input_ids, attention_mask, max_new_tokens, self.cache)
        require_ids_in_vocabulary(self.model, input_ids)
        step = step_for(settings)
        ranks = self.runner.ranks  # the tensor-parallel ranks' RankGroup; None on one rank
        if ranks is not None:  # before anything runs: ranks called differently would pair unrelated collectives
            rows = lengths + [0] * (self.max_batch_size - len(lengths))
            ranks.same(
                [*input_ids.shape, max_new_tokens, STEPS.index(step), return_logits, *rows],
                "generate()'s prompts (batch, length, attention_mask), max_new_tokens, do_sample (and top_k's variant) "
                "and return_logits",
            )
        # Before the prefill: capturing runs the step, which writes cache slots. Only the size this
        # call needs; it decodes eagerly above every size, and at a size not captured yet while a
        # background compile runs.
        graphs_serve = self._lifecycle.capture([step], rows=len(lengths), wait=False)
        if settings.do_sample:
            self._sampling_key = step
        input_ids = input_ids.to(self.device)
        end = EndTokens.resolve(self.model.generation_config, eos_token_id, pad_token_id)
        with self._lifecycle.drawing_from(generator, ranks) if settings.do_sample else contextlib.nullcontext():
            tokens, logits = self._new_tokens(input_ids, lengths, max_new_tokens, end, return_logits, settings, graphs_serve)
        tokens = end.pad_after_stop(tokens)
        out = torch.cat([input_ids, tokens], dim=1)
        self._start_due_compile()  # once this call's tokens are made: the compile would slow them (see compile_in_background)
        return (out, torch.stack(logits[: tokens.shape[1]], dim=1)) if return_logits else out

    def _new_tokens(
        self, input_ids: torch.Tensor, prompt_lengths: list[int], max_new_tokens: int, end: EndTokens, keep_logits: bool,
        settings: Sampling, graphs_serve: bool,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Up to ``max_new_tokens`` tokens per row (the prefill's, then one per decode step, until
        every row has ended), and their logits if ``keep_logits``; the decode steps replay the
        runner's graphs, or run eagerly where ``graphs_serve`` is False."""
        tokens = torch.empty(input_ids.shape[0], max_new_tokens, dtype=torch.long, device=self.device)
        first = self._model_forward.prefill(self.cache, input_ids, prompt_lengths)
        if settings.do_sample:
            rows = settings.rows(input_ids.shape[0], self.device)
            tokens[:, 0] = sample(first, **rows, generator=self._draws.generator, candidates=candidates(self._sampling_key))
            if graphs_serve:
                decode = functools.partial(self.sampling_runner, **rows)
            else:
                decode = functools.partial(self._sampling_step, **rows, key=self._sampling_key)
        else:
            tokens[:, 0] = first.argmax(-1)
            decode = self.runner if graphs_serve else self._decode_step
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
