"""breakgraph.hf.Generator(compile=...) on the CPU: the compiled decode step against transformers."""

import threading
import time

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers extra is not installed (pip install -e '.[transformers]')")

from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from breakgraph import hf
from breakgraph.hf import tracing
from breakgraph.hf.compiled import compiled_forward
from breakgraph.hf.lifecycle import CompilePhase
from breakgraph.hf.steps import GREEDY, SAMPLING_VARIANTS
from tests.helpers import transformers_eager_generate

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TRACED_ONLY = {"backend": "eager"}  # Dynamo's tracing, the seam under test, without Inductor's compile time


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def small(model_class, config_class, **overrides):
    model = model_class(config_class(**SMALL, **overrides)).eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    model.set_attn_implementation(hf.ATTENTION)
    return model


def generator(model, compile=TRACED_ONLY, **kwargs):
    return hf.Generator(model, max_length=kwargs.pop("max_length", 64), progress=False, compile=compile, **kwargs)


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU")
@pytest.mark.parametrize("mode", ["breakable", "full"])
@pytest.mark.parametrize(
    "model_class, config_class, overrides",
    [(LlamaForCausalLM, LlamaConfig, {}), (Qwen2ForCausalLM, Qwen2Config, {}), (MistralForCausalLM, MistralConfig, {"sliding_window": 64})],
    ids=["llama", "qwen2", "mistral"],
)
def test_compiled_generation_equals_transformers_in_one_graph(model_class, config_class, overrides, mode):
    model = small(model_class, config_class, **overrides)
    gen = generator(model, mode=mode, max_batch_size=4)
    ids = torch.randint(0, 300, (3, 10))
    expected = transformers_eager_generate(model, ids, 24)
    assert torch.equal(gen.generate(ids, 24), expected)
    assert torch.equal(gen.generate(ids, 24, do_sample=True, top_k=1), expected)  # the sampling step compiles the same forward
    assert not counters["graph_break"], dict(counters["graph_break"])  # attention is an op, not a break in Dynamo's graph
    assert counters["stats"]["unique_graphs"] == 1  # no step's lengths are read while tracing: one graph serves them all


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU")
def test_a_new_batch_size_compiles_once_and_steps_never_do():
    model = small(LlamaForCausalLM, LlamaConfig)
    gen = generator(model, max_batch_size=4)
    for batch in (3, 2, 4, 2, 3):
        ids = torch.randint(0, 300, (batch, 8))
        assert torch.equal(gen.generate(ids, 12), transformers_eager_generate(model, ids, 12))
    # the first size, then one graph with the batch dynamic (torch.compile's default)
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU")
def test_inductor_compiled_generation_equals_transformers():
    model = small(LlamaForCausalLM, LlamaConfig)
    gen = generator(model, compile=True, max_batch_size=2)
    ids = torch.randint(0, 300, (2, 10))
    assert torch.equal(gen.generate(ids, 16), transformers_eager_generate(model, ids, 16))


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU")
def test_what_the_break_does_not_apply_is_refused_when_compiled_too():
    gen = generator(small(MistralForCausalLM, MistralConfig, sliding_window=16), max_batch_size=1)
    with pytest.raises(NotImplementedError, match="sliding window of 16 tokens"), torch.inference_mode():
        gen.runner.fn(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))  # the compiled step, no prefill first


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU")
def test_left_padded_rows_each_equal_their_own_generation_when_compiled():
    model = small(LlamaForCausalLM, LlamaConfig)
    gen = generator(model, max_batch_size=4)
    lengths, width, new = [9, 4, 1], 9, 12
    ids = torch.randint(0, 300, (3, width))
    mask = torch.tensor([[0] * (width - length) + [1] * length for length in lengths])
    got = gen.generate(ids, new, attention_mask=mask)
    for row, length in enumerate(lengths):
        alone = transformers_eager_generate(model, ids[row : row + 1, width - length :], new)
        assert torch.equal(got[row, width:], alone[0, length:]), f"row {row} ({length}-token prompt)"


def test_the_compiled_attention_op_runs_only_under_a_generator():
    query = torch.randn(1, 4, 1, 16)
    cache = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="outside a Generator's forward"):
        torch.ops.breakgraph.hf_attention(query, cache, cache, 0.25)


@pytest.mark.parametrize(
    "compile, error, message",
    [
        ({"mode": "reduce-overhead"}, ValueError, r"mode 'reduce-overhead' captures CUDA graphs of its own.*'max-autotune-no-cudagraphs'"),
        ({"mode": "max-autotune"}, ValueError, r"mode 'max-autotune' captures CUDA graphs of its own"),
        ({"options": {"triton.cudagraphs": True}}, ValueError, r"triton.cudagraphs captures CUDA graphs of its own"),
        ({"backnd": "eager"}, TypeError, r"unknown option 'backnd'; did you mean 'backend'\?"),
        ({"backend": "cudagraphs"}, ValueError, r"backend 'cudagraphs' captures CUDA graphs of its own"),
        ({"options": ["max_autotune"]}, TypeError, r"options must be a dict of Inductor's options, got list"),
        ("inductor", TypeError, r"compile must be a bool or a dict of torch.compile's keywords, got str"),
    ],
)
def test_compile_settings_are_checked(compile, error, message):
    with pytest.raises(error, match=message):
        generator(small(LlamaForCausalLM, LlamaConfig), compile=compile)


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU")
def test_compiling_ahead_leaves_nothing_for_the_captures_to_compile():
    model = small(LlamaForCausalLM, LlamaConfig)
    gen = generator(model, max_batch_size=8)
    gen._lifecycle.compile.ahead()  # what the first capture runs before it, on a GPU
    assert counters["stats"]["unique_graphs"] == 2  # a batch of 1, then the batch dynamic
    # the runner's warm-ups and captures, largest first, on static inputs made outside inference mode
    inputs = {size: (torch.zeros(size, 1, dtype=torch.long), torch.full((size,), 3)) for size in (8, 4, 2, 1)}
    with torch.inference_mode():  # as Generator captures
        for ids, positions in inputs.values():
            gen.runner.fn(ids, positions)
    assert counters["stats"]["unique_graphs"] == 2


def test_a_compile_inside_a_capture_is_an_error_that_names_the_guard(monkeypatch):
    model = small(LlamaForCausalLM, LlamaConfig)
    forward = compiled_forward(model, TRACED_ONLY)
    ids = torch.randint(0, 300, (2, 4))
    forward(input_ids=ids)  # compiled outside a capture
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # as inside breakgraph's capture
    forward(input_ids=ids)  # the compiled code serves: nothing to compile
    with pytest.raises(torch._dynamo.exc.RecompileError, match="size mismatch|input_ids"):
        forward(input_ids=ids[:1])  # a batch of 1 would compile again


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU")
def test_a_background_compile_serves_uncompiled_until_it_ends_then_compiled_with_no_compile_of_its_own():
    model = small(LlamaForCausalLM, LlamaConfig)
    gen = generator(model, max_batch_size=4, compile_in_background=True)
    ids = torch.randint(0, 300, (3, 10))
    expected = transformers_eager_generate(model, ids, 16)
    assert not gen.compiling
    assert torch.equal(gen.generate(ids, 16), expected)
    assert gen.compiling and not gen.compiled  # started as the call returned, taken by a later call, never in the middle of one
    assert torch.equal(gen.generate(ids, 16), expected)
    gen.wait_for_compile()
    assert gen.compiled and not gen.compiling
    assert counters["stats"]["unique_graphs"] == 2  # on its twin cache and inputs: a batch of 1, then the batch dynamic
    with torch.inference_mode():  # the runner's warm-ups and captures on a GPU, on its static inputs
        for size in (4, 2, 1):
            gen.runner.fn(**gen.runner.inputs.views(size))
    assert counters["stats"]["unique_graphs"] == 2  # the twin's compiles serve the Generator's own cache and inputs
    assert torch.equal(gen.generate(ids, 16), expected)  # without a GPU on generate()'s inputs, which compile apart
    assert torch.equal(gen.generate(ids, 16, do_sample=True, top_k=1), expected)


def failing_compile_in_background():
    """A Generator whose background compile fails, its prompts, and transformers' tokens for them."""

    def failing_backend(graph, example_inputs):
        raise RuntimeError("no compiler here")

    model = small(LlamaForCausalLM, LlamaConfig)
    gen = generator(model, compile={"backend": failing_backend}, max_batch_size=2, compile_in_background=True)
    ids = torch.randint(0, 300, (2, 6))
    return gen, ids, transformers_eager_generate(model, ids, 8)


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU")
def test_a_failed_background_compile_is_raised_once_and_generation_goes_on_uncompiled():
    gen, ids, expected = failing_compile_in_background()
    assert torch.equal(gen.generate(ids, 8), expected)
    with pytest.raises(RuntimeError, match="compiling the decode step in the background failed; the Generator goes on uncompiled") as raised:
        gen.wait_for_compile()
    assert "no compiler here" in repr(raised.value.__cause__)
    assert not gen.compiled
    assert torch.equal(gen.generate(ids, 8), expected)
    gen.wait_for_compile()  # nothing runs: returns at once


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU")
def test_a_failed_background_compile_that_a_generation_takes_is_a_warning_and_the_generation_serves():
    gen, ids, expected = failing_compile_in_background()
    gen.generate(ids, 8)
    gen._lifecycle.running.work.error()  # the compile has ended
    with pytest.warns(UserWarning, match="compiling the decode step in the background failed.*no compiler here") as caught:
        assert torch.equal(gen.generate(ids, 8), expected)
    assert caught[0].filename == __file__  # the line that called generate(), not breakgraph's
    assert not gen.compiled and not gen.compiling


def held_compile_in_background():
    """A Generator whose background compile holds until ``release`` is set (``started`` once it began)."""
    started, release = threading.Event(), threading.Event()

    def held_backend(graph, example_inputs):
        started.set()
        release.wait(timeout=60)
        return graph.forward

    model = small(LlamaForCausalLM, LlamaConfig)
    gen = generator(model, compile={"backend": held_backend}, max_batch_size=2, compile_in_background=True)
    return gen, started, release


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU")
def test_a_step_or_size_not_captured_yet_decodes_eagerly_beside_the_background_compile_and_capture_waits_for_it():
    gen, started, release = held_compile_in_background()
    ids = torch.randint(0, 300, (2, 6))
    greedy = gen.generate(ids, 4)  # the greedy step; the compile starts as it returns
    assert started.wait(timeout=60)
    # A step, or a batch size, to capture: CUDA would refuse its capture beside the compile, so it decodes eagerly.
    assert torch.equal(gen.generate(ids, 4, do_sample=True, top_k=1), greedy)
    assert torch.equal(gen.generate(ids[:1], 4), greedy[:1])
    assert not release.is_set() and gen.compiling and not gen.compiled
    threading.Timer(0.5, release.set).start()
    gen.capture(sampling=True)  # waits for the compile, takes it, and captures compiled
    assert release.is_set() and gen.compiled and not gen.compiling


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU")
def test_capture_takes_a_running_compile_also_where_every_size_is_captured_already():
    gen, started, release = held_compile_in_background()
    gen.capture()  # every greedy size, uncompiled: the compile is due
    gen.generate(torch.randint(0, 300, (2, 6)), 2)  # the compile starts as it returns
    assert started.wait(timeout=60)
    threading.Timer(0.5, release.set).start()
    gen.capture()  # nothing left to capture: it waits for the compile all the same, and takes it
    assert release.is_set() and gen.compiled and not gen.compiling


class Traced(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x).relu()


def in_thread(work) -> threading.Thread:
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def still_waits(thread: threading.Thread) -> bool:
    thread.join(timeout=0.3)
    return thread.is_alive()


def ends(thread: threading.Thread) -> bool:
    thread.join(timeout=10)
    return not thread.is_alive()


def wait_until(condition) -> None:
    deadline = time.perf_counter() + 10
    while not condition():
        assert time.perf_counter() < deadline, "the other thread never got there"
        time.sleep(0.01)


def forward_until(turns: tracing.Turns, name: str, order: list, done: threading.Event | None = None):
    def forward():
        with turns.forward():
            order.append(name)
            if done is not None:
                done.wait(timeout=60)

    return forward


def compiling_in_background_with(backend, started: threading.Event):
    """A Generator whose first generate() started a background compile with ``backend``, which
    sets ``started``; its prompts, and transformers' tokens for them."""
    model = small(LlamaForCausalLM, LlamaConfig)
    gen = generator(model, compile={"backend": backend}, max_batch_size=2, compile_in_background=True)
    ids = torch.randint(0, 300, (2, 6))
    expected = transformers_eager_generate(model, ids, 3)
    assert torch.equal(gen.generate(ids, 3), expected)  # the compile starts as it returns
    assert started.wait(timeout=60)
    return gen, ids, expected


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU")
def test_the_serving_thread_runs_its_model_between_the_background_compiles_fx_traces():
    """torch.fx patches torch.nn.Module.__call__ for the whole process while it traces: a prefill on the
    serving thread meanwhile went into the trace (NameError: module is not installed as a submodule)."""
    started = threading.Event()

    def tracing_backend(graph, example_inputs):
        started.set()
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:
            torch.fx.symbolic_trace(Traced())
        return graph.forward

    gen, ids, expected = compiling_in_background_with(tracing_backend, started)
    for _ in range(10):  # while the compile traces, again and again
        assert torch.equal(gen.generate(ids, 3), expected)
    gen.wait_for_compile()
    assert not traces_wait_for_their_turn()  # once no compile runs


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU")
def test_a_trace_that_waits_too_long_for_its_turn_fails_the_compile_and_serving_goes_on(monkeypatch):
    """An eager forward that runs torch.compile'd code holds the turn while it waits for Dynamo's
    compile lock, which the background compile holds while it traces: the trace gives up."""
    monkeypatch.setattr(tracing, "TURN_WAIT_S", 0.2)
    started, go, done, order = threading.Event(), threading.Event(), threading.Event(), []

    def tracing_backend(graph, example_inputs):
        started.set()
        go.wait(timeout=60)
        torch.fx.symbolic_trace(Traced())
        return graph.forward

    gen, ids, expected = compiling_in_background_with(tracing_backend, started)
    holder = in_thread(forward_until(tracing.turns, "holder", order, done))  # the forward that waits on the compile
    wait_until(lambda: order == ["holder"])
    go.set()  # the compile traces now, while the turn is held
    try:
        with pytest.raises(RuntimeError, match="compiling the decode step in the background failed") as raised:
            gen.wait_for_compile()
        assert "waited 0.2 s for a Generator's eager forward while a compile runs" in str(raised.value.__cause__)
    finally:
        done.set()
        holder.join()
    assert torch.equal(gen.generate(ids, 3), expected) and not gen.compiled


def traces_wait_for_their_turn() -> bool:
    """Whether a torch.fx trace waits while another thread runs a forward."""
    order, done = [], threading.Event()
    holder = in_thread(forward_until(tracing.turns, "holder", order, done))
    wait_until(lambda: order == ["holder"])
    tracer = in_thread(lambda: torch.fx.symbolic_trace(Traced()))
    tracer.join(timeout=2)
    waited = tracer.is_alive()
    done.set()
    holder.join()
    tracer.join()
    return waited


def test_traces_take_turns_while_any_background_compile_runs_and_torch_dynamo_keeps_its_wrapper():
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))  # Dynamo has wrapped Tracer.trace
    wrapped_by_dynamo = torch.fx.Tracer.trace
    with tracing.traces_take_turns():
        with tracing.traces_take_turns():  # a second Generator's compile
            assert traces_wait_for_their_turn()
        assert traces_wait_for_their_turn()  # the first still runs
    assert not traces_wait_for_their_turn()
    assert torch.fx.Tracer.trace is wrapped_by_dynamo


def test_forwards_run_side_by_side_and_a_trace_goes_alone_before_the_forwards_that_come_after_it():
    turns, order, done = tracing.Turns(), [], threading.Event()
    first = in_thread(forward_until(turns, "first", order, done))
    wait_until(lambda: order == ["first"])
    assert ends(in_thread(forward_until(turns, "beside", order)))  # forwards do not wait for each other
    assert not turns.begin_trace(0.2)  # a trace waits for the forwards under way

    def trace():
        assert turns.begin_trace(60)
        order.append("trace")
        turns.end_trace()

    tracer = in_thread(trace)
    wait_until(lambda: turns._traces_waiting == 1)
    late = in_thread(forward_until(turns, "late", order))
    assert still_waits(late) and order == ["first", "beside"]  # behind the trace that waits
    done.set()
    assert all(map(ends, (first, tracer, late)))
    assert order == ["first", "beside", "trace", "late"]


def test_while_a_compile_runs_forwards_go_one_thread_at_a_time_and_each_may_trace_inside_itself():
    turns, order, traced, done = tracing.Turns(), [], [], threading.Event()
    turns.count_compile(+1)

    def forward_that_traces():
        with turns.forward():
            order.append("first")
            done.wait(timeout=60)
            traced.append(turns.begin_trace(0.2))  # no other thread's forward is under way: at once
            turns.end_trace()

    first = in_thread(forward_that_traces)
    wait_until(lambda: order == ["first"])
    second = in_thread(forward_until(turns, "second", order))
    assert still_waits(second)
    done.set()
    assert ends(first) and ends(second)
    assert traced == [True] and order == ["first", "second"]
    turns.count_compile(-1)


def test_a_trace_that_runs_out_of_time_lets_the_forwards_behind_it_go():
    turns, order, done = tracing.Turns(), [], threading.Event()
    holder = in_thread(forward_until(turns, "holder", order, done))
    wait_until(lambda: order == ["holder"])
    tracer = in_thread(lambda: turns.begin_trace(0.5))
    wait_until(lambda: turns._traces_waiting == 1)
    behind = in_thread(forward_until(turns, "behind", order))
    assert ends(tracer) and ends(behind)  # while the holder still runs
    assert order == ["holder", "behind"]
    done.set()
    assert ends(holder)


def test_a_nested_trace_that_ends_leaves_the_outer_one_alone():
    turns, order, inner_ended, finish = tracing.Turns(), [], threading.Event(), threading.Event()

    def nested_traces():
        assert turns.begin_trace(1) and turns.begin_trace(1)  # as Inductor's passes trace inside a trace
        turns.end_trace()
        inner_ended.set()
        finish.wait(timeout=60)
        turns.end_trace()

    tracer = in_thread(nested_traces)
    inner_ended.wait(timeout=10)
    forward = in_thread(forward_until(turns, "forward", order))
    assert still_waits(forward)
    finish.set()
    assert ends(tracer) and ends(forward) and order == ["forward"]


def test_a_thread_traces_inside_its_own_forward_and_runs_a_forward_inside_its_own_trace():
    turns, went = tracing.Turns(), []

    def trace_in_forward():
        with turns.forward():
            went.append(turns.begin_trace(0.2))
            with turns.forward():
                went.append(turns.begin_trace(0.2))
                turns.end_trace()
            turns.end_trace()

    assert ends(in_thread(trace_in_forward)) and went == [True, True]
    assert turns.begin_trace(0.2)  # nothing is left held
    turns.end_trace()


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU")
def test_draws_made_while_a_background_compile_runs_are_not_drawn_again_after_it():
    """Dynamo sets the default generator back to its state at a compile's start as the compile ends."""
    gen, started, release = held_compile_in_background()
    ids = torch.randint(0, 300, (2, 6))
    gen.generate(ids, 2, do_sample=True)  # captures the sampling step; the compile starts as it returns
    assert started.wait(timeout=60)
    during = gen.generate(ids, 12, do_sample=True, temperature=2.0)
    release.set()
    gen.wait_for_compile()
    after = gen.generate(ids, 12, do_sample=True, temperature=2.0)
    assert not torch.equal(during, after)  # the same prompts from the same generator state would draw the same tokens
    torch.manual_seed(5)
    seeded = gen.generate(ids, 12, do_sample=True, temperature=2.0)
    torch.manual_seed(5)
    assert torch.equal(gen.generate(ids, 12, do_sample=True, temperature=2.0), seeded)  # the default generator decides again


def test_compile_in_background_needs_a_compile():
    with pytest.raises(ValueError, match="compile_in_background=True compiles the decode step: give compile=True"):
        generator(small(LlamaForCausalLM, LlamaConfig), compile=False, compile_in_background=True)
    with pytest.raises(TypeError, match="compile_in_background"):
        generator(small(LlamaForCausalLM, LlamaConfig), compile_in_background="yes")


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU")
def test_a_first_call_that_no_size_serves_still_compiles_ahead_before_it_runs():
    model = small(LlamaForCausalLM, LlamaConfig)
    gen = generator(model, capture_sizes=[1], max_batch_size=2)
    ids = torch.randint(0, 300, (2, 6))
    tokens = gen.generate(ids, 3)  # two rows: above every size, so decoded eagerly
    assert gen._lifecycle.phase is CompilePhase.SERVING and gen.compiled and not gen._lifecycle.captured
    assert torch.equal(tokens, generator(model, compile=False, capture_sizes=[1], max_batch_size=2).generate(ids, 3))


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU")
def test_a_background_compile_is_due_after_a_first_call_that_no_size_serves():
    model = small(LlamaForCausalLM, LlamaConfig)
    gen = generator(model, capture_sizes=[1], max_batch_size=2, compile_in_background=True)
    ids = torch.randint(0, 300, (2, 6))
    expected = transformers_eager_generate(model, ids, 3)
    assert torch.equal(gen.generate(ids, 3), expected)  # two rows: above every size, so decoded eagerly
    assert gen.compiling and not gen._lifecycle.captured  # started as the call returned, with nothing captured first
    gen.wait_for_compile()
    assert gen.compiled and gen._lifecycle.phase is CompilePhase.SERVING
    assert torch.equal(gen.generate(ids, 3), expected)  # the compiled forward serves the eager calls


@pytest.mark.filterwarnings("ignore:breakgraph. no CUDA GPU")
def test_the_compile_moves_through_its_phases_by_its_transitions_only():
    model = small(LlamaForCausalLM, LlamaConfig)
    ids = torch.randint(0, 300, (2, 6))
    uncompiled = generator(model, compile=False, max_batch_size=2)
    assert uncompiled._lifecycle.phase is CompilePhase.UNCOMPILED and not uncompiled.compiled
    assert uncompiled.wait_for_compile()._lifecycle.phase is CompilePhase.UNCOMPILED  # nothing to wait for
    ahead = generator(model, max_batch_size=2)
    assert ahead._lifecycle.phase is CompilePhase.AHEAD and ahead.compiled and not ahead.compiling
    ahead.capture()
    assert ahead._lifecycle.phase is CompilePhase.SERVING and ahead._lifecycle.captured == {GREEDY}

    gen, started, release = held_compile_in_background()
    lifecycle = gen._lifecycle
    assert lifecycle.phase is CompilePhase.WAITING and not gen.compiled and not gen.compiling
    with pytest.raises(RuntimeError, match=r"cannot go from 'waiting for the first capture' to 'compiling'.*generate\(\), capture\(\)"):
        lifecycle.start()  # nothing is captured, so no compile is due
    assert lifecycle.phase is CompilePhase.WAITING and lifecycle.running is None  # a refused move changes nothing
    gen.capture(sampling=True)  # the first capture: uncompiled
    assert lifecycle.phase is CompilePhase.DUE and gen.compiling and lifecycle.captured == set(SAMPLING_VARIANTS)
    with pytest.raises(RuntimeError, match=r"no background compile runs to take \(.*'compile due'\): call the Generator's wait_for_compile"):
        lifecycle.take()
    gen.generate(ids, 2)  # captures the greedy step, still uncompiled; the compile starts as it returns
    assert lifecycle.phase is CompilePhase.RUNNING and lifecycle.running is not None and not gen.compiled
    assert started.wait(timeout=60)
    release.set()
    gen.wait_for_compile()
    assert lifecycle.phase is CompilePhase.SERVING and gen.compiled and not gen.compiling and lifecycle.running is None
    assert lifecycle.captured == {GREEDY, *SAMPLING_VARIANTS}
    with pytest.raises(RuntimeError, match="cannot go from 'compiled' to 'compiling'"):
        lifecycle.start()

    failed, ids, expected = failing_compile_in_background()
    failed.generate(ids, 8)
    assert failed._lifecycle.phase is CompilePhase.RUNNING
    with pytest.warns(UserWarning, match="compiling the decode step in the background failed"):
        failed.capture(sampling=True)  # a step to capture waits for the compile, and takes it
    assert failed._lifecycle.phase is CompilePhase.FAILED and failed._lifecycle.compile is None and not failed.compiled
    assert torch.equal(failed.generate(ids, 8, do_sample=True, top_k=1), expected)
