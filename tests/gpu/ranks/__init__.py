"""Programs that torchrun starts on every rank (see _ranks.py); launched by tests/gpu/test_tensor_parallel.py."""
