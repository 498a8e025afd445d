"""An embed engine's vector as a caller asked for it: cut to `dimensions` (Matryoshka,
where the model declares it: `PoolingConfig.check_dimensions`) and then L2-normalised
again when the model normalises, as OpenAI's `dimensions` does. The server's
/v1/embeddings and the offline `LLM.embed` both go through here."""

import math

from pagefleet_serve.config import PoolingConfig


def shape_embedding(
    vector: list[float], pooling: PoolingConfig, dimensions: int | None
) -> list[float]:
    """`vector` (the engine's, whole) cut to `dimensions` (None: kept whole), renormalised
    when the model normalises; check `dimensions` first (`check_dimensions`)."""
    if dimensions is None or dimensions == len(vector):
        return vector
    cut = vector[:dimensions]
    if not pooling.normalize:
        return cut
    norm = math.sqrt(math.fsum(x * x for x in cut))
    return [x / norm for x in cut] if norm > 0 else cut
