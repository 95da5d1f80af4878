"""The benchmark decoder's capturable attention equals its eager attention, row by row, inside a graph."""

import pytest
import torch



@pytest.mark.parametrize("batch", [1, 3, 8])
def test_split_k_decode_matches_eager_attention_at_each_rows_position(batch):
    pytest.importorskip("triton")
    from benchmarks.decode_attention import split_k_decode
    from benchmarks.decoder import AttentionMetadata, attention

    heads, kv_heads, head_dim, capacity = 16, 4, 128, 1024
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k_cache, v_cache = (torch.randn(batch, capacity, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    positions = torch.zeros(batch, device="cuda", dtype=torch.long)
    args = (q, k, v, k_cache, v_cache, positions)
    split_k_decode(*args)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = split_k_decode(*args)
    for trial in range(3):  # fresh inputs and positions each time: one graph serves every step
        chosen = torch.randperm(capacity)[:batch]
        chosen[0] = (0, capacity - 1, 517)[trial]  # the first and last slot, and one inside a chunk
        positions.copy_(chosen)
        for tensor in (q, k, v, k_cache, v_cache):
            tensor.copy_(torch.randn_like(tensor))
        expected_k, expected_v = k_cache.clone(), v_cache.clone()
        expected = torch.cat(
            [
                attention(q[r : r + 1], k[r : r + 1], v[r : r + 1], expected_k[r : r + 1], expected_v[r : r + 1],
                          AttentionMetadata(int(chosen[r])))
                for r in range(batch)
            ]
        )
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)  # this step's k, v written
