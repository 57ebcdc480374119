"""What an agent's tokens cost: the prices configured for its model, and the cost of one reply.

The cost goes on the reply as ``["llm-cost-usd", …]`` (docs/PROTOCOL.md, "Tags tenexd writes on
an agent reply"); without a configured price there is no cost and no tag.
"""

from __future__ import annotations

from dataclasses import dataclass

PER_MILLION = 1_000_000


@dataclass(frozen=True, slots=True)
class TokenPrices:
    """US dollars per million prompt (input) and completion (output) tokens; None: not priced."""

    input_per_million: float | None = None
    output_per_million: float | None = None

    @classmethod
    def of(cls, input_per_million: float | None, output_per_million: float | None) -> TokenPrices | None:
        """The prices, or None when neither is configured."""
        if input_per_million is None and output_per_million is None:
            return None
        return cls(input_per_million, output_per_million)

    def cost_usd(self, prompt_tokens: int | None, completion_tokens: int | None) -> float | None:
        """What ``prompt_tokens`` in and ``completion_tokens`` out cost; None when a priced side's count
        is unknown (a partial sum would understate the cost) or nothing is priced."""
        total = 0.0
        priced = False
        for price, tokens in (
            (self.input_per_million, prompt_tokens),
            (self.output_per_million, completion_tokens),
        ):
            if price is None:
                continue
            if tokens is None:
                return None
            total += price * tokens / PER_MILLION
            priced = True
        return total if priced else None
