"""The bindings layer on a GPU: capture, instantiate, upload, launch, exec update, destroy."""

import pytest
import torch
from cuda.bindings import runtime as cudart

import breakgraph_bindings as bindings

DEV = "cuda"


def _capture(stream, fn) -> bindings.Graph:
    with torch.cuda.stream(stream):
        bindings.begin_capture(stream)
        try:
            fn()
        finally:
            graph = bindings.end_capture(stream)
    return graph


def test_capture_instantiate_upload_launch_and_update():
    stream = torch.cuda.Stream()
    x, y = torch.randn(4096, device=DEV), torch.empty(4096, device=DEV)
    torch.cuda.synchronize()
    doubled = _capture(stream, lambda: torch.mul(x, 2.0, out=y))
    tripled = _capture(stream, lambda: torch.mul(x, 3.0, out=y))
    assert doubled.num_nodes == tripled.num_nodes >= 1
    executable = doubled.instantiate()
    executable.upload(stream)
    y.fill_(float("nan"))
    torch.cuda.synchronize()
    executable.launch(stream)
    bindings.synchronize(stream)
    torch.testing.assert_close(y, x * 2)
    executable.update(tripled)  # same topology, new scalar: the executable now triples
    executable.launch(stream)
    bindings.synchronize(stream)
    torch.testing.assert_close(y, x * 3)
    executable.destroy()
    executable.destroy()  # a second destroy does nothing
    doubled.destroy()
    assert not executable.alive and not doubled.alive


def test_an_update_across_topologies_is_refused_with_cuda_s_reason_and_the_executable_can_be_updated_back():
    stream = torch.cuda.Stream()
    x, y = torch.randn(4096, device=DEV), torch.empty(4096, device=DEV)
    torch.cuda.synchronize()
    doubled = _capture(stream, lambda: torch.mul(x, 2.0, out=y))
    two_steps = _capture(stream, lambda: (torch.mul(x, 2.0, out=y), y.add_(1.0)))
    executable = doubled.instantiate()
    with pytest.raises(bindings.GraphUpdateRefused) as refused:
        executable.update(two_steps)
    assert refused.value.reason in ("ErrorTopologyChanged", "cudaErrorGraphExecUpdateFailure")
    assert str(refused.value).startswith("cudaGraphExecUpdate: cudaErrorGraphExecUpdateFailure")
    # handled, so not left for the next library that checks CUDA's last error (torch's next kernel)
    assert cudart.cudaPeekAtLastError()[0] == cudart.cudaError_t.cudaSuccess
    executable.update(doubled)
    y.fill_(float("nan"))
    torch.cuda.synchronize()  # the poison lands before the launch on the other stream
    executable.launch(stream)
    bindings.synchronize(stream)
    torch.testing.assert_close(y, x * 2)


def test_free_device_memory_sees_allocations_and_graph_memory_nodes_hold_nothing():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = bindings.free_device_memory()
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEV)
    assert before - bindings.free_device_memory() >= 256 * 2**20
    del block
    torch.cuda.empty_cache()
    assert bindings.free_device_memory() >= before - 4 * 2**20
    device = torch.cuda.current_device()
    bindings.trim_graph_memory(device)
    assert bindings.graph_allocation_bytes(device) == 0  # torch's allocator makes no graph memory nodes


def test_capture_status_and_info_follow_the_capture():
    stream = torch.cuda.Stream()
    x = torch.zeros(16, device=DEV)
    torch.cuda.synchronize()
    assert bindings.capture_status(stream) is bindings.CaptureStatus.NONE
    assert bindings.capture_info(stream).status is bindings.CaptureStatus.NONE
    with torch.cuda.stream(stream):
        bindings.begin_capture(stream, "thread_local")
        first = bindings.capture_info(stream)
        x.add_(1)
        after_add = bindings.capture_info(stream)
        assert bindings.capture_status(stream) is bindings.CaptureStatus.ACTIVE
        graph = bindings.end_capture(stream)
    assert first.status is bindings.CaptureStatus.ACTIVE and first.capture_id > 0
    assert first.dependencies == () and len(after_add.dependencies) == 1
    assert after_add.capture_id == first.capture_id
    assert graph.num_nodes == 1
    assert bindings.capture_status(stream) is bindings.CaptureStatus.NONE


def test_exchange_capture_mode_returns_the_previous_mode():
    previous = bindings.exchange_capture_mode("relaxed")
    try:
        assert bindings.exchange_capture_mode("relaxed") is bindings.CaptureMode.RELAXED
    finally:
        bindings.exchange_capture_mode(previous)


def test_ending_a_stream_that_is_not_capturing_raises_a_named_error():
    stream = torch.cuda.Stream()
    with pytest.raises(bindings.CudaError) as info:
        bindings.end_capture(stream)
    assert info.value.name.startswith("cudaError") and "cudaStreamEndCapture" in str(info.value)
    bindings.clear_last_error()


def test_a_prepended_graph_runs_first_in_the_same_launch():
    stream = torch.cuda.Stream()
    x = torch.randn(4096, device=DEV)
    y = torch.empty_like(x)
    torch.cuda.synchronize()
    front = _capture(stream, lambda: torch.add(x, 1.0, out=y))
    back = _capture(stream, lambda: (y.mul_(2.0), y.sub_(x)))
    nodes = back.num_nodes
    back.prepend(front)
    assert back.num_nodes == nodes + 1 and len(back.root_nodes()) == 1  # the copy of front, ahead of the rest
    front.destroy()  # back holds its own copy
    executable = back.instantiate()
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        y.fill_(float("nan"))
        torch.cuda.synchronize()
        executable.launch(stream)
        bindings.synchronize(stream)
        torch.testing.assert_close(y, (x + 1) * 2 - x)


def test_a_graph_cuda_refuses_as_a_child_is_not_prepended_and_leaves_the_graph_as_it_was():
    from cuda.bindings import runtime as cudart

    stream = torch.cuda.Stream()
    x = torch.randn(4096, device=DEV)
    torch.cuda.synchronize()

    def allocates():  # stream-ordered allocation: an allocation node and a free node
        err, pointer = cudart.cudaMallocAsync(1 << 20, stream.cuda_stream)
        assert err == cudart.cudaError_t.cudaSuccess
        cudart.cudaFreeAsync(pointer, stream.cuda_stream)

    front = _capture(stream, allocates)
    back = _capture(stream, lambda: x.mul_(2.0))
    nodes = back.num_nodes
    with pytest.raises(bindings.CudaError, match="cudaGraphAddChildGraphNode"):
        back.prepend(front)
    assert back.num_nodes == nodes
    expected = x * 2
    executable = back.instantiate()
    executable.launch(stream)
    bindings.synchronize(stream)
    torch.testing.assert_close(x, expected)
