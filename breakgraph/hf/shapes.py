"""Model shapes for trying breakgraph.hf at a real size with random weights, where no model hub can be reached."""

LLAMA_3_2_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192},
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)
"""``LlamaConfig(**LLAMA_3_2_1B)``: Llama-3.2-1B's shape (examples, benchmarks, tests)."""
