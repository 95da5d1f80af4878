"""K tokens per launch with ``bg.while_loop`` against one launch per token: the ``tokens``
part of ``benchmarks.conditional``.

Greedy decoding with two models. The host-bound one is an embedding, one MLP block
and a head tied to the embedding: a handful of kernels a token, less GPU time than
the host spends between two launches. The decoder's full mode (attention reading
positions on the device, some 30 dependent kernels a layer) with an embedding and a
tied head is GPU-bound. One launch per token, the host reading after each whether
every row has produced the end token, against ``bg.while_loop`` decoding up to K
tokens in one launch and stopping on the device. Both give the same tokens, checked
with an end token the rows reach and with one they never do (timed).
"""

from __future__ import annotations

import functools

import torch

import breakgraph as bg
from benchmarks.attention import AttentionMetadata, attention_from_positions
from benchmarks.common import synchronized, time_alternated, verdict
from benchmarks.decoder import Decoder, DecoderConfig

PER_TOKEN, PER_LAUNCH = "one launch per token", "while_loop, K tokens per launch"
LAUNCHES_ONLY = "one launch per token, no host read"
TARGET = 1.2
TARGET_MODEL = "host-bound MLP 256"
VOCAB = 2048


class Greedy:
    """What both models share: the first token of every row, and the end token (-1, which
    no row produces, until a check sets one)."""

    def __init__(self, batch: int, hidden: int, dtype: torch.dtype):
        generator = torch.Generator(device="cuda").manual_seed(1)
        self.embed = (torch.randn(VOCAB, hidden, device="cuda", generator=generator) * 0.5).to(dtype)
        self.first = torch.randint(0, VOCAB, (batch,), device="cuda", generator=generator)
        self.end_token = torch.full((), -1, dtype=torch.long, device="cuda")
        self.generator = generator

    def next_tokens(self, tokens: torch.Tensor, finished: torch.Tensor) -> torch.Tensor:
        """The next token of every row; the end token again for rows that have finished."""
        chosen = (self.hidden(self.embed[tokens]) @ self.embed.T).argmax(-1)
        return torch.where(finished, self.end_token, chosen)

    def reset(self):
        """Back to the first token's state."""


class TokenMLP(Greedy):
    """Host-bound: one MLP block between the embedding and the tied head."""

    def __init__(self, batch: int, hidden: int = 256):
        super().__init__(batch, hidden, torch.bfloat16)
        scale = hidden**-0.5
        self.up = (torch.randn(hidden, 4 * hidden, device="cuda", generator=self.generator) * scale).bfloat16()
        self.down = (torch.randn(4 * hidden, hidden, device="cuda", generator=self.generator) * scale / 2).bfloat16()

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(x @ self.up) @ self.down


class TokenDecoder(Greedy):
    """GPU-bound: the decoder step with attention reading each row's position on the device."""

    def __init__(self, batch: int, config: DecoderConfig, start: int = 16):
        super().__init__(batch, config.hidden, config.dtype)
        self.decoder = Decoder(config, max_batch=batch)
        self.start = start
        self.positions = torch.full((batch,), start, dtype=torch.long, device="cuda")
        self.meta = AttentionMetadata(start, self.positions)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The decoder step; advances every row's position."""
        out = self.decoder.step(x, self.positions, self.meta, attend=attention_from_positions)
        self.positions.add_(1)
        return out

    def reset(self):
        self.positions.fill_(self.start)


class PerToken:
    """One launch per token; the host reads whether every row has finished after each."""

    def __init__(self, model: Greedy):
        self.model = m = model
        self.tokens, self.finished = m.first.clone(), torch.zeros_like(m.first, dtype=torch.bool)

        def one(tokens, finished):
            nxt = m.next_tokens(tokens, finished)
            tokens.copy_(nxt)
            finished.logical_or_(nxt == m.end_token)
            return finished.all()

        with torch.no_grad():
            self.step = bg.graphed(one, self.tokens, self.finished, warmup=1)
        m.reset()

    def run(self, limit: int) -> torch.Tensor:
        m = self.model
        m.reset()
        self.tokens.copy_(m.first)
        self.finished.zero_()
        out = []
        for _ in range(limit):
            done = self.step()
            out.append(self.tokens.clone())
            if done.item():
                break
        return torch.stack(out, 1)

    def launches_only(self, limit: int) -> None:
        """``limit`` launches with no read between them: the GPU's share of ``run``, whose
        difference to it is the host's round trip."""
        self.model.reset()
        self.tokens.copy_(self.model.first)
        self.finished.zero_()
        for _ in range(limit):
            self.step()


class PerLaunch:
    """Up to ``limit`` tokens in one launch: ``bg.while_loop`` stops on the device when the
    limit is reached or every row has finished. The body updates the loop's own carried
    tensors in place and returns them, so no copy is added to each pass."""

    def __init__(self, model: Greedy, limit: int):
        self.model = m = model
        batch = m.first.shape[0]
        self.tokens = m.first.clone()
        self.out = torch.zeros(batch, limit, dtype=torch.long, device="cuda")

        def loop(tokens):
            def go_on(count, tokens, finished):
                return (count < limit) & ~finished.all()

            def body(count, tokens, finished):
                nxt = m.next_tokens(tokens, finished)
                self.out.index_copy_(1, count.view(1), nxt.view(-1, 1))
                tokens.copy_(nxt)
                return count.add_(1), tokens, finished.logical_or_(nxt == m.end_token)

            start = (torch.zeros((), dtype=torch.long, device="cuda"), tokens, torch.zeros_like(tokens, dtype=torch.bool))
            return bg.while_loop(go_on, body, start)[0]

        with torch.no_grad():
            self.step = bg.graphed(loop, self.tokens, warmup=1)
        m.reset()

    def run(self) -> torch.Tensor:
        m = self.model
        m.reset()
        self.tokens.copy_(m.first)
        count = int(self.step())
        return self.out[:, :count].clone()


def token_rows(quick: bool) -> list[dict]:
    """Per token and per launch side by side, for each model, batch 1 and 8, K = 1, 4, 16."""
    small = DecoderConfig(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512, kv_capacity=1024)
    models = {TARGET_MODEL: TokenMLP, "decoder 2x256": functools.partial(TokenDecoder, config=small)}
    if not quick:
        models["decoder 16x2048"] = functools.partial(TokenDecoder, config=DecoderConfig())
    rows = [counting_loop(quick)]
    for name, make in models.items():
        for batch in (1, 8):
            model = make(batch)
            per_token = PerToken(model)
            for limit in (1, 4, 16):
                per_launch = PerLaunch(model, limit)
                label = f"{name}, batch {batch}, K={limit}"
                check_same_tokens(model, per_token, per_launch, limit, label)
                runs = {
                    PER_TOKEN: functools.partial(per_token.run, limit),
                    PER_LAUNCH: per_launch.run,
                    LAUNCHES_ONLY: functools.partial(per_token.launches_only, limit),
                }
                us = time_alternated({key: synchronized(run) for key, run in runs.items()}, 20 if quick else 400)
                for key, value in us.items():
                    rows.append(
                        {"part": "tokens", "shape": label, "variant": key, "us": round(value / limit, 1),
                         "check": f"{batch * limit / value * 1e6:,.0f} tokens/s"}
                    )
                speedup = us[PER_TOKEN] / us[PER_LAUNCH]
                target = ""
                if name == TARGET_MODEL and batch == 1 and limit > 1:
                    target = f" (target >= {TARGET} at batch 1 on the host-bound model: {verdict(speedup, TARGET, False)})"
                round_trip = (us[PER_TOKEN] - us[LAUNCHES_ONLY]) / limit
                rows.append(
                    {"part": "tokens", "shape": label, "variant": "ratios",
                     "us": f"while_loop tokens/s over per token {speedup:.2f}x{target}; the host's round trip {round_trip:.1f} us a token"}
                )
                del per_launch
            del per_token, model
    return rows


def counting_loop(quick: bool, passes: int = 16) -> dict:
    """The floor of a pass: a ``while_loop`` whose body only counts (an add, the copy back,
    the compare and the kernel that sets the handle)."""

    def count(start):
        return bg.while_loop(lambda c: c < passes, lambda c: (c + 1,), (start,))[0]

    loop = bg.graphed(count, torch.zeros((), dtype=torch.long, device="cuda"), warmup=1)
    assert int(loop()) == passes
    us = time_alternated({"loop": synchronized(loop)}, 20 if quick else 400)["loop"]
    return {"part": "tokens", "shape": f"a loop that only counts, {passes} passes", "variant": "µs a pass", "us": round(us / passes, 1), "check": f"{passes} passes"}


def check_same_tokens(model: Greedy, per_token: PerToken, per_launch: PerLaunch, limit: int, label: str) -> None:
    """Both paths give the same tokens: with an end token no row produces, and with one the
    first row produces halfway, where both must stop at the same token."""
    reference = per_token.run(limit)
    assert torch.equal(per_launch.run(), reference), f"{label}: tokens differ"
    if limit > 2:
        model.end_token.fill_(int(reference[0, limit // 2]))
        stopped = per_token.run(limit)
        assert torch.equal(per_launch.run(), stopped), f"{label}: tokens differ when rows stop"
        assert stopped.shape[1] <= limit // 2 + 1 or model.first.shape[0] > 1, f"{label}: did not stop at the end token"
        model.end_token.fill_(-1)
