"""A transformers model loaded tensor parallel (``tp_plan="auto"``), served by ``hf.Generator`` on every rank.

A small float32 Llama with random weights (8 heads, 4 key/value heads: whole
heads on each of 2 or 4 ranks), saved by rank 0 into the scratch folder
(``argv[1]``) and loaded by every rank, sharded by transformers. Against
transformers' own tensor-parallel generation, for the Generator in each mode
and compiled:

- greedy tokens equal transformers', for 4 prompts and for 3 left-padded
  rows (each against its own generation), on every rank;
- sampled tokens, each rank's generator seeded differently, the same on every
  rank, and so is each generator's state afterwards;
- a call made differently on one rank raises on every rank, which then go on
  in step;

and a model whose key/value heads do not split among the ranks (one head per
2 ranks) is refused when its Generator is made: transformers loads it (each
rank holds half a head's features) but cannot run it.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from breakgraph import hf
from tests.gpu.ranks._ranks import assert_same_on_every_rank, passed, same_on_every_rank, say, start
from tests.helpers import transformers_eager_generate

VOCAB, PROMPT, NEW, SIZES = 1000, 24, 32, [1, 2, 4]
SHAPE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, head_dim=32)
VARIANTS = {"breakable": dict(mode="breakable"), "full": dict(mode="full"), "breakable + compile": dict(mode="breakable", compile=True)}


def save(path: Path, key_value_heads: int) -> None:
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE, num_key_value_heads=key_value_heads)).save_pretrained(path)


def load(path: Path) -> LlamaForCausalLM:
    """The checkpoint at ``path``, each rank holding its share of the heads and of the MLP."""
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None  # every step asked for
    return model


def main() -> None:
    rank, world = start()
    scratch = Path(sys.argv[1])
    if rank == 0:
        save(scratch / "model", key_value_heads=4)
        save(scratch / "split_heads", key_value_heads=world // 2)
    dist.barrier()
    model = load(scratch / "model")
    assert model.tp_size == world

    ids = same_on_every_rank(torch.randint(0, VOCAB, (4, PROMPT), device="cuda"))
    expected = transformers_eager_generate(model, ids, NEW)  # transformers' tensor-parallel generation; leaves breakgraph's attention
    lengths = [PROMPT, 9, 1]
    mask = torch.zeros(3, PROMPT, dtype=torch.long, device="cuda")
    for row, length in enumerate(lengths):
        mask[row, PROMPT - length :] = 1
    alone = [
        transformers_eager_generate(model, ids[row : row + 1, PROMPT - length :], NEW)[0, length:] for row, length in enumerate(lengths)
    ]
    say(f"transformers' own generation on {world} ranks: {NEW} new tokens for 4 prompts and 3 left-padded rows")

    for variant, options in VARIANTS.items():
        generator = hf.Generator(model, max_length=PROMPT + NEW, max_batch_size=4, capture_sizes=SIZES, progress=False, **options)
        assert generator.cache.layers[0].keys.shape[1] == 4 // world, "the cache holds this rank's key/value heads"
        assert generator.runner.ranks is not None and generator.sampling_runner.ranks is not None

        got = generator.generate(ids, NEW)
        differs = (got != expected).any(dim=0).nonzero()
        assert differs.numel() == 0, f"{variant}: first differing column {int(differs[0]) - PROMPT} of {NEW} new tokens"
        assert sorted(size for _key, size in generator.runner.graphs) == [4], "the first call captures the size it needs"
        padded = generator.generate(ids[:3], NEW, attention_mask=mask)
        for row, length in enumerate(lengths):
            assert torch.equal(padded[row, PROMPT:], alone[row]), f"{variant}: row {row} ({length}-token prompt)"
        assert torch.equal(generator.generate(ids[:1], NEW)[0, PROMPT:], alone[0]), f"{variant}: batch 1, captured on this call"
        assert sorted(size for _key, size in generator.runner.graphs) == [1, 4], generator.runner.graphs
        assert torch.equal(generator.generate(ids, NEW, do_sample=True, top_k=1), expected), f"{variant}: top_k=1 draws the argmax"
        assert generator.compiled == ("compile" in variant)
        say(f"{variant}: greedy tokens equal transformers' (4 prompts; 3 left-padded rows)")

        for top_k in (50, 0):  # the draw among the candidates, and over the whole vocabulary
            draws = torch.Generator("cuda").manual_seed(1000 * rank + top_k)  # each rank its own seed: rank 0's is drawn
            sampled = generator.generate(ids, NEW, do_sample=True, temperature=0.8, top_k=top_k, generator=draws)
            assert_same_on_every_rank(sampled, f"{variant}: tokens sampled with top_k={top_k}")
            assert_same_on_every_rank(draws.get_state().cuda(), f"{variant}: the generator's state after sampling")
        say(f"{variant}: sampled tokens the same on every rank")

        try:
            generator.generate(ids, NEW - rank)
        except ValueError as error:
            assert "the ranks disagree on generate()'s" in str(error), error
        else:
            raise AssertionError(f"{variant}: rank {rank} generated {NEW - rank} tokens where rank 0 asked for {NEW}")
        assert torch.equal(generator.generate(ids, NEW), expected), f"{variant}: the ranks out of step after a refused call"
        say(f"{variant}: a call made differently on one rank raised on every rank, which went on in step")
        generator.runner.release()
        generator.sampling_runner.release()

    split = load(scratch / "split_heads")
    split.set_attn_implementation(hf.ATTENTION)
    try:
        hf.Generator(split, max_length=PROMPT + NEW, max_batch_size=4, capture_sizes=SIZES, progress=False)
    except ValueError as error:
        assert f"do not split evenly among {world} tensor-parallel ranks" in str(error), error
        say(f"refused: {error}")
    else:
        raise AssertionError(f"a Generator was made for {world // 2} key/value heads on {world} ranks")
    passed()


if __name__ == "__main__":
    main()
