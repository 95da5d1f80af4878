"""The break's attention runs scaled dot-product attention without cuDNN, and leaves the user's setting as it was."""

import threading

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers extra is not installed (pip install -e '.[transformers]')")

from breakgraph import hf

pytestmark = [pytest.mark.filterwarnings("error::FutureWarning"), pytest.mark.filterwarnings("error::DeprecationWarning")]


@pytest.fixture
def cudnn_seen(monkeypatch):
    """The cuDNN attention flag as each scaled_dot_product_attention call finds it; the user's
    setting is put back afterwards whatever the test did to it."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield seen
    torch.backends.cuda.enable_cudnn_sdp(before)


def decode_inputs(rows: int = 3):
    lengths = hf.RowLengths()
    lengths.set([5, 18, 40][:rows])
    positions = torch.tensor([4, 17, 39][:rows])
    return torch.randn(rows, 8, 1, 16), torch.randn(rows, 2, 40, 16), torch.randn(rows, 2, 40, 16), positions, lengths


@pytest.mark.parametrize("user_setting", [True, False])
@pytest.mark.parametrize("variant", [hf.attend, hf.attend_in_graph], ids=["eager break", "capturable variant"])
def test_attention_runs_without_cudnn_and_the_user_s_setting_stays(cudnn_seen, variant, user_setting):
    torch.backends.cuda.enable_cudnn_sdp(user_setting)
    variant(*decode_inputs(), 0.25)
    assert cudnn_seen == [False]
    assert torch.backends.cuda.cudnn_sdp_enabled() is user_setting


def test_the_prefill_runs_without_cudnn(cudnn_seen):
    torch.backends.cuda.enable_cudnn_sdp(True)
    lengths = hf.RowLengths()
    lengths.set([6, 6])
    query, keys = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 40, 16)
    hf.attend(query, keys, keys, torch.zeros(2, dtype=torch.long), lengths, 0.25)
    assert cudnn_seen == [False] and torch.backends.cuda.cudnn_sdp_enabled()


def test_the_user_s_setting_comes_back_when_attention_raises(monkeypatch):
    def failing(*args, **kwargs):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        raise RuntimeError("attention failed")

    before = torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", failing)
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        with pytest.raises(RuntimeError, match="attention failed"):
            hf.attend(*decode_inputs(), 0.25)
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_threads_attending_at_once_each_run_without_cudnn_and_the_last_restores(cudnn_seen):
    torch.backends.cuda.enable_cudnn_sdp(True)
    inputs = decode_inputs()
    start = threading.Barrier(8)
    failures = []

    def attend_often():
        start.wait()
        try:
            for _ in range(200):
                hf.attend(*inputs, 0.25)
        except Exception as error:  # reported below: an exception in a thread would pass unseen
            failures.append(error)

    threads = [threading.Thread(target=attend_often) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert len(cudnn_seen) == 8 * 200 and not any(cudnn_seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()
