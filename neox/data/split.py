"""The train/valid/test split string (no numpy or torch: config validation uses it)."""


def parse_split(split: str) -> list[float]:
    """Weights of train, valid and test from "949,50,1" (or "949/50/1"), normalised to sum to 1."""
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(
            f"split {split!r} must be up to three comma-separated numbers, e.g. '949,50,1'"
        ) from None
    if len(values) > 3:
        raise ValueError(f"split {split!r} has {len(values)} parts; give train,valid,test")
    values += [0.0] * (3 - len(values))
    if any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"split {split!r} must be non-negative numbers that are not all zero")
    total = sum(values)
    return [v / total for v in values]


def split_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """[start, stop) document ranges of train, valid and test, contiguous and in that order.

    deepy.py checks the counts before launch with this same function the data loader cuts by.
    """
    bounds, total = [0], 0.0
    for weight in parse_split(split):
        total += weight
        bounds.append(int(round(total * num_documents)))  # round half to even, as numpy does
    bounds[-1] = num_documents  # rounding of the cumulative sum never drops the last document
    return [(bounds[i], bounds[i + 1]) for i in range(3)]
